"""What each half of the connector counts and times, for vLLM's
connector stats (``_stats``): plain data, no vLLM, so that the worker half
imports without it (the GPU bundle drives it so)."""

from __future__ import annotations

import threading
from typing import Any

COUNTS = {
    # scheduler half
    "prepared": "Publications prepared for requests handed over (producer).",
    "aborted": "Publications rolled back before READY: a request aborted, a store failed, the engine stopped.",
    "admission_waits": "Prepares that found no room in the namespace within admission_timeout_s "
    "(served without a handoff).",
    "load_refused": "Handed-over requests refused before their load "
    "(bad kv_transfer_params, a prompt not the producer's).",
    "first_token_mismatches": "Restored requests whose first generated token differed from the producer's.",
    # worker half
    "stored_chunks": "KV chunks stored (each a block's pages and its header).",
    "stored_bytes": "Bytes of KV chunks stored.",
    "published": "Publications made READY, every chunk durable.",
    "restored": "Requests restored from a publication (claimed, loaded, verified, copied, acknowledged).",
    "restored_bytes": "Bytes of KV chunks loaded for restores.",
    "restored_checked_in_copy_bytes": "Bytes of restored chunks checked as they were copied out of host staging "
    "into the paged cache (one pass over them; on a GPU the daemon checks them in place as they land).",
    "restore_failures": "Restores that failed (their blocks reported to vLLM as load errors).",
}
TIMES = {
    "store": "One store call: a batch of chunks copied out and durable.",
    "publish": "One publish: the READY record durable.",
    "restore": "One request's restore, claim to acknowledgement.",
    "ready_wait": "A decode's wait for its publication to be READY, from the step that scheduled its load.",
    # scheduler half
    "load_wait": "A decode's wait for its KV (WAITING_FOR_REMOTE_KVS): from the step that allocated its blocks "
    "to the step that heard its restore done or failed.",
}
BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


def empty() -> dict[str, Any]:
    return {**{k: 0 for k in COUNTS}, **{k: [] for k in TIMES}}


def is_empty(data: dict[str, Any]) -> bool:
    return not any(data.get(k, 0) for k in COUNTS) and not any(data.get(k) for k in TIMES)


class Recorder:
    """Counts and latencies from any thread (the engine's, the mover's,
    the prepare pool's), taken by the engine thread once a step."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data = empty()

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.data[key] += n

    def time(self, key: str, seconds: float) -> None:
        with self.lock:
            self.data[key].append(seconds)

    def take(self) -> dict[str, Any] | None:
        """What was recorded since the last take (None: nothing)."""
        with self.lock:
            if is_empty(self.data):
                return None
            out, self.data = self.data, empty()
        return out
