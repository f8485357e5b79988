"""The socket thread's order of work: a lookup's reply goes out before the work the handler leaves
for after it (planning the background promotion of an L3 hit it declined), so that no engine waits
for that planning; a refused request leaves none behind."""

from __future__ import annotations

import pytest
import zmq

from kvcached.config import DaemonConfig
from kvcached.server.loop import Server
from proto import codec
from proto.messages import MsgKind
from proto.schema import Release
from tests.core.test_daemon_cost import make_state, slow_disk
from tests.core.test_daemon_l3 import only_in_l3
from tests.core.test_daemon_state import GEOMETRY

REPLY_WAIT_MS = 5_000        # what "the reply is on its way" may take to arrive; the test fails after it


@pytest.fixture
def wired(tmp_path):
    """A Server on a real ROUTER socket over ipc:// (no socket thread: the test hands it each
    request), an engine's DEALER connected to it, and a state with one session."""
    state = make_state()
    session, _ = state.attach(GEOMETRY, pid=1)
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    address = f"ipc://{tmp_path}/kvcached.sock"
    router.bind(address)
    dealer.connect(address)
    server = Server(DaemonConfig(socket_path=str(tmp_path / "unused.sock"), l2_bytes=2 << 20), state, router,
                    segment=None)
    try:
        yield server, dealer, session.session_id
    finally:
        server.close_wake_sockets()
        router.close(0)
        dealer.close(0)
        context.term()


def handle_next(server: Server, dealer: zmq.Socket, request_id: int, body: dict,
                kind: MsgKind = MsgKind.LOOKUP) -> None:
    dealer.send(codec.encode(kind, request_id, body))
    identity, payload = server.socket.recv_multipart()
    server._handle(identity, payload)


@pytest.mark.parametrize("kind", [MsgKind.LOOKUP, MsgKind.ACQUIRE], ids=["lookup", "acquire"])
def test_a_declined_l3_hits_reply_is_sent_before_its_background_promotion_is_planned(wired, rng, kind):
    """A lookup with prefetch (and an acquire that promotes) of a prefix only a slow L3 holds: the
    decision is recompute, and when the background promotion is planned, the reply is already at
    the engine."""
    server, dealer, session_id = wired
    prefix = only_in_l3(server.state, session_id, rng, 4)
    slow_disk(server.state, rng)
    planned = []
    plan = server._promote_in_background

    def planning(session_id, token_ids, reply):
        planned.append((reply.choice, dealer.poll(REPLY_WAIT_MS)))
        plan(session_id, token_ids, reply)

    server._promote_in_background = planning
    body = {"session_id": session_id, "token_ids": prefix, "policy": "cost"}
    body.update({"save": True, "promote": "wait"} if kind == MsgKind.ACQUIRE else {"prefetch": True})
    handle_next(server, dealer, 7, body, kind)
    assert planned == [("recompute", zmq.POLLIN)]
    reply = codec.decode(dealer.recv())
    assert (reply.kind, reply.request_id, reply.body["choice"]) == (MsgKind.REPLY, 7, "recompute")
    if reply.body.get("lease_id") is not None:
        server.state.release(Release(session_id, reply.body["lease_id"]))
    server.state.check_integrity()


def test_a_refused_request_leaves_no_work_for_after_the_next_reply(wired, rng):
    """A lookup the daemon refuses (an unknown session) after its handler left work for after its
    reply: that work is dropped, not run after the next request's reply."""
    server, dealer, session_id = wired
    ran = []
    lookup = server._handlers[MsgKind.LOOKUP]

    def leaves_work_then_fails(body):
        server._after_reply.append(lambda: ran.append(body["session_id"]))
        return lookup(body)

    server._handlers[MsgKind.LOOKUP] = leaves_work_then_fails
    handle_next(server, dealer, 1, {"session_id": session_id + 1, "token_ids": b""})
    assert codec.decode(dealer.recv()).kind is MsgKind.ERROR
    handle_next(server, dealer, 2, {"session_id": session_id, "token_ids": b""})
    assert codec.decode(dealer.recv()).kind is MsgKind.REPLY
    assert ran == [session_id]


def test_work_after_a_reply_that_fails_is_counted_and_the_next_request_is_served(wired, rng):
    """Work left for after a reply raises: the reply is out already, the failure is counted as an
    internal error, and the next request is answered as usual."""
    server, dealer, session_id = wired
    lookup = server._handlers[MsgKind.LOOKUP]

    def leaves_failing_work(body):
        server._after_reply.append(lambda: 1 / 0)
        return lookup(body)

    server._handlers[MsgKind.LOOKUP] = leaves_failing_work
    handle_next(server, dealer, 1, {"session_id": session_id, "token_ids": b""})
    assert codec.decode(dealer.recv()).kind is MsgKind.REPLY
    assert server.state.metrics.counters["errors_internal"] == 1
    server._handlers[MsgKind.LOOKUP] = lookup
    handle_next(server, dealer, 2, {"session_id": session_id, "token_ids": b""})
    assert codec.decode(dealer.recv()).kind is MsgKind.REPLY
    assert server.state.metrics.counters["errors_internal"] == 1
