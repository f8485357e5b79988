"""Mapping one namespace's region of a shared-memory segment as L2 pages."""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from collections.abc import Iterator

import pytest
import torch

from engine_client.dtypes import torch_dtype
from engine_client.shared_pool import SharedHostPool
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


def test_pages_view_the_region_at_the_offset_in_both_directions():
    """Bytes written to the file at the region show up in .pages, and writes to .pages land in the file,
    while the bytes before and after the region are left alone."""
    generator = torch.Generator().manual_seed(1)
    num_pages = 3
    offset = mmap.ALLOCATIONGRANULARITY
    region_bytes = num_pages * GEOMETRY.bytes_per_page
    file_bytes = offset + region_bytes + mmap.ALLOCATIONGRANULARITY
    with shm_segment(file_bytes) as path:
        outside = random_bytes(file_bytes, generator)
        file_fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(file_fd, outside, 0)
            with SharedHostPool.open(path, offset, num_pages, GEOMETRY, pin=False) as pool:
                assert tuple(pool.pages.shape) == (num_pages, *GEOMETRY.page_shape)
                assert pool.pages.dtype == torch_dtype(GEOMETRY.dtype)
                assert pool.pages.view(torch.uint8).flatten().numpy().tobytes() == outside[offset:offset + region_bytes]

                written = random_bytes(GEOMETRY.bytes_per_page, generator)
                pool.pages[1].view(torch.uint8).flatten().copy_(torch.frombuffer(bytearray(written), dtype=torch.uint8))
                page_1_at = offset + GEOMETRY.bytes_per_page
                assert os.pread(file_fd, GEOMETRY.bytes_per_page, page_1_at) == written
            after = os.pread(file_fd, file_bytes, 0)
        finally:
            os.close(file_fd)
    assert after[:page_1_at] == outside[:page_1_at]
    assert after[page_1_at + GEOMETRY.bytes_per_page:] == outside[page_1_at + GEOMETRY.bytes_per_page:]


@pytest.mark.parametrize("offset", [1, mmap.ALLOCATIONGRANULARITY // 2, -mmap.ALLOCATIONGRANULARITY])
def test_offset_must_be_a_non_negative_multiple_of_the_allocation_granularity(offset):
    """A misaligned or negative offset raises ValueError."""
    with shm_segment(4 * mmap.ALLOCATIONGRANULARITY) as path:
        with pytest.raises(ValueError, match="multiple of"):
            SharedHostPool.open(path, offset, 1, GEOMETRY, pin=False)


def test_region_past_the_end_of_the_file_is_refused():
    """A region that does not fit in the file raises ValueError naming the sizes."""
    num_pages = 4
    with shm_segment(mmap.ALLOCATIONGRANULARITY + num_pages * GEOMETRY.bytes_per_page - 1) as path:
        with pytest.raises(ValueError, match="the region needs"):
            SharedHostPool.open(path, mmap.ALLOCATIONGRANULARITY, num_pages, GEOMETRY, pin=False)
        with SharedHostPool.open(path, mmap.ALLOCATIONGRANULARITY, num_pages - 1, GEOMETRY, pin=False) as pool:
            assert pool.num_pages == num_pages - 1


@pytest.mark.parametrize("num_pages", [0, -1])
def test_num_pages_must_be_positive(num_pages):
    """Mapping zero or a negative number of pages raises ValueError."""
    with shm_segment(mmap.ALLOCATIONGRANULARITY) as path:
        with pytest.raises(ValueError, match="num_pages"):
            SharedHostPool.open(path, 0, num_pages, GEOMETRY, pin=False)


def test_missing_file_is_not_created():
    """Opening a path that does not exist raises FileNotFoundError and creates no file."""
    path = f"/dev/shm/kvcached-test-missing-{uuid.uuid4().hex}"
    with pytest.raises(FileNotFoundError):
        SharedHostPool.open(path, 0, 1, GEOMETRY, pin=False)
    assert not os.path.exists(path)


def test_close_is_idempotent_and_ends_access():
    """close() twice is fine; afterwards .pages raises RuntimeError and the pool reports closed."""
    with shm_segment(GEOMETRY.bytes_per_page) as path:
        pool = SharedHostPool.open(path, 0, 1, GEOMETRY, pin=False)
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
        pool = SharedHostPool.open(path, 0, 2, GEOMETRY, pin=False)
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
            SharedHostPool.open(path, 0, 1, GEOMETRY, pin=True)
        assert set(os.listdir("/proc/self/fd")) <= fds_before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_pool_is_page_locked_and_unpinned_on_close():
    """With pin=True on a GPU, .pages reports pinned memory and pin_seconds is measured; close() succeeds."""
    with shm_segment(4 * GEOMETRY.bytes_per_page) as path:
        pool = SharedHostPool.open(path, 0, 4, GEOMETRY, pin=True)
        assert pool.is_pinned and pool.pages.is_pinned()
        assert pool.pin_seconds > 0
        pool.close()
        assert pool.closed and not pool.is_pinned
