"""Tests for the L3 I/O layer: page moves between an mmap'ed arena and the storage file, faults,
the storage file's life cycle, and the I/O thread pool."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import random
import stat
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import pytest

from kvcached.core.storage import SlotLayout
from kvcached.server import io_workers
from kvcached.server.io_workers import (
    IoExecutor,
    IoResult,
    ShortReadError,
    read_pages,
    write_pages,
)
from kvcached.server.storage_file import StorageFile

BYTES_PER_PAGE = 8192  # a multiple of 4096, so the same geometry works with O_DIRECT
NUM_ARENA_PAGES = 32
LAYOUT = SlotLayout(bytes_per_page=BYTES_PER_PAGE, num_slots=24)
FILE_SIZE_BYTES = LAYOUT.size_bytes + 4096


class Arena:
    """An L2 arena like the daemon's: a shared-memory file, mmap'ed, full of fresh random bytes."""

    def __init__(self, num_pages: int = NUM_ARENA_PAGES, bytes_per_page: int = BYTES_PER_PAGE):
        self.bytes_per_page = bytes_per_page
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="kvcached-test-arena-", dir=shm_dir)
        try:
            os.ftruncate(fd, num_pages * bytes_per_page)
            self.mm = mmap.mmap(fd, num_pages * bytes_per_page)
        finally:
            os.close(fd)
        self.mm[:] = random.randbytes(num_pages * bytes_per_page)      # seeded (kvcached/testing/pytest_plugin.py)
        self.view = memoryview(self.mm)

    def page(self, page_id: int) -> bytes:
        return bytes(self.view[page_id * self.bytes_per_page:(page_id + 1) * self.bytes_per_page])

    def close(self) -> None:
        # mmap.close raises BufferError if any view of it is still alive: this also checks that
        # the I/O functions released every slice they took, on success and on error.
        self.view.release()
        self.mm.close()
        os.unlink(self.path)


@pytest.fixture
def arena():
    arena = Arena()
    yield arena
    arena.close()


@pytest.fixture
def storage(tmp_path):
    storage = StorageFile.open(str(tmp_path / "l3.bin"), FILE_SIZE_BYTES)
    storage.check_integrity()
    yield storage
    storage.close()
    storage.check_integrity()


def _open_direct_or_skip(path: str, size_bytes: int = FILE_SIZE_BYTES) -> StorageFile:
    try:
        return StorageFile.open(path, size_bytes, o_direct=True)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip(f"no O_DIRECT on the file system of {path}")
        raise


def _file_bytes(path: str, offset: int, num_bytes: int) -> bytes:
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(num_bytes)


def _roundtrip(storage: StorageFile, arena: Arena, src_page_ids, slot_ids, dst_page_ids):
    """Write src pages to slots, read the slots into dst pages; return both IoResults."""
    expected = [arena.page(page_id) for page_id in src_page_ids]
    # The destination pages must differ before the read, or equality afterwards proves nothing.
    assert all(arena.page(dst) != page for dst, page in zip(dst_page_ids, expected))
    write_result = write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, src_page_ids, slot_ids)
    storage.check_integrity()
    read_result = read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, slot_ids, dst_page_ids)
    storage.check_integrity()
    for dst, page in zip(dst_page_ids, expected):
        assert arena.page(dst) == page, f"L2 page {dst} differs from its source after the round trip"
    return write_result, read_result


def test_contiguous_roundtrip_is_bit_exact_in_one_extent(storage, arena):
    """8 contiguous pages -> 8 contiguous slots -> 8 other contiguous pages: bit-exact, 1 extent each way."""
    write_result, read_result = _roundtrip(storage, arena, list(range(0, 8)), list(range(8, 16)),
                                           list(range(16, 24)))
    assert write_result.num_extents == 1 and read_result.num_extents == 1
    assert write_result.num_bytes == read_result.num_bytes == 8 * BYTES_PER_PAGE


def test_fragmented_roundtrip_is_bit_exact_with_one_extent_per_page(storage, arena):
    """Alternating source pages into consecutive slots, read back into alternating other pages: 8 extents each way."""
    write_result, read_result = _roundtrip(storage, arena, list(range(0, 16, 2)), list(range(8)),
                                           list(range(17, 33, 2)))
    assert write_result.num_extents == 8 and read_result.num_extents == 8


def test_random_page_maps_roundtrip_bit_exact(tmp_path, seed):
    """Random permutations of pages and slots (mixed runs) round-trip bit for bit into different pages."""
    rng = random.Random(seed)
    for _ in range(5):
        arena = Arena()
        try:
            with StorageFile.open(str(tmp_path / "l3.bin"), FILE_SIZE_BYTES) as storage:
                num_pages = rng.randrange(1, NUM_ARENA_PAGES // 2 + 1)
                page_ids = rng.sample(range(NUM_ARENA_PAGES), 2 * num_pages)
                src_page_ids, dst_page_ids = page_ids[:num_pages], page_ids[num_pages:]
                if rng.random() < 0.5:  # sometimes long runs, to mix merged and single extents
                    src_page_ids.sort()
                slot_ids = rng.sample(range(LAYOUT.num_slots), num_pages)
                _roundtrip(storage, arena, src_page_ids, slot_ids, dst_page_ids)
        finally:
            arena.close()


def test_slots_land_at_their_layout_offsets(storage, arena):
    """After write_pages, the file holds page i's bytes exactly at layout.offset(slot i)."""
    src_page_ids, slot_ids = [5, 6, 30], [23, 0, 11]
    write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, src_page_ids, slot_ids)
    for page_id, slot in zip(src_page_ids, slot_ids):
        assert _file_bytes(storage.path, LAYOUT.offset(slot), BYTES_PER_PAGE) == arena.page(page_id)
    storage.check_integrity()


