"""The daemon's side of the admission hints (``proto.hints``): one slot per namespace, written
as the namespace's L2 residency, peer registrations and cost model change."""

from __future__ import annotations

import struct

import numpy as np

from proto import hints
from proto.messages import RESTORE_POLICIES


class AdmissionHints:
    """Over a writable buffer of ``hints.file_bytes(num_slots, num_buckets)`` bytes (the mapped
    hints file; a bytearray where no engine reads them)."""

    def __init__(self, num_slots: int, buffer=None, num_buckets: int = hints.DEFAULT_NUM_BUCKETS):
        size = hints.file_bytes(num_slots, num_buckets)
        self.buffer = bytearray(size) if buffer is None else buffer
        if len(self.buffer) != size:
            raise ValueError(f"a hints buffer of {num_slots} slots is {size} bytes, got {len(self.buffer)}")
        self.num_slots, self.num_buckets = num_slots, num_buckets
        self.buffer[:hints.HEADER_BYTES] = bytes(hints.HEADER_BYTES)
        struct.pack_into("<QQ", self.buffer, 8, num_slots, num_buckets)
        self.buffer[:len(hints.MAGIC)] = hints.MAGIC
        self._view()
        self._free = list(range(num_slots - 1, -1, -1))
        self._policy = 0

    def _view(self) -> None:
        self._heads = [np.frombuffer(self.buffer, dtype="<i8", count=4, offset=self.offset(s))
                       for s in range(self.num_slots)]
        self._buckets = [np.frombuffer(self.buffer, dtype="<u4", count=self.num_buckets,
                                       offset=self.offset(s) + hints.SLOT_HEADER_BYTES)
                         for s in range(self.num_slots)]

    def offset(self, slot: int) -> int:
        return hints.slot_offset(slot, self.num_buckets)

    def assign(self, namespace_id: int) -> int:
        """A free slot for a new namespace (one is free while fewer namespaces than slots live)."""
        slot = self._free.pop()
        self._buckets[slot][:] = 0
        head = self._heads[slot]
        head[hints.POLICY], head[hints.PEERS], head[hints.L3_MIN_TOKENS] = self._policy, 0, 0
        head[hints.TAG] = namespace_id + 1      # last: a reader trusts the slot from here on
        return slot

    def release(self, slot: int) -> None:
        self._heads[slot][hints.TAG] = 0
        self._free.append(slot)

    def set_policy(self, policy: str) -> None:
        self._policy = RESTORE_POLICIES.index(policy)
        for head in self._heads:
            head[hints.POLICY] = self._policy

    def set_peers(self, slot: int, num_peers: int) -> None:
        self._heads[slot][hints.PEERS] = num_peers

    def set_l3_min_tokens(self, slot: int, num_tokens: int) -> None:
        self._heads[slot][hints.L3_MIN_TOKENS] = min(num_tokens, hints.NEVER)

    def l2_root(self, slot: int, first_page: bytes, delta: int) -> None:
        """A path whose first page is ``first_page`` entered (+1) or left (-1) L2."""
        buckets, index = self._buckets[slot], hints.bucket(first_page, self.num_buckets)
        count = int(buckets[index]) + delta
        assert count >= 0, "a path left L2 that never entered it"
        buckets[index] = count

    def l2_roots(self, slot: int) -> np.ndarray:
        return self._buckets[slot].copy()

    def head(self, slot: int) -> dict[str, int]:
        head = self._heads[slot]
        return {"tag": int(head[hints.TAG]), "policy": int(head[hints.POLICY]), "peers": int(head[hints.PEERS]),
                "l3_min_tokens": int(head[hints.L3_MIN_TOKENS])}

    def close(self) -> None:
        """Go on from a private copy, so that the mapping under the buffer can close (the state
        stays whole after the file is gone: a stopped daemon's state is still checked).
        """
        copy = bytearray(self.buffer)
        self._heads, self._buckets = [], []
        self.buffer = copy
        self._view()
