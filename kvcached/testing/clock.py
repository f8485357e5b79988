"""A clock the test moves by hand, for the daemon's state (``DaemonState(clock=...)``) run in-process."""

from __future__ import annotations


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
