"""Seeing attached engines die: one pidfd per watched session, read by the event loop.

A pidfd becomes readable once its process has exited, every thread of it (a zombie counts: its
memory, file descriptors and so its CUDA contexts are gone already). An engine's pid means
something here only if the engine runs in this daemon's pid namespace, and it names that engine
only if the process behind it started when the engine says it did (pids are reused): the ATTACH
carries both, and a session whose process cannot be checked so is watched by heartbeats alone.
"""

from __future__ import annotations

import asyncio
import os
from typing import Callable

from proto import procfs


def open_pidfd(pid: int, pid_namespace_id: int, start_time: int) -> tuple[int | None, str]:
    """A pidfd of the engine process (pid, namespace, start time), or None and why not."""
    if not hasattr(os, "pidfd_open"):
        return None, "this system has no pidfd_open"
    if pid_namespace_id == 0 or start_time == 0:
        return None, "the engine did not say its pid namespace and start time"
    if pid_namespace_id != procfs.pid_namespace_id():
        return None, "the engine runs in another pid namespace"
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        return None, f"pidfd_open({pid}) failed: {exc}"
    # Checked after opening: if the start time still matches, the pidfd is of the same process
    # (had it exited before the open, the pid would now be another's, or nobody's).
    if procfs.start_time(pid) != start_time:
        os.close(pidfd)
        return None, f"pid {pid} is not the engine's process any more (start time differs)"
    return pidfd, ""


class PidWatcher:
    """pidfds of watched sessions, each read by the event loop; ``on_gone(session_id)`` runs on
    the loop once that process has exited. Every method runs on the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_gone: Callable[[int], None]):
        self._loop = loop
        self._on_gone = on_gone
        self._pidfds: dict[int, int] = {}       # session id -> pidfd

    def add(self, session_id: int, pidfd: int) -> None:
        assert session_id not in self._pidfds, f"session {session_id:x} is watched already"
        self._pidfds[session_id] = pidfd
        self._loop.add_reader(pidfd, self._readable, session_id)

    def _readable(self, session_id: int) -> None:
        self.discard(session_id)
        self._on_gone(session_id)

    def session_ids(self) -> list[int]:
        return list(self._pidfds)

    def discard(self, session_id: int) -> None:
        pidfd = self._pidfds.pop(session_id, None)
        if pidfd is not None:
            self._loop.remove_reader(pidfd)
            os.close(pidfd)

    def close(self) -> None:
        for session_id in list(self._pidfds):
            self.discard(session_id)
