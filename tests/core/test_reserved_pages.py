"""Standing reservations (pages reserved ahead of a backup) and page epochs, in-process."""

from __future__ import annotations

import dataclasses

import pytest

from kvcached.core.allocator import PageAllocator
from kvcached.core.daemon import ArenaPlan, DaemonState
from kvcached.core.tiers import Tier
from proto.errors import ErrorCode, ProtocolError
from tests.core.test_daemon_state import GEOMETRY, back_up, tokens


@pytest.fixture
def state():
    return DaemonState(ArenaPlan(2 << 20, 1), session_timeout_s=60.0)


def test_epochs_count_allocations_per_page():
    allocator = PageAllocator(8)
    first = allocator.allocate(5)
    assert allocator.epochs_of(first) == [1] * 5
    allocator.free(first[1:3])
    again = allocator.allocate(2)
    assert sorted(again) == sorted(first[1:3])
    assert allocator.epochs_of(first) == [1, 2, 2, 1, 1]
    assert allocator.epochs_of([5, 6, 7]) == [0, 0, 0]        # never allocated
    allocator.check_integrity()


def test_committed_pages_match_with_the_epochs_of_their_reservation(state, rng):
    """What the engine learned when it reserved its pages is what a later match reports."""
    session, _ = state.attach(GEOMETRY, pid=1)
    reservation = state.reserve_pages(session.session_id, 6)
    assert len(reservation.page_ids) == 6 and len(reservation.page_epochs) == 6
    prefix = tokens(rng, 4)
    pages = reservation.page_ids[1:5]
    reply, _ = state.commit_pages(session.session_id, reservation.lease_id, prefix, 0, pages)
    state.check_integrity()
    assert (reply.new_pages, reply.duplicate_pages) == (4, 0)
    match = state.match(session.session_id, prefix)
    assert match.host_page_ids == pages
    assert match.host_page_epochs == reservation.page_epochs[1:5]
    state.release(session.session_id, match.lease_id)
    # The two pages not committed are still the lease's: releasing it frees them.
    namespace = state.namespaces[session.namespace_id]
    assert state.status()["namespaces"][0]["tiers"]["l2"]["private_pages"] == 2
    state.release(session.session_id, reservation.lease_id)
    state.check_integrity()
    assert namespace.l2_allocator.num_free == namespace.num_pages - 4


def test_a_page_evicted_and_reused_changes_epoch(state, rng):
    """Eviction then reuse of a page is visible to an engine that remembers the old epoch."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    reservation = state.reserve_pages(session.session_id, 8)
    prefix = tokens(rng, 8)
    state.commit_pages(session.session_id, reservation.lease_id, prefix, 0, reservation.page_ids)
    assert reservation.lease_id not in state.leases          # no page left: the lease ended
    for _ in range(2):                                        # fills the pool: the prefix goes
        back_up(state, session.session_id, tokens(rng, 8))
    assert state.match(session.session_id, prefix).hit_tokens["l2"] == 0
    other, _ = state.attach(GEOMETRY, pid=2)
    # Each session may reserve half of L2 at once: together they take all of it, so every page.
    reused = [state.match(s.session_id, tokens(rng, 8), reserve_backup=True) for s in (session, other)]
    reused_pages = [p for reply in reused for p in reply.backup_page_ids]
    reused_epochs = [e for reply in reused for e in reply.backup_page_epochs]
    same = set(reused_pages) & set(reservation.page_ids)
    assert same
    before = dict(zip(reservation.page_ids, reservation.page_epochs))
    for page_id, epoch in zip(reused_pages, reused_epochs):
        if page_id in before:
            assert epoch > before[page_id]
    for s, reply in zip((session, other), reused):
        state.release(s.session_id, reply.lease_id)
    state.check_integrity()


def test_commit_of_an_extension_and_of_pages_the_tree_has(state, rng):
    """start_page > 0 extends a resident prefix; pages the tree holds already go back to the pool."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    head = tokens(rng, 3)
    head_pages = back_up(state, session.session_id, head)
    reservation = state.reserve_pages(session.session_id, 10)
    free_before = namespace.l2_allocator.num_free
    whole = head + tokens(rng, 2)
    # Pages 0..4 written again: 0..2 are duplicates, 3..4 are new.
    reply, _ = state.commit_pages(session.session_id, reservation.lease_id, whole, 0, reservation.page_ids[:5])
    state.check_integrity()
    assert (reply.new_pages, reply.duplicate_pages) == (2, 3)
    assert namespace.l2_allocator.num_free == free_before + 3
    longer = whole + tokens(rng, 1)
    reply, _ = state.commit_pages(session.session_id, reservation.lease_id, longer, 5, reservation.page_ids[5:6])
    state.check_integrity()
    assert (reply.new_pages, reply.duplicate_pages) == (1, 0)
    match = state.match(session.session_id, longer)
    assert match.host_page_ids == head_pages + reservation.page_ids[3:6]
    state.release(session.session_id, match.lease_id)
    state.release(session.session_id, reservation.lease_id)
    state.check_integrity()


