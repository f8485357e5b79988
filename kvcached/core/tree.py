"""One radix tree per namespace over page-aligned token ids, with per-tier residency.

Design notes
- Keys are the int32 little-endian bytes of token ids, whole pages only. A node's child map is
  keyed by the bytes of the child's first page, so a step down is one dict lookup and a whole
  edge is compared with one `bytes.startswith(key, offset)` (a memcmp, no copy).
- Each node holds, per tier, its page ids (None = not resident), a ref count and an LRU time.
  Residency is prefix-closed (a node resident in a tier has its parent resident there; the root
  counts as resident everywhere), so a tier's hit is the resident run from the root down.
- Per tier, the pages held, locked (ref counts) and reused are kept by ``tier_pages.py``.
- Splitting keeps the original node object as the LOWER (deeper) half and inserts a new upper
  node above it. A caller that holds a node (e.g. locked through a lease) therefore still holds
  the node that ends where it ended, and its heap entries stay valid.
- Eviction (``eviction.py``): a reuse-aware LRU over each tier's unlocked leaves; the tree tells
  it of every node that may have become evictable, been touched or been reused.
- Peer residency (``residency.py``) lives on the nodes too: ``node.peer`` maps an engine to its
  (block, epoch) per page of the node. The tree makes the paths it needs (``grow_path``), splits
  its entries with the node (telling ``on_peer_moved`` which blocks went to the upper half) and
  keeps a node that holds any.
"""

from __future__ import annotations

import collections
import operator
import time
from typing import Callable, Collection, Iterator, Sequence

import numpy as np

from kvcached.core.eviction import EvictionOrder
from kvcached.core.tier_pages import TierPages
from kvcached.core.tiers import IntegrityError, Tier
from kvcached.core.tree_integrity import check_nodes
from kvcached.core.tree_node import InsertResult, MatchResult, ResidentPages, TreeNode, subtree
from proto.tokens import TOKEN_BYTES, TOKEN_DTYPE, page_aligned, token_array

__all__ = ["InsertResult", "MatchResult", "PrefixTree", "ResidentPages", "TreeNode"]


