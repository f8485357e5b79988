"""KV events in process: what the state records of each tier change (kvcached/core/kv_events.py),
the buffer's bound and merging, and the batches' encoding in vLLM's format. The wire (a daemon, a
SUB socket) is in tests/integration/test_kv_events.py; vLLM's own decoder, in tests/vllm."""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np
import pytest

from kvcached.core.daemon import DaemonState
from kvcached.core.kv_events import (REMOTE_WHERE, TIER_WHERE, EventBuffer, EventKind, KeyCache, TierEvent,
                                    encode_batches, encode_in_slices)
from kvcached.core.tiers import Tier
from proto.messages import KVGeometry
from proto.schema import Acquire, Commit

# 131072-byte pages: a 2 MiB pool holds exactly 16 pages of 8 tokens.
GEOMETRY = KVGeometry("m", num_layers=4, num_kv_heads=4, head_dim=128, dtype="float32", page_size=8)
PAGE = GEOMETRY.page_size
L2 = TIER_WHERE[Tier.L2]


def tokens(rng, num_pages: int) -> bytes:
    return rng.integers(0, 1 << 30, size=num_pages * PAGE, dtype=np.int32).tobytes()


def chained_hashes(token_bytes: bytes, num_pages: int) -> list[int]:
    """blake2b-128 of the parent's key and the page's tokens, from 16 zero bytes; as an int of its
    last 8 bytes (vLLM's default block hash)."""
    hashes, parent = [], bytes(16)
    for page in range(num_pages):
        parent = hashlib.blake2b(parent + token_bytes[page * 4 * PAGE:(page + 1) * 4 * PAGE], digest_size=16).digest()
        hashes.append(int.from_bytes(parent[8:], "big"))
    return hashes


def event(kind, path: bytes, start_page: int, where=L2, model_id="m") -> TierEvent:
    return TierEvent(kind, model_id, PAGE, where, path, start_page)


class Sink:
    def __init__(self) -> None:
        self.writes = []

    def __call__(self, write) -> None:
        self.writes.append(write)


def commit(state, session_id, token_bytes, held_pages: int = 0) -> None:
    """Save a path of which the engine holds the first ``held_pages`` itself (hitting them in L2
    is no reuse)."""
    reply = state.acquire(Acquire(session_id, token_bytes, local_hit_tokens=held_pages * PAGE, save=True))
    state.commit(Commit(session_id, reply.lease_id, reply.reserved_page_ids))
    state.check_integrity()


def decoded(events) -> list[dict]:
    out = []
    for _, payload in encode_batches(events, ts=1.0):
        out.extend(msgpack.unpackb(payload)[1])
    return out


def test_buffer_merges_a_paths_consecutive_pages_bounds_its_bytes_and_counts_drops(rng):
    """Stores of one path's consecutive pages become one event, as do removals up a path (leaf,
    then its parent) and down it (a subtree cleared top down); a sibling's, another tier's or
    another model's is an event of its own. ``notify`` is called once per empty-to-non-empty. An
    event beyond ``max_buffered_bytes`` is dropped and counted, and ``take`` reports the drops
    once."""
    path = tokens(rng, 6)
    sibling = path[:2 * 4 * PAGE] + tokens(rng, 1)
    notified = []
    buffer = EventBuffer(20 * 4 * PAGE, notify=lambda: notified.append(1))
    buffer.record(event(EventKind.STORED, path[:2 * 4 * PAGE], 0))
    buffer.record(event(EventKind.STORED, path[:5 * 4 * PAGE], 2))
    buffer.record(event(EventKind.STORED, path[:5 * 4 * PAGE], 2, where=TIER_WHERE[Tier.L3]))
    buffer.record(event(EventKind.REMOVED, path[:6 * 4 * PAGE], 4))
    buffer.record(event(EventKind.REMOVED, path[:4 * 4 * PAGE], 3))
    buffer.record(event(EventKind.REMOVED, sibling, 2))
    assert len(notified) == 1
    events, dropped = buffer.take()
    assert dropped == 0
    assert [(e.kind, e.where, e.start_page, e.end_page) for e in events] == [
        (EventKind.STORED, L2, 0, 5), (EventKind.STORED, TIER_WHERE[Tier.L3], 2, 5),
        (EventKind.REMOVED, L2, 3, 6), (EventKind.REMOVED, L2, 2, 3)]
    assert events[0].path == path[:5 * 4 * PAGE] and events[2].path == path
    buffer.record(event(EventKind.STORED, path[:4 * 4 * PAGE], 0))            # 4 pages of 20
    buffer.record(event(EventKind.STORED, sibling, 2, model_id="other"))      # 3 more: 7
    buffer.record(event(EventKind.STORED, tokens(rng, 14), 0))                # 14 more: dropped
    assert len(notified) == 2
    events, dropped = buffer.take()
    assert [e.model_id for e in events] == ["m", "other"] and dropped == 1 and buffer.dropped_events == 1
    assert buffer.take() == ([], 0)


