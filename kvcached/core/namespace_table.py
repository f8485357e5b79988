"""The namespaces: one per KV geometry served, made at its first attach (or at start, from a
persistent L3 index) and reclaimed, idle longest first, when a new geometry needs the slot. Each
gets its tree, allocators, admission-hints slot and page-generations file here; what the pool and
the L3 index keep of it is given back on reclaim.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import TYPE_CHECKING, Callable

from kvcached.core import counters
from kvcached.core.allocator import PageAllocator
from kvcached.core.cost_model import CostModel
from kvcached.core.generations import GenerationFiles, PageGenerations
from kvcached.core.hints import AdmissionHints
from kvcached.core.kv_events import TIER_WHERE, EventBuffer, EventKind, TierEvent
from kvcached.core.metrics import Metrics
from kvcached.core.namespaces import Namespace
from kvcached.core.tiers import Tier
from kvcached.core.tree import PrefixTree, TreeNode
from proto.errors import ErrorCode, ProtocolError
from proto.messages import KVGeometry

if TYPE_CHECKING:
    from kvcached.core.l3_persistence import L3Persistence
    from kvcached.core.pool import Pool

logger = logging.getLogger(__name__)

# Pages (or slots) per namespace and tier, at most: a geometry with tiny pages would otherwise
# make allocators, the tree and the integrity check hold tens of millions of ids.
MAX_PAGES_PER_TIER = 1 << 20


class NamespaceTable:
    def __init__(self, namespaces: dict[int, Namespace], max_namespaces: int, metrics: Metrics,
                 clock: Callable[[], float], pool: Pool, l3: L3Persistence, hints: AdmissionHints, cost: CostModel,
                 generation_files: GenerationFiles, kv_events: EventBuffer | None,
                 busy_namespace_ids: Callable[[], set[int]], on_created: Callable[[Namespace], None]):
        """``namespaces``: the daemon's map by id, filled here (the other owners read it).
        ``busy_namespace_ids``: namespaces that are not idle though no session is attached (a move
        pending, pages quarantined). ``on_created``: called with each new namespace."""
        self.namespaces = namespaces
        self.geometry_to_namespace: dict[KVGeometry, Namespace] = {}
        self.max_namespaces = max_namespaces
        self._namespace_ids = itertools.count()
        self.metrics = metrics
        self._clock = clock
        self._pool = pool
        self._l3 = l3
        self._hints = hints
        self._cost = cost
        self._generation_files = generation_files
        self.kv_events = kv_events
        self._busy_namespace_ids = busy_namespace_ids
        self._on_created = on_created

    def create(self, geometry: KVGeometry) -> Namespace:
        """A namespace that owns no chunk yet (attach gives it the free ones; it gains more as it
        reserves pages: Pool.reserve)."""
        bytes_per_page = geometry.bytes_per_page
        if not self.namespaces:
            self._pool.fit_first_page(bytes_per_page)
        l2_chunks = self._pool.chunks[Tier.L2]
        if bytes_per_page > l2_chunks.chunk_bytes:
            raise ProtocolError(ErrorCode.GEOMETRY_MISMATCH,
                                f"one page of this geometry ({bytes_per_page} bytes) is larger than a chunk of the "
                                f"L2 pool ({l2_chunks.chunk_bytes} bytes); start the daemon with a larger --l2-size")
        if len(self.namespaces) >= self.max_namespaces and not self._reclaim_idle():
            raise ProtocolError(ErrorCode.OUT_OF_SPACE,
                                f"all {self.max_namespaces} namespaces have attached engines; "
                                "start the daemon with a larger --max-namespaces")
        num_pages = min(l2_chunks.space_bytes // bytes_per_page, MAX_PAGES_PER_TIER)
        l3_chunks = self._pool.chunks.get(Tier.L3)
        num_slots = (min(l3_chunks.space_bytes // bytes_per_page, MAX_PAGES_PER_TIER)
                     if l3_chunks is not None and bytes_per_page <= l3_chunks.chunk_bytes else 0)
        tiers = (Tier.L2, Tier.L3) if num_slots else (Tier.L2,)
        namespace_id = next(self._namespace_ids)
        hints_slot = self._hints.assign(namespace_id)
        generations_path, generation_words = self._generation_files.create(namespace_id, num_pages)
        namespace = Namespace(
            namespace_id=namespace_id,
            geometry=geometry,
            num_pages=num_pages,
            tree=PrefixTree(geometry.page_size, tiers=tiers, clock=self._clock,
                            on_l2_root=functools.partial(self._hints.l2_root, hints_slot),
                            on_residency=functools.partial(self.residency_event, geometry)
                            if self.publishes_events(geometry) else None),
            l2_allocator=PageAllocator(num_pages, all_free=False),
            l3_allocator=PageAllocator(num_slots, all_free=False) if num_slots else None,
            hints_slot=hints_slot,
            generations=PageGenerations(generations_path, generation_words),
        )
        self._on_created(namespace)
        if self.publishes_events(geometry) and not any(
                self.publishes_events(other) and other.model_id == geometry.model_id
                for other in self.geometry_to_namespace):
            # This model's first namespace in this run: what an earlier run published of it is gone.
            self.kv_events.record(TierEvent(EventKind.CLEARED, geometry.model_id, geometry.page_size, None, b"", 0))
        self.namespaces[namespace.namespace_id] = namespace
        self.geometry_to_namespace[geometry] = namespace
        if num_slots:
            self._l3.index_namespace(namespace)
        logger.info("namespace %d: %s, pages of %d bytes: up to %d in L2 and %d in L3 (the whole pool, shared with "
                    "the other namespaces)", namespace.namespace_id, geometry, bytes_per_page, num_pages, num_slots)
        return namespace

    def _reclaim_idle(self) -> bool:
        """Drop the namespace idle longest (no session, no pending move, no quarantine), so that a
        new geometry can be served; its chunks go back to the pool and its cached pages are lost.
        Returns whether one was reclaimed."""
        # A namespace with quarantined pages is not idle: a stale writer may still write them.
        busy = self._busy_namespace_ids()
        idle = [ns for ns in self.namespaces.values()
                if not ns.session_ids and ns.namespace_id not in busy and ns.idle_since is not None]
        if not idle:
            return False
        victim = min(idle, key=lambda ns: ns.idle_since)
        if self.publishes_events(victim.geometry):
            for node, tier in victim.tree.resident_nodes():
                self.residency_event(victim.geometry, node, tier, -1)
        del self.namespaces[victim.namespace_id]
        del self.geometry_to_namespace[victim.geometry]
        self._hints.release(victim.hints_slot)
        victim.generations.close_all()
        self._generation_files.close(victim.namespace_id)
        self._cost.forget_engine(victim.namespace_id)
        self._pool.forget(victim)
        self._l3.drop_namespace(victim)
        self.metrics.add(counters.NAMESPACES_RECLAIMED)
        logger.info("namespace %d (%s) reclaimed: idle since %.1f s, %d L2 pages dropped", victim.namespace_id,
                    victim.geometry.model_id, self._clock() - victim.idle_since, victim.tree.owned_pages(Tier.L2))
        return True

    def publishes_events(self, geometry: KVGeometry) -> bool:
        """Events are recorded for one rank of a tensor-parallel group (rank 0): its ranks store the
        same pages, and a router routes to the group, not to a rank."""
        return self.kv_events is not None and geometry.tp_rank == 0

    def residency_event(self, geometry: KVGeometry, node: TreeNode, tier: Tier, delta: int) -> None:
        path = node.path()
        start_page = (len(path) - len(node.key)) // (4 * geometry.page_size)
        self.kv_events.record(TierEvent(EventKind.STORED if delta > 0 else EventKind.REMOVED, geometry.model_id,
                                        geometry.page_size, TIER_WHERE[tier], path, start_page))