def test_open_discards_old_content_sets_size_and_mode(tmp_path):
    """Opening an existing file of the daemon's (0600) empties it and sizes it exactly; a new one
    is made 0600 whatever the umask."""
    path = tmp_path / "old.bin"
    path.write_bytes(random.randbytes(3 * FILE_SIZE_BYTES))
    os.chmod(path, 0o600)
    old_umask = os.umask(0)
    try:
        with StorageFile.open(str(tmp_path / "new.bin"), FILE_SIZE_BYTES):
            assert stat.S_IMODE(os.stat(tmp_path / "new.bin").st_mode) == 0o600
    finally:
        os.umask(old_umask)
    with StorageFile.open(str(path), FILE_SIZE_BYTES) as storage:
        assert os.path.getsize(path) == FILE_SIZE_BYTES
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert _file_bytes(str(path), 0, FILE_SIZE_BYTES) == bytes(FILE_SIZE_BYTES)
        storage.check_integrity()


def test_temp_file_has_no_name_while_open_and_close_is_idempotent(tmp_path):
    """Without a path, the temp file in temp_dir is 0600 and sized, and its name is removed as soon as it
    is open (so no exit path, SIGKILL included, leaves it behind); close twice is fine."""
    storage = StorageFile.open(None, FILE_SIZE_BYTES, temp_dir=str(tmp_path))
    assert storage.is_temporary and os.path.dirname(storage.path) == str(tmp_path)
    assert not os.path.exists(storage.path) and os.listdir(tmp_path) == []
    info = os.fstat(storage.io_fd)
    assert info.st_size == FILE_SIZE_BYTES and stat.S_IMODE(info.st_mode) == 0o600
    storage.check_integrity()
    storage.close()
    storage.close()
    assert storage.closed
    storage.check_integrity()


def test_sigkilled_owner_leaves_no_temp_file(tmp_path):
    """A process killed with SIGKILL while holding a temporary L3 file leaves nothing in temp_dir."""
    code = (
        "import os, signal\n"
        "from kvcached.server.storage_file import StorageFile\n"
        f"storage = StorageFile.open(None, 4096, temp_dir={str(tmp_path)!r})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=60)
    assert result.returncode == -9, result.stderr
    assert os.listdir(tmp_path) == []


def test_temp_file_is_removed_at_interpreter_exit(tmp_path):
    """A temp file never closed is removed when the interpreter exits."""
    code = (
        "from kvcached.server.storage_file import StorageFile\n"
        f"storage = StorageFile.open(None, 4096, temp_dir={str(tmp_path)!r})\n"
        "print(storage.path)\n"
    )
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True,
                            timeout=60, check=True)
    path = result.stdout.strip()
    assert path.startswith(str(tmp_path))
    assert not os.path.exists(path)


def test_short_read_on_truncated_file_raises(storage, arena):
    """A file truncated underneath (mid-slot and before a slot) makes read_pages raise ShortReadError."""
    write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, list(range(8)), list(range(8)))
    os.truncate(storage.path, LAYOUT.offset(5) + BYTES_PER_PAGE // 2)  # cuts slot 5 in half
    with pytest.raises(AssertionError, match="changed underneath"):
        storage.check_integrity()
    with pytest.raises(ShortReadError) as excinfo:
        read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, list(range(8)), list(range(16, 24)))
    assert excinfo.value.read_bytes == 5 * BYTES_PER_PAGE + BYTES_PER_PAGE // 2
    assert excinfo.value.expected_bytes == 8 * BYTES_PER_PAGE
    with pytest.raises(ShortReadError):  # a slot wholly past the end: the first read returns 0 bytes
        read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [7], [25])
    assert storage.num_inflight_io == 0
    os.truncate(storage.path, FILE_SIZE_BYTES)  # restore, so the fixture's closing check passes
    storage.check_integrity()


