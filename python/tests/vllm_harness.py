"""vLLM's real scheduler and a real worker-role connector, with a stand-in
for the model runner: the engine around ``pdstor.vllm.PdstorConnector`` in
its tests, as vLLM's own connector tests build it (their harness needs the
hub; a local tiny-Llama ``config.json`` replaces it: no weights, no
tokenizer).

The stand-in "forward pass" writes, for every token a step computes, the
KV that token would have — a function of the token id, its position, the
layer, the head and the element (:func:`expected_page`) — into the
request's paged blocks; so a restored block can be checked byte for byte
against what the prompt alone says, without pdstor.

An engine's KV cache is what its :class:`Kv` says: dense, MLA or FP8, laid
out in any of vLLM's ``KVCacheLayout`` members (vLLM's own
``create_kv_cache_views`` over one allocation, as its model runner makes
them), and sharded over tensor-parallel ranks — one worker-role connector
per rank, their outputs merged by vLLM's ``KVOutputAggregator``, each rank
holding its own heads."""

from __future__ import annotations

import copy
import json
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

LAYERS = 2
KV_HEADS = 2
HEAD_DIM = 16
EOS = 2
DTYPE = torch.bfloat16
# An MLA layer's latent per token (DeepSeek's is 512 + 64).
MLA_LATENT = 40

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": KV_HEADS * 2 * HEAD_DIM,
    "intermediate_size": 128,
    "num_attention_heads": KV_HEADS * 2,
    "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": LAYERS,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": EOS,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}

_none_hash = False

# The pdstor classes whose methods are daemon round trips (Buffer, Receipt
# and Timeline work locally).
_DAEMON_CLASSES = ("Client.", "Writer.", "Reader.")


class NoDaemonCalls:
    """Records every pdstor Client, Writer or Reader method called on this
    thread while entered (sys.setprofile sees every call into native code):
    the engine's thread must make none once the engine has started."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __enter__(self) -> NoDaemonCalls:
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and getattr(arg, "__qualname__", "").startswith(_DAEMON_CLASSES):
            owner = getattr(arg, "__self__", None)
            # A method of a pdstor object, or a static one (Writer.resume).
            if owner is None or type(owner).__module__ == "pdstor":
                self.calls.append(arg.__qualname__)


def tiny_model(dir: Path, **overrides: Any) -> Path:
    """A tiny Llama's config.json in `dir` (no weights: the scheduler needs none)."""
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    return dir


@dataclass(frozen=True)
class Kv:
    """An engine's KV cache: its kind ("dense", "mla", or an FP8 cache
    dtype), its tensor-parallel size, its physical layout, and (FP8) the
    scale every layer's K and V are quantized with."""

    kind: str = "dense"
    tp: int = 1
    layout: str = "LBHNC"
    scale: float = 1.0

    @property
    def heads(self) -> int:
        """Each rank's KV heads."""
        return 1 if self.kind == "mla" else KV_HEADS // self.tp

    @property
    def content(self) -> int:
        return MLA_LATENT if self.kind == "mla" else 2 * HEAD_DIM

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.kind.startswith("fp8") else DTYPE

    def spec(self, block: int) -> FullAttentionSpec:
        if self.kind == "mla":
            return MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=MLA_LATENT, dtype=DTYPE)
        return FullAttentionSpec(block_size=block, num_kv_heads=self.heads, head_size=HEAD_DIM, dtype=self.dtype)


def engine_config(
    model: Path,
    daemon: Any,
    role: str,
    engine_id: str,
    *,
    block: int = 16,
    batched: int = 64,
    seqs: int = 8,
    policy: str = "fail",
    extra: dict[str, Any] | None = None,
    kv: Kv = Kv(),
) -> VllmConfig:
    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", seed=0)
    sc = SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=batched,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    cc = CacheConfig(block_size=block, enable_prefix_caching=True)
    cc.kv_cache_layout = kv.layout  # resolved by the engine core before connectors are made
    if kv.kind.startswith("fp8"):
        cc.cache_dtype = kv.kind
    ktc = KVTransferConfig(
        kv_connector="PdstorConnector",
        kv_connector_module_path="pdstor.vllm",
        kv_role=role,
        engine_id=engine_id,
        kv_load_failure_policy=policy,
        kv_connector_extra_config={"server": daemon.server, "data_socket": daemon.data_socket, **(extra or {})},
    )
    config = VllmConfig(
        model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=ktc, device_config=DeviceConfig("cpu")
    )
    config.parallel_config.tensor_parallel_size = kv.tp
    return config


