"""The pool shared in chunks (kvcached/core/chunks.py) by the namespaces of a DaemonState: one
geometry holds all of it; others take chunks from idle or colder ones, never a chunk holding a
page someone may still write or read; evictions under pressure are counted and logged once per
episode; the L3 index follows chunks as they move."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvcached.core.daemon import MAX_SESSION_RESERVED_SHARE, DaemonState
from kvcached.core.l3_index import namespace_key
from kvcached.core.pool import CHUNK_SCAN_INTERVAL_S, PRESSURE_QUIET_S
from kvcached.core.tiers import IntegrityError, Tier
from proto.messages import KVGeometry
from kvcached.testing.clock import FakeClock
from proto.schema import Acquire, Commit, Lookup, Release
from tests.core.test_l3_index import ReplayedIndex, SimulatedTiers, index_matches_tree

PAGE = 8
# 16 KiB pages: 128 in a 2 MiB chunk. 24 KiB pages: 85 and a third, so pages straddle chunks.
SMALL = KVGeometry("small", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", page_size=PAGE)
ODD = KVGeometry("odd", num_layers=3, num_kv_heads=2, head_dim=64, dtype="float32", page_size=PAGE)
L2_BYTES = 8 << 20          # 4 chunks of 2 MiB


@pytest.fixture
def clock():
    return FakeClock()


def new_state(clock, l2_bytes=L2_BYTES, l3_bytes=0, index=None) -> DaemonState:
    return DaemonState(l2_bytes, max_namespaces=4, session_timeout_s=1.5, session_grace_s=30.0, l3_bytes=l3_bytes,
                       clock=clock, l3_index_sink=index)


def tokens(rng, num_pages: int) -> bytes:
    return rng.integers(0, 1 << 30, size=num_pages * PAGE, dtype=np.int32).tobytes()


def back_up(state: DaemonState, session_id: int, token_bytes: bytes) -> list[int]:
    """Back up a prefix in extensions of at most a session's reservation cap; returns its pages."""
    namespace = state.namespaces[state.sessions[session_id].namespace_id]
    step = int(namespace.num_pages * MAX_SESSION_RESERVED_SHARE)
    num_pages = len(token_bytes) // (4 * PAGE)
    page_ids = []
    for end in list(range(step, num_pages, step)) + [num_pages]:
        reply = state.acquire(Acquire(session_id, token_bytes[:end * 4 * PAGE], save=True))
        _, write_through = state.commit(Commit(session_id, reply.lease_id, reply.reserved_page_ids))
        if write_through is not None:
            state.finish_move(write_through, ok=True)
        page_ids += reply.reserved_page_ids
    state.check_integrity()
    return page_ids


def l2_hit_pages(state: DaemonState, session_id: int, token_bytes: bytes) -> int:
    return state.lookup(Lookup(session_id, token_bytes, prefetch=True)).hit_tokens["l2"] // PAGE


def l2_status(state: DaemonState, geometry: KVGeometry) -> dict:
    namespace = state.geometry_to_namespace[geometry]
    (entry,) = [n for n in state.status()["namespaces"] if n["namespace_id"] == namespace.namespace_id]
    return entry["tiers"]["l2"]


