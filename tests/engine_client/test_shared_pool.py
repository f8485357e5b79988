"""Mapping one namespace's region of a shared-memory segment as L2 pages."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from engine_client.dtypes import torch_dtype
from engine_client.shared_pool import SharedHostPool, chunk_pieces
from proto.messages import KVGeometry

GEOMETRY = KVGeometry(model_id="test-model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", page_size=8)

@contextlib.contextmanager
def shm_segment(num_bytes: int) -> Iterator[str]:
    """A fresh file under /dev/shm (mode 0600, space reserved), removed afterwards."""
    path = f"/dev/shm/kvcached-test-{os.getpid()}-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, num_bytes)
        os.close(fd)
        fd = -1
        yield path
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(path)


def random_bytes(num_bytes: int, generator: torch.Generator) -> bytes:
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=generator).numpy().tobytes()


def test_pages_view_the_file_in_both_directions():
    """Bytes written to the file show up in .pages, and writes to .pages land in the file, while
    the bytes after the pages are left alone."""
    generator = torch.Generator().manual_seed(1)
    num_pages = 3
    region_bytes = num_pages * GEOMETRY.bytes_per_page
    file_bytes = region_bytes + mmap.ALLOCATIONGRANULARITY
    with shm_segment(file_bytes) as path:
        outside = random_bytes(file_bytes, generator)
        file_fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(file_fd, outside, 0)
            with SharedHostPool.open(path, num_pages, GEOMETRY, pin=False) as pool:
                assert tuple(pool.pages.shape) == (num_pages, *GEOMETRY.page_shape)
                assert pool.pages.dtype == torch_dtype(GEOMETRY.dtype)
                assert pool.pages.view(torch.uint8).flatten().numpy().tobytes() == outside[:region_bytes]

                written = random_bytes(GEOMETRY.bytes_per_page, generator)
                pool.pages[1].view(torch.uint8).flatten().copy_(torch.frombuffer(bytearray(written), dtype=torch.uint8))
                page_1_at = GEOMETRY.bytes_per_page
                assert os.pread(file_fd, GEOMETRY.bytes_per_page, page_1_at) == written
            after = os.pread(file_fd, file_bytes, 0)
        finally:
            os.close(file_fd)
    assert after[:page_1_at] == outside[:page_1_at]
    assert after[page_1_at + GEOMETRY.bytes_per_page:] == outside[page_1_at + GEOMETRY.bytes_per_page:]


def test_region_past_the_end_of_the_file_is_refused():
    """Pages that do not fit in the file raise ValueError naming the sizes."""
    num_pages = 4
    with shm_segment(num_pages * GEOMETRY.bytes_per_page - 1) as path:
        with pytest.raises(ValueError, match="the region needs"):
            SharedHostPool.open(path, num_pages, GEOMETRY, pin=False)
        with SharedHostPool.open(path, num_pages - 1, GEOMETRY, pin=False) as pool:
            assert pool.num_pages == num_pages - 1


@pytest.mark.parametrize("num_pages", [0, -1])
def test_num_pages_must_be_positive(num_pages):
    """Mapping zero or a negative number of pages raises ValueError."""
    with shm_segment(mmap.ALLOCATIONGRANULARITY) as path:
        with pytest.raises(ValueError, match="num_pages"):
            SharedHostPool.open(path, num_pages, GEOMETRY, pin=False)


def test_missing_file_is_not_created():
    """Opening a path that does not exist raises FileNotFoundError and creates no file."""
    path = f"/dev/shm/kvcached-test-missing-{uuid.uuid4().hex}"
    with pytest.raises(FileNotFoundError):
        SharedHostPool.open(path, 1, GEOMETRY, pin=False)
    assert not os.path.exists(path)


def test_close_is_idempotent_and_ends_access():
    """close() twice is fine; afterwards .pages raises RuntimeError and the pool reports closed."""
    with shm_segment(GEOMETRY.bytes_per_page) as path:
        pool = SharedHostPool.open(path, 1, GEOMETRY, pin=False)
        assert not pool.closed
        pool.close()
        pool.close()
        assert pool.closed
        with pytest.raises(RuntimeError, match="closed"):
            _ = pool.pages


def test_close_with_a_live_view_refuses_and_keeps_the_pool_usable():
    """While a slice of .pages is alive, close() raises RuntimeError and the pool (and the slice) still
    read the shared bytes; once the slice is dropped, close() succeeds."""
    generator = torch.Generator().manual_seed(2)
    with shm_segment(2 * GEOMETRY.bytes_per_page) as path:
        pool = SharedHostPool.open(path, 2, GEOMETRY, pin=False)
        page_bits = pool.pages.view(torch.int16)
        page_bits.copy_(torch.randint(-2**15, 2**15, page_bits.shape, dtype=torch.int16, generator=generator))
        expected = page_bits.clone()
        del page_bits
        live_slice = pool.pages[1]
        with pytest.raises(RuntimeError, match="still alive"):
            pool.close()
        assert not pool.closed
        assert torch.equal(pool.pages.view(torch.int16), expected)
        assert torch.equal(live_slice.view(torch.int16), expected[1])
        del live_slice
        pool.close()
        assert pool.closed


@pytest.mark.skipif(torch.cuda.is_available(), reason="this process has CUDA")
def test_pin_without_cuda_raises_and_leaves_no_descriptor_open():
    """pin=True in a process without CUDA raises RuntimeError and closes the file descriptor."""
    with shm_segment(GEOMETRY.bytes_per_page) as path:
        fds_before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(RuntimeError, match="needs CUDA"):
            SharedHostPool.open(path, 1, GEOMETRY, pin=True)
        assert set(os.listdir("/proc/self/fd")) <= fds_before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_pool_is_page_locked_and_unpinned_on_close():
    """With pin=True on a GPU, .pages reports pinned memory and pin_seconds is measured; close() succeeds."""
    with shm_segment(4 * GEOMETRY.bytes_per_page) as path:
        pool = SharedHostPool.open(path, 4, GEOMETRY, pin=True)
        assert pool.is_pinned and pool.pages.is_pinned()
        assert pool.pin_seconds > 0
        pool.close()
        assert pool.closed and not pool.is_pinned


# ---- chunked and background pinning ---------------------------------------------------------------
# The CUDA calls are module functions of engine_client.shared_pool; these tests stand in for them,
# so the chunking, ordering and error paths run here without a GPU. The real calls are exercised
# by the tests marked gpu.

CHUNK_BYTES = mmap.PAGESIZE
PAGES_PER_CHUNK = CHUNK_BYTES // GEOMETRY.bytes_per_page


class FakeCuda:
    """Records registrations; a chunk's registration can be held until the test lets it go."""

    def __init__(self, hold: bool = False, fail_at_chunk: int | None = None):
        self.registered: dict[int, int] = {}       # address -> bytes
        self.unregistered: list[int] = []
        self.register_calls: list[tuple[int, int]] = []
        self.hold = hold
        self.fail_at_chunk = fail_at_chunk
        self.base_address: int | None = None
        self.release_events: dict[int, threading.Event] = {}
        self.lock = threading.Lock()

    def install(self, monkeypatch) -> "FakeCuda":
        import engine_client.shared_pool as shared_pool

        monkeypatch.setattr(shared_pool, "_check_cuda", lambda: None)
        monkeypatch.setattr(shared_pool, "_register", self.register)
        monkeypatch.setattr(shared_pool, "_unregister", self.unregister)
        return self

    def release(self, chunk: int) -> None:
        self.release_events.setdefault(chunk, threading.Event()).set()

    def register(self, address: int, num_bytes: int, device_index: int) -> None:
        with self.lock:
            if self.base_address is None:
                self.base_address = address         # chunk 0 is submitted first
            chunk = (address - self.base_address) // CHUNK_BYTES
            self.register_calls.append((address, num_bytes))
            event = self.release_events.setdefault(chunk, threading.Event())
        if self.hold:
            assert event.wait(10), f"chunk {chunk} was never released"
        if chunk == self.fail_at_chunk:
            raise RuntimeError(f"cudaHostRegister failed for chunk {chunk} (fake)")
        with self.lock:
            assert address not in self.registered, "a chunk was registered twice"
            self.registered[address] = num_bytes

    def unregister(self, address: int) -> None:
        with self.lock:
            assert address in self.registered, "unregistering a chunk that is not registered"
            del self.registered[address]
            self.unregistered.append(address)


