"""The engine's mapping of one namespace's region of the daemon's shared L2 segment.

Ownership. A `SharedHostPool` owns its mmap. `.pages` is a torch view of the mapping made through
a memoryview, and torch keeps that memoryview alive for as long as any tensor derived from
`.pages` (slices, `.view(...)`) lives. While one does, the mmap cannot be closed (Python raises
BufferError on an mmap with exported buffers), and `close()` refuses with RuntimeError and changes
nothing. So: drop every view of the pool (and drain transfers that use it) before closing it. This
is deliberate: the alternative, unmapping under a live tensor, turns a later access into a crash.

Pinning. With `pin=True` the mapped range is registered with CUDA (`cudaHostRegister`) so copies
to and from it run as DMA at PCIe speed. The daemon fills the segment with posix_fallocate, so its
pages exist; what is left per engine is to map them into this process (pre-fault) and to pin them.
Both are done per chunk of `pin_chunk_bytes` (256 MiB) on a few threads: each thread pre-faults its
chunk with MADV_POPULATE_WRITE and registers it, and the kernel and the driver do that work for
different chunks at once, faster than one MAP_POPULATE and one cudaHostRegister of the whole
range (``pin`` in docs/benchmarks.md has each way's time). tmpfs zeroes fallocated pages at first
touch: the daemon touches its segment when it creates it, once, so that the first engine to attach
does not pay for it.

Registration can also run in the background (`pin_in_background=True`): `open` returns once the
range is mapped, and the chunks are pinned in ascending order while the engine goes on. No DMA may touch memory
that is not pinned yet, so the transfer engine calls `wait_pinned(start, end)` for the bytes it is
about to copy, and splits its copies at chunk boundaries (`chunk_pieces`): one copy spanning two
registrations fails with cudaErrorInvalidValue, while copies cut at the boundary run as fast as
from a cudaHostAlloc buffer.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import math
import mmap
import os
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch

from engine_client.dtypes import torch_dtype
from proto import generations
from proto.messages import KVGeometry

logger = logging.getLogger(__name__)

# MAP_POPULATE is Linux-only; elsewhere the pages fault in on first touch.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

# Pinning granularity: small enough that several threads share a pool and the first chunks of a
# background registration are ready early (256 MiB pinned 16 GiB faster than 1 GiB did); a transfer
# that spans chunks is cut into one DMA per chunk, which costs no bandwidth. A pool's chunks are this
# rounded down to whole L2 pages (whole_page_chunk_bytes).
PIN_CHUNK_BYTES = 256 << 20

# cudaHostRegisterPortable: pinned for every CUDA context, not only the registering thread's.
_CUDA_HOST_REGISTER_PORTABLE = 1
# MADV_POPULATE_WRITE (Linux 5.14): fault the range in writable, like MAP_POPULATE, for one chunk.
_MADV_POPULATE_WRITE = 23


def default_pin_threads() -> int:
    """Threads that pin a pool: a few (at most 4). More are slower: the faults and the registrations
    contend in the kernel and the driver (``pin`` in docs/benchmarks.md)."""
    return max(1, min(4, os.cpu_count() or 1))


def chunk_pieces(start_byte: int, end_byte: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """[start_byte, end_byte) cut at every multiple of chunk_bytes, as (start, end) pairs in order."""
    assert 0 <= start_byte <= end_byte and chunk_bytes > 0, (start_byte, end_byte, chunk_bytes)
    pieces = []
    piece_start = start_byte
    while piece_start < end_byte:
        piece_end = min(end_byte, (piece_start // chunk_bytes + 1) * chunk_bytes)
        pieces.append((piece_start, piece_end))
        piece_start = piece_end
    return pieces


def whole_page_chunk_bytes(bytes_per_page: int, target_bytes: int = PIN_CHUNK_BYTES) -> int:
    """The pinning chunk of a pool of bytes_per_page pages: the largest common multiple of the page
    and of the OS page size not above target_bytes (at least one). Chunks of whole L2 pages: no page,
    and so no layer's row of one (a strided, layer-by-layer load), spans two registrations."""
    unit = math.lcm(bytes_per_page, mmap.PAGESIZE)
    return max(1, target_bytes // unit) * unit


# ---- CUDA and kernel calls (module functions so that tests can stand in for them) ---------------


def _check_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("pin=True needs CUDA, which is not available in this process")


def _register(address: int, num_bytes: int, device_index: int) -> None:
    """cudaHostRegister one chunk; called on a pinning thread (torch releases the GIL inside)."""
    torch.cuda.set_device(device_index)       # the thread's context is the engine's device's
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(address, num_bytes, _CUDA_HOST_REGISTER_PORTABLE)
    if error != cudart.cudaError.success:
        raise RuntimeError(f"cudaHostRegister of {num_bytes} bytes at {address:#x} failed: "
                           f"{cudart.cudaGetErrorString(error)} (cudaError {int(error)})")


def _unregister(address: int) -> None:
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostUnregister(address)
    if error != cudart.cudaError.success:
        # The mapping is about to go away regardless; a failed unregister only leaks a CUDA
        # bookkeeping entry, so report it rather than refuse to close.
        logger.error("cudaHostUnregister at %#x failed: %s (cudaError %d)", address,
                     cudart.cudaGetErrorString(error), int(error))


_libc: ctypes.CDLL | None = None
_populate_unsupported = False


def _prefault(address: int, num_bytes: int) -> None:
    """Map the chunk's pages into this process before pinning; a no-op where the kernel cannot.

    Through ctypes, which releases the GIL, so that several chunks fault in at once.
    """
    global _libc, _populate_unsupported
    if sys.platform != "linux" or _populate_unsupported:
        return
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
        _libc = libc
    if _libc.madvise(address, num_bytes, _MADV_POPULATE_WRITE) != 0:
        errno = ctypes.get_errno()
        if errno == 22:     # EINVAL: a kernel before 5.14; cudaHostRegister faults the pages itself
            _populate_unsupported = True
            logger.info("MADV_POPULATE_WRITE is not supported here; pinning faults pages in itself")
            return
        raise OSError(errno, f"madvise(MADV_POPULATE_WRITE) of {num_bytes} bytes failed: {os.strerror(errno)}")


# ---- the pool ---------------------------------------------------------------------------------


class SharedHostPool:
    """L2 pages `[num_pages, 2, layers, page_size, kv_heads, head_dim]` mapped from a shared segment."""

    def __init__(self, mapping: mmap.mmap, num_pages: int, geometry: KVGeometry, pin: bool, *,
                 pin_in_background: bool = False, pin_threads: int | None = None,
                 pin_chunk_bytes: int | None = None, prefault: bool = True,
                 device: torch.device | str | int | None = None):
        """Use `SharedHostPool.open`; this takes ownership of `mapping` and closes it on failure."""
        if pin_chunk_bytes is None:
            pin_chunk_bytes = whole_page_chunk_bytes(geometry.bytes_per_page)
        self.geometry = geometry
        self.num_pages = num_pages
        self.nbytes = num_pages * geometry.bytes_per_page
        self.pin_requested = pin
        self.pin_in_background = pin and pin_in_background
        self.pin_threads = default_pin_threads() if pin_threads is None else pin_threads
        self.pin_chunk_bytes = pin_chunk_bytes
        self.pin_seconds = 0.0                   # time to pin every chunk, once done
        self.unpin_seconds = 0.0
        self._prefault_chunks = prefault
        self._mmap: mmap.mmap | None = mapping
        self._pin_condition = threading.Condition()
        self._chunk_ranges: list[tuple[int, int]] = []
        self._chunk_is_pinned: list[bool] = []
        self._num_pinned_chunks = 0
        self._pin_error: BaseException | None = None
        self._pinning_finished = False
        self._stop_pinning = False
        self._pin_thread: threading.Thread | None = None
        self._base_address = 0
        self._device_index = 0
        self._pin_started = 0.0
        # Set by ``open`` from the daemon's file; until then nothing is trusted, nothing claimed.
        self.generations = PageGenerations("", 0)
        try:
            self._pages: torch.Tensor | None
            self._pages, self._buffer_ref = _pages_view(mapping, num_pages, geometry)
            if pin:
                self._start_pinning(device)
        except BaseException:
            self._stop_and_join_pinning()
            self._unpin_all()
            self._pages = None
            try:
                mapping.close()
            except BufferError:
                # A view still lives in the failing frame; the mapping goes away with it.
                pass
            self._mmap = None
            raise

    @classmethod
    def open(cls, path: str, num_pages: int, geometry: KVGeometry, pin: bool, *,
             pin_in_background: bool = False, pin_threads: int | None = None,
             pin_chunk_bytes: int | None = None, prefault: bool = True,
             device: torch.device | str | int | None = None, generations_path: str = "") -> "SharedHostPool":
        """Map the first `num_pages` pages of `path` (read-write, shared): page ids are absolute, the
        pages span the daemon's whole segment from its start.

        With `pin`, register the range with CUDA for `device` (default: the current one) in chunks
        of `pin_chunk_bytes` (default: `whole_page_chunk_bytes`) on `pin_threads` threads,
        pre-faulting each chunk first (`prefault`); with `pin_in_background`, return before that is
        done (see the module note).
        """
        if type(num_pages) is not int or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        geometry.validate()
        if pin_chunk_bytes is None:
            pin_chunk_bytes = whole_page_chunk_bytes(geometry.bytes_per_page)
        if pin:
            _check_pin_options(pin_threads, pin_chunk_bytes)
            _check_cuda()
        nbytes = num_pages * geometry.bytes_per_page
        fd = os.open(path, os.O_RDWR)
        try:
            file_size = os.fstat(fd).st_size
            if file_size < nbytes:
                raise ValueError(
                    f"{path} has {file_size} bytes; the region needs {nbytes} "
                    f"({num_pages} pages of {geometry.bytes_per_page} bytes)")
            # Pinning pre-faults chunk by chunk on several threads; MAP_POPULATE would do it all
            # here, on one thread, first.
            flags = mmap.MAP_SHARED | (0 if pin else _MAP_POPULATE)
            mapping = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            # The mmap holds its own duplicate of the descriptor; ours is not needed past here.
            os.close(fd)
        pool = cls(mapping, num_pages, geometry, pin, pin_in_background=pin_in_background,
                   pin_threads=pin_threads, pin_chunk_bytes=pin_chunk_bytes, prefault=prefault,
                   device=device)
        try:
            pool.generations = PageGenerations(generations_path, num_pages)
        except BaseException:
            pool.close()
            raise
        return pool

    @property
    def pages(self) -> torch.Tensor:
        if self._pages is None:
            raise RuntimeError("the shared host pool is closed")
        return self._pages

    def byte_view(self) -> torch.Tensor:
        """The whole region as one flat uint8 tensor (a view; it keeps the pool open while alive)."""
        return self.pages.view(torch.uint8).view(-1)

    @property
    def is_pinned(self) -> bool:
        """Every chunk of the region is registered with CUDA."""
        return self.pin_requested and self._num_pinned_chunks == len(self._chunk_ranges) > 0

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def chunk_pieces(self, start_byte: int, end_byte: int) -> list[tuple[int, int]]:
        """[start_byte, end_byte) of the region cut where one pinned chunk ends and the next begins."""
        if not self.pin_requested:
            return [(start_byte, end_byte)] if start_byte < end_byte else []
        return chunk_pieces(start_byte, end_byte, self.pin_chunk_bytes)

    def wait_pinned(self, start_byte: int, end_byte: int, timeout_s: float | None = None) -> None:
        """Return once every chunk holding bytes [start_byte, end_byte) is pinned.

        Returns at once for a pool opened without pinning. RuntimeError if pinning failed or the
        pool was closed first; TimeoutError after `timeout_s`.
        """
        if not self.pin_requested or start_byte >= end_byte or self.is_pinned:
            return
        first_chunk = start_byte // self.pin_chunk_bytes
        last_chunk = (end_byte - 1) // self.pin_chunk_bytes
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._pin_condition:
            while True:
                if self._pin_error is not None:
                    raise RuntimeError(f"pinning the shared host pool failed: {self._pin_error}") \
                        from self._pin_error
                if all(self._chunk_is_pinned[first_chunk:last_chunk + 1]):
                    return
                if self._pinning_finished or self._stop_pinning:
                    raise RuntimeError("the shared host pool was closed before these bytes were pinned")
                remaining_s = None if deadline is None else deadline - time.monotonic()
                if remaining_s is not None and remaining_s <= 0:
                    raise TimeoutError(f"bytes [{start_byte}, {end_byte}) of the shared host pool were "
                                       f"not pinned within timeout_s={timeout_s}")
                self._pin_condition.wait(remaining_s)

    def wait_until_pinned(self, timeout_s: float | None = None) -> None:
        """Return once the whole region is pinned (see `wait_pinned`)."""
        self.wait_pinned(0, self.nbytes, timeout_s)

    def pin_report(self) -> dict[str, Any]:
        """Pinning facts for the daemon's status (plain types only)."""
        with self._pin_condition:
            return {
                "requested": self.pin_requested, "background": self.pin_in_background,
                "bytes": self.nbytes, "chunk_bytes": self.pin_chunk_bytes, "threads": self.pin_threads,
                "chunks": len(self._chunk_ranges), "pinned_chunks": self._num_pinned_chunks,
                "pin_seconds": round(self.pin_seconds, 4) if self.is_pinned else None,
                "error": None if self._pin_error is None else str(self._pin_error),
            }

    def close(self) -> None:
        """Stop pinning, unpin and unmap. Idempotent. RuntimeError (and no change) while views of
        `.pages` live."""
        if self._mmap is None:
            return
        pages, self._pages = self._pages, None
        del pages
        buffer = self._buffer_ref()
        if buffer is not None:
            # Someone still holds a view; rebuild ours over the same buffer so the pool stays usable.
            self._pages = _typed_pages(buffer, self.num_pages, self.geometry)
            del buffer
            raise RuntimeError(
                "cannot close the shared host pool: tensor views of its pages are still alive "
                "(drop them and wait for transfers that use the pool first)")
        self._stop_and_join_pinning()
        self._unpin_all()
        self._mmap.close()
        self._mmap = None
        self.generations.close()

    def check_integrity(self) -> None:
        """Chunks tile the region in order, and the pinned count agrees with the per-chunk flags."""
        with self._pin_condition:
            if not self.pin_requested:
                assert not self._chunk_ranges and self._num_pinned_chunks == 0
                return
            expected = chunk_pieces(0, self.nbytes, self.pin_chunk_bytes)
            assert self._chunk_ranges == expected, "pin chunks do not tile the region"
            assert len(self._chunk_is_pinned) == len(self._chunk_ranges)
            assert sum(self._chunk_is_pinned) == self._num_pinned_chunks

    def __enter__(self) -> "SharedHostPool":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- CUDA registration ---------------------------------------------------------------------

    def _start_pinning(self, device: torch.device | str | int | None) -> None:
        _check_cuda()
        if device is None:
            self._device_index = torch.cuda.current_device()
        else:
            device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
            if device.type != "cuda":
                raise ValueError(f"pinning is for a CUDA device, got {device}")
            self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._base_address = self.pages.data_ptr()
        self._chunk_ranges = chunk_pieces(0, self.nbytes, self.pin_chunk_bytes)
        self._chunk_is_pinned = [False] * len(self._chunk_ranges)
        if self.pin_in_background:
            self._pin_thread = threading.Thread(target=self._pin_chunks, name="kvcached-pin", daemon=True)
            self._pin_thread.start()
            return
        self._pin_chunks()
        if self._pin_error is not None:
            raise RuntimeError(f"pinning the shared host pool failed: {self._pin_error}") from self._pin_error

    def _pin_chunks(self) -> None:
        self._pin_started = time.perf_counter()
        try:
            num_threads = min(self.pin_threads, len(self._chunk_ranges))
            with concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="kvcached-pin") as pool:
                # Submitted in ascending order, so the low chunks, which a fresh daemon hands out
                # first, are ready first.
                list(pool.map(self._pin_chunk, range(len(self._chunk_ranges))))
        finally:
            with self._pin_condition:
                if not self.is_pinned:
                    self.pin_seconds = time.perf_counter() - self._pin_started
                self._pinning_finished = True
                self._pin_condition.notify_all()
        if self._pin_error is None:
            logger.info("pinned %d bytes of shared host memory in %.3f s (%d chunks, %d threads%s)",
                        self.nbytes, self.pin_seconds, len(self._chunk_ranges), self.pin_threads,
                        ", in the background" if self.pin_in_background else "")

    def _pin_chunk(self, index: int) -> None:
        with self._pin_condition:
            if self._stop_pinning or self._pin_error is not None:
                return
        start, end = self._chunk_ranges[index]
        address = self._base_address + start
        try:
            if self._prefault_chunks:
                _prefault(address, end - start)
            _register(address, end - start, self._device_index)
        except BaseException as error:
            with self._pin_condition:
                if self._pin_error is None:
                    self._pin_error = error
                self._pin_condition.notify_all()
            return
        with self._pin_condition:
            self._chunk_is_pinned[index] = True
            self._num_pinned_chunks += 1
            if self.is_pinned:
                # Set with the last chunk, so whoever sees is_pinned also sees the final time.
                self.pin_seconds = time.perf_counter() - self._pin_started
            self._pin_condition.notify_all()

    def _stop_and_join_pinning(self) -> None:
        with self._pin_condition:
            self._stop_pinning = True
            self._pin_condition.notify_all()
        if self._pin_thread is not None:
            self._pin_thread.join()
            self._pin_thread = None

    def _unpin_all(self) -> None:
        """Unregister every pinned chunk (pinning has stopped)."""
        addresses = [self._base_address + start
                     for (start, _), pinned in zip(self._chunk_ranges, self._chunk_is_pinned) if pinned]
        if not addresses:
            return
        started = time.perf_counter()
        num_threads = min(self.pin_threads, len(addresses))
        if num_threads > 1:
            with concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="kvcached-unpin") as pool:
                list(pool.map(_unregister, addresses))
        else:
            for address in addresses:
                _unregister(address)
        with self._pin_condition:
            self._chunk_is_pinned = [False] * len(self._chunk_ranges)
            self._num_pinned_chunks = 0
        self.unpin_seconds = time.perf_counter() - started


