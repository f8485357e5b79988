"""What the wire's process identity means (``Attach``'s and peer registrations' ``pid``,
``pid_namespace_id`` and ``process_start_time``), read from /proc here for both sides.

A pid names a process only in its pid namespace and only until the process is gone (pids are
reused): the identity adds the namespace (the inode of /proc/<pid>/ns/pid) and the start time
(field 22 of /proc/<pid>/stat), and 0 stands for a part /proc did not tell.
"""

from __future__ import annotations

import os
from typing import NamedTuple

# Field numbers of proc(5)'s /proc/<pid>/stat, counted from 1 as the manual counts them.
STATE_FIELD = 3
FLAGS_FIELD = 9
START_TIME_FIELD = 22          # when the process started, in clock ticks since boot
# PF_EXITING in field 9, the flags: the process has begun to exit (before its files, and so its
# GPU memory, are released).
_PF_EXITING = 0x4


class ProcessIdentity(NamedTuple):
    """Which process: its pid, its pid namespace and its start time (0: not known)."""

    pid: int
    pid_namespace_id: int = 0
    process_start_time: int = 0

    def same_process(self, other: "ProcessIdentity") -> bool:
        """Whether both name one process; an unknown (0) namespace or start time on either side
        does not tell them apart."""
        def agree(a: int, b: int) -> bool:
            return 0 in (a, b) or a == b

        return (self.pid == other.pid and agree(self.pid_namespace_id, other.pid_namespace_id)
                and agree(self.process_start_time, other.process_start_time))


def own_identity() -> ProcessIdentity:
    """This process's identity; namespace and start time both 0 where /proc does not tell both (a
    daemon then relies on heartbeats)."""
    namespace_id, started = pid_namespace_id(), start_time()
    if namespace_id is None or started is None:
        return ProcessIdentity(os.getpid())
    return ProcessIdentity(os.getpid(), namespace_id, started)


def pid_namespace_id(pid: int | str = "self") -> int | None:
    """The inode of the process's pid namespace; None where /proc does not say."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def stat_fields(pid: int | str = "self") -> dict[int, bytes] | None:
    """The fields of /proc/<pid>/stat from the state on, by field number; None where it cannot be
    read (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    return dict(enumerate(stat[stat.rfind(b")") + 2:].split(), start=STATE_FIELD))


def start_time(pid: int | str = "self") -> int | None:
    """Field 22: when the process started (tells it apart from a later process given its pid)."""
    fields = stat_fields(pid)
    try:
        return int(fields[START_TIME_FIELD]) if fields is not None else None
    except (KeyError, ValueError):
        return None


def running(pid: int, process_start_time: int) -> bool:
    """Whether the process (pid, start time) lives and has not begun to exit (a zombie has)."""
    fields = stat_fields(pid)
    if fields is None:
        return False
    try:
        state, flags = fields[STATE_FIELD], int(fields[FLAGS_FIELD])
        started = int(fields[START_TIME_FIELD])
    except (KeyError, ValueError):
        return False
    return started == process_start_time and state not in (b"Z", b"X", b"x") and not flags & _PF_EXITING
