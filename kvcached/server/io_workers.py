"""L3 I/O: page moves between the L2 arena and the storage file's slots (``storage_file.py``), and
the file thread pool.

Design notes:
- Bytes move with pwrite/preadv straight between the mmap'ed L2 arena and the file, through
  memoryview slices: no serialisation, no intermediate copies.
- One system-call loop per extent: a run where both the L2 pages and the slots are consecutive
  (`coalesce_extents`). A loop, because the kernel may move fewer bytes than asked.
- A job's bytes go in slices of at most SLICE_BYTES (whole pages; a long extent is cut, short ones
  are packed together), run in parallel on a small module-level pool: several threads copy out of the
  page cache faster than one. The pool is not the IoExecutor's: a slice never
  waits for anything, so jobs waiting for their slices cannot deadlock it. A job returns or
  raises only after every slice it started has ended, so its pages are never freed or published
  under a live copy.
- Checksums (``checksum=True``) are computed here, in the I/O thread, on the bytes moved: before
  each write from the L2 page written, after each read on the L2 page read into.
- Fault injection: `_pwrite` and `_preadv` are the module's only references to os.pwrite and
  os.preadv; tests monkeypatch them to inject ENOSPC, EIO or short transfers. Truncating or
  unlinking the file underneath needs no seam: tests do it for real.
- asyncio lives only in IoExecutor; the functions above it are plain blocking calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
import threading
import time
import zlib
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from kvcached.core.storage import SlotLayout, coalesce_extents
from kvcached.server.storage_file import DIRECT_IO_ALIGNMENT_BYTES, StorageFile

logger = logging.getLogger(__name__)

SLICE_BYTES = 16 << 20  # the most one thread moves in one go; rounded down to whole pages (at least one)
NUM_SLICE_THREADS = min(8, os.cpu_count() or 1)

# Fault-injection seam (see the module note): looked up at call time, so monkeypatching works.
_pwrite = os.pwrite
_preadv = os.preadv


class ShortReadError(OSError):
    """The file ended before a slot's bytes did (it was truncated underneath, or a read went past
    its end). The destination pages hold partial data and must not be published. `offset`,
    `expected_bytes` and `read_bytes` are those of the one read that came short: an extent, or
    the slice of it that one thread read."""

    def __init__(self, path: str, offset: int, expected_bytes: int, read_bytes: int):
        super().__init__(
            errno.EIO,
            f"short read at offset {offset}: expected {expected_bytes} bytes, got {read_bytes} before end of file",
            path,
        )
        self.offset = offset
        self.expected_bytes = expected_bytes
        self.read_bytes = read_bytes


class IoResult(NamedTuple):
    num_bytes: int
    num_extents: int
    seconds: float  # the job's wall time in the file I/O, all slices (service time), not validation or queueing
    page_checksums: Sequence[int] = ()  # with checksum=True: zlib.crc32 of each page moved, in order


@contextlib.contextmanager
def _byte_view(buffer: Any) -> Iterator[memoryview]:
    """A flat byte view of `buffer`, released on exit so no export outlives the call (an mmap
    with a live export refuses to close)."""
    with memoryview(buffer) as view:
        if not view.c_contiguous:
            raise ValueError("the arena buffer must be C-contiguous")
        if view.format == "B" and view.ndim == 1:
            yield view
        else:
            with view.cast("B") as flat:
                yield flat


def _check_transfer(storage: StorageFile, layout: SlotLayout, arena: memoryview, bytes_per_page: int,
                    l2_page_ids: Sequence[int], slot_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
    """Validate a whole transfer before the first byte moves, so bad input never half-writes."""
    if bytes_per_page != layout.bytes_per_page:
        raise ValueError(f"bytes_per_page {bytes_per_page} differs from the slot layout's {layout.bytes_per_page}")
    if layout.size_bytes > storage.size_bytes:
        raise ValueError(f"the slots end at byte {layout.size_bytes}, past the file's {storage.size_bytes} bytes")
    num_arena_pages = len(arena) // bytes_per_page
    for page_id in l2_page_ids:
        if page_id >= num_arena_pages:
            raise ValueError(f"L2 page {page_id} out of range [0, {num_arena_pages})")
    for slot in slot_ids:
        layout.offset(slot)  # raises ValueError when out of range
    if len(set(dst_ids)) != len(dst_ids):
        raise ValueError("destination page ids repeat: two sources would race into one page")
    if storage.o_direct:
        _check_direct_alignment(layout, arena, bytes_per_page)


def _check_direct_alignment(layout: SlotLayout, arena: memoryview, bytes_per_page: int) -> None:
    align = DIRECT_IO_ALIGNMENT_BYTES
    if bytes_per_page % align:
        raise ValueError(f"O_DIRECT needs bytes_per_page to be a multiple of {align}, got {bytes_per_page}")
    # numpy reads the address of read-only buffers too (ctypes.from_buffer needs writable ones).
    arena_address = np.frombuffer(arena, dtype=np.uint8).ctypes.data
    if arena_address % align:
        raise ValueError(f"O_DIRECT needs the arena's address to be a multiple of {align}, got {arena_address:#x}")


def _pwrite_all(path: str, fd: int, view: memoryview, file_offset: int) -> None:
    num_done_bytes = 0
    while num_done_bytes < len(view):
        with view[num_done_bytes:] as rest:
            num_written_bytes = _pwrite(fd, rest, file_offset + num_done_bytes)
        if num_written_bytes == 0:
            # pwrite reporting no progress on a regular file means the disk is full.
            raise OSError(errno.ENOSPC, f"no space: wrote 0 bytes at offset {file_offset + num_done_bytes}", path)
        num_done_bytes += num_written_bytes


def _preadv_all(storage: StorageFile, fd: int, view: memoryview, file_offset: int) -> None:
    num_done_bytes = 0
    while num_done_bytes < len(view):
        with view[num_done_bytes:] as rest:
            num_read_bytes = _preadv(fd, [rest], file_offset + num_done_bytes)
        if num_read_bytes == 0:  # end of file: it was truncated underneath
            raise ShortReadError(storage.path, file_offset, len(view), num_done_bytes)
        num_done_bytes += num_read_bytes


def _page_checksums(view: memoryview, bytes_per_page: int) -> list[int]:
    checksums = []
    for start in range(0, len(view), bytes_per_page):
        with view[start:start + bytes_per_page] as page:
            checksums.append(zlib.crc32(page))
    return checksums


class _Piece(NamedTuple):
    """A contiguous part of one extent: `num_bytes` at `arena_offset` of the arena and at
    `file_offset` of the file (both at page boundaries, so O_DIRECT alignment holds)."""
    arena_offset: int
    file_offset: int
    num_bytes: int


def _plan_slices(runs: Sequence[tuple[int, int, int]], layout: SlotLayout,
                 bytes_per_page: int) -> list[list[_Piece]]:
    """Cut the runs (first L2 page, first slot, number of pages) into slices of at most
    SLICE_BYTES (whole pages, one at least), in order: a long run into several, consecutive
    short ones packed into one."""
    slice_pages = max(1, SLICE_BYTES // bytes_per_page)
    slices: list[list[_Piece]] = []
    num_free_pages = 0  # room left in the last slice
    for first_page_id, first_slot_id, num_run_pages in runs:
        num_done_pages = 0
        while num_done_pages < num_run_pages:
            if num_free_pages == 0:
                slices.append([])
                num_free_pages = slice_pages
            num_pages = min(num_free_pages, num_run_pages - num_done_pages)
            slices[-1].append(_Piece((first_page_id + num_done_pages) * bytes_per_page,
                                     layout.offset(first_slot_id + num_done_pages), num_pages * bytes_per_page))
            num_done_pages += num_pages
            num_free_pages -= num_pages
    return slices


_slice_pool: concurrent.futures.ThreadPoolExecutor | None = None
_slice_pool_lock = threading.Lock()


def _get_slice_pool() -> concurrent.futures.ThreadPoolExecutor:
    # Made on first use, not at import: a process forked before that gets a pool of its own.
    global _slice_pool
    with _slice_pool_lock:
        if _slice_pool is None:
            _slice_pool = concurrent.futures.ThreadPoolExecutor(NUM_SLICE_THREADS,
                                                                thread_name_prefix="kvcached-io-slice")
        return _slice_pool


def _run_slices(move_slice: Callable[[list[_Piece]], list[int]], slices: list[list[_Piece]]) -> list[int]:
    """Run `move_slice` on every slice, in parallel where there are several; return their page
    checksums in order. Returns or raises only when no slice runs any more; after the first
    error the slices not yet started are dropped, and the error of the earliest failed slice
    is raised."""
    if len(slices) <= 1:
        return move_slice(slices[0]) if slices else []
    pool = _get_slice_pool()
    futures = [pool.submit(move_slice, pieces) for pieces in slices]
    try:
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    finally:
        for future in futures:
            future.cancel()  # only those not started: a running one is waited for below
        concurrent.futures.wait(futures)
    for future in futures:
        if not future.cancelled() and future.exception() is not None:
            raise future.exception()
    assert not any(future.cancelled() for future in futures), "slices were dropped, yet none failed"
    return [page_checksum for future in futures for page_checksum in future.result()]


def write_pages(storage: StorageFile, layout: SlotLayout, src: Any, bytes_per_page: int,
                l2_page_ids: Sequence[int], slot_ids: Sequence[int], checksum: bool = False) -> IoResult:
    """Copy L2 page `l2_page_ids[i]` of the arena `src` into slot `slot_ids[i]` of `layout`.

    `src` is the whole L2 arena (page p = bytes [p*bytes_per_page, (p+1)*bytes_per_page)).
    Raises ValueError on bad input before any byte moves, OSError (ENOSPC, EIO, ...) from the
    file; after an OSError the slots hold undefined bytes and must not be published.
    """
    extents = coalesce_extents(l2_page_ids, slot_ids)
    with _byte_view(src) as arena:
        _check_transfer(storage, layout, arena, bytes_per_page, l2_page_ids, slot_ids, dst_ids=slot_ids)
        slices = _plan_slices([(extent.src_start, extent.dst_start, extent.num_pages) for extent in extents],
                              layout, bytes_per_page)
        with storage._io_in_flight() as fd:

            def write_slice(pieces: list[_Piece]) -> list[int]:
                checksums: list[int] = []
                for piece in pieces:
                    with arena[piece.arena_offset:piece.arena_offset + piece.num_bytes] as view:
                        if checksum:
                            checksums += _page_checksums(view, bytes_per_page)
                        _pwrite_all(storage.path, fd, view, piece.file_offset)
                return checksums

            start_s = time.perf_counter()
            checksums = _run_slices(write_slice, slices)
            seconds = time.perf_counter() - start_s
    return IoResult(len(slot_ids) * bytes_per_page, len(extents), seconds, checksums)


def read_pages(storage: StorageFile, layout: SlotLayout, dst: Any, bytes_per_page: int,
               slot_ids: Sequence[int], l2_page_ids: Sequence[int], checksum: bool = False) -> IoResult:
    """Copy slot `slot_ids[i]` of `layout` into L2 page `l2_page_ids[i]` of the arena `dst`.

    Raises ValueError on bad input before any byte moves, ShortReadError when the file ends
    early, OSError from the file; after any error the L2 pages hold partial data and must not
    be published.
    """
    extents = coalesce_extents(slot_ids, l2_page_ids)
    with _byte_view(dst) as arena:
        if arena.readonly:
            raise ValueError("read_pages needs a writable arena")
        _check_transfer(storage, layout, arena, bytes_per_page, l2_page_ids, slot_ids, dst_ids=l2_page_ids)
        slices = _plan_slices([(extent.dst_start, extent.src_start, extent.num_pages) for extent in extents],
                              layout, bytes_per_page)
        with storage._io_in_flight() as fd:

            def read_slice(pieces: list[_Piece]) -> list[int]:
                checksums: list[int] = []
                for piece in pieces:
                    with arena[piece.arena_offset:piece.arena_offset + piece.num_bytes] as view:
                        _preadv_all(storage, fd, view, piece.file_offset)
                        if checksum:
                            checksums += _page_checksums(view, bytes_per_page)
                return checksums

            start_s = time.perf_counter()
            checksums = _run_slices(read_slice, slices)
            seconds = time.perf_counter() - start_s
    return IoResult(len(slot_ids) * bytes_per_page, len(extents), seconds, checksums)


class WriteBackoff:
    """L3 write-throughs while writes fail, and what the log says of them. Not thread-safe: the
    server calls it under its state lock.

    A failure pauses write-throughs (``allows`` is False) for a delay that doubles, from
    min_delay_s up to max_delay_s, with each failure of a write started after the last pause
    ended (writes already in flight when one fails do not double it again); a success ends the
    pause and resets the delay. A cause (an errno name, or the error's type) is logged at once
    the first time in log_interval_s; later failures of it are counted and summarised in one line
    per cause once the interval has passed (at the next failure or success)."""

    def __init__(self, min_delay_s: float = 0.1, max_delay_s: float = 30.0, log_interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < min_delay_s <= max_delay_s or log_interval_s <= 0:
            raise ValueError(f"need 0 < min_delay_s <= max_delay_s and log_interval_s > 0, got {min_delay_s}, "
                             f"{max_delay_s}, {log_interval_s}")
        self.min_delay_s, self.max_delay_s, self.log_interval_s = min_delay_s, max_delay_s, log_interval_s
        self.clock = clock
        self.delay_s = 0.0                  # the current pause; 0 while writes succeed
        self.num_consecutive_failures = 0
        self._resume_at = 0.0
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, tuple[int, str]] = {}      # cause -> (failures not logged, the last message)

    def allows(self) -> bool:
        return self.clock() >= self._resume_at

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        if now >= self._resume_at:
            self.delay_s = min(self.max_delay_s, max(self.min_delay_s, 2 * self.delay_s))
            self._resume_at = now + self.delay_s
        self.num_consecutive_failures += 1
        cause = errno.errorcode.get(exc.errno, type(exc).__name__) if isinstance(exc, OSError) else type(exc).__name__
        if now - self._logged_at.get(cause, -float("inf")) >= self.log_interval_s:
            self._logged_at[cause] = now
            logger.warning("L3 write-through failed (%s): %s; write-throughs paused for %.1f s, the pause doubling "
                           "up to %.0f s while they fail (further failures are counted: h2s_failures)", cause, exc,
                           self.delay_s, self.max_delay_s)
        else:
            count, _ = self._unlogged.get(cause, (0, ""))
            self._unlogged[cause] = (count + 1, str(exc))
        self._flush(now, all_causes=False)

    def succeeded(self) -> None:
        if self.num_consecutive_failures:
            self._flush(self.clock(), all_causes=True)
            logger.warning("L3 write-throughs succeed again after %d failures", self.num_consecutive_failures)
        self.delay_s = 0.0
        self.num_consecutive_failures = 0
        self._resume_at = 0.0

    def _flush(self, now: float, all_causes: bool) -> None:
        for cause, (count, message) in list(self._unlogged.items()):
            if all_causes or now - self._logged_at[cause] >= self.log_interval_s:
                logger.warning("L3 write-through failed %d more times (%s) in %.0f s, the last: %s; paused for %.1f s",
                               count, cause, now - self._logged_at[cause], message, self.delay_s)
                self._logged_at[cause] = now
                del self._unlogged[cause]


class IoExecutor:
    """A bounded thread pool for blocking file I/O, awaited from asyncio.

    At most `max_workers` jobs run at once; more wait in the pool's queue (callers bound how
    many they submit: every job holds reserved pages). Invariant: when `run` returns or raises,
    its job is finished or will never start — even when the awaiting task is cancelled — so the
    caller may free or publish the job's pages at that point.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "kvcached-io"):
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
        self._max_workers = max_workers
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()
        self._num_inflight = 0  # submitted and not finished (queued or running)
        self._num_running = 0  # in a worker thread now
        self._is_shut_down = False

    @property
    def max_workers(self) -> int:
        return self._max_workers

    @property
    def num_inflight(self) -> int:
        return self._num_inflight

    @property
    def num_running(self) -> int:
        return self._num_running

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        with self._lock:
            self._num_running += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._num_running -= 1

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on a worker thread and return its result (or raise its exception)."""
        if self._is_shut_down:
            raise RuntimeError("IoExecutor is shut down")
        loop = asyncio.get_running_loop()
        with self._lock:
            self._num_inflight += 1
        try:
            # What loop.run_in_executor does, keeping the concurrent future: only its cancel()
            # tells whether the job had started (the asyncio wrapper's cancel always succeeds).
            pool_job = self._pool.submit(self._call, fn, args)
            job = asyncio.wrap_future(pool_job, loop=loop)
            try:
                # shield: a cancelled caller must not cancel a job that is already running.
                return await asyncio.shield(job)
            except asyncio.CancelledError:
                if pool_job.done() or pool_job.cancel():
                    raise  # finished, or cancelled before it started: nothing touches the pages
                # The job runs on: wait it out so the caller never frees pages under a live copy.
                while not job.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([job])
                if not job.cancelled() and job.exception() is not None:
                    logger.warning("I/O job %r failed after its caller was cancelled: %r", fn, job.exception())
                raise
        finally:
            with self._lock:
                self._num_inflight -= 1

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new jobs; queued jobs still run. With `wait`, block until all jobs finished
        (this blocks the calling thread, the event loop if called from it)."""
        self._is_shut_down = True
        self._pool.shutdown(wait=wait)

    def check_integrity(self) -> None:
        with self._lock:
            num_inflight, num_running = self._num_inflight, self._num_running
        if not 0 <= num_running <= min(num_inflight, self._max_workers):
            raise AssertionError(
                f"IoExecutor counts broken: {num_running} running, {num_inflight} in flight, "
                f"{self._max_workers} workers"
            )
