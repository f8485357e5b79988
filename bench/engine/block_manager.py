"""The KV blocks and the engine's own GPU prefix cache over whole blocks.

A full block's KV is named by its page key, a digest chained over the tokens up to its end
(``block_hashes``, ``proto/page_keys.py``), so a block is reusable by any request whose leading
tokens are the same. Every block is in exactly one of three sets:

  free        holds nothing reusable
  cached      ref count 0, holds the KV of its hash: reusable, and evictable in LRU order
  referenced  ref count > 0 (by requests, or held for the connector), with or without a hash

``allocate`` takes free blocks first, then evicts the least recently released cached ones. Every
block it hands out, and every block ``evict_all`` drops, first goes to ``on_write`` (when set): the
engine writes allocated blocks, so whoever reads them from outside (peer restores) must stop first.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

from proto.page_keys import ROOT_KEY, iter_page_keys


def block_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int,
                 known: Sequence[bytes] = ()) -> list[bytes]:
    """The page keys of the first num_blocks full blocks of token_ids (``known``: a prefix of
    them already computed)."""
    assert num_blocks * block_size <= len(token_ids), (num_blocks, len(token_ids))
    hashes = list(known[:num_blocks])
    tokens = token_ids[len(hashes) * block_size: num_blocks * block_size]
    hashes.extend(iter_page_keys(tokens, block_size, hashes[-1] if hashes else ROOT_KEY))
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_to_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free_block_ids: collections.deque[int] = collections.deque(range(num_blocks))
        self.cached_block_ids: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.num_evictions = 0
        self.on_write: Callable[[list[int]], None] | None = None

    @property
    def num_allocatable_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.cached_block_ids)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest cached run of hashes from the first on. Changes nothing."""
        block_ids = []
        for block_hash in hashes:
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def can_allocate(self, num_blocks: int, reused_block_ids: Sequence[int] = ()) -> bool:
        """Whether ``acquire(reused_block_ids)`` then ``allocate(num_blocks)`` would succeed."""
        num_reused_cached = sum(1 for b in reused_block_ids if self.ref_counts[b] == 0)
        return num_blocks <= self.num_allocatable_blocks - num_reused_cached

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Reference blocks found by ``match`` (a cached block stops being evictable)."""
        for block_id in block_ids:
            assert self.block_to_hash[block_id] is not None, block_id
            if self.ref_counts[block_id] == 0:
                del self.cached_block_ids[block_id]
            self.ref_counts[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int] | None:
        """num_blocks blocks, referenced once, holding nothing; None if there are not enough."""
        if num_blocks > self.num_allocatable_blocks:
            return None
        block_ids = []
        for _ in range(num_blocks):
            if self.free_block_ids:
                block_id = self.free_block_ids.popleft()
            else:
                block_id, _ = self.cached_block_ids.popitem(last=False)
                del self.hash_to_block[self.block_to_hash[block_id]]
                self.block_to_hash[block_id] = None
                self.num_evictions += 1
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        if self.on_write is not None:
            self.on_write(block_ids)
        return block_ids

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. Released last to first, so that a request's later
        blocks are evicted before its earlier ones (an earlier block is useful without the later
        ones, never the other way round)."""
        for block_id in reversed(block_ids):
            assert self.ref_counts[block_id] > 0, block_id
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_to_hash[block_id] is None:
                    self.free_block_ids.append(block_id)
                else:
                    self.cached_block_ids[block_id] = None

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """A referenced block now holds the whole KV of block_hash. False (nothing changes) when
        another block holds it already, or this block holds a hash."""
        assert self.ref_counts[block_id] > 0, block_id
        if block_hash in self.hash_to_block or self.block_to_hash[block_id] is not None:
            return False
        self.hash_to_block[block_hash] = block_id
        self.block_to_hash[block_id] = block_hash
        return True

    def evict_all(self) -> int:
        """Forget every cached block (a cold prefix cache); returns how many."""
        num_cached = len(self.cached_block_ids)
        dropped = []
        while self.cached_block_ids:
            block_id, _ = self.cached_block_ids.popitem(last=False)
            del self.hash_to_block[self.block_to_hash[block_id]]
            self.block_to_hash[block_id] = None
            self.free_block_ids.append(block_id)
            dropped.append(block_id)
        if dropped and self.on_write is not None:
            self.on_write(dropped)
        return num_cached

    def check_integrity(self) -> None:
        free, cached = set(self.free_block_ids), set(self.cached_block_ids)
        referenced = {b for b, count in enumerate(self.ref_counts) if count > 0}
        if len(free) != len(self.free_block_ids):
            raise AssertionError("a block is free twice")
        if free & cached or free & referenced or cached & referenced:
            raise AssertionError("free, cached and referenced blocks overlap")
        if len(free) + len(cached) + len(referenced) != self.num_blocks:
            raise AssertionError(f"{len(free)} free + {len(cached)} cached + {len(referenced)} referenced "
                                 f"!= {self.num_blocks} blocks")
        if any(count < 0 for count in self.ref_counts):
            raise AssertionError("a negative ref count")
        if any(self.block_to_hash[b] is not None for b in free) or any(self.block_to_hash[b] is None for b in cached):
            raise AssertionError("a free block with a hash, or a cached block without one")
        for block_hash, block_id in self.hash_to_block.items():
            if self.block_to_hash[block_id] != block_hash:
                raise AssertionError(f"block {block_id} is not the one of its hash")
        if sum(h is not None for h in self.block_to_hash) != len(self.hash_to_block):
            raise AssertionError("a block's hash is not in the hash map")