def test_read_after_unlink_still_returns_the_data(tmp_path, arena):
    """A file unlinked underneath keeps its data for the open descriptor, and close still succeeds."""
    storage = StorageFile.open(str(tmp_path / "l3.bin"), FILE_SIZE_BYTES)
    os.unlink(storage.path)
    _roundtrip(storage, arena, [1, 2, 3], [4, 5, 6], [10, 12, 14])
    storage.close()
    storage.check_integrity()


def test_zero_byte_write_raises_enospc(storage, arena, monkeypatch):
    """pwrite reporting 0 bytes written raises OSError(ENOSPC)."""
    monkeypatch.setattr(io_workers, "_pwrite", lambda fd, data, offset: 0)
    with pytest.raises(OSError) as excinfo:
        write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0, 1], [0, 1])
    assert excinfo.value.errno == errno.ENOSPC
    assert storage.num_inflight_io == 0
    storage.check_integrity()


@pytest.mark.parametrize("error_number", [errno.ENOSPC, errno.EIO])
def test_write_errors_propagate(storage, arena, monkeypatch, error_number):
    """An OSError from pwrite (disk full, I/O error) reaches the caller with its errno."""
    def failing_pwrite(fd, data, offset):
        raise OSError(error_number, os.strerror(error_number))

    monkeypatch.setattr(io_workers, "_pwrite", failing_pwrite)
    with pytest.raises(OSError) as excinfo:
        write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0], [0])
    assert excinfo.value.errno == error_number
    assert storage.num_inflight_io == 0
    storage.check_integrity()


def test_read_io_error_propagates(storage, arena, monkeypatch):
    """An EIO from preadv reaches the caller as OSError(EIO)."""
    write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0], [0])

    def failing_preadv(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(io_workers, "_preadv", failing_preadv)
    with pytest.raises(OSError) as excinfo:
        read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0], [1])
    assert excinfo.value.errno == errno.EIO
    assert storage.num_inflight_io == 0
    storage.check_integrity()


def test_partial_transfers_are_continued(storage, arena, monkeypatch):
    """When pwrite and preadv move at most 1000 bytes per call, the loops still move every byte."""
    real_pwrite, real_preadv = os.pwrite, os.preadv
    num_calls = {"pwrite": 0, "preadv": 0}

    def short_pwrite(fd, data, offset):
        num_calls["pwrite"] += 1
        return real_pwrite(fd, data[:1000], offset)

    def short_preadv(fd, buffers, offset):
        num_calls["preadv"] += 1
        return real_preadv(fd, [buffers[0][:1000]], offset)

    monkeypatch.setattr(io_workers, "_pwrite", short_pwrite)
    monkeypatch.setattr(io_workers, "_preadv", short_preadv)
    _roundtrip(storage, arena, [0, 1, 9], [2, 3, 20], [12, 13, 30])
    num_bytes = 3 * BYTES_PER_PAGE
    assert num_calls["pwrite"] >= num_bytes // 1000 and num_calls["preadv"] >= num_bytes // 1000


def test_injected_short_read_raises_and_reports_progress(storage, arena, monkeypatch):
    """A read that stops early (part of the bytes, then end of file) raises ShortReadError with the bytes read."""
    write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0, 1], [0, 1])
    real_preadv = os.preadv
    calls = []

    def truncating_preadv(fd, buffers, offset):
        calls.append(offset)
        if len(calls) > 1:
            return 0  # end of file
        return real_preadv(fd, [buffers[0][:4096]], offset)

    monkeypatch.setattr(io_workers, "_preadv", truncating_preadv)
    with pytest.raises(ShortReadError) as excinfo:
        read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0, 1], [10, 11])
    assert excinfo.value.read_bytes == 4096 and excinfo.value.offset == LAYOUT.offset(0)
    storage.check_integrity()


def test_bad_input_raises_before_any_byte_moves(storage, arena):
    """Out-of-range ids, mismatched page sizes, slots past the file end and repeated destinations
    raise ValueError, and the file is untouched (the valid first pages were not written)."""
    before = _file_bytes(storage.path, 0, FILE_SIZE_BYTES)
    bad_calls = [
        ([0, 1], [0, LAYOUT.num_slots]),                # slot out of range, last in the map
        ([0, NUM_ARENA_PAGES], [0, 1]),                 # L2 page out of range
        ([0, 1], [3, 3]),                               # two pages into one slot
    ]
    for l2_page_ids, slot_ids in bad_calls:
        with pytest.raises(ValueError):
            write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, l2_page_ids, slot_ids)
    with pytest.raises(ValueError, match="bytes_per_page"):
        write_pages(storage, LAYOUT, arena.view, 4096, [0], [0])
    too_big = SlotLayout(bytes_per_page=BYTES_PER_PAGE, num_slots=FILE_SIZE_BYTES // BYTES_PER_PAGE + 1)
    with pytest.raises(ValueError, match="past the file"):
        write_pages(storage, too_big, arena.view, BYTES_PER_PAGE, [0], [0])
    assert _file_bytes(storage.path, 0, FILE_SIZE_BYTES) == before
    storage.check_integrity()


def test_read_refuses_bad_destinations(storage, arena):
    """read_pages refuses a read-only arena and two slots into one L2 page, leaving the arena unchanged."""
    write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0, 1], [0, 1])
    arena_before = bytes(arena.view)
    with memoryview(bytes(arena.view)) as read_only_view:
        with pytest.raises(ValueError, match="writable"):
            read_pages(storage, LAYOUT, read_only_view, BYTES_PER_PAGE, [0], [5])
    with pytest.raises(ValueError, match="repeat"):
        read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0, 1], [5, 5])
    assert bytes(arena.view) == arena_before
    storage.check_integrity()


