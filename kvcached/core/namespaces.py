"""A namespace: the cache of one KV geometry (model, dtype, layout, tensor-parallel rank), with its
tree, its allocators per tier and what it may use of the pool.

Ownership of L2 pages, per namespace, is a partition: every page is exactly one of tree-owned,
free (in the allocator), private (reserved by an active lease for a backup, or by a pending tier
move) or quarantined (private to a session that ended while its process may still be writing
them; see "Fencing" in docs/architecture.md). Which pages a namespace may use at all follows from
the chunks of the pool it owns (``pool.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvcached.core.allocator import PageAllocator
from kvcached.core.generations import PageGenerations
from kvcached.core.residency import PeerResidency
from kvcached.core.tiers import Tier
from kvcached.core.tree import PrefixTree
from proto.messages import KVGeometry


@dataclasses.dataclass
class Pressure:
    """Evictions a namespace suffered to make room in one tier (its own LRU pages, or the pages of
    a chunk another namespace took)."""

    evicted_pages: int = 0
    episodes: int = 0
    last_eviction_at: float | None = None


@dataclasses.dataclass(eq=False)
class Namespace:
    namespace_id: int
    geometry: KVGeometry
    num_pages: int                                 # L2 page ids 0..num_pages-1 span the whole segment
    tree: PrefixTree
    l2_allocator: PageAllocator
    l3_allocator: PageAllocator | None = None      # None: no L3 for this namespace
    session_ids: set[int] = dataclasses.field(default_factory=set)
    idle_since: float | None = None                # when its last session ended; None while attached
    index_key: str = ""                            # with a persistent L3 index: namespace_key(geometry)
    l3_checksums: np.ndarray | None = None         # with a persistent L3 index: crc32 per L3 slot held
    # Pages it may use now per tier: those of the chunks it owns (chunks.py).
    capacity: dict[Tier, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(Tier, 0))
    pressure: dict[Tier, Pressure] = dataclasses.field(default_factory=lambda: {t: Pressure() for t in Tier})
    hints_slot: int = -1                           # its slot of the admission hints
    generations: PageGenerations | None = None     # the write generation of each L2 page
    peers: PeerResidency = dataclasses.field(init=False)     # engines' GPU-cache blocks on the tree's nodes

    def __post_init__(self) -> None:
        self.peers = PeerResidency(self.tree)

    def allocator(self, tier: Tier) -> PageAllocator:
        allocator = self.l2_allocator if tier is Tier.L2 else self.l3_allocator
        assert allocator is not None, f"namespace {self.namespace_id} has no {tier.label}"
        return allocator
