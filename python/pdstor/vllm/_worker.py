"""The connector's worker half: the bytes. Stores each step's completed
blocks from vLLM's paged cache, ends publications (READY with the
producer's first token once every chunk is durable, or rolled back), and
restores handed-over requests into it: claim, adopt, load every chunk (each
checked against the manifest's crc32c and its own header), copy into the
allocated blocks, then ack. None of it on the engine's thread: the engine
hands each step's work to the mover (``_mover``), and takes back through
``get_finished`` the requests whose stores are done (their blocks freed)
and whose restores are done. A restore that fails reports the request's
blocks through ``get_block_ids_with_load_errors`` in the same step, and the
claim as failed (the publication RETAINED, its bytes kept) — the engine is
never left to decode from blocks that were not restored.

vLLM's KV cache here is memory torch allocated (host or GPU), which the
daemon cannot map: the blocks go through one registered staging buffer (a
memfd the daemon reads and writes in place, ``host_fixed``; the copies per
layer, not per block: ``_staging``), made by the mover (the blocks it reads
or fills are held for it: a
finished request's until its publication ended, a restored one's until
vLLM hears the restore is done). vLLM hands every layer over as a
``[blocks, H, N, C]`` view of one shared allocation whatever the attention
backend, its strides set by the engine's KV cache layout (``LBNHC``,
``LBHNC``, or a block-outermost one where a block's layers lie together): a
block is indexed, never assumed contiguous. On a GPU the route without the
staging copy is DMA-BUF (`docs/gpu-qual.md`). Under tensor parallelism
this half is one rank's: it stores and restores its own shard's publication.

Nothing here imports vLLM: the GPU bundle drives this half over CUDA KV
caches laid out as vLLM lays them (``layouts.json``) where vLLM is not
installed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

import pdstor

from ._context import Context
from ._format import HEADER_BYTES, NO_SCALES, check_header, header
from ._identity import shard_name
from ._meta import EndSpec, LoadSpec, PdstorMetadata, SaveSpec
from ._mover import Mover
from ._staging import Staging

log = logging.getLogger("pdstor.vllm")


class LoadRefused(Exception):
    """A handed-over request that cannot be restored, and why."""


class WorkerSide:
    def __init__(self, ctx: Context, layer_names: list[str], dtype: torch.dtype):
        self.ctx = ctx
        self.client, self.layout, self.shape, self.cfg = ctx.client, ctx.layout, ctx.shape, ctx.cfg
        self.layer_names = layer_names
        self.dtype = dtype
        self.reader = pdstor.Reader(ctx.client, ctx.cfg.reader_id, session=ctx.session, verify="daemon")
        self.layers: list[torch.Tensor] = []
        self.staging: Staging | None = None
        self.slots = 0
        self.scales = NO_SCALES
        self.invalid: set[int] = set()
        # Request id -> (the handoff token whose stores failed, why): a
        # preempted request's next publication comes with a new token.
        self.failed_saves: dict[str, tuple[str, str]] = {}
        self.restored = 0
        self.failed_loads = 0
        self.published = 0
        self.mover: Mover | None = None

    def register(self, kv_caches: dict[str, torch.Tensor], scales: bytes = NO_SCALES) -> None:
        """This rank's paged caches (vLLM's per-layer views), and the
        digest of the scales its quantized KV is written with."""
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"pdstor.vllm: the engine registered no KV cache for layers {missing}")
        page = (self.shape.heads, self.shape.block_tokens, self.shape.content)
        layers = []
        for name in self.layer_names:
            t = kv_caches[name]
            if isinstance(t, torch.Tensor) and t.dim() == 3 and page[0] == 1:
                # An MLA cache: one latent per token, no head axis.
                t = t.unsqueeze(1)
            if not isinstance(t, torch.Tensor) or tuple(t.shape[1:]) != page or t.dtype != self.dtype:
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"pdstor.vllm: layer {name}'s KV cache is {got}; it reads vLLM's per-layer view "
                    f"[blocks, {page[0]}, {page[1]}, {page[2]}] of {self.dtype}"
                )
            layers.append(t)
        self.layers = layers
        self.scales = scales
        self.staging = Staging(self.shape, layers, self.dtype, self.cfg.staging_bytes)
        self.slots = self.staging.slots
        # Registered now: a data socket that does not answer fails the
        # engine's start, not its first request.
        self.client.register(self.staging.buffer)
        self.mover = Mover(self, self.cfg.ready_timeout_s)

    def _mover(self) -> Mover:
        if self.mover is None:
            raise RuntimeError("pdstor.vllm: the engine scheduled work before it registered its KV caches")
        return self.mover

    def _staging(self) -> Staging:
        if self.staging is None:
            raise RuntimeError("pdstor.vllm: the engine moved KV before it registered its KV caches")
        return self.staging

    def close(self) -> None:
        if self.mover is not None:
            self.mover.stop()
        if self.staging is not None:
            self.staging.close()

    def handoff(self, spec: SaveSpec | EndSpec) -> str:
        """This rank's shard publication of a request's."""
        if len(spec.handoffs) != self.ctx.tp_size:
            raise RuntimeError(
                f"pdstor.vllm: request {spec.req_id} has {len(spec.handoffs)} shard publications; this engine "
                f"has {self.ctx.tp_size} tensor-parallel ranks (its scheduler and workers disagree)"
            )
        return spec.handoffs[self.ctx.rank]

    def publication_of(self, spec: LoadSpec) -> str:
        """The publication this rank restores: its shard of the producer's
        (rank r of a producer with as many ranks; another size restores a
        shard whose layout it does not match, and its claim is refused)."""
        return shard_name(spec.name or "", self.ctx.rank % spec.producer_tp, spec.producer_tp)

    # -- saving ---------------------------------------------------------------

    def save(self, meta: PdstorMetadata) -> None:
        """This step's completed blocks, stored by the mover (after the
        forward pass that computed them)."""
        after = None
        if meta.saves and self.layers and self.layers[0].is_cuda:
            # The forward pass may still be running on vLLM's stream; the
            # mover's copy (on another thread, another stream) waits for it.
            after = torch.cuda.Event()
            after.record()
        for spec in meta.saves:
            spec.after = after
        if meta.saves:
            self._mover().submit(*meta.saves)

    def save_all(self, specs: list[SaveSpec]) -> None:
        """A round's stores, every request's together: their blocks
        gathered into the staging slots in request order and stored in one
        data-plane frame per slots-full (``Writer.store_many``), whatever the
        requests. A request whose store is refused is remembered (its
        publication rolled back, its later chunks not sent) and ends rolled
        back; the others go on. Should the round itself fail, every request
        in it ends rolled back."""
        try:
            self._save_all(specs)
        except Exception as e:  # noqa: BLE001 - none may end READY with chunks unstored
            log.exception("pdstor.vllm: a round of %d stores failed: %s", len(specs), e)
            for spec in specs:
                try:
                    handoff = self.handoff(spec)
                except RuntimeError:
                    continue
                if not self._failed(spec, handoff):
                    self.failed_saves[spec.req_id] = (handoff, str(e))

    def _save_all(self, specs: list[SaveSpec]) -> None:
        pieces: list[tuple[SaveSpec, str, int, int]] = []
        for spec in specs:
            try:
                handoff = self.handoff(spec)
            except RuntimeError as e:
                log.error("pdstor.vllm: request %s is not stored: %s", spec.req_id, e)
                continue
            if not self._failed(spec, handoff):
                pieces.extend((spec, handoff, index, block) for index, block in spec.chunks)
        for start in range(0, len(pieces), self.slots):
            window = [p for p in pieces[start : start + self.slots] if not self._failed(p[0], p[1])]
            try:
                if window:
                    self._store_window(window)
            except Exception as e:  # noqa: BLE001 - each request ends rolled back, none left owed
                log.exception("pdstor.vllm: a store of %d chunks failed: %s", len(window), e)
                for spec, handoff, *_ in window:
                    self.failed_saves[spec.req_id] = (handoff, str(e))

    def _failed(self, spec: SaveSpec, handoff: str) -> bool:
        failed = self.failed_saves.get(spec.req_id)
        return failed is not None and failed[0] == handoff

    def _store_window(self, window: list[tuple[SaveSpec, str, int, int]]) -> None:
        """One frame: `window`'s blocks gathered into slots 0.., each
        request's chunks one store of its publication."""
        staging = self._staging()
        # The latest step's event: the forward passes behind it ran on the same stream.
        after = next((spec.after for spec, *_ in reversed(window) if spec.after is not None), None)
        staging.gather([block for *_, block in window], after)
        # Per publication: its chunks here, and whether the last of them ends
        # it (several steps' stores of one request are one store).
        items: dict[str, tuple[SaveSpec, list[tuple[int, pdstor.Buffer, int, int]], list[bool]]] = {}
        for slot, (spec, handoff, index, _) in enumerate(window):
            at = staging.offset(slot)
            staging.buffer.write(at, header(self.shape, index, spec.prompt_tokens, spec.digest, self.scales))
            _, stores, last = items.setdefault(handoff, (spec, [], [False]))
            stores.append((index, staging.buffer, at, self.shape.chunk_bytes))
            last[0] = spec.last and index == spec.chunks[-1][0]
        asked = [(handoff, stores, last[0]) for handoff, (_, stores, last) in items.items()]
        began = time.monotonic()
        answers: list[pdstor.Error | None]
        try:
            answers = pdstor.Writer.store_many(self.client, asked)
        except pdstor.Error as e:
            answers = [e] * len(asked)
        self.ctx.stats.time("store", time.monotonic() - began)
        for (handoff, (spec, stores, _)), refused in zip(items.items(), answers):
            if refused is None:
                self.ctx.stats.count("stored_chunks", len(stores))
                self.ctx.stats.count("stored_bytes", len(stores) * self.shape.chunk_bytes)
                continue
            self.failed_saves[spec.req_id] = (handoff, str(refused))
            log.error(
                "pdstor.vllm: storing request %s failed (its publication is rolled back): %s", spec.req_id, refused
            )

    def end(self, spec: EndSpec) -> bool:
        """A publication's end, after every store queued before it: rolled
        back now, or True where it is to be published READY with the
        producer's first token (`publish_all`, with the round's others)."""
        handoff = self.handoff(spec)
        failed = self.failed_saves.pop(spec.req_id, None)
        if failed is not None and failed[0] != handoff:
            failed = None
        if spec.first_token is not None and failed is None:
            return True
        why = spec.why if failed is None else f"its stores failed: {failed[1]}"
        self._roll_back(spec, why)
        return False

    def publish_all(self, publish: list[EndSpec]) -> None:
        """Publishes READY in one round trip and one commit; a publication
        refused is rolled back."""
        began = time.monotonic()
        answers: list[pdstor.Receipt | Exception]
        try:
            answers = list(pdstor.Writer.publish_many(self.client, [(self.handoff(s), s.first_token) for s in publish]))
        except Exception as e:  # noqa: BLE001 - each publication is still rolled back, none left PREPARED
            answers = [e] * len(publish)
        took = time.monotonic() - began
        for spec, ready in zip(publish, answers):
            if isinstance(ready, pdstor.Receipt):
                self.ctx.stats.time("publish", took)
                self.ctx.stats.count("published")
                self.published += 1
                self.ctx.note("publish", receipt=ready)
            else:
                log.error("pdstor.vllm: request %s: its publish was refused: %s", spec.req_id, ready)
                self._roll_back(spec, f"its publish was refused: {ready}")

    def _roll_back(self, spec: EndSpec, why: str) -> None:
        try:
            w = pdstor.Writer.resume(self.client, self.handoff(spec), self.cfg.writer_id)
            log.info("pdstor.vllm: request %s: publication rolled back (%s): %s", spec.req_id, why, w.abort())
        except pdstor.Error as e:
            log.error("pdstor.vllm: request %s: rolling its publication back was refused: %s", spec.req_id, e)

    # -- loading --------------------------------------------------------------

    def load(self, meta: PdstorMetadata) -> None:
        """This step's publications to end and requests to restore, handed
        to the mover (publications end after the stores queued before)."""
        if meta.ends or meta.loads:
            self._mover().submit(*meta.ends, *meta.loads)

    def load_many(self, loads: Sequence[tuple[LoadSpec, str | pdstor.Receipt | None]]) -> list[list[int]]:
        """Restores handed-over requests (on the mover), their claims in one
        round trip and one commit; for each, the blocks that were not
        restored (none when it was)."""
        began = time.monotonic()
        readies: list[pdstor.Receipt | Exception] = []
        for spec, ready in loads:
            try:
                readies.append(self._ready(spec, ready))
            except LoadRefused as e:
                readies.append(e)
        asked = [r for r in readies if isinstance(r, pdstor.Receipt)]
        claimed: list[pdstor.Receipt | pdstor.Error]
        try:
            claimed = self.reader.claim_many(asked, lease_ms=self.cfg.lease_ms, layout=self.layout) if asked else []
        except pdstor.Error as e:
            claimed = [e] * len(asked)
        claiming = time.monotonic() - began
        claims = iter(claimed)
        out = []
        for (spec, _), got in zip(loads, readies):
            claim = next(claims) if isinstance(got, pdstor.Receipt) else got
            # Each restore's time: the claim batch's, then its own.
            out.append(self._load_one(spec, claim, time.monotonic() - claiming))
        return out

    def _ready(self, spec: LoadSpec, ready: str | pdstor.Receipt | None) -> pdstor.Receipt:
        if spec.error is not None:
            raise LoadRefused(spec.error)
        if ready is None:
            raise LoadRefused("no READY publication")
        if isinstance(ready, str):
            try:
                return pdstor.Receipt.from_json(ready)
            except (ValueError, TypeError) as e:
                raise LoadRefused(f"kv_transfer_params.pdstor.receipt is not a receipt: {e}") from e
        return ready

    def _load_one(self, spec: LoadSpec, claim: pdstor.Receipt | Exception, began: float) -> list[int]:
        try:
            if isinstance(claim, pdstor.Error):
                raise LoadRefused(f"claim refused: {claim}")
            if isinstance(claim, Exception):
                raise claim
            self.ctx.note("claim", receipt=claim)
            self._claimed(claim, spec)
            self.ctx.stats.time("restore", time.monotonic() - began)
            self.ctx.stats.count("restored")
            self.restored += 1
            return []
        except Exception as e:  # noqa: BLE001 - every failure goes to vLLM's load-error path
            self.ctx.stats.count("restore_failures")
            self.failed_loads += 1
            blocks = [b for _, b in spec.fill]
            log.error(
                "pdstor.vllm: request %s not restored (%d blocks reported failed): %s", spec.req_id, len(blocks), e
            )
            # Named by vLLM's request id only: the publication may
            # already have ended (a duplicate, a release).
            event = "recompute" if self.cfg.recompute else "load_failed"
            self.ctx.note(event, req_id=spec.req_id, detail=str(e))
            return blocks

    def _claimed(self, claim: pdstor.Receipt, spec: LoadSpec) -> None:
        try:
            self._restore(claim, spec)
        except Exception as e:
            # RETAINED: the bytes kept and never reused until reclaimed.
            try:
                self.reader.fail(claim, str(e).encode()[:1000].decode(errors="ignore"))
            except pdstor.Error as f:
                log.error("pdstor.vllm: reporting request %s's failed restore was refused: %s", spec.req_id, f)
            raise

    def _restore(self, claim: pdstor.Receipt, spec: LoadSpec) -> None:
        manifest = self.reader.adopt(claim, self.layout)
        if manifest.get("first_token") != spec.expect_token:
            raise LoadRefused(
                f"the publication's first token is {manifest.get('first_token')}; "
                f"this request's kv_transfer_params and prompt say {spec.expect_token}"
            )
        chunks = sorted(c["index"] for c in manifest["chunks"])
        expected = self.shape.chunks_for(spec.prompt_tokens)
        if chunks != list(range(expected)):
            raise LoadRefused(
                f"the publication holds chunks {chunks}; "
                f"a prompt of {spec.prompt_tokens} tokens needs 0..{expected - 1}"
            )
        fill = dict(spec.fill)
        staging = self._staging()
        halves = staging.halves()
        try:
            for turn, start in enumerate(range(0, expected, halves[0][1])):
                half = turn % len(halves)
                first, room = halves[half]
                batch = list(range(start, min(start + min(room, halves[0][1]), expected)))
                # The copies out of these slots a batch ago are done before
                # the daemon refills them.
                staging.wait(half)
                places = [(index, staging.buffer, staging.offset(first + slot)) for slot, index in enumerate(batch)]
                self.reader.load(claim, places)
                self.ctx.stats.count("restored_bytes", len(places) * self.shape.chunk_bytes)
                for slot, index in enumerate(batch):
                    raw = staging.buffer.read(staging.offset(first + slot), HEADER_BYTES)
                    why = check_header(raw, self.shape, index, spec.prompt_tokens, spec.digest, self.scales)
                    if why is not None:
                        raise LoadRefused(why)
                if staging.cuda:
                    filled = [(slot, fill[index]) for slot, index in enumerate(batch) if index in fill]
                    staging.scatter(half, first, filled)
                else:
                    checked = staging.copy_out(self.reader, claim, first, batch, fill)
                    self.ctx.stats.count("restored_checked_in_copy_bytes", checked)
        finally:
            staging.finish()
        self.ctx.note("restored", receipt=claim)
        self.reader.ack(claim)
        self.ctx.note("ack", receipt=claim)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM's get_finished: the requests whose publication ended (their
        blocks freed now) and whose restore is done; the blocks of failed
        restores go out by ``take_invalid`` in the same step."""
        if self.mover is None:
            return None, None
        sent, received = self.mover.collect()
        for failed in received.values():
            self.invalid.update(failed)
        return sent or None, set(received) or None

    def take_invalid(self) -> set[int]:
        out, self.invalid = self.invalid, set()
        return out
