"""acquire_async over the wire: a real daemon process, replies kept for the pending acquire they
answer, and no lease left behind by a acquire that is given up."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from typing import NamedTuple

import numpy as np
import pytest
import zmq

from engine_client import channel as channel_module
from engine_client.channel import Channel
from engine_client.client import ConnectionState, DaemonDown, DaemonUnavailable, connect
from proto import codec
from proto.errors import ProtocolError
from proto.messages import KVGeometry, MsgKind
from kvcached.testing.daemon_proc import PATIENT_DAEMON, DaemonProcess, stop_process

GEOMETRY = KVGeometry("async-model", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", page_size=16)


@pytest.fixture
def client(daemon):
    with connect(daemon.socket_path, timeout_s=5.0, client_name="async") as engine:
        engine.attach(GEOMETRY)
        yield engine


def back_up(client, rng, num_pages: int) -> np.ndarray:
    tokens = rng.integers(1, 2**31 - 1, size=num_pages * GEOMETRY.page_size, dtype=np.int32)
    reply = client.acquire(tokens, save=True)
    assert len(reply.reserved_page_ids) == num_pages
    client.commit(reply.lease_id, reply.reserved_page_ids)
    assert client.flush() == []
    return tokens


def free_l2_pages(status: dict) -> int:
    (namespace,) = status["namespaces"]
    return namespace["tiers"]["l2"]["free_pages"]


def assert_idle_and_sound(client) -> dict:
    assert client.flush() == []
    status = client.status(check_integrity=True)
    assert status["integrity"] == "ok"
    assert status["leases"] == 0, status
    return status


def test_replies_reach_their_own_pending_acquire_whatever_the_order(client, rng):
    """Three acquires in flight, collected last to first, with a blocking request in between: each
    result is the reply to its own tokens (the hit lengths differ), and no lease is left after."""
    prefixes = [back_up(client, rng, num_pages) for num_pages in (1, 3, 5)]
    pending = [client.acquire_async(tokens) for tokens in prefixes]
    assert client.status()["leases"] == 3      # a blocking request while they are in flight; each holds a lease
    replies = [p.result() for p in reversed(pending)][::-1]
    for tokens, reply in zip(prefixes, replies):
        assert reply.hit_tokens["l2"] == len(tokens), reply
        assert len(reply.host_page_ids) == len(tokens) // GEOMETRY.page_size
        client.release(reply.lease_id)
    assert_idle_and_sound(client)


def test_pending_acquire_reserves_pages_like_acquire(client, rng):
    tokens = rng.integers(1, 2**31 - 1, size=4 * GEOMETRY.page_size, dtype=np.int32)
    reply = client.acquire_async(tokens, save=True).result()
    assert reply.reserved_start_token == 0 and len(reply.reserved_page_ids) == 4
    client.commit(reply.lease_id, reply.reserved_page_ids)
    again = client.acquire(tokens)
    assert again.hit_tokens["l2"] == len(tokens)
    client.release(again.lease_id)
    assert_idle_and_sound(client)


@pytest.mark.parametrize("reply_arrived", [False, True], ids=["before-reply", "after-reply"])
def test_cancelled_acquire_leaves_no_lease(client, reply_arrived, rng):
    """A cancelled acquire's lease (on a hit, plus reserved pages) is released whether its reply
    had arrived when it was cancelled or arrives later: afterwards no lease is left and every
    reserved page is free again."""
    cached = back_up(client, rng, 2)
    free_before = free_l2_pages(client.status())
    tokens = np.concatenate([cached, rng.integers(1, 2**31 - 1, size=3 * GEOMETRY.page_size, dtype=np.int32)])
    pending = client.acquire_async(tokens, save=True)
    if reply_arrived:
        client.status()          # the daemon answers in order: the acquire's reply is in by now
    pending.cancel()
    status = assert_idle_and_sound(client)
    assert free_l2_pages(status) == free_before
    with pytest.raises(RuntimeError, match="already ended"):
        pending.result()


def test_result_twice_is_an_error(client, rng):
    pending = client.acquire_async(rng.integers(1, 2**31 - 1, size=16, dtype=np.int32))
    reply = pending.result()
    assert reply.lease_id is None and reply.hit_tokens["l2"] == 0
    with pytest.raises(RuntimeError, match="already ended"):
        pending.result()
    pending.cancel()           # a no-op once ended
    assert_idle_and_sound(client)


def test_acquire_interrupted_while_waiting_leaves_no_lease(client, monkeypatch, rng):
    """An exception inside result() (here: a failure while receiving) gives the acquire up: its lease
    is released once its reply arrives."""
    tokens = back_up(client, rng, 2)
    pending = client.acquire_async(tokens, save=True)
    channel = client._channel

    def broken_receive(deadline):
        monkeypatch.undo()
        raise KeyboardInterrupt

    monkeypatch.setattr(channel, "_receive", broken_receive)
    with pytest.raises(KeyboardInterrupt):
        pending.result()
    assert_idle_and_sound(client)


def test_dropped_pending_acquire_leaves_no_lease(client, rng):
    """A pending acquire dropped without result() or cancel() (an exception between acquire_async and
    result, say) is given up when it is collected: no lease is left."""
    tokens = back_up(client, rng, 3)
    pending = client.acquire_async(tokens)
    del pending
    gc.collect()
    assert_idle_and_sound(client)


def test_result_after_close_is_a_clear_error(daemon, rng):
    client = connect(daemon.socket_path, timeout_s=5.0)
    client.attach(GEOMETRY)
    pending = client.acquire_async(rng.integers(1, 2**31 - 1, size=16, dtype=np.int32))
    client.close()
    with pytest.raises(DaemonUnavailable, match="closed"):
        pending.result()
    pending.cancel()


def test_wait_for_a_reply_gives_nothing_up_when_it_is_not_in_time(rng):
    """A acquire sent to a stopped daemon (SIGSTOP; a patient one, whose session outlasts the stop):
    wait(0.05) is False and the acquire is still pending; resumed, wait() is True once the reply is
    in, and result() is that reply (the prefix's hit), its lease then released; no lease is left."""
    process = DaemonProcess(extra_args=PATIENT_DAEMON).start()
    try:
        with connect(process.socket_path, timeout_s=5.0, client_name="wait") as client:
            client.attach(GEOMETRY)
            tokens = back_up(client, rng, 3)
            stop_process(process.proc.pid)
            try:
                pending = client.acquire_async(tokens)
                assert not pending.wait(0.05), "a reply from a stopped daemon"
                assert not pending.ready()
            finally:
                os.kill(process.proc.pid, signal.SIGCONT)
            assert pending.wait(30.0), "no reply from the resumed daemon"
            reply = pending.result()
            assert reply.hit_tokens["l2"] == len(tokens), reply
            client.release(reply.lease_id)
            assert_idle_and_sound(client)
    finally:
        process.cleanup()


def test_wait_for_a_reply_that_cannot_come_returns_at_once(daemon, client, rng):
    """A acquire in flight when the daemon is SIGKILLed: once the client knows the session is gone,
    wait(60) returns True at once (well before its bound) and result() raises DaemonDown, rather
    than the wait sitting out its timeout for a reply that cannot come."""
    tokens = back_up(client, rng, 2)
    stop_process(daemon.proc.pid)
    pending = client.acquire_async(tokens)
    daemon.stop(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while client.state is not ConnectionState.DOWN:
        assert time.monotonic() < deadline, "the client never saw the daemon go"
        time.sleep(0.01)
    started = time.monotonic()
    assert pending.wait(60.0)
    assert time.monotonic() - started < 30, "the wait sat out its bound"
    with pytest.raises(DaemonDown):
        pending.result()


def test_a_given_up_acquire_answered_after_a_flush_still_has_its_lease_released(tmp_path):
    """An acquire that waits for a promotion is answered once the read is done, after the replies
    to later requests. Given up, and outlived by a flush's heartbeat (the flush stops waiting for
    it once the client's timeout has passed), its reply, when it comes, still hands its lease to be
    released (``on_orphan_lease``, with the generation it was sent for). A daemon over a real
    ipc:// socket, scripted here to answer in that order."""
    context = zmq.Context()
    daemon = context.socket(zmq.ROUTER)
    daemon.bind(f"ipc://{tmp_path}/kvcached.sock")
    channel = Channel(context, str(tmp_path / "kvcached.sock"), timeout_s=0.05)
    orphans = []
    channel.on_orphan_lease = lambda lease_id, generation: orphans.append((lease_id, generation))
    try:
        acquire_id = channel.begin(MsgKind.ACQUIRE, {"session_id": 1, "promote": "wait"})
        engine, acquire = daemon.recv_multipart()
        assert codec.decode(acquire).request_id == acquire_id
        channel.abandon(acquire_id, MsgKind.ACQUIRE, generation=3)
        time.sleep(2 * channel.timeout_s)          # the promotion's read takes longer than the timeout
        heartbeat_id = channel.begin(MsgKind.HEARTBEAT, {"session_id": 1})
        engine, _ = daemon.recv_multipart()
        daemon.send_multipart([engine, codec.encode(MsgKind.REPLY, heartbeat_id, {})])
        assert channel.wait_for(heartbeat_id, MsgKind.HEARTBEAT, timeout_s=5.0) == {}
        assert channel.abandoned_acquires() == 0, "a flush waits for a reply older than the timeout"
        daemon.send_multipart([engine, codec.encode(MsgKind.REPLY, acquire_id, {"lease_id": 42})])
        channel.absorb_until(lambda: bool(orphans), time.monotonic() + 5.0)
        assert orphans == [(42, 3)], "the late reply's lease was never handed on to be released"
    finally:
        channel.close()
        daemon.close(0)
        context.term()


class NewerAcquireReply(NamedTuple):
    """An acquire reply as a client of a newer protocol would read it: a field the daemon does not send."""

    lease_id: int | None
    a_field_of_a_newer_protocol: int


def test_an_acquire_reply_that_does_not_decode_has_its_lease_released(client, rng):
    """A reply to an acquire that does not decode (here: a field it lacks) raises ProtocolError from
    result(), and the lease it names is released: none is left, every reserved page free again."""
    cached = back_up(client, rng, 2)
    free_before = free_l2_pages(client.status())
    tokens = np.concatenate([cached, rng.integers(1, 2**31 - 1, size=2 * GEOMETRY.page_size, dtype=np.int32)])
    pending = client.acquire_async(tokens, save=True)
    pending.reply_type = NewerAcquireReply
    with pytest.raises(ProtocolError, match="a_field_of_a_newer_protocol"):
        pending.result()
    status = assert_idle_and_sound(client)
    assert free_l2_pages(status) == free_before


def test_a_pending_acquire_dropped_on_another_thread_is_given_up_by_the_owner(daemon, client, rng, monkeypatch):
    """A pending acquire whose last reference goes on another thread (the garbage collector may run
    on any, the heartbeat thread's included) does not use the client's single-thread channel
    there: nothing is sent or given up on that thread. Its lease is released at the owner's next
    use of the client: once a flush returns, the daemon holds none."""
    tokens = back_up(client, rng, 2)
    channel = client._channel
    threads_of_use = []
    for name in ("send", "abandon", "drain"):
        real = getattr(channel, name)

        def recorded(*args, _real=real, **kwargs):
            threads_of_use.append(threading.get_ident())
            return _real(*args, **kwargs)
        monkeypatch.setattr(channel, name, recorded)
    held = [client.acquire_async(tokens)]
    assert client.status()["leases"] == 1          # the acquire's reply is in, its lease held
    threads_of_use.clear()
    dropper = threading.Thread(target=lambda: (held.pop(), gc.collect()))
    dropper.start()
    dropper.join()
    assert not held and threads_of_use == [], "the channel was used on the thread that dropped the acquire"
    assert client.flush() == []
    assert not channel.pending_async, "the flush returned before the dropped acquire's release was handled"
    with connect(daemon.socket_path, timeout_s=5.0, client_name="observer") as observer:
        assert observer.status()["leases"] == 0, "the flush returned before the dropped acquire's release was handled"
    assert set(threads_of_use) == {threading.get_ident()}
    assert_idle_and_sound(client)


def test_a_late_acquire_reply_beyond_the_given_up_records_still_has_its_lease_released(tmp_path, monkeypatch):
    """More acquires given up than the channel keeps records of (MAX_PENDING_ASYNC, here 1): the late
    reply of one without a record still hands the lease it names on to be released (under the
    current session: generation 0), as the one with a record does under its own. A daemon over a
    real ipc:// socket, scripted here."""
    monkeypatch.setattr(channel_module, "MAX_PENDING_ASYNC", 1)
    context = zmq.Context()
    daemon = context.socket(zmq.ROUTER)
    daemon.bind(f"ipc://{tmp_path}/kvcached.sock")
    channel = Channel(context, str(tmp_path / "kvcached.sock"), timeout_s=5.0)
    orphans = []
    channel.on_orphan_lease = lambda lease_id, generation: orphans.append((lease_id, generation))
    try:
        acquire_ids = [channel.begin(MsgKind.ACQUIRE, {"session_id": 1, "promote": "wait"}) for _ in range(2)]
        engine = None
        for acquire_id in acquire_ids:
            engine, _ = daemon.recv_multipart()
            channel.abandon(acquire_id, MsgKind.ACQUIRE, generation=3)
        assert len(channel.abandoned) == 1
        for lease_id, acquire_id in zip((41, 42), acquire_ids):
            daemon.send_multipart([engine, codec.encode(MsgKind.REPLY, acquire_id, {"lease_id": lease_id})])
        channel.absorb_until(lambda: len(orphans) == 2, time.monotonic() + 5.0)
        assert orphans == [(41, 3), (42, 0)], "a late reply's lease was never handed on to be released"
    finally:
        channel.close()
        daemon.close(0)
        context.term()
