"""The L2 shared-memory segment and the files that guard it.

The segment is one file under /dev/shm, mode 0600, created by the daemon, filled with
``posix_fallocate`` so that every page exists before an engine maps and pins it (pinning
unpopulated shared memory is many times slower per GiB), and removed at exit. A daemon killed
with SIGKILL cannot remove it; the next daemon on the same socket holds the lock file and
therefore knows any segment with its name is stale, and removes it.

Every file the daemon makes or removes (the socket's directory, the lock file, the socket, the
segment) is checked first with lstat or opened with O_NOFOLLOW (O_EXCL where it is created), and
removed only while it is still the file the daemon made: a symlink or file another user planted
is refused with a message, never followed, truncated or unlinked.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import stat
import struct
import time
from typing import Callable

import numpy as np

from proto import epochs, generations
from proto.paths import file_kind, user_label

logger = logging.getLogger(__name__)


class StartupError(Exception):
    """The daemon cannot start; the message says why and what to do."""


def segment_name(socket_path: str) -> str:
    digest = hashlib.sha1(os.path.abspath(socket_path).encode()).hexdigest()[:12]
    return f"kvcached-{os.getuid()}-{digest}.l2"


def hints_file_name(socket_path: str) -> str:
    """The admission hints file (``proto.hints``): ``<segment name>.hints``."""
    return segment_name(socket_path) + ".hints"


def epoch_file_prefix(socket_path: str) -> str:
    """The names of a daemon's peer epoch files start so: ``<segment name>.peer-``."""
    return segment_name(socket_path) + ".peer-"


def generation_file_prefix(socket_path: str) -> str:
    """The names of a daemon's L2 page generation files start so: ``<segment name>.gen-``."""
    return segment_name(socket_path) + ".gen-"


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class SocketDirectory:
    """The socket's directory, checked and held open: the lock file and the socket are created,
    checked and removed through it (``dir_fd``), never by a path that a symlink could redirect.

    It must be a real directory (not a symlink) of the daemon's user, writable by no one else; a
    missing one is created 0700. Anything else is refused with a message that says why and what
    to do, before any file in it is opened."""

    def __init__(self, socket_path: str):
        self.path = os.path.dirname(socket_path)
        self.socket_name = os.path.basename(socket_path)
        self.socket_path = socket_path
        self._socket_stat: os.stat_result | None = None
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            os.mkdir(self.path, 0o700)
            logger.info("created the socket directory %s (mode 700)", self.path)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StartupError(f"cannot create the socket directory {self.path}: {exc.strerror}") from None
        try:
            info = os.lstat(self.path)
        except OSError as exc:           # e.g. a regular file where a directory above it should be
            raise StartupError(f"cannot use the socket directory {self.path}: {exc.strerror}; choose another "
                               "--socket") from None
        uid = os.geteuid()
        if stat.S_ISLNK(info.st_mode):
            raise StartupError(f"the socket directory {self.path} is a symlink (to {os.readlink(self.path)}); "
                               "kvcached uses only a real directory of its own: remove the link, or choose "
                               "another --socket")
        if not stat.S_ISDIR(info.st_mode):
            raise StartupError(f"the socket directory {self.path} is {file_kind(info.st_mode)}, not a directory: "
                               "remove it, or choose another --socket")
        if info.st_uid != uid:
            raise StartupError(f"the socket directory {self.path} belongs to {user_label(info.st_uid)}, not to "
                               f"{user_label(uid)} who runs the daemon: another user created it first (perhaps to "
                               "take over kvcached's socket). Remove it (as root or that user), or set "
                               "XDG_RUNTIME_DIR or --socket to a directory of your own")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StartupError(f"the socket directory {self.path} is writable by other users (mode "
                               f"{info.st_mode & 0o7777:o}), who could replace the socket: chmod 700 it, or "
                               "choose another --socket in a directory of its own")
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise StartupError(f"cannot open the socket directory {self.path}: {exc.strerror}") from None
        if not _same_file(os.fstat(self.fd), info):       # replaced between the check and the open
            os.close(self.fd)
            raise StartupError(f"the socket directory {self.path} changed while it was checked; try again")

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.lstat(name, dir_fd=self.fd)
        except FileNotFoundError:
            return None

    def remove_stale_socket(self) -> None:
        """A socket of ours left by a daemon that is gone (the caller holds the lock) is removed;
        anything else at the socket's name is refused, not removed."""
        info = self.lstat(self.socket_name)
        if info is None:
            return
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
            raise StartupError(f"{self.socket_path} is {file_kind(info.st_mode)} of {user_label(info.st_uid)}, not a "
                               "stale socket of this daemon's; kvcached does not remove it: remove it yourself, "
                               "or choose another --socket")
        os.unlink(self.socket_name, dir_fd=self.fd)

    def socket_bound(self) -> None:
        """After bind: make the socket 0600 and remember it, so that remove_socket removes this one only."""
        info = self.lstat(self.socket_name)
        if info is None or not stat.S_ISSOCK(info.st_mode):
            raise StartupError(f"the socket {self.socket_path} vanished or was replaced right after bind")
        os.chmod(self.socket_name, 0o600, dir_fd=self.fd)
        self._socket_stat = info

    def unlink_if_same(self, name: str, expected: os.stat_result | None) -> None:
        """Remove ``name`` only if it is still the file we made (a replaced file is left alone)."""
        info = self.lstat(name)
        if expected is not None and info is not None and _same_file(info, expected):
            os.unlink(name, dir_fd=self.fd)

    def remove_socket(self) -> None:
        self.unlink_if_same(self.socket_name, self._socket_stat)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# The segment is allocated and populated this much at a time: a stop signal waits for one slice at
