"""RemoteStore against a stand-in for the store's client (no store, no sockets): deadlines, the
breaker and its probe, in-place gets checked page by page."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import pytest

from kvcached.core.remote import HEADER_BYTES, pack_header, remote_key
from kvcached.server.remote_store import MAP_SLICE_BYTES, RemoteSettings, RemoteStore, RemoteUnavailable
from proto.page_keys import chain_page_keys

NAMESPACE = "0123456789abcdef0123456789abcdef"
PAGE_BYTES = 4096
PAGE_TOKENS = 4


class FakeStore:
    """Holds values in a dict; ``hang`` makes calls block until released; ``healthy`` is what a
    probe sees."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.hang = threading.Event()
        self.release = threading.Event()
        self.healthy = 0
        self.transfer_fails = False

    def _maybe_hang(self):
        if self.hang.is_set():
            self.release.wait(10.0)

    def setup(self, *args):
        return 0

    def register_buffer(self, address, size):
        return 0

    def health_check(self):
        return self.healthy

    def batch_is_exist(self, keys):
        self._maybe_hang()
        return [1 if key in self.values else 0 for key in keys]

    def batch_get_into_multi_buffers(self, keys, pointers, sizes):
        self._maybe_hang()
        if self.transfer_fails:
            return [-800] * len(keys)
        out = []
        for key, (header_at, page_at), (header_size, page_size) in zip(keys, pointers, sizes):
            value = self.values.get(key)
            if value is None:
                out.append(-704)
                continue
            (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * header_size).from_address(header_at))[:]) = \
                np.frombuffer(value[:header_size], dtype=np.uint8)
            (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * page_size).from_address(page_at))[:]) = \
                np.frombuffer(value[header_size:], dtype=np.uint8)
            out.append(len(value))
        return out


@pytest.fixture
def rng():
    return np.random.default_rng(4343)


def make(segment, fake, exist_timeout_s=0.05):
    settings = RemoteSettings("m:1", "http://m:8080/metadata", "127.0.0.1", 0, exist_timeout_s, 0.05, 2**30)
    store = RemoteStore(settings, segment, store_factory=lambda: fake)
    store.probe_if_due()                    # connects on the probe thread
    deadline = time.monotonic() + 5.0
    while not store.available():
        assert time.monotonic() < deadline, "not connected"
        time.sleep(0.01)
    return store


def store_pages(fake, tokens, pages: list[bytes]):
    keys = chain_page_keys(tokens, PAGE_TOKENS, len(pages))
    for key, payload in zip(keys, pages):
        fake.values[remote_key(NAMESPACE, key)] = pack_header(NAMESPACE, key, payload) + payload


def test_a_late_answer_is_a_miss_within_the_deadline_then_the_breaker_skips_the_store(rng):
    """A call that blocks past its deadline returns RemoteUnavailable at the deadline (the worker
    goes on), opens the breaker so the next request is not asked at all, and a probe that finds
    the store healthy closes it again."""
    segment = bytearray(16 * PAGE_BYTES)
    fake = FakeStore()
    store = make(segment, fake)
    tokens = rng.integers(0, 1 << 30, 8 * PAGE_TOKENS, dtype=np.int32)
    fake.hang.set()

    async def ask():
        return await store.run("exist", store.held_pages, NAMESPACE, tokens, PAGE_TOKENS, 0, 8, timeout_s=0.05)

    started = time.monotonic()
    with pytest.raises(RemoteUnavailable):
        asyncio.run(ask())
    assert time.monotonic() - started < 1.0
    assert not store.available() and store.counters["remote_deadline_misses_exist"] == 1
    with pytest.raises(RemoteUnavailable):
        asyncio.run(ask())                  # skipped: not asked
    assert store.counters["remote_skips_exist"] == 1
    fake.hang.clear()
    fake.release.set()
    store.breaker.open_until_s = 0.0        # the backoff is over
    store.probe_if_due()
    deadline = time.monotonic() + 5.0
    while not store.available():
        assert time.monotonic() < deadline, "the probe did not close the breaker"
        time.sleep(0.01)
    store.close()


def test_gets_land_in_place_and_only_leading_checked_pages_count(rng):
    """Pages are got into their L2 pages in place; the count is of the leading pages whose header
    and checksum hold: a page stored under another page's key stops it there, as does a flipped
    bit or a missing one (a miss); a failed transfer of every page is the store's failure."""
    segment = bytearray(16 * PAGE_BYTES)
    fake = FakeStore()
    store = make(segment, fake)
    tokens = rng.integers(0, 1 << 30, 6 * PAGE_TOKENS, dtype=np.int32)
    pages = [rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8).tobytes() for _ in range(6)]
    store_pages(fake, tokens, pages)
    page_ids = [9, 3, 12, 0, 5, 7]
    verified, why = store.get_pages(fake, NAMESPACE, tokens, PAGE_TOKENS, 0, page_ids, PAGE_BYTES)
    assert (verified, why) == (6, "")
    for page_id, payload in zip(page_ids, pages):
        assert bytes(segment[page_id * PAGE_BYTES:(page_id + 1) * PAGE_BYTES]) == payload
    keys = [remote_key(NAMESPACE, k) for k in chain_page_keys(tokens, PAGE_TOKENS, 6)]
    fake.values[keys[3]] = fake.values[keys[4]]          # page 4's value under page 3's key
    assert store.get_pages(fake, NAMESPACE, tokens, PAGE_TOKENS, 0, page_ids, PAGE_BYTES) == (3, "another page")
    flipped = bytearray(fake.values[keys[1]])
    flipped[HEADER_BYTES + 17] ^= 0x40
    fake.values[keys[1]] = bytes(flipped)
    assert store.get_pages(fake, NAMESPACE, tokens, PAGE_TOKENS, 0, page_ids, PAGE_BYTES) == (1, "checksum")
    del fake.values[keys[0]]                             # gone meanwhile (evicted): a miss
    assert store.get_pages(fake, NAMESPACE, tokens, PAGE_TOKENS, 0, page_ids, PAGE_BYTES) == (0, "")
    fake.transfer_fails = True                           # the host holding it died: a failure
    with pytest.raises(RemoteUnavailable):
        store.get_pages(fake, NAMESPACE, tokens, PAGE_TOKENS, 0, page_ids, PAGE_BYTES)
    store.close()


def mapped_bytes(path: str) -> int:
    """How many bytes of this process's mapping of the file at path are mapped in (its Rss)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.endswith(" " + path)]
    assert len(starts) == 1, f"{len(starts)} mappings of {path}"
    return next(int(line.split()[1]) for line in lines[starts[0] + 1:] if line.startswith("Rss:")) << 10


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a shared-memory filesystem")
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_l2_segment_is_mapped_in_before_gets_land_in_it(tmp_path):
    """The daemon populates its L2 segment without mapping it; with the remote tier on, the
    segment's pages are mapped into the daemon in the background (a get landing in an unmapped
    page would fault for every 4 KiB of it on the request's path), and the thread doing it ends
    cleanly."""
    from kvcached.server.shm import SharedSegment

    segment = SharedSegment.create("/dev/shm", f"kvt-remote-map-{os.getpid()}", 3 * MAP_SLICE_BYTES // 2)
    try:
        assert mapped_bytes(segment.path) == 0
        store = make(segment.mapping, FakeStore())
        deadline = time.monotonic() + 20.0
        while mapped_bytes(segment.path) < segment.size_bytes:
            assert time.monotonic() < deadline, f"{mapped_bytes(segment.path)} of {segment.size_bytes} bytes mapped"
            time.sleep(0.02)
        store.close()
    finally:
        segment.close()
