"""The daemon's whole state, with no I/O: namespaces, sessions, leases and metrics.

The server loop decodes a request, calls one method here and sends back what it returns, or
the ``ProtocolError`` it raises. Nothing here blocks or touches a socket, so every rule below
is tested in-process.

Ownership of L2 pages, per namespace, is a partition: every page is exactly one of
tree-owned, free (in the allocator), private (reserved by an active lease for a backup, or by a
pending tier move) or quarantined (private to a session that ended while its process may still be
writing them; see "Fencing" in docs/architecture.md).
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
from kvcached.core.cost_model import NO_DECISION, CostModel, Decision
from kvcached.core.l3_index import (ROOT_KEY, DeleteSlots, DropNamespace, IndexChange, NamespaceLayout, PutNamespace,
                                    PutSlots, SavedNamespace, SlotRow, namespace_key, plan_rebuild)
from kvcached.core.leases import Lease, LeaseState, Quarantine, Session
from kvcached.core.tier_ops import OpState, TierMove
from kvcached.core.tiers import IntegrityError, Tier
from kvcached.core.tree import PrefixTree
from proto.errors import ErrorCode, ProtocolError
from proto.messages import KVGeometry
from proto.replies import CommitReply, MatchReply

logger = logging.getLogger(__name__)

ARENA_ALIGN_BYTES = 2 * 1024 * 1024
# Pages (or slots) per namespace and tier, at most: a geometry with tiny pages would otherwise
# make allocators, the tree and the integrity check hold tens of millions of ids.
MAX_PAGES_PER_TIER = 1 << 20
# Of a namespace's L2 pages, at most this share is reserved by one session at a time, counted
# across all its leases (the backup pages of its matches); a match's L3 promotion reserves no
# more than that allowance either. Every reservation may evict cached prefixes, and a session
# keeps what it holds while it lives.
MAX_SESSION_RESERVED_SHARE = 0.5
# Ids of ended sessions remembered, so that a late commit from one is told (and counted) apart
# from a request naming a session that never existed.
MAX_ENDED_SESSIONS = 4096


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
    index_key: str = ""                            # with a persistent L3 index: namespace_key(geometry)
    l3_checksums: np.ndarray | None = None         # with a persistent L3 index: crc32 per L3 slot held

    def allocator(self, tier: Tier) -> PageAllocator:
        allocator = self.l2_allocator if tier is Tier.L2 else self.l3_allocator
        assert allocator is not None, f"namespace {self.namespace_id} has no {tier.label}"
        return allocator


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
    def __init__(self, arena_plan: ArenaPlan, *, session_timeout_s: float, session_grace_s: float = 30.0,
                 l3_plan: ArenaPlan | None = None, clock: Callable[[], float] = time.monotonic,
                 l3_index_sink: Callable[[IndexChange], None] | None = None, cost_model: CostModel | None = None):
        """``session_timeout_s``: how long a session whose process the daemon cannot watch lives
        without a sign of life. ``session_grace_s``: how long a watched (living) process's session
        lives without one, and how long the pages of an unwatched one stay quarantined after its
        last sign of life. ``l3_index_sink``: where every change of L3 residency is reported, in
        order, for a persistent L3 file (the I/O layer writes them to its index); None: L3 is
        temporary. ``cost_model``: decides which restores are taken (default: policy cost, the
        default priors)."""
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
        if session_grace_s < session_timeout_s:
            raise ValueError(f"session_grace_s ({session_grace_s}) must be at least session_timeout_s "
                             f"({session_timeout_s})")
        self.session_timeout_s = session_timeout_s
        self.session_grace_s = session_grace_s
        self.quarantines: dict[int, Quarantine] = {}        # by the ended session's id
        self._ended_session_ids: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.clock = clock
        self.namespaces: dict[int, Namespace] = {}
        self.geometry_to_namespace: dict[KVGeometry, Namespace] = {}
        self.sessions: dict[int, Session] = {}
        self.leases: dict[int, Lease] = {}
        self.metrics = Metrics()
        self._lease_ids = itertools.count(1)
        self._running_at = clock()
        self._l3_index_sink = l3_index_sink if self.l3_plan is not None else None
        self.cost = cost_model if cost_model is not None else CostModel()
        self._background_move_ids: dict[int, int] = {}      # namespace id -> its background promotion

    # ---- sessions -----------------------------------------------------------------------

    def attach(self, geometry: KVGeometry, pid: int, client_name: str = "", *, pid_watched: bool = False,
               pid_namespace_id: int = 0, process_start_time: int = 0,
               previous_session_id: int = 0) -> tuple[Session, Namespace]:
        """A new session. ``pid_watched``: the I/O layer watches this process and reports its exit
        (process_gone). ``previous_session_id``: a session of the same process that it has given
        up, every transfer into its pages drained: it ends, or its quarantine does."""
        namespace = self.geometry_to_namespace.get(geometry)
        if namespace is None:
            namespace = self._create_namespace(geometry)
        namespace.idle_since = None
        now = self.clock()
        session_id = secrets.randbits(62) + 1
        while session_id in self.sessions:
            session_id = secrets.randbits(62) + 1
        session = Session(session_id, namespace.namespace_id, pid, client_name, now, now,
                          pid_watched=pid_watched, pid_namespace_id=pid_namespace_id,
                          process_start_time=process_start_time)
        self.sessions[session_id] = session
        namespace.session_ids.add(session_id)
        self.metrics.add("attaches")
        logger.info("session %x attached: pid %d (%s), %s, namespace %d", session_id, pid,
                    "watched" if pid_watched else "heartbeats only", client_name or "-", namespace.namespace_id)
        if previous_session_id:
            self._end_previous_session(session, previous_session_id)
        return session, namespace

    def _end_previous_session(self, session: Session, previous_session_id: int) -> None:
        identity = (session.pid, session.pid_namespace_id, session.process_start_time)
        previous = self.sessions.get(previous_session_id)
        quarantine = self.quarantines.get(previous_session_id)
        if previous is not None and previous is not session and previous.same_process(*identity):
            self._end_session(previous, reason="replaced by a new session of its process", quarantine=False)
            self.metrics.add("sessions_replaced")
        elif quarantine is not None and quarantine.session.same_process(*identity):
            self._end_quarantine(previous_session_id, "reattach")
        elif previous is not None or quarantine is not None:
            self.metrics.add("previous_session_refused")
            logger.warning("session %x names session %x as its previous one, which belongs to another "
                           "process; ignored", session.session_id, previous_session_id)

    def _create_namespace(self, geometry: KVGeometry, arena_index: int | None = None) -> Namespace:
        num_pages = min(self.arena_plan.arena_bytes // geometry.bytes_per_page, MAX_PAGES_PER_TIER)
        if num_pages < 1:
            raise ProtocolError(ErrorCode.GEOMETRY_MISMATCH,
                                f"one page of this geometry ({geometry.bytes_per_page} bytes) does not fit "
                                f"in an L2 arena of {self.arena_plan.arena_bytes} bytes")
        if arena_index is None and not self._free_arena_indices and not self._reclaim_idle_namespace():
            raise ProtocolError(ErrorCode.OUT_OF_SPACE,
                                f"all {self.arena_plan.max_namespaces} namespaces have attached engines; "
                                "start the daemon with a larger --max-namespaces")
        num_slots = min(self.l3_plan.arena_bytes // geometry.bytes_per_page, MAX_PAGES_PER_TIER) if self.l3_plan else 0
        tiers = (Tier.L2, Tier.L3) if num_slots else (Tier.L2,)
        if arena_index is None:
            index = self._free_arena_indices.pop(0)
        else:                           # a region rebuilt from the L3 index
            index = arena_index
            self._free_arena_indices.remove(arena_index)
        namespace = Namespace(
            namespace_id=next(self._namespace_ids),
            geometry=geometry,
            arena_offset_bytes=self.arena_plan.arena_offset(index),
            num_pages=num_pages,
            tree=PrefixTree(geometry.page_size, tiers=tiers, clock=self.clock),
            l2_allocator=PageAllocator(num_pages),
            l3_region_offset_bytes=self.l3_plan.arena_offset(index) if num_slots else 0,
            l3_allocator=PageAllocator(num_slots) if num_slots else None,
            arena_index=index,
        )
        self.namespaces[namespace.namespace_id] = namespace
        self.geometry_to_namespace[geometry] = namespace
        if num_slots:
            self._index_namespace(namespace)
        logger.info("namespace %d (arena %d): %s, %d L2 pages and %d L3 slots of %d bytes",
                    namespace.namespace_id, index, geometry, num_pages, num_slots, geometry.bytes_per_page)
        return namespace

    def _reclaim_idle_namespace(self) -> bool:
        """Give the arena of the namespace idle longest (no session, no pending move) to a new one;
        its cached pages are dropped. Returns whether one was reclaimed."""
        # A namespace with quarantined pages is not idle: a stale writer may still write its arena.
        busy = {move.namespace_id for move in self.moves.values()}
        busy.update(q.session.namespace_id for q in self.quarantines.values())
        idle = [ns for ns in self.namespaces.values()
                if not ns.session_ids and ns.namespace_id not in busy and ns.idle_since is not None]
        if not idle:
            return False
        victim = min(idle, key=lambda ns: ns.idle_since)
        del self.namespaces[victim.namespace_id]
        del self.geometry_to_namespace[victim.geometry]
        self._free_arena_indices.append(victim.arena_index)
        self.cost.forget_engine(victim.namespace_id)
        if victim.l3_checksums is not None:
            self._l3_index_sink(DropNamespace(victim.index_key))
        self.metrics.add("namespaces_reclaimed")
        logger.info("namespace %d (%s) reclaimed: idle since %.1f s, %d L2 pages dropped", victim.namespace_id,
                    victim.geometry.model_id, self.clock() - victim.idle_since, victim.tree.owned_pages(Tier.L2))
        return True

    def session(self, session_id: int) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self._ended_session_ids:
                raise ProtocolError(ErrorCode.NOT_ATTACHED, f"session {session_id:x} has ended (detached, "
                                    "expired or replaced); attach again")
            raise ProtocolError(ErrorCode.NOT_ATTACHED, f"no session {session_id:x} (never attached, detached or expired)")
        session.last_seen = self.clock()
        return session

    def heartbeat(self, session_id: int) -> None:
        self.session(session_id)

    def engine_report(self, session_id: int, report: dict, cost_samples=()) -> None:
        """An engine's facts for status, and the timings it measured (direction, size, seconds) for
        the cost model of its namespace."""
        session = self.session(session_id)
        session.report = report
        for direction, size, seconds in cost_samples:
            if not self.cost.add_engine_sample(session.namespace_id, direction, size, seconds):
                self.cost.counters["samples_ignored_total"] += 1

    def detach(self, session_id: int) -> int:
        """End a session and reclaim its leases; returns how many leases were reclaimed. The engine
        detaches once its transfers are drained, so the pages are free at once."""
        session = self.session(session_id)
        return self._end_session(session, reason="detached", quarantine=False)

    def process_gone(self, session_id: int) -> bool:
        """The watched process of a session (live or quarantined) has exited: nothing of it can
        write any more, so its pages are free at once. Returns whether the session was known."""
        session = self.sessions.get(session_id)
        if session is not None:
            self._end_session(session, reason="ended: its process exited", quarantine=False)
            self.metrics.add("sessions_ended_process_gone")
            return True
        if session_id in self.quarantines:
            self._end_quarantine(session_id, "process_gone")
            return True
        return False

    def watches(self, session_id: int) -> bool:
        """Whether the exit of this session's process still matters (process_gone): a watched
        session that is live, or whose pages are quarantined."""
        session = self.sessions.get(session_id)
        return (session.pid_watched if session is not None
                else session_id in self.quarantines and self.quarantines[session_id].session.pid_watched)

    def note_running(self, max_gap_s: float) -> float:
        """Called at least every ``max_gap_s`` while the daemon runs (the reaper): a longer gap is
        time the daemon was stopped or starved, in which it could see no heartbeat, so it is
        credited to every session and quarantine (their clocks stop). Returns the seconds credited."""
        now = self.clock()
        credit_s = now - self._running_at - max_gap_s
        self._running_at = now
        if credit_s <= 0:
            return 0.0
        for session in itertools.chain(self.sessions.values(), (q.session for q in self.quarantines.values())):
            session.last_seen = min(now, session.last_seen + credit_s)
        self.metrics.add("daemon_pauses")
        self.metrics.add("daemon_pause_seconds", credit_s)
        logger.warning("the daemon did not run for %.3f s; sessions are credited that time", credit_s)
        return credit_s

    def expire_sessions(self) -> list[int]:
        """End every session silent for too long (session_timeout_s, or session_grace_s when its
        process is watched), quarantining what it could still write; end the quarantines of
        unwatched processes silent for session_grace_s. Returns the ids of the sessions ended."""
        now = self.clock()
        expired = [s for s in self.sessions.values()
                   if now - s.last_seen > (self.session_grace_s if s.pid_watched else self.session_timeout_s)]
        for session in expired:
            if session.pid_watched:
                self._end_session(session, reason=f"silent for {self.session_grace_s} s (its process lives)",
                                  quarantine=True)
                self.metrics.add("sessions_grace_exceeded")
            else:
                self._end_session(session, reason="expired (missed heartbeats)", quarantine=True)
                self.metrics.add("sessions_expired")
        for session_id, quarantine in list(self.quarantines.items()):
            if not quarantine.session.pid_watched and now - quarantine.session.last_seen > self.session_grace_s:
                self._end_quarantine(session_id, "grace")
        return [s.session_id for s in expired]

    def _end_session(self, session: Session, reason: str, quarantine: bool) -> int:
        """quarantine: its process may still write its private pages (they go to a Quarantine)."""
        reclaimed = 0
        quarantined: list[int] = []
        for lease_id in sorted(session.lease_ids):
            self._end_lease(self.leases[lease_id], LeaseState.RECLAIMED, quarantined if quarantine else None)
            reclaimed += 1
        del self.sessions[session.session_id]
        self._ended_session_ids[session.session_id] = None
        while len(self._ended_session_ids) > MAX_ENDED_SESSIONS:
            self._ended_session_ids.popitem(last=False)
        namespace = self.namespaces[session.namespace_id]
        namespace.session_ids.discard(session.session_id)
        if not namespace.session_ids:
            namespace.idle_since = self.clock()
        if quarantined:
            self.quarantines[session.session_id] = Quarantine(session, quarantined, reason)
            self.metrics.add("quarantines")
            self.metrics.add("pages_quarantined", len(quarantined))
        self.metrics.add("leases_reclaimed", reclaimed)
        logger.info("session %x %s; %d leases reclaimed, %d pages quarantined", session.session_id, reason,
                    reclaimed, len(quarantined))
        return reclaimed

    def _end_quarantine(self, session_id: int, cause: str) -> None:
        quarantine = self.quarantines.pop(session_id)
        self.namespaces[quarantine.session.namespace_id].l2_allocator.free(quarantine.page_ids)
        self.metrics.add(f"quarantines_ended_{cause}")
        logger.info("quarantine of session %x ended (%s): %d pages free", session_id, cause.replace("_", " "),
                    len(quarantine.page_ids))

    # ---- match, release, commit ----------------------------------------------------------

    def match(self, session_id: int, token_bytes: bytes, reserve_backup: bool = False,
              promote_l3: bool = False, promoted_tokens: int = 0, local_hit_tokens: int = 0,
              policy: str = "", decision: Decision | None = None) -> MatchReply | TierMove:
        """The hit per tier, a lease on the L2 hit and, with reserve_backup, private L2 pages for
        the pages the daemon lacks.

        With promote_l3 the cost model decides (under ``policy``, for the tokens beyond the engine's
        own ``local_hit_tokens``) whether the pages only L3 holds are worth restoring; if so, returns
        instead the S2H move that must run first (planned from the same tree walk, the decision in
        ``move.decision``); the caller runs it, finishes it, then matches again without promote_l3,
        with that decision. The reply carries the decision."""
        session = self.session(session_id)
        namespace = self.namespaces[session.namespace_id]
        page_size = namespace.geometry.page_size
        token_ids = np.frombuffer(token_bytes, dtype="<i4")
        num_pages = len(token_ids) // page_size
        token_ids = token_ids[: num_pages * page_size]
        local_hit_tokens = min(local_hit_tokens, len(token_ids)) // page_size * page_size

        result = namespace.tree.match(token_ids)
        allowed = self._reservable_pages(session, namespace)
        if promote_l3:
            decision = self.cost.decide(namespace.namespace_id, namespace.geometry.bytes_per_token, local_hit_tokens,
                                        result.hit_tokens[Tier.L2], result.hit_tokens.get(Tier.L3, 0), policy,
                                        where="match")
            if decision.choice == "l3" and allowed > 0:
                start_page = result.hit_tokens[Tier.L2] // page_size
                move = self._plan_move(namespace, result, token_ids, Tier.L3, Tier.L2, start_page,
                                       min(result.hit_tokens[Tier.L3] // page_size, start_page + allowed))
                if move is not None:
                    move.decision = decision
                    return move
        hits = {tier.label: count for tier, count in result.hit_tokens.items()}
        decided = self._decided(decision or NO_DECISION, policy, max(local_hit_tokens, result.hit_tokens[Tier.L2]))
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
        if locked_node is None and not backup_page_ids:
            return MatchReply(hits, None, host_page_ids, hit_tokens, [], promoted_tokens, *decided)

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
                          *decided)

    def _decided(self, decision: Decision, policy: str,
                 loadable_tokens: int | None = None) -> tuple[str, int, dict[str, float], str]:
        """A decision's reply fields. A match's reply names no more tokens to restore than its
        lease can load (``loadable_tokens``): a promotion may have failed, been cut to the
        session's allowance, or found no room."""
        if not decision.choice:
            return "", 0, {}, ""
        restore_tokens = decision.restore_tokens
        if loadable_tokens is not None and decision.choice in ("l2", "l3"):
            restore_tokens = min(restore_tokens, loadable_tokens)
        return decision.choice, restore_tokens, decision.predicted_s, policy or self.cost.policy

    def lookup(self, session_id: int, token_bytes: bytes, tp_group: bool = False, local_hit_tokens: int = 0,
               policy: str = "", promote_l3: bool = True) -> MatchReply:
        """The hit per tier of a prefix, changing nothing: no lease, no lock, no reservation, no
        LRU update, and no page ids (they are only ever handed out under a lease). It carries the
        cost model's decision (under ``policy``) for the tokens beyond the engine's own
        ``local_hit_tokens``; with promote_l3 False, L3 is no candidate.

        With tp_group, the hit of the session's tensor-parallel group: per tier, the least over
        the namespaces of every rank (the same geometry but for tp_rank); 0 while a rank has none.
        A prefix counts as cached only where every rank holds its shard."""
        session = self.session(session_id)
        geometry = self.namespaces[session.namespace_id].geometry
        token_ids = np.frombuffer(token_bytes, dtype="<i4")
        token_ids = token_ids[: len(token_ids) // geometry.page_size * geometry.page_size]
        local_hit_tokens = min(local_hit_tokens, len(token_ids)) // geometry.page_size * geometry.page_size
        if tp_group:
            namespaces = [self.geometry_to_namespace.get(dataclasses.replace(geometry, tp_rank=rank))
                          for rank in range(geometry.tp_size)]
        else:
            namespaces = [self.namespaces[session.namespace_id]]
        hits: dict[str, int] | None = None
        for namespace in namespaces:
            if namespace is None:
                tiers = self.namespaces[session.namespace_id].tree.tiers
                rank_hits = {tier.label: 0 for tier in tiers}
            else:
                rank_hits = {tier.label: count
                             for tier, count in namespace.tree.match(token_ids, touch=False).hit_tokens.items()}
            hits = rank_hits if hits is None else {label: min(hits[label], rank_hits.get(label, 0))
                                                   for label in hits}
        assert hits is not None
        self.metrics.add("lookups")
        self.metrics.add("lookup_tokens", len(token_ids))
        self.metrics.add("lookup_hit_tokens_l2", hits["l2"])
        decision = self.cost.decide(session.namespace_id, geometry.bytes_per_token, local_hit_tokens, hits["l2"],
                                    hits.get("l3", 0) if promote_l3 else 0, policy, where="lookup")
        return MatchReply(hits, None, [], hits["l2"], [], 0,
                          *self._decided(decision, policy))

    def promote_in_background(self, session_id: int, token_bytes: bytes, looked_up: MatchReply) -> TierMove | None:
        """After a lookup (of this session, for these tokens) whose decision declined an L3 hit: the
        S2H move of the pages only L3 holds, when the cost model says a later request would restore
        them from L2 rather than recompute them; None otherwise, or while this namespace has a
        background promotion pending already (one at a time). No request waits for it: its read
        is a storage-read sample, the one way the model learns a disk it keeps declining."""
        l3_tokens = looked_up.hit_tokens.get("l3", 0)
        if looked_up.policy != "cost" or looked_up.choice not in ("recompute", "l2") \
                or l3_tokens <= max(looked_up.hit_tokens["l2"], looked_up.restore_tokens):
            return None
        session = self.session(session_id)
        namespace = self.namespaces[session.namespace_id]
        if not self.cost.later_restore_wins(namespace.namespace_id, namespace.geometry.bytes_per_token, l3_tokens):
            self.cost.counters["background_promotion_skips_no_gain_total"] += 1
            return None
        if namespace.namespace_id in self._background_move_ids:
            self.cost.counters["background_promotion_skips_busy_total"] += 1
            return None
        page_size = namespace.geometry.page_size
        token_ids = np.frombuffer(token_bytes, dtype="<i4")
        token_ids = token_ids[: len(token_ids) // page_size * page_size]
        result = namespace.tree.match(token_ids, touch=False)
        l2_pages, l3_pages = result.hit_tokens[Tier.L2] // page_size, result.hit_tokens.get(Tier.L3, 0) // page_size
        allowed = self._reservable_pages(session, namespace)
        if l3_pages <= l2_pages or allowed <= 0:
            return None
        move = self._plan_move(namespace, result, token_ids, Tier.L3, Tier.L2, l2_pages,
                               min(l3_pages, l2_pages + allowed))
        if move is not None:
            self._background_move_ids[namespace.namespace_id] = move.op_id
            self.cost.counters["background_promotions_total"] += 1
        return move

    def _reservable_pages(self, session: Session, namespace: Namespace) -> int:
        """How many more L2 pages this session may reserve: MAX_SESSION_RESERVED_SHARE of the
        namespace's pages, less the private pages of all its leases. One cap for every path that
        reserves L2 pages for a session (a match's backup pages or its L3 promotion)."""
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
                if tier is Tier.L3:
                    self._unindex_slots(namespace, evicted)
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

    def _count_commit_of_ended(self, session_id: int) -> None:
        """A commit from a session that has ended is refused (session() raises): the engine may have
        written its pages after they were reclaimed. Counted apart from unknown sessions."""
        if session_id not in self.sessions and session_id in self._ended_session_ids:
            self.metrics.add("commits_refused_session_ended")

    def release(self, session_id: int, lease_id: int) -> None:
        _, lease = self._lease_of(session_id, lease_id)
        self._end_lease(lease, LeaseState.RELEASED)
        self.metrics.add("leases_released")

    def commit_backup(self, session_id: int, lease_id: int,
                      host_page_ids: list[int]) -> tuple[CommitReply, TierMove | None]:
        """Publish the backed-up pages (a prefix of the lease's reservation) and end the lease.

        Also returns the write-through of the committed path to L3, when there is one to run."""
        self._count_commit_of_ended(session_id)
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
        path_tokens = lease.token_ids[:num_tokens]
        self._end_lease(lease, LeaseState.COMMITTED)
        self.metrics.add("backup_commits")
        self.metrics.add("backup_pages_committed", new_pages)
        self.metrics.add("backup_pages_duplicate", duplicates)
        write_through = self.plan_write_through(namespace, path_tokens) if host_page_ids else None
        return CommitReply(new_pages, duplicates), write_through

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
            self._count_skip(f"{'h2s' if destination is Tier.L3 else 's2h'}_no_space",
                             f"no free {destination.label} page for a {'write-through' if destination is Tier.L3 else 'promotion'}")
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

    def _count_skip(self, counter: str, message: str) -> None:
        """A copy to another tier not made: counted (status shows it), logged the first time."""
        if not self.metrics.counters[counter]:
            logger.warning("%s (counted as %s; each further one is counted, not logged)", message, counter)
        self.metrics.add(counter)

    def pending_moves(self, direction: str) -> int:
        return sum(move.direction == direction for move in self.moves.values())

    def finish_move(self, move: TierMove, ok: bool, skipped: bool = False) -> int:
        """Publish a completed move's pages in the tree, or return them on failure.

        With a persistent L3 index, a promotion publishes only its leading pages whose bytes
        read match the checksums recorded when they were written; the first page that does not
        is dropped from L3 (with what lies below it) and counted, and the rest of the prefix is
        left to recompute. Returns the number of pages the destination tier gained. Once
        published, the pages belong to the tree: nothing that happens to a session later frees them."""
        namespace = self.namespaces[move.namespace_id]
        allocator = namespace.allocator(move.destination)
        gained = 0
        num_valid = self._num_verified_pages(namespace, move) if ok else 0
        if num_valid:
            move.transition(OpState.PUBLISHED)
            published = move.private_page_ids[:num_valid]
            if num_valid < len(move.private_page_ids):
                allocator.free(move.private_page_ids[num_valid:])
            inserted = namespace.tree.insert(move.token_ids, move.destination, published,
                                             start_page=move.start_page)
            if inserted.duplicate_page_ids:      # someone published the same pages meanwhile
                allocator.free(inserted.duplicate_page_ids)
            if move.destination is Tier.L3:
                self._index_written(namespace, move, set(inserted.duplicate_page_ids))
            gained = inserted.new_pages
            move.num_published_pages = num_valid
            self.metrics.add(f"{move.direction}_pages_published", gained)
        else:
            move.transition(OpState.FAILED)
            allocator.free(move.private_page_ids)
            if skipped:     # never started (policy), not an I/O failure
                self._count_skip(f"{move.direction}_policy_skips", f"a {move.direction} move was skipped (backlog)")
            elif not ok:
                self.metrics.add(f"{move.direction}_failures")
        move.private_page_ids = []
        for node, tier in move.locks:
            namespace.tree.unlock(node, tier)
        move.locks = []
        del self.moves[move.op_id]
        if self._background_move_ids.get(move.namespace_id) == move.op_id:
            del self._background_move_ids[move.namespace_id]
            self.cost.counters["background_promoted_pages_total"] += gained
        if ok and num_valid < len(move.source_page_ids):
            self._drop_corrupt_l3_page(namespace, move, move.start_page + num_valid)
        return gained

    # ---- the persistent L3 index (see l3_index.py) -------------------------------------------

    def _index_namespace(self, namespace: Namespace) -> None:
        if self._l3_index_sink is None:
            return
        assert namespace.l3_allocator is not None
        namespace.index_key = namespace_key(namespace.geometry)
        namespace.l3_checksums = np.zeros(namespace.l3_allocator.num_pages, dtype=np.uint32)
        self._l3_index_sink(PutNamespace(NamespaceLayout(
            namespace.index_key, namespace.geometry, namespace.arena_index, namespace.l3_region_offset_bytes,
            namespace.l3_allocator.num_pages, namespace.geometry.bytes_per_page)))

    def _unindex_slots(self, namespace: Namespace, slot_ids: list[int]) -> None:
        if namespace.l3_checksums is not None:
            self._l3_index_sink(DeleteSlots(namespace.index_key, list(slot_ids)))

    def _index_written(self, namespace: Namespace, move: TierMove, duplicate_slot_ids: set[int]) -> None:
        """Rows for the slots a write-through just gave the tree (not for duplicates: freed)."""
        if namespace.l3_checksums is None:
            return
        assert len(move.page_checksums) == len(move.source_page_ids), "h2s finished without its checksums"
        assert len(move.page_keys) >= move.start_page + len(move.source_page_ids), "h2s finished without its keys"
        page_size = namespace.geometry.page_size
        rows = []
        for i, slot in enumerate(move.private_page_ids[:len(move.source_page_ids)]):
            if slot in duplicate_slot_ids:
                continue
            page = move.start_page + i
            rows.append(SlotRow(slot, move.page_keys[page], move.page_keys[page - 1] if page else ROOT_KEY,
                                move.token_ids[page * page_size:(page + 1) * page_size].tobytes(),
                                move.page_checksums[i]))
            namespace.l3_checksums[slot] = move.page_checksums[i]
        if rows:
            self._l3_index_sink(PutSlots(namespace.index_key, rows))

    def _num_verified_pages(self, namespace: Namespace, move: TierMove) -> int:
        """Of a finished move, the leading pages that may be published: for a promotion with a
        persistent index, those whose bytes read match their recorded checksums."""
        if move.destination is not Tier.L2 or namespace.l3_checksums is None:
            return len(move.private_page_ids)
        assert len(move.page_checksums) == len(move.source_page_ids), "s2h finished without its checksums"
        expected = namespace.l3_checksums[move.source_page_ids].tolist()
        for i, (read, written) in enumerate(zip(move.page_checksums, expected)):
            if read != written:
                return i
        return len(move.private_page_ids)

    def _drop_corrupt_l3_page(self, namespace: Namespace, move: TierMove, page: int) -> None:
        """A slot did not hold what its checksum says: drop that page (and what lies below it)
        from L3 and the index. While another move still locks it, it stays until read again."""
        slot = move.source_page_ids[page - move.start_page]
        self.metrics.add("l3_checksum_mismatches")
        freed = namespace.tree.discard(move.token_ids, Tier.L3, page)
        if freed:
            namespace.l3_allocator.free(freed)
            self._unindex_slots(namespace, freed)
            self.metrics.add("l3_pages_dropped_corrupt", len(freed))
        logger.warning("namespace %d: L3 slot %d does not hold the page its index names (checksum mismatch); "
                       "not served, %d slots dropped", namespace.namespace_id, slot, len(freed))

    def restore_l3(self, saved: list[SavedNamespace], l3_bytes_kept: int) -> int:
        """At start, before any engine attached: give each namespace of a persistent index its L3
        region back and rebuild its L3 residency from its rows. What no longer fits (another
        layout, file size or number of namespaces) or cannot be trusted is dropped from the
        index, and logged. ``l3_bytes_kept``: how much of the file kept its content. Returns the
        number of L3 pages restored."""
        assert not self.namespaces, "restore_l3 runs before the first attach"
        restored = 0
        arena_indices: set[int] = set()
        for entry in sorted(saved, key=lambda e: e.layout.arena_index):
            layout = entry.layout
            reason = self._l3_region_unusable(layout, arena_indices, l3_bytes_kept)
            if reason is not None:
                logger.warning("L3 index: %d pages of %s dropped: %s", len(entry.rows), layout.geometry.model_id,
                               reason)
                self.metrics.add("l3_index_rows_dropped", len(entry.rows))
                if self._l3_index_sink is not None:
                    self._l3_index_sink(DropNamespace(layout.namespace_key))
                continue
            arena_indices.add(layout.arena_index)
            namespace = self._create_namespace(layout.geometry, arena_index=layout.arena_index)
            namespace.idle_since = self.clock()
            bytes_per_page = namespace.geometry.bytes_per_page
            usable_slots = min(namespace.l3_allocator.num_pages,
                               max(0, l3_bytes_kept - namespace.l3_region_offset_bytes) // bytes_per_page)
            plan = plan_rebuild(entry.rows, namespace.geometry.page_size, usable_slots)
            namespace.l3_allocator.take([slot for run in plan.runs for slot in run.slot_ids])
            for run in plan.runs:
                inserted = namespace.tree.insert(run.token_ids, Tier.L3, run.slot_ids, start_page=run.start_page)
                assert inserted.new_pages == len(run.slot_ids), "a rebuilt page was already in the tree"
                if namespace.l3_checksums is not None:
                    namespace.l3_checksums[run.slot_ids] = run.checksums
                restored += len(run.slot_ids)
            if plan.dropped_slot_ids:
                self._unindex_slots(namespace, plan.dropped_slot_ids)
                self.metrics.add("l3_index_rows_dropped", len(plan.dropped_slot_ids))
            num_pages = sum(len(run.slot_ids) for run in plan.runs)
            self.metrics.add("l3_pages_restored", num_pages)
            logger.info("L3 index: namespace %d (%s) back with %d pages; dropped %d rows past the region's end "
                        "(the file or region shrank), %d torn, %d whose parent page is gone",
                        namespace.namespace_id, layout.geometry.model_id, num_pages, plan.num_beyond,
                        plan.num_torn, plan.num_orphans)
        return restored

    def _l3_region_unusable(self, layout: NamespaceLayout, taken_arena_indices: set[int],
                            l3_bytes_kept: int) -> str | None:
        """Why a saved namespace's region cannot be used as it is now, or None."""
        if self.l3_plan is None:
            return "this daemon has no L3 room"
        if layout.arena_index >= self.arena_plan.max_namespaces:
            return (f"its region {layout.arena_index} is past the {self.arena_plan.max_namespaces} namespaces "
                    "served now (--max-namespaces)")
        if layout.arena_index in taken_arena_indices or layout.geometry in self.geometry_to_namespace:
            return "another namespace of the index claims the same region or geometry"
        if layout.bytes_per_page != layout.geometry.bytes_per_page:
            return f"its pages of {layout.bytes_per_page} bytes do not match its geometry's"
        if layout.region_offset_bytes != self.l3_plan.arena_offset(layout.arena_index):
            return (f"its region moved from byte {layout.region_offset_bytes} to "
                    f"{self.l3_plan.arena_offset(layout.arena_index)} (the L3 size or --max-namespaces changed)")
        if min(self.l3_plan.arena_bytes // layout.bytes_per_page, MAX_PAGES_PER_TIER) < 1:
            return "one of its pages no longer fits in an L3 region"
        if self.arena_plan.arena_bytes < layout.bytes_per_page:
            return "one of its pages no longer fits in an L2 arena"
        if l3_bytes_kept < layout.region_offset_bytes + layout.bytes_per_page:
            return f"the L3 file kept only {l3_bytes_kept} bytes, none of its region"
        return None

    def _end_lease(self, lease: Lease, new_state: LeaseState, quarantined: list[int] | None = None) -> None:
        """quarantined: a list that takes the lease's private pages instead of the allocator."""
        lease.transition(new_state)
        namespace = self.namespaces[lease.namespace_id]
        if lease.locked_node is not None:
            namespace.tree.unlock(lease.locked_node, Tier.L2)
        if quarantined is not None:
            quarantined.extend(lease.private_page_ids)
        elif lease.private_page_ids:
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
        quarantined_list = [p for q in self.quarantines.values() if q.session.namespace_id == namespace.namespace_id
                            for p in q.page_ids]

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
            total = len(owned) + len(free) + len(private) + len(quarantined)
            if total != allocator.num_pages:
                raise IntegrityError(f"{where}: owned {len(owned)} + free {len(free)} + private {len(private)} "
                                     f"+ quarantined {len(quarantined)} != capacity {allocator.num_pages}")
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
        quarantined = sum(len(q.page_ids) for q in self.quarantines.values()
                          if q.session.namespace_id == namespace.namespace_id) if tier is Tier.L2 else 0
        allocator = namespace.allocator(tier)
        return {
            "capacity_pages": allocator.num_pages,
            "free_pages": allocator.num_free,
            "owned_pages": namespace.tree.owned_pages(tier),
            "protected_pages": namespace.tree.protected_pages(tier),
            "evictable_pages": namespace.tree.evictable_pages(tier),
            "private_pages": private,
            "quarantined_pages": quarantined,
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
                 "age_s": round(self.clock() - s.attached_at, 3), "idle_s": round(self.clock() - s.last_seen, 3),
                 "pid_watched": s.pid_watched, "report": s.report}
                for s in self.sessions.values()
            ],
            "quarantines": [
                {"session": session_tag(session_id), "pid": q.session.pid, "client_name": q.session.client_name,
                 "namespace_id": q.session.namespace_id, "pages": len(q.page_ids), "reason": q.reason,
                 "pid_watched": q.session.pid_watched, "idle_s": round(self.clock() - q.session.last_seen, 3)}
                for session_id, q in self.quarantines.items()
            ],
            "leases": len(self.leases),
            "pending": {"h2s": self.pending_moves("h2s"), "s2h": self.pending_moves("s2h")},
            "namespaces": namespaces,
            "cost_model": self.cost.status({ns.namespace_id: ns.geometry.model_id for ns in self.namespaces.values()}),
            "metrics": self.metrics.snapshot(),
        }
