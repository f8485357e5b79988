"""The admission hints file's layout: what the daemon publishes per namespace (``kvcached.core.hints``
writes it) for an engine to read without a round trip (``engine_client.hints`` reads it and predicts
the daemon's decision from it).

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

import zlib

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