def paged_caches(spec: Any, names: list[str], num_blocks: int, layout: str) -> dict[str, torch.Tensor]:
    """Every layer's paged cache as vLLM's model runner makes it: views of
    one allocation in the physical layout `layout`."""
    member = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, len(names), member)
    size = len(names) * num_blocks * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    return dict(zip(names, create_kv_cache_views(raw, spec, num_blocks, member, tensor)))


def expected_page(tokens: list[int], start: int, layer: int, kv: Kv = Kv(), rank: int = 0) -> torch.Tensor:
    """The KV of `tokens` at positions start.. in `layer` of rank `rank`'s
    heads, as [H, n, C]: small integers (exact in bf16, and as FP8 bytes),
    different per token, position, layer, head (the model's, not the
    rank's) and element."""
    n = len(tokens)
    t = torch.tensor(tokens, dtype=torch.int64).view(1, n, 1)
    pos = torch.arange(start, start + n, dtype=torch.int64).view(1, n, 1)
    first = rank * kv.heads
    h = torch.arange(first, first + kv.heads, dtype=torch.int64).view(kv.heads, 1, 1)
    c = torch.arange(kv.content, dtype=torch.int64).view(1, 1, kv.content)
    value = (t * 31 + pos * 7 + layer * 13 + h * 5 + c) % 241
    return value.to(torch.uint8) if kv.dtype == torch.uint8 else (value - 120).to(DTYPE)


def next_token(all_tokens: list[int]) -> int:
    """The stand-in model's sampled token: a function of the sequence so far."""
    return 3 + (sum(all_tokens) * 7 + len(all_tokens)) % 500


@dataclass
class Finished:
    req_id: str
    tokens: list[int]
    reason: Any
    params: dict[str, Any] | None


