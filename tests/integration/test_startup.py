"""Start-up as an operator meets it, each case a real process: an L2 pool that does not fit is
refused before anything is made, and SIGINT or SIGTERM at any moment of start-up (populate
included) ends the daemon within 1 s with nothing of it left in /dev/shm or its socket directory."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess
from kvcached.testing.startup import STOP_BOUND_S, large_pool_bytes, shm_leftovers, stop_and_time, wait_for_log


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
