"""Bad input over the real wire: each gets an error reply to that peer only, and the daemon keeps serving."""

from __future__ import annotations

import collections
import re

import msgpack
import numpy as np
import pytest
import zmq

from engine_client.client import DaemonError, connect
from proto import codec
from proto.errors import ErrorCode
from proto.messages import PROTOCOL_VERSION, KVGeometry, MsgKind
from kvcached.testing.daemon_proc import DaemonProcess

GEOMETRY = KVGeometry("test-model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=4)


class RawPeer:
    """A peer that can send anything, bypassing the client's own checks."""

    def __init__(self, socket_path: str):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"ipc://{socket_path}")

    def send_raw(self, payload: bytes, timeout_s: float = 5.0) -> codec.Frame:
        self.socket.send(payload)
        assert self.socket.poll(int(timeout_s * 1000)), "the daemon did not answer"
        return codec.decode(self.socket.recv(), max_frame_bytes=1 << 30)

    def request(self, kind: int, body, request_id: int = 7) -> codec.Frame:
        return self.send_raw(msgpack.packb([kind, request_id, body], use_bin_type=True))

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


@pytest.fixture
def peer(daemon):
    raw = RawPeer(daemon.socket_path)
    yield raw
    raw.close()


@pytest.fixture
def bystander(daemon):
    """An attached engine that must keep being served while another peer misbehaves."""
    client = connect(daemon.socket_path, timeout_s=5.0, client_name="bystander")
    client.attach(GEOMETRY)
    yield client
    client.close()


def assert_still_serving(client, daemon) -> None:
    tokens = np.random.randint(0, 50_000, size=32, dtype=np.int32)      # seeded (kvcached/testing/pytest_plugin.py)
    reply = client.acquire(tokens)
    assert reply.hit_tokens["l2"] == 0
    assert daemon.alive()
    assert client.status(check_integrity=True)["integrity"] == "ok"


def attach_body(**overrides):
    body = {"protocol_version": PROTOCOL_VERSION, "pid": 1, "geometry": GEOMETRY.to_wire()}
    body.update(overrides)
    return body


def assert_error(frame: codec.Frame, code: ErrorCode, request_id: int | None = 7) -> None:
    assert frame.kind == MsgKind.ERROR, frame
    assert frame.body["code"] == code, frame.body
    assert isinstance(frame.body["message"], str) and frame.body["message"]
    if request_id is not None:
        assert frame.request_id == request_id


def test_malformed_msgpack_gets_bad_frame(daemon, peer, bystander):
    """Bytes that are not msgpack get a BAD_FRAME error reply; the daemon keeps serving others."""
    assert_error(peer.send_raw(b"\xc1\xff\x00garbage"), ErrorCode.BAD_FRAME, request_id=0)
    assert_error(peer.send_raw(msgpack.packb({"not": "an array"})), ErrorCode.BAD_FRAME, request_id=0)
    assert_error(peer.request(MsgKind.ACQUIRE, ["body", "is", "a", "list"]), ErrorCode.BAD_FRAME)
    assert_still_serving(bystander, daemon)


def test_unknown_kind_gets_unknown_kind(daemon, peer, bystander):
    """A message kind the protocol does not define, or a reply kind sent as a request, is refused."""
    assert_error(peer.request(250, {}), ErrorCode.UNKNOWN_KIND)
    for retired in (4, 6, 7, 10, 11):    # MATCH, BACKUP_RESERVE, BACKUP_COMMIT, RESERVE_PAGES, COMMIT_PAGES: retired
        assert_error(peer.request(retired, {"session_id": bystander.info.session_id}), ErrorCode.UNKNOWN_KIND)
    assert_error(peer.request(MsgKind.REPLY, {}), ErrorCode.UNKNOWN_KIND)
    assert_still_serving(bystander, daemon)


