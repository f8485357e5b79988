"""DaemonState in-process: leases, backups, eviction under pressure, session expiry, integrity."""

from __future__ import annotations

import numpy as np
import pytest

from kvcached.core.daemon import MAX_SESSION_RESERVED_SHARE, DaemonState
from kvcached.core.tiers import IntegrityError, Tier
from proto.errors import ErrorCode, ProtocolError
from proto.messages import KVGeometry
from kvcached.testing.clock import FakeClock
from proto.schema import Acquire, Commit, Release

# 131072-byte pages: a 2 MiB pool holds exactly 16 pages of 8 tokens.
GEOMETRY = KVGeometry("m", num_layers=4, num_kv_heads=4, head_dim=128, dtype="float32", page_size=8)
PAGE = GEOMETRY.page_size


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def state(clock):
    return DaemonState(2 << 20, max_namespaces=1, session_timeout_s=1.5, clock=clock)


def tokens(rng, num_pages: int) -> bytes:
    return rng.integers(0, 1 << 30, size=num_pages * PAGE, dtype=np.int32).tobytes()


def back_up(state, session_id, token_bytes) -> list[int]:
    """Back up a prefix, in extensions of at most what one session may reserve at once."""
    page_ids = []
    for end in extension_ends(state, session_id, len(token_bytes) // (4 * PAGE)):
        reply = state.acquire(Acquire(session_id, token_bytes[:end * 4 * PAGE], save=True))
        state.commit(Commit(session_id, reply.lease_id, reply.reserved_page_ids))
        state.check_integrity()
        page_ids += reply.reserved_page_ids
    return page_ids


def extension_ends(state, session_id, num_pages: int) -> list[int]:
    """Page counts at which a backup of num_pages pages is committed, each step no more than a
    session's reservation cap."""
    namespace = state.namespaces[state.sessions[session_id].namespace_id]
    step = int(namespace.num_pages * MAX_SESSION_RESERVED_SHARE)
    return list(range(step, num_pages, step)) + [num_pages]


def test_backup_then_match_returns_the_committed_pages(state, rng):
    """Pages committed by one session are what a later match of the same prefix (by another session) returns."""
    a, namespace = state.attach(GEOMETRY, pid=1)
    b, _ = state.attach(GEOMETRY, pid=2)
    assert namespace.num_pages == 16
    prefix = tokens(rng, 5)
    committed = back_up(state, a.session_id, prefix)
    assert len(committed) == 5

    reply = state.acquire(Acquire(b.session_id, prefix + tokens(rng, 1)[: 4 * 3]))   # plus a partial page
    state.check_integrity()
    assert reply.hit_tokens == {"l2": 5 * PAGE}
    assert reply.host_page_ids == committed
    assert namespace.tree.protected_pages(Tier.L2) == 5
    state.release(Release(b.session_id, reply.lease_id))
    state.check_integrity()
    assert namespace.tree.protected_pages(Tier.L2) == 0


def test_extending_a_cached_prefix_reserves_only_missing_pages(state, rng):
    """A reservation covers only the pages after the L2 hit; committing it extends the cached prefix."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    head, tail = tokens(rng, 3), tokens(rng, 2)
    first = back_up(state, session.session_id, head)
    reply = state.acquire(Acquire(session.session_id, head + tail, save=True))
    assert reply.hit_tokens["l2"] == 3 * PAGE and reply.reserved_start_token == 3 * PAGE
    assert len(reply.reserved_page_ids) == 2
    state.commit(Commit(session.session_id, reply.lease_id, reply.reserved_page_ids))
    state.check_integrity()
    again = state.acquire(Acquire(session.session_id, head + tail))
    assert again.host_page_ids == first + reply.reserved_page_ids
    state.release(Release(session.session_id, again.lease_id))
    state.check_integrity()


def test_pressure_evicts_lru_prefixes_but_never_leased_ones(state, clock, rng):
    """When L2 is full, a reservation evicts least-recently-used prefixes; a prefix under a lease survives."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefixes = []
    for _ in range(3):                      # 3 x 5 pages of 16
        prefixes.append(tokens(rng, 5))
        back_up(state, session.session_id, prefixes[-1])
        clock.advance(1.0)
        state.heartbeat(session.session_id)
    state.acquire(Acquire(session.session_id, prefixes[0]))               # oldest, but leased now
    clock.advance(1.0)
    state.heartbeat(session.session_id)
    state.check_integrity()

    newcomer = tokens(rng, 6)               # needs 5 more pages than are free: evicts one prefix
    reply = state.acquire(Acquire(session.session_id, newcomer, save=True))
    state.check_integrity()
    assert len(reply.reserved_page_ids) == 6
    hits = [state.acquire(Acquire(session.session_id, p)).hit_tokens["l2"] // PAGE for p in prefixes]
    # prefixes[0] is leased: kept although oldest. prefixes[1] is the LRU unleased one: evicted.
    assert hits == [5, 0, 5]
    assert state.metrics.counters["evicted_pages_l2"] == 5
    for lease in list(state.leases.values()):
        state.release(Release(session.session_id, lease.lease_id))
    state.check_integrity()


def test_reservation_is_best_effort_when_everything_is_leased(state, rng):
    """With every L2 page tree-owned and locked, a reservation gets as many pages as are free (here none)."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = tokens(rng, 16)
    back_up(state, session.session_id, prefix)
    held = state.acquire(Acquire(session.session_id, prefix))
    reply = state.acquire(Acquire(session.session_id, tokens(rng, 2), save=True))
    assert reply.reserved_page_ids == [] and reply.lease_id is None
    assert state.metrics.counters["backup_reserve_failures"] == 1
    state.release(Release(session.session_id, held.lease_id))
    state.check_integrity()


def test_release_twice_and_foreign_lease_are_refused_without_change(state, rng):
    """Releasing a lease twice raises UNKNOWN_LEASE; touching another session's lease raises NOT_LEASED."""
    a, namespace = state.attach(GEOMETRY, pid=1)
    b, _ = state.attach(GEOMETRY, pid=2)
    reply = state.acquire(Acquire(a.session_id, tokens(rng, 2), save=True))
    with pytest.raises(ProtocolError) as error:
        state.release(Release(b.session_id, reply.lease_id))
    assert error.value.code == ErrorCode.NOT_LEASED
    with pytest.raises(ProtocolError) as error:
        state.commit(Commit(b.session_id, reply.lease_id, reply.reserved_page_ids))
    assert error.value.code == ErrorCode.NOT_LEASED
    state.check_integrity()
    assert namespace.l2_allocator.num_free == 14
    state.release(Release(a.session_id, reply.lease_id))
    with pytest.raises(ProtocolError) as error:
        state.release(Release(a.session_id, reply.lease_id))
    assert error.value.code == ErrorCode.UNKNOWN_LEASE
    state.check_integrity()
    assert namespace.l2_allocator.num_free == 16


def test_commit_checks_page_ids(state, rng):
    """Commit refuses out-of-range ids (BAD_PAGES) and ids that are not a prefix of the reservation (NOT_LEASED)."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    reply = state.acquire(Acquire(session.session_id, tokens(rng, 3), save=True))
    with pytest.raises(ProtocolError) as error:
        state.commit(Commit(session.session_id, reply.lease_id, [16]))
    assert error.value.code == ErrorCode.BAD_PAGES
    with pytest.raises(ProtocolError) as error:
        state.commit(Commit(session.session_id, reply.lease_id, reply.reserved_page_ids[1:]))
    assert error.value.code == ErrorCode.NOT_LEASED
    state.check_integrity()
    # A prefix of the reservation is fine: the rest returns to the free pool.
    state.commit(Commit(session.session_id, reply.lease_id, reply.reserved_page_ids[:2]))
    state.check_integrity()
    assert namespace.tree.owned_pages(Tier.L2) == 2 and namespace.l2_allocator.num_free == 14


def test_concurrent_backups_of_one_prefix_keep_one_copy(state, rng):
    """Two sessions backing up the same prefix: the second commit's pages are duplicates and return to the pool."""
    a, namespace = state.attach(GEOMETRY, pid=1)
    b, _ = state.attach(GEOMETRY, pid=2)
    prefix = tokens(rng, 4)
    first = state.acquire(Acquire(a.session_id, prefix, save=True))
    second = state.acquire(Acquire(b.session_id, prefix, save=True))
    assert set(first.reserved_page_ids).isdisjoint(second.reserved_page_ids)
    state.commit(Commit(a.session_id, first.lease_id, first.reserved_page_ids))
    result, _ = state.commit(Commit(b.session_id, second.lease_id, second.reserved_page_ids))
    state.check_integrity()
    assert result.new_pages == 0 and result.duplicate_pages == 4
    assert namespace.tree.owned_pages(Tier.L2) == 4 and namespace.l2_allocator.num_free == 12


def test_expired_session_loses_its_leases(state, clock, rng):
    """A session silent for longer than session_timeout_s is ended and every lease it held is
    reclaimed: its locked prefix becomes evictable, its private reserved pages are quarantined (its
    process may still write them), neither free nor reserved."""
    dead, namespace = state.attach(GEOMETRY, pid=1)
    alive, _ = state.attach(GEOMETRY, pid=2)
    prefix = tokens(rng, 4)
    back_up(state, dead.session_id, prefix)
    state.acquire(Acquire(dead.session_id, prefix))
    state.acquire(Acquire(dead.session_id, tokens(rng, 3), save=True))
    assert namespace.tree.protected_pages(Tier.L2) == 4 and namespace.l2_allocator.num_free == 9
    clock.advance(1.0)
    state.heartbeat(alive.session_id)
    assert state.expire_sessions() == []
    clock.advance(1.0)
    state.heartbeat(alive.session_id)
    assert state.expire_sessions() == [dead.session_id]
    state.check_integrity()
    assert state.leases == {}
    assert namespace.tree.protected_pages(Tier.L2) == 0
    assert namespace.tree.evictable_pages(Tier.L2) == 4
    assert namespace.l2_allocator.num_free == 9
    assert state.status()["namespaces"][0]["tiers"]["l2"]["quarantined_pages"] == 3
    with pytest.raises(ProtocolError) as error:
        state.acquire(Acquire(dead.session_id, prefix))
    assert error.value.code == ErrorCode.NOT_ATTACHED


def test_namespaces_are_isolated(state, rng):
    """Engines with different geometry never see each other's pages; a geometry beyond
    max_namespaces, when no namespace is idle, is refused."""
    two = DaemonState(4 << 20, max_namespaces=2, session_timeout_s=1.5)
    a, ns_a = two.attach(GEOMETRY, pid=1)
    other = KVGeometry("other-model", 4, 4, 128, "float32", 8)
    b, ns_b = two.attach(other, pid=2)
    assert ns_a is not ns_b
    prefix = tokens(rng, 2)
    back_up(two, a.session_id, prefix)
    assert two.acquire(Acquire(b.session_id, prefix)).hit_tokens["l2"] == 0
    with pytest.raises(ProtocolError) as error:
        two.attach(KVGeometry("third", 4, 4, 128, "float32", 8), pid=3)
    assert error.value.code == ErrorCode.OUT_OF_SPACE
    two.check_integrity()


def test_integrity_check_detects_a_page_both_owned_and_free(state, rng):
    """check_integrity fails when a tree-owned page is also in the free pool (a leak waiting to corrupt data)."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    committed = back_up(state, session.session_id, tokens(rng, 2))
    namespace.l2_allocator.free([committed[0]])
    with pytest.raises(IntegrityError, match="both owned and free"):
        state.check_integrity()


def test_integrity_check_detects_a_lost_private_page(state, rng):
    """check_integrity fails when a reserved page is neither owned, free nor private (capacity accounting)."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    reply = state.acquire(Acquire(session.session_id, tokens(rng, 2), save=True))
    state.leases[reply.lease_id].private_page_ids.pop()
    with pytest.raises(IntegrityError, match="capacity"):
        state.check_integrity()


def test_idle_namespace_makes_way_for_a_new_geometry(clock, rng):
    """With max_namespaces namespaces served, a new geometry replaces the namespace idle longest (no
    session; its cache dropped, its chunks back in the pool); namespaces with attached engines are
    never taken."""
    state = DaemonState(4 << 20, max_namespaces=2, session_timeout_s=1.5, clock=clock)
    first, ns_first = state.attach(GEOMETRY, pid=1)
    back_up(state, first.session_id, tokens(rng, 3))
    second, ns_second = state.attach(KVGeometry("second", 4, 4, 128, "float32", 8), pid=2)
    third_geometry = KVGeometry("third", 4, 4, 128, "float32", 8)
    with pytest.raises(ProtocolError) as error:         # both namespaces have engines
        state.attach(third_geometry, pid=3)
    assert error.value.code == ErrorCode.OUT_OF_SPACE
    state.detach(first.session_id)
    clock.advance(1)
    third, ns_third = state.attach(third_geometry, pid=3)
    state.check_integrity()
    assert state.chunks[Tier.L2].owned_by(ns_first.namespace_id) == []
    assert ns_first.namespace_id not in state.namespaces and ns_second.namespace_id in state.namespaces
    assert state.metrics.counters["namespaces_reclaimed"] == 1
    state.detach(second.session_id)
    clock.advance(1)
    again, ns_again = state.attach(GEOMETRY, pid=4)            # the first model comes back: a fresh cache
    assert ns_again is not ns_first and ns_again.tree.owned_pages(Tier.L2) == 0
    state.check_integrity()


@pytest.mark.parametrize("share", [MAX_SESSION_RESERVED_SHARE, 0.25, 1.0])
def test_one_session_reserves_at_most_its_share_of_l2(clock, rng, share):
    """A session's leases reserve at most ``session_share`` of the namespace's 16 pages at once;
    once they are released it may reserve that much again."""
    state = DaemonState(2 << 20, max_namespaces=1, session_timeout_s=1.5, clock=clock, session_share=share)
    session, namespace = state.attach(GEOMETRY, pid=1)
    cap = int(namespace.num_pages * share)
    first = state.acquire(Acquire(session.session_id, tokens(rng, 16), save=True))
    assert len(first.reserved_page_ids) == cap
    second = state.acquire(Acquire(session.session_id, tokens(rng, 4), save=True))
    assert second.reserved_page_ids == []
    assert state.metrics.counters["reservations_capped"] == 2 - (cap == 16)
    state.release(Release(session.session_id, first.lease_id))
    again = state.acquire(Acquire(session.session_id, tokens(rng, 16), save=True))
    assert len(again.reserved_page_ids) == cap
    state.check_integrity()


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_session_share_outside_0_to_1_is_refused(clock, share):
    with pytest.raises(ValueError, match="session_share"):
        DaemonState(2 << 20, max_namespaces=1, session_timeout_s=1.5, clock=clock, session_share=share)
