"""The persistent L3 index: a sqlite3 file (WAL mode) beside the L3 file, written by one thread.

The daemon's state reports each change of L3 residency to ``submit`` (called under the state
lock: it only queues); the writer thread applies the queue in order, one transaction per batch.
Rows are what ``kvcached.core.l3_index`` describes. Ordering against the L3 file, so that at any
instant the process dies the index names no slot whose bytes are not that page's:
- a slot's row is submitted only once its bytes are written (the state records it when the
  write-through is published), and holds the crc32 of the bytes written;
- a slot is written only once every delete submitted before the write is committed
  (``wait_for_deletes``, which a write-through's I/O job calls before its first pwrite): an
  evicted slot's old row is gone from the file before another page's bytes go into the slot.
Neither file is fsynced: what a crash of the whole machine loses or tears is caught by the
checksum when the page is read, and never served. An index that cannot be written any more is
removed, so the next start begins empty rather than trusting rows that missed their deletes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
from typing import Any

from kvcached.core.l3_index import (DeleteSlots, DropNamespace, IndexChange, NamespaceLayout, PutNamespace, PutSlots,
                                    SavedNamespace, SlotRow, namespace_key)
from kvcached.server.storage_file import UnsafeFileError, open_private_file, same_file
from proto.errors import ProtocolError
from proto.messages import KVGeometry

logger = logging.getLogger(__name__)

# 2: slot ids are absolute (slot s of a geometry at byte s * bytes_per_page of the file), the file
# shared in chunks. 1 (older): one region of the file per namespace, slots counted from its start;
# such an index is not read (its slots would name other bytes now): its pages are dropped.
SCHEMA_VERSION = 2
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS namespaces (
    ns_key TEXT PRIMARY KEY, geometry TEXT NOT NULL, bytes_per_page INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS slots (
    ns_key TEXT NOT NULL, slot INTEGER NOT NULL, page_key BLOB NOT NULL, parent_key BLOB NOT NULL,
    tokens BLOB NOT NULL, checksum INTEGER NOT NULL, PRIMARY KEY (ns_key, slot));
PRAGMA user_version = {SCHEMA_VERSION};
"""


def index_path(l3_path: str) -> str:
    return l3_path + ".index"


def index_files(path: str) -> tuple[str, str, str]:
    """The index and sqlite's sidecar files (WAL mode) beside it."""
    return path, path + "-wal", path + "-shm"


