"""DaemonState's peer restores in-process: registrations, publications, who may read whom, the
peer candidate of lookups and matches, and what a session's end takes with it."""

from __future__ import annotations

import numpy as np
import pytest

from kvcached.core.daemon import DaemonState
from proto.errors import ErrorCode, ProtocolError
from proto.messages import KVGeometry
from proto.schema import Acquire, Commit, Lookup, PeerPublish, PeerRegister, Release

GEOMETRY = KVGeometry("m", num_layers=4, num_kv_heads=4, head_dim=128, dtype="float32", page_size=8)
PAGE = GEOMETRY.page_size
NUM_BLOCKS = 64


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ended():
    return []


@pytest.fixture
def state(ended):
    return DaemonState(4 << 20, max_namespaces=2, session_timeout_s=1.5, clock=FakeClock(), peer_end_sink=ended.append)


def register(state, session, device="gpu-0", transport="cuda"):
    request = PeerRegister.parse({
        "session_id": session.session_id, "transport": transport, "device_id": device, "layout": "layer",
        "dtype": "float32", "num_blocks": NUM_BLOCKS, "storages": [{"handle": b"x" * 64, "size": 1 << 20}],
        "tensors": [{"storage": 0, "offset": 0, "shape": [2, NUM_BLOCKS, 8], "stride": [8 * NUM_BLOCKS, 8, 1]}]})
    export = state.peer_register(session.session_id, request)
    state.peer_ready(export, f"/dev/shm/epochs-{export.peer_id:x}", 64)
    return export


def attach(state, pid, pid_namespace_id=7, geometry=GEOMETRY):
    session, _ = state.attach(geometry, pid=pid, pid_namespace_id=pid_namespace_id, process_start_time=pid * 10)
    return session


def publish(state, session, token_ids, block_ids, epochs, start_page=0, removed=()):
    state.peer_publish(session.session_id, PeerPublish.parse({
        "session_id": session.session_id, "removed": list(removed),
        "runs": [{"token_ids": token_ids.tobytes(), "start_page": start_page, "block_ids": list(block_ids),
                  "epochs": list(epochs)}] if block_ids else []}))


def test_a_published_prefix_is_offered_to_other_engines(state, rng, seed):
    """What A publishes is B's peer candidate (lookup: the tokens; match: A's peer id, blocks and
    epochs); A is never its own candidate; PEER_LIST gives B A's registration with its epoch file."""
    a, b = attach(state, 1), attach(state, 2)
    export_a, export_b = register(state, a), register(state, b)
    tokens = rng.integers(0, 1 << 30, 6 * PAGE, dtype=np.int32)
    blocks = rng.choice(NUM_BLOCKS, 5, replace=False).tolist()
    epochs = (2 * rng.integers(1, 1000, 5)).tolist()
    publish(state, a, tokens, blocks, epochs)
    state.check_integrity()
    assert state.lookup(Lookup(b.session_id, tokens.tobytes(), prefetch=True)).hit_tokens["peer"] == 5 * PAGE, f"seed {seed}"
    reply = state.acquire(Acquire(b.session_id, tokens.tobytes()))
    assert (reply.peer_id, reply.peer_block_ids, reply.peer_epochs) == (export_a.peer_id, blocks, epochs)
    assert reply.hit_tokens["peer"] == 5 * PAGE and reply.lease_id is None
    assert state.lookup(Lookup(a.session_id, tokens.tobytes(), prefetch=True)).hit_tokens["peer"] == 0
    listed = state.peer_list(b.session_id)
    assert [p["peer_id"] for p in listed] == [export_a.peer_id]
    assert listed[0]["epochs_path"] == export_a.epochs_path and listed[0]["pid"] == 1
    assert [p["peer_id"] for p in state.peer_list(a.session_id)] == [export_b.peer_id]
    # A session that did not register gets no candidate and no list.
    c = attach(state, 3)
    assert "peer" not in state.lookup(Lookup(c.session_id, tokens.tobytes(), prefetch=True)).hit_tokens
    assert state.acquire(Acquire(c.session_id, tokens.tobytes())).peer_id == 0 and state.peer_list(c.session_id) == []


@pytest.mark.parametrize("what", ["device", "transport", "pid_namespace", "namespace"])
def test_only_engines_that_can_open_it_are_offered_a_registration(state, rng, what):
    """Another device, another transport, another (or unknown) pid namespace, or another namespace
    (model geometry): no candidate and no listing."""
    a = attach(state, 1)
    register(state, a)
    if what == "namespace":
        b = attach(state, 2, geometry=KVGeometry("other", 4, 4, 128, "float32", 8))
    else:
        b = attach(state, 2, pid_namespace_id=8 if what == "pid_namespace" else 7)
    register(state, b, device="gpu-1" if what == "device" else "gpu-0",
             transport="host" if what == "transport" else "cuda")
    tokens = rng.integers(0, 1 << 30, 2 * PAGE, dtype=np.int32)
    publish(state, a, tokens, [1, 2], [2, 2])
    assert state.lookup(Lookup(b.session_id, tokens.tobytes(), prefetch=True)).hit_tokens["peer"] == 0
    assert state.peer_list(b.session_id) == []