def test_closed_storage_refuses_io(tmp_path, arena):
    """After close, page I/O raises ValueError instead of touching a stale descriptor."""
    storage = StorageFile.open(str(tmp_path / "l3.bin"), FILE_SIZE_BYTES)
    storage.close()
    with pytest.raises(ValueError, match="closed"):
        write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0], [0])
    with pytest.raises(ValueError, match="closed"):
        read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0], [1])
    storage.check_integrity()


def test_close_waits_for_io_in_flight(storage, arena, monkeypatch):
    """close() does not close the descriptor under a running pwrite: it times out while one runs, succeeds after."""
    started, release = threading.Event(), threading.Event()
    real_pwrite = os.pwrite

    def blocking_pwrite(fd, data, offset):
        started.set()
        assert release.wait(10)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(io_workers, "_pwrite", blocking_pwrite)
    results = []
    writer = threading.Thread(target=lambda: results.append(
        write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0], [0])))
    writer.start()
    assert started.wait(10)
    with pytest.raises(TimeoutError, match="in flight"):
        storage.close(timeout_s=0.05)
    assert not storage.closed and storage.num_inflight_io == 1
    storage.check_integrity()
    with pytest.raises(ValueError, match="closed"):  # closing already refuses new I/O
        write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [1], [1])
    release.set()
    storage.close(timeout_s=10)
    writer.join(10)
    assert storage.closed and len(results) == 1 and results[0].num_bytes == BYTES_PER_PAGE


def test_o_direct_roundtrip_is_bit_exact(tmp_path, arena):
    """With O_DIRECT, fragmented and contiguous maps round-trip bit for bit."""
    with _open_direct_or_skip(str(tmp_path / "l3.bin")) as storage:
        _roundtrip(storage, arena, [0, 2, 4, 5, 6], [0, 1, 2, 3, 4], [20, 21, 22, 23, 24])
        _roundtrip(storage, arena, [8, 9, 10], [10, 12, 11], [1, 3, 7])
        storage.check_integrity()


def test_o_direct_short_read_on_unaligned_truncation_raises(tmp_path, arena):
    """With O_DIRECT, a file truncated mid-slot at an unaligned size raises ShortReadError."""
    with _open_direct_or_skip(str(tmp_path / "l3.bin")) as storage:
        write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0, 1], [0, 1])
        os.truncate(storage.path, LAYOUT.offset(1) + 1000)
        with pytest.raises(ShortReadError):
            read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0, 1], [10, 11])
        os.truncate(storage.path, FILE_SIZE_BYTES)
        storage.check_integrity()


def test_o_direct_alignment_is_validated(tmp_path, arena):
    """O_DIRECT refuses an unaligned file size, page size or arena address with ValueError."""
    with pytest.raises(ValueError, match="multiple of 4096"):
        StorageFile.open(str(tmp_path / "odd.bin"), FILE_SIZE_BYTES + 512, o_direct=True)
    with _open_direct_or_skip(str(tmp_path / "l3.bin")) as storage:
        odd_page = SlotLayout(bytes_per_page=4096 + 512, num_slots=4)
        with pytest.raises(ValueError, match="bytes_per_page"):
            write_pages(storage, odd_page, arena.view, 4096 + 512, [0], [0])
        with arena.view[512:512 + 4 * BYTES_PER_PAGE] as unaligned_arena:
            with pytest.raises(ValueError, match="address"):
                write_pages(storage, LAYOUT, unaligned_arena, BYTES_PER_PAGE, [0], [0])
        storage.check_integrity()
    # The same unaligned arena is fine without O_DIRECT.
    with StorageFile.open(str(tmp_path / "buffered.bin"), FILE_SIZE_BYTES) as storage:
        expected = bytes(arena.view[512:512 + BYTES_PER_PAGE])
        with arena.view[512:512 + 4 * BYTES_PER_PAGE] as unaligned_arena:
            write_pages(storage, LAYOUT, unaligned_arena, BYTES_PER_PAGE, [0], [0])
        assert _file_bytes(storage.path, LAYOUT.offset(0), BYTES_PER_PAGE) == expected


# --- IoExecutor ---------------------------------------------------------------------------