def test_wrong_protocol_version_is_refused(daemon, peer, bystander):
    """Attach with another protocol version gets VERSION_MISMATCH and creates no session; an engine
    newer than the daemon is told to upgrade the daemon, not itself."""
    reply = peer.request(MsgKind.ATTACH, attach_body(protocol_version=PROTOCOL_VERSION + 1))
    assert_error(reply, ErrorCode.VERSION_MISMATCH)
    assert reply.body["message"] == (
        f"protocol version mismatch: daemon speaks {PROTOCOL_VERSION}, engine sent {PROTOCOL_VERSION + 1}; "
        "upgrade the kvcached daemon to the engine's version"), reply.body
    assert len(bystander.status()["sessions"]) == 1
    assert_still_serving(bystander, daemon)


def v1_attach_body() -> dict:
    """What a protocol 1 engine sent to attach (its AttachInfo then carried arena_offset_bytes)."""
    return {"protocol_version": 1, "pid": 1, "geometry": GEOMETRY.to_wire(), "client_name": "engine-v1"}


def test_a_version_1_engine_gets_one_error_naming_both_versions(daemon, peer, bystander):
    """A protocol 1 engine's ATTACH gets one VERSION_MISMATCH error whose message names the daemon's
    version (2) and the engine's (1) and says what to upgrade; no session is made, and the daemon
    logs one line for it, not a traceback."""
    reply = peer.request(MsgKind.ATTACH, v1_attach_body())
    assert_error(reply, ErrorCode.VERSION_MISMATCH)
    message = reply.body["message"]
    assert message == ("protocol version mismatch: daemon speaks 2, engine sent 1; "
                       "upgrade the engine's kvcached-sidecar to the daemon's version"), message
    assert "\n" not in message
    assert len(bystander.status()["sessions"]) == 1
    assert_still_serving(bystander, daemon)
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()


def test_a_version_1_match_frame_gets_a_clear_error_not_a_misread(daemon, peer, bystander):
    """A protocol 1 engine's MATCH (kind 4) and BACKUP_COMMIT (kind 7) frames, well formed for that
    protocol, each get an UNKNOWN_KIND error naming the retired kind and the daemon's version: no
    lease is taken, nothing is committed, and the daemon serves on."""
    session_id = bystander.info.session_id
    tokens = np.arange(16, dtype="<i4").tobytes()
    match = {"session_id": session_id, "token_ids": tokens, "reserve_backup": True, "promote_l3": True,
             "lock": True}
    reply = peer.request(4, match)
    assert_error(reply, ErrorCode.UNKNOWN_KIND)
    assert reply.body["message"].startswith("message kind 4 (MATCH) is not in protocol 2"), reply.body
    reply = peer.request(7, {"session_id": session_id, "lease_id": 1, "host_page_ids": [0]})
    assert_error(reply, ErrorCode.UNKNOWN_KIND)
    assert reply.body["message"].startswith("message kind 7 (BACKUP_COMMIT) is not in protocol 2"), reply.body
    status = bystander.status(check_integrity=True)
    assert status["integrity"] == "ok" and status["leases"] == 0, status["leases"]
    assert_still_serving(bystander, daemon)


@pytest.mark.parametrize("geometry_change", [
    {"dtype": "int7"},
    {"num_layers": 0},
    {"num_kv_heads": -1},
    {"page_size": "16"},
    {"tp_rank": 3, "tp_size": 2},
    {"dtype": []},
    {"num_layers": 1024, "head_dim": 4096, "num_kv_heads": 1024},   # one page larger than the arena
])
def test_bad_geometry_is_refused(daemon, peer, bystander, geometry_change):
    """An invalid geometry, or one whose page cannot fit the pool, gets GEOMETRY_MISMATCH."""
    geometry = dict(GEOMETRY.to_wire(), **geometry_change)
    assert_error(peer.request(MsgKind.ATTACH, attach_body(geometry=geometry)), ErrorCode.GEOMETRY_MISMATCH)
    assert_still_serving(bystander, daemon)