def pinned_pool(path: str, num_pages: int, **options) -> SharedHostPool:
    return SharedHostPool.open(path, num_pages, GEOMETRY, pin=True, pin_chunk_bytes=CHUNK_BYTES,
                               device=0, **options)


@pytest.mark.parametrize("start, end, chunk, expected", [
    (0, 10, 4, [(0, 4), (4, 8), (8, 10)]),
    (3, 9, 4, [(3, 4), (4, 8), (8, 9)]),
    (4, 8, 4, [(4, 8)]),
    (5, 5, 4, []),
    (0, 3, 100, [(0, 3)]),
])
def test_chunk_pieces_cut_a_range_at_every_chunk_boundary(start, end, chunk, expected):
    """chunk_pieces returns consecutive pieces covering [start, end) that never cross a multiple of chunk."""
    assert chunk_pieces(start, end, chunk) == expected


@pytest.mark.parametrize("pin_threads", [1, 3])
def test_blocking_pin_registers_each_chunk_once_and_close_unregisters_them(monkeypatch, pin_threads):
    """Opening with pin=True registers every chunk of the region exactly once (tiling it) before open
    returns; close() unregisters exactly those chunks."""
    fake = FakeCuda().install(monkeypatch)
    num_pages = 3 * PAGES_PER_CHUNK + PAGES_PER_CHUNK // 2          # three and a half chunks
    with shm_segment(num_pages * GEOMETRY.bytes_per_page) as path:
        pool = pinned_pool(path, num_pages, pin_threads=pin_threads)
        pool.check_integrity()
        assert pool.is_pinned and pool.pin_seconds > 0
        base = pool.pages.data_ptr()
        expected = {base + start: end - start
                    for start, end in chunk_pieces(0, pool.nbytes, CHUNK_BYTES)}
        assert fake.registered == expected and len(fake.register_calls) == len(expected) == 4
        assert pool.pin_report()["pinned_chunks"] == 4
        pool.close()
        assert fake.registered == {} and sorted(fake.unregistered) == sorted(expected)


