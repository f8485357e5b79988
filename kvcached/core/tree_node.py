"""The prefix tree's node and what its operations return.

A node holds whole pages of token ids (its ``key``: int32 little-endian bytes) and, per tier, its
page ids (None = not resident), a ref count, an LRU time and whether a match reused it there.
Peer residency (``residency.py``) lives on the nodes too: ``node.peer`` maps an engine to its
(block, epoch) per page of the node.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

import numpy as np

from kvcached.core.tiers import Tier


class TreeNode:
    __slots__ = ("parent", "children", "key", "num_pages", "page_ids", "ref_count",
                 "last_access", "reused", "num_resident_children", "peer")

    def __init__(self, parent: TreeNode | None, key: bytes, num_pages: int,
                 tiers: Sequence[Tier], now: float):
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.key = key
        self.num_pages = num_pages
        self.page_ids: dict[Tier, list[int] | None] = dict.fromkeys(tiers)
        self.ref_count: dict[Tier, int] = dict.fromkeys(tiers, 0)
        self.last_access: dict[Tier, float] = dict.fromkeys(tiers, now)
        self.reused: dict[Tier, bool] = dict.fromkeys(tiers, False)     # hit by a match in the tier
        # Children resident in each tier; a node with none is a leaf for that tier's eviction.
        self.num_resident_children: dict[Tier, int] = dict.fromkeys(tiers, 0)
        # owner -> int64 [num_pages, 2]: (block id, epoch) per page, block -1 where it holds none
        self.peer: dict[int, np.ndarray] | None = None

    def path(self) -> bytes:
        """The token bytes of the path from the root through this node (whole pages)."""
        keys = []
        node: TreeNode | None = self
        while node is not None:
            keys.append(node.key)
            node = node.parent
        return b"".join(reversed(keys))

    def holds_nothing(self) -> bool:
        return self.peer is None and all(ids is None for ids in self.page_ids.values())

    def is_resident(self, tier: Tier) -> bool:
        return self.page_ids[tier] is not None

    def __repr__(self) -> str:
        resident = ",".join(t.label for t, ids in self.page_ids.items() if ids is not None)
        return f"TreeNode(num_pages={self.num_pages}, resident=[{resident}])"


def subtree(root: TreeNode) -> Iterator[TreeNode]:
    """Every node from root down, each parent before its children."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


class MatchResult(NamedTuple):
    hit_tokens: dict[Tier, int]
    page_ids: dict[Tier, list[int]]
    last_node: dict[Tier, TreeNode | None]
    matched_tokens: int
    # Per tier, the LRU time of the deepest hit node before this match touched it (None: no hit):
    # when the prefix was last used there.
    previous_access: dict[Tier, float | None] = {}


class ResidentPages(NamedTuple):
    page_ids: np.ndarray        # int64
    last_access: np.ndarray     # float64: the LRU time of each page's node
    locked: np.ndarray          # bool: its node's ref count is > 0
    reused: np.ndarray          # bool: its node was hit by a match in the tier


class InsertResult(NamedTuple):
    new_pages: int
    duplicate_page_ids: list[int]
    last_node: TreeNode | None