def test_missing_and_mistyped_fields_are_refused(daemon, peer, bystander):
    """Each field a peer sends is validated: missing or mistyped fields get BAD_FRAME."""
    session_id = bystander.info.session_id
    assert_error(peer.request(MsgKind.ATTACH, {"protocol_version": PROTOCOL_VERSION, "pid": 1}), ErrorCode.BAD_FRAME)
    for kind in (MsgKind.LOOKUP, MsgKind.ACQUIRE):
        assert_error(peer.request(kind, {"session_id": session_id}), ErrorCode.BAD_FRAME)
        assert_error(peer.request(kind, {"session_id": session_id, "token_ids": b"abc"}), ErrorCode.BAD_FRAME)
        assert_error(peer.request(kind, {"session_id": session_id, "token_ids": [1, 2, 3]}), ErrorCode.BAD_FRAME)
    tokens = np.arange(8, dtype="<i4").tobytes()
    for bad in ({"save": 1}, {"promote": "later"}, {"promote": True}):
        assert_error(peer.request(MsgKind.ACQUIRE, {"session_id": session_id, "token_ids": tokens, **bad}),
                     ErrorCode.BAD_FRAME)
    for bad in ({"prefetch": 1}, {"tp_group": "yes"}):
        assert_error(peer.request(MsgKind.LOOKUP, {"session_id": session_id, "token_ids": tokens, **bad}),
                     ErrorCode.BAD_FRAME)
    assert_error(peer.request(MsgKind.RELEASE, {"session_id": session_id, "lease_id": -1}), ErrorCode.BAD_FRAME)
    assert_error(peer.request(MsgKind.COMMIT, {"session_id": session_id, "lease_id": 1,
                                               "page_ids": ["x"]}), ErrorCode.BAD_FRAME)
    commit = {"session_id": session_id, "lease_id": 1, "page_ids": [0]}
    for bad in ({"page_ids": [1.0]}, {"page_ids": "0"}, {"lease_id": None}, {"ack": 1}):
        assert_error(peer.request(MsgKind.COMMIT, {**commit, **bad}), ErrorCode.BAD_FRAME)
    assert_still_serving(bystander, daemon)


def test_unknown_session_is_refused(daemon, peer, bystander):
    """A request naming a session the daemon never issued gets NOT_ATTACHED."""
    for kind in (MsgKind.LOOKUP, MsgKind.ACQUIRE):
        assert_error(peer.request(kind, {"session_id": 12345, "token_ids": b"\x00" * 16}), ErrorCode.NOT_ATTACHED)
    assert_still_serving(bystander, daemon)


def test_oversize_frame_is_refused(daemon, peer, bystander):
    """A frame over max_frame_bytes gets FRAME_TOO_LARGE, not a disconnect or a crash."""
    huge = {"session_id": bystander.info.session_id, "token_ids": b"\x01\x00\x00\x00" * (5 << 20)}
    assert_error(peer.request(MsgKind.ACQUIRE, huge), ErrorCode.FRAME_TOO_LARGE)
    assert_still_serving(bystander, daemon)


def test_page_ids_out_of_range_or_not_leased(daemon, bystander, rng):
    """Commit with page ids out of range gets BAD_PAGES; pages of another lease or session get NOT_LEASED."""
    other = connect(daemon.socket_path, timeout_s=5.0, client_name="other")
    other.attach(GEOMETRY)
    try:
        tokens = rng.integers(0, 50_000, size=64, dtype=np.int32)
        mine = bystander.acquire(tokens, save=True)
        theirs = other.acquire(tokens[::-1].copy(), save=True)
        assert mine.reserved_page_ids and theirs.reserved_page_ids
        num_pages = bystander.info.num_pages

        with pytest.raises(DaemonError) as error:
            bystander.request_raw(MsgKind.COMMIT, {"session_id": bystander.info.session_id,
                                                   "lease_id": mine.lease_id, "page_ids": [num_pages]})
        assert error.value.code == ErrorCode.BAD_PAGES
        with pytest.raises(DaemonError) as error:
            bystander.request_raw(MsgKind.COMMIT, {"session_id": bystander.info.session_id,
                                                   "lease_id": mine.lease_id, "page_ids": theirs.reserved_page_ids})
        assert error.value.code == ErrorCode.NOT_LEASED
        with pytest.raises(DaemonError) as error:     # someone else's lease
            bystander.request_raw(MsgKind.RELEASE, {"session_id": bystander.info.session_id,
                                                    "lease_id": theirs.lease_id})
        assert error.value.code == ErrorCode.NOT_LEASED
        # The refused requests changed nothing: both leases are still live and intact.
        status = bystander.status(check_integrity=True)
        assert status["integrity"] == "ok" and status["leases"] == 2
        bystander.release(mine.lease_id)
        other.release(theirs.lease_id)
        assert bystander.flush() == [] and other.flush() == []
    finally:
        other.close()
    assert_still_serving(bystander, daemon)


