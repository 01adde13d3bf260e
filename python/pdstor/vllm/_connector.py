"""PdstorConnector: vLLM's KVConnectorBase_V1 around the two halves (see
the package's docstring)."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import pdstor

from ._context import Context
from ._format import HEADER_BYTES, NO_SCALES, scales_digest
from ._identity import engine_kv, tp_rank
from ._meta import PdstorMetadata
from ._scheduler import SchedulerSide
from ._stats import PdstorPromMetrics, PdstorStats
from ._worker import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pdstor.vllm")


@dataclass(frozen=True)
class Config:
    server: str = "unix:/run/pdstor/control.sock"
    data_socket: str = "/run/pdstor/data.sock"
    writer_id: str = "vllm"
    reader_id: str = "vllm"
    lease_ms: int = 60_000
    admission_timeout_s: float = 30.0
    # How long a decode waits for a named publication to become READY.
    ready_timeout_s: float = 30.0
    # A publication no decode claims this long after READY is released unread
    # (0: kept until released). vLLM's own bound on a prefill's blocks no
    # decode reads (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s).
    unread_release_s: float = 480.0
    staging_bytes: int = 64 << 20
    timeline: str | None = None
    # kv_transfer_config.kv_load_failure_policy == "recompute" (set from it, not a key)
    recompute: bool = False

    @staticmethod
    def from_extra(extra: dict[str, Any]) -> Config:
        known = (set(Config.__dataclass_fields__) - {"recompute"}) | {"model_identity"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"pdstor.vllm: unknown kv_connector_extra_config keys {unknown}; it takes {sorted(known)}")
        fields = {k: v for k, v in extra.items() if k in Config.__dataclass_fields__ and k != "recompute"}
        return Config(**fields)


class PdstorConnector(KVConnectorBase_V1):
    """vLLM's connector for pdstor: the scheduler role decides and owns
    (prepare, publish, claim), the worker role moves and verifies bytes
    (store, adopt, load, ack)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        cfg = Config.from_extra(dict(ktc.kv_connector_extra_config or {}))
        self.cfg = dataclasses.replace(cfg, recompute=getattr(ktc, "kv_load_failure_policy", "fail") == "recompute")
        self.kv = engine_kv(vllm_config, kv_cache_config, dict(ktc.kv_connector_extra_config or {}))
        # A worker's tensor-parallel rank; the scheduler prepares every rank's shard.
        self.rank = tp_rank(vllm_config) if role != KVConnectorRole.SCHEDULER else 0
        self.layout, self.shape = self.kv.layouts[self.rank], self.kv.shape
        self.client = pdstor.Client(self.cfg.server, self.cfg.data_socket)
        try:
            self.client.healthz()
        except pdstor.Error as e:
            raise RuntimeError(
                f"pdstor.vllm: the daemon at {self.cfg.server} does not answer ({e}): start `pdstor serve` "
                "there, or set kv_connector_extra_config.server to its control socket"
            ) from e
        self._check_fit()
        engine_id = str(ktc.engine_id)
        roles = (bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer))
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        half = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        # One node per process: a restarted engine's lines are another node's,
        # each in order (a node's seq restarting would read as lines out of order).
        rank = f"-tp{self.rank}" if half == "worker" and self.kv.tp_size > 1 else ""
        node = f"vllm-{half}{rank}-{engine_id}-{os.getpid()}-{secrets.token_hex(3)}"
        timeline = pdstor.Timeline(self.cfg.timeline, node) if self.cfg.timeline else None
        ctx = Context(
            self.client, self.layout, self.shape, self.cfg, engine_id, timeline, layouts=self.kv.layouts, rank=self.rank
        )
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(ctx, roles)
        else:
            group = kv_cache_config.kv_cache_groups[0]
            self._worker = WorkerSide(ctx, list(group.layer_names), group.kv_cache_spec.dtype)
        self._vllm_config = vllm_config
        log.info(
            "pdstor.vllm: %s role (rank %d of %d) on %s, layout %s",
            role.name,
            self.rank,
            self.kv.tp_size,
            self.cfg.server,
            self.layout,
        )

    def _check_fit(self) -> None:
        """A namespace whose slots cannot hold this engine's chunks fails the
        start, not every request."""
        slot = int(self.client.namespace()["slot_size"])
        s, need = self.shape, self.shape.chunk_bytes
        what = (
            f"this engine's chunks are {need} bytes (a {s.block_tokens}-token block's KV, {s.layers} layers of "
            f"{s.page_bytes} B, and a {HEADER_BYTES}-byte header, padded to 4 KiB)"
        )
        if need > slot:
            raise RuntimeError(
                f"pdstor.vllm: {what}; the namespace at {self.cfg.server} holds {slot} bytes a slot: format it with "
                f"`pdstor format --chunk-slot {need // 1024}K` (or serve this engine with a smaller --block-size)"
            )
        if slot >= 2 * need:
            log.warning(
                "pdstor.vllm: %s; the namespace's slots are %d bytes: %.0f%% of each slot stays unused "
                "(`pdstor format --chunk-slot %dK` fits this model)",
                what,
                slot,
                100 * (slot - need) / slot,
                need // 1024,
            )

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._sched is None:
            raise RuntimeError("pdstor.vllm: a scheduler-role call on the worker-role connector")
        return self._sched

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("pdstor.vllm: a worker-role call on the scheduler-role connector")
        return self._worker

    # -- worker role ----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register(kv_caches, self._scales())

    def _scales(self) -> bytes:
        """The digest of this engine's FP8 KV scales (every layer's K and V
        scale, read from its attention layers): a chunk written with other
        scales is refused at restore."""
        if not self.kv.kv_dtype.startswith("fp8"):
            return NO_SCALES
        context = self._vllm_config.compilation_config.static_forward_context
        values: list[float] = []
        for name in self.worker_side.layer_names:
            layer = context.get(name)
            k, v = getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)
            if k is None or v is None or k.numel() != 1 or v.numel() != 1:
                raise ValueError(
                    f"pdstor.vllm: layer {name}'s {self.kv.kv_dtype} KV scales are not one K and one V scale "
                    f"({None if k is None else tuple(k.shape)}, {None if v is None else tuple(v.shape)}): "
                    "pdstor.vllm hands over per-layer scales only"
                )
            values += [float(k.item()), float(v.item())]
        return scales_digest(values)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdstorMetadata)
        self.worker_side.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a request is scheduled once get_finished
        # reported its restore done, every layer of it.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # The blocks are copied once the step's forward pass is done
        # (wait_for_save), all layers at once, from the registered caches.
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdstorMetadata)
        self.worker_side.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_invalid()

    # -- scheduler role -------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.match(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler_side.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.update_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.finished(request, block_ids)

    # -- vLLM's connector stats (logged, and on the engine's /metrics) ----------

    def get_kv_connector_stats(self) -> PdstorStats | None:
        data = self._worker.ctx.stats.take() if self._worker is not None else self.scheduler_side.stats()
        return PdstorStats(data=dict(data)) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdstorStats:
        return PdstorStats(data=dict(data)) if data else PdstorStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict
    ) -> PdstorPromMetrics:
        return PdstorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()
