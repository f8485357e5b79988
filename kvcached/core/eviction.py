"""Which resident pages a tier frees first: a reuse-aware LRU over the prefix tree's leaves.

- Eviction knows reuse (S3-FIFO's idea on a tree of leaves): a node resident in a tier is
  "reused" there once an acquire hits it (insertion is not use). Leaves never reused go first, oldest
  first, so a flood of one-use prompts churns among themselves; reused leaves go first only while
  reused pages exceed MAIN_SHARE of the tier's pages (or nothing else is evictable), so old
  reuse cannot hold the whole tier and a new working set still gets room to be reused. The flag
  outlives residency while the node stays in the tree (L3 or children keep it): a prefix reused
  before comes back to L2 as reused (S3-FIFO's ghost queue, for free).
- One lazy min-heap per tier and class (never reused, reused) of (last_access, seq, node).
  Invariant: every node that is evictable in a tier has an entry in its class's heap whose time
  equals its current last_access there; stale entries (an older time, or the other class) are
  skipped when popped, and a heap is rebuilt once it holds many more entries than the tree has
  nodes. The tree calls ``push_if_evictable`` wherever a node may have become evictable or
  changed its LRU time or class.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterator, Sequence

from kvcached.core.tiers import IntegrityError, Tier
from kvcached.core.tree_node import TreeNode

MAIN_SHARE = 0.9         # of a tier's pages, reused pages above which reused leaves are evicted first


def is_evictable(node: TreeNode, tier: Tier) -> bool:
    """A resident, unlocked leaf of `tier` (no child resident there), in the tree."""
    return (node.parent is not None and node.page_ids[tier] is not None
            and node.ref_count[tier] == 0 and node.num_resident_children[tier] == 0)


class EvictionOrder:
    """The order in which a tree's evictable leaves go, per tier.
    ``nodes()`` walks the tree's nodes and ``num_nodes()`` counts them (to rebuild a heap)."""

    def __init__(self, tiers: Sequence[Tier], nodes: Callable[[], Iterator[TreeNode]],
                 num_nodes: Callable[[], int]):
        self._nodes = nodes
        self._num_nodes = num_nodes
        # (tier, reused) -> the lazy min-heap of that class's evictable leaves
        self._heaps: dict[tuple[Tier, bool], list[tuple[float, int, TreeNode]]] = {
            (t, reused): [] for t in tiers for reused in (False, True)}
        self._seq = itertools.count()

    # ---- order -----------------------------------------------------------------------------

    def next_rank(self, tier: Tier, num_owned_pages: int, num_reused_pages: int) -> tuple[bool, float] | None:
        """(reused, LRU time) of the leaf ``pop`` would take; None when nothing is evictable.
        ``num_owned_pages``: the tier's resident pages; ``num_reused_pages``: those reused."""
        never = self._top(tier, False)
        reused = self._top(tier, True)
        if reused is not None and (never is None or num_reused_pages > MAIN_SHARE * num_owned_pages):
            return True, reused
        return None if never is None else (False, never)

    def pop(self, tier: Tier, num_owned_pages: int, num_reused_pages: int) -> TreeNode | None:
        """Take the leaf to evict next from its heap (the caller clears it); None when none is."""
        rank = self.next_rank(tier, num_owned_pages, num_reused_pages)
        if rank is None:
            return None
        _, _, node = heapq.heappop(self._heaps[tier, rank[0]])    # current: next_rank's _top said so
        return node

    def push_if_evictable(self, node: TreeNode, tier: Tier) -> None:
        if not is_evictable(node, tier):
            return
        reused = node.reused[tier]
        heap = self._heaps[tier, reused]
        heapq.heappush(heap, (node.last_access[tier], next(self._seq), node))
        if len(heap) > 2 * self._num_nodes() + 64:
            self._rebuild(tier, reused)

    def check(self, tier: Tier) -> None:
        """The heap invariant: every evictable node has a current entry in its class's heap."""
        fresh = {id(node) for reused in (False, True) for last_access, _, node in self._heaps[tier, reused]
                 if self._is_current(last_access, node, tier, reused)}
        for node in self._nodes():
            if is_evictable(node, tier) and id(node) not in fresh:
                raise IntegrityError(f"evictable {node!r} has no current entry in the "
                                     f"{tier.label} eviction heap")

    def _top(self, tier: Tier, reused: bool) -> float | None:
        """The LRU time of the first current entry of a class's heap, stale ones dropped."""
        heap = self._heaps[tier, reused]
        while heap:
            last_access, _, node = heap[0]
            if self._is_current(last_access, node, tier, reused):
                return last_access
            heapq.heappop(heap)               # stale: an evictable node always has a current entry
        return None

    @staticmethod
    def _is_current(last_access: float, node: TreeNode, tier: Tier, reused: bool) -> bool:
        """Whether a heap entry of this class stands for the node as it is now."""
        return last_access == node.last_access[tier] and node.reused[tier] == reused and is_evictable(node, tier)

    def _rebuild(self, tier: Tier, reused: bool) -> None:
        heap = [(node.last_access[tier], next(self._seq), node) for node in self._nodes()
                if is_evictable(node, tier) and node.reused[tier] == reused]
        heapq.heapify(heap)
        self._heaps[tier, reused] = heap
