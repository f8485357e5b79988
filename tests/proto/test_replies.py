"""Reply bodies, defined once in proto/replies.py: what the daemon builds decodes to the same reply,
and a body with a field missing or mistyped is a clear error on the engine's side."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import numpy as np
import pytest
import zmq

from engine_client.client import connect
from proto import codec
from proto.errors import ProtocolError
from proto.messages import KVGeometry, MsgKind
from proto.replies import (NO_DECISION, AcquireReply, AttachInfo, CommitReply, Decision, DetachReply, LookupReply,
                           from_wire, to_wire)

SEED = 314
GEOMETRY = KVGeometry("replies-model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", page_size=4)


def random_acquire_reply(rng: np.random.Generator) -> AcquireReply:
    hit = int(rng.integers(0, 50)) * 4
    return AcquireReply({"l2": hit, "l3": hit + 8}, int(rng.integers(1, 2**62)),
                        rng.integers(0, 4096, size=hit // 4).tolist(), rng.integers(1, 2**62, size=hit // 4).tolist(),
                        reserved_start_token=hit, reserved_page_ids=rng.integers(0, 4096, size=7).tolist(),
                        reserved_generation=int(rng.integers(1, 2**62)), promoted_tokens=int(rng.integers(0, hit + 1)))


def random_lookup_reply(rng: np.random.Generator) -> LookupReply:
    hit = int(rng.integers(0, 50)) * 4
    return LookupReply({"l2": hit, "l3": hit + 8}, "l3", hit + 8, {"l3": float(rng.random()), "recompute": 1.0},
                       "cost")


def attach_info(**changes) -> AttachInfo:
    return AttachInfo(session_id=12, namespace_id=0, shm_path="/dev/shm/x", num_pages=64,
                      bytes_per_page=GEOMETRY.bytes_per_page, heartbeat_interval_s=0.5, session_timeout_s=1.5,
                      max_frame_bytes=1 << 20, daemon_pid=1, protocol_version=2, pid_watched=True,
                      session_grace_s=30.0)._replace(**changes)


def test_every_reply_survives_the_codec_unchanged():
    """to_wire, a frame through the codec, from_wire: the same reply, for each reply type."""
    rng = np.random.default_rng(SEED)
    replies = [random_acquire_reply(rng) for _ in range(20)] + [random_lookup_reply(rng) for _ in range(20)]
    replies += [AcquireReply({"l2": 0}, None, []), attach_info(), DetachReply(3), CommitReply(5, 2)]
    for reply in replies:
        frame = codec.decode(codec.encode(MsgKind.REPLY, 9, to_wire(reply)))
        assert from_wire(type(reply), frame.body) == reply, f"seed {SEED}: {reply}"


@pytest.mark.parametrize("field, value", [
    ("lease_id", "7"), ("lease_id", 1.5), ("host_page_ids", [1, 2.0]), ("host_page_ids", None),
    ("reserved_page_ids", [True]), ("hit_tokens", {"l2": "16"}), ("hit_tokens", [16]), ("reserved_start_token", None),
    ("promoted_tokens", False), ("reserved_generation", 1.0), ("save_skipped", None),
])
def test_a_mistyped_acquire_reply_field_is_named_in_the_error(field, value):
    """A field of the wrong type (bools and floats are not integers) raises ProtocolError naming the
    reply and the field."""
    body = to_wire(random_acquire_reply(np.random.default_rng(SEED)))
    body[field] = value
    with pytest.raises(ProtocolError, match=f"AcquireReply: field '{field}'"):
        from_wire(AcquireReply, body)


@pytest.mark.parametrize("field", AttachInfo._fields)
def test_an_attach_reply_missing_any_field_is_refused(field):
    """Every field of the ATTACH reply is required on the wire: one missing raises ProtocolError naming it."""
    body = to_wire(attach_info())
    del body[field]
    with pytest.raises(ProtocolError, match=f"AttachInfo: the reply has no field '{field}'"):
        from_wire(AttachInfo, body)


def test_fields_a_reply_type_does_not_know_are_ignored():
    """A newer daemon's extra fields (new fields go last) do not break decoding."""
    body = dict(to_wire(CommitReply(1, 0)), later_field=[1, 2])
    assert from_wire(CommitReply, body) == CommitReply(1, 0)


def test_a_client_given_an_acquire_reply_without_its_pages_raises_a_clear_error():
    """Over ipc://, a daemon whose ACQUIRE reply lacks reserved_page_ids: the client's acquire raises
    ProtocolError naming the field, rather than handing the engine a reply with a hole in it."""
    directory = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
    socket_path = os.path.join(directory, "fake.sock")
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{socket_path}")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(50):
                continue
            identity, payload = router.recv_multipart()
            frame = codec.decode(payload)
            if frame.kind == MsgKind.ATTACH:
                body = to_wire(attach_info(shm_path=socket_path))
            elif frame.kind == MsgKind.ACQUIRE:
                body = to_wire(AcquireReply({"l2": 0}, 5, [], reserved_page_ids=[3, 4]))
                del body["reserved_page_ids"]
            else:
                body = {}
            router.send_multipart([identity, codec.encode(MsgKind.REPLY, frame.request_id, body)])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with connect(socket_path, timeout_s=2.0) as client:
            client.attach(GEOMETRY)
            with pytest.raises(ProtocolError, match="AcquireReply: the reply has no field 'reserved_page_ids'"):
                client.acquire(np.arange(8, dtype=np.int32), save=True)
    finally:
        stop.set()
        server.join()
        router.close(0)
        context.term()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_decision_goes_on_the_wire_in_the_replies_and_comes_back_whole(rng):
    """The daemon puts the cost model's Decision into a LOOKUP or ACQUIRE reply field by field; the
    engine's decoded reply gives back the same Decision (and an acquire reply without one, NO_DECISION)."""
    restore_tokens = int(rng.integers(1, 100)) * 4
    decision = Decision("l2", restore_tokens, {"l2": float(rng.random()), "recompute": float(rng.random())})
    acquired = AcquireReply({"l2": restore_tokens}, None, [], reserved_start_token=restore_tokens,
                            **decision._asdict(), policy="cost")
    assert from_wire(AcquireReply, to_wire(acquired)).decision == decision
    looked_up = LookupReply({"l2": restore_tokens}, *decision, policy="cost")
    assert from_wire(LookupReply, to_wire(looked_up)).decision == decision
    assert from_wire(AcquireReply, to_wire(random_acquire_reply(rng))).decision == NO_DECISION
