"""L3 over the real wire: restore from L3 after L2 eviction, faults that fall back to recompute."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import tempfile
import threading
import time

import numpy as np
import pytest

from engine_client.client import DaemonDown, DaemonError, DaemonUnavailable, connect
from kvcached.config import DaemonConfig
from kvcached.server import io_workers
from kvcached.server.startup import serve
from proto.errors import ErrorCode
from kvcached.testing.daemon_proc import DaemonProcess
from kvcached.testing.engine_proc import GEOMETRY
from kvcached.testing.engine_proc import run_engine
from kvcached.testing.l3 import back_up_random, l2_l3, wait_for_write_through

PAGE = GEOMETRY.page_size


def test_engine_restores_from_l3_after_l2_evicted_it(tmp_path, rng):
    """Engine A backs up three prefixes; L2 pressure evicts them (L3 keeps them); engine B's match
    promotes them from L3 and restores them bit for bit into different L1 pages."""
    daemon = DaemonProcess(l2_size="2MiB", extra_args=("--max-namespaces", "1")).start()
    try:
        state_path = str(tmp_path / "a.pt")
        # Each process gets its own seed drawn from rng: the same seed would make the same tokens.
        backup = run_engine(daemon.socket_path, "backup", state_path, seed=int(rng.integers(2**31)))
        with connect(daemon.socket_path, timeout_s=5.0, client_name="filler") as filler:
            filler.attach(GEOMETRY)
            status = wait_for_write_through(filler)
            assert status["io"]["h2s"]["bytes"] == backup["pages"] * GEOMETRY.bytes_per_page
            capacity = status["namespaces"][0]["tiers"]["l2"]["capacity_pages"]
            back_up_random(filler, capacity, rng)
            status = wait_for_write_through(filler)
            assert status["namespaces"][0]["tiers"]["l2"]["owned_pages"] == capacity

        restore = run_engine(daemon.socket_path, "restore", state_path, seed=int(rng.integers(2**31)))
        for result in restore["results"]:
            assert result["bit_exact"] and not result["same_pages_as_source"], result
            assert result["restored_tokens"] == result["tokens"] // PAGE * PAGE
        with connect(daemon.socket_path, timeout_s=5.0) as observer:
            status = observer.status(check_integrity=True)
        assert status["integrity"] == "ok"
        assert status["metrics"]["promotions"] >= 3
        assert status["io"]["s2h"]["bytes"] == backup["pages"] * GEOMETRY.bytes_per_page
        assert status["io"]["s2h"]["failures"] == 0
    finally:
        assert daemon.stop() == 0
        daemon.cleanup()


def test_temporary_l3_file_leaves_nothing_behind(rng):
    """Without --l3-path the L3 file is a temporary file whose name is removed as soon as the daemon
    opens it: it works (write-through happens) and nothing is left after exit, SIGKILL included."""
    daemon = DaemonProcess().start()
    try:
        with connect(daemon.socket_path, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
            back_up_random(client, 4, rng)
            status = wait_for_write_through(client)
        path = status["daemon"]["l3_file"]
        assert path and status["io"]["h2s"]["count"] == 1 and status["io"]["h2s"]["failures"] == 0
        assert not os.path.exists(path)
        daemon.stop(signal.SIGKILL)
        assert not os.path.exists(path)
    finally:
        daemon.cleanup()


def evicted_prefix(client, rng) -> np.ndarray:
    """A prefix that is in L3 but no longer in L2."""
    tokens = back_up_random(client, 6, rng)
    status = wait_for_write_through(client)
    back_up_random(client, status["namespaces"][0]["tiers"]["l2"]["capacity_pages"], rng)
    wait_for_write_through(client)
    assert l2_l3(client, tokens) == (0, 6 * PAGE)
    return tokens


def start_daemon_with_l3_file() -> tuple[DaemonProcess, str]:
    """A daemon with a 2 MiB L2 (256 pages of this geometry) and a 64 MiB L3 file at a known path."""
    socket_dir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    l3_path = os.path.join(socket_dir, "l3.bin")
    daemon = DaemonProcess(l2_size="2MiB", socket_dir=socket_dir,
                           extra_args=("--max-namespaces", "1", "--l3-path", l3_path, "--l3-size", "64MiB"))
    return daemon.start(), l3_path


def test_l3_file_truncated_underneath_falls_back_to_recompute(rng):
    """With the L3 file truncated under the daemon, a promotion's short read fails: the match
    replies with what L2 has (nothing), counts the fallback, publishes nothing, keeps serving."""
    daemon, l3_path = start_daemon_with_l3_file()
    try:
        with connect(daemon.socket_path, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
            tokens = evicted_prefix(client, rng)
            os.truncate(l3_path, 0)
            reply = client.acquire(tokens)
            assert reply.hit_tokens["l2"] == 0 and reply.promoted_tokens == 0
            status = client.status(check_integrity=True)
            assert status["integrity"] == "ok"
            assert status["metrics"]["restore_fallbacks"] == 1
            assert status["io"]["s2h"]["failures"] == 1
            assert status["namespaces"][0]["tiers"]["l2"]["private_pages"] == 0
            assert l2_l3(client, tokens)[0] == 0          # nothing half-read was published
    finally:
        assert daemon.stop() == 0
        daemon.cleanup()


RUNNING_SERVERS: list = []     # (event loop, Server) of the in-process daemon running now


@contextlib.contextmanager
def inprocess_daemon_with(**overrides):
    """The daemon's real loop and socket in a thread of this process, so faults can be injected into its I/O."""
    socket_dir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    config = DaemonConfig(**{"socket_path": os.path.join(socket_dir, "kvcached.sock"), "l2_bytes": 2 << 20,
                             "l3_bytes": 64 << 20, "max_namespaces": 1, **overrides})
    ready = threading.Event()
    servers = RUNNING_SERVERS

    def on_ready(server):
        servers.append((asyncio.get_running_loop(), server))
        ready.set()

    thread = threading.Thread(target=lambda: asyncio.run(serve(config, on_ready, install_signal_handlers=False)))
    thread.start()
    assert ready.wait(20), "in-process daemon did not start"
    try:
        yield config
    finally:
        loop, server = servers.pop()
        if thread.is_alive():             # a test may have stopped it already
            loop.call_soon_threadsafe(server.stop_event.set)
        thread.join(20)
        assert not thread.is_alive()
        os.rmdir(socket_dir)


