"""A side's first attach, off the engine's path: the scheduler's and the worker's sessions are made
by an ``Attacher``, which keeps trying in a thread of its own while no daemon answers."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Generic, TypeVar

from engine_client.channel import DaemonError, DaemonUnavailable

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class Attacher(Generic[_T]):
    """A side's session, attached once: ``attach()`` is tried at once; while it fails for want of
    a daemon, a thread of our own tries again every retry_interval_s, never on the engine's path.
    ``result`` is None until then. Once attached, the client re-attaches by itself after outages."""

    def __init__(self, what: str, attach: Callable[[], _T], close: Callable[[_T], None], retry_interval_s: float):
        self.what = what
        self.result: _T | None = None
        self._attach = attach
        self._close = close
        self._retry_interval_s = retry_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not self._try(first=True):
            self._thread = threading.Thread(target=self._retry, name="kvcached-attach", daemon=True)
            self._thread.start()

    def _try(self, first: bool = False) -> bool:
        try:
            result = self._attach()
        except (DaemonUnavailable, DaemonError) as exc:
            if first:
                logger.warning("kvcached: %s could not attach (%s); running without it until the daemon answers",
                               self.what, exc)
            return False
        if self._stop.is_set():             # closed meanwhile
            self._close(result)
            return True
        if not first:
            logger.info("kvcached: %s is attached", self.what)
        self.result = result
        return True

    def _retry(self) -> None:
        while not self._stop.wait(self._retry_interval_s):
            if self._try():
                return

    def close(self, timeout_s: float) -> _T | None:
        """Stop trying (waiting at most timeout_s for an attempt under way); what was attached."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.result
