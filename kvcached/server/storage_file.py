"""The L3 storage file: opened safely (never through a symlink, never another user's file, private
to the daemon's user; ``open_private_file`` opens the L3 index alike), kept or made temporary,
closed once. Page moves use it (``io_workers.py``).

Design notes:
- No fsync. A temporary file's content dies with the process. A file kept across restarts
  (``keep_content``) is described by the daemon's L3 index (``l3_index_store.py``), whose rows
  are written only after a slot's bytes are, each with the crc32 of those bytes: what a crash
  of the machine loses or tears in the file fails that check on read and is never served.
- O_DIRECT (opt-in): reads AND writes go through one O_DIRECT descriptor. L2 already caches L3,
  so a page-cache copy would hold the same bytes twice in host memory, and mixing buffered writes
  with direct reads makes the kernel flush dirty pages before each direct read. A plain
  descriptor is kept beside it for ftruncate/fstat. O_DIRECT needs every offset, length and
  buffer address aligned to DIRECT_IO_ALIGNMENT_BYTES; the L2 arena is page-aligned mmap
  memory, so in practice the condition is on `bytes_per_page` and the region offsets.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import os
import stat
import tempfile
import threading
from typing import Iterator

from proto.paths import file_kind, user_label

logger = logging.getLogger(__name__)

DIRECT_IO_ALIGNMENT_BYTES = 4096
FILE_MODE = 0o600  # the file holds every engine's KV bytes: private to the daemon's user


class UnsafeFileError(ValueError):
    """A path the daemon will not use for its L3 file or index: a symlink, another user's file, one
    that others may read or write, or a directory others may change. The message says what to do."""


def _check_directory(dir_fd: int, directory: str) -> None:
    """Whoever may replace files in the directory could swap ours between a check and an open."""
    info = os.fstat(dir_fd)
    if info.st_uid not in (os.geteuid(), 0):
        raise UnsafeFileError(f"the directory {directory} belongs to {user_label(info.st_uid)}, who could replace "
                              "the L3 files in it: choose a directory of the daemon's user (or root's)")
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise UnsafeFileError(f"the directory {directory} is writable by everyone without the sticky bit: anyone "
                              "could replace the L3 files in it: choose another directory, or chmod o-w it")


def _check_private(info: os.stat_result, path: str) -> None:
    """A regular file of the daemon's user, one link, no access for group or others."""
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        raise UnsafeFileError(f"{path} is {file_kind(info.st_mode)} with {info.st_nlink} links, not a file of "
                              "kvcached's; it is left alone: remove it, or choose another --l3-path")
    if info.st_uid != os.geteuid():
        raise UnsafeFileError(f"{path} belongs to {user_label(info.st_uid)}, not to the daemon's "
                              f"{user_label(os.geteuid())}; kvcached does not adopt another user's file: remove it, "
                              "or choose another --l3-path")
    if info.st_mode & 0o077:
        raise UnsafeFileError(f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: group or others may read or write "
                              f"it, and it holds prompts' tokens and KV; kvcached makes it {FILE_MODE:04o}: chmod "
                              f"{FILE_MODE:o} it if it is the daemon's, or remove it")