def _check_pin_options(pin_threads: int | None, pin_chunk_bytes: int) -> None:
    if pin_threads is not None and (type(pin_threads) is not int or pin_threads < 1):
        raise ValueError(f"pin_threads must be a positive integer, got {pin_threads!r}")
    if type(pin_chunk_bytes) is not int or pin_chunk_bytes < mmap.PAGESIZE or pin_chunk_bytes % mmap.PAGESIZE:
        raise ValueError(f"pin_chunk_bytes must be a positive multiple of the page size {mmap.PAGESIZE}, "
                         f"got {pin_chunk_bytes!r}")


def _pages_view(mapping: mmap.mmap, num_pages: int,
                geometry: KVGeometry) -> tuple[torch.Tensor, weakref.ref]:
    """The typed page view of `mapping`, and a weak reference to the memoryview it holds.

    Going through a memoryview is what makes live tensor views block mm.close() (see the module
    note): torch keeps the object it was given alive, and the memoryview holds an export of the
    mmap, whereas torch.frombuffer on the mmap itself holds no export.
    """
    buffer = memoryview(mapping)
    return _typed_pages(buffer, num_pages, geometry), weakref.ref(buffer)


def _typed_pages(buffer: memoryview, num_pages: int, geometry: KVGeometry) -> torch.Tensor:
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=num_pages * geometry.bytes_per_page)
    return flat.view(torch_dtype(geometry.dtype)).view(num_pages, *geometry.page_shape)


