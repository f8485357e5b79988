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
import hashlib
import itertools
import logging
import secrets
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from kvcached.core.allocator import PageAllocator
from kvcached.core.leases import Lease, LeaseState, Session
from kvcached.core.tier_ops import OpState, TierMove
from kvcached.core.tiers import IntegrityError, Tier
from kvcached.core.tree import PrefixTree
from proto.errors import ErrorCode, ProtocolError
from proto.messages import KVGeometry

logger = logging.getLogger(__name__)

ARENA_ALIGN_BYTES = 2 * 1024 * 1024
# Pages (or slots) per namespace and tier, at most: a geometry with tiny pages would otherwise
# make allocators, the tree and the integrity check hold tens of millions of ids.
MAX_PAGES_PER_TIER = 1 << 20
# Of a namespace's L2 pages, at most this share is reserved by one session at a time, counted
# across all its leases (backup pages of its matches, pages held ahead); a match's L3 promotion
# reserves no more than that allowance either. Every reservation may evict cached prefixes, and
# a session keeps what it holds while it lives.
MAX_SESSION_RESERVED_SHARE = 0.5


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
    l3_region_offset_bytes: int = 0
    l3_allocator: PageAllocator | None = None      # None: no L3 for this namespace
    session_ids: set[int] = dataclasses.field(default_factory=set)
    arena_index: int = 0                           # which L2 arena / L3 region it occupies
    idle_since: float | None = None                # when its last session ended; None while attached

    def allocator(self, tier: Tier) -> PageAllocator:
        allocator = self.l2_allocator if tier is Tier.L2 else self.l3_allocator
        assert allocator is not None, f"namespace {self.namespace_id} has no {tier.label}"
        return allocator


class MatchReply(NamedTuple):
    hit_tokens: dict[str, int]      # per tier label
    lease_id: int | None
    host_page_ids: list[int]        # L2 pages of the hit prefix, in order
    backup_start_token: int
    backup_page_ids: list[int]      # private L2 pages to back up pages from backup_start_token on
    promoted_tokens: int = 0        # of the L2 hit, tokens just promoted from L3 for this match
    host_page_epochs: list[int] = []      # each host page's allocation epoch (see PageAllocator)
    backup_page_epochs: list[int] = []

    def to_wire(self) -> dict[str, Any]:
        return {"hit_tokens": self.hit_tokens, "lease_id": self.lease_id, "host_page_ids": self.host_page_ids,
                "backup_start_token": self.backup_start_token, "backup_page_ids": self.backup_page_ids,
                "promoted_tokens": self.promoted_tokens, "host_page_epochs": self.host_page_epochs,
                "backup_page_epochs": self.backup_page_epochs}


class Reservation(NamedTuple):
    """A standing lease's pages: a backup may be written into them before its prefix is known."""

    lease_id: int | None            # None: no page could be reserved
    page_ids: list[int]
    page_epochs: list[int]

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


def session_tag(session_id: int) -> str:
    """How status names a session: session ids are capabilities (a peer that knows one can detach
    that engine or release its leases), so status shows a digest, never the id."""
    return hashlib.blake2b(session_id.to_bytes(8, "little"), digest_size=6).hexdigest()


