"""Start-up as an operator meets it: what a daemon left in /dev/shm, a pool large enough for
start-up to take a while, and the time from a signal to its exit."""

from __future__ import annotations

import os
import time

from kvcached.server.shm import (MEMORY_HEADROOM_BYTES, epoch_file_prefix, generation_file_prefix, hints_file_name,
                                 memory_room_bytes, segment_name)
from kvcached.testing.daemon_proc import DaemonProcess


# "Done when": a stop signal at any moment of start-up ends the daemon within this.
STOP_BOUND_S = 1.0


def shm_leftovers(socket_path: str) -> list[str]:
    """What a daemon on socket_path has in /dev/shm: its segment, hints, epoch and generation files."""
    names = {segment_name(socket_path), hints_file_name(socket_path)}
    prefixes = (epoch_file_prefix(socket_path), generation_file_prefix(socket_path))
    return sorted(n for n in os.listdir("/dev/shm") if n in names or n.startswith(prefixes))


def large_pool_bytes() -> int:
    """A largish pool (1 GiB) that takes a second or more to populate on a 2-core box, smaller where
    the box has less room. A stop's exit waits for the kernel to free what was populated (the
    ``sigint_startup`` drill of bench/drills.py measures it), so a larger one would measure the kernel."""
    room = min(os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize,
               memory_room_bytes()[0] - MEMORY_HEADROOM_BYTES)
    return max(256 << 20, min(1 << 30, room // 4)) // (1 << 20) * (1 << 20)


def wait_for_log(daemon: DaemonProcess, text: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in daemon.log():
        assert daemon.alive() and time.monotonic() < deadline, f"no {text!r} in the log: {daemon.log()}"
        time.sleep(0.005)


def stop_and_time(daemon: DaemonProcess, signum: int) -> float:
    started = time.monotonic()
    daemon.proc.send_signal(signum)
    try:
        daemon.proc.wait(30)
    finally:
        elapsed_s = time.monotonic() - started
    return elapsed_s
