"""The sqlite3 L3 index: what is submitted comes back after a reopen, deletes are committed before
wait_for_deletes returns, a fresh or unreadable index starts empty, a failed writer removes it."""

from __future__ import annotations

import os
import secrets
import sqlite3
import stat
import threading
import zlib

import numpy as np
import pytest

from kvcached.core.l3_index import (DeleteSlots, DropNamespace, NamespaceLayout, PutNamespace, PutSlots, SlotRow,
                                    namespace_key)
from kvcached.server.l3_index_store import L3IndexStore
from proto.page_keys import ROOT_KEY, chain_page_keys
from proto.messages import KVGeometry

GEOMETRY = KVGeometry("m", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", page_size=16)
OTHER = KVGeometry("other", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", page_size=16)


@pytest.fixture
def rng() -> np.random.Generator:
    seed = secrets.randbits(32)
    print(f"seed={seed}")            # shown by pytest when the test fails
    return np.random.default_rng(seed)


def layout(geometry: KVGeometry) -> NamespaceLayout:
    return NamespaceLayout(namespace_key(geometry), geometry, geometry.bytes_per_page)


def rows_of(rng, num_pages: int, first_slot: int) -> list[SlotRow]:
    tokens = rng.integers(0, 150_000, size=num_pages * 16, dtype=np.int32)
    keys = chain_page_keys(tokens, 16, num_pages)
    return [SlotRow(first_slot + page, keys[page], keys[page - 1] if page else ROOT_KEY,
                    tokens[page * 16:(page + 1) * 16].tobytes(), zlib.crc32(rng.bytes(64)))
            for page in range(num_pages)]


def reopen(path: str) -> dict:
    store, saved = L3IndexStore.open(path, fresh=False)
    store.close()
    return {entry.layout: sorted(entry.rows) for entry in saved}


def test_submitted_changes_come_back_after_a_reopen(tmp_path, rng):
    """Namespaces and rows put, rows deleted and a namespace dropped, in that order: a reopened
    index holds exactly what the changes leave, and the file is private (0600)."""
    path = str(tmp_path / "l3.bin.index")
    store, saved = L3IndexStore.open(path, fresh=False)
    assert saved == []
    store.start()
    a, b = rows_of(rng, 5, 0), rows_of(rng, 3, 10)
    for change in (PutNamespace(layout(GEOMETRY)), PutNamespace(layout(OTHER)),
                   PutSlots(namespace_key(GEOMETRY), a), PutSlots(namespace_key(OTHER), b),
                   DeleteSlots(namespace_key(GEOMETRY), [a[3].slot, a[4].slot]),
                   DropNamespace(namespace_key(OTHER))):
        store.submit(change)
    store.close()
    assert reopen(path) == {layout(GEOMETRY): sorted(a[:3])}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_wait_for_deletes_returns_once_they_are_committed(tmp_path, rng):
    """When wait_for_deletes returns, another connection to the file no longer sees the deleted
    rows: a slot may be overwritten from then on."""
    path = str(tmp_path / "l3.bin.index")
    store, _ = L3IndexStore.open(path, fresh=False)
    store.start()
    rows = rows_of(rng, 4, 0)
    store.submit(PutNamespace(layout(GEOMETRY)))
    store.submit(PutSlots(namespace_key(GEOMETRY), rows))
    store.submit(DeleteSlots(namespace_key(GEOMETRY), [rows[1].slot]))
    store.wait_for_deletes(timeout_s=10.0)
    reader = sqlite3.connect(path)
    try:
        slots = sorted(slot for (slot,) in reader.execute("SELECT slot FROM slots"))
    finally:
        reader.close()
    assert slots == [0, 2, 3]
    assert store.status()["pending_changes"] == 0
    store.close()


def test_fresh_empties_the_index(tmp_path, rng):
    """An index opened fresh (--l3-fresh, or a new L3 file) holds nothing of before."""
    path = str(tmp_path / "l3.bin.index")
    store, _ = L3IndexStore.open(path, fresh=False)
    store.start()
    store.submit(PutNamespace(layout(GEOMETRY)))
    store.submit(PutSlots(namespace_key(GEOMETRY), rows_of(rng, 3, 0)))
    store.close()
    assert len(reopen(path)) == 1
    store, saved = L3IndexStore.open(path, fresh=True)
    store.close()
    assert saved == [] and reopen(path) == {}


def test_an_unreadable_index_starts_empty_and_works(tmp_path, rng):
    """A file that is not a database (a torn or foreign file) is replaced by an empty index that
    takes and keeps new rows."""
    path = str(tmp_path / "l3.bin.index")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(rng.bytes(8192))
    store, saved = L3IndexStore.open(path, fresh=False)
    assert saved == []
    store.start()
    rows = rows_of(rng, 2, 5)
    store.submit(PutNamespace(layout(GEOMETRY)))
    store.submit(PutSlots(namespace_key(GEOMETRY), rows))
    store.close()
    assert reopen(path) == {layout(GEOMETRY): sorted(rows)}


def test_a_torn_namespace_row_is_dropped_with_its_rows(tmp_path, rng):
    """A namespace whose stored geometry no longer parses (or no longer matches its key) comes back
    as nothing, and its rows are deleted; the other namespace is untouched."""
    path = str(tmp_path / "l3.bin.index")
    store, _ = L3IndexStore.open(path, fresh=False)
    store.start()
    for geometry in (GEOMETRY, OTHER):
        store.submit(PutNamespace(layout(geometry)))
        store.submit(PutSlots(namespace_key(geometry), rows_of(rng, 2, 0)))
    store.close()
    writer = sqlite3.connect(path)
    with writer:
        writer.execute("UPDATE namespaces SET geometry = ? WHERE ns_key = ?",
                       ('{"model_id": "other", "num_layers": 3}', namespace_key(OTHER)))
    writer.close()
    assert list(reopen(path)) == [layout(GEOMETRY)]
    reader = sqlite3.connect(path)
    assert reader.execute("SELECT COUNT(*) FROM slots WHERE ns_key = ?", (namespace_key(OTHER),)).fetchone() == (0,)
    reader.close()


def test_a_writer_that_fails_removes_the_index(tmp_path, rng):
    """A change the database refuses stops the writer: the index files are removed (the next start
    is empty, not stale), waits return, and later changes are dropped."""
    path = str(tmp_path / "l3.bin.index")
    store, _ = L3IndexStore.open(path, fresh=False)
    store.start()
    store.submit(PutNamespace(layout(GEOMETRY)))
    store.submit(PutSlots(namespace_key(GEOMETRY), [rows_of(rng, 1, 0)[0]._replace(checksum={"not": "a number"})]))
    store.submit(DeleteSlots(namespace_key(GEOMETRY), [0]))
    store.wait_for_deletes(timeout_s=10.0)
    assert store.status()["failed"]
    assert not any(os.path.exists(path + suffix) for suffix in ("", "-wal", "-shm"))
    store.submit(PutSlots(namespace_key(GEOMETRY), rows_of(rng, 1, 1)))
    store.close()
    assert not os.path.exists(path)


def test_a_write_through_overwrites_a_slot_only_after_its_old_row_is_deleted(tmp_path, rng, monkeypatch):
    """The index writer is held back; slot 1's row is deleted (its page was evicted) and a
    write-through into slot 1 starts: its pwrite comes only once the delete is committed, so the
    index never names slot 1 while it holds another page's bytes. The result carries the crc32 of
    each page written and the path's chained keys."""
    from kvcached.core.storage import SlotLayout
    from kvcached.core.tier_ops import TierMove
    from kvcached.core.tiers import Tier
    from kvcached.server import io_workers
    from kvcached.server.storage_file import StorageFile
    from kvcached.server.moves import _write_indexed

    path = str(tmp_path / "l3.bin.index")
    store, _ = L3IndexStore.open(path, fresh=False)
    rows = rows_of(rng, 3, 0)
    release_writer = threading.Event()
    real_apply = store._apply
    monkeypatch.setattr(store, "_apply", lambda batch: (release_writer.wait(10.0), real_apply(batch)))
    store.start()
    release_writer.set()
    store.submit(PutNamespace(layout(GEOMETRY)))
    store.submit(PutSlots(namespace_key(GEOMETRY), rows))
    store.submit(DeleteSlots(namespace_key(GEOMETRY), [9]))      # a slot with no row: a marker
    store.wait_for_deletes(timeout_s=10.0)                        # so the puts before it are committed too
    release_writer.clear()
    store.submit(DeleteSlots(namespace_key(GEOMETRY), [1]))
    threading.Timer(0.2, release_writer.set).start()

    rows_seen_at_pwrite = []
    real_pwrite = io_workers._pwrite

    def checking_pwrite(fd, data, offset):
        reader = sqlite3.connect(path)
        rows_seen_at_pwrite.append(reader.execute("SELECT COUNT(*) FROM slots WHERE slot = 1").fetchone()[0])
        reader.close()
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(io_workers, "_pwrite", checking_pwrite)
    bytes_per_page = 4096
    arena = bytearray(rng.bytes(4 * bytes_per_page))
    tokens = rng.integers(0, 150_000, size=2 * 16, dtype=np.int32)
    move = TierMove(op_id=1, namespace_id=0, source=Tier.L2, destination=Tier.L3, token_ids=tokens, start_page=0,
                    source_page_ids=[2, 3], private_page_ids=[1, 2], locks=[])
    with StorageFile.open(str(tmp_path / "l3.bin"), 16 * bytes_per_page, keep_content=True) as storage:
        result, keys = _write_indexed(store, storage, SlotLayout(bytes_per_page, 16), memoryview(arena), 16, move)
    store.close()
    assert rows_seen_at_pwrite and set(rows_seen_at_pwrite) == {0}
    assert list(result.page_checksums) == [zlib.crc32(arena[p * bytes_per_page:(p + 1) * bytes_per_page])
                                           for p in (2, 3)]
    assert keys == chain_page_keys(tokens, 16, 2)


# The index as an older kvcached wrote it (schema 1): one region of the L3 file per namespace, at
# region_offset, its slots counted from there.
_SCHEMA_1 = """
CREATE TABLE namespaces (
    ns_key TEXT PRIMARY KEY, geometry TEXT NOT NULL, arena_index INTEGER NOT NULL,
    region_offset INTEGER NOT NULL, num_slots INTEGER NOT NULL, bytes_per_page INTEGER NOT NULL);
CREATE TABLE slots (
    ns_key TEXT NOT NULL, slot INTEGER NOT NULL, page_key BLOB NOT NULL, parent_key BLOB NOT NULL,
    tokens BLOB NOT NULL, checksum INTEGER NOT NULL, PRIMARY KEY (ns_key, slot));
PRAGMA user_version = 1;
"""


def write_schema_1_index(path: str, geometry: KVGeometry, arena_index: int, region_offset: int,
                         rows: list[SlotRow]) -> None:
    import json

    writer = sqlite3.connect(path)
    try:
        writer.executescript(_SCHEMA_1)
        with writer:
            writer.execute("INSERT INTO namespaces VALUES (?, ?, ?, ?, 64, ?)",
                           (namespace_key(geometry), json.dumps(geometry.to_wire(), sort_keys=True), arena_index,
                            region_offset, geometry.bytes_per_page))
            writer.executemany("INSERT INTO slots VALUES (?, ?, ?, ?, ?, ?)",
                               [(namespace_key(geometry), *row) for row in rows])
    finally:
        writer.close()
    os.chmod(path, 0o600)          # as every kvcached made it


def test_an_index_of_the_older_layout_is_refused_with_a_warning(tmp_path, rng, caplog):
    """An index written with schema 1 (regions of the file, slots counted from each region's
    start) is not read as if its slots were absolute: it comes back empty, with a warning that
    says why, and is then a working index of the current schema."""
    path = str(tmp_path / "l3.bin.index")
    write_schema_1_index(path, GEOMETRY, 1, 1 << 20, rows_of(rng, 4, 0))
    with caplog.at_level("WARNING", logger="kvcached.server.l3_index_store"):
        store, saved = L3IndexStore.open(path, fresh=False)
    assert saved == []
    assert any("older kvcached (schema 1" in record.getMessage() for record in caplog.records)
    store.start()
    rows = rows_of(rng, 2, 5)
    store.submit(PutNamespace(layout(GEOMETRY)))
    store.submit(PutSlots(namespace_key(GEOMETRY), rows))
    store.close()
    assert reopen(path) == {layout(GEOMETRY): sorted(rows)}