def test_commit_below_a_prefix_that_is_gone_publishes_nothing(state, rng):
    session, namespace = state.attach(GEOMETRY, pid=1)
    reservation = state.reserve_pages(session.session_id, 4)
    free_before = namespace.l2_allocator.num_free
    reply, write_through = state.commit_pages(session.session_id, reservation.lease_id, tokens(rng, 5), 3,
                                              reservation.page_ids[:2])
    state.check_integrity()
    assert (reply.new_pages, reply.duplicate_pages, write_through) == (0, 0, None)
    assert namespace.l2_allocator.num_free == free_before + 2
    assert namespace.tree.owned_pages(Tier.L2) == 0
    assert state.metrics.counters["backup_commits_prefix_gone"] == 1


def test_bad_commits_of_reserved_pages_change_nothing(state, rng):
    a, _ = state.attach(GEOMETRY, pid=1)
    b, _ = state.attach(GEOMETRY, pid=2)
    reservation = state.reserve_pages(a.session_id, 4)
    match = state.match(a.session_id, tokens(rng, 2), reserve_backup=True)
    prefix = tokens(rng, 4)
    cases = [
        (a.session_id, reservation.lease_id, prefix, 0, [reservation.page_ids[0]] * 2, ErrorCode.BAD_PAGES),
        (a.session_id, reservation.lease_id, prefix, 0, match.backup_page_ids[:1], ErrorCode.NOT_LEASED),
        (a.session_id, match.lease_id, prefix, 0, match.backup_page_ids, ErrorCode.NOT_LEASED),
        (b.session_id, reservation.lease_id, prefix, 0, reservation.page_ids[:1], ErrorCode.NOT_LEASED),
        (a.session_id, 10**9, prefix, 0, reservation.page_ids[:1], ErrorCode.UNKNOWN_LEASE),
    ]
    before = state.status()
    for session_id, lease_id, token_bytes, start_page, page_ids, code in cases:
        with pytest.raises(ProtocolError) as caught:
            state.commit_pages(session_id, lease_id, token_bytes, start_page, page_ids)
        assert caught.value.code == code, (caught.value, page_ids)
    with pytest.raises(ProtocolError) as caught:
        state.commit_backup(a.session_id, reservation.lease_id, reservation.page_ids[:1])
    assert caught.value.code == ErrorCode.NOT_LEASED
    assert state.status()["namespaces"] == before["namespaces"]
    state.check_integrity()


