"""Tiering: the copies between tiers the daemon plans and the I/O layer runs: write-through of
committed L2 pages to L3 (H2S), promotion of pages only L3 holds (S2H, for an acquire or in the
background), gets from the remote store into L2 (R2H) and write-through to it (H2R).

A move's destination pages are private to it while it runs, and the tree nodes it reads from or
inserts below are locked; ``finish_move`` publishes the leading pages that arrived intact (checked
against the L3 index's checksums, the generations engines stamp, or the remote store's keys) and
frees the rest. No I/O here.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Callable, Iterator, NamedTuple

import numpy as np

from kvcached.core import counters
from kvcached.core.cost_model import CostModel
from kvcached.core.kv_events import REMOTE_WHERE, EventBuffer, EventKind, TierEvent
from kvcached.core.l3_index import namespace_key
from kvcached.core.l3_persistence import L3Persistence
from kvcached.core.metrics import Metrics
from kvcached.core.namespaces import Namespace
from kvcached.core.pool import Pool
from kvcached.core.tier_ops import OpState, TierMove
from kvcached.core.tiers import Tier
from kvcached.core.tree import TreeNode
from proto.counters import Counter
from proto.messages import KVGeometry
from proto.tokens import page_aligned, token_array
from proto.tokens import token_bytes as wire_token_bytes

logger = logging.getLogger(__name__)


class RemoteAsk(NamedTuple):
    """What the I/O layer asks the remote store before a lookup or acquire: which of pages
    [start_page, end_page) of this path it holds (their keys chain from page 0)."""
    namespace_id: int
    namespace_key: str
    page_size: int
    token_ids: np.ndarray               # the path, whole pages (a copy)
    start_page: int
    end_page: int


@dataclasses.dataclass(eq=False)
class RemoteWrite:
    """A write-through of L2 pages [start_page, start_page + len(page_ids)) of a path to the remote
    store. Its L2 pages are locked (never evicted nor handed out) until ``finish_remote_write``;
    the writer sends a page only while its generation is the one recorded here."""
    write_id: int
    namespace_id: int
    namespace_key: str
    page_size: int
    bytes_per_page: int
    token_ids: np.ndarray
    start_page: int
    page_ids: list[int]
    generations: list[int]
    lock: TreeNode | None


class Tiering:
    def __init__(self, namespaces: dict[int, Namespace], metrics: Metrics, pool: Pool, l3: L3Persistence,
                 cost: CostModel, generation_ids: Iterator[int],
                 remote_write_sink: Callable[[RemoteWrite], None] | None, kv_events: EventBuffer | None,
                 publishes_events: Callable[[KVGeometry], bool]):
        """``generation_ids``: the daemon's write generations (a promoted page is stamped with a new
        one). ``remote_write_sink``: where each write-through to the remote store goes; None: no
        remote tier. ``kv_events``, ``publishes_events``: where what the remote store gained is
        recorded, for which geometries."""
        self.moves: dict[int, TierMove] = {}
        self._move_ids = itertools.count(1)
        self._background_move_ids: dict[int, int] = {}      # namespace id -> its background promotion
        self.remote_writes: dict[int, RemoteWrite] = {}
        self._remote_write_ids = itertools.count(1)
        self._remote_namespace_keys: dict[int, str] = {}
        self._remote_write_sink = remote_write_sink
        self._namespaces = namespaces
        self.metrics = metrics
        self._pool = pool
        self._l3 = l3
        self._cost = cost      # its counters count background promotions
        self._generation_ids = generation_ids
        self.kv_events = kv_events
        self._publishes_events = publishes_events

    def promote_in_background(self, namespace: Namespace, token_bytes: bytes, allowed: int) -> TierMove | None:
        """The S2H move of the pages of this path only L3 holds (at most ``allowed``) that no request
        waits for (``DaemonState.promote_in_background``); None while the namespace has one pending
        already, or when there is nothing to promote."""
        if namespace.namespace_id in self._background_move_ids:
            self._cost.counters.add(counters.BACKGROUND_PROMOTION_SKIPS, 1, "busy")
            return None
        page_size = namespace.geometry.page_size
        token_ids = token_array(token_bytes)
        token_ids = token_ids[: page_aligned(len(token_ids), page_size)]
        result = namespace.tree.match(token_ids, touch=False)
        l2_pages, l3_pages = result.hit_tokens[Tier.L2] // page_size, result.hit_tokens.get(Tier.L3, 0) // page_size
        if l3_pages <= l2_pages or allowed <= 0:
            return None
        move = self.plan_move(namespace, result, token_ids, Tier.L3, Tier.L2, l2_pages,
                              min(l3_pages, l2_pages + allowed))
        if move is not None:
            self._background_move_ids[namespace.namespace_id] = move.op_id
            self._cost.counters.add(counters.BACKGROUND_PROMOTIONS)
        return move

    def busy_namespace_ids(self) -> set[int]:
        """Namespaces with a pending move or remote write (never reclaimed meanwhile)."""
        return {move.namespace_id for move in self.moves.values()} | {
            write.namespace_id for write in self.remote_writes.values()}

    def held_page_ids(self, namespace: Namespace, tier: Tier) -> list[int]:
        """The namespace's pages in the tier that pending moves reserved."""
        return [p for m in self.moves.values() if m.namespace_id == namespace.namespace_id and m.destination is tier
                for p in m.private_page_ids]

    @property
    def remote_enabled(self) -> bool:
        return self._remote_write_sink is not None

    def remote_namespace_key(self, namespace: Namespace) -> str:
        key = self._remote_namespace_keys.get(namespace.namespace_id)
        if key is None:
            key = self._remote_namespace_keys[namespace.namespace_id] = namespace_key(namespace.geometry)
        return key

    def remote_ask_after(self, namespace: Namespace, token_ids: np.ndarray, result) -> RemoteAsk | None:
        """remote_ask, given the tree's match of the path's whole pages."""
        page_size = namespace.geometry.page_size
        num_pages = len(token_ids) // page_size
        l2_pages = result.hit_tokens[Tier.L2] // page_size
        if l2_pages >= num_pages or result.hit_tokens.get(Tier.L3, 0) > result.hit_tokens[Tier.L2]:
            return None
        return RemoteAsk(namespace.namespace_id, self.remote_namespace_key(namespace), page_size,
                         token_ids[: num_pages * page_size].copy(), l2_pages, num_pages)

    def plan_remote_move(self, namespace: Namespace, result, token_ids: np.ndarray, remote_pages: int,
                          allowed: int) -> TierMove | None:
        """R2H: private L2 pages for the pages after the L2 hit that the store holds (at most
        ``allowed``), the L2 prefix they go below locked; None where L3 holds more than L2 now or
        no page is free."""
        page_size = namespace.geometry.page_size
        start_page = result.hit_tokens[Tier.L2] // page_size
        end_page = min(remote_pages, start_page + allowed)
        if end_page <= start_page or result.hit_tokens.get(Tier.L3, 0) > result.hit_tokens[Tier.L2]:
            return None
        locks = [(result.last_node[Tier.L2], Tier.L2)] if result.last_node[Tier.L2] is not None else []
        for node, tier in locks:
            namespace.tree.lock(node, tier)
        private_page_ids = self._pool.reserve(namespace, Tier.L2, end_page - start_page)
        if not private_page_ids:
            for node, tier in locks:
                namespace.tree.unlock(node, tier)
            self._count_skip(counters.NO_SPACE_SKIPS, "r2h", "no free l2 page for a remote restore")
            return None
        count = len(private_page_ids)
        move = TierMove(
            op_id=next(self._move_ids), namespace_id=namespace.namespace_id, source=Tier.L2,
            destination=Tier.L2, token_ids=token_ids[: (start_page + count) * page_size].copy(),
            start_page=start_page, source_page_ids=[], private_page_ids=private_page_ids, locks=locks, remote=True)
        namespace.generations.revoke(private_page_ids)      # the daemon writes them: no reader trusts them yet
        self.moves[move.op_id] = move
        return move

    def plan_remote_write(self, namespace: Namespace, token_ids: np.ndarray, start_page: int) -> None:
        """After a commit: send the path's L2 pages from start_page on to the remote store."""
        page_size = namespace.geometry.page_size
        result = namespace.tree.match(token_ids, touch=False)
        l2_pages = result.hit_tokens[Tier.L2] // page_size
        node = result.last_node[Tier.L2]
        if l2_pages <= start_page or node is None:
            return
        namespace.tree.lock(node, Tier.L2)
        page_ids = list(result.page_ids[Tier.L2][start_page:l2_pages])
        write = RemoteWrite(next(self._remote_write_ids), namespace.namespace_id, self.remote_namespace_key(namespace),
                            page_size, namespace.geometry.bytes_per_page, token_ids[: l2_pages * page_size].copy(),
                            start_page, page_ids, namespace.generations.published_of(page_ids), node)
        self.remote_writes[write.write_id] = write
        self._remote_write_sink(write)

    def finish_remote_write(self, write: RemoteWrite, num_sent: int) -> None:
        """A write-through to the store ended (``num_sent`` pages stored): its pages are unlocked."""
        del self.remote_writes[write.write_id]
        namespace = self._namespaces.get(write.namespace_id)
        if write.lock is not None and namespace is not None:
            namespace.tree.unlock(write.lock, Tier.L2)
        write.lock = None
        self.metrics.add(counters.REMOTE_WRITTEN_PAGES, num_sent)
        if num_sent and namespace is not None and self._publishes_events(namespace.geometry):
            geometry = namespace.geometry
            path = wire_token_bytes(write.token_ids[: (write.start_page + num_sent) * geometry.page_size])
            self.kv_events.record(TierEvent(EventKind.STORED, geometry.model_id, geometry.page_size, REMOTE_WHERE,
                                            path, write.start_page))

    def plan_write_through(self, namespace: Namespace, token_ids: np.ndarray) -> TierMove | None:
        """H2S: copy the L2 pages of this path that L3 lacks into newly reserved L3 slots."""
        if namespace.l3_allocator is None:
            return None
        page_size = namespace.geometry.page_size
        result = namespace.tree.match(token_ids, own_pages=len(token_ids) // page_size)     # a copy, no use
        l2_pages = result.hit_tokens[Tier.L2] // page_size
        l3_pages = result.hit_tokens[Tier.L3] // page_size
        if l3_pages >= l2_pages:
            return None
        return self.plan_move(namespace, result, token_ids, Tier.L2, Tier.L3, l3_pages, l2_pages)

    def plan_move(self, namespace: Namespace, result, token_ids: np.ndarray, source: Tier,
                   destination: Tier, start_page: int, end_page: int) -> TierMove | None:
        # Lock the source pages and the destination's resident prefix before reserving: the
        # reservation may evict, and must not evict what this move reads or inserts below.
        locks = [(node, tier) for node, tier in ((result.last_node[source], source),
                                                 (result.last_node[destination], destination))
                 if node is not None]
        for node, tier in locks:
            namespace.tree.lock(node, tier)
        direction, what = ("h2s", "write-through") if destination is Tier.L3 else ("s2h", "promotion")
        private_page_ids = self._pool.reserve(namespace, destination, end_page - start_page)
        if not private_page_ids:
            for node, tier in locks:
                namespace.tree.unlock(node, tier)
            self._count_skip(counters.NO_SPACE_SKIPS, direction, f"no free {destination.label} page for a {what}")
            return None
        count = len(private_page_ids)
        if count < end_page - start_page:       # cut short for want of room (callers cut to the allowance)
            self.metrics.add(counters.IO_PAGES_CUT, end_page - start_page - count, direction)
        page_size = namespace.geometry.page_size
        move = TierMove(
            op_id=next(self._move_ids), namespace_id=namespace.namespace_id, source=source,
            destination=destination, token_ids=token_ids[: (start_page + count) * page_size].copy(),
            start_page=start_page, source_page_ids=result.page_ids[source][start_page:start_page + count],
            private_page_ids=private_page_ids, locks=locks)
        if destination is Tier.L2:      # the daemon writes them: no reader trusts them until stamped
            namespace.generations.revoke(private_page_ids)
        else:                           # the daemon reads them: the generations they must keep throughout
            move.source_generations = namespace.generations.published_of(move.source_page_ids)
        self.moves[move.op_id] = move
        return move

    def _count_skip(self, counter: Counter, direction: str, message: str) -> None:
        """A copy to another tier not made: counted (status shows it), logged the first time."""
        if not self.metrics.counters.value(counter, direction):
            logger.warning("%s (counted as %s; each further one is counted, not logged)", message,
                           self.metrics.counters.key_of(counter, direction))
        self.metrics.add(counter, 1, direction)

    def pending_moves(self, direction: str) -> int:
        return sum(move.direction == direction for move in self.moves.values())

    def finish_move(self, move: TierMove, ok: bool, skipped: bool = False) -> int:
        """Publish a completed move's pages in the tree, or return them on failure.

        With a persistent L3 index, a promotion publishes only its leading pages whose bytes
        read match the checksums recorded when they were written; the first page that does not
        is dropped from L3 (with what lies below it) and counted, and the rest of the prefix is
        left to recompute. Returns the number of pages the destination tier gained. Once
        published, the pages belong to the tree: nothing that happens to a session later frees them."""
        namespace = self._namespaces[move.namespace_id]
        allocator = namespace.allocator(move.destination)
        gained = 0
        num_valid = self._l3.num_verified_pages(namespace, move) if ok else 0
        if num_valid and move.destination is Tier.L3:
            # An engine's page rewritten (or being rewritten) while it was read is not written through.
            intact = namespace.generations.num_leading_intact(move.source_page_ids, move.source_generations)
            if intact < num_valid:
                self.metrics.add(counters.STALE_GENERATION_PAGES, num_valid - intact)
                num_valid = intact
        if num_valid:
            move.transition(OpState.PUBLISHED)
            published = move.private_page_ids[:num_valid]
            if move.destination is Tier.L2:
                namespace.generations.stamp(published, next(self._generation_ids))
            if num_valid < len(move.private_page_ids):
                allocator.free(move.private_page_ids[num_valid:])
            inserted = namespace.tree.insert(move.token_ids, move.destination, published,
                                             start_page=move.start_page)
            if inserted.duplicate_page_ids:      # someone published the same pages meanwhile
                allocator.free(inserted.duplicate_page_ids)
            move.num_published_pages = num_valid
            if move.destination is Tier.L3:
                self._l3.index_written(namespace, move, set(inserted.duplicate_page_ids))
            gained = inserted.new_pages
            self.metrics.add(counters.IO_PUBLISHED_PAGES, gained, move.direction)
        else:
            move.transition(OpState.FAILED)
            allocator.free(move.private_page_ids)
            if skipped:     # never started (policy), not an I/O failure
                self._count_skip(counters.BACKLOG_SKIPS, move.direction,
                                 f"a {move.direction} move was skipped (backlog)")
            elif not ok:
                self.metrics.add(counters.IO_FAILURES, 1, move.direction)
        move.private_page_ids = []
        for node, tier in move.locks:
            namespace.tree.unlock(node, tier)
        move.locks = []
        del self.moves[move.op_id]
        if self._background_move_ids.get(move.namespace_id) == move.op_id:
            del self._background_move_ids[move.namespace_id]
            self._cost.counters.add(counters.BACKGROUND_PROMOTED_PAGES, gained)
        if move.remote and move.mismatch:
            self.metrics.add(counters.REMOTE_CHECKSUM_MISMATCHES)
            logger.warning("namespace %d: a page the remote store gave is not the page asked for (%s); not "
                           "served, the request recomputes it", move.namespace_id, move.mismatch)
        if ok and move.destination is Tier.L2 and num_valid < len(move.source_page_ids):
            self._l3.drop_corrupt_page(namespace, move, move.start_page + num_valid)
        return gained
