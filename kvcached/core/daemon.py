"""The daemon's whole state, with no I/O: namespaces, sessions, leases and metrics.

The server loop decodes a request, calls one method here and sends back what it returns, or
the ``ProtocolError`` it raises. Nothing here blocks or touches a socket, so every rule below
is tested in-process.

Ownership of L2 pages, per namespace, is a partition: every page is exactly one of
tree-owned, free (in the allocator) or private (reserved by an active lease for a backup).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import secrets
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from kvcached.core.allocator import PageAllocator
from kvcached.core.leases import Lease, LeaseState, Session
from kvcached.core.tiers import IntegrityError, Tier
from kvcached.core.tree import PrefixTree
from proto.errors import ErrorCode, ProtocolError
from proto.messages import KVGeometry

logger = logging.getLogger(__name__)

ARENA_ALIGN_BYTES = 2 * 1024 * 1024


class ArenaPlan(NamedTuple):
    """How the L2 segment is split: one equal arena per namespace, 2 MiB aligned."""

    segment_bytes: int
    max_namespaces: int

    @property
    def arena_bytes(self) -> int:
        return (self.segment_bytes // self.max_namespaces) // ARENA_ALIGN_BYTES * ARENA_ALIGN_BYTES

    def arena_offset(self, index: int) -> int:
        return index * self.arena_bytes


@dataclasses.dataclass(eq=False)
class Namespace:
    namespace_id: int
    geometry: KVGeometry
    arena_offset_bytes: int
    num_pages: int
    tree: PrefixTree
    l2_allocator: PageAllocator
    session_ids: set[int] = dataclasses.field(default_factory=set)


class MatchReply(NamedTuple):
    hit_tokens: dict[str, int]      # per tier label
    lease_id: int | None
    host_page_ids: list[int]        # L2 pages of the hit prefix, in order
    backup_start_token: int
    backup_page_ids: list[int]      # private L2 pages to back up pages from backup_start_token on

    def to_wire(self) -> dict[str, Any]:
        return self._asdict()


class CommitReply(NamedTuple):
    new_pages: int
    duplicate_pages: int

    def to_wire(self) -> dict[str, Any]:
        return self._asdict()


class Metrics:
    """Monotonic counters; the status snapshot reports them as they are."""

    def __init__(self) -> None:
        self.counters: collections.Counter[str] = collections.Counter()

    def add(self, name: str, value: int | float = 1) -> None:
        self.counters[name] += value

    def snapshot(self) -> dict[str, int | float]:
        return dict(sorted(self.counters.items()))


class DaemonState:
    def __init__(self, arena_plan: ArenaPlan, *, session_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        if arena_plan.arena_bytes <= 0:
            raise ValueError(f"L2 segment of {arena_plan.segment_bytes} bytes is too small for "
                             f"{arena_plan.max_namespaces} namespaces")
        self.arena_plan = arena_plan
        self.session_timeout_s = session_timeout_s
        self.clock = clock
        self.namespaces: dict[int, Namespace] = {}
        self.geometry_to_namespace: dict[KVGeometry, Namespace] = {}
        self.sessions: dict[int, Session] = {}
        self.leases: dict[int, Lease] = {}
        self.metrics = Metrics()
        self._lease_ids = itertools.count(1)

    # ---- sessions -----------------------------------------------------------------------

    def attach(self, geometry: KVGeometry, pid: int, client_name: str = "") -> tuple[Session, Namespace]:
        namespace = self.geometry_to_namespace.get(geometry)
        if namespace is None:
            namespace = self._create_namespace(geometry)
        now = self.clock()
        session_id = secrets.randbits(62) + 1
        while session_id in self.sessions:
            session_id = secrets.randbits(62) + 1
        session = Session(session_id, namespace.namespace_id, pid, client_name, now, now)
        self.sessions[session_id] = session
        namespace.session_ids.add(session_id)
        self.metrics.add("attaches")
        logger.info("session %x attached: pid %d, %s, namespace %d", session_id, pid,
                    client_name or "-", namespace.namespace_id)
        return session, namespace

    def _create_namespace(self, geometry: KVGeometry) -> Namespace:
        index = len(self.namespaces)
        if index >= self.arena_plan.max_namespaces:
            raise ProtocolError(ErrorCode.OUT_OF_SPACE,
                                f"all {self.arena_plan.max_namespaces} namespaces are in use; "
                                "start the daemon with a larger --max-namespaces")
        num_pages = self.arena_plan.arena_bytes // geometry.bytes_per_page
        if num_pages < 1:
            raise ProtocolError(ErrorCode.GEOMETRY_MISMATCH,
                                f"one page of this geometry ({geometry.bytes_per_page} bytes) does not fit "
                                f"in an L2 arena of {self.arena_plan.arena_bytes} bytes")
        namespace = Namespace(
            namespace_id=index,
            geometry=geometry,
            arena_offset_bytes=self.arena_plan.arena_offset(index),
            num_pages=num_pages,
            tree=PrefixTree(geometry.page_size, tiers=(Tier.L2,), clock=self.clock),
            l2_allocator=PageAllocator(num_pages),
        )
        self.namespaces[index] = namespace
        self.geometry_to_namespace[geometry] = namespace
        logger.info("namespace %d: %s, %d L2 pages of %d bytes", index, geometry, num_pages,
                    geometry.bytes_per_page)
        return namespace

    def session(self, session_id: int) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise ProtocolError(ErrorCode.NOT_ATTACHED, f"no session {session_id:x} (never attached, detached or expired)")
        session.last_seen = self.clock()
        return session

    def heartbeat(self, session_id: int) -> None:
        self.session(session_id)

    def engine_report(self, session_id: int, report: dict) -> None:
        self.session(session_id).report = report

    def detach(self, session_id: int) -> int:
        """End a session and reclaim its leases; returns how many leases were reclaimed."""
        session = self.session(session_id)
        return self._end_session(session, reason="detached")

    def expire_sessions(self) -> list[int]:
        """End every session that missed its heartbeats; returns their ids."""
        deadline = self.clock() - self.session_timeout_s
        expired = [s for s in self.sessions.values() if s.last_seen < deadline]
        for session in expired:
            self._end_session(session, reason="expired")
            self.metrics.add("sessions_expired")
        return [s.session_id for s in expired]

    def _end_session(self, session: Session, reason: str) -> int:
        reclaimed = 0
        for lease_id in sorted(session.lease_ids):
            self._end_lease(self.leases[lease_id], LeaseState.RECLAIMED)
            reclaimed += 1
        del self.sessions[session.session_id]
        self.namespaces[session.namespace_id].session_ids.discard(session.session_id)
        self.metrics.add("leases_reclaimed", reclaimed)
        logger.info("session %x %s; %d leases reclaimed", session.session_id, reason, reclaimed)
        return reclaimed

    # ---- match, release, commit ----------------------------------------------------------

    def match(self, session_id: int, token_bytes: bytes, reserve_backup: bool = False) -> MatchReply:
        session = self.session(session_id)
        namespace = self.namespaces[session.namespace_id]
        page_size = namespace.geometry.page_size
        token_ids = np.frombuffer(token_bytes, dtype="<i4")
        num_pages = len(token_ids) // page_size
        token_ids = token_ids[: num_pages * page_size]

        result = namespace.tree.match(token_ids)
        hit_tokens = result.hit_tokens[Tier.L2]
        locked_node = result.last_node[Tier.L2]
        host_page_ids = list(result.page_ids[Tier.L2])
        hit_pages = hit_tokens // page_size
        self.metrics.add("matches")
        self.metrics.add("match_tokens", num_pages * page_size)
        self.metrics.add("hit_tokens_l2", hit_tokens)

        # Lock the hit before reserving: the reservation may evict, and must not evict our own hit.
        if locked_node is not None:
            namespace.tree.lock(locked_node, Tier.L2)
        backup_page_ids: list[int] = []
        if reserve_backup and num_pages > hit_pages:
            backup_page_ids = self._reserve_l2(namespace, num_pages - hit_pages)
            self.metrics.add("backup_pages_reserved", len(backup_page_ids))
        if locked_node is None and not backup_page_ids:
            return MatchReply({Tier.L2.label: hit_tokens}, None, host_page_ids, hit_tokens, [])

        lease = Lease(
            lease_id=next(self._lease_ids),
            session_id=session_id,
            namespace_id=namespace.namespace_id,
            token_ids=token_ids[: (hit_pages + len(backup_page_ids)) * page_size],
            locked_node=locked_node,
            hit_pages=hit_pages,
            private_page_ids=backup_page_ids,
        )
        self.leases[lease.lease_id] = lease
        session.lease_ids.add(lease.lease_id)
        return MatchReply({Tier.L2.label: hit_tokens}, lease.lease_id, host_page_ids, hit_tokens, backup_page_ids)

    def _reserve_l2(self, namespace: Namespace, num_pages: int) -> list[int]:
        """Best effort: evict LRU L2 leaves if needed, then reserve as many pages as are free, up to num_pages."""
        allocator = namespace.l2_allocator
        if not allocator.can_allocate(num_pages):
            evicted = namespace.tree.evict(Tier.L2, num_pages - allocator.num_free)
            if evicted:
                allocator.free(evicted)
                self.metrics.add("evicted_pages_l2", len(evicted))
        count = min(num_pages, allocator.num_free)
        if count == 0:
            self.metrics.add("backup_reserve_failures")
            return []
        page_ids = allocator.allocate(count)
        assert page_ids is not None
        return page_ids

    def _lease_of(self, session_id: int, lease_id: int) -> tuple[Session, Lease]:
        session = self.session(session_id)
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is not LeaseState.ACTIVE:
            raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id} is not active (already released, "
                                "committed or reclaimed, or never granted)")
        if lease.session_id != session_id:
            raise ProtocolError(ErrorCode.NOT_LEASED, f"lease {lease_id} belongs to another session")
        return session, lease

    def release(self, session_id: int, lease_id: int) -> None:
        _, lease = self._lease_of(session_id, lease_id)
        self._end_lease(lease, LeaseState.RELEASED)
        self.metrics.add("leases_released")

    def commit_backup(self, session_id: int, lease_id: int, host_page_ids: list[int]) -> CommitReply:
        """Publish the backed-up pages (a prefix of the lease's reservation) and end the lease."""
        _, lease = self._lease_of(session_id, lease_id)
        namespace = self.namespaces[lease.namespace_id]
        for page_id in host_page_ids:
            if not 0 <= page_id < namespace.num_pages:
                raise ProtocolError(ErrorCode.BAD_PAGES,
                                    f"page id {page_id} is out of range 0..{namespace.num_pages - 1}")
        if host_page_ids != lease.private_page_ids[: len(host_page_ids)]:
            raise ProtocolError(ErrorCode.NOT_LEASED,
                                f"pages {host_page_ids[:8]}... are not the pages reserved by lease {lease_id} "
                                "(send a prefix of the reservation, in order)")
        page_size = namespace.geometry.page_size
        num_tokens = (lease.hit_pages + len(host_page_ids)) * page_size
        new_pages = duplicates = 0
        if host_page_ids:
            inserted = namespace.tree.insert(lease.token_ids[:num_tokens], Tier.L2, host_page_ids,
                                             start_page=lease.hit_pages)
            # The tree now owns the pages it kept; duplicates go back to the allocator at lease end.
            kept = set(host_page_ids) - set(inserted.duplicate_page_ids)
            lease.private_page_ids = [p for p in lease.private_page_ids if p not in kept]
            new_pages, duplicates = inserted.new_pages, len(inserted.duplicate_page_ids)
        self._end_lease(lease, LeaseState.COMMITTED)
        self.metrics.add("backup_commits")
        self.metrics.add("backup_pages_committed", new_pages)
        self.metrics.add("backup_pages_duplicate", duplicates)
        return CommitReply(new_pages, duplicates)

    def _end_lease(self, lease: Lease, new_state: LeaseState) -> None:
        lease.transition(new_state)
        namespace = self.namespaces[lease.namespace_id]
        if lease.locked_node is not None:
            namespace.tree.unlock(lease.locked_node, Tier.L2)
        if lease.private_page_ids:
            namespace.l2_allocator.free(lease.private_page_ids)
        lease.private_page_ids = []
        del self.leases[lease.lease_id]
        session = self.sessions.get(lease.session_id)
        if session is not None:
            session.lease_ids.discard(lease.lease_id)

    # ---- integrity and status -------------------------------------------------------------

    def check_integrity(self) -> None:
        for lease in self.leases.values():
            if lease.state is not LeaseState.ACTIVE:
                raise IntegrityError(f"lease {lease.lease_id} is {lease.state} but still tracked")
            session = self.sessions.get(lease.session_id)
            if session is None or lease.lease_id not in session.lease_ids:
                raise IntegrityError(f"lease {lease.lease_id} has no live session that knows it")
        for session in self.sessions.values():
            for lease_id in session.lease_ids:
                if lease_id not in self.leases:
                    raise IntegrityError(f"session {session.session_id:x} holds unknown lease {lease_id}")
        for namespace in self.namespaces.values():
            self._check_namespace(namespace)

    def _check_namespace(self, namespace: Namespace) -> None:
        owned = namespace.tree.check_integrity()[Tier.L2]
        namespace.l2_allocator.check_integrity()
        free = namespace.l2_allocator.free_page_ids()
        private: set[int] = set()
        expected_refs: collections.Counter[int] = collections.Counter()
        nodes_by_id = {}
        for lease in self.leases.values():
            if lease.namespace_id != namespace.namespace_id:
                continue
            overlap = private.intersection(lease.private_page_ids)
            if overlap or len(set(lease.private_page_ids)) != len(lease.private_page_ids):
                raise IntegrityError(f"private pages reserved twice: {sorted(overlap)[:8]}")
            private.update(lease.private_page_ids)
            node = lease.locked_node
            while node is not None and node.parent is not None:
                expected_refs[id(node)] += 1
                nodes_by_id[id(node)] = node
                node = node.parent
        for a_name, a, b_name, b in (("owned", owned, "free", free), ("owned", owned, "private", private),
                                     ("free", free, "private", private)):
            both = a & b
            if both:
                raise IntegrityError(f"namespace {namespace.namespace_id}: pages both {a_name} and {b_name}: "
                                     f"{sorted(both)[:8]}")
        total = len(owned) + len(free) + len(private)
        if total != namespace.num_pages:
            raise IntegrityError(f"namespace {namespace.namespace_id}: owned {len(owned)} + free {len(free)} + "
                                 f"private {len(private)} != capacity {namespace.num_pages}")
        for node_id, node in nodes_by_id.items():
            if node.ref_count[Tier.L2] != expected_refs[node_id]:
                raise IntegrityError(f"node ref_count {node.ref_count[Tier.L2]} != {expected_refs[node_id]} "
                                     "locks held by active leases")
        if sum(expected_refs.values()) == 0 and namespace.tree.protected_pages(Tier.L2) != 0:
            raise IntegrityError("pages are protected but no lease locks them")

    def status(self) -> dict[str, Any]:
        namespaces = []
        for namespace in self.namespaces.values():
            tree = namespace.tree
            private = sum(len(l.private_page_ids) for l in self.leases.values()
                          if l.namespace_id == namespace.namespace_id)
            namespaces.append({
                "namespace_id": namespace.namespace_id,
                "geometry": namespace.geometry.to_wire(),
                "bytes_per_page": namespace.geometry.bytes_per_page,
                "sessions": len(namespace.session_ids),
                "tiers": {
                    Tier.L2.label: {
                        "capacity_pages": namespace.num_pages,
                        "free_pages": namespace.l2_allocator.num_free,
                        "owned_pages": tree.owned_pages(Tier.L2),
                        "protected_pages": tree.protected_pages(Tier.L2),
                        "evictable_pages": tree.evictable_pages(Tier.L2),
                        "private_pages": private,
                    },
                },
                "tree_nodes": tree.num_nodes,
            })
        return {
            "sessions": [
                {"session_id": f"{s.session_id:x}", "pid": s.pid, "client_name": s.client_name,
                 "namespace_id": s.namespace_id, "leases": len(s.lease_ids),
                 "age_s": round(self.clock() - s.attached_at, 3), "report": s.report}
                for s in self.sessions.values()
            ],
            "leases": len(self.leases),
            "namespaces": namespaces,
            "metrics": self.metrics.snapshot(),
        }