def open_private_file(path: str) -> int:
    """Open ``path`` read-write, created 0600 if missing, as a file private to the daemon: through
    its directory, opened and checked first, with O_NOFOLLOW (a symlink is never followed), and
    kept only if it is a regular file of the daemon's effective user, with one link, that group
    and others may neither read nor write. Anything else raises UnsafeFileError, before a byte of
    it is read or written."""
    directory, name = os.path.split(os.path.abspath(path))
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_directory(dir_fd, directory)
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE,
                         dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeFileError(f"{path} is a symlink; kvcached never follows one for its L3 files: remove "
                                      "it, or choose another --l3-path") from None
            raise
    finally:
        os.close(dir_fd)
    try:
        _check_private(os.fstat(fd), path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def same_file(fd: int, path: str) -> bool:
    """``path`` (not followed) is still the file open as fd."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (info.st_dev, info.st_ino) == (opened.st_dev, opened.st_ino)


class StorageFile:
    """The L3 file: a fixed size, sparse until written, content discarded at open unless kept.

    Build with `StorageFile.open`. Thread-safe for concurrent page I/O (pwrite/preadv carry
    their own offsets). `close()` refuses new I/O, then waits for I/O in flight, so a
    descriptor is never closed (and its number reused) under a running transfer.
    """

    def __init__(self, path: str, size_bytes: int, o_direct: bool, fd: int, direct_fd: int | None,
                 is_temporary: bool, kept_content_bytes: int = 0):
        # Private: use StorageFile.open, which owns the failure handling of a half-built file.
        self._path = path
        self._size_bytes = size_bytes
        self._o_direct = o_direct
        self._fd = fd
        self._direct_fd = direct_fd
        self._is_temporary = is_temporary
        self._kept_content_bytes = kept_content_bytes
        self._cond = threading.Condition()
        self._num_inflight_io = 0
        self._closing = False  # new I/O refused
        self._closed = False  # descriptors closed
        if is_temporary:
            atexit.register(self._remove_at_exit)

    @classmethod
    def open(cls, path: str | None, size_bytes: int, o_direct: bool = False,
             temp_dir: str | None = None, keep_content: bool = False) -> StorageFile:
        """Create or open `path` (mode 0600, locked against a second daemon) and size it to
        exactly `size_bytes`, discarding old content unless `keep_content` (then the bytes below
        both sizes stay: `kept_content_bytes`). Without a path, a temporary file in `temp_dir`
        (default: the system temp dir) whose name is removed as soon as it is open (nothing is
        left behind, whatever the exit)."""
        if not isinstance(size_bytes, int) or size_bytes <= 0:
            raise ValueError(f"size_bytes must be a positive int, got {size_bytes!r}")
        if o_direct and size_bytes % DIRECT_IO_ALIGNMENT_BYTES:
            raise ValueError(
                f"size_bytes {size_bytes} is not a multiple of {DIRECT_IO_ALIGNMENT_BYTES}, which O_DIRECT needs"
            )
        is_temporary = path is None
        if is_temporary:
            fd, path = tempfile.mkstemp(prefix="kvcached-l3-", suffix=".bin", dir=temp_dir)  # mode 0600
        else:
            fd = open_private_file(path)    # never through a symlink, never another user's file
        direct_fd = None
        kept_content_bytes = 0
        try:
            if not is_temporary:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)     # released when fd closes
                except BlockingIOError:
                    raise OSError(errno.EBUSY, "another kvcached daemon uses this L3 file", path) from None
            if keep_content and not is_temporary:
                kept_content_bytes = min(os.fstat(fd).st_size, size_bytes)
            else:
                # Truncate to 0 first so no byte of a previous run survives below size_bytes.
                os.ftruncate(fd, 0)
            os.ftruncate(fd, size_bytes)
            if o_direct:
                try:
                    direct_fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError as exc:
                    if exc.errno == errno.EINVAL:
                        raise OSError(exc.errno, "the file system does not support O_DIRECT", path) from exc
                    raise
                if not same_file(direct_fd, path) or not same_file(fd, path):
                    raise UnsafeFileError(f"{path} was replaced while the daemon opened it")
        except BaseException:
            if direct_fd is not None:
                os.close(direct_fd)
            os.close(fd)
            if is_temporary:
                _unlink_quietly(path)
            raise
        if is_temporary:
            # The name goes at once: the open descriptors keep the file, and even a daemon killed
            # with SIGKILL leaves nothing behind.
            _unlink_quietly(path)
        logger.info("L3 file %s: %d bytes (%d kept from before), o_direct=%s, temporary=%s", path, size_bytes,
                    kept_content_bytes, o_direct, is_temporary)
        return cls(path, size_bytes, o_direct, fd, direct_fd, is_temporary, kept_content_bytes)

    @property
    def path(self) -> str:
        return self._path

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    @property
    def o_direct(self) -> bool:
        return self._o_direct

    @property
    def is_temporary(self) -> bool:
        return self._is_temporary

    @property
    def kept_content_bytes(self) -> int:
        """Bytes at the file's start that kept their content from before this open."""
        return self._kept_content_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def io_fd(self) -> int:
        """The descriptor page reads and writes use (the O_DIRECT one when o_direct)."""
        return self._fd if self._direct_fd is None else self._direct_fd

    @property
    def num_inflight_io(self) -> int:
        return self._num_inflight_io

    @contextlib.contextmanager
    def _io_in_flight(self) -> Iterator[int]:
        """Hold the file open for one transfer; yields the descriptor to use."""
        with self._cond:
            if self._closing:
                raise ValueError(f"{self._path}: the storage file is closed")
            self._num_inflight_io += 1
        try:
            yield self.io_fd
        finally:
            with self._cond:
                self._num_inflight_io -= 1
                self._cond.notify_all()

    def close(self, timeout_s: float = 30.0) -> None:
        """Refuse new I/O, wait up to `timeout_s` for I/O in flight, close the descriptors, and
        remove a temporary file. Idempotent; the file may already be gone."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            if not self._cond.wait_for(lambda: self._num_inflight_io == 0, timeout=timeout_s):
                raise TimeoutError(
                    f"closing {self._path}: {self._num_inflight_io} I/O calls still in flight after {timeout_s} s"
                )
            self._closed = True
        if self._direct_fd is not None:
            os.close(self._direct_fd)
        os.close(self._fd)
        if self._is_temporary:
            _unlink_quietly(self._path)
            atexit.unregister(self._remove_at_exit)
        logger.info("L3 file %s closed", self._path)

    def _remove_at_exit(self) -> None:
        if not self._closed:
            _unlink_quietly(self._path)

    def check_integrity(self) -> None:
        """The file still has its size (nobody truncated it underneath) and the I/O count is sane."""
        if self._num_inflight_io < 0:
            raise AssertionError(f"{self._path}: negative in-flight I/O count {self._num_inflight_io}")
        if self._closed:
            if self._num_inflight_io:
                raise AssertionError(f"{self._path}: closed with {self._num_inflight_io} I/O calls in flight")
            return
        actual_size_bytes = os.fstat(self._fd).st_size
        if actual_size_bytes != self._size_bytes:
            raise AssertionError(
                f"{self._path}: file is {actual_size_bytes} bytes, expected {self._size_bytes} (changed underneath)"
            )

    def __enter__(self) -> StorageFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"StorageFile(path={self._path!r}, size_bytes={self._size_bytes}, o_direct={self._o_direct}, "
                f"closed={self._closed})")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # removed underneath: the goal is met
        pass
