"""What the connector tells: pages not moved, counted by cause and logged once per cause; the
counters and the transfers' timings (the cost model's samples), sent to the daemon with its
periodic report, whose status shows them."""

from __future__ import annotations

import logging
import time
from typing import Any

from engine_client.client import DaemonUnavailable
from engine_client.connector.config import COST_REPORT_INTERVAL_S
from engine_client.connector.state import Cause
from proto import counters
from proto.errors import ErrorCode

logger = logging.getLogger(__name__)


class Reporting:
    """``KVConnector``'s counting and reporting (a mixin; its state is set up by
    ``KVConnector.__init__``: counters, _cost_samples, _warned, _reported, _reported_at)."""

    def _skip(self, num_pages: int, cause: Cause) -> None:
        """A save's pages not written: counted, logged once per cause, reported to the daemon."""
        if num_pages <= 0:
            return
        # An outage is logged once, by the client; a policy skip is the daemon's choice (counted).
        if cause not in (Cause.DAEMON_DOWN, Cause.EVICTED_BEFORE_REUSE):
            self._warn_once(f"save_{cause}", f"save pages skipped: {cause}")
        self.counters.add(counters.ENGINE_SAVE_SKIPPED_PAGES, num_pages, cause)
        self.counters.add(counters.ENGINE_SAVE_SKIPPED_PAGES_SUM, num_pages)

    def _count_failure(self, num_pages: int, cause: Cause) -> None:
        """A load's pages not filled (the engine recomputes them)."""
        if cause is not Cause.DAEMON_DOWN:
            self._warn_once(f"load_{cause}", f"load pages not loaded (to be recomputed): {cause}")
        self.counters.add(counters.ENGINE_LOAD_FAILED_PAGES, num_pages, cause)
        self.counters.add(counters.ENGINE_LOAD_FAILED_PAGES_SUM, num_pages)

    def _warn_once(self, cause: str, message: str) -> None:
        key = f"warned_{cause}"
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s (each further one is counted, not logged)", message)

    def _count_refusals(self, errors) -> None:
        for error in errors:
            self.counters.add(counters.ENGINE_REFUSALS, 1, getattr(error.kind, 'name', 'request').lower())
            if error.code != ErrorCode.NOT_ATTACHED:    # sent for a session that ended since: the
                logger.warning("the daemon refused a request: %s", error)   # end was logged already

    def stats(self) -> dict[str, int]:
        stats = self.counters + self.lookups.counters + self.transfer.load_paths
        stats[counters.REQUESTS_OPEN] = self.num_open_requests
        return dict(sorted(stats.items()))

    def _report(self, force: bool = False) -> None:
        """Send changed counters (its status shows them) and the timings taken since the last report
        (its cost model learns from them) to the daemon, at most every report_interval_s."""
        now = time.monotonic()
        if not self.client.is_attached(self._generation):
            return                          # sent again once the session is back (or its successor's pool is in)
        since_s = now - self._reported_at
        if not force and since_s < self.config.report_interval_s and not (
                self._cost_samples and since_s >= COST_REPORT_INTERVAL_S):
            return
        stats = self.stats()
        if not force and stats == self._reported and not self._cost_samples:
            return
        samples = list(self._cost_samples)
        report: dict[str, Any] = {"connector": {
            "layout": self.layout.kind, "page_layout": self.layout.page_layout,
            "block_shape": list(self.layout.block_shape), "transfer": self.transfer.report(),
            "pin": self.host_pool.pin_report(), "counters": stats}}
        try:
            self.client.report(report, samples)
        except (DaemonUnavailable, RuntimeError) as exc:
            logger.debug("report not sent: %s", exc)
            return
        for _ in samples:
            self._cost_samples.popleft()
        self._reported, self._reported_at = stats, now

    def flush_report(self) -> None:
        """Send the counters now (tests, shutdown)."""
        self._report(force=True)
