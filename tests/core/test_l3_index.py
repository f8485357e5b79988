"""The persistent L3 index as the state records it: rows follow L3 residency (evictions delete
them), a replayed index rebuilds the same residency, torn or missing rows lose only themselves and
what lies below them, a changed layout drops what no longer fits, a corrupt slot is never published."""

from __future__ import annotations

import dataclasses
import secrets
import zlib

import numpy as np
import pytest

from kvcached.core.daemon import DaemonState
from kvcached.core.l3_index import (DeleteSlots, DropNamespace, NamespaceLayout, PutNamespace, PutSlots, SavedNamespace,
                                    SlotRow, namespace_key, plan_rebuild)
from kvcached.core.tier_ops import TierMove
from kvcached.core.tiers import Tier
from kvcached.testing.clock import FakeClock
from proto.page_keys import ROOT_KEY, chain_page_keys, page_key
from proto.schema import Acquire, Commit, Release
from tests.core.test_daemon_state import GEOMETRY, PAGE

OTHER_GEOMETRY = dataclasses.replace(GEOMETRY, model_id="other")
L2_BYTES = 2 << 20                      # 16 pages of 131072 bytes
L3_BYTES = 4 << 20                      # 32 slots


@pytest.fixture
def rng() -> np.random.Generator:
    seed = secrets.randbits(32)
    print(f"seed={seed}")            # shown by pytest when the test fails
    return np.random.default_rng(seed)


class ReplayedIndex:
    """The index file as the writer leaves it once it has applied every change, in order."""

    def __init__(self) -> None:
        self.layouts: dict = {}
        self.rows: dict[str, dict[int, object]] = {}

    def __call__(self, change) -> None:
        if isinstance(change, PutNamespace):
            self.layouts[change.layout.namespace_key] = change.layout
            self.rows.setdefault(change.layout.namespace_key, {})
        elif isinstance(change, DropNamespace):
            self.layouts.pop(change.namespace_key, None)
            self.rows.pop(change.namespace_key, None)
        elif isinstance(change, PutSlots):
            self.rows[change.namespace_key].update({row.slot: row for row in change.rows})
        elif isinstance(change, DeleteSlots):
            for slot in change.slot_ids:
                self.rows.get(change.namespace_key, {}).pop(slot, None)

    def saved(self) -> list[SavedNamespace]:
        return [SavedNamespace(layout, list(self.rows[key].values())) for key, layout in self.layouts.items()]


class SimulatedTiers:
    """What the L2 pages and L3 slots behind a DaemonState hold, moved as the I/O layer moves them
    (with the checksums and keys it reports)."""

    def __init__(self, state: DaemonState, rng: np.random.Generator):
        self.state, self.rng = state, rng
        self.l2: dict[int, bytes] = {}
        self.l3: dict[int, bytes] = {}

    def back_up(self, session_id: int, token_bytes: bytes) -> None:
        reply = self.state.acquire(Acquire(session_id, token_bytes, save=True))
        for page in reply.reserved_page_ids:
            self.l2[page] = self.rng.bytes(32)
        _, move = self.state.commit(Commit(session_id, reply.lease_id, reply.reserved_page_ids))
        if move is not None:
            self.finish(move)
        self.state.check_integrity()

    def finish(self, move: TierMove) -> None:
        page_size = self.state.namespaces[move.namespace_id].geometry.page_size
        source, destination = (self.l2, self.l3) if move.destination is Tier.L3 else (self.l3, self.l2)
        for src, dst in zip(move.source_page_ids, move.private_page_ids):
            destination[dst] = source[src]
        move.page_checksums = [zlib.crc32(destination[dst]) for dst in move.private_page_ids]
        move.page_keys = chain_page_keys(move.token_ids, page_size, move.start_page + len(move.source_page_ids))
        self.state.finish_move(move, ok=True)

    def promote(self, session_id: int, token_bytes: bytes):
        """An acquire that promotes from L3 first, as the server runs it; the lease is released."""
        request = Acquire(session_id, token_bytes, promote="wait")
        outcome = self.state.acquire(request)
        if isinstance(outcome, TierMove):
            self.finish(outcome)
            outcome = self.state.acquire_after(request, outcome)
        if outcome.lease_id is not None:
            self.state.release(Release(session_id, outcome.lease_id))
        self.state.check_integrity()
        return outcome


