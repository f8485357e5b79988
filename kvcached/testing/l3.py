"""L3 across daemon restarts: a daemon on one socket directory and L3 file stopped and started
again, prefixes backed up into L2 and written through to L3, a byte flipped in the L3 file."""

from __future__ import annotations

import os
import sqlite3
import tempfile
import time

import numpy as np

from kvcached.core.l3_index import namespace_key
from kvcached.server.status import StatusClient
from kvcached.testing.daemon_proc import DaemonProcess, commit_written
from kvcached.testing.engine_proc import GEOMETRY
from proto.page_keys import chain_page_keys

PAGE = GEOMETRY.page_size


class RestartingDaemon:
    """One socket directory and L3 file, served by a daemon that is stopped and started again."""

    def __init__(self, *extra_args: str):
        self.socket_dir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
        self.l3_path = os.path.join(self.socket_dir, "l3.bin")
        self.index_path = self.l3_path + ".index"
        self.args = ("--max-namespaces", "1", "--l3-path", self.l3_path, "--l3-size", "16MiB", *extra_args)
        self.daemon: DaemonProcess | None = None

    def start(self, *more_args: str) -> DaemonProcess:
        self.daemon = DaemonProcess(l2_size="2MiB", socket_dir=self.socket_dir, extra_args=self.args + more_args)
        return self.daemon.start()

    def stop(self, sig: int) -> int:
        assert self.daemon is not None
        return self.daemon.stop(sig)

    def status(self) -> dict:
        with StatusClient(self.daemon.socket_path, timeout_s=5.0) as client:
            return client.status(check_integrity=True)

    def wait_until_indexed(self, timeout_s: float = 20.0) -> dict:
        """Every write-through done and every index change committed."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if status["pending"]["h2s"] == 0 and status["daemon"]["l3_index"]["pending_changes"] == 0:
                return status
            assert time.monotonic() < deadline, f"still writing: {status['pending']}, {status['daemon']['l3_index']}"
            time.sleep(0.02)

    def cleanup(self) -> None:
        if self.daemon is not None:
            self.daemon.cleanup()      # removes the socket directory, L3 file and index with it


def flip_byte(l3_path: str, index_path: str, tokens: np.ndarray, page: int, byte_in_page: int) -> None:
    """Flip one byte of the slot that the index says holds this page of this prefix."""
    key = chain_page_keys(tokens, PAGE, page + 1)[page]
    reader = sqlite3.connect(index_path)
    try:
        (slot,), = reader.execute("SELECT slot FROM slots WHERE ns_key = ? AND page_key = ?",
                                  (namespace_key(GEOMETRY), key))
    finally:
        reader.close()
    fd = os.open(l3_path, os.O_RDWR)
    try:
        offset = slot * GEOMETRY.bytes_per_page + byte_in_page      # slot ids are absolute in the file
        (value,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([value ^ 0x01]), offset)
    finally:
        os.close(fd)


def wait_for_write_through(client, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.status(check_integrity=True)
        if status["pending"]["h2s"] == 0:
            return status
        assert time.monotonic() < deadline, f"write-through still pending: {status['pending']}"
        time.sleep(0.02)


def back_up_random(client, num_pages: int, rng) -> np.ndarray:
    """Back up a new random prefix of num_pages pages (evicting older ones if L2 is full), in
    extensions of at most half of L2: what one session may reserve at once."""
    tokens = rng.integers(0, 150_000, size=num_pages * PAGE, dtype=np.int32)
    step = client.info.num_pages // 2
    start = 0
    for end in list(range(step, num_pages, step)) + [num_pages]:
        # It holds what it backed up already itself: hitting that is no reuse of L2's copy.
        reply = client.acquire(tokens[:end * PAGE], save=True, local_hit_tokens=start * PAGE)
        start = end
        assert reply.reserved_start_token + len(reply.reserved_page_ids) * PAGE == end * PAGE
        commit_written(client, reply)
        assert client.flush() == []
    return tokens


def l2_l3(client, tokens) -> tuple[int, int]:
    reply = client.acquire(tokens, promote="none")
    if reply.lease_id is not None:
        client.release(reply.lease_id)
    return reply.hit_tokens["l2"], reply.hit_tokens["l3"]
