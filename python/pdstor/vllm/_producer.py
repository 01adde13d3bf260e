"""The scheduler half of a prefill engine (``kv_producer``): which requests
are stored, and the steps that own their publications — without a daemon
round trip on the scheduler's thread.

A request is prepared when the scheduler first considers it: the prepare
goes to a small pool of threads, and ``get_num_new_matched_tokens``
answers ``None`` ("ask again") until it is answered — room in the store
waited for there, up to ``admission_timeout_s``, after which the request
is prefilled without a handoff. Each step hands the worker the blocks its
prompt completed; ``request_finished`` answers ``(True, params)`` at once,
the blocks held until the worker's mover has stored every chunk and
published READY with the first output token (reported through
``get_finished``). The params name the publication (``req``): the decode
engine finds it READY by that name, so the prefill's answer never waits
for the stores. An aborted request's publication is rolled back, a
preempted one's too (it is prepared anew when scheduled again).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pdstor
from pdstor._policy import unread_window_ms

from ._context import Context
from ._format import prompt_digest
from ._identity import shard_name
from ._meta import EndSpec, PdstorMetadata, SaveSpec

log = logging.getLogger("pdstor.vllm")

PARAMS = "pdstor"
"""The key of pdstor's entry in a request's ``kv_transfer_params``."""

# Prepares (and rollbacks of publications no store reached) in flight at
# once: concurrent requests share the journal's flushes.
PREPARE_THREADS = 4


@dataclass
class _Pub:
    """A request this engine prefills for another: its open publication."""

    # One per tensor-parallel rank: its shard publication's handoff.
    handoffs: tuple[str, ...]
    publication: int
    name: str
    prompt_tokens: int
    digest: bytes
    total: int
    block_ids: list[int]
    next_chunk: int = 0


@dataclass(frozen=True)
class _Prepared:
    handoffs: tuple[str, ...]
    # Rank 0's shard publication (the timeline's).
    publication: int


class Producer:
    def __init__(self, ctx: Context, counters: Any):
        self.ctx, self.counters = ctx, counters
        self.client, self.layout, self.shape, self.cfg = ctx.client, ctx.layout, ctx.shape, ctx.cfg
        self.pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="pdstor-vllm-prepare")
        # The pool's threads count admission waits beside the engine thread's counts.
        self.count_lock = threading.Lock()
        # Under tensor parallelism, the one prepare that waits for room.
        self.wait_lock = threading.Lock()
        self.pubs: dict[str, _Pub] = {}
        self.preparing: dict[str, tuple[Future[_Prepared], str, int]] = {}
        # Preempted requests prepared anew and not scheduled since: their
        # publication is the one to store, whatever the step reports.
        self.fresh: set[str] = set()
        self.attempts: dict[str, int] = {}
        self.waiting_since: dict[str, float] = {}
        self.store_failed: dict[str, str] = {}
        self.ends: list[EndSpec] = []

    def close(self) -> None:
        """The engine stops: every publication it opened and did not hand
        over is rolled back (a PREPARED one would hold its slots until an
        operator cancelled it)."""
        open_ = [(rid, h) for rid, pub in self.pubs.items() for h in pub.handoffs]
        pending = list(self.preparing.items())
        self.pubs.clear()
        self.preparing.clear()
        self.pool.shutdown(wait=True)
        for rid, (future, _, _) in pending:
            if future.exception() is None:
                open_.extend((rid, h) for h in future.result().handoffs)
        for rid, handoff in open_:
            self._rollback(handoff, rid, "open when the engine shut down")

    # -- admission ------------------------------------------------------------

    def admit(self, request: Any) -> tuple[int | None, bool]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        if rid in self.pubs:
            if request.status != RequestStatus.PREEMPTED or rid in self.fresh:
                return 0, False
            # Preempted, and resumed in the same schedule() that preempted
            # it (before build_meta saw it): its blocks were freed, it is
            # recomputed from its first token, so it is stored anew.
            self.abort(rid, "preempted: it is prepared anew and stored again")
        if rid in self.store_failed:
            return 0, False
        pending = self.preparing.get(rid)
        if pending is None:
            self._start_prepare(request)
            if request.status == RequestStatus.PREEMPTED:
                # The step's report of its preemption is not about this one.
                self.fresh.add(rid)
            return None, False
        future, name, total = pending
        if not future.done():
            return None, False
        del self.preparing[rid]
        self.waiting_since.pop(rid, None)
        try:
            prepared = future.result()
        except Exception as e:  # noqa: BLE001 - a prepare that failed, however, is a request not handed over
            kind = "no room" if isinstance(e, pdstor.AdmissionTimeout) else "prepare refused"
            self.store_failed[rid] = (
                f"{kind} for {total} chunks (admission_timeout_s={self.cfg.admission_timeout_s}): {e}"
            )
            log.error("pdstor.vllm: request %s is not handed over: %s", rid, self.store_failed[rid])
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        self.counters.prepared += 1
        self.pubs[rid] = _Pub(
            prepared.handoffs, prepared.publication, name, len(prompt), prompt_digest(prompt), total, []
        )
        detail = f"prefill {rid}: {len(prompt)} tokens, {total} chunks"
        self.ctx.note("schedule", req_id=name, publication=prepared.publication, detail=detail)
        return 0, False

    def _start_prepare(self, request: Any) -> None:
        rid = request.request_id
        total = self.shape.chunks_for(len(request.prompt_token_ids or []))
        attempt = self.attempts.get(rid, 0)
        self.attempts[rid] = attempt + 1
        name = f"vllm-{self.ctx.engine_id}-{rid}" + (f"-{attempt}" if attempt else "")
        deadline = self.waiting_since.setdefault(rid, time.monotonic()) + self.cfg.admission_timeout_s
        future = self.pool.submit(self._prepare, name, total, deadline)
        self.preparing[rid] = (future, name, total)

    def _prepare(self, name: str, total: int, deadline: float) -> _Prepared:
        """On the pool: prepares every tensor-parallel rank's shard
        publication. Where the store has no room at once (counted), waits
        for it until the deadline — under tensor parallelism one request at
        a time: two requests each holding one rank's shard and waiting for
        the other's room would hold each other until their deadlines."""
        try:
            return self._prepare_shards(name, total, None)
        except pdstor.AdmissionTimeout:
            with self.count_lock:
                self.counters.admission_waits += 1
        if self.ctx.tp_size == 1:
            return self._prepare_shards(name, total, deadline)
        with self.wait_lock:
            return self._prepare_shards(name, total, deadline)

    def _prepare_shards(self, name: str, total: int, deadline: float | None) -> _Prepared:
        """Prepares every rank's shard, waiting for room until `deadline`
        (None: not at all); where one cannot be, rolls back the ones that were."""
        unread_ms = unread_window_ms("unread_release_s", self.cfg.unread_release_s)
        done: list[tuple[str, int]] = []
        try:
            for rank, layout in enumerate(self.ctx.shard_layouts):
                shard = shard_name(name, rank, self.ctx.tp_size)
                timeout_ms = 0 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
                writer = pdstor.Writer(self.client, self.cfg.writer_id)
                writer.prepare(shard, layout, total, timeout_ms=timeout_ms, unread_release_ms=unread_ms)
                if writer.publication is None:
                    raise RuntimeError(f"prepare of {shard} answered no publication number")
                done.append((writer.handoff(), writer.publication))
        except Exception:
            for handoff, _ in done:
                self._rollback(handoff, name, "another rank's shard could not be prepared")
            raise
        return _Prepared(tuple(h for h, _ in done), done[0][1])

    def _rollback(self, handoff: str, rid: str, why: str) -> None:
        """On the pool: rolls back a publication no store reached."""
        try:
            outcome = pdstor.Writer.resume(self.client, handoff, self.cfg.writer_id).abort()
        except pdstor.Error as e:
            outcome = f"abort refused: {e}"
        log.info("pdstor.vllm: request %s %s: publication %s", rid, why, outcome)

    def _rollback_when_prepared(self, future: Future[_Prepared], rid: str, why: str) -> None:
        def done(f: Future[_Prepared]) -> None:
            if f.exception() is None:
                try:
                    for handoff in f.result().handoffs:
                        self.pool.submit(self._rollback, handoff, rid, why)
                except RuntimeError:  # the pool is shut down: this thread is one of its last
                    for handoff in f.result().handoffs:
                        self._rollback(handoff, rid, why)

        future.add_done_callback(done)

    def abort(self, rid: str, why: str, finishing: bool = False) -> bool:
        """Rolls back a request's publication: by the worker after the
        stores queued before, where any were; else on the pool. Whether
        vLLM must hold the request's blocks until then (a finishing
        request's, which the mover may still be reading)."""
        pending = self.preparing.pop(rid, None)
        if pending is not None:
            self._rollback_when_prepared(pending[0], rid, why)
            self.counters.aborted += 1
        pub = self.pubs.pop(rid, None)
        if pub is None:
            return False
        self.counters.aborted += 1
        if pub.next_chunk == 0:
            for handoff in pub.handoffs:
                self.pool.submit(self._rollback, handoff, rid, why)
            return False
        self.ends.append(EndSpec(rid, pub.handoffs, None, why, release=finishing))
        return finishing

    # -- each step --------------------------------------------------------------

    def build_meta(self, meta: PdstorMetadata, so: Any) -> None:
        for rid in so.preempted_req_ids or ():
            if rid not in self.fresh:
                self.abort(rid, "preempted: it will be prepared anew and stored again")
        for new in so.scheduled_new_reqs:
            self.fresh.discard(new.req_id)
            pub = self.pubs.get(new.req_id)
            if pub is not None:
                pub.block_ids = list(new.block_ids[0])
                self._plan_saves(meta, new.req_id, pub, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self.fresh.discard(rid)
            pub = self.pubs.get(rid)
            if pub is None:
                continue
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                pub.block_ids = list(added[0]) if added else []
            elif added:
                pub.block_ids.extend(added[0])
            self._plan_saves(meta, rid, pub, cached.num_computed_tokens[i] + so.num_scheduled_tokens[rid])
        meta.ends, self.ends = self.ends, []

    def _plan_saves(self, meta: PdstorMetadata, rid: str, pub: _Pub, computed: int) -> None:
        computed = min(computed, pub.prompt_tokens)
        done = pub.total if computed >= pub.prompt_tokens else computed // self.shape.block_tokens
        if done <= pub.next_chunk:
            return
        chunks = [(i, pub.block_ids[i]) for i in range(pub.next_chunk, done)]
        meta.saves.append(
            SaveSpec(
                req_id=rid,
                handoffs=pub.handoffs,
                prompt_tokens=pub.prompt_tokens,
                digest=pub.digest,
                chunks=chunks,
                last=done == pub.total,
            )
        )
        pub.next_chunk = done

    # -- the end ----------------------------------------------------------------

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self.waiting_since.pop(rid, None)
        self.attempts.pop(rid, None)
        self.fresh.discard(rid)
        failed = self.store_failed.pop(rid, None)
        status = request.status
        if rid in self.preparing:
            self.abort(rid, f"finished {status.name} before it was admitted")
            return False, {PARAMS: {"error": f"request {status.name} before its publication was prepared"}}
        pub = self.pubs.get(rid)
        if pub is None:
            return False, ({PARAMS: {"error": failed}} if failed else None)
        outputs = list(request.output_token_ids or [])
        if status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR) or not outputs:
            held = self.abort(rid, f"finished {status.name} before it was handed over", finishing=True)
            return held, {PARAMS: {"error": f"request {status.name}: publication {pub.name} rolled back"}}
        if pub.next_chunk < pub.total:
            held = self.abort(rid, f"finished with {pub.next_chunk}/{pub.total} chunks stored", finishing=True)
            return held, {PARAMS: {"error": f"only {pub.next_chunk}/{pub.total} chunks stored: rolled back"}}
        self.pubs.pop(rid)
        # Published by the worker once every chunk is durable; the blocks
        # are held until then (freed through get_finished).
        self.ends.append(EndSpec(rid, pub.handoffs, outputs[0], "", release=True))
        self.counters.published += 1
        return True, {
            PARAMS: {
                "req": pub.name,
                "prompt_tokens": pub.prompt_tokens,
                "prompt_digest": pub.digest.hex(),
                "first_token": outputs[0],
                # Each rank's shard is its own publication (shard_name).
                "tp": self.ctx.tp_size,
            }
        }
