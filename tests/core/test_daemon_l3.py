"""DaemonState with an L3 tier: write-through, promotion, per-tier eviction, ownership on failure."""

from __future__ import annotations

import numpy as np
import pytest

from kvcached.core.daemon import DaemonState
from kvcached.core.tier_ops import IllegalOpTransition, OpState, TierMove
from kvcached.core.tiers import Tier
from kvcached.testing.clock import FakeClock
from proto.errors import ErrorCode, ProtocolError
from proto.schema import Acquire, Commit, Release
from tests.core.test_daemon_state import GEOMETRY, PAGE, extension_ends, tokens

# 16 L2 pages and 32 L3 slots of 131072 bytes.
L3_BYTES = 4 << 20


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def state(clock):
    return DaemonState(2 << 20, max_namespaces=1, session_timeout_s=1.5, l3_bytes=L3_BYTES, clock=clock)


def commit(state, session_id, token_bytes):
    """Back up a prefix to L2; returns its L2 pages and the write-through it started (not yet run).
    A prefix longer than a session may reserve at once is backed up in extensions, the
    write-through of each but the last run to success."""
    page_ids, write_through = [], None
    for end in extension_ends(state, session_id, len(token_bytes) // (4 * PAGE)):
        if write_through is not None:
            state.finish_move(write_through, ok=True)
        reply = state.acquire(Acquire(session_id, token_bytes[:end * 4 * PAGE], save=True))
        _, write_through = state.commit(Commit(session_id, reply.lease_id, reply.reserved_page_ids))
        state.check_integrity()
        page_ids += reply.reserved_page_ids
    return page_ids, write_through


def only_in_l3(state, session_id, rng, num_pages: int) -> bytes:
    """Back up a prefix, write it through, then fill L2 so that only L3 still holds it."""
    prefix = tokens(rng, num_pages)
    _, move = commit(state, session_id, prefix)
    state.finish_move(move, ok=True)
    _, move = commit(state, session_id, tokens(rng, 16))       # all of L2: evicts the prefix there
    state.finish_move(move, ok=True)
    state.check_integrity()
    assert l2_l3_hits(state, session_id, prefix) == (0, num_pages)
    return prefix


def l2_l3_hits(state, session_id, token_bytes):
    reply = state.acquire(Acquire(session_id, token_bytes))
    if reply.lease_id is not None:
        state.release(Release(session_id, reply.lease_id))
    return reply.hit_tokens["l2"] // PAGE, reply.hit_tokens["l3"] // PAGE


def test_write_through_publishes_l3_only_after_success(state, rng):
    """A commit plans an H2S move of the new pages; L3 residency appears only when the move is published."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = tokens(rng, 4)
    l2_pages, move = commit(state, session.session_id, prefix)
    assert move is not None and move.direction == "h2s"
    assert move.source_page_ids == l2_pages and len(move.private_page_ids) == 4
    assert l2_l3_hits(state, session.session_id, prefix) == (4, 0)
    assert namespace.tree.protected_pages(Tier.L2) == 4      # the source is locked while it is read
    state.check_integrity()
    assert state.finish_move(move, ok=True) == 4
    state.check_integrity()
    assert l2_l3_hits(state, session.session_id, prefix) == (4, 4)
    assert namespace.tree.protected_pages(Tier.L2) == 0
    with pytest.raises(IllegalOpTransition):
        move.transition(OpState.FAILED)


def test_failed_write_through_returns_slots(state, rng):
    """A failed H2S returns its private slots; the prefix stays in L2 only."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = tokens(rng, 3)
    _, move = commit(state, session.session_id, prefix)
    state.finish_move(move, ok=False)
    state.check_integrity()
    assert namespace.l3_allocator.num_free == namespace.capacity[Tier.L3] == 32
    assert l2_l3_hits(state, session.session_id, prefix) == (3, 0)
    assert state.metrics.counters["h2s_failures"] == 1


def test_only_the_missing_suffix_is_written_through(state, rng):
    """Extending a prefix already in L3 writes only the new pages."""
    session, _ = state.attach(GEOMETRY, pid=1)
    head, tail = tokens(rng, 3), tokens(rng, 2)
    _, move = commit(state, session.session_id, head)
    state.finish_move(move, ok=True)
    _, move = commit(state, session.session_id, head + tail)
    assert move.start_page == 3 and len(move.private_page_ids) == 2
    state.finish_move(move, ok=True)
    state.check_integrity()
    assert l2_l3_hits(state, session.session_id, head + tail) == (5, 5)


def test_promotion_restores_l2_residency_from_l3(state, clock, rng):
    """After L2 evicts a prefix that L3 still holds, a promotion reads it into new L2 pages and a
    match then hits it in L2; L3 residency is untouched by the L2 eviction."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = tokens(rng, 5)
    _, move = commit(state, session.session_id, prefix)
    state.finish_move(move, ok=True)
    clock.advance(1)
    state.heartbeat(session.session_id)
    filler = tokens(rng, 16)                 # needs all of L2: evicts the prefix from L2 only
    _, move = commit(state, session.session_id, filler)
    assert l2_l3_hits(state, session.session_id, prefix) == (0, 5)
    state.finish_move(move, ok=True)
    state.check_integrity()

    promotion = state.acquire(Acquire(session.session_id, prefix, promote="wait"))
    assert isinstance(promotion, TierMove) and promotion.direction == "s2h"
    assert promotion.start_page == 0 and len(promotion.private_page_ids) == 5
    state.check_integrity()
    assert state.finish_move(promotion, ok=True) == 5
    state.check_integrity()
    reply = state.acquire(Acquire(session.session_id, prefix))
    assert reply.hit_tokens == {"l2": 5 * PAGE, "l3": 5 * PAGE}
    assert reply.host_page_ids == promotion.private_page_ids or len(reply.host_page_ids) == 5
    state.release(Release(session.session_id, reply.lease_id))
    state.check_integrity()


def test_published_promotion_survives_the_sessions_death(state, clock, rng):
    """Once a promotion is published its L2 pages belong to the tree: the requesting session dying
    before it restores (its lease reclaimed) does not free them."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    keeper, _ = state.attach(GEOMETRY, pid=2)
    prefix = only_in_l3(state, session.session_id, rng, num_pages=4)
    promotion = state.acquire(Acquire(session.session_id, prefix, promote="wait"))
    state.finish_move(promotion, ok=True)
    reply = state.acquire(Acquire(session.session_id, prefix))              # the engine's lease on the promoted pages
    promoted = reply.host_page_ids
    clock.advance(2)
    state.heartbeat(keeper.session_id)
    assert state.expire_sessions() == [session.session_id]       # dies before its H2D
    state.check_integrity()
    assert l2_l3_hits(state, keeper.session_id, prefix) == (4, 4)
    owned = namespace.tree.check_integrity()[Tier.L2]
    assert set(promoted) <= owned


def test_a_promotion_reserves_no_more_than_the_sessions_allowance(state, rng):
    """A match's L3 promotion takes L2 pages under the same per-session cap as its reservations:
    with pages reserved by another of its acquires, it promotes only what the session may
    still reserve; with none left, none."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = only_in_l3(state, session.session_id, rng, num_pages=8)

    def reserve(num_pages: int):
        other = rng.integers(0, 50_000, size=num_pages * PAGE, dtype=np.int32).tobytes()
        reply = state.acquire(Acquire(session.session_id, other, save=True))
        assert len(reply.reserved_page_ids) == num_pages
        return reply

    ahead = reserve(namespace.num_pages // 2 - 3)
    promotion = state.acquire(Acquire(session.session_id, prefix, promote="wait"))
    assert isinstance(promotion, TierMove) and len(promotion.private_page_ids) == 3
    state.finish_move(promotion, ok=True)
    state.check_integrity()
    assert l2_l3_hits(state, session.session_id, prefix) == (3, 8)
    assert state.metrics.counters["s2h_pages_cut_no_space"] == 0      # cut to the cap, not for room
    more = reserve(3)                                  # the cap is reached now
    outcome = state.acquire(Acquire(session.session_id, prefix, promote="wait"))
    assert not isinstance(outcome, TierMove) and outcome.hit_tokens["l2"] == 3 * PAGE
    state.release(Release(session.session_id, outcome.lease_id))
    for reservation in (ahead, more):
        state.release(Release(session.session_id, reservation.lease_id))
    state.check_integrity()


def test_a_promotion_cut_for_want_of_l2_room_is_counted(state, rng):
    """With most of L2 reserved by other sessions, a promotion takes the pages left, publishes
    those, and counts the pages it could not take (s2h_pages_cut_no_space): the engine loads what
    was promoted and recomputes the rest."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = only_in_l3(state, session.session_id, rng, num_pages=8)
    held = []
    for num_pages in (namespace.num_pages // 2, namespace.num_pages // 2 - 5):     # 11 of 16 pages
        other, _ = state.attach(GEOMETRY, pid=1)
        pages = rng.integers(0, 50_000, size=num_pages * PAGE, dtype=np.int32).tobytes()
        reply = state.acquire(Acquire(other.session_id, pages, save=True))
        assert len(reply.reserved_page_ids) == num_pages
        held.append((other.session_id, reply.lease_id))
    promotion = state.acquire(Acquire(session.session_id, prefix, promote="wait"))
    assert isinstance(promotion, TierMove) and len(promotion.private_page_ids) == 5
    assert state.metrics.counters["s2h_pages_cut_no_space"] == 3
    state.finish_move(promotion, ok=True)
    state.check_integrity()
    assert l2_l3_hits(state, session.session_id, prefix) == (5, 8)
    for other_id, lease_id in held:
        state.release(Release(other_id, lease_id))
    state.check_integrity()


@pytest.mark.parametrize("read_ok", [True, False], ids=["published", "failed"])
def test_an_acquire_whose_session_ended_during_its_promotion_is_refused_and_not_counted_served(state, rng, read_ok):
    """The session of an acquire that waits for its L3 promotion ends while the read runs: the
    move still ends (published or its pages returned), the acquire is refused (NOT_ATTACHED) and
    no lease is left; it is counted neither as served after a promotion nor as a fallback."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = only_in_l3(state, session.session_id, rng, num_pages=4)
    keeper, _ = state.attach(GEOMETRY, pid=2)
    request = Acquire(session.session_id, prefix, save=True, promote="wait")
    promotion = state.acquire(request)
    assert isinstance(promotion, TierMove)
    state.detach(session.session_id)
    state.finish_move(promotion, ok=read_ok)
    with pytest.raises(ProtocolError) as refused:
        state.acquire_after(request, promotion)
    assert refused.value.code == ErrorCode.NOT_ATTACHED
    state.check_integrity()
    assert not state.leases and not state.moves
    counted = state.metrics.counters
    assert (counted["promotions"], counted["restore_fallbacks"]) == (0, 0), counted
    assert l2_l3_hits(state, keeper.session_id, prefix) == (4 if read_ok else 0, 4)


def test_failed_promotion_falls_back_without_leaks(state, rng):
    """A failed S2H returns its private L2 pages; L3 still holds the prefix; nothing is published."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = only_in_l3(state, session.session_id, rng, num_pages=4)
    promotion = state.acquire(Acquire(session.session_id, prefix, promote="wait"))
    private = set(promotion.private_page_ids)
    state.finish_move(promotion, ok=False)
    state.check_integrity()
    assert not state.moves
    assert private <= namespace.l2_allocator.free_page_ids()
    assert namespace.l2_allocator.num_free + namespace.tree.owned_pages(Tier.L2) == namespace.num_pages
    assert l2_l3_hits(state, session.session_id, prefix) == (0, 4)
    assert state.metrics.counters["s2h_failures"] == 1


def test_l3_evicts_its_own_lru_and_nodes_leave_only_when_no_tier_holds_them(state, clock, rng):
    """L3 pressure evicts L3's least recently used pages; a node still in L3 stays in the tree,
    a node in no tier leaves it."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    old, newer, big, last = tokens(rng, 8), tokens(rng, 8), tokens(rng, 16), tokens(rng, 4)
    # newer fills L2 (16 pages); big evicts both from L2 and fills L3 (32 slots); last needs 4
    # more slots: L3 evicts old, its least recently used.
    for prefix in (old, newer, big, last):
        _, move = commit(state, session.session_id, prefix)
        state.finish_move(move, ok=True)
        clock.advance(1)
        state.heartbeat(session.session_id)
    state.check_integrity()
    assert state.metrics.counters["evicted_pages_l3"] == 8
    assert l2_l3_hits(state, session.session_id, old) == (0, 0)
    assert l2_l3_hits(state, session.session_id, newer) == (0, 8)
    assert namespace.tree.owned_pages(Tier.L3) == 28
    assert namespace.tree.num_nodes == 4         # newer, big (two extensions), last: old left the tree


def test_no_l3_means_no_moves(rng):
    """Without an L3 plan the daemon plans no write-through and no promotion."""
    state = DaemonState(2 << 20, max_namespaces=1, session_timeout_s=1.5)
    session, namespace = state.attach(GEOMETRY, pid=1)
    _, move = commit(state, session.session_id, tokens(rng, 2))
    assert move is None and namespace.l3_allocator is None
    outcome = state.acquire(Acquire(session.session_id, tokens(rng, 2), promote="wait"))
    assert not isinstance(outcome, TierMove) and outcome.lease_id is None


def test_a_skipped_write_through_is_counted_each_time_and_logged_once(state, caplog, rng):
    """Write-throughs skipped by policy (a backlog) are counted in the metrics every time and logged
    once: no L3 copy is left out silently."""
    session, _ = state.attach(GEOMETRY, pid=1)
    caplog.set_level("WARNING", logger="kvcached.core.daemon")
    for _ in range(3):
        _, move = commit(state, session.session_id, tokens(rng, 2))
        state.finish_move(move, ok=False, skipped=True)
    state.check_integrity()
    assert state.metrics.counters["h2s_policy_skips"] == 3
    skips = [r for r in caplog.records if "h2s_policy_skips" in r.getMessage()]
    assert len(skips) == 1, [r.getMessage() for r in caplog.records]
