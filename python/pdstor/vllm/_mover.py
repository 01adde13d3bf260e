"""The worker half's mover: the one thread that talks to the daemon and
moves the bytes, beside the engine's own, so that no engine step waits for
a store, a publish, a claim or a load.

Jobs come from the engine thread in order (``submit``): a step's stores,
the end of a publication (publish or roll back, after the stores queued
before it), and handed-over requests to restore. A restore whose
publication is not READY yet — the producer answered its request before its
stores were durable — waits here, every waiting name looked up together,
until it is READY, until it is gone, or until ``ready_timeout_s``. What is
done is collected by the engine thread (``collect``) and reported to vLLM
through ``get_finished`` and ``get_block_ids_with_load_errors``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pdstor

from ._meta import EndSpec, LoadSpec, SaveSpec

if TYPE_CHECKING:
    from ._worker import WorkerSide

log = logging.getLogger("pdstor.vllm")

# How long the mover sleeps between lookups of publications not yet READY:
# from the first to the last, doubling while none becomes READY.
POLL_FIRST_S = 0.001
POLL_LAST_S = 0.02
_STOP = object()


@dataclass
class _Waiting:
    spec: LoadSpec
    since: float
    deadline: float


class Mover:
    def __init__(self, side: WorkerSide, ready_timeout_s: float):
        self.side = side
        self.ready_timeout_s = ready_timeout_s
        self.jobs: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.waiting: list[_Waiting] = []
        self.lock = threading.Lock()
        # Requests whose publication ended and whose blocks vLLM holds for us.
        self.sent: set[str] = set()
        # Restores done: request id -> the blocks that were not restored.
        self.received: dict[str, list[int]] = {}
        self.thread = threading.Thread(target=self._run, name="pdstor-vllm-mover", daemon=True)
        self.thread.start()

    def submit(self, job: SaveSpec | EndSpec | LoadSpec) -> None:
        self.jobs.put(job)

    def collect(self) -> tuple[set[str], dict[str, list[int]]]:
        """What finished since the last call: the requests whose blocks
        vLLM may free, and the restores (with the blocks that failed)."""
        with self.lock:
            sent, self.sent = self.sent, set()
            received, self.received = self.received, {}
        return sent, received

    def stop(self, timeout_s: float = 10.0) -> None:
        self.jobs.put(_STOP)
        self.thread.join(timeout_s)

    # -- the thread -----------------------------------------------------------

    def _run(self) -> None:
        # vLLM binds its worker to its cores and spins there between steps
        # (os.sched_yield, holding the GIL): this thread waits on the daemon,
        # not on the model, so it may run on any core (on a 2-core machine, a
        # spinning worker starved a mover bound to its core for a minute).
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except OSError as e:
            log.debug("pdstor.vllm: the mover keeps the worker's cores: %s", e)
        delay = POLL_FIRST_S
        while True:
            try:
                job = self.jobs.get(timeout=delay) if self.waiting else self.jobs.get()
            except queue.Empty:
                job = None
            if job is _STOP:
                self._give_up_waiting("the engine is shutting down")
                return
            if job is not None:
                self._do(job)
            if self.waiting:
                try:
                    progressed = self._poll()
                except Exception as e:  # noqa: BLE001 - the thread outlives any one round
                    log.exception("pdstor.vllm: the mover's lookup round failed (asked again): %s", e)
                    progressed = False
                delay = POLL_FIRST_S if progressed else min(2 * delay, POLL_LAST_S)

    def _do(self, job: object) -> None:
        """One job; whatever it raises is logged and the job still ends as
        vLLM needs it to (blocks released, a restore reported failed)."""
        try:
            if isinstance(job, SaveSpec):
                self.side.save_one(job)
            elif isinstance(job, EndSpec):
                self.side.end_one(job)
            elif isinstance(job, LoadSpec):
                self._start_load(job)
        except Exception as e:  # noqa: BLE001 - a dead mover would hold every block it owes vLLM
            log.exception("pdstor.vllm: the mover's %s for request %s failed: %s", type(job).__name__, getattr(job, "req_id", "?"), e)
            if isinstance(job, LoadSpec) and job.report:
                with self.lock:
                    self.received.setdefault(job.req_id, [b for _, b in job.fill])
        if isinstance(job, EndSpec) and job.release:
            with self.lock:
                self.sent.add(job.req_id)

    def _start_load(self, spec: LoadSpec) -> None:
        if spec.error is None and spec.ready is None:
            now = time.monotonic()
            self.waiting.append(_Waiting(spec, now, now + self.ready_timeout_s))
            return
        self._finish_load(spec, spec.ready)

    def _finish_load(self, spec: LoadSpec, ready: str | pdstor.Receipt | None, error: str | None = None) -> None:
        if error is not None:
            spec.error = error
        failed = self.side.load_one(spec, ready)
        if spec.report:
            with self.lock:
                self.received[spec.req_id] = failed

    def _poll(self) -> bool:
        """Looks up every waiting publication at once; restores the READY
        ones and fails the ones that are gone or late. Whether any left."""
        names = [w.spec.name or "" for w in self.waiting]
        try:
            found = self.side.client.lookup(names)
            missing = [n for n, r in zip(names, found) if r is None]
            states = {p["req_id"]: p["state"] for p in self.side.client.publications()} if missing else {}
        except pdstor.Error as e:
            # Asked again next round; a restore still waits no longer than its deadline.
            log.warning("pdstor.vllm: looking the handed-over publications up failed (asked again): %s", e)
            return self._expire(f"their lookup kept failing ({e})")
        now = time.monotonic()
        keep, progressed = [], False
        for w, ready, name in zip(self.waiting, found, names):
            state = states.get(name, "READY" if ready is not None else None)
            if ready is not None:
                self.side.ctx.stats.time("ready_wait", now - w.since)
                self._finish_load(w.spec, ready)
            elif state == "PREPARED" and now < w.deadline:
                keep.append(w)
                continue
            elif state == "PREPARED":
                why = f"publication {name!r} is still being stored after ready_timeout_s={self.ready_timeout_s}"
                self._finish_load(w.spec, None, why)
            elif state == "READY":
                # READY between the lookup and the listing: looked up again next round.
                keep.append(w)
            elif state is None:
                why = f"no publication is named {name!r} (its producer rolled it back, or it was released)"
                self._finish_load(w.spec, None, why)
            else:
                self._finish_load(w.spec, None, f"publication {name!r} is {state}, not READY: another reader took it")
            progressed = True
        self.waiting = keep
        return progressed

    def _expire(self, why: str) -> bool:
        """Fails the waiting restores past their deadline; whether any were."""
        now = time.monotonic()
        late = [w for w in self.waiting if now >= w.deadline]
        self.waiting = [w for w in self.waiting if now < w.deadline]
        for w in late:
            self._finish_load(w.spec, None, f"not READY within ready_timeout_s={self.ready_timeout_s}: {why}")
        return bool(late)

    def _give_up_waiting(self, why: str) -> None:
        waiting, self.waiting = self.waiting, []
        for w in waiting:
            self._finish_load(w.spec, None, why)