class PageGenerations:
    """This engine's mapping of its namespace's L2 page generations (``proto.generations``): a
    writer claims its reserved pages before its copy and stamps them once the copy is complete; a
    reader trusts a page only while its word holds the generation the daemon published
    (docs/architecture.md, "Fencing"). Without a file (a daemon that names none) no page is
    trusted and none claimed: every load is a miss, every save skipped."""

    def __init__(self, path: str, num_pages: int):
        self.path = path
        self._mapping: mmap.mmap | None = None
        if not path:
            self.words = np.zeros(num_pages, dtype=np.uint64)
            return
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size < generations.file_bytes(num_pages):
                raise ValueError(f"{path} has {size} bytes, not the {generations.file_bytes(num_pages)} of "
                                 f"{num_pages} page generations")
            self._mapping = mmap.mmap(fd, generations.file_bytes(num_pages), mmap.MAP_SHARED,
                                      mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.words = np.frombuffer(self._mapping, dtype="<u8", count=num_pages)

    def claim(self, page_ids: np.ndarray, generation: int) -> np.ndarray:
        """Before any byte is copied into them: of ``page_ids``, those still reserved for
        ``generation`` become being-written (0); returns which (a page the daemon revoked or gave
        to another writer is not touched)."""
        page_ids = np.asarray(page_ids, dtype=np.int64)
        claimed = self.words[page_ids] == np.uint64(generations.reserved(generation))
        self.words[page_ids[claimed]] = 0
        return claimed

    def stamp(self, page_ids: np.ndarray, generation: int) -> None:
        """Once the copy into them is complete: their bytes are those of ``generation``."""
        self.words[np.asarray(page_ids, dtype=np.int64)] = generation

    def num_leading_intact(self, page_ids: np.ndarray, expected: np.ndarray) -> int:
        """How many leading pages hold the generation they were published with (``expected``)."""
        page_ids = np.asarray(page_ids, dtype=np.int64)
        expected = np.asarray(expected, dtype=np.uint64)
        bad = np.flatnonzero((self.words[page_ids] != expected) | (expected == 0))
        return int(bad[0]) if len(bad) else len(page_ids)

    def close(self) -> None:
        if self._mapping is not None:
            self.words = np.zeros(0, dtype=np.uint64)      # drops the export of the mapping
            self._mapping.close()
            self._mapping = None