def test_release_twice_reports_unknown_lease_asynchronously(daemon, bystander, rng):
    """The second release of a lease gets UNKNOWN_LEASE, delivered through poll/flush, not raised inline."""
    tokens = rng.integers(0, 50_000, size=16, dtype=np.int32)
    reply = bystander.acquire(tokens, save=True)
    bystander.release(reply.lease_id)
    bystander.release(reply.lease_id)      # does not block or raise here
    errors = bystander.flush()
    assert [e.code for e in errors] == [ErrorCode.UNKNOWN_LEASE]
    assert errors[0].kind == MsgKind.RELEASE
    assert_still_serving(bystander, daemon)


def test_unacknowledged_release_replies_only_on_error(daemon, bystander, rng):
    """A release sent with ack=False gets no reply when it succeeds, and an error reply when it fails."""
    tokens = rng.integers(0, 50_000, size=16, dtype=np.int32)
    reply = bystander.acquire(tokens, save=True)
    peer = RawPeer(daemon.socket_path)
    try:
        session_id = bystander.info.session_id
        body = {"session_id": session_id, "lease_id": reply.lease_id, "ack": False}
        peer.socket.send(msgpack.packb([MsgKind.RELEASE, 21, body], use_bin_type=True))
        peer.socket.send(msgpack.packb([MsgKind.RELEASE, 22, body], use_bin_type=True))   # now unknown
        barrier = peer.request(MsgKind.HEARTBEAT, {"session_id": session_id}, request_id=23)
        # The first release succeeded silently; the second's error arrives before the barrier reply.
        assert_error(barrier, ErrorCode.UNKNOWN_LEASE, request_id=22)
        after = codec.decode(peer.socket.recv())
        assert after.kind == MsgKind.REPLY and after.request_id == 23
    finally:
        peer.close()
    assert bystander.status(check_integrity=True)["leases"] == 0


def test_engine_report_shows_in_status(daemon, bystander):
    """An engine's report (e.g. its chosen transfer backends) appears under its session in the status."""
    bystander.report({"transfer": {"d2h": "triton", "h2d": "torch"}})
    assert bystander.flush() == []
    (session,) = bystander.status()["sessions"]
    assert session["report"] == {"transfer": {"d2h": "triton", "h2d": "torch"}}
    peer = RawPeer(daemon.socket_path)
    try:
        too_big = {"session_id": bystander.info.session_id, "report": {"x": "y" * 70_000}}
        assert_error(peer.request(MsgKind.ENGINE_REPORT, too_big), ErrorCode.BAD_FRAME)
    finally:
        peer.close()


def test_bad_restore_policies_and_cost_samples_are_refused_and_feed_nothing(daemon, peer, bystander):
    """An acquire or lookup naming an unknown policy, or a negative engine hit, and an engine report
    whose cost samples are malformed (unknown direction, negative or non-finite seconds, a float
    size, too many) get BAD_FRAME; the cost model takes in none of them."""
    session_id = bystander.info.session_id
    request = {"session_id": session_id, "token_ids": np.arange(8, dtype="<i4").tobytes()}
    for kind in (MsgKind.LOOKUP, MsgKind.ACQUIRE):
        for bad in ({"policy": "sometimes"}, {"policy": 1}, {"local_hit_tokens": -4}):
            assert_error(peer.request(kind, {**request, **bad}), ErrorCode.BAD_FRAME)
    report = {"session_id": session_id, "report": {}}
    for samples in ([["s2h", 4096, 0.1]], [["h2d", 4096, -1.0]], [["h2d", 4096, float("nan")]],
                    [["h2d", 4096.0, 0.1]], [["prefill", 64]], "h2d", [["h2d", 1, 0.1]] * 1025):
        assert_error(peer.request(MsgKind.ENGINE_REPORT, {**report, "cost_samples": samples}), ErrorCode.BAD_FRAME)
    (engine,) = bystander.status()["cost_model"]["engines"] or [None]
    assert engine is None or all(d["samples_total"] == 0 for d in engine["directions"].values()), engine
    assert_still_serving(bystander, daemon)


