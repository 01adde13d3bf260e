"""The connector's counters and latencies, through vLLM's connector-stats
hooks: each half's ``get_kv_connector_stats`` answers what it did since the
last call; vLLM merges the ranks' and the scheduler's (``aggregate``), logs
``reduce()`` every interval, and hands the same dict to
``PdstorPromMetrics.observe``, which feeds the engine's ``/metrics``:

- ``vllm:pdstor_<count>_total`` for every name in ``COUNTS``;
- ``vllm:pdstor_<latency>_seconds`` histograms for every name in ``TIMES``:
  a store call (one batch of chunks, until the daemon has them durable), a
  publish, a restore (claim → ack, every chunk loaded, checked and copied),
  and a decode's wait for its publication to be READY.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ._recorder import BUCKETS, COUNTS, TIMES, empty, is_empty


@dataclass
class PdstorStats(KVConnectorStats):
    """What one half did in an interval: counts and each latency observed."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in COUNTS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        for k in TIMES:
            self.data[k] = [*self.data.get(k, []), *other.data.get(k, [])]
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTS if self.data.get(k, 0)}
        for k in TIMES:
            seen = sorted(self.data.get(k, []))
            if seen:
                out[f"{k} p50 ms"] = round(1000 * seen[len(seen) // 2], 3)
                out[f"{k} max ms"] = round(1000 * seen[-1], 3)
        return out

    def is_empty(self) -> bool:
        return is_empty(self.data)


class PdstorPromMetrics(KVConnectorPromMetrics):
    """The counters and histograms above, one child per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return {i: metric.labels(*values) for i, values in per_engine_labelvalues.items()}

        self.counters = {
            k: per_engine(self._counter_cls(name=f"vllm:pdstor_{k}", documentation=doc, labelnames=labelnames))
            for k, doc in COUNTS.items()
        }
        self.histograms = {
            k: per_engine(
                self._histogram_cls(
                    name=f"vllm:pdstor_{k}_seconds", documentation=doc, buckets=BUCKETS, labelnames=labelnames
                )
            )
            for k, doc in TIMES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, by_engine in self.counters.items():
            n = transfer_stats_data.get(k, 0)
            if n:
                by_engine[engine_idx].inc(n)
        for k, by_engine in self.histograms.items():
            for seconds in transfer_stats_data.get(k, []):
                by_engine[engine_idx].observe(seconds)
