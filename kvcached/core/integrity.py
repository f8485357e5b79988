"""The daemon's invariants, checked over its whole state (tests call it after every step): the
partition of each namespace's pages (tree-owned, free, private, quarantined) within the chunks it
owns, lock counts equal to the leases, moves and writes that hold them, leases known to their live
sessions, and the published hints equal to the tree's.
"""

from __future__ import annotations

import collections
import itertools
from typing import TYPE_CHECKING

import numpy as np

from kvcached.core.leases import LeaseState
from kvcached.core.namespaces import Namespace
from kvcached.core.tier_ops import OpState
from kvcached.core.tiers import IntegrityError, Tier
from proto import hints

if TYPE_CHECKING:
    from kvcached.core.daemon import DaemonState


def check_integrity(state: DaemonState) -> None:
    """Every invariant of the daemon's state; raises IntegrityError on the first that fails."""
    for lease in state.leases.values():
        if lease.state is not LeaseState.ACTIVE:
            raise IntegrityError(f"lease {lease.lease_id} is {lease.state} but still tracked")
        session = state.sessions.get(lease.session_id)
        if session is None or lease.lease_id not in session.lease_ids:
            raise IntegrityError(f"lease {lease.lease_id} has no live session that knows it")
    for session in state.sessions.values():
        for lease_id in session.lease_ids:
            if lease_id not in state.leases:
                raise IntegrityError(f"session {session.session_id:x} holds unknown lease {lease_id}")
    for tier, chunks in state.chunks.items():
        for chunk, owner in enumerate(chunks.owner):
            if owner is not None and (owner not in state.namespaces
                                      or tier not in state.namespaces[owner].tree.tiers):
                raise IntegrityError(f"{tier.label} chunk {chunk} belongs to namespace {owner}, which has no "
                                     f"{tier.label}")
    for namespace in state.namespaces.values():
        _check_namespace(state, namespace)

def _check_namespace(state: DaemonState, namespace: Namespace) -> None:
    owned_by_tier = namespace.tree.check_integrity()
    namespace.peers.check_integrity()
    head = state.hints.head(namespace.hints_slot)
    if head["tag"] != namespace.namespace_id + 1:
        raise IntegrityError(f"namespace {namespace.namespace_id}: its hints slot {namespace.hints_slot} is "
                             f"tagged {head['tag']}")
    expected_roots = np.zeros(state.hints.num_buckets, dtype=np.int64)
    for key, child in namespace.tree.root.children.items():
        if child.is_resident(Tier.L2):
            expected_roots[hints.bucket(key, state.hints.num_buckets)] += 1
    if not np.array_equal(expected_roots, state.hints.l2_roots(namespace.hints_slot)):
        raise IntegrityError(f"namespace {namespace.namespace_id}: the published first pages in L2 differ from "
                             "the tree's")
    expected_refs: dict[Tier, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    nodes_by_id = {}
    private_by_tier: dict[Tier, list[int]] = collections.defaultdict(list)
    quarantined_list = [p for q in state.quarantines.values() if q.session.namespace_id == namespace.namespace_id
                        for p in q.page_ids]

    def expect_lock(node, tier: Tier) -> None:
        while node is not None and node.parent is not None:
            expected_refs[tier][id(node)] += 1
            nodes_by_id[id(node)] = node
            node = node.parent

    for lease in state.leases.values():
        if lease.namespace_id == namespace.namespace_id:
            private_by_tier[Tier.L2].extend(lease.private_page_ids)
            expect_lock(lease.locked_node, Tier.L2)
    for move in state.moves.values():
        if move.namespace_id == namespace.namespace_id:
            if move.state is not OpState.PENDING:
                raise IntegrityError(f"move {move.op_id} is {move.state} but still tracked")
            private_by_tier[move.destination].extend(move.private_page_ids)
            for node, tier in move.locks:
                expect_lock(node, tier)
    for write in state.remote_writes.values():
        if write.namespace_id == namespace.namespace_id:
            expect_lock(write.lock, Tier.L2)

    for tier, owned in owned_by_tier.items():
        allocator = namespace.allocator(tier)
        allocator.check_integrity()
        free = allocator.free_page_ids()
        private = set(private_by_tier[tier])
        quarantined = set(quarantined_list) if tier is Tier.L2 else set()
        where = f"namespace {namespace.namespace_id} {tier.label}"
        if len(private) != len(private_by_tier[tier]):
            raise IntegrityError(f"{where}: a private page is reserved twice")
        if tier is Tier.L2 and len(quarantined) != len(quarantined_list):
            raise IntegrityError(f"{where}: a page is quarantined twice")
        sets = (("owned", owned), ("free", free), ("private", private), ("quarantined", quarantined))
        for (a_name, a), (b_name, b) in itertools.combinations(sets, 2):
            both = a & b
            if both:
                raise IntegrityError(f"{where}: pages both {a_name} and {b_name}: {sorted(both)[:8]}")
        # Its pages are those of the chunks it owns, exactly: none beyond them, none lost.
        usable = state.chunks[tier].page_ids_of(namespace.namespace_id, namespace.geometry.bytes_per_page,
                                               allocator.num_pages)
        if len(usable) != namespace.capacity[tier]:
            raise IntegrityError(f"{where}: capacity {namespace.capacity[tier]} != {len(usable)} pages in its "
                                 "chunks")
        total = len(owned) + len(free) + len(private) + len(quarantined)
        if total != len(usable):
            raise IntegrityError(f"{where}: owned {len(owned)} + free {len(free)} + private {len(private)} "
                                 f"+ quarantined {len(quarantined)} != capacity {len(usable)}")
        for name, page_ids in sets:
            outside = page_ids - usable
            if outside:
                raise IntegrityError(f"{where}: {name} pages outside its chunks: {sorted(outside)[:8]}")
        for node_id, count in expected_refs[tier].items():
            node = nodes_by_id[node_id]
            if node.ref_count[tier] != count:
                raise IntegrityError(f"{where}: node ref_count {node.ref_count[tier]} != {count} locks held "
                                     "by leases and pending moves")
        if not expected_refs[tier] and namespace.tree.protected_pages(tier) != 0:
            raise IntegrityError(f"{where}: pages are protected but nothing locks them")
