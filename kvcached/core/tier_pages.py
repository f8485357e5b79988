"""Per tier, the pages a prefix tree holds: their ids, how many are locked and how many reused,
and the callbacks told as a node's pages enter or leave a tier.

Ref counts: ``lock`` adds one to a node and all its ancestors, so a parent's count is >= each
child's and a node with ref_count 0 has a whole subtree with ref_count 0 in that tier. A node's
``reused`` flag outlives its residency (see ``eviction.py``); only resident pages are counted.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvcached.core.tiers import IntegrityError, Tier
from kvcached.core.tree_integrity import TreeRecount
from kvcached.core.tree_node import TreeNode


class TierPages:
    """``on_l2_root(first page, +1 or -1)`` and ``on_residency(node, tier, +1 or -1)``: see
    ``PrefixTree``."""

    def __init__(self, tiers: Sequence[Tier], root: TreeNode, page_bytes: int,
                 on_l2_root: Callable[[bytes, int], None] | None,
                 on_residency: Callable[[TreeNode, Tier, int], None] | None):
        self._root = root
        self._page_bytes = page_bytes
        self._on_l2_root = on_l2_root
        self._on_residency = on_residency
        self._owned_page_ids: dict[Tier, set[int]] = {t: set() for t in tiers}
        self._num_protected_pages: dict[Tier, int] = dict.fromkeys(tiers, 0)
        self._num_reused_pages: dict[Tier, int] = dict.fromkeys(tiers, 0)

    def owned_pages(self, tier: Tier) -> int:
        return len(self._owned_page_ids[tier])

    def protected_pages(self, tier: Tier) -> int:
        return self._num_protected_pages[tier]

    def reused_pages(self, tier: Tier) -> int:
        return self._num_reused_pages[tier]

    def check_new_page_ids(self, tier: Tier, new_page_ids: list[int]) -> None:
        """ValueError if one of new_page_ids is negative, repeated or owned in `tier` already."""
        if any(p < 0 for p in new_page_ids):
            raise ValueError("page ids must be >= 0")
        if len(set(new_page_ids)) != len(new_page_ids):
            raise ValueError("page ids repeated in one call")
        owned = self._owned_page_ids[tier]
        already_owned = [p for p in new_page_ids if p in owned]
        if already_owned:
            raise ValueError(f"page ids already owned by the tree in {tier.label}: {already_owned[:8]}")

    # ---- residency -------------------------------------------------------------------------

    def make_resident(self, node: TreeNode, tier: Tier, page_ids: list[int]) -> None:
        assert node.page_ids[tier] is None and len(page_ids) == node.num_pages
        node.page_ids[tier] = page_ids
        self._owned_page_ids[tier].update(page_ids)
        if node.reused[tier]:                  # reused while it was here before (the node stayed)
            self._num_reused_pages[tier] += node.num_pages
        node.parent.num_resident_children[tier] += 1
        self._residency_changed(node, tier, 1)

    def clear(self, node: TreeNode, tier: Tier) -> list[int]:
        """Undo make_resident (the node stays in the tree); returns its page ids, now freed."""
        freed = node.page_ids[tier]
        self._owned_page_ids[tier].difference_update(freed)
        if node.reused[tier]:
            self._num_reused_pages[tier] -= node.num_pages
        node.page_ids[tier] = None
        node.parent.num_resident_children[tier] -= 1
        self._residency_changed(node, tier, -1)
        return freed

    def mark_reused(self, node: TreeNode, tier: Tier) -> None:
        """A match used node's pages in `tier` (the node is resident there)."""
        if not node.reused[tier]:
            node.reused[tier] = True
            self._num_reused_pages[tier] += node.num_pages

    def _residency_changed(self, node: TreeNode, tier: Tier, delta: int) -> None:
        """Node's residency in tier changed by delta: reported to on_residency, and to on_l2_root
        where it is a path's first page in L2."""
        if self._on_residency is not None:
            self._on_residency(node, tier, delta)
        if tier is Tier.L2 and node.parent is self._root and self._on_l2_root is not None:
            self._on_l2_root(node.key[:self._page_bytes], delta)

    # ---- locks -----------------------------------------------------------------------------

    def lock(self, node: TreeNode, tier: Tier) -> None:
        """Protect node and its ancestors in `tier` from eviction (ref_count += 1)."""
        self._check_lockable(node, tier)
        current = node
        while current is not None:
            current.ref_count[tier] += 1
            if current.ref_count[tier] == 1:
                self._num_protected_pages[tier] += current.num_pages
            current = current.parent

    def unlock(self, node: TreeNode, tier: Tier) -> None:
        """Undo one lock(); ValueError (nothing changed) if the node is not locked."""
        self._check_lockable(node, tier)
        # Ancestors' counts are >= the node's, so checking the node covers the whole path.
        if node.ref_count[tier] < 1:
            raise ValueError(f"unlock of a node that is not locked in {tier.label}")
        current = node
        while current is not None:
            current.ref_count[tier] -= 1
            if current.ref_count[tier] == 0:
                self._num_protected_pages[tier] -= current.num_pages
            current = current.parent

    def _check_lockable(self, node: TreeNode, tier: Tier) -> None:
        if node is self._root:
            raise ValueError("the root cannot be locked or unlocked")
        if node.parent is None or node.page_ids[tier] is None:
            raise ValueError(f"{node!r} is not resident in {tier.label} (or not in the tree)")

    def check(self, recount: TreeRecount) -> None:
        """The counts kept as pages come and go equal a recount over the nodes."""
        for tier, owned in self._owned_page_ids.items():
            if recount.owned_page_ids[tier] != owned:
                raise IntegrityError(f"owned page ids of {tier.label} disagree with a recount")
            if recount.protected_pages[tier] != self._num_protected_pages[tier]:
                raise IntegrityError(f"protected pages of {tier.label}: {self._num_protected_pages[tier]}"
                                     f" != recount {recount.protected_pages[tier]}")
            if recount.reused_pages[tier] != self._num_reused_pages[tier]:
                raise IntegrityError(f"reused pages of {tier.label}: {self._num_reused_pages[tier]}"
                                     f" != recount {recount.reused_pages[tier]}")
