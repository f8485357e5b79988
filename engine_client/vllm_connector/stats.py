"""kvcached's counters as vLLM connector stats (``KVCachedStats``, which cross from the workers to
the engine core) and Prometheus counters (``KVCachedPromMetrics``); ``Counts`` keeps one side's."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# kvcached's counters (the connector's, the lookups') as vLLM connector stats, each a Prometheus
# counter "vllm:kvcached_<name>_total" per engine.
METRICS = {
    "lookup_tokens": "prompt tokens asked about (the scheduler's lookups)",
    "lookup_hit_tokens": "tokens kvcached offered the scheduler (its decision: the prefix to hold, vLLM's own hit in)",
    "lookup_failures": "lookups not answered (daemon away or late): counted as misses",
    "loaded_tokens": "tokens loaded from kvcached into vLLM's blocks",
    "load_failed_tokens": "tokens whose load failed: recomputed by vLLM",
    "saved_tokens": "tokens saved into kvcached's L2",
    "save_skipped_tokens": "tokens a save could not write (no space, daemon away, ...)",
    "reattaches": "sessions attached again after the daemon was away",
}


@dataclasses.dataclass
class KVCachedStats(KVConnectorStats):
    """Counter increments since the last report; ``data`` is {name: int} (it crosses processes)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVCachedPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, documentation in METRICS.items():
            counter = self._counter_cls(name=f"vllm:kvcached_{name}", documentation=f"kvcached: {documentation}",
                                        labelnames=labelnames)
            for engine_idx, labelvalues in per_engine_labelvalues.items():
                self._counters[(engine_idx, name)] = counter.labels(*labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self._counters.get((engine_idx, name))
            if counter is not None and value:
                counter.inc(value)


class Counts:
    """Counters of one side, reported as increments."""

    def __init__(self):
        self.total: collections.Counter[str] = collections.Counter()
        self._reported: collections.Counter[str] = collections.Counter()

    def take(self) -> KVCachedStats | None:
        delta = {name: self.total[name] - self._reported[name] for name in self.total
                 if self.total[name] != self._reported[name]}
        if not delta:
            return None
        self._reported = collections.Counter(self.total)
        return KVCachedStats(data=delta)
