"""Fencing in DaemonState: which sessions end when, what their pages become (free or quarantined),
and every way a quarantine ends. See "Fencing" in docs/architecture.md."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvcached.core.daemon import DaemonState
from kvcached.core.tiers import IntegrityError
from proto.errors import ErrorCode, ProtocolError
from kvcached.testing.clock import FakeClock
from proto.schema import Acquire, Commit, Release
from tests.core.test_daemon_state import GEOMETRY, PAGE, tokens

TIMEOUT_S, GRACE_S = 1.5, 30.0
NS_ID, START = 4026531836, 12345          # a pid namespace and a process start time


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def state(clock):
    return DaemonState(2 << 20, max_namespaces=1, session_timeout_s=TIMEOUT_S, session_grace_s=GRACE_S, clock=clock)


def l2(state) -> dict:
    (namespace,) = state.status()["namespaces"]
    return namespace["tiers"]["l2"]


def holding(state, rng, pid: int = 7, watched: bool = False):
    """A session holding pages it may write under two leases: 3 reserved pages after a locked
    2-page hit, and 4 reserved pages of a prefix the daemon has none of. Returns the leases too."""
    session, namespace = state.attach(GEOMETRY, pid=pid, pid_watched=watched, pid_namespace_id=NS_ID,
                                      process_start_time=START)
    hit = tokens(rng, 2)
    reply = state.acquire(Acquire(session.session_id, hit, save=True))
    state.commit(Commit(session.session_id, reply.lease_id, reply.reserved_page_ids))
    after_hit = state.acquire(Acquire(session.session_id, hit + tokens(rng, 3), save=True))
    fresh = state.acquire(Acquire(session.session_id, tokens(rng, 4), save=True))
    writable = set(after_hit.reserved_page_ids) | set(fresh.reserved_page_ids)
    assert len(writable) == 7 and after_hit.hit_tokens["l2"] == 2 * PAGE and fresh.hit_tokens["l2"] == 0
    state.check_integrity()
    return session, namespace, (after_hit, fresh), writable


def keep_alive(state, clock, session, seconds: float, step_s: float = 0.5) -> None:
    """Advance the clock by seconds while session heartbeats every step_s; reap at each step."""
    for _ in range(int(round(seconds / step_s))):
        clock.advance(step_s)
        state.heartbeat(session.session_id)
        state.expire_sessions()


def test_an_unwatched_session_that_expires_quarantines_what_it_could_write_until_the_grace(state, clock):
    """A session whose pid is not watched expires after session_timeout_s; the pages it could still
    write (the reserved pages of its two leases) are then quarantined: counted in
    integrity and status, never handed to another session, until session_grace_s after its last
    sign of life, when they are free."""
    rng = np.random.default_rng(1)
    stale, namespace, _, writable = holding(state, rng)
    other, _ = state.attach(GEOMETRY, pid=8)
    keep_alive(state, clock, other, 2.0)
    assert stale.session_id not in state.sessions
    state.check_integrity()
    assert l2(state)["quarantined_pages"] == 7 and l2(state)["private_pages"] == 0
    assert state.metrics.counters["quarantines"] == 1 and state.metrics.counters["pages_quarantined"] == 7
    # Everything else can be given out; the quarantined pages cannot.
    # (one session may reserve only half of the pages: a second one takes the rest)
    third, _ = state.attach(GEOMETRY, pid=9)
    grabbed = [state.acquire(Acquire(holder.session_id, tokens(rng, 16), save=True)) for holder in (other, third)]
    grabbed_pages = set(grabbed[0].reserved_page_ids) | set(grabbed[1].reserved_page_ids)
    assert len(grabbed_pages) == namespace.num_pages - 7
    assert not grabbed_pages & writable
    state.check_integrity()
    for holder, reply in zip((other, third), grabbed):
        state.release(Release(holder.session_id, reply.lease_id))
    state.detach(third.session_id)
    keep_alive(state, clock, other, GRACE_S - 2.0 - 0.5)
    assert l2(state)["quarantined_pages"] == 7
    keep_alive(state, clock, other, 1.0)
    state.check_integrity()
    # (the grab above evicted the cached 2-page hit: every page is free now)
    assert l2(state)["quarantined_pages"] == 0 and namespace.l2_allocator.num_free == namespace.num_pages
    assert state.metrics.counters["quarantines_ended_grace"] == 1


def test_a_watched_session_survives_a_stall_and_past_the_grace_is_quarantined_until_its_process_exits(state, clock):
    """A session whose pid is watched keeps its session (and its pages private) while silent for up
    to session_grace_s; beyond it, the session ends and its pages stay quarantined however long
    after, until the process is seen gone."""
    rng = np.random.default_rng(2)
    stalled, namespace, _, writable = holding(state, rng, watched=True)
    clock.advance(GRACE_S - 0.1)
    assert state.expire_sessions() == []
    assert l2(state)["private_pages"] == 7 and state.watches(stalled.session_id)
    clock.advance(0.2)
    assert state.expire_sessions() == [stalled.session_id]
    assert state.metrics.counters["sessions_grace_exceeded"] == 1
    clock.advance(10 * GRACE_S)
    state.expire_sessions()
    state.check_integrity()
    assert l2(state)["quarantined_pages"] == 7 and state.watches(stalled.session_id)
    assert state.process_gone(stalled.session_id)
    state.check_integrity()
    assert l2(state)["quarantined_pages"] == 0 and not state.watches(stalled.session_id)
    assert namespace.l2_allocator.num_free == namespace.num_pages - 2
    assert state.metrics.counters["quarantines_ended_process_gone"] == 1


def test_a_watched_process_that_exits_loses_its_session_and_frees_its_pages_at_once(state, clock):
    """When a watched process exits, its session ends at once and its pages are free (no
    quarantine: nothing of the process can write any more); its locked prefix becomes evictable."""
    rng = np.random.default_rng(3)
    dead, namespace, _, _ = holding(state, rng, watched=True)
    assert state.process_gone(dead.session_id)
    state.check_integrity()
    assert state.leases == {} and state.quarantines == {}
    assert namespace.l2_allocator.num_free == namespace.num_pages - 2
    assert l2(state)["evictable_pages"] == 2
    assert state.metrics.counters["sessions_ended_process_gone"] == 1
    assert not state.process_gone(dead.session_id)          # told twice: nothing left to do


def test_a_reattach_naming_the_old_session_ends_its_quarantine_only_from_the_same_process(state, clock):
    """A new session that names an ended one as its previous session frees that session's
    quarantine if it comes from the same process (pid, pid namespace, start time); from another
    process (another pid, or the same pid with another start time) it changes nothing and is counted."""
    rng = np.random.default_rng(4)
    stale, namespace, _, _ = holding(state, rng, pid=7)
    clock.advance(TIMEOUT_S + 0.1)
    state.expire_sessions()
    assert l2(state)["quarantined_pages"] == 7
    for pid, start in ((8, START), (7, START + 1)):
        state.attach(GEOMETRY, pid=pid, pid_namespace_id=NS_ID, process_start_time=start,
                     previous_session_id=stale.session_id)
        assert l2(state)["quarantined_pages"] == 7
    assert state.metrics.counters["previous_session_refused"] == 2
    state.attach(GEOMETRY, pid=7, pid_namespace_id=NS_ID, process_start_time=START,
                 previous_session_id=stale.session_id)
    state.check_integrity()
    assert l2(state)["quarantined_pages"] == 0 and state.metrics.counters["quarantines_ended_reattach"] == 1


def test_a_reattach_naming_a_live_session_ends_it_and_frees_its_pages(state):
    """A process that re-attaches naming its still-live old session (its transfers drained) ends
    that session: its leases are reclaimed and its pages free, not quarantined."""
    rng = np.random.default_rng(5)
    old, namespace, _, _ = holding(state, rng, pid=7)
    new, _ = state.attach(GEOMETRY, pid=7, pid_namespace_id=NS_ID, process_start_time=START,
                          previous_session_id=old.session_id)
    state.check_integrity()
    assert set(state.sessions) == {new.session_id}
    assert state.leases == {} and state.quarantines == {}
    assert namespace.l2_allocator.num_free == namespace.num_pages - 2


def test_a_commit_from_an_ended_session_is_refused_and_counted(state, clock):
    """Commits (after a locked hit or of a fresh prefix) from a session that has ended are refused
    with NOT_ATTACHED, publish nothing, and are counted; a commit naming a session that never
    existed is refused too but not counted as one."""
    rng = np.random.default_rng(6)
    stale, namespace, (after_hit, fresh), _ = holding(state, rng)
    third = state.acquire(Acquire(stale.session_id, tokens(rng, 1), save=True))   # its last page under the cap
    clock.advance(TIMEOUT_S + 0.1)
    state.expire_sessions()
    for commit in (lambda: state.commit(Commit(stale.session_id, after_hit.lease_id, after_hit.reserved_page_ids)),
                   lambda: state.commit(Commit(stale.session_id, fresh.lease_id, fresh.reserved_page_ids[:2])),
                   lambda: state.commit(Commit(12345, third.lease_id, third.reserved_page_ids))):
        with pytest.raises(ProtocolError) as error:
            commit()
        assert error.value.code == ErrorCode.NOT_ATTACHED
    state.check_integrity()
    assert state.metrics.counters["commits_refused_session_ended"] == 2
    assert l2(state)["owned_pages"] == 2 and l2(state)["quarantined_pages"] == 8


def test_time_the_daemon_did_not_run_is_not_counted_against_sessions(state, clock):
    """A gap between two reaper observations longer than expected is credited to every session:
    a session silent 1 s before a 2 s daemon pause is not expired after it, while one that stays
    silent long enough once the daemon runs again is."""
    rng = np.random.default_rng(7)
    session, _ = state.attach(GEOMETRY, pid=7)
    for _ in range(10):                              # 1 s of regular reaper ticks
        clock.advance(0.1)
        assert state.note_running(0.3) == 0.0
        state.expire_sessions()
    clock.advance(2.0)                               # the daemon was stopped
    assert state.note_running(0.3) == pytest.approx(1.7)
    assert state.expire_sessions() == []
    state.acquire(Acquire(session.session_id, tokens(rng, 1)))      # alive: a request refreshes it
    for _ in range(14):
        clock.advance(0.1)
        state.note_running(0.3)
        assert state.expire_sessions() == []
    clock.advance(0.2)
    state.note_running(0.3)
    assert state.expire_sessions() == [session.session_id]
    assert state.metrics.counters["daemon_pauses"] == 1


def test_integrity_detects_a_quarantined_page_that_is_also_free(state, clock):
    """check_integrity fails when a quarantined page is also in the allocator's free set."""
    rng = np.random.default_rng(8)
    stale, namespace, _, _ = holding(state, rng)
    clock.advance(TIMEOUT_S + 0.1)
    state.expire_sessions()
    state.check_integrity()
    quarantine = state.quarantines[stale.session_id]
    namespace.l2_allocator.free(quarantine.page_ids[:1])
    with pytest.raises(IntegrityError, match="both free and quarantined"):
        state.check_integrity()


def test_a_namespace_with_quarantined_pages_keeps_its_arena(clock):
    """The arena of a namespace whose pages are quarantined is not given to a new geometry (a stale
    writer may still write it) until the quarantine ends."""
    state = DaemonState(2 << 20, max_namespaces=1, session_timeout_s=TIMEOUT_S, session_grace_s=GRACE_S, clock=clock)
    rng = np.random.default_rng(9)
    holding(state, rng)
    clock.advance(TIMEOUT_S + 0.1)
    state.expire_sessions()
    other_geometry = dataclasses.replace(GEOMETRY, model_id="other")
    with pytest.raises(ProtocolError) as error:
        state.attach(other_geometry, pid=9)
    assert error.value.code == ErrorCode.OUT_OF_SPACE
    clock.advance(GRACE_S)
    state.expire_sessions()
    state.attach(other_geometry, pid=9)
    state.check_integrity()
    assert state.metrics.counters["namespaces_reclaimed"] == 1
