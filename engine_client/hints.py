"""An engine's reading of the admission hints file (its layout: ``proto.hints``): whether the daemon
would decline to restore a request, so that the engine admits the request at once and takes its
match's reply (the reservation for its saves) while the forward runs.

A declined request would otherwise wait for one lookup round trip before its prefill starts: on
a short request that is several percent of its time. The daemon publishes per namespace what its
decision depends on; a reader that finds nothing the daemon could restore predicts "recompute".
A stale read costs at most one restore not taken (the engine recomputes, which is always
correct): bytes are only ever loaded under a lease of the match's reply.
"""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np

from proto.hints import HEADER_BYTES, L3_MIN_TOKENS, MAGIC, PEERS, POLICY, SLOT_HEADER_BYTES, TAG, bucket, file_bytes, \
    slot_bytes
from proto.messages import RESTORE_POLICIES


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