def l3_page_ids(state: DaemonState, geometry, token_bytes: bytes) -> list[int]:
    tree = state.geometry_to_namespace[geometry].tree
    return tree.match(np.frombuffer(token_bytes, dtype="<i4")).page_ids[Tier.L3]


def index_matches_tree(state: DaemonState, index: ReplayedIndex, geometry=GEOMETRY) -> None:
    namespace = state.geometry_to_namespace[geometry]
    owned = namespace.tree.check_integrity()[Tier.L3]
    rows = index.rows[namespace_key(geometry)]
    assert set(rows) == owned
    assert all(int(namespace.l3_checksums[slot]) == row.checksum for slot, row in rows.items())


def random_workload(state: DaemonState, tiers: SimulatedTiers, index: ReplayedIndex, rng, num_steps: int = 40,
                    geometry=GEOMETRY) -> list[bytes]:
    """New prefixes and extensions of earlier ones (so the tree branches), more than L3 holds; the
    index is checked against the tree after every step."""
    session, _ = state.attach(geometry, pid=1)
    prefixes: list[bytes] = []
    for _ in range(num_steps):
        if prefixes and rng.random() < 0.5:
            head = prefixes[rng.integers(len(prefixes))]
            head = head[:PAGE * 4 * int(rng.integers(1, len(head) // (PAGE * 4) + 1))]
            prefix = head + rng.integers(0, 1 << 30, size=int(rng.integers(1, 4)) * PAGE, dtype=np.int32).tobytes()
        else:
            prefix = rng.integers(0, 1 << 30, size=int(rng.integers(1, 6)) * PAGE, dtype=np.int32).tobytes()
        tiers.back_up(session.session_id, prefix)
        prefixes.append(prefix)
        index_matches_tree(state, index, geometry)
    return prefixes


def new_state(index: ReplayedIndex | None = None, l2_bytes=L2_BYTES, l3_bytes=L3_BYTES,
              max_namespaces=1) -> DaemonState:
    return DaemonState(l2_bytes, max_namespaces=max_namespaces, session_timeout_s=1.5, l3_bytes=l3_bytes,
                       clock=FakeClock(), l3_index_sink=index)


def test_index_rows_are_the_tree_l3_pages_after_every_step(rng):
    """Each write-through adds rows for the slots it published, each L3 eviction deletes its slots'
    rows: after every step the index names exactly the slots the tree holds in L3, with their checksums."""
    index = ReplayedIndex()
    state = new_state(index)
    random_workload(state, SimulatedTiers(state, rng), index, rng)
    assert state.metrics.counters["evicted_pages_l3"] > 0, "the workload must overflow L3"


def test_a_replayed_index_rebuilds_the_same_l3_residency_and_it_is_served(rng):
    """A new state rebuilt from the index holds every prefix in L3 in the same slots with the same
    checksums; promoting each one puts the bytes the old state wrote into L2."""
    index = ReplayedIndex()
    state = new_state(index)
    tiers = SimulatedTiers(state, rng)
    prefixes = random_workload(state, tiers, index, rng)
    before = [l3_page_ids(state, GEOMETRY, prefix) for prefix in prefixes]

    index_after = ReplayedIndex()
    index_after.layouts, index_after.rows = dict(index.layouts), {k: dict(v) for k, v in index.rows.items()}
    rebuilt = new_state(index_after)
    assert rebuilt.restore_l3(index.saved(), l3_bytes_kept=L3_BYTES) == sum(map(len, index.rows.values()))
    rebuilt.check_integrity()
    assert [l3_page_ids(rebuilt, GEOMETRY, prefix) for prefix in prefixes] == before
    index_matches_tree(rebuilt, index_after)

    session, _ = rebuilt.attach(GEOMETRY, pid=2)
    served = SimulatedTiers(rebuilt, rng)
    served.l3 = dict(tiers.l3)
    original = {slot: tiers.l3[slot] for slots in before for slot in slots}
    for prefix, slots in zip(prefixes, before):
        served.promote(session.session_id, prefix)
        l2_ids = rebuilt.geometry_to_namespace[GEOMETRY].tree.match(
            np.frombuffer(prefix, dtype="<i4")).page_ids[Tier.L2]
        assert len(l2_ids) == min(len(slots), 16)
        assert [served.l2[p] for p in l2_ids] == [original[s] for s in slots[:len(l2_ids)]]
    assert rebuilt.metrics.counters["s2h_pages_published"] > 0
    assert rebuilt.metrics.counters["l3_checksum_mismatches"] == 0


def two_prefixes_index(rng) -> tuple[ReplayedIndex, bytes, bytes, bytes]:
    """An index of a (6 pages), b (a's first 2 pages + 3 of its own) and c (4 pages, unrelated)."""
    index = ReplayedIndex()
    state = new_state(index)
    tiers = SimulatedTiers(state, rng)
    session, _ = state.attach(GEOMETRY, pid=1)
    a = rng.integers(0, 1 << 30, size=6 * PAGE, dtype=np.int32).tobytes()
    b = a[:2 * PAGE * 4] + rng.integers(0, 1 << 30, size=3 * PAGE, dtype=np.int32).tobytes()
    c = rng.integers(0, 1 << 30, size=4 * PAGE, dtype=np.int32).tobytes()
    for prefix in (a, b, c):
        tiers.back_up(session.session_id, prefix)
    return index, a, b, c


def rebuilt_hits(index: ReplayedIndex, *prefixes) -> tuple[DaemonState, ReplayedIndex, list[int]]:
    index_after = ReplayedIndex()
    index_after.layouts, index_after.rows = dict(index.layouts), {k: dict(v) for k, v in index.rows.items()}
    rebuilt = new_state(index_after)
    rebuilt.restore_l3(index.saved(), l3_bytes_kept=L3_BYTES)
    rebuilt.check_integrity()
    index_matches_tree(rebuilt, index_after)
    return rebuilt, index_after, [len(l3_page_ids(rebuilt, GEOMETRY, p)) for p in prefixes]


def slot_of(index: ReplayedIndex, prefix: bytes, page: int) -> int:
    key = chain_page_keys(np.frombuffer(prefix, dtype="<i4"), PAGE, page + 1)[page]
    (slot,) = [slot for slot, row in index.rows[namespace_key(GEOMETRY)].items() if row.page_key == key]
    return slot


@pytest.mark.parametrize("tear", ["tokens", "key", "checksum", "short"])
def test_a_torn_row_loses_only_itself_and_what_lies_below_it(rng, tear):
    """A row that is not what it claims (tokens or key changed, checksum out of range, tokens cut
    short) is dropped with the pages below it; its siblings and other prefixes come back whole,
    and the rebuilt state deletes the dropped rows from the index."""
    index, a, b, c = two_prefixes_index(rng)
    rows = index.rows[namespace_key(GEOMETRY)]
    slot = slot_of(index, a, 3)
    row = rows[slot]
    rows[slot] = {"tokens": row._replace(token_bytes=bytes([row.token_bytes[0] ^ 1]) + row.token_bytes[1:]),
                  "key": row._replace(page_key=bytes(16)),
                  "checksum": row._replace(checksum=1 << 32),
                  "short": row._replace(token_bytes=row.token_bytes[:-4])}[tear]
    _, after, hits = rebuilt_hits(index, a, b, c)
    assert hits == [3, 5, 4]
    assert len(after.rows[namespace_key(GEOMETRY)]) == 3 + 3 + 4


def test_a_missing_row_loses_only_what_lies_below_it(rng):
    """With the row of a's page 3 gone (a write whose row never landed), a comes back with 3 pages,
    b and c whole; a's rows below the gap are deleted from the index."""
    index, a, b, c = two_prefixes_index(rng)
    del index.rows[namespace_key(GEOMETRY)][slot_of(index, a, 3)]
    _, after, hits = rebuilt_hits(index, a, b, c)
    assert hits == [3, 5, 4]
    assert len(after.rows[namespace_key(GEOMETRY)]) == 3 + 3 + 4


def test_plan_rebuild_keys_chain_from_the_root():
    """Each page's key digests its parent's key and its tokens, from ROOT_KEY: equal pages under
    different parents have different keys, and a rebuilt run's path is the original path."""
    tokens = np.arange(3 * PAGE, dtype=np.int32)
    keys = chain_page_keys(tokens, PAGE, 3)
    assert keys[0] == page_key(ROOT_KEY, tokens[:PAGE].tobytes())
    assert keys[2] == page_key(keys[1], tokens[2 * PAGE:].tobytes())
    repeated = np.concatenate([tokens[:PAGE], tokens[:PAGE]])
    assert len(set(chain_page_keys(repeated, PAGE, 2))) == 2
    rows = [SlotRow(slot, keys[page], keys[page - 1] if page else ROOT_KEY,
                    tokens[page * PAGE:(page + 1) * PAGE].tobytes(), zlib.crc32(bytes([page])))
            for page, slot in enumerate((7, 3, 9))]
    plan = plan_rebuild(rows, PAGE, num_slots=10)
    assert [(run.start_page, run.slot_ids) for run in plan.runs] == [(0, [7, 3, 9])]
    assert plan.runs[0].token_bytes == tokens.tobytes() and plan.runs[0].parent_key == ROOT_KEY
    assert plan.dropped_slot_ids == []


def test_a_branchy_plan_holds_each_row_once_and_rebuilds_every_path(rng):
    """A history of 40 pages with 30 continuations of 3 pages branching off it: the plan holds
    each row's tokens once (no path from the root per run, so its size is O(rows)), every run's
    parent run comes before it, and the rebuilt tree holds every continuation's whole path in L3
    in the slots its rows name."""
    history = rng.integers(0, 1 << 30, size=40 * PAGE, dtype=np.int32)
    paths = [history]
    for branch_page in rng.integers(1, 40, size=30).tolist():
        paths.append(np.concatenate([history[:branch_page * PAGE],
                                     rng.integers(0, 1 << 30, size=3 * PAGE, dtype=np.int32)]))
    rows: dict[bytes, SlotRow] = {}
    for path in paths:
        keys = chain_page_keys(path, PAGE, len(path) // PAGE)
        for page, key in enumerate(keys):
            if key not in rows:
                rows[key] = SlotRow(len(rows), key, keys[page - 1] if page else ROOT_KEY,
                                    path[page * PAGE:(page + 1) * PAGE].tobytes(), int(rng.integers(1 << 32)))
    plan = plan_rebuild(list(rows.values()), PAGE, num_slots=len(rows))
    assert plan.dropped_slot_ids == []
    assert sum(len(run.token_bytes) for run in plan.runs) == len(rows) * PAGE * 4
    ends = {ROOT_KEY}
    for run in plan.runs:
        assert run.parent_key in ends
        ends.add(run.end_key)
    state = new_state(l3_bytes=len(rows) * GEOMETRY.bytes_per_page)
    layout = NamespaceLayout(namespace_key(GEOMETRY), GEOMETRY, GEOMETRY.bytes_per_page)
    assert state.restore_l3([SavedNamespace(layout, list(rows.values()))], len(rows) * GEOMETRY.bytes_per_page) \
        == len(rows)
    state.check_integrity()
    for path in paths:
        keys = chain_page_keys(path, PAGE, len(path) // PAGE)
        assert l3_page_ids(state, GEOMETRY, path.tobytes()) == [rows[key].slot for key in keys]


def test_a_changed_layout_drops_what_no_longer_fits(rng):
    """Rows of two namespaces sharing an L3 file of four chunks, rebuilt: with the same sizes, all
    of them; with one namespace served, the one with fewer rows is dropped whole; with 10 slots'
    worth of bytes kept, each prefix up to its first slot at or past 10; in a larger file cut into
    larger chunks, the namespace with more rows whole and, of the other, only rows in chunks the
    first did not claim. What is dropped leaves the index, what is kept matches the tree, and no
    chunk holds rows of two namespaces."""
    index = ReplayedIndex()
    state = new_state(index, l2_bytes=4 << 20, l3_bytes=8 << 20, max_namespaces=2)
    assert state.chunks[Tier.L3].num_chunks == 4
    tiers = SimulatedTiers(state, rng)
    prefixes = {GEOMETRY: random_workload(state, tiers, index, rng, num_steps=20)}
    prefixes[OTHER_GEOMETRY] = random_workload(state, tiers, index, rng, num_steps=3, geometry=OTHER_GEOMETRY)
    counts = {g: len(index.rows[namespace_key(g)]) for g in prefixes}
    for _ in range(5):          # the rebuild keeps the namespace with more rows: no tie
        if counts[GEOMETRY] != counts[OTHER_GEOMETRY]:
            break
        prefixes[GEOMETRY] += random_workload(state, tiers, index, rng, num_steps=1)
        counts = {g: len(index.rows[namespace_key(g)]) for g in prefixes}
    assert min(counts.values()) > 0 and counts[GEOMETRY] != counts[OTHER_GEOMETRY], counts
    larger, smaller = sorted(prefixes, key=lambda g: counts[g], reverse=True)
    before = {g: [l3_page_ids(state, g, prefix) for prefix in prefixes[g]] for g in prefixes}

    def rebuild(l3_bytes, kept_bytes, max_namespaces=2):
        after = ReplayedIndex()
        after.layouts, after.rows = dict(index.layouts), {k: dict(v) for k, v in index.rows.items()}
        rebuilt = new_state(after, l2_bytes=4 << 20, l3_bytes=l3_bytes, max_namespaces=max_namespaces)
        rebuilt.restore_l3(index.saved(), l3_bytes_kept=kept_bytes)
        rebuilt.check_integrity()
        chunks = rebuilt.chunks[Tier.L3]
        row_chunks = {}
        for g in prefixes:
            if g in rebuilt.geometry_to_namespace:
                index_matches_tree(rebuilt, after, g)
                row_chunks[g] = {slot * g.bytes_per_page // chunks.chunk_bytes for slot in after.rows[namespace_key(g)]}
            else:
                assert namespace_key(g) not in after.rows
        assert not set.intersection(*row_chunks.values()) if len(row_chunks) == 2 else True
        hits = {g: [l3_page_ids(rebuilt, g, prefix) for prefix in prefixes[g]]
                for g in prefixes if g in rebuilt.geometry_to_namespace}
        return after, hits

    def below(g, limit):
        """Each prefix's leading slots, up to its first slot at or past limit."""
        kept = []
        for slots in before[g]:
            run = []
            for slot in slots:
                if slot >= limit:
                    break
                run.append(slot)
            kept.append(run)
        return kept

    _, hits = rebuild(8 << 20, 8 << 20)
    assert hits == before
    _, hits = rebuild(8 << 20, 8 << 20, max_namespaces=1)
    assert hits == {larger: before[larger]}
    _, hits = rebuild(8 << 20, 10 * GEOMETRY.bytes_per_page)
    assert hits == {g: below(g, 10) for g in prefixes}
    after, hits = rebuild(200 << 20, 8 << 20)         # chunks of 4 MiB: two old chunks in one
    assert hits[larger] == before[larger]
    old_rows = {g: index.rows[namespace_key(g)] for g in prefixes}
    new_chunk = {g: {slot: slot * g.bytes_per_page // (4 << 20) for slot in old_rows[g]} for g in prefixes}
    first_chunks = set(new_chunk[larger].values())
    clashing = {slot for slot, chunk in new_chunk[smaller].items() if chunk in first_chunks}
    kept = set(after.rows[namespace_key(smaller)])
    assert not kept & clashing and kept <= set(old_rows[smaller])
    if not clashing:
        assert hits[smaller] == before[smaller]


def test_a_slot_whose_bytes_fail_their_checksum_is_never_published(rng):
    """A promotion reading a slot whose bytes changed publishes only the pages before it; that page
    and those below it leave L3 and the index, the mismatch is counted, no L2 page leaks."""
    index = ReplayedIndex()
    state = new_state(index)
    tiers = SimulatedTiers(state, rng)
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = rng.integers(0, 1 << 30, size=6 * PAGE, dtype=np.int32).tobytes()
    tiers.back_up(session.session_id, prefix)
    for _ in range(2):      # L2 emptied of the prefix, half of it at a time (the per-session cap)
        tiers.back_up(session.session_id, rng.integers(0, 1 << 30, size=8 * PAGE, dtype=np.int32).tobytes())
    slots = l3_page_ids(state, GEOMETRY, prefix)
    assert len(slots) == 6 and namespace.tree.match(np.frombuffer(prefix, "<i4")).hit_tokens[Tier.L2] == 0
    written = [tiers.l3[slot] for slot in slots]
    tiers.l3[slots[3]] = bytes([written[3][0] ^ 0x10]) + written[3][1:]

    reply = tiers.promote(session.session_id, prefix)
    assert reply.hit_tokens["l2"] == 3 * PAGE and reply.promoted_tokens == 3 * PAGE
    assert reply.hit_tokens["l3"] == 3 * PAGE
    l2_ids = namespace.tree.match(np.frombuffer(prefix, "<i4")).page_ids[Tier.L2]
    assert [tiers.l2[p] for p in l2_ids] == written[:3]
    assert state.metrics.counters["l3_checksum_mismatches"] == 1
    assert state.metrics.counters["l3_pages_dropped_corrupt"] == 3
    assert not set(slots[3:]) & set(index.rows[namespace_key(GEOMETRY)])
    index_matches_tree(state, index)
    l2 = state.status()["namespaces"][0]["tiers"]["l2"]
    assert l2["private_pages"] == 0 and l2["free_pages"] + l2["owned_pages"] == l2["capacity_pages"]


def test_a_reclaimed_namespace_leaves_the_index():
    """When an idle namespace is reclaimed for another geometry, its layout and rows are dropped
    from the index and the newcomer's layout is recorded."""
    index = ReplayedIndex()
    state = new_state(index)
    rng = np.random.default_rng(7)
    tiers = SimulatedTiers(state, rng)
    session, _ = state.attach(GEOMETRY, pid=1)
    tiers.back_up(session.session_id, rng.integers(0, 1 << 30, size=3 * PAGE, dtype=np.int32).tobytes())
    assert len(index.rows[namespace_key(GEOMETRY)]) == 3
    state.detach(session.session_id)
    state.attach(OTHER_GEOMETRY, pid=2)
    assert list(index.layouts) == [namespace_key(OTHER_GEOMETRY)]
    assert namespace_key(GEOMETRY) not in index.rows


def test_a_temporary_l3_records_nothing():
    """Without an index sink (a temporary L3), namespaces keep no checksums and moves finish
    without them."""
    state = new_state(None)
    rng = np.random.default_rng(3)
    session, namespace = state.attach(GEOMETRY, pid=1)
    assert namespace.l3_checksums is None and namespace.index_key == ""
    reply = state.acquire(Acquire(session.session_id, rng.integers(0, 1 << 30, size=2 * PAGE, dtype=np.int32).tobytes(), save=True))
    _, move = state.commit(Commit(session.session_id, reply.lease_id, reply.reserved_page_ids))
    assert state.finish_move(move, ok=True) == 2
    state.check_integrity()