def test_a_commit_whose_tokens_fall_short_returns_its_pages(state, rng):
    """The engine sends commits without waiting and counts the pages as gone: a commit refused for
    too few tokens still takes its pages out of the lease (freed, nothing published)."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    reservation = state.reserve_pages(session.session_id, 4)
    free_before = namespace.l2_allocator.num_free
    with pytest.raises(ProtocolError) as caught:
        state.commit_pages(session.session_id, reservation.lease_id, tokens(rng, 1), 0, reservation.page_ids[:2])
    assert caught.value.code == ErrorCode.BAD_FRAME
    state.check_integrity()
    assert namespace.l2_allocator.num_free == free_before + 2
    assert state.leases[reservation.lease_id].private_page_ids == reservation.page_ids[2:]
    assert namespace.tree.owned_pages(Tier.L2) == 0


def test_reservations_are_capped_per_session_and_reclaimed_with_it(state):
    """A session holds at most half the namespace's pages ahead; another session has its own share;
    whatever a session holds goes back when it ends."""
    session, namespace = state.attach(GEOMETRY, pid=1)
    other, _ = state.attach(GEOMETRY, pid=2)
    first = state.reserve_pages(session.session_id, 6)
    second = state.reserve_pages(session.session_id, 6)       # up to the cap: 8 of 16 pages
    assert len(first.page_ids) == 6 and len(second.page_ids) == 2
    assert state.reserve_pages(session.session_id, 1) == (None, [], [])
    third = state.reserve_pages(other.session_id, 16)          # best effort: what is left
    assert len(third.page_ids) == 8
    state.check_integrity()
    assert state.detach(session.session_id) == 2
    state.check_integrity()
    assert namespace.l2_allocator.num_free == 8
    assert len(state.reserve_pages(other.session_id, 1).page_ids) == 0      # still at its cap
    state.detach(other.session_id)
    state.check_integrity()
    assert namespace.l2_allocator.num_free == namespace.num_pages


def test_epochs_of_a_namespace_made_anew_or_a_new_daemon_do_not_repeat(state):
    """A namespace reclaimed and made again, or a daemon started again, hands out the same page ids
    at other epochs: an engine's record of the old pages can never be taken for the new ones."""
    session, _ = state.attach(GEOMETRY, pid=1)
    old = state.reserve_pages(session.session_id, 4)
    state.detach(session.session_id)
    other, _ = state.attach(dataclasses.replace(GEOMETRY, model_id="other"), pid=2)   # reclaims the arena
    state.detach(other.session_id)
    session, namespace = state.attach(GEOMETRY, pid=3)                                # and back
    assert state.metrics.counters["namespaces_reclaimed"] == 2
    again = state.reserve_pages(session.session_id, 4)
    assert again.page_ids == old.page_ids and again.page_epochs != old.page_epochs
    restarted = DaemonState(ArenaPlan(2 << 20, 1), session_timeout_s=60.0)
    fresh, _ = restarted.attach(GEOMETRY, pid=4)
    new = restarted.reserve_pages(fresh.session_id, 4)
    assert new.page_ids == old.page_ids and new.page_epochs != old.page_epochs


def test_one_cap_bounds_all_the_pages_a_session_reserves(state, rng):
    """Pages held ahead and a match's backup pages share one cap per session (half of the namespace's
    L2 pages), counted across its leases; another session keeps its own share; what is committed or
    released no longer counts."""
    a, namespace = state.attach(GEOMETRY, pid=1)
    b, _ = state.attach(GEOMETRY, pid=2)
    cap = namespace.num_pages // 2
    ahead = state.reserve_pages(a.session_id, 6)
    assert len(ahead.page_ids) == 6
    first = state.match(a.session_id, tokens(rng, namespace.num_pages), reserve_backup=True)
    assert len(first.backup_page_ids) == cap - 6
    assert state.match(a.session_id, tokens(rng, 4), reserve_backup=True).backup_page_ids == []
    assert state.reserve_pages(a.session_id, 4).page_ids == []
    assert state.metrics.counters["reservations_capped"] == 3
    other = state.match(b.session_id, tokens(rng, namespace.num_pages), reserve_backup=True)
    assert len(other.backup_page_ids) == cap
    state.check_integrity()
    state.release(a.session_id, ahead.lease_id)
    again = state.reserve_pages(a.session_id, 8)       # the released pages no longer count
    assert len(again.page_ids) == 6
    state.check_integrity()