def test_status_never_reveals_session_ids(daemon, bystander):
    """Session ids are capabilities: the status names sessions by a digest, so a peer that reads the
    status cannot detach another engine or release its leases."""
    import json

    status = bystander.status()
    session_id = bystander.info.session_id
    text = json.dumps(status)
    assert f"{session_id:x}" not in text and str(session_id) not in text
    assert len(status["sessions"]) == 1 and status["sessions"][0]["session"]


def test_error_replies_and_log_lines_never_echo_a_whole_value(daemon, peer):
    """Fields far too large (a 1.37 MB string as the session id, huge lists, a map of 100,000 unknown
    geometry fields, ...) are refused with an error whose message quotes at most a short head of the
    value: every reply is under 2 KiB, and so is every line of the daemon's log."""
    big_string = "7" * 1_370_000
    huge_list = list(range(300_000))
    geometry = dict(GEOMETRY.to_wire())
    cases = [
        (MsgKind.ACQUIRE, {"session_id": big_string, "token_ids": b""}, ErrorCode.BAD_FRAME),
        (MsgKind.RELEASE, {"session_id": 1, "lease_id": huge_list}, ErrorCode.BAD_FRAME),
        (MsgKind.COMMIT, {"session_id": 1, "lease_id": 1, "page_ids": [big_string]}, ErrorCode.BAD_FRAME),
        (MsgKind.ATTACH, attach_body(protocol_version=huge_list), ErrorCode.VERSION_MISMATCH),
        (MsgKind.ATTACH, attach_body(geometry={**geometry, "num_layers": big_string}), ErrorCode.GEOMETRY_MISMATCH),
        (MsgKind.ATTACH, attach_body(geometry={**geometry, **{f"f{i}": i for i in range(100_000)}}),
         ErrorCode.BAD_FRAME),
    ]
    for kind, body, code in cases:
        reply = peer.request(kind, body)
        assert_error(reply, code)
        assert len(codec.encode(reply.kind, reply.request_id, reply.body)) < 2048, reply.body["message"][:200]
    assert_error(peer.send_raw(msgpack.packb([int(MsgKind.STATUS), big_string, {}])), ErrorCode.BAD_FRAME, 0)
    assert daemon.stop() == 0
    log = daemon.log()
    assert "refused" in log
    longest = max(log.splitlines(), key=len)
    assert len(longest) < 2048, longest[:300]


def test_refused_requests_are_summarised_per_interval_not_logged_one_by_one(daemon, peer):
    """Hundreds of refused requests leave no line each in the daemon's log (INFO): they are counted per
    error code and summarised (the first at once, the rest when the interval ends or at shutdown),
    and the counts add up to what was sent."""
    sent = {"NOT_ATTACHED": 0, "BAD_FRAME": 0}
    for index in range(400):
        if index % 3:
            assert_error(peer.request(MsgKind.ACQUIRE, {"session_id": 12345, "token_ids": b""}), ErrorCode.NOT_ATTACHED)
            sent["NOT_ATTACHED"] += 1
        else:
            assert_error(peer.send_raw(b"\xc1 not msgpack"), ErrorCode.BAD_FRAME, request_id=0)
            sent["BAD_FRAME"] += 1
    assert daemon.stop() == 0
    lines = [line for line in daemon.log().splitlines() if "refused" in line]
    summaries = [re.search(r"refused \d+ requests? in the last [\d.]+ s \(([^)]*)\)", line) for line in lines]
    assert all(summaries), lines             # no line but summaries
    assert all(" WARNING " in line for line in lines)
    assert 1 <= len(summaries) <= 3, lines   # 10 s apart, at most, and one at shutdown
    counted = collections.Counter()
    for summary in summaries:
        for entry in summary.group(1).split(", "):
            name, count = entry.split()
            counted[name] += int(count)
    assert counted == sent


