"""Peers that die: leases of a killed engine are reclaimed, a dead daemon is reported, nothing is left behind."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import numpy as np
import pytest

from engine_client.client import DaemonUnavailable, connect
from kvcached.server.shm import hints_file_name, segment_name
from kvcached.testing.daemon_proc import DaemonProcess
from kvcached.testing.holder import GEOMETRY, start_holder


def l2(status: dict) -> dict:
    (namespace,) = status["namespaces"]
    return namespace["tiers"]["l2"]


def test_sigkilled_engines_lose_leases_through_their_pids(daemon):
    """Engines killed with SIGKILL mid-backup (each holding a lease on a committed prefix and a
    acquire's reserved pages) have every lease reclaimed because their processes are gone
    (seen through their pids, not by missed heartbeats); their pages are free or evictable at
    once, none quarantined. (How soon: bench/drills.py measures it.)"""
    holders = [start_holder(daemon.socket_path, seed=seed) for seed in (1, 2)]
    with connect(daemon.socket_path, timeout_s=5.0, client_name="observer") as observer:
        while observer.status()["pending"]["h2s"]:      # the holders' write-throughs to L3 also lock pages
            time.sleep(0.01)
        before = observer.status(check_integrity=True)
        locked_pages = sum(locked for _, locked, _ in holders)
        private_pages = sum(private for _, _, private in holders)
        assert before["integrity"] == "ok"
        assert before["leases"] == 4
        assert all(s["pid_watched"] for s in before["sessions"]), before["sessions"]
        assert l2(before)["protected_pages"] == locked_pages > 0
        assert l2(before)["private_pages"] == private_pages > 0
        assert l2(before)["evictable_pages"] == 0

        for holder, _, _ in holders:
            holder.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for holder, _, _ in holders:
            holder.wait()
        while True:
            status = observer.status(check_integrity=True)
            if status["leases"] == 0:
                break
            assert time.monotonic() - killed_at < 20.0, f"leases still held 20 s after SIGKILL: {status}"
            time.sleep(0.02)
        assert status["integrity"] == "ok"
        assert status["sessions"] == [] and status["quarantines"] == []
        assert l2(status)["protected_pages"] == 0
        assert l2(status)["private_pages"] == 0 and l2(status)["quarantined_pages"] == 0
        assert l2(status)["evictable_pages"] == locked_pages
        assert status["metrics"]["leases_reclaimed"] == 4
        assert status["metrics"]["sessions_ended_process_gone"] == 2


def test_client_raises_when_daemon_is_killed(daemon):
    """With the daemon SIGKILLed, a match raises DaemonUnavailable within its timeout (or sooner,
    once the heartbeats tell the daemon is down) instead of hanging."""
    client = connect(daemon.socket_path, timeout_s=5.0)
    client.attach(GEOMETRY)       # a loaded machine may take more than 1 s to answer the attach
    client.timeout_s = client._channel.timeout_s = 1.0
    daemon.stop(signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="within timeout_s=1.0|unavailable"):
        client.acquire(np.arange(16, dtype=np.int32))
    assert time.monotonic() - started < 5.0       # a hang is unbounded; 1 s plus scheduling slack
    client.close()       # must not hang either


def test_connect_without_daemon_is_a_clear_error(tmp_path):
    """Connecting to a socket path where no daemon listens raises at once, naming the path."""
    path = str(tmp_path / "nobody.sock")
    with pytest.raises(DaemonUnavailable, match="nobody.sock"):
        connect(path)


def test_sigterm_removes_segment_socket_and_lock():
    """SIGTERM (and SIGINT) shut the daemon down cleanly: exit 0, segment, admission hints file,
    socket and lock file gone."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        daemon = DaemonProcess().start()
        segment = os.path.join("/dev/shm", segment_name(daemon.socket_path))
        hints = os.path.join("/dev/shm", hints_file_name(daemon.socket_path))
        try:
            for path in (segment, hints):
                assert os.path.exists(path) and os.stat(path).st_mode & 0o777 == 0o600, path
            assert os.stat(daemon.socket_dir).st_mode & 0o777 == 0o700
            assert daemon.stop(sig) == 0, daemon.log()
            assert not os.path.exists(segment) and not os.path.exists(hints)
            assert not os.path.exists(daemon.socket_path)
            assert not os.path.exists(daemon.socket_path + ".lock")
        finally:
            daemon.cleanup()


def test_stale_segment_of_killed_daemon_is_cleaned_at_next_start():
    """A daemon killed with SIGKILL leaves its segment; the next daemon on that socket removes and recreates it."""
    first = DaemonProcess().start()
    segment = os.path.join("/dev/shm", segment_name(first.socket_path))
    first_inode = os.stat(segment).st_ino
    first.stop(signal.SIGKILL)
    assert os.path.exists(segment), "SIGKILL cannot clean up; the segment should still be there"
    second = DaemonProcess(socket_dir=first.socket_dir).start()
    try:
        assert "removing stale L2 segment" in second.log()
        assert os.stat(segment).st_ino != first_inode
        with connect(second.socket_path, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
            assert client.status(check_integrity=True)["integrity"] == "ok"
    finally:
        assert second.stop() == 0
        second.cleanup()
    assert not os.path.exists(segment)


def test_second_daemon_on_same_socket_is_refused(daemon):
    """A second daemon on a socket that is being served exits with a clear error and leaves the first intact."""
    second = DaemonProcess(socket_dir=daemon.socket_dir)
    second.log_path = os.path.join(daemon.socket_dir, "second.log")
    with pytest.raises(RuntimeError, match="another kvcached daemon"):
        second.start()
    with connect(daemon.socket_path, timeout_s=5.0) as client:
        client.attach(GEOMETRY)
        assert client.status(check_integrity=True)["integrity"] == "ok"


def test_startup_failure_after_the_server_exists_does_not_hang(tmp_path):
    """If start-up fails after the server is built (here: the readiness callback raises), serve()
    raises promptly and releases everything instead of hanging on open sockets."""
    import asyncio
    import threading

    from kvcached.config import DaemonConfig
    from kvcached.server.startup import serve

    config = DaemonConfig(socket_path=os.path.join(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"), "k.sock"),
                          l2_bytes=4 << 20, l3_bytes=0, max_namespaces=1)
    outcome = []

    def fail(server):
        raise RuntimeError("readiness check failed")

    def target():
        try:
            asyncio.run(serve(config, fail, install_signal_handlers=False))
        except RuntimeError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "serve() hung after a start-up failure"
    assert outcome == ["readiness check failed"]
    assert not os.path.exists(config.socket_path)
    assert not os.path.exists(os.path.join("/dev/shm", segment_name(config.socket_path)))
    assert not os.path.exists(os.path.join("/dev/shm", hints_file_name(config.socket_path)))
    os.rmdir(os.path.dirname(config.socket_path))      # empty: the daemon removed what it made


def test_too_small_pool_is_a_clear_error():
    """An L2 pool below 2 MiB exits with a message, not a traceback."""
    daemon = DaemonProcess(l2_size="1MiB")
    try:
        with pytest.raises(RuntimeError) as error:
            daemon.start()
        assert "at least 2 MiB" in str(error.value) and "Traceback" not in str(error.value)
    finally:
        daemon.cleanup()
