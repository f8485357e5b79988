"""Lookups (LOOKUP) in-process: they change nothing, and a TP group's hit is its least rank's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvcached.core.daemon import DaemonState
from kvcached.core.tiers import Tier
from proto.errors import ProtocolError
from proto.messages import KVGeometry
from proto.replies import LookupReply
from proto.schema import Acquire, Commit, Lookup
from kvcached.testing.clock import FakeClock

# 16384-byte pages: one 2 MiB arena per namespace holds 128 pages of 8 tokens.
GEOMETRY = KVGeometry("m", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", page_size=8)
PAGE = GEOMETRY.page_size


def make_state(num_namespaces: int = 1) -> DaemonState:
    return DaemonState(num_namespaces << 21, max_namespaces=num_namespaces, session_timeout_s=1.5, clock=FakeClock())


def tokens(rng, num_pages: int) -> bytes:
    return rng.integers(0, 1 << 30, size=num_pages * PAGE, dtype=np.int32).tobytes()


def back_up(state, session_id, token_bytes) -> None:
    reply = state.acquire(Acquire(session_id, token_bytes, save=True))
    state.commit(Commit(session_id, reply.lease_id, reply.reserved_page_ids))


def test_a_lookup_locks_nothing_and_hands_out_no_pages():
    """A lookup answers the hit per tier but takes no lease, protects no page and names no page id,
    however often it is asked."""
    state = make_state()
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = tokens(np.random.default_rng(1), 5)
    back_up(state, session.session_id, prefix)
    for _ in range(3):
        reply = state.lookup(Lookup(session.session_id, prefix + tokens(np.random.default_rng(2), 2), prefetch=True))
        assert isinstance(reply, LookupReply) and reply.hit_tokens["l2"] == 5 * PAGE
    assert not state.leases and not session.lease_ids
    assert namespace.tree.protected_pages(Tier.L2) == 0
    state.check_integrity()


def test_a_lookup_does_not_change_which_prefix_is_evicted_first():
    """Eviction is least-recently-used: a lookup of the older prefix does not make it recent, so a
    reservation under pressure still evicts it (a locked match of it would have saved it)."""
    state = make_state()
    session, namespace = state.attach(GEOMETRY, pid=1)
    rng = np.random.default_rng(3)
    older, newer = tokens(rng, 60), tokens(rng, 60)
    back_up(state, session.session_id, older)
    state.clock.advance(1.0)
    back_up(state, session.session_id, newer)
    state.clock.advance(1.0)
    state.heartbeat(session.session_id)
    assert state.lookup(Lookup(session.session_id, older, prefetch=True)).hit_tokens["l2"] == 60 * PAGE
    state.clock.advance(1.0)
    reply = state.acquire(Acquire(session.session_id, tokens(rng, 10), save=True))   # evicts 2 pages
    assert len(reply.reserved_page_ids) == 10
    assert state.lookup(Lookup(session.session_id, older, prefetch=True)).hit_tokens["l2"] < 60 * PAGE
    assert state.lookup(Lookup(session.session_id, newer, prefetch=True)).hit_tokens["l2"] == 60 * PAGE
    state.check_integrity()


def test_a_group_lookup_is_the_least_hit_over_the_ranks():
    """With tp_group the hit is, per tier, the least over every rank's namespace, and 0 while a rank
    of the group has not attached; without it, only the asking rank's own hit."""
    state = make_state(num_namespaces=3)
    geometries = [dataclasses.replace(GEOMETRY, tp_size=2, tp_rank=rank) for rank in range(2)]
    rank0, _ = state.attach(geometries[0], pid=1)
    rng = np.random.default_rng(4)
    prefix = tokens(rng, 6)
    back_up(state, rank0.session_id, prefix)
    assert state.lookup(Lookup(rank0.session_id, prefix, prefetch=True)).hit_tokens["l2"] == 6 * PAGE
    assert state.lookup(Lookup(rank0.session_id, prefix, tp_group=True, prefetch=True)).hit_tokens["l2"] == 0   # rank 1 is absent
    rank1, _ = state.attach(geometries[1], pid=2)
    back_up(state, rank1.session_id, prefix[: 4 * PAGE * 4])                           # rank 1 holds 4 pages
    assert state.lookup(Lookup(rank0.session_id, prefix, tp_group=True, prefetch=True)).hit_tokens["l2"] == 4 * PAGE
    assert state.lookup(Lookup(rank1.session_id, prefix, tp_group=True, prefetch=True)).hit_tokens["l2"] == 4 * PAGE
    other_model, _ = state.attach(dataclasses.replace(geometries[1], model_id="other"), pid=3)
    assert state.lookup(Lookup(other_model.session_id, prefix, tp_group=True, prefetch=True)).hit_tokens["l2"] == 0
    state.check_integrity()


