"""Refused requests in the daemon's log: each at DEBUG, and a WARNING summary at most once per interval.

A peer that sends bad requests in a loop must neither fill the log nor slow the daemon with it.
The first refusal after a quiet interval is summarised at once (an operator sees it when it
happens); later ones are counted per error code and summarised when the interval has passed,
at the next refusal or the next ``flush_due`` (the reaper calls it), and at shutdown. Messages
are capped already (``proto.errors.ProtocolError``), so no line echoes a peer's whole value.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

logger = logging.getLogger(__name__)


class RefusalLog:
    """Not thread-safe: the server calls it under its state lock."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.clock = clock
        self._counts: collections.Counter[str] = collections.Counter()
        self._last_message = ""
        self._since = clock() - interval_s       # the first refusal is summarised at once

    def note(self, code_name: str, message: str) -> None:
        logger.debug("refused a request: %s: %s", code_name, message)
        self._counts[code_name] += 1
        self._last_message = f"{code_name}: {message}"
        self.flush_due()

    def flush_due(self) -> None:
        if self._counts and self.clock() - self._since >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        """Log the summary of what was counted since the last one, if anything."""
        now = self.clock()
        if self._counts:
            total = sum(self._counts.values())
            per_code = ", ".join(f"{name} {count}" for name, count in sorted(self._counts.items()))
            logger.warning("refused %d request%s in the last %.1f s (%s); the last: %s", total,
                           "" if total == 1 else "s", now - self._since, per_code, self._last_message)
            self._counts.clear()
        self._since = now