def test_executor_runs_jobs_off_the_loop_thread():
    """run() executes the job on a worker thread, returns its result and re-raises its exception."""
    async def main():
        executor = IoExecutor(max_workers=2)
        try:
            loop_thread_id = threading.get_ident()
            job_thread_id = await executor.run(threading.get_ident)
            assert job_thread_id != loop_thread_id
            assert await executor.run(divmod, 17, 5) == (3, 2)
            with pytest.raises(ZeroDivisionError):
                await executor.run(divmod, 1, 0)
            assert executor.num_inflight == 0
            executor.check_integrity()
        finally:
            executor.shutdown()

    asyncio.run(main())


def test_executor_bounds_concurrency():
    """With max_workers=2 and 6 blocked jobs, exactly 2 run and all 6 are counted in flight until released."""
    async def main():
        executor = IoExecutor(max_workers=2)
        release = threading.Event()
        lock = threading.Lock()
        num_running = [0]
        max_num_running = [0]

        def job(index):
            with lock:
                num_running[0] += 1
                max_num_running[0] = max(max_num_running[0], num_running[0])
            assert release.wait(10)
            with lock:
                num_running[0] -= 1
            return index

        try:
            tasks = [asyncio.ensure_future(executor.run(job, index)) for index in range(6)]
            deadline = time.monotonic() + 10
            while executor.num_running < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)  # room for a third job to start, if the bound were broken
            assert executor.num_running == 2 and max_num_running[0] == 2
            assert executor.num_inflight == 6
            executor.check_integrity()
            release.set()
            assert await asyncio.gather(*tasks) == list(range(6))
            assert max_num_running[0] == 2
            assert executor.num_inflight == 0 and executor.num_running == 0
            executor.check_integrity()
        finally:
            release.set()
            executor.shutdown()

    asyncio.run(main())


def test_cancelled_caller_of_a_running_job_waits_for_it():
    """Cancelling the task awaiting a running job does not end the task until the job has finished."""
    async def main():
        executor = IoExecutor(max_workers=1)
        started, release, finished = threading.Event(), threading.Event(), threading.Event()

        def job():
            started.set()
            assert release.wait(10)
            finished.set()

        try:
            task = asyncio.ensure_future(executor.run(job))
            while not started.is_set():
                await asyncio.sleep(0.005)
            task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done()  # the job still runs: the caller must not reuse its pages yet
            assert executor.num_inflight == 1
            executor.check_integrity()
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert finished.is_set()
            assert executor.num_inflight == 0
            executor.check_integrity()
        finally:
            release.set()
            executor.shutdown()

    asyncio.run(main())


def test_cancelled_queued_job_never_runs():
    """Cancelling the caller of a job still queued ends the caller at once, and the job never runs."""
    async def main():
        executor = IoExecutor(max_workers=1)
        started, release = threading.Event(), threading.Event()
        queued_job_ran = threading.Event()

        def blocker():
            started.set()
            assert release.wait(10)

        try:
            blocking_task = asyncio.ensure_future(executor.run(blocker))
            while not started.is_set():
                await asyncio.sleep(0.005)
            queued_task = asyncio.ensure_future(executor.run(queued_job_ran.set))
            await asyncio.sleep(0.01)
            assert executor.num_inflight == 2
            queued_task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued_task
            assert executor.num_inflight == 1
            executor.check_integrity()
            release.set()
            await blocking_task
            executor.shutdown(wait=True)
            assert not queued_job_ran.is_set()
            executor.check_integrity()
        finally:
            release.set()
            executor.shutdown()

    asyncio.run(main())


def test_shut_down_executor_refuses_jobs():
    """After shutdown, run() raises RuntimeError."""
    async def main():
        executor = IoExecutor(max_workers=1)
        executor.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            await executor.run(time.monotonic)
        executor.check_integrity()

    asyncio.run(main())


def test_invalid_max_workers_raises():
    """A pool needs at least one worker."""
    with pytest.raises(ValueError):
        IoExecutor(max_workers=0)


async def run_all(executor: IoExecutor, move, storage, arena, pairs, timeout_s: float = 30.0) -> list:
    """``move`` (write_pages or read_pages) of each (sources, targets) pair of page ids, all at once
    on the executor; their results, within timeout_s (a deadlock fails the test, not hangs it)."""
    jobs = [executor.run(move, storage, LAYOUT, arena.view, BYTES_PER_PAGE, list(sources), list(targets))
            for sources, targets in pairs]
    return await asyncio.wait_for(asyncio.gather(*jobs), timeout=timeout_s)