# most (tens of milliseconds), and progress is reported after each.
POPULATE_SLICE_BYTES = 32 << 20
_ZEROS = bytes(2 << 20)


def _populate(fd: int, offset: int, length: int) -> None:
    """Allocate these pages and clear them now, in the daemon, rather than on the first engine's
    attach: fallocated tmpfs pages are cleared at first touch, which would otherwise make the first
    attach several times slower (``pin`` in docs/benchmarks.md). Cleared with write(2), not through
    the daemon's mapping, so that the daemon maps none of them: unmapping at exit costs nothing
    (unmapping pages populated through the mapping takes time in proportion to them)."""
    os.posix_fallocate(fd, offset, length)
    done = 0
    with memoryview(_ZEROS) as zeros:
        while done < length:
            done += os.pwrite(fd, zeros[:length - done], offset + done)


# Memory a new pool must leave free for everything else on the host (the daemon itself included).
MEMORY_HEADROOM_BYTES = 512 << 20


class PoolTooLarge(StartupError):
    """The L2 pool does not fit in the shared-memory filesystem or in memory (exit status 2)."""


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None      # "max": no limit


def _stat_field(path: str, name: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                words = line.split()
                if len(words) >= 2 and words[0] == name:
                    return int(words[1])
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_room(group: str, limit_name: str, usage_name: str, cache_name: str) -> int | None:
    """What a group's memory limit leaves: limit - usage + page cache that is not shared memory
    (reclaimable); None where the group has no limit."""
    limit, usage = _read_int(os.path.join(group, limit_name)), _read_int(os.path.join(group, usage_name))
    if limit is None or usage is None or limit >= 1 << 60:      # v1 writes "no limit" as ~2^63
        return None
    stat_path = os.path.join(group, "memory.stat")
    reclaimable = max(0, _stat_field(stat_path, cache_name) - _stat_field(stat_path, "shmem"))
    return limit - usage + reclaimable


def memory_room_bytes(meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup",
                      proc_cgroup: str = "/proc/self/cgroup") -> tuple[int, str]:
    """The memory a new segment can take (its tmpfs pages are memory) and what bounds it: the
    host's MemAvailable, or less where a cgroup memory limit (v2 memory.max of this process's group
    or a group above it; v1 memory.limit_in_bytes) leaves less."""
    room, source = _stat_field(meminfo, "MemAvailable:") * 1024, "MemAvailable"
    try:
        with open(proc_cgroup) as f:
            own_group = next((line[3:].strip() for line in f if line.startswith("0::")), None)
    except OSError:
        own_group = None
    groups = []
    if own_group is not None and os.path.exists(os.path.join(cgroup_root, "cgroup.controllers")):
        group = os.path.normpath(os.path.join(cgroup_root, own_group.lstrip("/")))
        while group.startswith(cgroup_root):
            groups.append((group, "memory.max", "memory.current", "file"))
            group = os.path.dirname(group)
    groups.append((os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes", "memory.usage_in_bytes", "cache"))
    for group, limit_name, usage_name, cache_name in groups:
        cgroup = _cgroup_room(group, limit_name, usage_name, cache_name)
        if cgroup is not None and cgroup < room:
            room, source = cgroup, f"the cgroup limit {os.path.join(group, limit_name)}"
    return room, source


def check_pool_fits(shm_dir: str, l2_bytes: int, other_bytes: int, stale_paths: tuple[str, ...] = (),
                    memory_room: tuple[int, str] | None = None) -> None:
    """PoolTooLarge, in one line, unless an L2 segment of ``l2_bytes`` (and ``other_bytes`` of
    smaller files) fits both in ``shm_dir``'s free space and in memory, leaving
    MEMORY_HEADROOM_BYTES. Stale files of ours at ``stale_paths`` are removed before the segment is
    made, so what they hold counts as free. Checked before anything is made: a pool that does not
    fit would be OOM-killed or SIGBUS mid-populate, and leave what it had populated behind."""
    stale_bytes = 0
    for path in stale_paths:
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            stale_bytes += info.st_blocks * 512
    try:
        filesystem = os.statvfs(shm_dir)
    except OSError as exc:
        raise StartupError(f"cannot use the shared-memory directory {shm_dir}: {exc.strerror}") from None
    shm_free = filesystem.f_bavail * filesystem.f_frsize + stale_bytes
    memory, memory_source = memory_room if memory_room is not None else memory_room_bytes()
    memory += stale_bytes
    fits = min(shm_free, memory - MEMORY_HEADROOM_BYTES) - other_bytes
    if l2_bytes <= fits:
        return
    raise PoolTooLarge(f"an L2 pool of {_format_bytes(l2_bytes)} does not fit: {shm_dir} has "
                       f"{_format_bytes(shm_free)} free, memory {_format_bytes(memory)} available ({memory_source}) "
                       f"of which {_format_bytes(MEMORY_HEADROOM_BYTES)} stay free; at most "
                       f"{_format_bytes(max(0, fits) // (2 << 20) * (2 << 20))} fits: choose a smaller --l2-size")


def _format_bytes(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if abs(num_bytes) >= 1 << 30 else f"{num_bytes / 2**20:.0f} MiB"


class DaemonLock:
    """An flock on <socket>.lock: one daemon per socket, and proof that leftovers are stale.

    Opened with O_NOFOLLOW through the checked directory, and used only if it is a regular file of
    ours with one link: a planted symlink or hard link never makes the daemon write another file."""

    def __init__(self, directory: SocketDirectory):
        self.directory = directory
        self.name = directory.socket_name + ".lock"
        self.path = os.path.join(directory.path, self.name)
        try:
            self.fd = os.open(self.name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                              0o600, dir_fd=directory.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StartupError(f"the lock file {self.path} is a symlink; kvcached never follows one: "
                                   "remove it, or choose another --socket") from None
            raise StartupError(f"cannot open the lock file {self.path}: {exc.strerror}") from None
        self._stat = os.fstat(self.fd)
        if (not stat.S_ISREG(self._stat.st_mode) or self._stat.st_uid != os.geteuid()
                or self._stat.st_nlink != 1):
            os.close(self.fd)
            raise StartupError(f"the lock file {self.path} is {file_kind(self._stat.st_mode)} of "
                               f"{user_label(self._stat.st_uid)} with {self._stat.st_nlink} links, not a lock "
                               "file of this daemon's; kvcached leaves it alone: remove it, or choose another "
                               "--socket")
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise StartupError(f"another kvcached daemon (pid {holder}) is serving {directory.socket_path}") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def close(self) -> None:
        if self.fd >= 0:
            self.directory.unlink_if_same(self.name, self._stat)
            os.close(self.fd)
            self.fd = -1


class SharedSegment:
    """The daemon's side of the L2 pool: create, populate, map, and remove at close."""

    def __init__(self, path: str, size_bytes: int, fd: int, mapping: mmap.mmap):
        self.path = path
        self.size_bytes = size_bytes
        self._fd = fd
        self._stat = os.fstat(fd)
        self.mapping = mapping

    @classmethod
    def create(cls, shm_dir: str, name: str, size_bytes: int,
               progress: Callable[[int, int], None] | None = None, what: str = "L2 segment",
               check_stop: Callable[[], None] | None = None) -> "SharedSegment":
        """``progress(done_bytes, size_bytes)`` is called as the segment is allocated and populated,
        after each POPULATE_SLICE_BYTES, and then ``check_stop()``, which raises to stop: the
        segment is removed and the exception goes on. ``what``: the file's name in messages (the
        admission hints file is made the same way)."""
        path = os.path.join(shm_dir, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            info = None
        if info is not None:
            # We hold the daemon lock for this socket, so a segment of ours by this name is stale.
            # Anything else (a symlink, another user's file) was not made by us and stays. In the
            # sticky shared-memory directory nobody else can replace our file before the unlink.
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise StartupError(f"{path} is {file_kind(info.st_mode)} of {user_label(info.st_uid)}, not an {what} "
                                   "this daemon left behind; kvcached does not remove it: remove it "
                                   "yourself, or choose another --socket (the file is named after it)")
            logger.warning("removing stale %s %s left by a daemon that did not exit cleanly", what, path)
            os.unlink(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StartupError(f"cannot create {what} {path}: {exc.strerror}") from None
        mapping = None
        started = time.perf_counter()
        try:
            # Sized first, then allocated slice by slice and each slice populated once its pages
            # exist (touching a tmpfs page that could not be allocated would be a SIGBUS).
            os.ftruncate(fd, size_bytes)
            mapping = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            for offset in range(0, size_bytes, POPULATE_SLICE_BYTES):
                length = min(POPULATE_SLICE_BYTES, size_bytes - offset)
                try:
                    _populate(fd, offset, length)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                        raise StartupError(
                            f"{shm_dir} has no room for an {what} of {size_bytes} bytes; "
                            "choose a smaller --l2-size or enlarge the shared-memory filesystem") from None
                    raise
                if progress is not None:
                    progress(offset + length, size_bytes)
                if check_stop is not None:
                    check_stop()
        except BaseException:
            if mapping is not None:
                mapping.close()
            _unlink_if_same(path, os.fstat(fd))
            os.close(fd)
            raise
        logger.info("%s %s: %d bytes populated in %.2f s", what, path, size_bytes, time.perf_counter() - started)
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
        _unlink_if_same(self.path, self._stat)
        os.close(self._fd)
        self._fd = -1


def _unlink_if_same(path: str, expected: os.stat_result) -> None:
    """Remove the file at path only if it is still ours (a file put there since is left alone)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if _same_file(info, expected):
        os.unlink(path)


class EpochFiles:
    """The epoch files of live peer registrations (``proto.epochs``), one per peer id, in the
    shared-memory directory. Files of ours with our prefix found at start are stale (we hold the
    daemon lock) and removed; anything else by those names is left alone and refused."""

    def __init__(self, shm_dir: str, prefix: str):
        self.shm_dir = shm_dir
        self.prefix = prefix
        self._files: dict[int, tuple[str, int, os.stat_result, mmap.mmap]] = {}
        for name in os.listdir(shm_dir):
            if not name.startswith(prefix):
                continue
            path = os.path.join(shm_dir, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                logger.warning("removing stale peer epoch file %s left by a daemon that did not exit cleanly", path)
                os.unlink(path)

    def create(self, peer_id: int, num_blocks: int) -> tuple[str, int]:
        """Make the file of a registration; returns its path and where its epochs start. OSError
        (nothing left behind) when it cannot be made."""
        path = os.path.join(self.shm_dir, f"{self.prefix}{peer_id:016x}.epochs")
        size = epochs.file_bytes(num_blocks)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            info = os.fstat(fd)
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            mapping[:len(epochs.MAGIC)] = epochs.MAGIC
            struct.pack_into("<Q", mapping, epochs.NUM_BLOCKS_OFFSET, num_blocks)
        except BaseException:
            _unlink_if_same(path, os.fstat(fd))
            raise
        finally:
            os.close(fd)
        self._files[peer_id] = (path, size, info, mapping)
        return path, epochs.EPOCHS_OFFSET

    def close(self, peer_id: int) -> None:
        """The registration ended: mark its file closed (readers stop copying from it and close
        their mappings), then remove it; the memory goes once the last mapping does."""
        entry = self._files.pop(peer_id, None)
        if entry is None:
            return
        path, _, info, mapping = entry
        struct.pack_into("<Q", mapping, epochs.CLOSED_OFFSET, 1)
        mapping.close()
        _unlink_if_same(path, info)

    def close_all(self) -> None:
        for peer_id in list(self._files):
            self.close(peer_id)


class GenerationFiles:
    """The L2 page generation files (``proto.generations``), one per namespace, in the
    shared-memory directory (``kvcached.core.generations.GenerationFiles``). Made and removed
    like the peer epoch files: stale ones of ours are removed at start, anything else by those
    names is left alone and refused."""

    def __init__(self, shm_dir: str, prefix: str):
        self.shm_dir = shm_dir
        self.prefix = prefix
        self._files: dict[int, tuple[str, os.stat_result, mmap.mmap]] = {}
        for name in os.listdir(shm_dir):
            path = os.path.join(shm_dir, name)
            if name.startswith(prefix):
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                    logger.warning("removing stale page generation file %s left by a daemon that did not exit "
                                   "cleanly", path)
                    os.unlink(path)

    def create(self, namespace_id: int, num_pages: int) -> tuple[str, np.ndarray]:
        path = os.path.join(self.shm_dir, f"{self.prefix}{namespace_id:08x}")
        size = generations.file_bytes(num_pages)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            info = os.fstat(fd)
            os.ftruncate(fd, size)         # zeroed: no page is trusted before the daemon says so
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            _unlink_if_same(path, os.fstat(fd))
            raise
        finally:
            os.close(fd)
        self._files[namespace_id] = (path, info, mapping)
        return path, np.frombuffer(mapping, dtype="<u8", count=num_pages)

    def close(self, namespace_id: int) -> None:
        """Remove the file; the memory goes once the last mapping does (the daemon's own array
        keeps its mapping alive until it is dropped)."""
        entry = self._files.pop(namespace_id, None)
        if entry is not None:
            _unlink_if_same(entry[0], entry[1])

    def close_all(self) -> None:
        for namespace_id in list(self._files):
            self.close(namespace_id)
