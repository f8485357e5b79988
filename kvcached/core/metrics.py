"""The daemon's counters and time histograms: plain numbers, no I/O.

The status snapshot carries them as they are (``snapshot()``); the HTTP layer turns that
snapshot into Prometheus metrics at scrape time (kvcached/server/metrics.py), so every number is
counted once, here, and read by whoever asks. What may be counted is declared in
kvcached/core/counters.py; anything else raises where it is counted.
"""

from __future__ import annotations

import bisect
from typing import Any

from kvcached.core import counters
from proto.counters import Counter, Counts

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
    """Monotonic counters (also per model, where the caller names one) and time histograms, of the
    counters ``kvcached.core.counters`` declares (DAEMON, HISTOGRAMS) only."""

    def __init__(self) -> None:
        self.counters = Counts(counters.DAEMON)
        self.model_counters: dict[str, Counts] = {}
        self.histograms: dict[str, Histogram] = {}
        self._histogram_keys = Counts(counters.HISTOGRAMS)

    def add(self, counter: Counter, value: int | float = 1, label: str = "", model: str | None = None) -> None:
        """Count ``counter`` (of ``label``, the value of its label); with ``model``, under that model
        too (the total stays the sum)."""
        self.counters.add(counter, value, label)
        if model is not None:
            per_model = self.model_counters.get(model)
            if per_model is None:
                per_model = self.model_counters[model] = Counts(counters.DAEMON)
            per_model.add(counter, value, label)

    def observe(self, histogram: Counter, seconds: float, label: str = "") -> None:
        key = self._histogram_keys.key_of(histogram, label)
        found = self.histograms.get(key)
        if found is None:
            found = self.histograms[key] = Histogram()
        found.observe(seconds)

    def snapshot(self) -> dict[str, int | float]:
        return dict(sorted(self.counters.items()))

    def model_snapshot(self) -> dict[str, dict[str, int | float]]:
        return {model: dict(sorted(counts.items())) for model, counts in sorted(self.model_counters.items())}

    def histogram_snapshot(self) -> dict[str, dict[str, Any]]:
        return {name: histogram.snapshot() for name, histogram in sorted(self.histograms.items())}
