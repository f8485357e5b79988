"""Every integer field of ATTACH, fuzzed over the real socket: out-of-range, huge and mistyped values
each get a typed error reply (never INTERNAL), the daemon logs no traceback and keeps serving."""

from __future__ import annotations

import os

import pytest

from proto import procfs
from proto.errors import ErrorCode
from proto.messages import PROTOCOL_VERSION, MsgKind
from proto.schema import MAX_PID
from tests.integration.test_wire_errors import GEOMETRY, RawPeer, assert_still_serving

# Where a value is a wrong type or beyond what any kernel or geometry allows.
FUZZ_VALUES = [-1, 0, 1, MAX_PID, MAX_PID + 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -2**63, 1.5, True, "7",
               None, [1]]
ATTACH_FIELDS = ["pid", "pid_namespace_id", "process_start_time", "previous_session_id"]
GEOMETRY_FIELDS = ["num_layers", "num_kv_heads", "head_dim", "page_size", "tp_rank", "tp_size"]


@pytest.fixture
def peer(daemon):
    raw = RawPeer(daemon.socket_path)
    yield raw
    raw.close()


@pytest.fixture
def bystander(daemon):
    from engine_client.client import connect

    client = connect(daemon.socket_path, timeout_s=5.0, client_name="bystander")
    client.attach(GEOMETRY)
    yield client
    client.close()


def watchable_attach_body() -> dict:
    """An ATTACH the daemon would watch by pidfd (this process, in the daemon's pid namespace), so
    that a bad pid reaches the pid watching too."""
    return {"protocol_version": PROTOCOL_VERSION, "pid": os.getpid(), "geometry": GEOMETRY.to_wire(),
            "pid_namespace_id": os.stat("/proc/self/ns/pid").st_ino,
            "process_start_time": procfs.start_time(os.getpid())}


def test_attach_pid_beyond_what_linux_allows_gets_a_typed_error(daemon, peer, bystander):
    """pid 2^31 (and 0, -1, 2^22, the kernel's PID_MAX_LIMIT) is refused with BAD_FRAME naming the
    range, not an INTERNAL error; the daemon logs no traceback and keeps serving."""
    for pid in (2**31, 2**22, 0, -1):
        frame = peer.request(MsgKind.ATTACH, {**watchable_attach_body(), "pid": pid})
        assert frame.kind == MsgKind.ERROR and frame.body["code"] == ErrorCode.BAD_FRAME, frame
        assert f"1..{MAX_PID}" in frame.body["message"], frame.body
    assert "Traceback" not in daemon.log()
    assert_still_serving(bystander, daemon)


@pytest.mark.parametrize("field", ATTACH_FIELDS + [f"geometry.{name}" for name in GEOMETRY_FIELDS]
                         + ["geometry.block_shape"])
def test_every_integer_field_of_attach_is_validated(daemon, peer, bystander, field):
    """Each value of FUZZ_VALUES in the field: a reply, or an error reply with a typed code (not
    INTERNAL); no traceback in the daemon's log; other engines are still served."""
    for value in FUZZ_VALUES:
        body = watchable_attach_body()
        if field == "geometry.block_shape":
            body["geometry"] = {**body["geometry"], "block_shape": [value, 2, 32]}
        elif field.startswith("geometry."):
            body["geometry"] = {**body["geometry"], field.split(".", 1)[1]: value}
        else:
            body[field] = value
        frame = peer.request(MsgKind.ATTACH, body)
        if frame.kind == MsgKind.REPLY:
            detach = peer.request(MsgKind.DETACH, {"session_id": frame.body["session_id"]})
            assert detach.kind == MsgKind.REPLY, detach
        else:
            assert frame.kind == MsgKind.ERROR and frame.body["code"] != ErrorCode.INTERNAL, (value, frame.body)
    assert "Traceback" not in daemon.log()
    assert_still_serving(bystander, daemon)