def test_each_refused_request_is_logged_at_debug():
    """With --log-level DEBUG, every refused request has its own DEBUG line, naming its code."""
    daemon = DaemonProcess(l2_size="8MiB", extra_args=("--l3-size", "0", "--log-level", "DEBUG"))
    try:
        daemon.start()
        raw = RawPeer(daemon.socket_path)
        try:
            for _ in range(25):
                assert_error(raw.request(MsgKind.ACQUIRE, {"session_id": 12345, "token_ids": b""}),
                             ErrorCode.NOT_ATTACHED)
        finally:
            raw.close()
        assert daemon.stop() == 0
        lines = [line for line in daemon.log().splitlines() if "refused a request: NOT_ATTACHED" in line]
        assert len(lines) == 25 and all(" DEBUG " in line for line in lines), lines[:3]
    finally:
        daemon.cleanup()


def peer_register_body(session_id: int, **overrides) -> dict:
    body = {"session_id": session_id, "transport": "cuda", "device_id": "gpu-test", "layout": "layer",
            "dtype": "float16", "num_blocks": 8, "storages": [{"handle": b"h" * 64, "size": 4096, "offset": 0}],
            "tensors": [{"storage": 0, "offset": 0, "shape": [2, 8, 4, 2, 16], "stride": [1024, 128, 32, 16, 1]}]}
    body.update(overrides)
    return body


@pytest.mark.parametrize("change", [
    {"transport": "rdma"},
    {"num_blocks": 0},
    {"storages": []},
    {"storages": [{"handle": b"h" * 5000}]},                       # a handle value too long
    {"storages": [{f"k{i}": i for i in range(40)}]},               # too many handle fields
    {"storages": [{"handle": [1, 2]}]},                            # not a scalar
    {"tensors": [{"storage": 1, "offset": 0, "shape": [2], "stride": [1]}]},   # no such storage
    {"tensors": [{"storage": 0, "offset": 0, "shape": [2, 3], "stride": [1]}]},
    {"device_id": 7},
])
def test_bad_peer_registrations_are_refused(daemon, peer, bystander, change):
    """A PEER_REGISTER whose fields are malformed gets BAD_FRAME and registers nothing; the daemon
    keeps serving."""
    body = peer_register_body(bystander.info.session_id, **change)
    assert_error(peer.request(MsgKind.PEER_REGISTER, body), ErrorCode.BAD_FRAME)
    assert "peer" not in bystander.status()["sessions"][0]
    assert_still_serving(bystander, daemon)


def test_bad_peer_publications_are_refused(daemon, bystander, rng):
    """A PEER_PUBLISH before any registration gets NOT_ATTACHED; after one, a block beyond the
    registration or a run its tokens do not cover gets BAD_PAGES, an odd epoch BAD_FRAME; a good
    one is taken; the tree stays intact."""
    session_id = bystander.info.session_id
    tokens = rng.integers(0, 50_000, size=2 * GEOMETRY.page_size, dtype=np.int32).tobytes()
    run = {"token_ids": tokens, "start_page": 0, "block_ids": [1, 2], "epochs": [2, 2]}
    with pytest.raises(DaemonError) as error:
        bystander.request_raw(MsgKind.PEER_PUBLISH, {"session_id": session_id, "runs": [run]})
    assert error.value.code == ErrorCode.NOT_ATTACHED
    reply = bystander.request_raw(MsgKind.PEER_REGISTER, peer_register_body(session_id))
    assert reply["epochs_path"] and reply["peer_id"]
    for bad, code in (({"block_ids": [1, 8]}, ErrorCode.BAD_PAGES), ({"start_page": 1}, ErrorCode.BAD_PAGES),
                      ({"epochs": [2, 3]}, ErrorCode.BAD_FRAME), ({"epochs": [2]}, ErrorCode.BAD_FRAME)):
        with pytest.raises(DaemonError) as error:
            bystander.request_raw(MsgKind.PEER_PUBLISH, {"session_id": session_id, "runs": [{**run, **bad}]})
        assert error.value.code == code, bad
    bystander.request_raw(MsgKind.PEER_PUBLISH, {"session_id": session_id, "runs": [run]})
    status = bystander.status(check_integrity=True)
    assert status["integrity"] == "ok" and status["sessions"][0]["peer"]["published_blocks"] == 2
    assert_still_serving(bystander, daemon)
