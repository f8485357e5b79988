"""The pool: the L2 segment and the L3 file, each cut in chunks that namespaces own (``chunks.py``;
"Tiers" in docs/architecture.md). One geometry gets the whole pool, several share it, and a chunk
changes hands only once every page of its old owner in it is free. This owner reserves pages for a
namespace: from its free pages, from chunks it gains, else by evicting its own LRU leaves.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import numpy as np

from kvcached.core import counters
from kvcached.core.chunks import ChunkMap
from kvcached.core.metrics import Metrics
from kvcached.core.namespaces import Namespace
from kvcached.core.tiers import Tier

logger = logging.getLogger(__name__)

# A namespace that evicted cached pages to make room is "under pressure" until it has gone this
# long without evicting; each such episode is logged once.
PRESSURE_QUIET_S = 60.0
# A search of the other namespaces for a chunk to take that found none is not repeated for this
# long by the same namespace and tier (it walks their trees); meanwhile it evicts its own pages.
CHUNK_SCAN_INTERVAL_S = 1.0


class ChunkOffer(NamedTuple):
    """A chunk another namespace could give up: its pages are free or cached and unlocked."""

    namespace: Namespace
    chunk: int
    newest_access: float       # the LRU time of its most recently used page; -inf if it caches none
    # (holds a reused page, LRU time of its newest such page, else of its newest page): the page
    # its owner's evict() would keep longest, as PrefixTree.next_eviction_rank ranks them
    newest_rank: tuple[bool, float] = (False, -np.inf)


class Pool:
    def __init__(self, l2_bytes: int, l3_bytes: int, namespaces: dict[int, Namespace], metrics: Metrics,
                 clock: Callable[[], float], held_page_ids: Callable[[Namespace, Tier], list[int]],
                 on_l3_evicted: Callable[[Namespace, list[int]], None]):
        """``namespaces``: the daemon's, read here (a chunk is taken from one of them).
        ``held_page_ids``: a namespace's pages in a tier that are private (leases, pending moves) or
        quarantined: a chunk holding one never changes hands. ``on_l3_evicted``: told of the L3
        slots evicted (the persistent index drops their rows)."""
        self.chunks: dict[Tier, ChunkMap] = {Tier.L2: ChunkMap(l2_bytes)}
        if l3_bytes > 0:
            self.chunks[Tier.L3] = ChunkMap(l3_bytes)
        self._namespaces = namespaces
        self.metrics = metrics
        self._clock = clock
        self._held_page_ids = held_page_ids
        self._on_l3_evicted = on_l3_evicted
        # (namespace id, tier) -> when it may search the other namespaces for a chunk again
        self._chunk_scan_not_before: dict[tuple[int, Tier], float] = {}

    def fit_first_page(self, bytes_per_page: int) -> None:
        """The first geometry: where its page is larger than a chunk (a small pool: chunks are 1/64
        of it), the pool is cut in chunks of whole pages of it instead (none straddles two);
        nothing is in the pool yet."""
        for tier, chunks in self.chunks.items():
            if bytes_per_page > chunks.chunk_bytes:
                self.chunks[tier] = ChunkMap(chunks.space_bytes, min(bytes_per_page, chunks.space_bytes))

    def free_room(self, namespace: Namespace, tier: Tier) -> int:
        """The pages the namespace could reserve without evicting: its free pages and those of the
        free chunks."""
        return namespace.allocator(tier).num_free + sum(
            len(self.pages_if_gained(namespace, tier, chunk)) for chunk in self.chunks[tier].free_chunks())

    def forget(self, namespace: Namespace) -> None:
        """A namespace reclaimed: its chunks go back to the pool."""
        for tier, chunks in self.chunks.items():
            for chunk in chunks.owned_by(namespace.namespace_id):
                chunks.owner[chunk] = None
            self._chunk_scan_not_before.pop((namespace.namespace_id, tier), None)

    def reserve_l2(self, namespace: Namespace, num_pages: int) -> list[int]:
        page_ids = self.reserve(namespace, Tier.L2, num_pages)
        if not page_ids:
            self.metrics.add(counters.RESERVATION_FAILURES)
        return page_ids

    def reserve(self, namespace: Namespace, tier: Tier, num_pages: int) -> list[int]:
        """Best effort: make room if needed (_make_room), then reserve as many pages as are free, up
        to num_pages (possibly none). Locked nodes are never evicted."""
        allocator = namespace.allocator(tier)
        if allocator.num_free < num_pages:
            self._make_room(namespace, tier, num_pages)
        count = min(num_pages, allocator.num_free)
        if count == 0:
            return []
        page_ids = allocator.allocate(count)
        assert page_ids is not None
        return page_ids

    def _make_room(self, namespace: Namespace, tier: Tier, num_pages: int) -> None:
        """Until num_pages are free: gain chunks (free ones, those of idle namespaces, colder ones
        of active namespaces: _gain_chunk), then evict the namespace's own LRU leaves."""
        allocator = namespace.allocator(tier)
        while allocator.num_free < num_pages and self._gain_chunk(namespace, tier):
            pass
        if allocator.num_free < num_pages:
            evicted = namespace.tree.evict(tier, num_pages - allocator.num_free)
            if evicted:
                allocator.free(evicted)
                if tier is Tier.L3:
                    self._on_l3_evicted(namespace, evicted)
                self._note_eviction(namespace, tier, len(evicted), "its own least recently used pages")

    def _gain_chunk(self, namespace: Namespace, tier: Tier) -> bool:
        """Give the namespace more of the tier, if it can be had and yields pages: every free chunk,
        else the coldest chunk another namespace can give up (_chunk_to_take). Returns whether it
        gained any."""
        if self.assign_free_chunks(namespace, tier):
            return True
        now = self._clock()
        scan_key = (namespace.namespace_id, tier)
        if now < self._chunk_scan_not_before.get(scan_key, -np.inf):
            return False
        offer = self._chunk_to_take(namespace, tier)
        if offer is None:
            self._chunk_scan_not_before[scan_key] = now + CHUNK_SCAN_INTERVAL_S
            return False
        self._take_chunk(offer, namespace, tier)
        return True

    def pages_if_gained(self, namespace: Namespace, tier: Tier, chunk: int) -> range:
        return self.chunks[tier].usable_pages(chunk, namespace.namespace_id, namespace.geometry.bytes_per_page,
                                              namespace.allocator(tier).num_pages)

    def assign_free_chunks(self, namespace: Namespace, tier: Tier) -> int:
        """Every free chunk of the tier that yields pages becomes the namespace's (a new namespace
        gets them at once: one geometry alone holds the whole pool). Returns how many."""
        free = [chunk for chunk in self.chunks[tier].free_chunks() if self.pages_if_gained(namespace, tier, chunk)]
        for chunk in free:
            self.assign_chunk(namespace, tier, chunk)
        return len(free)

    def assign_chunk(self, namespace: Namespace, tier: Tier, chunk: int) -> None:
        """A free chunk becomes the namespace's: its pages there join its free pages."""
        chunks = self.chunks[tier]
        assert chunks.owner[chunk] is None, f"chunk {chunk} of {tier.label} is owned already"
        chunks.owner[chunk] = namespace.namespace_id
        pages = self.pages_if_gained(namespace, tier, chunk)
        namespace.allocator(tier).free_range(pages.start, pages.stop)
        namespace.capacity[tier] += len(pages)

    def _release_chunk(self, namespace: Namespace, tier: Tier, chunk: int) -> None:
        """The namespace gives a chunk back to the pool; every page of it there must be free."""
        chunks = self.chunks[tier]
        assert chunks.owner[chunk] == namespace.namespace_id
        pages = self.pages_if_gained(namespace, tier, chunk)
        if tier is Tier.L2:     # another namespace may write these bytes now: no reader here trusts them
            namespace.generations.revoke(np.arange(pages.start, pages.stop))
        namespace.allocator(tier).take_range(pages.start, pages.stop)
        namespace.capacity[tier] -= len(pages)
        chunks.owner[chunk] = None

    def _chunk_to_take(self, namespace: Namespace, tier: Tier) -> ChunkOffer | None:
        """The chunk of another namespace that this one may take: of an idle namespace (no session)
        the coldest; else the coldest of an active one that ranks below the page this namespace
        would evict instead (``PrefixTree.next_eviction_rank``: never reused below reused, older
        below newer), or any, when it has nothing to evict: a chunk holding reused pages only for
        a namespace whose next eviction is reused too, and newer; a chunk of pages never reused
        for one whose next eviction is reused, or from a namespace holding more chunks than it.
        So one-use pages never take a chunk holding a page its owner reused, and share the rest
        of the pool evenly between active namespaces; reused pages take what ranks below them.
        Only chunks that hold no private, quarantined or locked page of their owner, and that
        give this namespace at least one page."""
        own_next = namespace.tree.next_eviction_rank(tier)
        own_chunks = len(self.chunks[tier].owned_by(namespace.namespace_id))
        best: tuple[tuple[bool, tuple[bool, float]], ChunkOffer] | None = None
        for other in self._namespaces.values():
            if other is namespace or tier not in other.tree.tiers:
                continue
            idle = not other.session_ids
            larger = len(self.chunks[tier].owned_by(other.namespace_id)) > own_chunks
            for offer in self._chunk_offers(other, tier):
                if not self.pages_if_gained(namespace, tier, offer.chunk):
                    continue
                if not idle and own_next is not None and not (
                        offer.newest_rank < own_next if offer.newest_rank[0] else own_next[0] or larger):
                    continue
                rank = (not idle, offer.newest_rank)
                if best is None or rank < best[0]:
                    best = (rank, offer)
        return best[1] if best is not None else None

    def _chunk_offers(self, namespace: Namespace, tier: Tier) -> list[ChunkOffer]:
        """The chunks the namespace could give up now, each with the LRU time of its newest page."""
        chunks = self.chunks[tier]
        owned = chunks.owned_by(namespace.namespace_id)
        if not owned:
            return []
        bytes_per_page = namespace.geometry.bytes_per_page
        newest = np.full(chunks.num_chunks, -np.inf)
        newest_reused = np.full(chunks.num_chunks, -np.inf)
        blocked = np.zeros(chunks.num_chunks, dtype=bool)
        resident = namespace.tree.resident_pages(tier)
        held = np.array(self._held_page_ids(namespace, tier), dtype=np.int64)
        for page_end in (0, 1):          # a page counts for the chunk of its first and of its last byte
            chunk_ids = ((resident.page_ids + page_end) * bytes_per_page - page_end) // chunks.chunk_bytes
            np.maximum.at(newest, chunk_ids, resident.last_access)
            np.maximum.at(newest_reused, chunk_ids[resident.reused], resident.last_access[resident.reused])
            blocked[chunk_ids[resident.locked]] = True
            blocked[((held + page_end) * bytes_per_page - page_end) // chunks.chunk_bytes] = True
        has_reused = newest_reused > -np.inf
        return [ChunkOffer(namespace, chunk, float(newest[chunk]),
                           (True, float(newest_reused[chunk])) if has_reused[chunk] else (False, float(newest[chunk])))
                for chunk in owned if not blocked[chunk]]

    def _take_chunk(self, offer: ChunkOffer, namespace: Namespace, tier: Tier) -> None:
        """Move a chunk from its owner to ``namespace``: the owner's cached pages in it are evicted
        (with what lies below them: residency is prefix-closed), then it changes hands."""
        victim = offer.namespace
        pages = self.pages_if_gained(victim, tier, offer.chunk)
        evicted = victim.tree.discard_pages(tier, pages)
        if evicted:
            victim.allocator(tier).free(evicted)
            if tier is Tier.L3:
                self._on_l3_evicted(victim, evicted)
            self._note_eviction(victim, tier, len(evicted), f"a chunk of the pool went to namespace "
                                f"{namespace.namespace_id} ({namespace.geometry.model_id})")
        self._release_chunk(victim, tier, offer.chunk)
        self.assign_chunk(namespace, tier, offer.chunk)
        self.metrics.add(counters.CHUNKS_TAKEN, 1, tier.label)
        logger.info("%s chunk %d moved from namespace %d (%s, %s) to namespace %d (%s): %d cached pages evicted",
                    tier.label, offer.chunk, victim.namespace_id, victim.geometry.model_id,
                    "idle" if not victim.session_ids else "active", namespace.namespace_id,
                    namespace.geometry.model_id, len(evicted))

    def _note_eviction(self, namespace: Namespace, tier: Tier, num_pages: int, cause: str) -> None:
        """Cached pages evicted to make room: counted per namespace and tier; the first eviction
        after PRESSURE_QUIET_S without any starts an episode, logged once."""
        self.metrics.add(counters.EVICTED_PAGES, num_pages, tier.label, model=namespace.geometry.model_id)
        pressure = namespace.pressure[tier]
        now = self._clock()
        if pressure.last_eviction_at is None or now - pressure.last_eviction_at > PRESSURE_QUIET_S:
            pressure.episodes += 1
            self.metrics.add(counters.PRESSURE_EPISODES, 1, tier.label)
            logger.warning("namespace %d (%s): %s is full, cached prefixes are evicted to make room (%s); it holds "
                           "%d pages of %d bytes now. Each eviction is counted (status: evicted_pages); a larger "
                           "--%s-size keeps more. Logged once until %.0f s pass without an eviction.",
                           namespace.namespace_id, namespace.geometry.model_id, tier.label, cause,
                           namespace.capacity[tier], namespace.geometry.bytes_per_page, tier.label, PRESSURE_QUIET_S)
        pressure.last_eviction_at = now
        pressure.evicted_pages += num_pages