def remove_index_files(path: str) -> None:
    for name in index_files(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


class IndexNotWritable(Exception):
    """The index could be opened but not written (the disk is full, an I/O error): it is kept as
    it is, for a start that can write it."""


class L3IndexStore:
    """Build with ``open`` (which reads what it holds), then ``start`` the writer; ``close`` once."""

    def __init__(self, path: str, connection: sqlite3.Connection):
        self.path = path
        self._connection: sqlite3.Connection | None = connection
        self._cond = threading.Condition()
        self._queue: list[IndexChange] = []
        self._num_submitted = 0         # sequence number of the last change submitted
        self._num_committed = 0         # ... and of the last one committed
        self._last_delete_seq = 0       # ... of the last delete or namespace drop submitted
        self._failed = False
        self._closing = False
        self._thread: threading.Thread | None = None

    @classmethod
    def open(cls, path: str, fresh: bool) -> tuple[L3IndexStore, list[SavedNamespace]]:
        """Open (or create) the index and read what it holds; ``fresh`` empties it first. The
        index and its sidecar files are opened as ``open_private_file`` says (UnsafeFileError).
        An index that is not a database (torn, overwritten) is removed and made anew, empty: it only
        ever costs what it held. One that cannot be written now (a full disk) is kept as it is:
        IndexNotWritable."""
        try:
            store = cls(path, _connect(path, fresh))
            try:
                return store, store._load()
            except BaseException:
                store._close_connection()
                raise
        except sqlite3.OperationalError as exc:        # SQLITE_FULL, SQLITE_IOERR, locked, cannot open
            raise IndexNotWritable(f"the L3 index {path} cannot be written now ({exc}); it is kept as it "
                                   "is") from None
        except sqlite3.DatabaseError as exc:
            logger.warning("L3 index %s is not readable (%s): starting with an empty one", path, exc)
            remove_index_files(path)
            store = cls(path, _connect(path, fresh=True))
            return store, store._load()

    # ---- start-up ------------------------------------------------------------------------

    def _load(self) -> list[SavedNamespace]:
        """Every namespace of the index with its rows. Rows of unreadable namespaces, of none, or
        of the wrong types are deleted here; the rest is checked by ``plan_rebuild``."""
        assert self._connection is not None and self._thread is None, "load runs before start"
        connection = self._connection
        saved = []
        for ns_key, geometry_json, *numbers in connection.execute(
                "SELECT ns_key, geometry, bytes_per_page FROM namespaces"):
            try:
                geometry = KVGeometry.from_wire(json.loads(geometry_json))
                if namespace_key(geometry) != ns_key or not all(type(n) is int and n >= 0 for n in numbers):
                    raise ValueError("the row does not match its key")
            except (ValueError, TypeError, ProtocolError) as exc:
                logger.warning("L3 index: namespace %s dropped, its row is torn: %s", ns_key, exc)
                with _transaction(connection):
                    connection.execute("DELETE FROM namespaces WHERE ns_key = ?", (ns_key,))
                continue
            rows = []
            for row in connection.execute("SELECT slot, page_key, parent_key, tokens, checksum FROM slots "
                                          "WHERE ns_key = ?", (ns_key,)):
                if (type(row[0]) is int and all(type(v) is bytes for v in row[1:4])
                        and type(row[4]) is int):
                    rows.append(SlotRow(*row))
            saved.append(SavedNamespace(NamespaceLayout(ns_key, geometry, *numbers), rows))
        with _transaction(connection):
            connection.execute("DELETE FROM slots WHERE ns_key NOT IN (SELECT ns_key FROM namespaces)")
        return saved

    def start(self) -> None:
        self._thread = threading.Thread(target=self._write_loop, name="kvcached-l3-index", daemon=True)
        self._thread.start()

    # ---- from the state (under its lock) and from I/O jobs -------------------------------

    def submit(self, change: IndexChange) -> None:
        """Queue one change; no I/O. Dropped once the index has failed."""
        with self._cond:
            if self._failed or self._closing:
                return
            self._queue.append(change)
            self._num_submitted += 1
            if isinstance(change, (DeleteSlots, DropNamespace)):
                self._last_delete_seq = self._num_submitted
            self._cond.notify_all()

    def wait_for_deletes(self, timeout_s: float) -> None:
        """Block until every delete submitted so far is committed (or the index has failed and is
        gone); TimeoutError after timeout_s."""
        with self._cond:
            target = self._last_delete_seq
            if not self._cond.wait_for(lambda: self._failed or self._num_committed >= target, timeout=timeout_s):
                raise TimeoutError(f"the L3 index did not commit its deletes within timeout_s={timeout_s} "
                                   f"({self._num_submitted - self._num_committed} changes queued)")

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {"path": self.path, "pending_changes": self._num_submitted - self._num_committed,
                    "committed_changes": self._num_committed, "failed": self._failed}

    # ---- the writer thread ---------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
                last_seq = self._num_submitted
            try:
                self._apply(batch)
            except sqlite3.Error as exc:
                self._fail(exc)
                return
            with self._cond:
                self._num_committed = last_seq
                self._cond.notify_all()

    def _apply(self, batch: list[IndexChange]) -> None:
        connection = self._connection
        assert connection is not None
        with _transaction(connection):
            for change in batch:
                if isinstance(change, PutSlots):
                    connection.executemany(
                        "INSERT OR REPLACE INTO slots (ns_key, slot, page_key, parent_key, tokens, checksum) "
                        "VALUES (?, ?, ?, ?, ?, ?)", [(change.namespace_key, *row) for row in change.rows])
                elif isinstance(change, DeleteSlots):
                    connection.executemany("DELETE FROM slots WHERE ns_key = ? AND slot = ?",
                                           [(change.namespace_key, slot) for slot in change.slot_ids])
                elif isinstance(change, PutNamespace):
                    layout = change.layout
                    connection.execute(
                        "INSERT OR REPLACE INTO namespaces VALUES (?, ?, ?)",
                        (layout.namespace_key, json.dumps(layout.geometry.to_wire(), sort_keys=True),
                         layout.bytes_per_page))
                elif isinstance(change, DropNamespace):
                    connection.execute("DELETE FROM slots WHERE ns_key = ?", (change.namespace_key,))
                    connection.execute("DELETE FROM namespaces WHERE ns_key = ?", (change.namespace_key,))
                else:
                    raise AssertionError(f"unknown index change {change!r}")

    def _fail(self, exc: Exception) -> None:
        logger.error("L3 index %s could not be written (%s): removed; L3 starts empty after the next restart",
                     self.path, exc)
        self._close_connection()
        try:
            remove_index_files(self.path)
        except OSError as remove_error:      # the checksums still keep wrong bytes from being served
            logger.error("L3 index %s could not be removed: %s", self.path, remove_error)
        with self._cond:
            self._failed = True
            self._queue = []
            self._cond.notify_all()

    def _close_connection(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(sqlite3.Error):
                self._connection.close()
            self._connection = None

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then close. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("L3 index %s: writer still busy after %s s; its last changes are lost",
                               self.path, timeout_s)
                return
        self._close_connection()


@contextlib.contextmanager
def _transaction(connection: sqlite3.Connection):
    """One transaction (the connection is in autocommit mode): committed on success, else rolled back."""
    connection.execute("BEGIN")
    try:
        yield
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


def _connect(path: str, fresh: bool) -> sqlite3.Connection:
    # sqlite opens its files by name and follows symlinks: the index and its -wal and -shm files
    # are opened (created 0600) and checked here first, then sqlite opens these very files, which
    # is checked once it has (a file swapped in between, by whoever may write the directory, is
    # refused, never used).
    fds = [open_private_file(name) for name in index_files(path)]
    try:
        connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if not all(same_file(fd, name) for fd, name in zip(fds, index_files(path))):
                raise UnsafeFileError(f"the L3 index {path} or its -wal or -shm file was replaced while the "
                                      "daemon opened it")
        except BaseException:
            connection.close()
            raise
    finally:
        for fd in fds:
            os.close(fd)
    try:
        if mode != "wal":
            raise sqlite3.DatabaseError(f"journal mode is {mode}, not wal")
        # WAL with synchronous NORMAL: a commit survives the process dying at any instant.
        connection.execute("PRAGMA synchronous = NORMAL")
        version = connection.execute("PRAGMA user_version").fetchone()[0]
        if version == 1:
            logger.warning("L3 index %s was written by an older kvcached (schema 1: one region of the L3 file per "
                           "namespace); this daemon shares the file in chunks and cannot tell which bytes those "
                           "rows name now, so L3 starts empty (the file's old pages are not served)", path)
        elif version not in (0, SCHEMA_VERSION):
            logger.warning("L3 index %s has schema %d, this daemon writes %d: starting empty", path, version,
                           SCHEMA_VERSION)
        if fresh or version != SCHEMA_VERSION:
            connection.executescript("DROP TABLE IF EXISTS slots; DROP TABLE IF EXISTS namespaces;")
            connection.executescript(_SCHEMA)
    except BaseException:
        connection.close()
        raise
    return connection