@pytest.fixture
def inprocess_daemon():
    with inprocess_daemon_with() as config:
        yield config


def test_read_error_falls_back_and_write_error_is_counted(inprocess_daemon, monkeypatch, rng):
    """EIO on an L3 read: the match falls back to L2 only and private pages return. ENOSPC on an L3
    write: the write-through fails, nothing gains L3 residency, the slots return. The daemon keeps serving."""
    with connect(inprocess_daemon.socket_path, timeout_s=5.0) as client:
        client.attach(GEOMETRY)
        tokens = evicted_prefix(client, rng)

        def failing_preadv(*args):
            raise OSError(errno.EIO, "injected read error")

        monkeypatch.setattr(io_workers, "_preadv", failing_preadv)
        reply = client.acquire(tokens)
        assert reply.hit_tokens["l2"] == 0 and reply.promoted_tokens == 0
        status = client.status(check_integrity=True)
        assert status["integrity"] == "ok" and status["io"]["s2h"]["failures"] == 1
        assert status["metrics"]["restore_fallbacks"] == 1

        monkeypatch.setattr(io_workers, "_pwrite", lambda fd, data, offset: 0)     # a full disk
        fresh = back_up_random(client, 3, rng)
        status = wait_for_write_through(client)
        assert status["integrity"] == "ok" and status["io"]["h2s"]["failures"] == 1
        assert l2_l3(client, fresh) == (3 * PAGE, 0)
        l3 = status["namespaces"][0]["tiers"]["l3"]
        assert l3["private_pages"] == 0 and l3["free_pages"] + l3["owned_pages"] == l3["capacity_pages"]

        monkeypatch.undo()                  # the disk recovers: the next promotion works
        reply = client.acquire(tokens)
        assert reply.hit_tokens["l2"] == 6 * PAGE and reply.promoted_tokens == 6 * PAGE
        client.release(reply.lease_id)
        assert client.flush() == []
        assert client.status(check_integrity=True)["integrity"] == "ok"


