"""The prefix tree's invariants, checked from scratch over its nodes (tests call it after every
step), and a recount of what the tree keeps counted, for it to compare with its counters."""

from __future__ import annotations

from typing import NamedTuple, Sequence

from kvcached.core.tiers import IntegrityError, Tier
from kvcached.core.tree_node import TreeNode, subtree


class TreeRecount(NamedTuple):
    num_nodes: int                          # excluding the root
    owned_page_ids: dict[Tier, set[int]]    # resident page ids per tier
    protected_pages: dict[Tier, int]        # of locked nodes
    reused_pages: dict[Tier, int]           # of nodes reused in the tier


def check_nodes(root: TreeNode, tiers: Sequence[Tier], page_bytes: int) -> TreeRecount:
    """Check every node's links, keys, residency (prefix-closed, one id per page, no id twice in a
    tier), ref counts (a parent's >= each child's) and peer entries; returns the recount."""
    if root.parent is not None or root.key != b"" or root.num_pages != 0:
        raise IntegrityError("root must have no parent, no key and no pages")
    owned: dict[Tier, set[int]] = {t: set() for t in tiers}
    protected = dict.fromkeys(tiers, 0)
    reused_pages = dict.fromkeys(tiers, 0)
    num_page_ids = dict.fromkeys(tiers, 0)
    num_nodes = 0
    for node in subtree(root):
        num_resident_children = dict.fromkeys(tiers, 0)
        for map_key, child in node.children.items():
            if child.parent is not node:
                raise IntegrityError(f"{child!r} is in a child map but its parent link differs")
            if child.key[:page_bytes] != map_key:
                raise IntegrityError(f"{child!r} is keyed by bytes other than its first page")
            for tier in tiers:
                if child.page_ids[tier] is not None:
                    num_resident_children[tier] += 1
        if node.num_resident_children != num_resident_children:
            raise IntegrityError(f"{node!r} counts resident children {node.num_resident_children}"
                                 f", recount gives {num_resident_children}")
        for tier in tiers:
            if node.ref_count[tier] < 0:
                raise IntegrityError(f"{node!r} has negative ref_count in {tier.label}")
        if node is root:
            for tier in tiers:
                if node.page_ids[tier] != []:
                    raise IntegrityError("root must be resident with no pages in every tier")
            continue
        num_nodes += 1
        parent = node.parent
        if parent is None or parent.children.get(node.key[:page_bytes]) is not node:
            raise IntegrityError(f"{node!r} is not in its parent's child map")
        if node.num_pages < 1 or len(node.key) != node.num_pages * page_bytes:
            raise IntegrityError(f"{node!r} key of {len(node.key)} bytes is not "
                                 f"num_pages * {page_bytes} with num_pages >= 1")
        if not node.children and node.holds_nothing():
            raise IntegrityError(f"{node!r} is empty: no residency and no children")
        for owner, held in (node.peer or {}).items():
            if held.shape != (node.num_pages, 2) or not (held[:, 0] >= 0).any():
                raise IntegrityError(f"{node!r} holds a malformed or empty peer entry of owner {owner}")
        for tier in tiers:
            node_page_ids = node.page_ids[tier]
            if node.ref_count[tier] > parent.ref_count[tier]:
                raise IntegrityError(f"{node!r} ref_count exceeds its parent's in {tier.label}")
            if node_page_ids is None:
                if node.ref_count[tier] != 0:
                    raise IntegrityError(f"{node!r} is locked in {tier.label} but not resident")
                continue
            if parent.page_ids[tier] is None:
                raise IntegrityError(f"{node!r} is resident in {tier.label} but its parent is not")
            if len(node_page_ids) != node.num_pages:
                raise IntegrityError(f"{node!r} has {len(node_page_ids)} page ids in "
                                     f"{tier.label} for {node.num_pages} pages")
            if node_page_ids and min(node_page_ids) < 0:
                raise IntegrityError(f"{node!r} holds a negative page id in {tier.label}")
            # Summing lengths and comparing with the set size finds repeats in one pass.
            owned[tier].update(node_page_ids)
            num_page_ids[tier] += len(node_page_ids)
            if node.ref_count[tier] > 0:
                protected[tier] += node.num_pages
            if node.reused[tier]:
                reused_pages[tier] += node.num_pages
    for tier in tiers:
        if len(owned[tier]) != num_page_ids[tier]:
            raise IntegrityError(f"{num_page_ids[tier] - len(owned[tier])} page ids appear "
                                 f"more than once in {tier.label}")
    return TreeRecount(num_nodes, owned, protected, reused_pages)
