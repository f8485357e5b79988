"""The admission hints file: what an engine reads, without a round trip, to know that the daemon
would decline to restore a request, so that it admits the request at once and takes its match's
reply (the reservation for its saves) while the forward runs.

A declined request would otherwise wait for one lookup round trip before its prefill starts: on
a short request that is several percent of its time. The daemon publishes per namespace what its
decision depends on; a reader that finds nothing the daemon could restore predicts "recompute".
A stale read costs at most one restore not taken (the engine recomputes, which is always
correct): bytes are only ever loaded under a lease of the match's reply.

The daemon creates the file (``O_EXCL|O_NOFOLLOW``, mode 0600, in the shared-memory directory,
named after its socket) and removes it at exit. Layout, little-endian:

    [0, 8)      MAGIC
    [8, 16)     num_slots (u64)
    [16, 24)    num_buckets (u64)
    [64 + s * slot_bytes(num_buckets), ...)   slot s, one per namespace served:
        [0, 8)      tag (u64): namespace id + 1; 0 while the slot is free
        [8, 16)     policy (u64): the daemon's restore policy, an index of RESTORE_POLICIES
        [16, 24)    peers (u64): peer registrations in the namespace (their GPU caches are candidates
                    for the others)
        [24, 32)    l3_min_tokens (i64): the fewest tokens beyond an engine's own hit at which an
                    L3 restore could beat recompute under the cost model (NEVER: at no length)
        [64, ...)   num_buckets u32 counts: per bucket of ``bucket(first page)``, the paths whose
                    first page L2 holds (residency is prefix-closed: an L2 hit starts at the
                    first page, so a request whose first page's bucket is 0 has no L2 hit)

Every field is one aligned load or store (single-copy atomic on x86-64); the daemon is the one
writer, under the lock that every change of its prefix trees holds (``state_lock``).
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib

import numpy as np

from proto.messages import RESTORE_POLICIES

MAGIC = b"KVHINTS1"
HEADER_BYTES = 64
SLOT_HEADER_BYTES = 64
DEFAULT_NUM_BUCKETS = 1 << 14
NEVER = 1 << 62

TAG, POLICY, PEERS, L3_MIN_TOKENS = range(4)      # the slot header's i64 fields


def slot_bytes(num_buckets: int) -> int:
    return SLOT_HEADER_BYTES + 4 * num_buckets


def file_bytes(num_slots: int, num_buckets: int = DEFAULT_NUM_BUCKETS) -> int:
    return HEADER_BYTES + num_slots * slot_bytes(num_buckets)


def slot_offset(slot: int, num_buckets: int = DEFAULT_NUM_BUCKETS) -> int:
    return HEADER_BYTES + slot * slot_bytes(num_buckets)


def bucket(first_page: bytes, num_buckets: int) -> int:
    """The bucket of a path: of the little-endian int32 bytes of its first page's token ids."""
    return zlib.crc32(first_page) % num_buckets


class HintsView:
    """An engine's read-only view of its namespace's slot."""

    def __init__(self, mapping: mmap.mmap, offset: int, num_buckets: int, namespace_id: int):
        self._mapping = mapping
        self._head = np.frombuffer(mapping, dtype="<i8", count=4, offset=offset)
        self._buckets = np.frombuffer(mapping, dtype="<u4", count=num_buckets, offset=offset + SLOT_HEADER_BYTES)
        self.num_buckets = num_buckets
        self.namespace_id = namespace_id

    @classmethod
    def open(cls, path: str, offset: int, namespace_id: int) -> "HintsView":
        """Map the slot at ``offset`` of the file at ``path`` (an attach reply's). OSError or
        ValueError when it is not a hints file, or the slot is not in it."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ValueError(f"{path} is not an admission hints file ({size} bytes)")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            if mapping[:len(MAGIC)] != MAGIC:
                raise ValueError(f"{path} is not an admission hints file")
            num_slots, num_buckets = struct.unpack_from("<QQ", mapping, 8)
            if not (num_buckets >= 1 and size == file_bytes(num_slots, num_buckets) and
                    HEADER_BYTES <= offset <= size - slot_bytes(num_buckets) and
                    (offset - HEADER_BYTES) % slot_bytes(num_buckets) == 0):
                raise ValueError(f"{path}: no slot at offset {offset}")
            return cls(mapping, offset, num_buckets, namespace_id)
        except BaseException:
            mapping.close()
            raise

    def close(self) -> None:
        del self._head, self._buckets
        self._mapping.close()

    def predicts_recompute(self, first_page: bytes, tokens_beyond: int, promote_l3: bool, policy: str,
                           peer_registered: bool = False) -> bool:
        """Whether the daemon would decline every restore of a request whose first page (token id
        bytes) is ``first_page``, and that holds ``tokens_beyond`` tokens of whole pages beyond the
        engine's own hit: under ``policy`` ("": the daemon's), no peer candidate (only an engine
        registered for peer restores has one, from another registration), no L2 hit, and, with
        ``promote_l3``, no L3 hit long enough to win. False whenever unsure."""
        head = self._head
        if int(head[TAG]) != self.namespace_id + 1:
            return False                    # the slot is another namespace's now (or free)
        if not policy:
            index = int(head[POLICY])
            policy = RESTORE_POLICIES[index] if 0 <= index < len(RESTORE_POLICIES) else ""
        if policy == "never" or tokens_beyond <= 0:
            return True
        if policy != "cost" or (peer_registered and int(head[PEERS]) > 1):
            return False
        if self._buckets[bucket(first_page, self.num_buckets)]:
            return False
        return not promote_l3 or tokens_beyond < int(head[L3_MIN_TOKENS])