def test_batches_are_vllms_kv_event_batch_with_chained_hashes(rng):
    """One msgpack array [ts, events, nil] per model; BlockStored maps carry vLLM's fields in its
    order, the hashes chained from the tokens and the parent the page before the first one stored;
    BlockRemoved its hashes and medium; AllBlocksCleared its type alone."""
    path = tokens(rng, 5)
    hashes = chained_hashes(path, 5)
    batches = encode_batches([event(EventKind.CLEARED, b"", 0, where=None),
                              event(EventKind.STORED, path, 2, where=REMOTE_WHERE),
                              event(EventKind.REMOVED, path[:3 * 4 * PAGE], 1, model_id="other")], ts=12.5)
    assert [model for model, _ in batches] == ["m", "other"]
    first, second = (msgpack.unpackb(payload) for _, payload in batches)
    assert first[0] == 12.5 and first[2] is None
    cleared, stored = first[1]
    assert cleared == {"type": "AllBlocksCleared"}
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                            "medium", "lora_name", "locality", "ownership"]
    assert stored["block_hashes"] == hashes[2:] and stored["parent_block_hash"] == hashes[1]
    assert stored["token_ids"] == np.frombuffer(path[2 * 4 * PAGE:], dtype="<i4").tolist()
    assert (stored["block_size"], stored["medium"], stored["locality"]) == (PAGE, "STORAGE", "REMOTE")
    assert second[1] == [{"type": "BlockRemoved", "block_hashes": hashes[1:3], "medium": "CPU",
                          "locality": "LOCAL", "ownership": "kvcached"}]


