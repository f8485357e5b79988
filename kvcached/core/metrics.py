"""The daemon's counters and time histograms: plain numbers, no I/O.

The status snapshot carries them as they are (``snapshot()``); the HTTP layer turns that
snapshot into Prometheus metrics at scrape time (kvcached/server/metrics.py), so every number is
counted once, here, and read by whoever asks.
"""

from __future__ import annotations

import bisect
import collections
from typing import Any

# Upper bounds (seconds) of every time histogram: 50 us (a request handled in the socket thread)
# to 10 s (an L3 read of a long prefix from a slow disk), about three per decade.
SECONDS_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
                   100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Counts of observations per bucket of SECONDS_BUCKETS (the last one: above them all)."""

    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(SECONDS_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(SECONDS_BUCKETS, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        cumulative, total = [], 0
        for count in self.counts:
            total += count
            cumulative.append(total)
        return {"le": list(SECONDS_BUCKETS), "cumulative": cumulative, "sum": round(self.sum, 9),
                "count": self.count}


class Metrics:
    """Monotonic counters (also per model, where the caller names one) and time histograms."""

    def __init__(self) -> None:
        self.counters: collections.Counter[str] = collections.Counter()
        self.model_counters: dict[str, collections.Counter[str]] = {}
        self.histograms: dict[str, Histogram] = {}

    def add(self, name: str, value: int | float = 1, model: str | None = None) -> None:
        """Count under ``name``; with ``model``, under that model too (the total stays the sum)."""
        self.counters[name] += value
        if model is not None:
            counters = self.model_counters.get(model)
            if counters is None:
                counters = self.model_counters[model] = collections.Counter()
            counters[name] += value

    def observe(self, name: str, seconds: float) -> None:
        histogram = self.histograms.get(name)
        if histogram is None:
            histogram = self.histograms[name] = Histogram()
        histogram.observe(seconds)

    def snapshot(self) -> dict[str, int | float]:
        return dict(sorted(self.counters.items()))

    def model_snapshot(self) -> dict[str, dict[str, int | float]]:
        return {model: dict(sorted(counters.items())) for model, counters in sorted(self.model_counters.items())}

    def histogram_snapshot(self) -> dict[str, dict[str, Any]]:
        return {name: histogram.snapshot() for name, histogram in sorted(self.histograms.items())}
