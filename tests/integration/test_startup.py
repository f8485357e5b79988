"""Start-up as an operator meets it, each case a real process: an L2 pool that does not fit is
refused before anything is made, and SIGINT or SIGTERM at any moment of start-up (populate
included) ends the daemon within 1 s with nothing of it left in /dev/shm or its socket directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvcached.server.shm import (MEMORY_HEADROOM_BYTES, epoch_file_prefix, generation_file_prefix, hints_file_name,
                                 memory_room_bytes, segment_name)
from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess, child_env

# "Done when": a stop signal at any moment of start-up ends the daemon within this.
STOP_BOUND_S = 1.0


def shm_leftovers(socket_path: str) -> list[str]:
    """What a daemon on socket_path has in /dev/shm: its segment, hints, epoch and generation files."""
    names = {segment_name(socket_path), hints_file_name(socket_path)}
    prefixes = (epoch_file_prefix(socket_path), generation_file_prefix(socket_path))
    return sorted(n for n in os.listdir("/dev/shm") if n in names or n.startswith(prefixes))


def large_pool_bytes() -> int:
    """A largish pool (1 GiB) that takes a second or more to populate on a 2-core box, smaller where
    the box has less room. A stop's exit waits for the kernel to free what was populated (about
    0.4 s a GiB on such a box: the ``sigint_startup`` drill of bench/drills.py), so a larger one would measure the kernel."""
    room = min(os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize,
               memory_room_bytes()[0] - MEMORY_HEADROOM_BYTES)
    return max(256 << 20, min(1 << 30, room // 4)) // (1 << 20) * (1 << 20)


def test_an_l2_pool_that_does_not_fit_is_refused_in_one_line_before_anything_is_made():
    """--l2-size beyond what /dev/shm and memory hold (64 GiB, or twice the host's memory where that
    is more): exit status 2, one line on stderr naming --l2-size, /dev/shm's free space and the
    memory available, no traceback, nothing populated; nothing in /dev/shm or the socket directory."""
    total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    size = max(64 << 30, 2 * total_bytes)
    daemon = DaemonProcess(l2_size=str(size))
    try:
        result = subprocess.run(daemon.args, env=daemon.env, cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=60)
        lines = result.stderr.splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert "argument --l2-size" in lines[0] and "/dev/shm has" in lines[0] and "available (" in lines[0], lines
        assert "Traceback" not in result.stderr and "populat" not in result.stdout + result.stderr
        assert shm_leftovers(daemon.socket_path) == [] and os.listdir(daemon.socket_dir) == []
    finally:
        daemon.cleanup()


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


# Moments: the daemon's first line (its handlers in place; before that, Python is starting and
# imports it: a SIGINT there is Python's KeyboardInterrupt), then a while after it (paths checked,
# the L3 file opened, the HTTP address bound, the pool being made), and the progress lines of the
# pool's population (a quarter and half of it populated).
MOMENTS = [("starting", 0.0), ("starting", 0.1), ("starting", 0.3), ("populating", "25%"), ("populating", "50%"),
           ("populating", "75%")]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("moment", MOMENTS, ids=[f"{how}-{when}" for how, when in MOMENTS])
def test_a_stop_signal_at_any_moment_of_startup_ends_the_daemon_within_1s_leaving_nothing(signum, moment):
    """SIGINT or SIGTERM at each moment of start-up of a daemon with a largish L2 pool (1 GiB): it
    exits within STOP_BOUND_S, with no traceback, and leaves nothing of it in /dev/shm (segment,
    hints, epoch or generation files) nor in its socket directory (socket, lock file)."""
    how, when = moment
    daemon = DaemonProcess(l2_size=str(large_pool_bytes())).spawn()
    try:
        if how == "starting":
            wait_for_log(daemon, "kvcached starting")
            time.sleep(when)
        else:
            wait_for_log(daemon, f"populating the L2 pool: {when}")
        assert daemon.alive(), daemon.log()
        elapsed_s = stop_and_time(daemon, signum)
        log = daemon.log()
        assert elapsed_s <= STOP_BOUND_S, f"exit took {elapsed_s:.3f} s: {log}"
        assert "Traceback" not in log, log
        assert shm_leftovers(daemon.socket_path) == [], log
        assert os.listdir(daemon.socket_dir) == [], log
    finally:
        daemon.cleanup()
