"""What an L2 pool may take, read from files as the kernel writes them (no process started): the
host's MemAvailable, lowered by a cgroup's memory limit (v2 and v1), and /dev/shm's free space, with
what stale files of ours hold counted as free."""

from __future__ import annotations

import os

import pytest

from kvcached.server.shm import MEMORY_HEADROOM_BYTES, PoolTooLarge, check_pool_fits, memory_room_bytes

GIB = 1 << 30


def write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.fixture
def host(tmp_path):
    """A fake /proc and /sys/fs/cgroup: 20 GiB MemAvailable; this process in cgroup v2 group
    /pods/engine; no limits yet."""
    write(tmp_path / "meminfo", f"MemTotal:       {24 * GIB // 1024} kB\nMemAvailable:   {20 * GIB // 1024} kB\n")
    write(tmp_path / "cgroup", "0::/pods/engine\n")
    root = tmp_path / "cgroupfs"
    write(root / "cgroup.controllers", "cpu memory\n")
    for group in (root / "pods", root / "pods" / "engine"):
        write(group / "memory.max", "max\n")
        write(group / "memory.current", f"{GIB}\n")
        write(group / "memory.stat", "anon 1\nfile 0\nshmem 0\n")
    return tmp_path


def room(host) -> tuple[int, str]:
    return memory_room_bytes(str(host / "meminfo"), str(host / "cgroupfs"), str(host / "cgroup"))


def test_without_a_limit_memory_available_is_the_hosts(host):
    """No memory.max anywhere ("max"): the room is MemAvailable."""
    assert room(host) == (20 * GIB, "MemAvailable")


def test_a_v2_limit_of_the_group_or_a_group_above_it_lowers_the_room(host):
    """A 8 GiB memory.max on the parent group with 3 GiB used, 1 GiB of it reclaimable page cache
    (file minus shmem): 8 - 3 + 1 = 6 GiB, named by its file; a tighter limit on the own group wins."""
    write(host / "cgroupfs" / "pods" / "memory.max", f"{8 * GIB}\n")
    write(host / "cgroupfs" / "pods" / "memory.current", f"{3 * GIB}\n")
    write(host / "cgroupfs" / "pods" / "memory.stat", f"anon {GIB}\nfile {2 * GIB}\nshmem {GIB}\n")
    assert room(host) == (6 * GIB, f"the cgroup limit {host / 'cgroupfs' / 'pods' / 'memory.max'}")
    write(host / "cgroupfs" / "pods" / "engine" / "memory.max", f"{3 * GIB}\n")
    assert room(host)[0] == 2 * GIB


def test_a_v1_limit_lowers_the_room(host):
    """cgroup v1's memory.limit_in_bytes (4 GiB, 1 GiB used): 3 GiB; v1's "no limit" (~2^63) is none."""
    v1 = host / "cgroupfs" / "memory"
    write(v1 / "memory.limit_in_bytes", f"{4 * GIB}\n")
    write(v1 / "memory.usage_in_bytes", f"{GIB}\n")
    assert room(host)[0] == 3 * GIB
    write(v1 / "memory.limit_in_bytes", "9223372036854771712\n")
    assert room(host) == (20 * GIB, "MemAvailable")


def test_a_pool_must_fit_shm_and_memory_with_headroom(tmp_path):
    """The pool plus the other files must fit both the directory's free space and the memory room
    less MEMORY_HEADROOM_BYTES; the message is one line naming both figures and the largest pool that fits."""
    shm_free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    memory = (shm_free + 2 * MEMORY_HEADROOM_BYTES, "MemAvailable")
    check_pool_fits(str(tmp_path), shm_free - (1 << 20), 1 << 20, memory_room=memory)
    with pytest.raises(PoolTooLarge) as refused:
        check_pool_fits(str(tmp_path), shm_free + (64 << 20), 1 << 20, memory_room=memory)
    message = str(refused.value)
    assert "\n" not in message and f"{tmp_path} has" in message and "(MemAvailable)" in message
    small_memory = (1 << 30, "MemAvailable")
    with pytest.raises(PoolTooLarge, match="at most 510 MiB fits"):
        check_pool_fits(str(tmp_path), 600 << 20, 2 << 20, memory_room=small_memory)


def test_a_stale_segment_of_ours_counts_as_free(tmp_path):
    """What a stale segment of ours holds (it is removed before the new one is made) counts as free
    space and free memory: a pool that fits only with it gone is accepted."""
    stale = tmp_path / "stale.l2"
    with open(stale, "wb") as f:
        f.write(os.urandom(8 << 20))
        f.flush()
        os.fsync(f.fileno())
    held = os.stat(stale).st_blocks * 512
    memory = (MEMORY_HEADROOM_BYTES + (4 << 20), "MemAvailable")
    check_pool_fits(str(tmp_path), (4 << 20) + held, 0, stale_paths=(str(stale),), memory_room=memory)
    with pytest.raises(PoolTooLarge):
        check_pool_fits(str(tmp_path), (4 << 20) + held + (2 << 20), 0, stale_paths=(str(stale),),
                        memory_room=memory)
