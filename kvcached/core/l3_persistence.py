"""L3 persistence: the index of what each L3 slot holds (``l3_index.py``), kept in step with the
tree, and the checksums a promotion's bytes are checked against before they are served.

With a persistent L3 file every change of L3 residency goes, in order, to a sink (the I/O layer
writes it to the index file); at start the namespaces it names are rebuilt from their rows. Without
one (no sink) L3 is temporary and every method here is a no-op or a pass-through.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from kvcached.core import counters
from kvcached.core.l3_index import (DeleteSlots, DropNamespace, IndexChange, NamespaceLayout, PutNamespace, PutSlots,
                                    SavedNamespace, SlotRow, namespace_key, plan_rebuild)
from kvcached.core.metrics import Metrics
from kvcached.core.namespaces import Namespace
from kvcached.core.pool import Pool
from kvcached.core.tier_ops import TierMove
from kvcached.core.tiers import Tier
from kvcached.core.tree import TreeNode
from proto.messages import KVGeometry
from proto.page_keys import ROOT_KEY

logger = logging.getLogger(__name__)


class L3Persistence:
    def __init__(self, sink: Callable[[IndexChange], None] | None, metrics: Metrics, clock: Callable[[], float]):
        """``sink``: where every change of L3 residency is reported, in order; None: L3 is temporary."""
        self._sink = sink
        self.metrics = metrics
        self._clock = clock

    def drop_namespace(self, namespace: Namespace) -> None:
        """A namespace reclaimed: its rows leave the index."""
        if namespace.l3_checksums is not None:
            self._sink(DropNamespace(namespace.index_key))

    def index_namespace(self, namespace: Namespace) -> None:
        if self._sink is None:
            return
        assert namespace.l3_allocator is not None
        namespace.index_key = namespace_key(namespace.geometry)
        namespace.l3_checksums = np.zeros(namespace.l3_allocator.num_pages, dtype=np.uint32)
        self._sink(PutNamespace(NamespaceLayout(namespace.index_key, namespace.geometry,
                                                         namespace.geometry.bytes_per_page)))

    def unindex_slots(self, namespace: Namespace, slot_ids: list[int]) -> None:
        if namespace.l3_checksums is not None:
            self._sink(DeleteSlots(namespace.index_key, list(slot_ids)))

    def index_written(self, namespace: Namespace, move: TierMove, duplicate_slot_ids: set[int]) -> None:
        """Rows for the slots a write-through just gave the tree (not for duplicates: freed)."""
        if namespace.l3_checksums is None:
            return
        assert len(move.page_checksums) == len(move.source_page_ids), "h2s finished without its checksums"
        assert len(move.page_keys) >= move.start_page + len(move.source_page_ids), "h2s finished without its keys"
        page_size = namespace.geometry.page_size
        rows = []
        for i, slot in enumerate(move.private_page_ids[:move.num_published_pages]):
            if slot in duplicate_slot_ids:
                continue
            page = move.start_page + i
            rows.append(SlotRow(slot, move.page_keys[page], move.page_keys[page - 1] if page else ROOT_KEY,
                                move.token_ids[page * page_size:(page + 1) * page_size].tobytes(),
                                move.page_checksums[i]))
            namespace.l3_checksums[slot] = move.page_checksums[i]
        if rows:
            self._sink(PutSlots(namespace.index_key, rows))

    def num_verified_pages(self, namespace: Namespace, move: TierMove) -> int:
        """Of a finished move, the leading pages that may be published: for a promotion with a
        persistent index, those whose bytes read match their recorded checksums."""
        if move.remote:
            return move.num_verified_pages
        if move.destination is not Tier.L2 or namespace.l3_checksums is None:
            return len(move.private_page_ids)
        assert len(move.page_checksums) == len(move.source_page_ids), "s2h finished without its checksums"
        expected = namespace.l3_checksums[move.source_page_ids].tolist()
        for i, (read, written) in enumerate(zip(move.page_checksums, expected)):
            if read != written:
                return i
        return len(move.private_page_ids)

    def drop_corrupt_page(self, namespace: Namespace, move: TierMove, page: int) -> None:
        """A slot did not hold what its checksum says: drop that page (and what lies below it)
        from L3 and the index. While another move still locks it, it stays until read again."""
        slot = move.source_page_ids[page - move.start_page]
        self.metrics.add(counters.L3_CHECKSUM_MISMATCHES)
        freed = namespace.tree.discard(move.token_ids, Tier.L3, page)
        if freed:
            namespace.l3_allocator.free(freed)
            self.unindex_slots(namespace, freed)
            self.metrics.add(counters.L3_CORRUPT_PAGES, len(freed))
        logger.warning("namespace %d: L3 slot %d does not hold the page its index names (checksum mismatch); "
                       "not served, %d slots dropped", namespace.namespace_id, slot, len(freed))

    def restore(self, saved: list[SavedNamespace], l3_bytes_kept: int, pool: Pool,
                create_namespace: Callable[[KVGeometry], Namespace], served: dict[KVGeometry, Namespace],
                max_namespaces: int) -> int:
        """At start, before any engine attached: rebuild each namespace of a persistent index from
        its rows, and give it back the chunks of the file its slots lie in. Namespaces with more
        rows go first; a row whose slot lies (now) in a chunk another namespace took back, past
        the file's end, or in bytes the file did not keep, is dropped, as is what cannot be trusted
        (torn rows, rows whose parent is gone) and what no longer fits at all (another page size,
        more namespaces than served). What is dropped leaves the index and is logged.
        ``l3_bytes_kept``: how much of the file kept its content. ``served``: the daemon's
        namespaces by geometry (``create_namespace`` adds each rebuilt one). Returns the number of
        L3 pages restored."""
        assert not served, "restore_l3 runs before the first attach"
        restored = 0
        for entry in sorted(saved, key=lambda e: (-len(e.rows), e.layout.namespace_key)):
            layout = entry.layout
            reason = self._layout_unusable(layout, l3_bytes_kept, pool, served, max_namespaces)
            if reason is not None:
                logger.warning("L3 index: %d pages of %s dropped: %s", len(entry.rows), layout.geometry.model_id,
                               reason)
                self.metrics.add(counters.L3_INDEX_ROWS_DROPPED, len(entry.rows))
                if self._sink is not None:
                    self._sink(DropNamespace(layout.namespace_key))
                continue
            namespace = create_namespace(layout.geometry)
            namespace.idle_since = self._clock()
            chunks = pool.chunks[Tier.L3]
            bytes_per_page = layout.bytes_per_page
            usable_slots = min(namespace.l3_allocator.num_pages, l3_bytes_kept // bytes_per_page)
            rows, foreign_slots = [], []
            for row in entry.rows:
                if 0 <= row.slot < usable_slots and any(chunks.owner[chunk] is not None for chunk in
                                                        chunks.chunks_of_page(row.slot, bytes_per_page)):
                    foreign_slots.append(row.slot)       # another namespace's rows claimed that chunk first
                else:
                    rows.append(row)
            plan = plan_rebuild(rows, namespace.geometry.page_size, usable_slots)
            slot_ids = [slot for run in plan.runs for slot in run.slot_ids]
            for chunk in sorted({c for slot in slot_ids for c in chunks.chunks_of_page(slot, bytes_per_page)}):
                pool.assign_chunk(namespace, Tier.L3, chunk)
            namespace.l3_allocator.take(slot_ids)
            # Each run goes below the node its parent run made: no path from the root is built.
            branch_nodes: dict[bytes, TreeNode] = {}
            for run in plan.runs:
                parent = None if run.parent_key == ROOT_KEY else branch_nodes[run.parent_key]
                node = namespace.tree.insert_child(parent, Tier.L3, run.token_bytes, run.slot_ids)
                if run.end_key in plan.branch_keys:
                    branch_nodes[run.end_key] = node
                if namespace.l3_checksums is not None:
                    namespace.l3_checksums[run.slot_ids] = run.checksums
            del branch_nodes
            dropped = plan.dropped_slot_ids + foreign_slots
            if dropped:
                self.unindex_slots(namespace, dropped)
                self.metrics.add(counters.L3_INDEX_ROWS_DROPPED, len(dropped))
            restored += len(slot_ids)
            self.metrics.add(counters.L3_RESTORED_PAGES, len(slot_ids))
            logger.info("L3 index: namespace %d (%s) back with %d pages in %d chunks; dropped %d rows past the file's "
                        "end or the bytes it kept, %d in chunks of another namespace, %d torn, %d whose parent "
                        "page is gone", namespace.namespace_id, layout.geometry.model_id, len(slot_ids),
                        len(chunks.owned_by(namespace.namespace_id)), plan.num_beyond, len(foreign_slots),
                        plan.num_torn, plan.num_orphans)
        return restored

    @staticmethod
    def _layout_unusable(layout: NamespaceLayout, l3_bytes_kept: int, pool: Pool,
                         served: dict[KVGeometry, Namespace], max_namespaces: int) -> str | None:
        """Why a saved namespace cannot be rebuilt at all now, or None."""
        l3_chunks = pool.chunks.get(Tier.L3)
        if l3_chunks is None:
            return "this daemon has no L3"
        if len(served) >= max_namespaces:
            return f"the index holds more namespaces than the {max_namespaces} served now (--max-namespaces)"
        if layout.geometry in served:
            return "another namespace of the index has the same geometry"
        if layout.bytes_per_page != layout.geometry.bytes_per_page:
            return f"its pages of {layout.bytes_per_page} bytes do not match its geometry's"
        if layout.bytes_per_page > min(l3_chunks.chunk_bytes, pool.chunks[Tier.L2].chunk_bytes):
            return "one of its pages is larger than a chunk of the pool now (a smaller --l2-size or --l3-size)"
        if l3_bytes_kept < layout.bytes_per_page:
            return f"the L3 file kept only {l3_bytes_kept} bytes"
        return None