def test_background_pin_makes_each_chunk_usable_as_soon_as_it_is_registered(monkeypatch):
    """With pin_in_background, open returns before any chunk is pinned; wait_pinned for bytes of a
    chunk returns once that chunk is registered, and times out for a chunk still held."""
    fake = FakeCuda(hold=True).install(monkeypatch)
    num_pages = 3 * PAGES_PER_CHUNK
    with shm_segment(num_pages * GEOMETRY.bytes_per_page) as path:
        pool = pinned_pool(path, num_pages, pin_in_background=True, pin_threads=1)
        try:
            assert not pool.is_pinned and fake.registered == {}
            fake.release(0)
            pool.wait_pinned(0, CHUNK_BYTES, timeout_s=10)
            with pytest.raises(TimeoutError, match="not pinned within"):
                pool.wait_pinned(CHUNK_BYTES - 1, CHUNK_BYTES + 1, timeout_s=0.05)
            assert not pool.is_pinned and pool.pin_report()["pin_seconds"] is None
            fake.release(1)
            fake.release(2)
            pool.wait_until_pinned(timeout_s=10)
            pool.check_integrity()
            assert pool.is_pinned and len(fake.registered) == 3 and pool.pin_seconds > 0
        finally:
            for chunk in range(3):
                fake.release(chunk)
            pool.close()
        assert fake.registered == {}