def test_concurrent_reads_and_writes_through_the_executor(storage, arena):
    """Writes and reads of disjoint slots run concurrently on the pool and every page arrives bit-exact."""
    async def main():
        executor = IoExecutor(max_workers=4)
        try:
            expected = {dst: arena.page(src) for src, dst in zip(range(0, 12), range(12, 24))}
            write_results = await run_all(executor, write_pages, storage, arena,
                                          [([src], [slot]) for src, slot in zip(range(0, 12), range(12))])
            assert all(isinstance(result, IoResult) and result.num_extents == 1 for result in write_results)
            await run_all(executor, read_pages, storage, arena,
                          [([slot], [dst]) for slot, dst in zip(range(12), range(12, 24))])
            assert {dst: arena.page(dst) for dst in expected} == expected
            executor.check_integrity()
        finally:
            executor.shutdown()

    asyncio.run(main())
    storage.check_integrity()


def test_keep_content_keeps_the_bytes_below_both_sizes(tmp_path):
    """Reopened with keep_content, a file keeps its bytes below the smaller of its old and new size
    (kept_content_bytes says how many); reopened without it, nothing of before is left."""
    path = str(tmp_path / "l3.bin")
    old = os.urandom(3 * 4096)
    with StorageFile.open(path, 3 * 4096) as storage:
        os.pwrite(storage.io_fd, old, 0)
    with StorageFile.open(path, 2 * 4096, keep_content=True) as storage:
        assert storage.kept_content_bytes == 2 * 4096
        assert os.pread(storage.io_fd, 2 * 4096, 0) == old[:2 * 4096]
    with StorageFile.open(path, 4 * 4096, keep_content=True) as storage:
        assert storage.kept_content_bytes == 2 * 4096
        assert os.pread(storage.io_fd, 4 * 4096, 0) == old[:2 * 4096] + bytes(2 * 4096)
    with StorageFile.open(path, 2 * 4096) as storage:
        assert storage.kept_content_bytes == 0
        assert os.pread(storage.io_fd, 2 * 4096, 0) == bytes(2 * 4096)


def test_a_second_open_of_a_named_l3_file_is_refused(tmp_path):
    """While one StorageFile has a named file open, another open of it fails with EBUSY (two
    daemons would overwrite each other's slots); once closed, it opens again."""
    path = str(tmp_path / "l3.bin")
    with StorageFile.open(path, 4096):
        with pytest.raises(OSError) as raised:
            StorageFile.open(path, 4096, keep_content=True)
        assert raised.value.errno == errno.EBUSY and "another kvcached daemon" in str(raised.value)
    with StorageFile.open(path, 4096, keep_content=True) as storage:
        assert storage.kept_content_bytes == 4096


# --- slices: one job's bytes moved in parallel -------------------------------------------------
# SLICE_BYTES is set to a little over 3 pages (rounded down to 3 whole pages), so the 8-page
# extents of these tests go in slices of 3, 3 and 2 pages.
SLICE_PAGES = 3


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(io_workers, "SLICE_BYTES", SLICE_PAGES * BYTES_PER_PAGE + 100)


def _record_calls(monkeypatch, name: str) -> list[tuple[int, int]]:
    """Wrap io_workers._pwrite or _preadv (the real call); return the (file offset, bytes asked)
    of each call, in the order they were made."""
    real = getattr(io_workers, name)
    calls: list[tuple[int, int]] = []
    lock = threading.Lock()

    def recording(fd, data, offset):
        with lock:
            calls.append((offset, len(data) if name == "_pwrite" else len(data[0])))
        return real(fd, data, offset)

    monkeypatch.setattr(io_workers, name, recording)
    return calls


def _slot_ranges(first_slot_id: int, num_pages_per_call: list[int]) -> list[tuple[int, int]]:
    ranges, slot_id = [], first_slot_id
    for num_pages in num_pages_per_call:
        ranges.append((LAYOUT.offset(slot_id), num_pages * BYTES_PER_PAGE))
        slot_id += num_pages
    return ranges


def test_long_extent_goes_in_slices_bit_exact(storage, arena, monkeypatch, small_slices):
    """An 8-page extent is written and read in three calls of 3, 3 and 2 whole pages at the right
    offsets, and round-trips bit for bit into other pages; the file holds each page at its slot."""
    writes, reads = _record_calls(monkeypatch, "_pwrite"), _record_calls(monkeypatch, "_preadv")
    write_result, read_result = _roundtrip(storage, arena, list(range(0, 8)), list(range(8, 16)),
                                           list(range(16, 24)))
    expected_calls = _slot_ranges(8, [3, 3, 2])
    assert sorted(writes) == expected_calls and sorted(reads) == expected_calls
    assert write_result.num_extents == read_result.num_extents == 1
    assert write_result.num_bytes == read_result.num_bytes == 8 * BYTES_PER_PAGE
    for page_id, slot_id in zip(range(0, 8), range(8, 16)):
        assert _file_bytes(storage.path, LAYOUT.offset(slot_id), BYTES_PER_PAGE) == arena.page(page_id)


