"""The daemon's status snapshot: sessions, quarantines, namespaces per tier, the pool, the cost model
and the counters, read from the state and changing nothing.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from kvcached.core.leases import Session
from kvcached.core.namespaces import Namespace
from kvcached.core.pool import PRESSURE_QUIET_S
from kvcached.core.tiers import Tier

if TYPE_CHECKING:
    from kvcached.core.daemon import DaemonState


def session_tag(session_id: int) -> str:
    """How status names a session: session ids are capabilities (a peer that knows one can detach
    that engine or release its leases), so status shows a digest, never the id."""
    return hashlib.blake2b(session_id.to_bytes(8, "little"), digest_size=6).hexdigest()


def _tier_status(state: DaemonState, namespace: Namespace, tier: Tier) -> dict[str, int]:
    private = sum(len(m.private_page_ids) for m in state.moves.values()
                  if m.namespace_id == namespace.namespace_id and m.destination is tier)
    if tier is Tier.L2:
        private += sum(len(l.private_page_ids) for l in state.leases.values()
                       if l.namespace_id == namespace.namespace_id)
    quarantined = sum(len(q.page_ids) for q in state.quarantines.values()
                      if q.session.namespace_id == namespace.namespace_id) if tier is Tier.L2 else 0
    allocator = namespace.allocator(tier)
    pressure = namespace.pressure[tier]
    return {
        "capacity_pages": namespace.capacity[tier],
        "chunks": len(state.chunks[tier].owned_by(namespace.namespace_id)),
        "free_pages": allocator.num_free,
        "owned_pages": namespace.tree.owned_pages(tier),
        "protected_pages": namespace.tree.protected_pages(tier),
        "evictable_pages": namespace.tree.evictable_pages(tier),
        "private_pages": private,
        "quarantined_pages": quarantined,
        "evicted_pages": pressure.evicted_pages,
        "pressure_episodes": pressure.episodes,
        "under_pressure": (pressure.last_eviction_at is not None
                           and state.clock() - pressure.last_eviction_at <= PRESSURE_QUIET_S),
    }

def _peer_status(state: DaemonState, session: Session) -> dict[str, Any]:
    export = state.peers.by_session.get(session.session_id)
    if export is None:
        return {}
    peers = state.namespaces[export.namespace_id].peers
    return {"peer": {"transport": export.request.transport, "device_id": export.request.device_id,
                     "num_blocks": export.request.num_blocks, "published_blocks": peers.blocks(export.peer_id),
                     "readers_may_open": len(state.peers.readable_by(export))}}

def status(state: DaemonState) -> dict[str, Any]:
    """The daemon's state as status shows it (the I/O layer adds its own)."""
    namespaces = []
    for namespace in state.namespaces.values():
        tree = namespace.tree
        namespaces.append({
            "namespace_id": namespace.namespace_id,
            "geometry": namespace.geometry.to_wire(),
            "bytes_per_page": namespace.geometry.bytes_per_page,
            "sessions": len(namespace.session_ids),
            "tiers": {tier.label: _tier_status(state, namespace, tier) for tier in tree.tiers},
            "tree_nodes": tree.num_nodes,
        })
    return {
        "sessions": [
            {"session": session_tag(s.session_id), "pid": s.identity.pid, "client_name": s.client_name,
             "namespace_id": s.namespace_id, "leases": len(s.lease_ids),
             "age_s": round(state.clock() - s.attached_at, 3), "idle_s": round(state.clock() - s.last_seen, 3),
             "pid_watched": s.pid_watched, "report": s.report, **_peer_status(state, s)}
            for s in state.sessions.values()
        ],
        "quarantines": [
            {"session": session_tag(session_id), "pid": q.session.identity.pid, "client_name": q.session.client_name,
             "namespace_id": q.session.namespace_id, "pages": len(q.page_ids), "reason": q.reason,
             "pid_watched": q.session.pid_watched, "idle_s": round(state.clock() - q.session.last_seen, 3)}
            for session_id, q in state.quarantines.items()
        ],
        "leases": len(state.leases),
        "pending": {"h2s": state.pending_moves("h2s"), "s2h": state.pending_moves("s2h"),
                    "r2h": state.pending_moves("r2h"), "h2r": len(state.remote_writes)},
        "namespaces": namespaces,
        "cost_model": state.cost.status({ns.namespace_id: ns.geometry.model_id for ns in state.namespaces.values()}),
        "pool": {tier.label: {"chunk_bytes": chunks.chunk_bytes, "chunks": chunks.num_chunks,
                              "free_chunks": len(chunks.free_chunks())}
                 for tier, chunks in state.chunks.items()},
        "metrics": state.metrics.snapshot(),
        "metrics_by_model": state.metrics.model_snapshot(),
        "histograms": state.metrics.histogram_snapshot(),
    }
