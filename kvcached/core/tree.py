"""One radix tree per namespace over page-aligned token ids, with per-tier residency.

Design notes
- Keys are the int32 little-endian bytes of token ids, whole pages only. A node's child map is
  keyed by the bytes of the child's first page, so a step down is one dict lookup and a whole
  edge is compared with one `bytes.startswith(key, offset)` (a memcmp, no copy).
- Each node holds, per tier, its page ids (None = not resident), a ref count and an LRU time.
  Residency is prefix-closed (a node resident in a tier has its parent resident there; the root
  counts as resident everywhere), so a tier's hit is the resident run from the root down.
- Ref counts: lock() adds one to a node and all its ancestors, so a parent's count is >= each
  child's and a node with ref_count 0 has a whole subtree with ref_count 0 in that tier.
- Splitting keeps the original node object as the LOWER (deeper) half and inserts a new upper
  node above it. A caller that holds a node (e.g. locked through a lease) therefore still holds
  the node that ends where it ended, and its heap entries stay valid.
- Eviction knows reuse (S3-FIFO's idea on a tree of leaves): a node resident in a tier is
  "reused" there once a match hits it (insertion is not use). Leaves never reused go first, oldest
  first, so a flood of one-use prompts churns among themselves; reused leaves go first only while
  reused pages exceed MAIN_SHARE of the tier's pages (or nothing else is evictable), so old
  reuse cannot hold the whole tier and a new working set still gets room to be reused. The flag
  outlives residency while the node stays in the tree (L3 or children keep it): a prefix reused
  before comes back to L2 as reused (S3-FIFO's ghost queue, for free).
- Eviction uses one lazy min-heap per tier and class (never reused, reused) of (last_access, seq,
  node). Invariant: every node that is evictable in a tier has an entry in its class's heap whose
  time equals its current last_access there; stale entries (an older time, or the other class)
  are skipped when popped, and a heap is rebuilt once it holds many more entries than the tree
  has nodes.
- Peer residency (``residency.py``) lives on the nodes too: ``node.peer`` maps an engine to its
  (block, epoch) per page of the node. The tree makes the paths it needs (``grow_path``), splits
  its entries with the node (telling ``on_peer_moved`` which blocks went to the upper half) and
  keeps a node that holds any.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import operator
import time
from typing import Callable, Collection, Iterator, NamedTuple, Sequence

import numpy as np

from kvcached.core.tiers import IntegrityError, Tier
from proto.tokens import TOKEN_BYTES, TOKEN_DTYPE, page_aligned, token_array

MAIN_SHARE = 0.9         # of a tier's pages, reused pages above which reused leaves are evicted first


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
        self._on_l2_root = on_l2_root
        self._on_residency = on_residency
        self._root = TreeNode(None, b"", 0, tiers, clock())
        for tier in tiers:
            self._root.page_ids[tier] = []    # the root holds no pages but counts as resident
        self._num_nodes = 0                   # excluding the root
        self._owned_page_ids: dict[Tier, set[int]] = {t: set() for t in tiers}
        self._num_protected_pages: dict[Tier, int] = dict.fromkeys(tiers, 0)
        # (tier, reused) -> the lazy min-heap of that class's evictable leaves
        self._evict_heaps: dict[tuple[Tier, bool], list[tuple[float, int, TreeNode]]] = {
            (t, reused): [] for t in tiers for reused in (False, True)}
        self._num_reused_pages: dict[Tier, int] = dict.fromkeys(tiers, 0)
        self._heap_seq = itertools.count()
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
        return len(self._owned_page_ids[tier])

    def protected_pages(self, tier: Tier) -> int:
        """Resident pages with ref_count > 0 in `tier`: these cannot be evicted."""
        return self._num_protected_pages[tier]

    def evictable_pages(self, tier: Tier) -> int:
        """Resident pages with ref_count 0: all of them can be freed by evict() (leaves first)."""
        return len(self._owned_page_ids[tier]) - self._num_protected_pages[tier]

    def reused_pages(self, tier: Tier) -> int:
        return self._num_reused_pages[tier]

    def oldest_evictable_access(self, tier: Tier) -> float | None:
        """The LRU time of the leaf evict() would free first; None when nothing is evictable."""
        rank = self.next_eviction_rank(tier)
        return None if rank is None else rank[1]

    def next_eviction_rank(self, tier: Tier) -> tuple[bool, float] | None:
        """(reused, LRU time) of the leaf evict() would free first; None when nothing is evictable.
        Ranks order pages by what evict() keeps longer: never reused before reused, then older
        before newer (while reused pages are within MAIN_SHARE of the tier)."""
        never = self._heap_top(tier, False)
        reused = self._heap_top(tier, True)
        if reused is not None and (never is None or self._num_reused_pages[tier] > MAIN_SHARE * len(
                self._owned_page_ids[tier])):
            return True, reused
        return None if never is None else (False, never)

    def _heap_top(self, tier: Tier, reused: bool) -> float | None:
        """The LRU time of the first current entry of a class's heap, stale ones dropped."""
        heap = self._evict_heaps[tier, reused]
        while heap:
            last_access, _, node = heap[0]
            if self._is_current(last_access, node, tier, reused):
                return last_access
            heapq.heappop(heap)               # stale: an evictable node always has a current entry
        return None

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

    def match(self, token_ids, touch: bool = True, own_pages: int = 0) -> MatchResult:
        """Longest cached prefix (page-aligned) per tier; splits the last node at the match end.

        touch=False (a lookup): no node's LRU time changes, so asking changes no eviction order.
        A touched hit node is reused in its tier where it reaches beyond ``own_pages``, the
        leading pages the caller holds itself (its own GPU cache; a write-through copying the
        path): a copy nobody reads from is not used."""
        data = self.token_bytes(token_ids)
        page_bytes = self._page_bytes
        end = len(data)
        node = self._root
        path: list[TreeNode] = []
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
            child = self._split(child, num_common)
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
            for path_node in path:
                node_page_ids = path_node.page_ids[tier]
                if node_page_ids is None:
                    break
                tier_page_ids.extend(node_page_ids)
                previous = path_node.last_access[tier]
                end_bytes += len(path_node.key)
                if touch:
                    path_node.last_access[tier] = now
                    if not path_node.reused[tier] and end_bytes > own_bytes:
                        path_node.reused[tier] = True
                        self._num_reused_pages[tier] += path_node.num_pages
                deepest = path_node
            hit_tokens[tier] = len(tier_page_ids) * self.page_size
            page_ids[tier] = tier_page_ids
            last_node[tier] = deepest
            previous_access[tier] = previous
            if deepest is not None and touch:
                # Only the deepest hit node can be evictable: each shallower one has a resident
                # child on the path. Its LRU time (and maybe its class) changed: a fresh entry.
                self._push_if_evictable(deepest, tier)
        return MatchResult(hit_tokens, page_ids, last_node, pos // TOKEN_BYTES, previous_access)

    # ---- lock / unlock -------------------------------------------------------------------

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
        # Ancestors keep a resident child (this path), so only the node itself can become evictable.
        self._push_if_evictable(node, tier)

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
        if any(p < 0 for p in new_page_ids):
            raise ValueError("page ids must be >= 0")
        if len(set(new_page_ids)) != len(new_page_ids):
            raise ValueError("page ids repeated in one insert")
        owned = self._owned_page_ids[tier]
        already_owned = [p for p in new_page_ids if p in owned]
        if already_owned:
            raise ValueError(f"page ids already owned by the tree in {tier.label}: {already_owned[:8]}")
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
                self._make_resident(child, tier, new_page_ids[page - start_page:])
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
                self._make_resident(
                    child, tier, new_page_ids[page - start_page:page - start_page + num_common])
                new_pages += num_common
            child.last_access[tier] = now
            node = child
            page += num_common
        node.last_access[tier] = now
        # Every other node on the path has a resident child (the next one), so only the last
        # node can be evictable, and its LRU time just changed.
        self._push_if_evictable(node, tier)
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
        if len(set(new_page_ids)) != num_pages or any(p < 0 for p in new_page_ids):
            raise ValueError("page ids must be distinct and >= 0")
        owned = self._owned_page_ids[tier]
        already_owned = [p for p in new_page_ids if p in owned]
        if already_owned:
            raise ValueError(f"page ids already owned by the tree in {tier.label}: {already_owned[:8]}")
        node = TreeNode(parent, key, num_pages, self.tiers, self._clock())
        parent.children[key[:page_bytes]] = node
        self._num_nodes += 1
        self._make_resident(node, tier, new_page_ids)
        self._push_if_evictable(node, tier)
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
            rank = self.next_eviction_rank(tier)
            if rank is None:
                break
            _, _, node = heapq.heappop(self._evict_heaps[tier, rank[0]])     # current: next_eviction_rank said so
            node_page_ids = node.page_ids[tier]
            if node.reused[tier]:
                self._num_reused_pages[tier] -= node.num_pages
            freed.extend(node_page_ids)
            self._owned_page_ids[tier].difference_update(node_page_ids)
            node.page_ids[tier] = None
            parent = node.parent
            parent.num_resident_children[tier] -= 1
            self._residency_changed(node, tier, -1)
            self.remove_if_empty(node)
            if parent is not self._root:
                self._push_if_evictable(parent, tier)
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
        node, page = self._root, 0
        while True:
            pos = page * page_bytes
            child = node.children.get(data[pos:pos + page_bytes])
            if child is None:
                return []
            num_common = self.num_common_pages(data, pos, child.key)
            if page + child.num_pages <= from_page:
                if num_common < child.num_pages:
                    return []
                node, page = child, page + child.num_pages
                continue
            if num_common <= from_page - page:
                return []
            if from_page > page:
                self._split(child, from_page - page)      # child stays the lower half, from from_page on
            target = child
            break
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
            freed.extend(current.page_ids[tier])
            self._owned_page_ids[tier].difference_update(current.page_ids[tier])
            if current.reused[tier]:
                self._num_reused_pages[tier] -= current.num_pages
            current.page_ids[tier] = None
            current.parent.num_resident_children[tier] -= 1
            self._residency_changed(current, tier, -1)
            cleared.append(current)
            stack.extend(current.children.values())
        parent = target.parent
        for current in reversed(cleared):       # deepest first: a node goes once its children have
            self.remove_if_empty(current)
        if parent is not self._root and parent.parent is not None:
            self._push_if_evictable(parent, tier)
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
        root = self._root
        page_bytes = self._page_bytes
        if root.parent is not None or root.key != b"" or root.num_pages != 0:
            raise IntegrityError("root must have no parent, no key and no pages")
        owned: dict[Tier, set[int]] = {t: set() for t in self.tiers}
        protected = dict.fromkeys(self.tiers, 0)
        reused_pages = dict.fromkeys(self.tiers, 0)
        num_page_ids = dict.fromkeys(self.tiers, 0)
        num_nodes = 0
        for node in self.nodes():
            num_resident_children = dict.fromkeys(self.tiers, 0)
            for map_key, child in node.children.items():
                if child.parent is not node:
                    raise IntegrityError(f"{child!r} is in a child map but its parent link differs")
                if child.key[:page_bytes] != map_key:
                    raise IntegrityError(f"{child!r} is keyed by bytes other than its first page")
                for tier in self.tiers:
                    if child.page_ids[tier] is not None:
                        num_resident_children[tier] += 1
            if node.num_resident_children != num_resident_children:
                raise IntegrityError(f"{node!r} counts resident children {node.num_resident_children}"
                                     f", recount gives {num_resident_children}")
            for tier in self.tiers:
                if node.ref_count[tier] < 0:
                    raise IntegrityError(f"{node!r} has negative ref_count in {tier.label}")
            if node is root:
                for tier in self.tiers:
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
            for tier in self.tiers:
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
        if num_nodes != self._num_nodes:
            raise IntegrityError(f"num_nodes {self._num_nodes} != recount {num_nodes}")
        for tier in self.tiers:
            if len(owned[tier]) != num_page_ids[tier]:
                raise IntegrityError(f"{num_page_ids[tier] - len(owned[tier])} page ids appear "
                                     f"more than once in {tier.label}")
            if owned[tier] != self._owned_page_ids[tier]:
                raise IntegrityError(f"owned page ids of {tier.label} disagree with a recount")
            if protected[tier] != self._num_protected_pages[tier]:
                raise IntegrityError(f"protected pages of {tier.label}: {self._num_protected_pages[tier]}"
                                     f" != recount {protected[tier]}")
            if reused_pages[tier] != self._num_reused_pages[tier]:
                raise IntegrityError(f"reused pages of {tier.label}: {self._num_reused_pages[tier]}"
                                     f" != recount {reused_pages[tier]}")
            self._check_evict_heap(tier)
        return owned

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

    def _make_resident(self, node: TreeNode, tier: Tier, page_ids: list[int]) -> None:
        assert node.page_ids[tier] is None and len(page_ids) == node.num_pages
        node.page_ids[tier] = page_ids
        self._owned_page_ids[tier].update(page_ids)
        if node.reused[tier]:                  # reused while it was here before (the node stayed)
            self._num_reused_pages[tier] += node.num_pages
        node.parent.num_resident_children[tier] += 1
        self._residency_changed(node, tier, 1)

    def _residency_changed(self, node: TreeNode, tier: Tier, delta: int) -> None:
        """Node's residency in tier changed by delta: reported to on_residency, and to on_l2_root
        where it is a path's first page in L2."""
        if self._on_residency is not None:
            self._on_residency(node, tier, delta)
        if tier is Tier.L2 and node.parent is self._root and self._on_l2_root is not None:
            self._on_l2_root(node.key[:self._page_bytes], delta)

    def remove_if_empty(self, node: TreeNode) -> None:
        """Drop node, then its emptied ancestors, while they hold nothing in any tier. A node
        dropped already (with a child that emptied it) has no parent: nothing to do."""
        while node.parent is not None and not node.children and node.holds_nothing():
            parent = node.parent
            del parent.children[node.key[:self._page_bytes]]
            node.parent = None
            self._num_nodes -= 1
            node = parent

    def _is_evictable(self, node: TreeNode, tier: Tier) -> bool:
        return (node.parent is not None and node.page_ids[tier] is not None
                and node.ref_count[tier] == 0 and node.num_resident_children[tier] == 0)

    def _is_current(self, last_access: float, node: TreeNode, tier: Tier, reused: bool) -> bool:
        """Whether a heap entry of this class stands for the node as it is now."""
        return last_access == node.last_access[tier] and node.reused[tier] == reused and self._is_evictable(node, tier)

    def _push_if_evictable(self, node: TreeNode, tier: Tier) -> None:
        if not self._is_evictable(node, tier):
            return
        reused = node.reused[tier]
        heap = self._evict_heaps[tier, reused]
        heapq.heappush(heap, (node.last_access[tier], next(self._heap_seq), node))
        if len(heap) > 2 * self._num_nodes + 64:
            self._rebuild_evict_heap(tier, reused)

    def _rebuild_evict_heap(self, tier: Tier, reused: bool) -> None:
        heap = [(node.last_access[tier], next(self._heap_seq), node) for node in self.nodes()
                if self._is_evictable(node, tier) and node.reused[tier] == reused]
        heapq.heapify(heap)
        self._evict_heaps[tier, reused] = heap

    def _check_evict_heap(self, tier: Tier) -> None:
        fresh = {id(node) for reused in (False, True) for last_access, _, node in self._evict_heaps[tier, reused]
                 if self._is_current(last_access, node, tier, reused)}
        for node in self.nodes():
            if self._is_evictable(node, tier) and id(node) not in fresh:
                raise IntegrityError(f"evictable {node!r} has no current entry in the "
                                     f"{tier.label} eviction heap")

    def nodes(self) -> Iterator[TreeNode]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _resident_prefix_pages(self, data: bytes, tier: Tier, limit_pages: int) -> int:
        """Pages of data's prefix resident in `tier`, counted up to at least limit_pages (no mutation)."""
        page_bytes = self._page_bytes
        node = self._root
        pos = 0
        while pos < limit_pages * page_bytes:
            child = node.children.get(data[pos:pos + page_bytes])
            if child is None or child.page_ids[tier] is None:
                break
            num_common = self.num_common_pages(data, pos, child.key)
            pos += num_common * page_bytes
            if num_common < child.num_pages:
                break
            node = child
        return pos // page_bytes

    def _check_tier(self, tier: Tier) -> Tier:
        if tier not in self.tiers:
            raise ValueError(f"tier {tier!r} is not one of this tree's tiers {self.tiers}")
        return Tier(tier)

    def _check_lockable(self, node: TreeNode, tier: Tier) -> None:
        self._check_tier(tier)
        if node is self._root:
            raise ValueError("the root cannot be locked or unlocked")
        if node.parent is None or node.page_ids[tier] is None:
            raise ValueError(f"{node!r} is not resident in {tier.label} (or not in the tree)")