def test_a_failed_registration_fails_open_and_leaves_nothing_registered(monkeypatch):
    """If a chunk cannot be pinned, a blocking open raises RuntimeError, unregisters the chunks it had
    pinned and closes the file descriptor."""
    fake = FakeCuda(fail_at_chunk=2).install(monkeypatch)
    with shm_segment(4 * CHUNK_BYTES) as path:
        fds_before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(RuntimeError, match="chunk 2"):
            pinned_pool(path, 4 * PAGES_PER_CHUNK, pin_threads=1)
        assert fake.registered == {} and len(fake.unregistered) == 2
        assert set(os.listdir("/proc/self/fd")) <= fds_before


def test_a_failed_background_registration_is_raised_by_wait_pinned(monkeypatch):
    """A chunk that fails to pin in the background makes wait_pinned raise RuntimeError naming the failure."""
    FakeCuda(fail_at_chunk=1).install(monkeypatch)
    with shm_segment(4 * CHUNK_BYTES) as path:
        pool = pinned_pool(path, 4 * PAGES_PER_CHUNK, pin_in_background=True, pin_threads=1)
        with pytest.raises(RuntimeError, match="pinning the shared host pool failed: .*chunk 1"):
            pool.wait_until_pinned(timeout_s=10)
        assert pool.pin_report()["error"] is not None
        pool.close()


def test_close_during_background_pinning_stops_it_and_unregisters_what_was_pinned(monkeypatch):
    """close() while chunks are still being pinned stops the pinning, waits for the chunk in progress
    and unregisters every chunk that was registered; nothing stays registered."""
    fake = FakeCuda(hold=True).install(monkeypatch)
    with shm_segment(4 * CHUNK_BYTES) as path:
        pool = pinned_pool(path, 4 * PAGES_PER_CHUNK, pin_in_background=True, pin_threads=1)
        fake.release(0)
        pool.wait_pinned(0, 1, timeout_s=10)
        closer = threading.Thread(target=pool.close)
        closer.start()
        deadline = time.monotonic() + 10
        while not pool._stop_pinning and time.monotonic() < deadline:    # close() has asked pinning to stop
            time.sleep(0.001)
        fake.release(1)                 # the chunk in progress when close() began
        closer.join(10)
        assert not closer.is_alive() and pool.closed
        assert fake.registered == {} and len(fake.register_calls) <= 2
        assert len(fake.unregistered) == len(fake.register_calls)
        with pytest.raises(RuntimeError):
            pool.wait_pinned(0, 1)


@pytest.mark.parametrize("pin_threads, pin_chunk_bytes", [(0, CHUNK_BYTES), (1, 1000), (1, 0)])
def test_bad_pin_options_are_refused(monkeypatch, pin_threads, pin_chunk_bytes):
    """A non-positive thread count or a chunk size that is not a multiple of the page size raises ValueError."""
    FakeCuda().install(monkeypatch)
    with shm_segment(GEOMETRY.bytes_per_page) as path:
        with pytest.raises(ValueError, match="pin_threads|pin_chunk_bytes"):
            SharedHostPool.open(path, 1, GEOMETRY, pin=True, pin_threads=pin_threads,
                                pin_chunk_bytes=pin_chunk_bytes, device=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("background", [False, True])
def test_chunked_pinning_on_a_gpu_pins_every_chunk(background):
    """With small chunks, every chunk ends up page-locked (checked at each chunk's first byte), with or
    without background pinning; close() unpins them."""
    num_pages = 4 * PAGES_PER_CHUNK + 1
    with shm_segment(num_pages * GEOMETRY.bytes_per_page) as path:
        pool = SharedHostPool.open(path, num_pages, GEOMETRY, pin=True, pin_chunk_bytes=CHUNK_BYTES,
                                   pin_in_background=background)
        pool.wait_until_pinned(timeout_s=30)
        pool.check_integrity()
        flat = pool.byte_view()
        starts = [start for start, _ in chunk_pieces(0, pool.nbytes, CHUNK_BYTES)]
        assert len(starts) > 2 and all(flat[start:].is_pinned() for start in starts)
        del flat
        pool.close()
        assert pool.closed and not pool.is_pinned