def test_state_records_l2_stores_and_evictions_of_rank_0(rng):
    """A commit records its new pages stored in L2 (after the model's AllBlocksCleared, its first
    namespace here), an extension only the pages it adds; pressure that evicts the prefix records
    their removal. A tensor-parallel rank other than 0 records none of its own stores: rank 0 speaks
    for the group."""
    buffer = EventBuffer(1 << 20)
    state = DaemonState(2 << 20, max_namespaces=2, session_timeout_s=1.5, kv_events=buffer)
    session, _ = state.attach(GEOMETRY, pid=1)
    prefix = tokens(rng, 4)
    commit(state, session.session_id, prefix[:2 * 4 * PAGE])
    events = decoded(buffer.take()[0])          # taken between the two, as the loop would
    commit(state, session.session_id, prefix, held_pages=2)
    events += decoded(buffer.take()[0])
    hashes = chained_hashes(prefix, 4)
    assert [e["type"] for e in events] == ["AllBlocksCleared", "BlockStored", "BlockStored"]
    assert [(e["block_hashes"], e["parent_block_hash"]) for e in events[1:]] == [
        (hashes[:2], None), (hashes[2:], hashes[1])]
    other = tokens(rng, 16)           # the whole of L2, in two halves (what a session may reserve at once)
    commit(state, session.session_id, other[:8 * 4 * PAGE])
    commit(state, session.session_id, other, held_pages=8)
    removed = [h for e in decoded(buffer.take()[0]) if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert set(hashes) <= set(removed)

    rank1, _ = state.attach(dataclasses.replace(GEOMETRY, tp_rank=1, tp_size=2), pid=2)
    commit(state, rank1.session_id, tokens(rng, 2))     # may evict rank 0's pages (recorded) for room
    assert [e for e in buffer.take()[0] if e.kind is not EventKind.REMOVED] == []


def test_a_reclaimed_namespace_records_the_removal_of_every_page(rng):
    """A namespace reclaimed for another model records the removal of each page it held (not
    AllBlocksCleared, which would clear the same model's other namespaces in a router too); the
    new model's first namespace records AllBlocksCleared."""
    buffer = EventBuffer(1 << 20)
    state = DaemonState(2 << 20, max_namespaces=1, session_timeout_s=1.5, kv_events=buffer)
    session, _ = state.attach(GEOMETRY, pid=1)
    prefixes = [tokens(rng, 3), tokens(rng, 2)]
    for prefix in prefixes:
        commit(state, session.session_id, prefix)
    state.detach(session.session_id)
    buffer.take()
    state.attach(KVGeometry("n", num_layers=4, num_kv_heads=4, head_dim=128, dtype="float32", page_size=8), pid=2)
    events, _ = buffer.take()
    assert [(e.kind, e.model_id) for e in events] == [(EventKind.REMOVED, "m")] * 2 + [(EventKind.CLEARED, "n")]
    removed = {h for e in decoded(events[:2]) for h in e["block_hashes"]}
    assert removed == set(chained_hashes(prefixes[0], 3)) | set(chained_hashes(prefixes[1], 2))


def test_a_write_through_to_the_remote_store_records_what_it_stored(rng):
    """The remote tier's write of a committed path records BlockStored ("STORAGE", "REMOTE") of
    the leading pages the store took, nothing when it took none."""
    buffer, sink = EventBuffer(1 << 20), Sink()
    state = DaemonState(2 << 20, max_namespaces=1, session_timeout_s=1.5, kv_events=buffer, remote_write_sink=sink)
    session, _ = state.attach(GEOMETRY, pid=1)
    prefix = tokens(rng, 5)
    commit(state, session.session_id, prefix)
    state.finish_remote_write(sink.writes.pop(), 3)
    commit(state, session.session_id, prefix + tokens(rng, 1), held_pages=5)
    state.finish_remote_write(sink.writes.pop(), 0)
    remote = [e for e in decoded(buffer.take()[0]) if e.get("locality") == "REMOTE"]
    assert [(e["block_hashes"], e["parent_block_hash"], e["medium"]) for e in remote] == [
        (chained_hashes(prefix, 3), None, "STORAGE")]


@pytest.mark.parametrize("max_buffered_bytes", [-1])
def test_a_negative_bound_is_refused(max_buffered_bytes):
    """A buffer bound below 0 is a programming error of the caller: ValueError."""
    with pytest.raises(ValueError):
        EventBuffer(max_buffered_bytes)


def test_keys_from_the_cache_equal_those_hashed_afresh(rng):
    """A shared KeyCache serves a removal the keys its store hashed and an extension its parent's,
    and what it serves equals what a fresh encoding hashes; one path under two page sizes is two
    entries, never one's keys for the other."""
    path = tokens(rng, 6)
    events = [event(EventKind.STORED, path[:4 * 4 * PAGE], 0), event(EventKind.STORED, path, 4),
              event(EventKind.REMOVED, path, 2), TierEvent(EventKind.STORED, "m", 2 * PAGE, L2, path, 1)]
    cache = KeyCache()
    shared = []
    for one in events:
        slices = encode_in_slices([one], 1.0, cache, pages_per_slice=1)
        try:
            while True:
                next(slices)
        except StopIteration as done:
            shared.append(done.value)
    assert cache.hits == 2
    assert shared == [encode_batches([one], 1.0) for one in events]
    assert msgpack.unpackb(shared[3][0][1])[1][0]["block_hashes"] != chained_hashes(path, 6)[1:]



def test_token_ids_packed_in_slices_are_msgpacks_own_encoding(rng):
    """A store's token ids packed a slice at a time (one array header, then the slices' elements)
    are byte for byte msgpack's packing of the whole list, at every size around the slice's."""
    for num_pages in (1, 2, 3, 5, 17, 40):
        path = tokens(rng, num_pages)
        for pages_per_slice in (1, 2, 16):
            slices = encode_in_slices([event(EventKind.STORED, path, 0)], 1.0, KeyCache(), pages_per_slice)
            try:
                while True:
                    next(slices)
            except StopIteration as done:
                (_, payload), = done.value
            stored = msgpack.unpackb(payload)[1][0]
            assert stored["token_ids"] == np.frombuffer(path, dtype="<i4").tolist()
            assert payload == msgpack.packb([1.0, [stored], None])