@pytest.mark.parametrize("verb, body", [
    (Lookup, {"tp_group": 0}), (Lookup, {"prefetch": "yes"}), (Lookup, {"policy": "sometimes"}),
    (Acquire, {"save": 1}), (Acquire, {"promote": "later"}), (Acquire, {"promote": True}),
])
def test_mistyped_fields_are_refused(verb, body):
    """A field of the wrong type or outside its set is refused at parse, naming the field."""
    with pytest.raises(ProtocolError, match=next(iter(body))):
        verb.parse({"session_id": 1, "token_ids": b"\0" * 4, **body})


def test_a_field_of_another_verb_is_ignored():
    """Fields a request does not define are ignored (proto.schema's rule, so that a newer peer's
    fields do not break an older daemon): a LOOKUP carrying ACQUIRE's save and promote parses as the
    same lookup, and an ACQUIRE carrying LOOKUP's tp_group and prefetch as the same acquire."""
    base = {"session_id": 1, "token_ids": b"\0" * 8, "local_hit_tokens": 1, "policy": "always"}
    assert Lookup.parse({**base, "save": True, "promote": "wait"}) == Lookup.parse(base)
    assert Acquire.parse({**base, "tp_group": True, "prefetch": True}) == Acquire.parse(base)


def test_a_router_peek_needs_no_session_and_changes_nothing():
    """peek (POST /lookup) answers the hit per tier in each namespace of the model and salt asked
    for, or of the geometry asked for, with no session; every node keeps the LRU time and reuse
    mark of its backup and no lock, and the leases and counters stay as they were."""
    state = make_state(num_namespaces=2)
    session, namespace = state.attach(GEOMETRY, pid=1)
    salted_geometry = dataclasses.replace(GEOMETRY, cache_salt="tenant-a")
    salted, _ = state.attach(salted_geometry, pid=2)
    rng = np.random.default_rng(5)
    prefix, other = tokens(rng, 6), tokens(rng, 4)
    backed_up_at = state.clock()
    back_up(state, session.session_id, prefix)
    back_up(state, salted.session_id, other)
    state.clock.advance(1.0)
    before = (state.metrics.snapshot(), len(state.leases))

    def ids(token_bytes: bytes) -> np.ndarray:
        return np.frombuffer(token_bytes, dtype="<i4")

    for _ in range(3):
        [hits] = state.peek(ids(prefix + tokens(rng, 1)[: 3 * 4]), model_id="m")    # 3 tokens more
        assert hits.namespace_id == namespace.namespace_id and hits.hit_tokens == {"l2": 6 * PAGE}
        [hits] = state.peek(ids(prefix[: 3 * PAGE * 4] + tokens(rng, 2)), geometry=GEOMETRY)
        assert hits.hit_tokens == {"l2": 3 * PAGE} and hits.remote_ask is None
    [hits] = state.peek(ids(other), model_id="m")
    assert hits.namespace_id == namespace.namespace_id and hits.hit_tokens == {"l2": 0}
    [hits] = state.peek(ids(other), model_id="m", cache_salt="tenant-a")
    assert hits.geometry == salted_geometry and hits.hit_tokens == {"l2": 4 * PAGE}
    assert state.peek(ids(prefix), model_id="other") == []
    assert state.peek(ids(prefix), geometry=dataclasses.replace(GEOMETRY, tp_size=2)) == []

    nodes = [node for node in namespace.tree.nodes() if node is not namespace.tree.root]
    for node in nodes:
        assert (node.last_access[Tier.L2], node.reused[Tier.L2], node.ref_count[Tier.L2]) == (backed_up_at, False, 0)
    assert len(nodes) == 1          # not split at the 3-page hit: the tree keeps its shape
    assert (state.metrics.snapshot(), len(state.leases)) == before
    state.check_integrity()
