"""The connector's scheduler half: which requests are handed over, and the
steps that own them — the producer's (``_producer``: prepare, the blocks
each step stores, the publication's end) and the consumer's
(``_consumer``: which requests restore a handoff, and their outcome).
Nothing here waits for the daemon: prepares run on a pool beside the
scheduler, everything else on the worker's mover."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ._consumer import Consumer
from ._context import Context
from ._meta import PdstorMetadata
from ._producer import PARAMS, Producer

__all__ = ["PARAMS", "Counters", "SchedulerSide"]

# What this half reports to vLLM's stats (its restores and publishes are the worker's to count).
SCHEDULER_COUNTS = ("prepared", "aborted", "admission_waits", "load_refused", "first_token_mismatches")


@dataclass
class Counters:
    """What this scheduler half did, for the operator and the tests."""

    prepared: int = 0
    # Requests answered with a handoff (published by the worker once stored).
    published: int = 0
    aborted: int = 0
    # Prepares that found no room within admission_timeout_s.
    admission_waits: int = 0
    # Restores the worker reported done, and failed.
    restored: int = 0
    load_failed: int = 0
    # Handed-over requests refused before their load (bad params, a prompt not the producer's).
    load_refused: int = 0
    # Stock requests whose decode's first token differed from the producer's.
    first_token_mismatches: int = 0


class SchedulerSide:
    def __init__(self, ctx: Context, roles: tuple[bool, bool]):
        self.ctx = ctx
        self.producer_role, self.consumer_role = roles
        self.counters = Counters()
        self.producer = Producer(ctx, self.counters)
        self.consumer = Consumer(ctx, self.counters)
        self.reported = Counters()

    def stats(self) -> dict[str, Any] | None:
        """vLLM's connector stats: this half's counts and latencies since
        the last call."""
        with self.producer.count_lock:
            now = asdict(self.counters)
        before = asdict(self.reported)
        delta = {k: now[k] - before[k] for k in SCHEDULER_COUNTS if now[k] != before[k]}
        self.reported = Counters(**now)
        times = self.ctx.stats.take() or {}
        return {**times, **delta} or None

    def close(self) -> None:
        self.producer.close()

    def match(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = (request.kv_transfer_params or {}).get(PARAMS)
        if params is not None and self.consumer_role:
            # Handed over — or the producer said it could not be (an
            # "error" entry): a strict consumer fails that like any miss.
            return self.consumer.match(request, num_computed_tokens, params)
        if self._stores(request):
            return self.producer.admit(request)
        return 0, False

    def _stores(self, request: Any) -> bool:
        if not self.producer_role:
            return False
        if not self.consumer_role:
            return True
        return bool((request.kv_transfer_params or {}).get("do_remote_decode"))

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.consumer.after_alloc(request, blocks, num_external_tokens)

    def build_meta(self, so: Any) -> PdstorMetadata:
        meta = PdstorMetadata()
        self.producer.build_meta(meta, so)
        meta.loads = self.consumer.take_loads()
        return meta

    def update_output(self, out: Any) -> None:
        self.consumer.update_output(out)

    def finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.consumer.finished(request)
        return self.producer.finished(request)