class PrefixTree:
    def __init__(self, page_size: int, tiers: Sequence[Tier] = (Tier.L2, Tier.L3),
                 clock: Callable[[], float] = time.monotonic,
                 on_l2_root: Callable[[bytes, int], None] | None = None,
                 on_residency: Callable[[TreeNode, Tier, int], None] | None = None):
        """``on_l2_root(first page, +1 or -1)``: called as a path's first page enters or leaves L2
        (what ``kvcached.core.hints`` publishes: a request with no such first page has no L2 hit).
        ``on_residency(node, tier, +1 or -1)``: called as a node's pages enter or leave a tier, the
        node still in the tree (``TreeNode.path`` names its pages); the KV events are recorded from it."""
        page_size = operator.index(page_size)
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        tiers = tuple(Tier(t) for t in tiers)
        if not tiers or len(set(tiers)) != len(tiers):
            raise ValueError(f"tiers must be distinct and non-empty, got {tiers}")
        self.page_size = page_size
        self.tiers = tiers
        self._clock = clock
        self._page_bytes = page_size * TOKEN_BYTES
        self._root = TreeNode(None, b"", 0, tiers, clock())
        for tier in tiers:
            self._root.page_ids[tier] = []    # the root holds no pages but counts as resident
        self._num_nodes = 0                   # excluding the root
        self._pages = TierPages(tiers, self._root, self._page_bytes, on_l2_root, on_residency)
        self._eviction = EvictionOrder(tiers, self.nodes, lambda: self._num_nodes)
        # Told (owner, block ids, node) as a split moves peer entries to the new upper node.
        self.on_peer_moved: Callable[[int, list[int], TreeNode], None] | None = None

    # ---- queries -------------------------------------------------------------------------

    @property
    def root(self) -> TreeNode:
        return self._root

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of token ids (a key's unit)."""
        return self._page_bytes

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, not counting the root."""
        return self._num_nodes

    def owned_pages(self, tier: Tier) -> int:
        return self._pages.owned_pages(tier)

    def protected_pages(self, tier: Tier) -> int:
        """Resident pages with ref_count > 0 in `tier`: these cannot be evicted."""
        return self._pages.protected_pages(tier)

    def evictable_pages(self, tier: Tier) -> int:
        """Resident pages with ref_count 0: all of them can be freed by evict() (leaves first)."""
        return self._pages.owned_pages(tier) - self._pages.protected_pages(tier)

    def reused_pages(self, tier: Tier) -> int:
        return self._pages.reused_pages(tier)

    def oldest_evictable_access(self, tier: Tier) -> float | None:
        """The LRU time of the leaf evict() would free first; None when nothing is evictable."""
        rank = self.next_eviction_rank(tier)
        return None if rank is None else rank[1]

    def next_eviction_rank(self, tier: Tier) -> tuple[bool, float] | None:
        """(reused, LRU time) of the leaf evict() would free first; None when nothing is evictable.
        Ranks order pages by what evict() keeps longer: never reused before reused, then older
        before newer (while reused pages are within MAIN_SHARE of the tier)."""
        return self._eviction.next_rank(tier, self._pages.owned_pages(tier), self._pages.reused_pages(tier))

    def resident_pages(self, tier: Tier) -> ResidentPages:
        """Every page resident in `tier` with its node's LRU time, whether it is locked and reused."""
        tier = self._check_tier(tier)
        page_ids: list[int] = []
        last_access: list[float] = []
        reused: list[bool] = []
        locked: list[bool] = []
        for node in self.nodes():
            node_page_ids = node.page_ids[tier]
            if node is self._root or not node_page_ids:
                continue
            page_ids.extend(node_page_ids)
            last_access.extend([node.last_access[tier]] * len(node_page_ids))
            locked.extend([node.ref_count[tier] > 0] * len(node_page_ids))
            reused.extend([node.reused[tier]] * len(node_page_ids))
        return ResidentPages(np.array(page_ids, dtype=np.int64), np.array(last_access, dtype=np.float64),
                             np.array(locked, dtype=bool), np.array(reused, dtype=bool))

    # ---- match ---------------------------------------------------------------------------

    def match(self, token_ids, touch: bool = True, own_pages: int = 0, split: bool = True) -> MatchResult:
        """Longest cached prefix (page-aligned) per tier; splits the last node at the match end.

        touch=False (a lookup): no node's LRU time changes, so asking changes no eviction order.
        split=False (a read that only counts, e.g. LOOKUP): a hit ending inside an edge leaves the
        tree's shape as it was; the hit and page ids count that edge's matching pages, and
        ``last_node`` stops at the deepest whole node (never lock it for the partial pages).
        A touched hit node is reused in its tier where it reaches beyond ``own_pages``, the
        leading pages the caller holds itself (its own GPU cache; a write-through copying the
        path): a copy nobody reads from is not used."""
        assert split or not touch, "a match that touches its hit splits at its end"
        data = self.token_bytes(token_ids)
        page_bytes = self._page_bytes
        end = len(data)
        node = self._root
        path: list[TreeNode] = []
        partial_pages = 0           # with split=False: the matching pages of the last, unsplit edge
        pos = 0
        while pos < end:
            child = node.children.get(data[pos:pos + page_bytes])
            if child is None:
                break
            key = child.key
            if data.startswith(key, pos):
                path.append(child)
                pos += len(key)
                node = child
                continue
            # The edge matches only partly: split it at the last matching page boundary, so
            # every hit is made of whole nodes.
            num_common = self.num_common_pages(data, pos, key)
            if split:
                child = self._split(child, num_common)
            else:
                partial_pages = num_common
            path.append(child)
            pos += num_common * page_bytes
            break

        now = self._clock()
        own_bytes = own_pages * page_bytes
        hit_tokens: dict[Tier, int] = {}
        page_ids: dict[Tier, list[int]] = {}
        last_node: dict[Tier, TreeNode | None] = {}
        previous_access: dict[Tier, float | None] = {}
        for tier in self.tiers:
            tier_page_ids: list[int] = []
            deepest = previous = None
            end_bytes = 0
            for index, path_node in enumerate(path):
                node_page_ids = path_node.page_ids[tier]
                if node_page_ids is None:
                    break
                if partial_pages and index == len(path) - 1:
                    tier_page_ids.extend(node_page_ids[:partial_pages])
                    previous = path_node.last_access[tier]
                    break
                tier_page_ids.extend(node_page_ids)
                previous = path_node.last_access[tier]
                end_bytes += len(path_node.key)
                if touch:
                    path_node.last_access[tier] = now
                    if end_bytes > own_bytes:
                        self._pages.mark_reused(path_node, tier)
                deepest = path_node
            hit_tokens[tier] = len(tier_page_ids) * self.page_size
            page_ids[tier] = tier_page_ids
            last_node[tier] = deepest
            previous_access[tier] = previous
            if deepest is not None and touch:
                # Only the deepest hit node can be evictable: each shallower one has a resident
                # child on the path. Its LRU time (and maybe its class) changed: a fresh entry.
                self._eviction.push_if_evictable(deepest, tier)
        return MatchResult(hit_tokens, page_ids, last_node, pos // TOKEN_BYTES, previous_access)

    # ---- lock / unlock -------------------------------------------------------------------

    def lock(self, node: TreeNode, tier: Tier) -> None:
        """Protect node and its ancestors in `tier` from eviction (ref_count += 1)."""
        self._pages.lock(node, self._check_tier(tier))

    def unlock(self, node: TreeNode, tier: Tier) -> None:
        """Undo one lock(); ValueError (nothing changed) if the node is not locked."""
        self._pages.unlock(node, self._check_tier(tier))
        # Ancestors keep a resident child (this path), so only the node itself can become evictable.
        self._eviction.push_if_evictable(node, tier)

    def resident_nodes(self) -> Iterator[tuple[TreeNode, Tier]]:
        """Every (node, tier) the node is resident in, each parent before its children."""
        for node in self.nodes():
            if node is not self._root:
                for tier in self.tiers:
                    if node.page_ids[tier] is not None:
                        yield node, tier

    # ---- insert --------------------------------------------------------------------------

    def insert(self, token_ids, tier: Tier, page_ids: Sequence[int],
               start_page: int = 0) -> InsertResult:
        """Make pages [start_page, start_page + len(page_ids)) of token_ids resident in `tier`.

        token_ids must cover at least those pages (extra tokens are ignored). The prefix
        [0, start_page) must already be resident in `tier`. Pages the tree already holds in
        `tier` are kept; the caller's ids for them come back in duplicate_page_ids to be freed.
        """
        tier = self._check_tier(tier)
        start_page = operator.index(start_page)
        if start_page < 0:
            raise ValueError(f"start_page must be >= 0, got {start_page}")
        new_page_ids = [operator.index(p) for p in page_ids]
        total_pages = start_page + len(new_page_ids)
        data = self.token_bytes(token_ids)
        page_bytes = self._page_bytes
        if len(data) < total_pages * page_bytes:
            raise ValueError(f"token_ids cover {len(data) // page_bytes} pages, "
                             f"insert needs {total_pages}")
        data = data[:total_pages * page_bytes]
        self._pages.check_new_page_ids(tier, new_page_ids)
        resident_pages = self._resident_prefix_pages(data, tier, start_page)
        if resident_pages < start_page:
            raise ValueError(f"prefix of {start_page} pages is not resident in {tier.label} "
                             f"(only {resident_pages})")
        if total_pages == 0:
            return InsertResult(0, [], None)

        now = self._clock()
        node = self._root
        page = 0
        new_pages = 0
        duplicate_page_ids: list[int] = []
        while page < total_pages:
            pos = page * page_bytes
            child = node.children.get(data[pos:pos + page_bytes])
            if child is None:
                # Validation above guarantees page >= start_page here.
                child = TreeNode(node, data[pos:], total_pages - page, self.tiers, now)
                node.children[data[pos:pos + page_bytes]] = child
                self._num_nodes += 1
                self._pages.make_resident(child, tier, new_page_ids[page - start_page:])
                new_pages += total_pages - page
                node = child
                break
            num_common = self.num_common_pages(data, pos, child.key)
            if num_common < child.num_pages:
                child = self._split(child, num_common)
            if child.is_resident(tier):
                # Our ids for the part of this node at or after start_page are duplicates.
                first_ours = max(page, start_page) - start_page
                end_ours = page + num_common - start_page
                if end_ours > first_ours:
                    duplicate_page_ids.extend(new_page_ids[first_ours:end_ours])
            else:
                # A node not resident in `tier` lies wholly at or after start_page (validated).
                self._pages.make_resident(
                    child, tier, new_page_ids[page - start_page:page - start_page + num_common])
                new_pages += num_common
            child.last_access[tier] = now
            node = child
            page += num_common
        node.last_access[tier] = now
        # Every other node on the path has a resident child (the next one), so only the last
        # node can be evictable, and its LRU time just changed.
        self._eviction.push_if_evictable(node, tier)
        return InsertResult(new_pages, duplicate_page_ids, node)

    def insert_child(self, parent: TreeNode | None, tier: Tier, key: bytes,
                     page_ids: Sequence[int]) -> TreeNode:
        """Add a new node below ``parent`` (None: the root) holding the whole pages ``key``,
        resident in ``tier`` with ``page_ids``; returns it. For rebuilding a tree one chain of
        pages at a time (the L3 index at start): no token path from the root is needed, so the
        work and memory are those of the chain alone. ``parent`` must be resident in ``tier``,
        end where ``key`` begins and have no child starting with ``key``'s first page."""
        tier = self._check_tier(tier)
        parent = self._root if parent is None else parent
        key = bytes(key)
        page_bytes = self._page_bytes
        new_page_ids = [operator.index(p) for p in page_ids]
        num_pages = len(new_page_ids)
        if num_pages == 0 or len(key) != num_pages * page_bytes:
            raise ValueError(f"key of {len(key)} bytes for {num_pages} pages of {page_bytes} bytes")
        if parent is not self._root and (parent.parent is None or not parent.is_resident(tier)):
            raise ValueError(f"parent {parent!r} is not in the tree, resident in {tier.label}")
        if key[:page_bytes] in parent.children:
            raise ValueError("the parent has a child starting with that page already")
        self._pages.check_new_page_ids(tier, new_page_ids)
        node = TreeNode(parent, key, num_pages, self.tiers, self._clock())
        parent.children[key[:page_bytes]] = node
        self._num_nodes += 1
        self._pages.make_resident(node, tier, new_page_ids)
        self._eviction.push_if_evictable(node, tier)
        return node

    # ---- evict ---------------------------------------------------------------------------

    def evict(self, tier: Tier, num_pages: int) -> list[int]:
        """Free unlocked leaves of `tier` until num_pages freed or none left: in the order of
        next_eviction_rank (never reused first, least recently used first within a class)."""
        tier = self._check_tier(tier)
        num_pages = operator.index(num_pages)
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        freed: list[int] = []
        while len(freed) < num_pages:
            node = self._eviction.pop(tier, self._pages.owned_pages(tier), self._pages.reused_pages(tier))
            if node is None:
                break
            parent = node.parent
            freed.extend(self._pages.clear(node, tier))
            self.remove_if_empty(node)
            if parent is not self._root:
                self._eviction.push_if_evictable(parent, tier)
        return freed

    # ---- discard -------------------------------------------------------------------------

    def discard(self, token_ids, tier: Tier, from_page: int) -> list[int]:
        """Clear `tier`'s residency of page `from_page` of this path and of everything below it
        (residency is prefix-closed: what lies below a page cannot stay without it); returns the
        freed page ids. Frees nothing when the path does not reach that page, the page is not
        resident in `tier`, or it (or anything below it) is locked there."""
        tier = self._check_tier(tier)
        from_page = operator.index(from_page)
        data = self.token_bytes(token_ids)
        page_bytes = self._page_bytes
        if not 0 <= from_page < len(data) // page_bytes:
            return []
        for target, page, num_common in self.walk(data):
            if page + target.num_pages > from_page:
                break
        else:
            return []
        if num_common <= from_page - page:
            return []
        if from_page > page:
            self._split(target, from_page - page)      # target stays the lower half, from from_page on
        # A parent's ref count is >= each child's, so an unlocked target has an unlocked subtree.
        if target.page_ids[tier] is None or target.ref_count[tier] > 0:
            return []
        return self._clear_subtree(target, tier)

    def discard_pages(self, tier: Tier, page_ids: Collection[int]) -> list[int]:
        """Clear `tier`'s residency of every page in page_ids and of everything below each (what
        lies below a page cannot stay without it); returns every page id freed, those below
        included. ValueError, and nothing changed, when one of them is locked in `tier`. Walks the
        whole tree: for the rare moves of a chunk of the pool between namespaces."""
        tier = self._check_tier(tier)
        wanted = set(page_ids)
        targets: list[tuple[TreeNode, int]] = []
        queue = collections.deque([self._root])
        while queue:                          # breadth first: ancestors before descendants
            node = queue.popleft()
            queue.extend(node.children.values())
            node_page_ids = node.page_ids[tier]
            if node is self._root or not node_page_ids:
                continue
            first = next((i for i, page_id in enumerate(node_page_ids) if page_id in wanted), None)
            if first is None:
                continue
            if node.ref_count[tier] > 0:
                raise ValueError(f"page {node_page_ids[first]} is locked in {tier.label}")
            targets.append((node, first))
        freed: list[int] = []
        for node, first in targets:
            if node.page_ids[tier] is None:  # cleared with an ancestor's subtree
                continue
            if first > 0:
                self._split(node, first)      # node stays the lower half, from its first wanted page on
            freed.extend(self._clear_subtree(node, tier))
        return freed

    def _clear_subtree(self, target: TreeNode, tier: Tier) -> list[int]:
        """Clear `tier`'s residency of target and everything below it (all unlocked)."""
        freed: list[int] = []
        cleared: list[TreeNode] = []
        stack = [target]
        while stack:
            current = stack.pop()
            if current.page_ids[tier] is None:
                continue
            freed.extend(self._pages.clear(current, tier))
            cleared.append(current)
            stack.extend(current.children.values())
        parent = target.parent
        for current in reversed(cleared):       # deepest first: a node goes once its children have
            self.remove_if_empty(current)
        if parent is not self._root and parent.parent is not None:
            self._eviction.push_if_evictable(parent, tier)
        return freed

    # ---- paths made for peer residency (residency.py) -----------------------------------------

    def grow_path(self, data: bytes, total_pages: int) -> list[tuple[TreeNode, int]]:
        """The nodes of data's path (token bytes, whole pages) down to page total_pages, made where
        missing (holding nothing in any tier) and split where data leaves an edge; each with the
        index of its first page. A node made here that ends up holding nothing must be dropped
        (``remove_if_empty``)."""
        page_bytes = self._page_bytes
        node, page, path = self._root, 0, []
        while page < total_pages:
            pos = page * page_bytes
            child = node.children.get(data[pos:pos + page_bytes])
            if child is None:
                child = TreeNode(node, data[pos:], total_pages - page, self.tiers, self._clock())
                node.children[data[pos:pos + page_bytes]] = child
                self._num_nodes += 1
                path.append((child, page))
                break
            num_common = self.num_common_pages(data, pos, child.key)
            if num_common < child.num_pages and page + num_common < total_pages:
                child = self._split(child, num_common)      # data leaves this edge: branch off there
            path.append((child, page))
            page += min(num_common, child.num_pages)
            node = child
        return path

    # ---- integrity -----------------------------------------------------------------------

    def check_integrity(self) -> dict[Tier, set[int]]:
        """Check every invariant from scratch; returns the page ids the tree owns per tier."""
        recount = check_nodes(self._root, self.tiers, self._page_bytes)
        if recount.num_nodes != self._num_nodes:
            raise IntegrityError(f"num_nodes {self._num_nodes} != recount {recount.num_nodes}")
        self._pages.check(recount)
        for tier in self.tiers:
            self._eviction.check(tier)
        return recount.owned_page_ids

    # ---- internals -----------------------------------------------------------------------

    def token_bytes(self, token_ids) -> bytes:
        data = token_array(token_ids).tobytes()
        return data[:page_aligned(len(data), self._page_bytes)]

    def num_common_pages(self, data: bytes, pos: int, key: bytes) -> int:
        """Whole pages shared by data[pos:] and key (the first page is known to match)."""
        num_bytes = min(len(key), len(data) - pos)
        if data.startswith(key[:num_bytes], pos):
            return num_bytes // self._page_bytes
        ours = np.frombuffer(data, dtype=TOKEN_DTYPE, count=num_bytes // TOKEN_BYTES,
                             offset=pos)
        theirs = np.frombuffer(key, dtype=TOKEN_DTYPE, count=num_bytes // TOKEN_BYTES)
        first_mismatch = int(np.argmax(ours != theirs))
        return first_mismatch // self.page_size

    def _split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Split node after num_pages; returns the new upper node (the original stays below it,
        unless only peer residency above the split made it hold anything: then it goes)."""
        assert 0 < num_pages < node.num_pages, (num_pages, node.num_pages)
        split_bytes = num_pages * self._page_bytes
        parent = node.parent
        upper = TreeNode(parent, node.key[:split_bytes], num_pages, self.tiers, 0.0)
        for tier in self.tiers:
            node_page_ids = node.page_ids[tier]
            if node_page_ids is not None:
                upper.page_ids[tier] = node_page_ids[:num_pages]
                node.page_ids[tier] = node_page_ids[num_pages:]
                upper.num_resident_children[tier] = 1
            # Both halves carry the node's locks, so an unlock through either stays balanced;
            # the protected-page total is unchanged (the same pages, now on two nodes).
            upper.ref_count[tier] = node.ref_count[tier]
            upper.last_access[tier] = node.last_access[tier]
            upper.reused[tier] = node.reused[tier]        # the same pages, counted once either way
        if node.peer is not None:
            upper_peer, lower_peer = {}, {}
            for owner, held in node.peer.items():
                top, bottom = held[:num_pages].copy(), held[num_pages:].copy()
                if (top[:, 0] >= 0).any():
                    upper_peer[owner] = top
                    if self.on_peer_moved is not None:
                        self.on_peer_moved(owner, top[:, 0][top[:, 0] >= 0].tolist(), upper)
                if (bottom[:, 0] >= 0).any():
                    lower_peer[owner] = bottom
            upper.peer, node.peer = upper_peer or None, lower_peer or None
        node.key = node.key[split_bytes:]
        node.num_pages -= num_pages
        node.parent = upper
        upper.children[node.key[:self._page_bytes]] = node
        parent.children[upper.key[:self._page_bytes]] = upper
        self._num_nodes += 1
        if not node.children and node.holds_nothing():
            # A peer held only pages above the split: the lower half holds nothing and goes.
            del upper.children[node.key[:self._page_bytes]]
            node.parent = None
            self._num_nodes -= 1
        return upper

    def remove_if_empty(self, node: TreeNode) -> None:
        """Drop node, then its emptied ancestors, while they hold nothing in any tier. A node
        dropped already (with a child that emptied it) has no parent: nothing to do."""
        while node.parent is not None and not node.children and node.holds_nothing():
            parent = node.parent
            del parent.children[node.key[:self._page_bytes]]
            node.parent = None
            self._num_nodes -= 1
            node = parent

    def nodes(self) -> Iterator[TreeNode]:
        return subtree(self._root)

    def walk(self, data: bytes) -> Iterator[tuple[TreeNode, int, int]]:
        """The nodes data's path (token bytes, whole pages) enters from the root down, each with
        its first page and the pages data shares with it; the walk ends at the first node data
        shares only partly. Changes nothing."""
        page_bytes = self._page_bytes
        node, pos = self._root, 0
        while pos < len(data):
            child = node.children.get(data[pos:pos + page_bytes])
            if child is None:
                return
            num_common = self.num_common_pages(data, pos, child.key)
            yield child, pos // page_bytes, num_common
            if num_common < child.num_pages:
                return
            pos += num_common * page_bytes
            node = child

    def _resident_prefix_pages(self, data: bytes, tier: Tier, limit_pages: int) -> int:
        """Pages of data's prefix resident in `tier`, counted up to at least limit_pages (no mutation)."""
        num_pages = 0
        for node, page, num_common in self.walk(data):
            if page >= limit_pages or node.page_ids[tier] is None:
                break
            num_pages = page + num_common
        return num_pages

    def _check_tier(self, tier: Tier) -> Tier:
        if tier not in self.tiers:
            raise ValueError(f"tier {tier!r} is not one of this tree's tiers {self.tiers}")
        return Tier(tier)