@dataclass
class Engine:
    """One vLLM engine: its real Scheduler, a real worker-role connector per
    tensor-parallel rank and the paged KV caches each registered; `step()`
    is one engine step."""

    config: VllmConfig
    num_blocks: int
    # The stand-in model's sampler (another makes an engine that computes unlike its peer).
    sample: Callable[[list[int]], int] = next_token
    # Its KV cache (engine_config's `kv`).
    kv: Kv = Kv()
    scheduler: Scheduler = field(init=False)
    # One worker-role connector, and its paged caches, per rank.
    workers: list[Any] = field(init=False)
    caches: list[dict[str, torch.Tensor]] = field(init=False)
    # request id -> tokens [0, n) whose restored KV was checked byte for byte
    restored_checked: dict[str, int] = field(default_factory=dict)
    finished: dict[str, Finished] = field(default_factory=dict)
    generated: dict[str, list[int]] = field(default_factory=dict)
    # request id -> the (chunk, block) pairs its load filled
    fills: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # Loads handed to the worker and not yet checked, by request id.
    loads: dict[str, Any] = field(default_factory=dict)
    # Blocks the worker reported not restored.
    failed_blocks: set[int] = field(default_factory=set)
    # Steps that computed no token (every request waiting for the connector).
    idle_steps: int = 0
    # The connector stats each step's scheduler stats carried (both halves', merged by vLLM).
    connector_stats: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        global _none_hash
        if not _none_hash:
            init_none_hash(sha256)
            _none_hash = True
        block = self.config.cache_config.block_size
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = self.kv.spec(block)
        kcc = KVCacheConfig(
            num_blocks=self.num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
        )
        self.config.cache_config.num_gpu_blocks = self.num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=block,
            log_stats=True,
        )
        self.aggregator = KVOutputAggregator(self.kv.tp)
        self.workers, self.caches = [], []
        for rank in range(self.kv.tp):
            # Each rank's worker process has its own config, its rank set.
            config = copy.deepcopy(self.config)
            config.parallel_config.rank = rank
            context = config.compilation_config.static_forward_context
            for name in names:
                # The attention layers' FP8 scales, as vLLM's model loader leaves them.
                scale = torch.tensor(self.kv.scale, dtype=torch.float32)
                context[name] = types.SimpleNamespace(_k_scale=scale, _v_scale=scale * 2)
            worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
            caches = paged_caches(spec, names, self.num_blocks, self.kv.layout)
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.caches.append(caches)
        self.names = names
        self.block = block

    @property
    def worker(self) -> Any:
        """Rank 0's worker-role connector."""
        return self.workers[0]

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict | None = None) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.block, sha256),
        )
        req.kv_transfer_params = params
        self.scheduler.add_request(req)
        return req

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def blocks_of(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def read_tokens(self, req_id: str, layer: int, start: int, end: int, rank: int = 0) -> torch.Tensor:
        """The paged KV of positions [start, end) of a request in rank
        `rank`'s cache, as [H, n, C]."""
        blocks = self.blocks_of(req_id)
        cache = self.caches[rank][self.names[layer]]
        parts = [cache[blocks[pos // self.block], :, pos % self.block, :] for pos in range(start, end)]
        return torch.stack(parts, dim=1)

    def step(self) -> list[Any]:
        """One engine step, as vLLM's model runner drives the connector; no
        daemon round trip may be made on this thread (asserted)."""
        with NoDaemonCalls() as guard:
            results = self._step()
        assert not guard.calls, f"daemon round trips on the engine's thread: {guard.calls}"
        return results

    def _step(self) -> list[Any]:
        so = self.scheduler.schedule()
        for w in self.workers:
            w.bind_connector_metadata(so.kv_connector_metadata)
            w.start_load_kv(None)
        for spec in so.kv_connector_metadata.loads:
            self.loads[spec.req_id] = spec
            self.fills[spec.req_id] = spec.fill
        # A restored request is scheduled once its load is reported done:
        # check what was restored before this step computes anything.
        for new in so.scheduled_new_reqs:
            self._check_restored(new)
        # The forward pass: the KV of every token computed this step, each rank its heads.
        starts = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update({rid: cached.num_computed_tokens[i] for i, rid in enumerate(cached.req_ids)})
        sampled: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = starts[rid]
            tokens = list(req.all_token_ids[start : start + n])
            blocks = self.blocks_of(rid)
            for rank, caches in enumerate(self.caches):
                for layer, name in enumerate(self.names):
                    page = expected_page(tokens, start, layer, self.kv, rank)
                    for k in range(n):
                        pos = start + k
                        caches[name][blocks[pos // self.block], :, pos % self.block, :] = page[:, k, :]
            done = start + n >= req.num_tokens
            sampled[rid] = [self.sample(list(req.all_token_ids))] if done else []
        req_ids = list(so.num_scheduled_tokens)
        outputs = []
        for w in self.workers:
            w.wait_for_save()
            sending, recving = w.get_finished(so.finished_req_ids)
            invalid = w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=[sampled[r] for r in req_ids],
                    kv_connector_output=KVConnectorOutput(
                        finished_sending=sending,
                        finished_recving=recving,
                        invalid_block_ids=invalid,
                        kv_connector_stats=w.get_kv_connector_stats(),
                    ),
                )
            )
        # What vLLM's executor hands the scheduler: rank 0's output, the
        # transfers finished on every rank, the failed blocks of any.
        out = self.aggregator.aggregate(outputs)
        assert out is not None and out.kv_connector_output is not None
        self.failed_blocks |= out.kv_connector_output.invalid_block_ids
        if not req_ids:
            self.idle_steps += 1
        results = []
        for outputs in self.scheduler.update_from_output(so, out).values():
            stats = outputs.scheduler_stats.kv_connector_stats if outputs.scheduler_stats else None
            if stats:
                self.connector_stats.append(stats)
            for o in outputs.outputs:
                self.generated.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = Finished(
                        o.request_id, self.generated[o.request_id], o.finish_reason, o.kv_transfer_params
                    )
                results.append(o)
        if not req_ids:
            # vLLM's engine core sleeps 1 ms between steps that ran no model.
            time.sleep(0.001)
        return results

    def run(self, timeout_s: float = 60.0) -> None:
        """Steps until nothing is waiting, running or held for the connector."""
        deadline = time.monotonic() + timeout_s
        while self.scheduler.requests:
            if time.monotonic() > deadline:
                raise AssertionError(f"still unfinished after {timeout_s} s: {list(self.scheduler.requests)}")
            self.step()

    def step_until(self, done: Callable[[], bool], timeout_s: float = 30.0) -> int:
        """Steps until `done()`; how many steps it took."""
        deadline, steps = time.monotonic() + timeout_s, 0
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"not done after {timeout_s} s ({steps} steps)")
            self.step()
            steps += 1
        return steps

    def _check_restored(self, new: Any) -> None:
        """A restored request's blocks, byte for byte on every rank, against
        what its prompt alone says."""
        spec = self.loads.pop(new.req_id, None)
        if spec is None or spec.error is not None or not spec.fill:
            return
        if any(b in self.failed_blocks for _, b in spec.fill):
            return
        req = self.scheduler.requests[new.req_id]
        # Restored up to what vLLM takes as computed (a stock request's
        # last prompt token is computed again by this step).
        start, end = spec.fill[0][0] * self.block, min(spec.prompt_tokens, new.num_computed_tokens)
        for rank in range(self.kv.tp):
            for layer in range(LAYERS):
                got = self.read_tokens(new.req_id, layer, start, end, rank)
                want = expected_page(list(req.prompt_token_ids[start:end]), start, layer, self.kv, rank)
                assert torch.equal(got, want), f"{new.req_id}: restored KV of layer {layer}, rank {rank} differs"
        self.restored_checked[new.req_id] = end

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.scheduler.connector.shutdown()
