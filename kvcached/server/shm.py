"""The L2 shared-memory segment and the files that guard it.

The segment is one file under /dev/shm, mode 0600, created by the daemon, filled with
``posix_fallocate`` so that every page exists before an engine maps and pins it (pinning
unpopulated shared memory is 15-20x slower per GiB), and removed at exit. A daemon killed
with SIGKILL cannot remove it; the next daemon on the same socket holds the lock file and
therefore knows any segment with its name is stale, and removes it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import stat
import time

logger = logging.getLogger(__name__)


class StartupError(Exception):
    """The daemon cannot start; the message says why and what to do."""


def segment_name(socket_path: str) -> str:
    digest = hashlib.sha1(os.path.abspath(socket_path).encode()).hexdigest()[:12]
    return f"kvcached-{os.getuid()}-{digest}.l2"


def ensure_private_dir(path: str) -> None:
    """Create the socket's directory 0700; refuse one that another user owns."""
    if not os.path.isdir(path):
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"cannot create socket directory {path}: {exc.strerror}") from None
    info = os.stat(path)
    if info.st_uid != os.getuid():
        raise StartupError(f"socket directory {path} belongs to uid {info.st_uid}, not to us ({os.getuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        logger.warning("socket directory %s is writable by others (mode %o)", path, info.st_mode & 0o777)


# Linux 5.14+: fault every page in writable, as a write would, without changing its bytes.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_TOUCH_CHUNK_BYTES = 64 << 20


def _touch_every_page(mapping: mmap.mmap, size_bytes: int) -> None:
    """Make tmpfs zero-fill every page now, in the daemon, rather than on the first engine's
    attach: fallocated tmpfs pages are cleared at first touch, which was measured to make a first
    attach of 16 GiB take 5.6 s instead of 1 s."""
    started = time.perf_counter()
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except OSError:         # older kernels: write zeros, which is what the pages hold anyway
        zeros = bytes(_TOUCH_CHUNK_BYTES)
        for offset in range(0, size_bytes, _TOUCH_CHUNK_BYTES):
            end = min(offset + _TOUCH_CHUNK_BYTES, size_bytes)
            mapping[offset:end] = zeros[: end - offset]
    logger.info("L2 segment: %d bytes populated in %.2f s", size_bytes, time.perf_counter() - started)


class DaemonLock:
    """An flock on <socket>.lock: one daemon per socket, and proof that leftovers are stale."""

    def __init__(self, socket_path: str):
        self.path = socket_path + ".lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise StartupError(f"another kvcached daemon (pid {holder}) is serving {socket_path}") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self.fd)
            self.fd = -1


class SharedSegment:
    """The daemon's side of the L2 pool: create, populate, map, and remove at close."""

    def __init__(self, path: str, size_bytes: int, fd: int, mapping: mmap.mmap):
        self.path = path
        self.size_bytes = size_bytes
        self._fd = fd
        self.mapping = mapping

    @classmethod
    def create(cls, shm_dir: str, name: str, size_bytes: int) -> "SharedSegment":
        path = os.path.join(shm_dir, name)
        if os.path.exists(path):
            # We hold the daemon lock for this socket, so whoever made this file is gone.
            logger.warning("removing stale L2 segment %s left by a daemon that did not exit cleanly", path)
            os.unlink(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StartupError(f"cannot create L2 segment {path}: {exc.strerror}") from None
        try:
            try:
                os.posix_fallocate(fd, 0, size_bytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise StartupError(
                        f"{shm_dir} has no room for an L2 pool of {size_bytes} bytes; "
                        "choose a smaller --l2-size or enlarge the shared-memory filesystem") from None
                raise
            mapping = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            _touch_every_page(mapping, size_bytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        logger.info("L2 segment %s: %d bytes, populated", path, size_bytes)
        return cls(path, size_bytes, fd, mapping)

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self.mapping.close()
        except BufferError:
            # A view is still exported (an I/O in flight at shutdown); the unlink below still
            # frees the memory once the last mapping goes.
            logger.warning("L2 segment still has exported views at close")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1