# pages 0-6 -> slots 0-6, page 9 -> slot 10, pages 12-16 -> slots 14-18: slices of 3 pages are
# [0-2] [3-5] [6, 9, 12] [13-15] [16], in 7 calls.
SEVERAL_SRC_PAGE_IDS = [0, 1, 2, 3, 4, 5, 6, 9, 12, 13, 14, 15, 16]
SEVERAL_SLOT_IDS = [0, 1, 2, 3, 4, 5, 6, 10, 14, 15, 16, 17, 18]
SEVERAL_DST_PAGE_IDS = [17, 18, 19, 20, 21, 22, 23, 25, 26, 27, 28, 29, 30]
SEVERAL_CALLS = sorted(_slot_ranges(0, [3, 3, 1]) + _slot_ranges(10, [1]) + _slot_ranges(14, [1, 3, 1]))


def test_several_extents_go_in_slices_bit_exact(storage, arena, monkeypatch, small_slices):
    """Three extents (7, 1 and 5 pages) move in calls of at most 3 whole pages each, every slot byte
    once, and round-trip bit for bit."""
    writes, reads = _record_calls(monkeypatch, "_pwrite"), _record_calls(monkeypatch, "_preadv")
    write_result, read_result = _roundtrip(storage, arena, SEVERAL_SRC_PAGE_IDS, SEVERAL_SLOT_IDS,
                                           SEVERAL_DST_PAGE_IDS)
    assert sorted(writes) == SEVERAL_CALLS and sorted(reads) == SEVERAL_CALLS
    assert write_result.num_extents == read_result.num_extents == 3


def test_sliced_checksums_are_per_page_in_order(tmp_path, monkeypatch):
    """With checksums, a sliced job returns the crc32 of each page moved in the order of its page map,
    the same list as the one-thread path (slices larger than the job), on writes and on reads."""
    results = {}
    arena_bytes = random.randbytes(NUM_ARENA_PAGES * BYTES_PER_PAGE)  # the same bytes for both slice sizes
    for slice_bytes in (SLICE_PAGES * BYTES_PER_PAGE, 1 << 30):
        monkeypatch.setattr(io_workers, "SLICE_BYTES", slice_bytes)
        reads = _record_calls(monkeypatch, "_preadv")
        arena = Arena()
        arena.mm[:] = arena_bytes
        try:
            with StorageFile.open(str(tmp_path / f"l3-{slice_bytes}.bin"), FILE_SIZE_BYTES) as storage:
                expected = [zlib.crc32(arena.page(page_id)) for page_id in SEVERAL_SRC_PAGE_IDS]
                written = write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, SEVERAL_SRC_PAGE_IDS,
                                      SEVERAL_SLOT_IDS, checksum=True)
                read = read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, SEVERAL_SLOT_IDS,
                                  SEVERAL_DST_PAGE_IDS, checksum=True)
                assert list(written.page_checksums) == list(read.page_checksums) == expected
                results[slice_bytes] = (list(read.page_checksums), len(reads))
        finally:
            arena.close()
        monkeypatch.undo()
    (sliced, num_sliced_calls), (whole, num_whole_calls) = results.values()
    assert sliced == whole
    assert (num_sliced_calls, num_whole_calls) == (len(SEVERAL_CALLS), 3)  # 7 slices' calls, one per extent


def test_slices_of_one_job_run_at_once(storage, arena, monkeypatch):
    """The two slices of a 4-page extent (slices of 2 pages) are read by two threads at the same time:
    each waits in its read for the other to arrive."""
    if io_workers.NUM_SLICE_THREADS < 2:
        pytest.skip("one CPU: the slice pool has one thread")
    monkeypatch.setattr(io_workers, "SLICE_BYTES", 2 * BYTES_PER_PAGE)
    write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0, 1, 2, 3], [0, 1, 2, 3])
    both_in_read = threading.Barrier(2, timeout=10)  # broken (and the read fails) if the slices ran one by one
    real_preadv = os.preadv
    thread_ids = set()

    def meeting_preadv(fd, buffers, offset):
        thread_ids.add(threading.get_ident())
        both_in_read.wait()
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(io_workers, "_preadv", meeting_preadv)
    expected = [arena.page(page_id) for page_id in range(4)]
    read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0, 1, 2, 3], [10, 11, 12, 13])
    assert len(thread_ids) == 2
    assert [arena.page(page_id) for page_id in range(10, 14)] == expected