def chunk_of(page_id: int, geometry: KVGeometry, chunk_bytes: int = 2 << 20) -> set[int]:
    first = page_id * geometry.bytes_per_page // chunk_bytes
    return {first, ((page_id + 1) * geometry.bytes_per_page - 1) // chunk_bytes}


def fill_with_prefixes(state, clock, session_id, rng, num_prefixes: int, num_pages: int) -> list[bytes]:
    prefixes = []
    for _ in range(num_prefixes):
        clock.advance(1)
        prefixes.append(tokens(rng, num_pages))
        back_up(state, session_id, prefixes[-1])
    return prefixes


def test_one_geometry_holds_the_whole_pool(clock, rng):
    """With four namespaces allowed, a single geometry whose pages straddle chunk boundaries may
    use every page of the L2 segment and of the L3 file (space_bytes // bytes_per_page), and fills
    L2 to the last page before it evicts anything."""
    state = new_state(clock, l3_bytes=16 << 20)
    session, namespace = state.attach(ODD, pid=1)
    assert namespace.capacity == {Tier.L2: L2_BYTES // ODD.bytes_per_page, Tier.L3: (16 << 20) // ODD.bytes_per_page}
    capacity = namespace.capacity[Tier.L2]
    page_ids = []
    while len(page_ids) < capacity:
        page_ids += back_up(state, session.session_id, tokens(rng, min(37, capacity - len(page_ids))))
    assert sorted(page_ids) == list(range(capacity))
    assert l2_status(state, ODD)["owned_pages"] == capacity and l2_status(state, ODD)["evicted_pages"] == 0
    assert state.metrics.counters["evicted_pages_l2"] == 0
    back_up(state, session.session_id, tokens(rng, 1))                 # its oldest prefix goes
    assert l2_status(state, ODD)["evicted_pages"] == 37
    assert l2_status(state, ODD)["owned_pages"] == capacity - 36


def test_a_second_geometry_takes_the_coldest_chunks_of_an_idle_first_one(clock, rng, caplog):
    """The first geometry fills the pool with 8 prefixes (two per chunk, oldest first) and goes
    idle; a second geometry backing up 100 pages of its own takes the two coldest chunks: the 4
    oldest prefixes of the first are evicted, the 4 newest still hit, each namespace's pages lie
    in its own chunks, and the first namespace's evictions are counted and logged once."""
    state = new_state(clock)
    first, first_ns = state.attach(SMALL, pid=1)
    prefixes = fill_with_prefixes(state, clock, first.session_id, rng, 8, 64)
    assert first_ns.capacity[Tier.L2] == 512 and first_ns.l2_allocator.num_free == 0
    state.detach(first.session_id)
    clock.advance(1)

    second, second_ns = state.attach(ODD, pid=2)
    assert second_ns.capacity[Tier.L2] == 0
    with caplog.at_level(logging.WARNING, logger="kvcached.core.pool"):
        second_pages = back_up(state, second.session_id, tokens(rng, 100))
    assert state.chunks[Tier.L2].owner == [second_ns.namespace_id] * 2 + [first_ns.namespace_id] * 2
    assert all(chunk_of(p, ODD) <= {0, 1} for p in second_pages) and len(second_pages) == 100
    assert second_ns.capacity[Tier.L2] == 170 and first_ns.capacity[Tier.L2] == 256
    watcher, _ = state.attach(SMALL, pid=3)
    assert [l2_hit_pages(state, watcher.session_id, p) for p in prefixes] == [0] * 4 + [64] * 4
    status = l2_status(state, SMALL)
    assert status["evicted_pages"] == 256 and status["under_pressure"] and status["pressure_episodes"] == 1
    assert state.metrics.counters["chunks_taken_l2"] == 2
    warnings = [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"namespace {first_ns.namespace_id} (small)")
    state.check_integrity()


def test_an_active_namespace_gives_up_only_chunks_colder_than_what_the_taker_could_evict(clock, rng):
    """Both namespaces active: the newcomer, with nothing to evict, takes the coldest chunk; then
    another, as the first's chunks are colder than its own oldest page; once the first has
    touched every prefix it kept, the newcomer evicts its own pages and no chunk moves."""
    state = new_state(clock)
    first, first_ns = state.attach(SMALL, pid=1)
    prefixes = fill_with_prefixes(state, clock, first.session_id, rng, 8, 64)
    second_geometry = KVGeometry("second", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", page_size=PAGE)
    second, second_ns = state.attach(second_geometry, pid=2)
    clock.advance(1)
    back_up(state, second.session_id, tokens(rng, 100))          # chunk 0: prefixes 0 and 1 go
    assert state.metrics.counters["chunks_taken_l2"] == 1 and second_ns.capacity[Tier.L2] == 128
    clock.advance(1)
    back_up(state, second.session_id, tokens(rng, 100))          # chunk 1: prefixes 2 and 3 go
    assert state.metrics.counters["chunks_taken_l2"] == 2 and second_ns.capacity[Tier.L2] == 256
    assert l2_status(state, second_geometry)["evicted_pages"] == 0
    clock.advance(1)
    for prefix in prefixes[4:]:                                     # the first touches what it kept
        reply = state.acquire(Acquire(first.session_id, prefix))
        state.release(Release(first.session_id, reply.lease_id))
    clock.advance(CHUNK_SCAN_INTERVAL_S + 1)
    back_up(state, second.session_id, tokens(rng, 200))          # 56 free: its two older prefixes go
    assert state.metrics.counters["chunks_taken_l2"] == 2, "a chunk warmer than the taker's own pages moved"
    assert l2_status(state, second_geometry)["evicted_pages"] == 200
    assert [l2_hit_pages(state, first.session_id, p) for p in prefixes] == [0] * 4 + [64] * 4
    state.check_integrity()


def test_chunks_holding_leased_private_or_quarantined_pages_never_change_hands(clock, rng):
    """Chunk 0 holds a prefix under a lease, chunk 2 a session's reserved pages, chunk 3
    the pages of a session that went silent (quarantined: it may still write them): a second
    geometry that asks for the whole pool gets chunk 1 only. Once the lease and the reservation
    are released, the quarantine has ended and the first geometry is idle, it gets the other three."""
    state = new_state(clock)
    holder, first_ns = state.attach(SMALL, pid=1)
    leased, plain = tokens(rng, 128), tokens(rng, 128)
    back_up(state, holder.session_id, leased)
    back_up(state, holder.session_id, plain)
    lease = state.acquire(Acquire(holder.session_id, leased))
    reserver, _ = state.attach(SMALL, pid=2)
    reservation = state.acquire(Acquire(reserver.session_id, tokens(rng, 128), save=True))
    silent, _ = state.attach(SMALL, pid=3)
    state.acquire(Acquire(silent.session_id, tokens(rng, 128), save=True))
    assert {page_id // 128 for page_id in reservation.reserved_page_ids} == {2}
    live = [holder.session_id, reserver.session_id]

    def wait(seconds: float) -> None:
        """Time passes; the live sessions send heartbeats, the silent one does not."""
        while seconds > 0:
            clock.advance(min(seconds, 1.0))
            seconds -= 1.0
            for session_id in live:
                state.heartbeat(session_id)
            state.expire_sessions()

    wait(2.0)
    assert silent.session_id not in state.sessions and len(state.quarantines) == 1
    taker, taker_ns = state.attach(ODD, pid=4)
    live.append(taker.session_id)
    for _ in range(3):
        wait(CHUNK_SCAN_INTERVAL_S + 0.1)
        back_up(state, taker.session_id, tokens(rng, 150))
    owner = state.chunks[Tier.L2].owner
    assert owner == [first_ns.namespace_id, taker_ns.namespace_id, first_ns.namespace_id, first_ns.namespace_id]
    assert l2_hit_pages(state, holder.session_id, leased) == 128 and l2_hit_pages(state, holder.session_id, plain) == 0
    state.check_integrity()

    state.release(Release(holder.session_id, lease.lease_id))
    state.release(Release(reserver.session_id, reservation.lease_id))
    wait(30.0)
    assert not state.quarantines
    for session_id in (holder.session_id, reserver.session_id):   # idle: one-use pages may take all of it
        state.detach(session_id)
        live.remove(session_id)
    back_up(state, taker.session_id, tokens(rng, 300))
    assert state.chunks[Tier.L2].owner == [taker_ns.namespace_id] * 4
    state.check_integrity()


def test_integrity_finds_pages_outside_their_namespace_s_chunks(clock, rng):
    """check_integrity fails when a namespace holds pages of a chunk it does not own."""
    state = new_state(clock)
    session, _ = state.attach(SMALL, pid=1)
    back_up(state, session.session_id, tokens(rng, 4))
    state.chunks[Tier.L2].owner[0] = None
    with pytest.raises(IntegrityError, match="capacity"):
        state.check_integrity()


def test_pressure_is_logged_once_per_episode_and_shown_in_status(clock, rng, caplog):
    """Evictions to make room start an episode: one warning, status under_pressure; more evictions
    within PRESSURE_QUIET_S of the last one log nothing new; after a quiet period status clears,
    and the next eviction starts (and logs) a second episode."""
    state = new_state(clock, l2_bytes=2 << 20)
    session, namespace = state.attach(SMALL, pid=1)
    with caplog.at_level(logging.WARNING, logger="kvcached.core.pool"):
        back_up(state, session.session_id, tokens(rng, 128))
        assert not l2_status(state, SMALL)["under_pressure"]
        for _ in range(3):
            clock.advance(PRESSURE_QUIET_S / 2)
            back_up(state, session.session_id, tokens(rng, 32))
        evicted = l2_status(state, SMALL)["evicted_pages"]
        assert l2_status(state, SMALL)["under_pressure"] and evicted == state.metrics.counters["evicted_pages_l2"] > 0
        assert len([r for r in caplog.records if "is full" in r.getMessage()]) == 1
        clock.advance(PRESSURE_QUIET_S + 1)
        assert not l2_status(state, SMALL)["under_pressure"]
        back_up(state, session.session_id, tokens(rng, 128))
    assert l2_status(state, SMALL)["pressure_episodes"] == 2 == state.metrics.counters["pressure_episodes_l2"]
    assert len([r for r in caplog.records if "is full" in r.getMessage()]) == 2


def test_l3_chunks_that_change_hands_leave_the_index_true(clock, rng):
    """A first geometry fills L3 (written through) and goes idle; a second one's write-throughs take
    L3 chunks from it. After every step the index names exactly what each tree holds in L3, no
    chunk holds rows of both, and a state rebuilt from the index gives each its rows back."""
    from tests.core.test_daemon_state import GEOMETRY as BIG          # 128 KiB pages: 16 per chunk

    other = KVGeometry("other-big", num_layers=4, num_kv_heads=4, head_dim=128, dtype="float32", page_size=PAGE)
    index = ReplayedIndex()
    state = new_state(clock, l2_bytes=4 << 20, l3_bytes=8 << 20, index=index)
    tiers = SimulatedTiers(state, rng)
    first, _ = state.attach(BIG, pid=1)
    for _ in range(9):
        clock.advance(1)
        tiers.back_up(first.session_id, tokens(rng, 8))
        index_matches_tree(state, index, BIG)
    assert state.metrics.counters["evicted_pages_l3"] > 0
    state.detach(first.session_id)
    second, second_ns = state.attach(other, pid=2)
    for _ in range(3):
        clock.advance(1)
        tiers.back_up(second.session_id, tokens(rng, 8))
        for geometry in (BIG, other):
            index_matches_tree(state, index, geometry)
    l3 = state.chunks[Tier.L3]
    assert state.metrics.counters["chunks_taken_l3"] >= 1 and second_ns.capacity[Tier.L3] >= 16
    rows_chunks = [{slot * BIG.bytes_per_page // l3.chunk_bytes for slot in index.rows[namespace_key(g)]}
                   for g in (BIG, other)]
    assert not rows_chunks[0] & rows_chunks[1]

    after = ReplayedIndex()
    after.layouts, after.rows = dict(index.layouts), {k: dict(v) for k, v in index.rows.items()}
    rebuilt = new_state(FakeClock(), l2_bytes=4 << 20, l3_bytes=8 << 20, index=after)
    assert rebuilt.restore_l3(index.saved(), l3_bytes_kept=8 << 20) == sum(map(len, index.rows.values()))
    rebuilt.check_integrity()
    for geometry in (BIG, other):
        index_matches_tree(rebuilt, after, geometry)
        assert after.rows[namespace_key(geometry)] == index.rows[namespace_key(geometry)]


def test_a_first_geometry_with_pages_larger_than_a_chunk_gets_the_pool_cut_for_it(clock, rng):
    """A small pool (chunks of 2 MiB) and a first geometry of 2.25 MiB pages (as Qwen3-8B's): it is
    served, the pool is cut in chunks that hold one of its pages, and it may use every page of
    the segment; a later geometry with pages larger than those chunks is refused, naming them."""
    big = KVGeometry("m", num_layers=36, num_kv_heads=8, head_dim=128 * 16 // PAGE, dtype="bfloat16", page_size=PAGE)
    state = new_state(clock, l2_bytes=64 << 20)
    assert state.chunks[Tier.L2].chunk_bytes == 2 << 20 < big.bytes_per_page
    session, namespace = state.attach(big, pid=1)
    assert state.chunks[Tier.L2].chunk_bytes >= big.bytes_per_page
    assert namespace.capacity[Tier.L2] == (64 << 20) // big.bytes_per_page
    page_ids = back_up(state, session.session_id, tokens(rng, 5))
    assert len(page_ids) == 5
    state.check_integrity()
    bigger = KVGeometry("m2", num_layers=80, num_kv_heads=8, head_dim=128 * 16 // PAGE, dtype="bfloat16", page_size=PAGE)
    with pytest.raises(Exception, match="larger than a chunk"):
        state.attach(bigger, pid=2)
