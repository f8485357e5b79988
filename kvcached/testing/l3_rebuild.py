"""A large, branchy L3 index (one long history, many continuations branching off it) written
without a daemon, and a real daemon restarting on it: its peak RSS and the seconds until it answers."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np

from kvcached.core.l3_index import NamespaceLayout, PutNamespace, PutSlots, SlotRow, namespace_key
from kvcached.server.l3_index_store import L3IndexStore, index_path
from kvcached.server.status import StatusClient
from kvcached.testing.daemon_proc import DaemonProcess
from kvcached.testing.engine_proc import GEOMETRY
from proto.page_keys import ROOT_KEY, page_key

CONTINUATION_PAGES = 50


TEST_ROWS = 160_000


MAX_REBUILD_RSS_BYTES = 500_000_000


def write_branchy_index(l3_path: str, num_rows: int, seed: int, geometry=GEOMETRY) -> int:
    """An L3 file (sparse) and its index holding num_rows pages of one namespace: a history of a
    quarter of the rows, and continuations of CONTINUATION_PAGES pages each branching off it at
    random pages. Written with the index store's own API; returns the file's size."""
    rng = np.random.default_rng(seed)
    page_size = geometry.page_size
    num_history = num_rows // 4
    num_continuations = (num_rows - num_history) // CONTINUATION_PAGES
    num_history = num_rows - num_continuations * CONTINUATION_PAGES
    ns_key = namespace_key(geometry)
    store, _ = L3IndexStore.open(index_path(l3_path), fresh=True)
    store.start()
    try:
        store.submit(PutNamespace(NamespaceLayout(ns_key, geometry, geometry.bytes_per_page)))
        slot = 0

        def put_chain(parent: bytes, num_pages: int) -> list[bytes]:
            nonlocal slot
            tokens = rng.integers(0, 150_000, size=num_pages * page_size, dtype=np.int32).tobytes()
            checksums = rng.integers(0, 1 << 32, size=num_pages, dtype=np.uint64).tolist()
            keys, rows = [], []
            for page in range(num_pages):
                token_bytes = tokens[page * page_size * 4:(page + 1) * page_size * 4]
                key = page_key(parent, token_bytes)
                rows.append(SlotRow(slot, key, parent, token_bytes, int(checksums[page])))
                keys.append(key)
                parent, slot = key, slot + 1
            store.submit(PutSlots(ns_key, rows))
            return keys

        history_keys = []
        parent = ROOT_KEY
        while len(history_keys) < num_history:          # in batches: the writer commits as it goes
            history_keys += put_chain(parent, min(10_000, num_history - len(history_keys)))
            parent = history_keys[-1]
        for branch_page in rng.integers(1, num_history, size=num_continuations).tolist():
            put_chain(history_keys[branch_page - 1], CONTINUATION_PAGES)
        assert slot == num_rows
    finally:
        store.close(timeout_s=120.0)
    size_bytes = num_rows * geometry.bytes_per_page
    with open(l3_path, "wb") as f:
        f.truncate(size_bytes)                          # sparse: the rows' bytes are never read here
    os.chmod(l3_path, 0o600)
    return size_bytes


def peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def restart_on_branchy_index(num_rows: int, seed: int) -> dict:
    """A real daemon started on a branchy index of num_rows rows: its peak RSS, the seconds until
    it answered, and the L3 pages it holds."""
    socket_dir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    l3_path = os.path.join(socket_dir, "l3.bin")
    try:
        size_bytes = write_branchy_index(l3_path, num_rows, seed)
        daemon = DaemonProcess(l2_size="4MiB", socket_dir=socket_dir,
                               extra_args=("--max-namespaces", "1", "--l3-path", l3_path, "--l3-size", str(size_bytes)))
        started = time.monotonic()
        daemon.start(timeout_s=120.0)
        try:
            seconds = time.monotonic() - started
            with StatusClient(daemon.socket_path, timeout_s=30.0) as client:
                status = client.status(check_integrity=True)
            return {"peak_rss_bytes": peak_rss_bytes(daemon.proc.pid), "seconds": seconds,
                    "l3_pages": status["namespaces"][0]["tiers"]["l3"]["owned_pages"], "integrity": status["integrity"]}
        finally:
            daemon.stop()
            daemon.cleanup()
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