class DaemonState:
    def __init__(self, arena_plan: ArenaPlan, *, session_timeout_s: float,
                 l3_plan: ArenaPlan | None = None, clock: Callable[[], float] = time.monotonic):
        if arena_plan.arena_bytes <= 0:
            raise ValueError(f"L2 segment of {arena_plan.segment_bytes} bytes is too small for "
                             f"{arena_plan.max_namespaces} namespaces")
        if l3_plan is not None and l3_plan.max_namespaces != arena_plan.max_namespaces:
            raise ValueError("L2 and L3 plans must have the same number of namespaces")
        self.arena_plan = arena_plan
        self.l3_plan = l3_plan if l3_plan is not None and l3_plan.arena_bytes > 0 else None
        self.moves: dict[int, TierMove] = {}
        self._move_ids = itertools.count(1)
        self._namespace_ids = itertools.count()
        self._free_arena_indices = list(range(arena_plan.max_namespaces))
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
        namespace.idle_since = None
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
        num_pages = min(self.arena_plan.arena_bytes // geometry.bytes_per_page, MAX_PAGES_PER_TIER)
        if num_pages < 1:
            raise ProtocolError(ErrorCode.GEOMETRY_MISMATCH,
                                f"one page of this geometry ({geometry.bytes_per_page} bytes) does not fit "
                                f"in an L2 arena of {self.arena_plan.arena_bytes} bytes")
        if not self._free_arena_indices and not self._reclaim_idle_namespace():
            raise ProtocolError(ErrorCode.OUT_OF_SPACE,
                                f"all {self.arena_plan.max_namespaces} namespaces have attached engines; "
                                "start the daemon with a larger --max-namespaces")
        num_slots = min(self.l3_plan.arena_bytes // geometry.bytes_per_page, MAX_PAGES_PER_TIER) if self.l3_plan else 0
        tiers = (Tier.L2, Tier.L3) if num_slots else (Tier.L2,)
        index = self._free_arena_indices.pop(0)
        namespace = Namespace(
            namespace_id=next(self._namespace_ids),
            geometry=geometry,
            arena_offset_bytes=self.arena_plan.arena_offset(index),
            num_pages=num_pages,
            tree=PrefixTree(geometry.page_size, tiers=tiers, clock=self.clock),
            l2_allocator=PageAllocator(num_pages, first_epoch=secrets.randbits(48)),
            l3_region_offset_bytes=self.l3_plan.arena_offset(index) if num_slots else 0,
            l3_allocator=PageAllocator(num_slots) if num_slots else None,
            arena_index=index,
        )
        self.namespaces[namespace.namespace_id] = namespace
        self.geometry_to_namespace[geometry] = namespace
        logger.info("namespace %d (arena %d): %s, %d L2 pages and %d L3 slots of %d bytes",
                    namespace.namespace_id, index, geometry, num_pages, num_slots, geometry.bytes_per_page)
        return namespace

    def _reclaim_idle_namespace(self) -> bool:
        """Give the arena of the namespace idle longest (no session, no pending move) to a new one;
        its cached pages are dropped. Returns whether one was reclaimed."""
        busy = {move.namespace_id for move in self.moves.values()}
        idle = [ns for ns in self.namespaces.values()
                if not ns.session_ids and ns.namespace_id not in busy and ns.idle_since is not None]
        if not idle:
            return False
        victim = min(idle, key=lambda ns: ns.idle_since)
        del self.namespaces[victim.namespace_id]
        del self.geometry_to_namespace[victim.geometry]
        self._free_arena_indices.append(victim.arena_index)
        self.metrics.add("namespaces_reclaimed")
        logger.info("namespace %d (%s) reclaimed: idle since %.1f s, %d L2 pages dropped", victim.namespace_id,
                    victim.geometry.model_id, self.clock() - victim.idle_since, victim.tree.owned_pages(Tier.L2))
        return True

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
        namespace = self.namespaces[session.namespace_id]
        namespace.session_ids.discard(session.session_id)
        if not namespace.session_ids:
            namespace.idle_since = self.clock()
        self.metrics.add("leases_reclaimed", reclaimed)
        logger.info("session %x %s; %d leases reclaimed", session.session_id, reason, reclaimed)
        return reclaimed

    # ---- match, release, commit ----------------------------------------------------------

    def match(self, session_id: int, token_bytes: bytes, reserve_backup: bool = False,
              promote_l3: bool = False, promoted_tokens: int = 0) -> MatchReply | TierMove:
        """The hit per tier, a lease on the L2 hit and, with reserve_backup, private L2 pages for
        the pages the daemon lacks.

        With promote_l3, when L3 holds more of the prefix than L2, returns instead the S2H move
        that must run first (planned from the same tree walk); the caller runs it, finishes it,
        then matches again without promote_l3."""
        session = self.session(session_id)
        namespace = self.namespaces[session.namespace_id]
        page_size = namespace.geometry.page_size
        token_ids = np.frombuffer(token_bytes, dtype="<i4")
        num_pages = len(token_ids) // page_size
        token_ids = token_ids[: num_pages * page_size]

        result = namespace.tree.match(token_ids)
        allowed = self._reservable_pages(session, namespace)
        if promote_l3 and result.hit_tokens.get(Tier.L3, 0) > result.hit_tokens[Tier.L2] and allowed > 0:
            start_page = result.hit_tokens[Tier.L2] // page_size
            move = self._plan_move(namespace, result, token_ids, Tier.L3, Tier.L2, start_page,
                                   min(result.hit_tokens[Tier.L3] // page_size, start_page + allowed))
            if move is not None:
                return move
        hits = {tier.label: count for tier, count in result.hit_tokens.items()}
        hit_tokens = result.hit_tokens[Tier.L2]
        locked_node = result.last_node[Tier.L2]
        host_page_ids = list(result.page_ids[Tier.L2])
        hit_pages = hit_tokens // page_size
        self.metrics.add("matches")
        self.metrics.add("match_tokens", num_pages * page_size)
        self.metrics.add("hit_tokens_l2", hit_tokens)
        if Tier.L3 in result.hit_tokens:
            self.metrics.add("hit_tokens_l3", result.hit_tokens[Tier.L3])

        # Lock the hit before reserving: the reservation may evict, and must not evict our own hit.
        if locked_node is not None:
            namespace.tree.lock(locked_node, Tier.L2)
        backup_page_ids: list[int] = []
        if reserve_backup and num_pages > hit_pages:
            wanted = num_pages - hit_pages
            if wanted > allowed:
                self.metrics.add("reservations_capped")
            backup_page_ids = self._reserve_l2(namespace, min(wanted, allowed)) if allowed > 0 else []
            self.metrics.add("backup_pages_reserved", len(backup_page_ids))
        allocator = namespace.l2_allocator
        host_page_epochs = allocator.epochs_of(host_page_ids)
        if locked_node is None and not backup_page_ids:
            return MatchReply(hits, None, host_page_ids, hit_tokens, [], promoted_tokens, host_page_epochs)

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
        return MatchReply(hits, lease.lease_id, host_page_ids, hit_tokens, backup_page_ids, promoted_tokens,
                          host_page_epochs, allocator.epochs_of(backup_page_ids))

    def reserve_pages(self, session_id: int, num_pages: int) -> Reservation:
        """A standing lease on up to num_pages private L2 pages (evicting if needed; possibly none),
        for backups that the engine writes before it tells which prefix they hold (commit_pages).
        Capped with the session's other reservations (``_reservable_pages``)."""
        session = self.session(session_id)
        namespace = self.namespaces[session.namespace_id]
        allowed = self._reservable_pages(session, namespace)
        if num_pages > allowed:
            self.metrics.add("reservations_capped")
        page_ids = self._reserve_l2(namespace, min(num_pages, allowed)) if allowed > 0 else []
        self.metrics.add("pages_reserved_ahead", len(page_ids))
        if not page_ids:
            return Reservation(None, [], [])
        lease = Lease(lease_id=next(self._lease_ids), session_id=session_id, namespace_id=namespace.namespace_id,
                      token_ids=np.empty(0, dtype="<i4"), locked_node=None, hit_pages=0,
                      private_page_ids=page_ids, standing=True)
        self.leases[lease.lease_id] = lease
        session.lease_ids.add(lease.lease_id)
        return Reservation(lease.lease_id, page_ids, namespace.l2_allocator.epochs_of(page_ids))

    def _reservable_pages(self, session: Session, namespace: Namespace) -> int:
        """How many more L2 pages this session may reserve: MAX_SESSION_RESERVED_SHARE of the
        namespace's pages, less the private pages of all its leases. One cap for every path that
        reserves L2 pages for a session (a match's backup pages or L3 promotion, RESERVE_PAGES)."""
        held = sum(len(self.leases[lease_id].private_page_ids) for lease_id in session.lease_ids)
        return max(0, int(namespace.num_pages * MAX_SESSION_RESERVED_SHARE) - held)

    def _reserve_l2(self, namespace: Namespace, num_pages: int) -> list[int]:
        page_ids = self._reserve(namespace, Tier.L2, num_pages)
        if not page_ids:
            self.metrics.add("backup_reserve_failures")
        return page_ids

    def _reserve(self, namespace: Namespace, tier: Tier, num_pages: int) -> list[int]:
        """Best effort: evict the tier's LRU leaves if needed, then reserve as many pages as are
        free, up to num_pages (possibly none). Locked nodes are never evicted."""
        allocator = namespace.allocator(tier)
        if not allocator.can_allocate(num_pages):
            evicted = namespace.tree.evict(tier, num_pages - allocator.num_free)
            if evicted:
                allocator.free(evicted)
                self.metrics.add(f"evicted_pages_{tier.label}", len(evicted))
        count = min(num_pages, allocator.num_free)
        if count == 0:
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

    def commit_backup(self, session_id: int, lease_id: int,
                      host_page_ids: list[int]) -> tuple[CommitReply, TierMove | None]:
        """Publish the backed-up pages (a prefix of the lease's reservation) and end the lease.

        Also returns the write-through of the committed path to L3, when there is one to run."""
        _, lease = self._lease_of(session_id, lease_id)
        if lease.standing:
            raise ProtocolError(ErrorCode.NOT_LEASED, f"lease {lease_id} holds pages reserved ahead: "
                                "commit them with the prefix they hold (COMMIT_PAGES)")
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
        path_tokens = lease.token_ids[:num_tokens]
        self._end_lease(lease, LeaseState.COMMITTED)
        self.metrics.add("backup_commits")
        self.metrics.add("backup_pages_committed", new_pages)
        self.metrics.add("backup_pages_duplicate", duplicates)
        write_through = self.plan_write_through(namespace, path_tokens) if host_page_ids else None
        return CommitReply(new_pages, duplicates), write_through

    def commit_pages(self, session_id: int, lease_id: int, token_bytes: bytes, start_page: int,
                     host_page_ids: list[int]) -> tuple[CommitReply, TierMove | None]:
        """Publish pages of a standing lease as pages [start_page, start_page + n) of a prefix.

        The pages named leave the lease whatever happens: the tree keeps those it lacked, the
        rest (pages it holds already, or all of them when the prefix's first start_page pages
        are no longer in L2) go back to the allocator. A lease left with no pages ends.
        Also returns the write-through of the committed path to L3, when there is one to run."""
        _, lease = self._lease_of(session_id, lease_id)
        if not lease.standing:
            raise ProtocolError(ErrorCode.NOT_LEASED, f"lease {lease_id} comes from a match: commit its "
                                "reserved pages with BACKUP_COMMIT")
        namespace = self.namespaces[lease.namespace_id]
        page_size = namespace.geometry.page_size
        if len(set(host_page_ids)) != len(host_page_ids):
            raise ProtocolError(ErrorCode.BAD_PAGES, "a page id is named twice")
        private = set(lease.private_page_ids)
        foreign = [p for p in host_page_ids if p not in private]
        if foreign:
            raise ProtocolError(ErrorCode.NOT_LEASED, f"pages {foreign[:8]} are not held by lease {lease_id}")
        token_ids = np.frombuffer(token_bytes, dtype="<i4")
        num_tokens = (start_page + len(host_page_ids)) * page_size
        if len(token_ids) < num_tokens:
            # The pages still leave the lease (as the engine, which sends commits without waiting,
            # counts on): freed, not published.
            self._return_reserved(namespace, lease, host_page_ids)
            raise ProtocolError(ErrorCode.BAD_FRAME, f"{len(token_ids)} tokens do not cover pages "
                                f"[{start_page}, {start_page + len(host_page_ids)}) of {page_size} tokens; "
                                "the pages were returned")
        token_ids = token_ids[:num_tokens]
        tree = namespace.tree
        new_pages, duplicates, kept = 0, 0, set()
        resident = tree.match(token_ids[:start_page * page_size]).hit_tokens[Tier.L2] // page_size if start_page else 0
        if resident < start_page:
            self.metrics.add("backup_commits_prefix_gone")
        elif host_page_ids:
            inserted = tree.insert(token_ids, Tier.L2, host_page_ids, start_page=start_page)
            kept = set(host_page_ids) - set(inserted.duplicate_page_ids)
            new_pages, duplicates = inserted.new_pages, len(inserted.duplicate_page_ids)
        self._return_reserved(namespace, lease, host_page_ids, kept)
        self.metrics.add("backup_commits")
        self.metrics.add("backup_pages_committed", new_pages)
        self.metrics.add("backup_pages_duplicate", duplicates)
        write_through = self.plan_write_through(namespace, token_ids) if new_pages else None
        return CommitReply(new_pages, duplicates), write_through

    def _return_reserved(self, namespace: Namespace, lease: Lease, page_ids: list[int],
                         kept: set[int] = frozenset()) -> None:
        """Take page_ids out of a standing lease: those the tree kept are its own now, the rest are
        freed. A lease left with no pages ends."""
        returned = [p for p in page_ids if p not in kept]
        if returned:
            namespace.l2_allocator.free(returned)
        named = set(page_ids)
        lease.private_page_ids = [p for p in lease.private_page_ids if p not in named]
        if not lease.private_page_ids:
            self._end_lease(lease, LeaseState.COMMITTED)

    # ---- moves between tiers (L3) ------------------------------------------------------------

    def plan_write_through(self, namespace: Namespace, token_ids: np.ndarray) -> TierMove | None:
        """H2S: copy the L2 pages of this path that L3 lacks into newly reserved L3 slots."""
        if namespace.l3_allocator is None:
            return None
        result = namespace.tree.match(token_ids)
        page_size = namespace.geometry.page_size
        l2_pages = result.hit_tokens[Tier.L2] // page_size
        l3_pages = result.hit_tokens[Tier.L3] // page_size
        if l3_pages >= l2_pages:
            return None
        return self._plan_move(namespace, result, token_ids, Tier.L2, Tier.L3, l3_pages, l2_pages)

    def _plan_move(self, namespace: Namespace, result, token_ids: np.ndarray, source: Tier,
                   destination: Tier, start_page: int, end_page: int) -> TierMove | None:
        # Lock the source pages and the destination's resident prefix before reserving: the
        # reservation may evict, and must not evict what this move reads or inserts below.
        locks = [(node, tier) for node, tier in ((result.last_node[source], source),
                                                 (result.last_node[destination], destination))
                 if node is not None]
        for node, tier in locks:
            namespace.tree.lock(node, tier)
        private_page_ids = self._reserve(namespace, destination, end_page - start_page)
        if not private_page_ids:
            for node, tier in locks:
                namespace.tree.unlock(node, tier)
            self.metrics.add(f"{'h2s' if destination is Tier.L3 else 's2h'}_no_space")
            return None
        count = len(private_page_ids)
        page_size = namespace.geometry.page_size
        move = TierMove(
            op_id=next(self._move_ids), namespace_id=namespace.namespace_id, source=source,
            destination=destination, token_ids=token_ids[: (start_page + count) * page_size].copy(),
            start_page=start_page, source_page_ids=result.page_ids[source][start_page:start_page + count],
            private_page_ids=private_page_ids, locks=locks)
        self.moves[move.op_id] = move
        return move

    def pending_moves(self, direction: str) -> int:
        return sum(move.direction == direction for move in self.moves.values())

    def finish_move(self, move: TierMove, ok: bool, skipped: bool = False) -> int:
        """Publish a completed move's pages in the tree, or return them on failure.

        Returns the number of pages the destination tier gained. Once published, the pages
        belong to the tree: nothing that happens to a session later frees them."""
        namespace = self.namespaces[move.namespace_id]
        allocator = namespace.allocator(move.destination)
        gained = 0
        if ok:
            move.transition(OpState.PUBLISHED)
            inserted = namespace.tree.insert(move.token_ids, move.destination, move.private_page_ids,
                                             start_page=move.start_page)
            if inserted.duplicate_page_ids:      # someone published the same pages meanwhile
                allocator.free(inserted.duplicate_page_ids)
            gained = inserted.new_pages
            self.metrics.add(f"{move.direction}_pages_published", gained)
        else:
            move.transition(OpState.FAILED)
            allocator.free(move.private_page_ids)
            # skipped: never started (policy), not an I/O failure
            self.metrics.add(f"{move.direction}_{'policy_skips' if skipped else 'failures'}")
        move.private_page_ids = []
        for node, tier in move.locks:
            namespace.tree.unlock(node, tier)
        move.locks = []
        del self.moves[move.op_id]
        return gained

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
        owned_by_tier = namespace.tree.check_integrity()
        expected_refs: dict[Tier, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        nodes_by_id = {}
        private_by_tier: dict[Tier, list[int]] = collections.defaultdict(list)

        def expect_lock(node, tier: Tier) -> None:
            while node is not None and node.parent is not None:
                expected_refs[tier][id(node)] += 1
                nodes_by_id[id(node)] = node
                node = node.parent

        for lease in self.leases.values():
            if lease.namespace_id == namespace.namespace_id:
                private_by_tier[Tier.L2].extend(lease.private_page_ids)
                expect_lock(lease.locked_node, Tier.L2)
        for move in self.moves.values():
            if move.namespace_id == namespace.namespace_id:
                if move.state is not OpState.PENDING:
                    raise IntegrityError(f"move {move.op_id} is {move.state} but still tracked")
                private_by_tier[move.destination].extend(move.private_page_ids)
                for node, tier in move.locks:
                    expect_lock(node, tier)

        for tier, owned in owned_by_tier.items():
            allocator = namespace.allocator(tier)
            allocator.check_integrity()
            free = allocator.free_page_ids()
            private = set(private_by_tier[tier])
            where = f"namespace {namespace.namespace_id} {tier.label}"
            if len(private) != len(private_by_tier[tier]):
                raise IntegrityError(f"{where}: a private page is reserved twice")
            for a_name, a, b_name, b in (("owned", owned, "free", free), ("owned", owned, "private", private),
                                         ("free", free, "private", private)):
                both = a & b
                if both:
                    raise IntegrityError(f"{where}: pages both {a_name} and {b_name}: {sorted(both)[:8]}")
            total = len(owned) + len(free) + len(private)
            if total != allocator.num_pages:
                raise IntegrityError(f"{where}: owned {len(owned)} + free {len(free)} + private {len(private)} "
                                     f"!= capacity {allocator.num_pages}")
            for node_id, count in expected_refs[tier].items():
                node = nodes_by_id[node_id]
                if node.ref_count[tier] != count:
                    raise IntegrityError(f"{where}: node ref_count {node.ref_count[tier]} != {count} locks held "
                                         "by leases and pending moves")
            if not expected_refs[tier] and namespace.tree.protected_pages(tier) != 0:
                raise IntegrityError(f"{where}: pages are protected but nothing locks them")

    def _tier_status(self, namespace: Namespace, tier: Tier) -> dict[str, int]:
        private = sum(len(m.private_page_ids) for m in self.moves.values()
                      if m.namespace_id == namespace.namespace_id and m.destination is tier)
        if tier is Tier.L2:
            private += sum(len(l.private_page_ids) for l in self.leases.values()
                           if l.namespace_id == namespace.namespace_id)
        allocator = namespace.allocator(tier)
        return {
            "capacity_pages": allocator.num_pages,
            "free_pages": allocator.num_free,
            "owned_pages": namespace.tree.owned_pages(tier),
            "protected_pages": namespace.tree.protected_pages(tier),
            "evictable_pages": namespace.tree.evictable_pages(tier),
            "private_pages": private,
        }

    def status(self) -> dict[str, Any]:
        namespaces = []
        for namespace in self.namespaces.values():
            tree = namespace.tree
            namespaces.append({
                "namespace_id": namespace.namespace_id,
                "geometry": namespace.geometry.to_wire(),
                "bytes_per_page": namespace.geometry.bytes_per_page,
                "sessions": len(namespace.session_ids),
                "tiers": {tier.label: self._tier_status(namespace, tier) for tier in tree.tiers},
                "tree_nodes": tree.num_nodes,
            })
        return {
            "sessions": [
                {"session": session_tag(s.session_id), "pid": s.pid, "client_name": s.client_name,
                 "namespace_id": s.namespace_id, "leases": len(s.lease_ids),
                 "age_s": round(self.clock() - s.attached_at, 3), "report": s.report}
                for s in self.sessions.values()
            ],
            "leases": len(self.leases),
            "pending": {"h2s": self.pending_moves("h2s"), "s2h": self.pending_moves("s2h")},
            "namespaces": namespaces,
            "metrics": self.metrics.snapshot(),
        }