def test_short_read_in_the_middle_slice_raises(storage, arena, monkeypatch, small_slices):
    """A read of the middle slice that ends early (half a page, then end of file) raises
    ShortReadError for that slice, and no slice reads on after read_pages raised."""
    write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, list(range(8)), list(range(8)))
    real_preadv = os.preadv
    middle_offset = LAYOUT.offset(SLICE_PAGES)
    lock = threading.Lock()
    num_in_read = [0]

    def short_middle_preadv(fd, buffers, offset):
        with lock:
            num_in_read[0] += 1
        try:
            if offset == middle_offset:
                return real_preadv(fd, [buffers[0][:BYTES_PER_PAGE // 2]], offset)
            if middle_offset < offset < LAYOUT.offset(2 * SLICE_PAGES):
                return 0  # the rest of the middle slice: end of file
            return real_preadv(fd, buffers, offset)
        finally:
            with lock:
                num_in_read[0] -= 1

    monkeypatch.setattr(io_workers, "_preadv", short_middle_preadv)
    with pytest.raises(ShortReadError) as excinfo:
        read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, list(range(8)), list(range(16, 24)))
    assert num_in_read[0] == 0
    assert excinfo.value.offset == middle_offset
    assert excinfo.value.expected_bytes == SLICE_PAGES * BYTES_PER_PAGE
    assert excinfo.value.read_bytes == BYTES_PER_PAGE // 2
    assert storage.num_inflight_io == 0
    storage.check_integrity()


@pytest.mark.parametrize("name", ["_preadv", "_pwrite"])
def test_io_error_in_one_slice_raises_after_every_slice_ended(storage, arena, monkeypatch, name):
    """An EIO in the second of two slices raises OSError(EIO) from the job, and only after the first
    slice, still in its system call when the second failed, has ended."""
    monkeypatch.setattr(io_workers, "SLICE_BYTES", 2 * BYTES_PER_PAGE)
    write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0, 1, 2, 3], [0, 1, 2, 3])
    real = getattr(io_workers, name)
    first_slice_in_call, job_ended = threading.Event(), threading.Event()
    events = []

    def failing_second_slice(fd, data, offset):
        if offset == LAYOUT.offset(2):
            assert first_slice_in_call.wait(10)
            events.append("second slice failed")
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        first_slice_in_call.set()
        # Still in the call when the second slice fails; a job that ended at that error would end
        # this wait at once. One that waits for this slice ends the wait by its bound.
        events.append("job ended under the first slice" if job_ended.wait(0.5) else "first slice ended")
        return real(fd, data, offset)

    monkeypatch.setattr(io_workers, name, failing_second_slice)
    with pytest.raises(OSError) as excinfo:
        if name == "_preadv":
            read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [0, 1, 2, 3], [10, 11, 12, 13])
        else:
            write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, [4, 5, 6, 7], [0, 1, 2, 3])
    job_ended.set()
    assert excinfo.value.errno == errno.EIO
    assert events == ["second slice failed", "first slice ended"]
    assert storage.num_inflight_io == 0
    storage.check_integrity()


def test_measured_seconds_cover_every_slice(storage, arena, monkeypatch, small_slices):
    """IoResult.seconds is the whole job's time: a last slice that takes 50 ms makes it at least 50 ms."""
    write_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, list(range(8)), list(range(8)))
    real_preadv = os.preadv
    last_slice_offset = LAYOUT.offset(2 * SLICE_PAGES)

    def slow_last_preadv(fd, buffers, offset):
        if offset == last_slice_offset:
            time.sleep(0.05)  # a lower bound on the job's time, not a wait for anything
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(io_workers, "_preadv", slow_last_preadv)
    result = read_pages(storage, LAYOUT, arena.view, BYTES_PER_PAGE, list(range(8)), list(range(16, 24)))
    assert result.seconds >= 0.05


def test_o_direct_sliced_roundtrip_is_bit_exact(tmp_path, arena, monkeypatch, small_slices):
    """With O_DIRECT, extents cut into slices at whole pages round-trip bit for bit (aligned offsets)."""
    reads = _record_calls(monkeypatch, "_preadv")
    with _open_direct_or_skip(str(tmp_path / "l3.bin")) as storage:
        _roundtrip(storage, arena, SEVERAL_SRC_PAGE_IDS, SEVERAL_SLOT_IDS, SEVERAL_DST_PAGE_IDS)
        storage.check_integrity()
    assert sorted(reads) == SEVERAL_CALLS


def test_concurrent_sliced_jobs_through_the_executor(storage, arena, small_slices):
    """Jobs of several slices each, run at once on the I/O pool (two writes, then four reads), share
    the slice pool without deadlock (bounded by a timeout) and arrive bit for bit."""
    async def main():
        executor = IoExecutor(max_workers=4)
        try:
            await run_all(executor, write_pages, storage, arena, [(pages, pages) for pages in (range(0, 6), range(6, 12))])
            slot_to_dst = [(range(0, 6), range(12, 18)), (range(6, 12), range(18, 24)),
                           (range(0, 4), range(24, 28)), (range(6, 10), range(28, 32))]
            expected = {dst: arena.page(slot) for slots, dsts in slot_to_dst for slot, dst in zip(slots, dsts)}
            await run_all(executor, read_pages, storage, arena, slot_to_dst)
            assert {dst: arena.page(dst) for dst in expected} == expected
            executor.check_integrity()
        finally:
            executor.shutdown()

    asyncio.run(main())
    storage.check_integrity()
