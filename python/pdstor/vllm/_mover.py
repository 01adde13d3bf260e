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

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
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
        self.jobs: queue.SimpleQueue[tuple[object, ...]] = queue.SimpleQueue()
        self.waiting: list[_Waiting] = []
        self.lock = threading.Lock()
        # Requests whose publication ended and whose blocks vLLM holds for us.
        self.sent: set[str] = set()
        # Restores done: request id -> the blocks that were not restored.
        self.received: dict[str, list[int]] = {}
        self.thread = threading.Thread(target=self._run, name="pdstor-vllm-mover", daemon=True)
        self.thread.start()

    def submit(self, *jobs: SaveSpec | EndSpec | LoadSpec) -> None:
        """A step's jobs, queued as one: the mover takes them in one round."""
        if jobs:
            self.jobs.put(jobs)

    def collect(self) -> tuple[set[str], dict[str, list[int]]]:
        """What finished since the last call: the requests whose blocks
        vLLM may free, and the restores (with the blocks that failed)."""
        with self.lock:
            sent, self.sent = self.sent, set()
            received, self.received = self.received, {}
        return sent, received

    def stop(self, timeout_s: float = 10.0) -> None:
        self.jobs.put((_STOP,))
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
        if self.side.staging is not None:
            self.side.staging.bind_thread()
        delay = POLL_FIRST_S
        while True:
            try:
                first = self.jobs.get(timeout=delay) if self.waiting else self.jobs.get()
            except queue.Empty:
                first = ()
            jobs = [*first, *self._drain()] if first else []
            stop = _STOP in jobs
            if jobs:
                self._do_all([j for j in jobs if j is not _STOP])
            if stop:
                self._give_up_waiting("the engine is shutting down")
                return
            if self.waiting:
                try:
                    progressed = self._poll()
                except Exception as e:  # noqa: BLE001 - the thread outlives any one round
                    log.exception("pdstor.vllm: the mover's lookup round failed (asked again): %s", e)
                    progressed = False
                delay = POLL_FIRST_S if progressed else min(2 * delay, POLL_LAST_S)

    def _drain(self) -> list[object]:
        """Every job queued now: the rest of the steps' work this round."""
        more: list[object] = []
        while True:
            try:
                more.extend(self.jobs.get_nowait())
            except queue.Empty:
                return more

    def _do_all(self, jobs: list[object]) -> None:
        """One round's jobs, in the order the engine handed them over, but
        together where they can be: the stores queued back to back (several
        steps', several requests') in one data-plane frame per staging-full;
        the ends of publications and the restores between two stores
        published together — one round trip, one commit — before the next
        store, and those restores started then, their claims together. An
        end always follows the stores queued before it. Whatever a job raises is logged and it still ends as vLLM
        needs it to (blocks released, a restore reported failed)."""
        saves: list[SaveSpec] = []
        ends: list[EndSpec] = []
        loads: list[LoadSpec] = []
        for job in jobs:
            if isinstance(job, SaveSpec):
                if ends or loads:
                    self._store(saves)
                    self._flush(ends, loads)
                    saves, ends, loads = [], [], []
                saves.append(job)
            elif isinstance(job, EndSpec):
                ends.append(job)
            elif isinstance(job, LoadSpec):
                loads.append(job)
        self._store(saves)
        self._flush(ends, loads)

    def _store(self, saves: list[SaveSpec]) -> None:
        """The stores of consecutive steps, together (``save_all``)."""
        if saves:
            self._guarded(saves[0], functools.partial(self.side.save_all, saves))

    def _flush(self, ends: list[EndSpec], loads: list[LoadSpec]) -> None:
        """Ends `ends` (rolled back, or published in one batch), then starts
        `loads`: those already refused or with a receipt restored now, those
        named left to the lookup rounds."""
        publish: list[EndSpec] = []
        for end in ends:
            self._guarded(end, functools.partial(self._end, end, publish))
        if publish:
            self._guarded(publish[0], lambda: self.side.publish_all(publish))
        with self.lock:
            self.sent.update(j.req_id for j in ends if j.release)
        now = time.monotonic()
        ready: list[tuple[LoadSpec, str | pdstor.Receipt | None]] = []
        for spec in loads:
            if spec.error is None and spec.ready is None:
                self.waiting.append(_Waiting(spec, now, now + self.ready_timeout_s))
            else:
                ready.append((spec, spec.ready))
        self._finish_loads(ready)

    def _end(self, spec: EndSpec, publish: list[EndSpec]) -> None:
        if self.side.end(spec):
            publish.append(spec)

    def _guarded(self, job: SaveSpec | EndSpec, run: Callable[[], None]) -> None:
        try:
            run()
        except Exception as e:  # noqa: BLE001 - a dead mover would hold every block it owes vLLM
            log.exception("pdstor.vllm: the mover's %s for request %s failed: %s", type(job).__name__, job.req_id, e)

    def _finish_loads(self, loads: Sequence[tuple[LoadSpec, str | pdstor.Receipt | None]]) -> None:
        """Restores `loads` (their claims in one round trip) and reports
        each; a restore that cannot even start reports every block failed."""
        if not loads:
            return
        try:
            failed = self.side.load_many(loads)
        except Exception as e:  # noqa: BLE001 - a dead mover would hold every block it owes vLLM
            log.exception("pdstor.vllm: the mover's restores of %d requests failed: %s", len(loads), e)
            failed = [[b for _, b in spec.fill] for spec, _ in loads]
        with self.lock:
            for (spec, _), blocks in zip(loads, failed):
                if spec.report:
                    self.received[spec.req_id] = blocks

    @staticmethod
    def _failing(spec: LoadSpec, why: str) -> tuple[LoadSpec, None]:
        spec.error = why
        return spec, None

    def _poll(self) -> bool:
        """Looks up every waiting publication at once; restores the READY
        ones and fails the ones that are gone or late. Whether any left."""
        # Each rank looks up its own shard's publication.
        names = [self.side.publication_of(w.spec) for w in self.waiting]
        try:
            found = self.side.client.lookup(names)
            missing = [n for n, r in zip(names, found) if r is None]
            states = {p["req_id"]: p["state"] for p in self.side.client.publications()} if missing else {}
        except pdstor.Error as e:
            # Asked again next round; a restore still waits no longer than its deadline.
            log.warning("pdstor.vllm: looking the handed-over publications up failed (asked again): %s", e)
            return self._expire(f"their lookup kept failing ({e})")
        now = time.monotonic()
        keep: list[_Waiting] = []
        done: list[tuple[LoadSpec, str | pdstor.Receipt | None]] = []
        for w, ready, name in zip(self.waiting, found, names):
            state = states.get(name, "READY" if ready is not None else None)
            if ready is not None:
                self.side.ctx.stats.time("ready_wait", now - w.since)
                done.append((w.spec, ready))
            elif state == "PREPARED" and now < w.deadline:
                keep.append(w)
            elif state == "PREPARED":
                why = f"publication {name!r} is still being stored after ready_timeout_s={self.ready_timeout_s}"
                done.append(self._failing(w.spec, why))
            elif state == "READY":
                # READY between the lookup and the listing: looked up again next round.
                keep.append(w)
            elif state is None:
                why = f"no publication is named {name!r} (its producer rolled it back, or it was released)"
                done.append(self._failing(w.spec, why))
            else:
                done.append(
                    self._failing(w.spec, f"publication {name!r} is {state}, not READY: another reader took it")
                )
        self.waiting = keep
        self._finish_loads(done)
        return bool(done)

    def _expire(self, why: str) -> bool:
        """Fails the waiting restores past their deadline; whether any were."""
        now = time.monotonic()
        late = [w for w in self.waiting if now >= w.deadline]
        self.waiting = [w for w in self.waiting if now < w.deadline]
        why = f"not READY within ready_timeout_s={self.ready_timeout_s}: {why}"
        self._finish_loads([self._failing(w.spec, why) for w in late])
        return bool(late)

    def _give_up_waiting(self, why: str) -> None:
        waiting, self.waiting = self.waiting, []
        self._finish_loads([self._failing(w.spec, why) for w in waiting])