def test_l3_file_removed_underneath_keeps_serving_from_the_open_file(rng):
    """Removing the L3 file's name does not lose data: the daemon's open descriptor still reads it,
    so a promotion of an evicted prefix succeeds and nothing is counted as a failure."""
    daemon, l3_path = start_daemon_with_l3_file()
    try:
        with connect(daemon.socket_path, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
            tokens = evicted_prefix(client, rng)
            os.unlink(l3_path)
            reply = client.acquire(tokens)
            assert reply.hit_tokens["l2"] == 6 * PAGE and reply.promoted_tokens == 6 * PAGE
            client.release(reply.lease_id)
            status = client.status(check_integrity=True)
            assert status["integrity"] == "ok" and status["io"]["s2h"]["failures"] == 0
            assert status["io"]["s2h"]["extents_per_io"] == 1.0     # contiguous slots into contiguous pages
    finally:
        assert daemon.stop() == 0
        daemon.cleanup()


def hold_reads(monkeypatch) -> threading.Event:
    """Every L3 read of the (in-process) daemon waits until the returned event is set (10 s at most)."""
    real_preadv = io_workers._preadv
    gate = threading.Event()

    def held_preadv(*args):
        assert gate.wait(10.0), "the test never let the L3 read go on"
        return real_preadv(*args)

    monkeypatch.setattr(io_workers, "_preadv", held_preadv)
    return gate


def test_an_acquire_that_times_out_does_not_leak_its_lease(inprocess_daemon, monkeypatch, rng):
    """An acquire slower than the client's timeout (a slow L3 read) raises DaemonUnavailable; the lease its
    late reply carries is released by the client, so the daemon is left holding nothing."""
    with connect(inprocess_daemon.socket_path, timeout_s=5.0) as client:
        client.attach(GEOMETRY)
        tokens = evicted_prefix(client, rng)
        gate = hold_reads(monkeypatch)
        client._channel.timeout_s = 0.1
        with pytest.raises(DaemonUnavailable, match="ACQUIRE"):
            client.acquire(tokens)
        client._channel.timeout_s = 5.0
        gate.set()                            # the promotion completes, its reply comes late
        assert client.flush() == []           # waits for the late reply and releases its lease
        status = client.status(check_integrity=True)
        assert status["integrity"] == "ok" and status["leases"] == 0
        assert status["namespaces"][0]["tiers"]["l2"]["protected_pages"] == 0


def test_flush_waits_for_the_late_reply_of_a_cancelled_promoting_match(inprocess_daemon, monkeypatch, rng):
    """A match that promotes from L3 is answered after its read, later than requests sent after it.
    Cancelled at once, its lease is still released by the next flush(), with no sleep in between."""
    with connect(inprocess_daemon.socket_path, timeout_s=5.0) as client:
        client.attach(GEOMETRY)
        tokens = evicted_prefix(client, rng)
        gate = hold_reads(monkeypatch)
        pending = client.acquire_async(tokens)
        assert client.status()["leases"] == 0      # answered before the match: the read is held
        pending.cancel()
        gate.set()
        assert client.flush() == []
        status = client.status(check_integrity=True)
        assert status["integrity"] == "ok" and status["leases"] == 0
        assert status["metrics"]["promotions"] == 1


def test_a_promoting_match_cut_short_by_shutdown_gets_shutting_down_and_leaks_nothing(monkeypatch, rng):
    """Stopping the daemon while a match waits for its L3 read: the match is answered with
    SHUTTING_DOWN (never with a reply as if the read had failed), and its pages go back first.
    The client may see the daemon's SHUTDOWN notice (sent to the session's heartbeat socket)
    before that reply, on its other socket: it then gives the match up as DaemonDown, naming the
    shutdown; either way no match reply is taken for a read that did not happen."""
    with inprocess_daemon_with() as config:
        with connect(config.socket_path, timeout_s=2.0) as client:     # its detach finds no daemon
            client.attach(GEOMETRY)
            tokens = evicted_prefix(client, rng)
            gate = hold_reads(monkeypatch)
            pending = client.acquire_async(tokens)
            client.status()                      # handled after the match: its move is spawned
            loop, server = RUNNING_SERVERS[-1]
            state = server.state
            loop.call_soon_threadsafe(server.stop_event.set)
            deadline = time.monotonic() + 10.0
            while not shutdown_cancelled_every_task(server):
                assert time.monotonic() < deadline, "shutdown did not cancel the promoting match"
                time.sleep(0.005)
            gate.set()
            with pytest.raises((DaemonError, DaemonDown)) as raised:
                pending.result()
            if isinstance(raised.value, DaemonError):
                assert raised.value.code == ErrorCode.SHUTTING_DOWN
            else:
                assert "shutting down" in str(raised.value), raised.value
        state.check_integrity()
        assert not state.moves, "the cut-short move was never finished"
        l2 = state.status()["namespaces"][0]["tiers"]["l2"]
        assert l2["private_pages"] == 0 and l2["free_pages"] + l2["owned_pages"] == l2["capacity_pages"], l2


def shutdown_cancelled_every_task(server) -> bool:
    """Whether the server's shutdown has begun and cancelled every task it had (a task cancelled
    before its I/O started is gone already). stop_event is set after the acquire's task was spawned
    (both are queued on the loop in that order), so the acquire's task is among them."""
    if not server.stop_event.is_set():
        return False
    try:
        return all(task.cancelling() for task in list(server._tasks))
    except RuntimeError:        # the loop changed the set while we read it: look again
        return False


def test_write_through_backlog_is_bounded(rng):
    """Past max_pending_writes, committed pages skip L3 (counted as policy skips) instead of queueing
    writes that would keep L2 pages locked."""
    with inprocess_daemon_with(max_pending_writes=0) as config:
        with connect(config.socket_path, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
            tokens = back_up_random(client, 4, rng)
            status = wait_for_write_through(client)
            assert status["metrics"]["h2s_policy_skips"] == 1
            assert status["io"]["h2s"]["count"] == 0 and status["io"]["h2s"]["failures"] == 0
            assert l2_l3(client, tokens) == (4 * PAGE, 0)
            assert status["namespaces"][0]["tiers"]["l3"]["private_pages"] == 0
