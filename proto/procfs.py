"""What the wire's process identity means (``Attach.process_start_time``, peer registrations'
``process_start_time``): fields of /proc/<pid>/stat, read here for both sides."""

from __future__ import annotations

# Field numbers of proc(5)'s /proc/<pid>/stat, counted from 1 as the manual counts them.
STATE_FIELD = 3
FLAGS_FIELD = 9
START_TIME_FIELD = 22          # when the process started, in clock ticks since boot


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