def test_the_longest_run_wins_and_removals_apply_first(state, rng, seed):
    """Of two owners the one holding more leading pages is the candidate; in one publication the
    removals apply before the runs (a block reused and filled again is held once, at its new page)."""
    a, b, c = attach(state, 1), attach(state, 2), attach(state, 3)
    export_a, export_b = register(state, a), register(state, b)
    register(state, c)
    tokens = rng.integers(0, 1 << 30, 4 * PAGE, dtype=np.int32)
    publish(state, a, tokens, [1, 2], [2, 2])
    publish(state, b, tokens, [5, 6, 7], [4, 4, 4])
    assert state.acquire(Acquire(c.session_id, tokens.tobytes())).peer_id == export_b.peer_id, f"seed {seed}"
    # b reuses block 6 for page 2 of another prefix: removed, then published there.
    other = rng.integers(0, 1 << 30, 3 * PAGE, dtype=np.int32)
    publish(state, b, other, [8, 9, 6], [2, 2, 6], removed=[6])
    state.check_integrity()
    reply = state.acquire(Acquire(c.session_id, tokens.tobytes()))
    assert (reply.peer_id, reply.peer_block_ids) == (export_a.peer_id, [1, 2])
    assert state.acquire(Acquire(c.session_id, other.tobytes())).peer_block_ids == [8, 9, 6]


def test_the_peer_is_chosen_by_the_cost_model_and_loses_once_its_copies_measure_slow(state, rng, seed):
    """A match of a registered session with a peer candidate carries the cost model's decision even
    promoting nothing ("none"): at the d2d prior the peer (6 pages) beats L2 (4 pages) and restores all 6;
    once the engine reports d2d copies of 0.5 s, the match and the lookup take L2 instead (peer
    fields still named). An acquire with no peer candidate that promotes nothing asks no decision."""
    a, b = attach(state, 1), attach(state, 2)
    register(state, a)
    register(state, b)
    tokens = rng.integers(0, 1 << 30, 6 * PAGE, dtype=np.int32)
    backup = state.acquire(Acquire(b.session_id, tokens[: 4 * PAGE].tobytes(), save=True))
    state.commit(Commit(b.session_id, backup.lease_id, backup.reserved_page_ids))
    assert backup.choice == ""                       # nothing published yet: no candidate, no decision
    publish(state, a, tokens, rng.choice(NUM_BLOCKS, 6, replace=False).tolist(), [2] * 6)
    reply = state.acquire(Acquire(b.session_id, tokens.tobytes()))
    assert (reply.choice, reply.restore_tokens, reply.hit_tokens["l2"]) == ("peer", 6 * PAGE, 4 * PAGE), f"seed {seed}"
    assert len(reply.peer_block_ids) == 6 and reply.predicted_s["peer"] < reply.predicted_s["l2"]
    state.release(Release(b.session_id, reply.lease_id))
    bytes_per_page = GEOMETRY.bytes_per_page
    state.engine_report(b.session_id, {}, [("d2d", n * bytes_per_page, 0.5 + n * 1e-6)
                                           for n in rng.integers(1, 32, size=8).tolist()])
    reply = state.acquire(Acquire(b.session_id, tokens.tobytes()))
    assert (reply.choice, reply.restore_tokens, len(reply.peer_block_ids)) == ("l2", 4 * PAGE, 6), f"seed {seed}"
    state.release(Release(b.session_id, reply.lease_id))
    looked_up = state.lookup(Lookup(b.session_id, tokens.tobytes(), prefetch=True))
    assert (looked_up.choice, looked_up.restore_tokens) == ("l2", 4 * PAGE)
    skips = state.status()["cost_model"]["engines"][0]["policy_skips_total"]
    assert skips == {"lookup": {"peer": 1}, "match": {"peer": 1}}
    state.check_integrity()


@pytest.mark.parametrize("end", ["detach", "process_gone", "expire"])
def test_a_session_end_takes_its_registration_and_residency(state, ended, rng, end):
    """However an owner's session ends, its registration ends once (the sink hears of it), its
    blocks leave the tree and nobody is offered them or lists it."""
    a, b = attach(state, 1), attach(state, 2)
    export_a = register(state, a)
    register(state, b)
    tokens = rng.integers(0, 1 << 30, 3 * PAGE, dtype=np.int32)
    publish(state, a, tokens, [3, 4, 5], [2, 2, 2])
    namespace = state.namespaces[a.namespace_id]
    if end == "detach":
        state.detach(a.session_id)
    elif end == "process_gone":
        state.process_gone(a.session_id)
    else:
        state.clock.now += 2.0
        state.heartbeat(b.session_id)
        state.expire_sessions()
    state.check_integrity()
    assert ended == [export_a]
    assert namespace.peers.blocks(export_a.peer_id) == 0 and namespace.tree.num_nodes == 0
    assert state.lookup(Lookup(b.session_id, tokens.tobytes(), prefetch=True)).hit_tokens["peer"] == 0
    assert state.peer_list(b.session_id) == []


def test_bad_publications_are_refused(state, rng):
    """A block beyond the registration, a run the tokens do not cover, a publication without a
    registration, and a second registration are refused with a ProtocolError."""
    a, b = attach(state, 1), attach(state, 2)
    register(state, a)
    tokens = rng.integers(0, 1 << 30, 2 * PAGE, dtype=np.int32)
    with pytest.raises(ProtocolError) as error:
        publish(state, a, tokens, [NUM_BLOCKS], [2])
    assert error.value.code == ErrorCode.BAD_PAGES
    with pytest.raises(ProtocolError) as error:
        publish(state, a, tokens, [1, 2, 3], [2, 2, 2])
    assert error.value.code == ErrorCode.BAD_PAGES
    with pytest.raises(ProtocolError) as error:
        publish(state, b, tokens, [1], [2])
    assert error.value.code == ErrorCode.NOT_ATTACHED
    with pytest.raises(ProtocolError):
        register(state, a)
    with pytest.raises(ProtocolError):      # an odd epoch is a block being written
        publish(state, a, tokens, [1], [3])
    state.check_integrity()
    assert state.namespaces[a.namespace_id].tree.num_nodes == 0
