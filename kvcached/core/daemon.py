"""The daemon's whole state, with no I/O: one facade over small owners.

The server loop decodes a request, calls one method here and sends back what it returns, or
the ``ProtocolError`` it raises. Nothing here blocks or touches a socket, so every rule below
is tested in-process. The owners: the namespaces (``namespaces.py``), the pool of chunks
(``pool.py``), L3 persistence (``l3_persistence.py``); integrity (``integrity.py``) and the status
snapshot (``snapshot.py``) read them all.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import secrets
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from kvcached.core import counters, integrity, snapshot
from kvcached.core.allocator import PageAllocator
from kvcached.core.chunks import ChunkMap
from kvcached.core.cost_model import NO_DECISION, CostModel, Decision
from kvcached.core.generations import GenerationFiles, PageGenerations, PrivateGenerations
from kvcached.core.hints import AdmissionHints
from kvcached.core.kv_events import REMOTE_WHERE, TIER_WHERE, EventBuffer, EventKind, TierEvent
from kvcached.core.l3_index import IndexChange, SavedNamespace, namespace_key
from kvcached.core.l3_persistence import L3Persistence
from kvcached.core.leases import Lease, LeaseState, Quarantine, Session
from kvcached.core.metrics import Metrics
from kvcached.core.namespaces import Namespace
from kvcached.core.pool import Pool
from kvcached.core.residency import PeerExport, PeerRegistry
from kvcached.core.tier_ops import OpState, TierMove
from kvcached.core.tiers import Tier
from kvcached.core.tree import PrefixTree, TreeNode
from proto.errors import ErrorCode, ProtocolError
from proto.counters import Counter
from proto.hints import NEVER
from proto.messages import KVGeometry
from proto.replies import CommitReply, MatchReply
from proto.schema import PeerPublish, PeerRegister

logger = logging.getLogger(__name__)

# Pages (or slots) per namespace and tier, at most: a geometry with tiny pages would otherwise
# make allocators, the tree and the integrity check hold tens of millions of ids.
MAX_PAGES_PER_TIER = 1 << 20
# Of the L2 pool (counted in its namespace's pages), at most this share is reserved by one session
# at a time, over all its leases (the backup pages of its matches); a match's L3 promotion
# reserves no more than that allowance either. Every reservation may evict cached prefixes, and a
# session keeps what it holds while it lives. The default; ``session_share`` sets another.
MAX_SESSION_RESERVED_SHARE = 0.5
# Ids of ended sessions remembered, so that a late commit from one is told (and counted) apart
# from a request naming a session that never existed.
MAX_ENDED_SESSIONS = 4096


class RemoteAsk(NamedTuple):
    """What the I/O layer asks the remote store before a lookup or match: which of pages
    [start_page, end_page) of this path it holds (their keys chain from page 0)."""
    namespace_id: int
    namespace_key: str
    page_size: int
    token_ids: np.ndarray               # the path, whole pages (a copy)
    start_page: int
    end_page: int


class PrefixHits(NamedTuple):
    """A namespace's cached prefix of a path (``DaemonState.peek``): tokens per tier label, and
    what to ask the remote store (None: nothing, or no remote tier)."""
    namespace_id: int
    geometry: KVGeometry
    hit_tokens: dict[str, int]
    remote_ask: RemoteAsk | None


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


class DaemonState:
    def __init__(self, l2_bytes: int, *, max_namespaces: int, session_timeout_s: float,
                 session_grace_s: float = 30.0, l3_bytes: int = 0, clock: Callable[[], float] = time.monotonic,
                 l3_index_sink: Callable[[IndexChange], None] | None = None,
                 peer_end_sink: Callable[[PeerExport], None] | None = None, cost_model: CostModel | None = None,
                 session_share: float = MAX_SESSION_RESERVED_SHARE, hints: AdmissionHints | None = None,
                 generation_files: GenerationFiles | None = None,
                 remote_write_sink: Callable[[RemoteWrite], None] | None = None,
                 kv_events: EventBuffer | None = None):
        """``l2_bytes``, ``l3_bytes``: the L2 segment and the L3 file (0: no L3), each shared by
        every namespace in chunks. ``max_namespaces``: distinct geometries served at once.
        ``session_timeout_s``: how long a session whose process the daemon cannot watch lives
        without a sign of life. ``session_grace_s``: how long a watched (living) process's session
        lives without one, and how long the pages of an unwatched one stay quarantined after its
        last sign of life. ``l3_index_sink``: where every change of L3 residency is reported, in
        order, for a persistent L3 file (the I/O layer writes them to its index); None: L3 is
        temporary. ``peer_end_sink``: called with each peer registration that ends (its session
        ended), so that the I/O layer closes its epoch file. ``cost_model``: decides which restores are
        taken (default: policy cost, the default priors). ``session_share``: the most of L2 one
        session reserves at a time (MAX_SESSION_RESERVED_SHARE). ``hints``: where the admission
        hints are published (``proto.hints``; the I/O layer maps them from a file engines read),
        one slot per namespace. ``generation_files``: where each namespace's L2 page generations
        live (``proto.generations``; the I/O layer makes a file engines map), default private.
        ``remote_write_sink``: with a remote tier, where each committed path's write-through to
        the store goes (the I/O layer sends it, then calls ``finish_remote_write``); None: no remote tier.
        ``kv_events``: where the KV events of tier changes are recorded (``kv_events.py``; the I/O
        layer publishes them); None: none are."""
        if not max_namespaces >= 1:
            raise ValueError(f"max_namespaces must be at least 1, got {max_namespaces}")
        if not 0 < session_share <= 1:
            raise ValueError(f"session_share must be in (0, 1], got {session_share}")
        self.session_share = session_share
        self.max_namespaces = max_namespaces
        self.moves: dict[int, TierMove] = {}
        self._move_ids = itertools.count(1)
        self._namespace_ids = itertools.count()
        if session_grace_s < session_timeout_s:
            raise ValueError(f"session_grace_s ({session_grace_s}) must be at least session_timeout_s "
                             f"({session_timeout_s})")
        self.session_timeout_s = session_timeout_s
        self.session_grace_s = session_grace_s
        self.quarantines: dict[int, Quarantine] = {}        # by the ended session's id
        self._ended_session_ids: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.clock = clock
        self.namespaces: dict[int, Namespace] = {}
        self.metrics = Metrics()
        self.pool = Pool(l2_bytes, l3_bytes, self.namespaces, self.metrics, clock, self._held_page_ids,
                         lambda namespace, slot_ids: self.l3.unindex_slots(namespace, slot_ids))
        self.l3 = L3Persistence(l3_index_sink if l3_bytes > 0 else None, self.metrics, clock)
        self.geometry_to_namespace: dict[KVGeometry, Namespace] = {}
        self.sessions: dict[int, Session] = {}
        self.leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._generation_ids = itertools.count(1)       # write generations: never 0, never reused
        self._generation_files = generation_files if generation_files is not None else PrivateGenerations()
        self._running_at = clock()
        self.peers = PeerRegistry()
        self._peer_end_sink = peer_end_sink
        self.cost = cost_model if cost_model is not None else CostModel()
        self._background_move_ids: dict[int, int] = {}      # namespace id -> its background promotion
        self.hints = hints if hints is not None else AdmissionHints(max_namespaces)
        if self.hints.num_slots < max_namespaces:
            raise ValueError(f"the admission hints have {self.hints.num_slots} slots for {max_namespaces} namespaces")
        self.hints.set_policy(self.cost.policy)
        self._remote_write_sink = remote_write_sink
        self.remote_writes: dict[int, RemoteWrite] = {}
        self._remote_write_ids = itertools.count(1)
        self._remote_namespace_keys: dict[int, str] = {}
        self.kv_events = kv_events

    @property
    def chunks(self) -> dict[Tier, ChunkMap]:
        return self.pool.chunks

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
            for tier in namespace.tree.tiers:
                self.pool.assign_free_chunks(namespace, tier)
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
        self.metrics.add(counters.ATTACHES)
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
            self.metrics.add(counters.SESSIONS_ENDED, 1, "replaced")
        elif quarantine is not None and quarantine.session.same_process(*identity):
            self._end_quarantine(previous_session_id, "reattach")
        elif previous is not None or quarantine is not None:
            self.metrics.add(counters.PREVIOUS_SESSION_REFUSED)
            logger.warning("session %x names session %x as its previous one, which belongs to another "
                           "process; ignored", session.session_id, previous_session_id)

    def _create_namespace(self, geometry: KVGeometry) -> Namespace:
        """A namespace that owns no chunk yet (attach gives it the free ones; it gains more as it
        reserves pages: Pool.reserve)."""
        bytes_per_page = geometry.bytes_per_page
        if not self.namespaces:
            self.pool.fit_first_page(bytes_per_page)
        l2_chunks = self.chunks[Tier.L2]
        if bytes_per_page > l2_chunks.chunk_bytes:
            raise ProtocolError(ErrorCode.GEOMETRY_MISMATCH,
                                f"one page of this geometry ({bytes_per_page} bytes) is larger than a chunk of the "
                                f"L2 pool ({l2_chunks.chunk_bytes} bytes); start the daemon with a larger --l2-size")
        if len(self.namespaces) >= self.max_namespaces and not self._reclaim_idle_namespace():
            raise ProtocolError(ErrorCode.OUT_OF_SPACE,
                                f"all {self.max_namespaces} namespaces have attached engines; "
                                "start the daemon with a larger --max-namespaces")
        num_pages = min(l2_chunks.space_bytes // bytes_per_page, MAX_PAGES_PER_TIER)
        l3_chunks = self.chunks.get(Tier.L3)
        num_slots = (min(l3_chunks.space_bytes // bytes_per_page, MAX_PAGES_PER_TIER)
                     if l3_chunks is not None and bytes_per_page <= l3_chunks.chunk_bytes else 0)
        tiers = (Tier.L2, Tier.L3) if num_slots else (Tier.L2,)
        namespace_id = next(self._namespace_ids)
        hints_slot = self.hints.assign(namespace_id)
        generations_path, generation_words = self._generation_files.create(namespace_id, num_pages)
        namespace = Namespace(
            namespace_id=namespace_id,
            geometry=geometry,
            num_pages=num_pages,
            tree=PrefixTree(geometry.page_size, tiers=tiers, clock=self.clock,
                            on_l2_root=functools.partial(self.hints.l2_root, hints_slot),
                            on_residency=functools.partial(self._residency_event, geometry)
                            if self._publishes_events(geometry) else None),
            l2_allocator=PageAllocator(num_pages, all_free=False),
            l3_allocator=PageAllocator(num_slots, all_free=False) if num_slots else None,
            hints_slot=hints_slot,
            generations=PageGenerations(generations_path, generation_words),
        )
        self.publish_cost_hints(namespace)
        if self._publishes_events(geometry) and not any(
                self._publishes_events(other) and other.model_id == geometry.model_id
                for other in self.geometry_to_namespace):
            # This model's first namespace in this run: what an earlier run published of it is gone.
            self.kv_events.record(TierEvent(EventKind.CLEARED, geometry.model_id, geometry.page_size, None, b"", 0))
        self.namespaces[namespace.namespace_id] = namespace
        self.geometry_to_namespace[geometry] = namespace
        if num_slots:
            self.l3.index_namespace(namespace)
        logger.info("namespace %d: %s, pages of %d bytes: up to %d in L2 and %d in L3 (the whole pool, shared with "
                    "the other namespaces)", namespace.namespace_id, geometry, bytes_per_page, num_pages, num_slots)
        return namespace

    def _reclaim_idle_namespace(self) -> bool:
        """Drop the namespace idle longest (no session, no pending move, no quarantine), so that a
        new geometry can be served; its chunks go back to the pool and its cached pages are lost.
        Returns whether one was reclaimed."""
        # A namespace with quarantined pages is not idle: a stale writer may still write them.
        busy = {move.namespace_id for move in self.moves.values()}
        busy.update(write.namespace_id for write in self.remote_writes.values())
        busy.update(q.session.namespace_id for q in self.quarantines.values())
        idle = [ns for ns in self.namespaces.values()
                if not ns.session_ids and ns.namespace_id not in busy and ns.idle_since is not None]
        if not idle:
            return False
        victim = min(idle, key=lambda ns: ns.idle_since)
        if self._publishes_events(victim.geometry):
            for node, tier in victim.tree.resident_nodes():
                self._residency_event(victim.geometry, node, tier, -1)
        del self.namespaces[victim.namespace_id]
        del self.geometry_to_namespace[victim.geometry]
        self.hints.release(victim.hints_slot)
        victim.generations.close_all()
        self._generation_files.close(victim.namespace_id)
        self.cost.forget_engine(victim.namespace_id)
        self.pool.forget(victim)
        self.l3.drop_namespace(victim)
        self.metrics.add(counters.NAMESPACES_RECLAIMED)
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
                self.cost.counters.add(counters.SAMPLES_IGNORED)
        if cost_samples:
            self.publish_cost_hints(self.namespaces[session.namespace_id])

    def publish_cost_hints(self, namespace: Namespace | None = None) -> None:
        """Publish the least L3 restore that could win (``proto.hints``) for a namespace whose
        model changed (None: every namespace, after a storage sample)."""
        for ns in self.namespaces.values() if namespace is None else (namespace,):
            if self.remote_enabled:     # the store may hold any prefix: no request is predicted a miss
                self.hints.set_l3_min_tokens(ns.hints_slot, 0)
                continue
            least = None if ns.l3_allocator is None else \
                self.cost.l3_min_tokens(ns.namespace_id, ns.geometry.bytes_per_token)
            self.hints.set_l3_min_tokens(ns.hints_slot, NEVER if least is None else least)

    def _decide(self, namespace: Namespace, *args, **kwargs) -> Decision:
        """``CostModel.decide`` for this namespace; where it dropped a stale line's samples, the hints
        are published again (a storage line is every namespace's)."""
        resets = self.cost.counters.value(counters.STALE_LINE_RESETS)
        decision = self.cost.decide(namespace.namespace_id, namespace.geometry.bytes_per_token, *args, **kwargs)
        if self.cost.counters.value(counters.STALE_LINE_RESETS) != resets:
            self.publish_cost_hints()
        return decision

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
            self.metrics.add(counters.SESSIONS_ENDED, 1, "ended_process_gone")
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
        self.metrics.add(counters.DAEMON_PAUSES)
        self.metrics.add(counters.DAEMON_PAUSED_SECONDS, credit_s)
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
                self.metrics.add(counters.SESSIONS_ENDED, 1, "grace_exceeded")
            else:
                self._end_session(session, reason="expired (missed heartbeats)", quarantine=True)
                self.metrics.add(counters.SESSIONS_ENDED, 1, "expired")
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
        self._end_peer_export(session.session_id)
        self._ended_session_ids[session.session_id] = None
        while len(self._ended_session_ids) > MAX_ENDED_SESSIONS:
            self._ended_session_ids.popitem(last=False)
        namespace = self.namespaces[session.namespace_id]
        namespace.session_ids.discard(session.session_id)
        if not namespace.session_ids:
            namespace.idle_since = self.clock()
        if quarantined:
            self.quarantines[session.session_id] = Quarantine(session, quarantined, reason)
            self.metrics.add(counters.QUARANTINES)
            self.metrics.add(counters.QUARANTINED_PAGES, len(quarantined))
        self.metrics.add(counters.LEASES_ENDED, reclaimed, "reclaimed")
        logger.info("session %x %s; %d leases reclaimed, %d pages quarantined", session.session_id, reason,
                    reclaimed, len(quarantined))
        return reclaimed

    def _end_quarantine(self, session_id: int, cause: str) -> None:
        quarantine = self.quarantines.pop(session_id)
        self.namespaces[quarantine.session.namespace_id].l2_allocator.free(quarantine.page_ids)
        self.metrics.add(counters.QUARANTINES_ENDED, 1, cause)
        logger.info("quarantine of session %x ended (%s): %d pages free", session_id, cause.replace("_", " "),
                    len(quarantine.page_ids))

    # ---- match, release, commit ----------------------------------------------------------

    def match(self, session_id: int, token_bytes: bytes, reserve_backup: bool = False,
              promote_l3: bool = False, promoted_tokens: int = 0, local_hit_tokens: int = 0,
              policy: str = "", decision: Decision | None = None, recompute: bool = False,
              remote_tokens: int = 0) -> MatchReply | TierMove:
        """The hit per tier, a lease on the L2 hit and, with reserve_backup, private L2 pages for
        the pages the daemon lacks.

        With promote_l3 the cost model decides (under ``policy``, for the tokens beyond the engine's
        own ``local_hit_tokens``) whether the pages only L3 holds are worth restoring; if so, returns
        instead the S2H move that must run first (planned from the same tree walk, the decision in
        ``move.decision``); the caller runs it, finishes it, then matches again without promote_l3,
        with that decision. The reply carries the decision.

        With recompute, the engine admitted the request on a predicted decline (``proto.hints``)
        and recomputes what lies beyond its own hit whatever the reply says: nothing is promoted;
        the decision the model would have taken is counted under "predicted" and replied.

        ``remote_tokens``: the leading tokens L2 and the remote store hold together (what the
        store answered to ``remote_ask``), a candidate with promote_l3; where the model takes it,
        returns the R2H move that gets the store's pages into L2 first, as for L3."""
        session = self.session(session_id)
        namespace = self.namespaces[session.namespace_id]
        page_size = namespace.geometry.page_size
        token_ids = np.frombuffer(token_bytes, dtype="<i4")
        num_pages = len(token_ids) // page_size
        token_ids = token_ids[: num_pages * page_size]
        local_hit_tokens = min(local_hit_tokens, len(token_ids)) // page_size * page_size

        result = namespace.tree.match(token_ids, own_pages=local_hit_tokens // page_size)
        allowed = self._reservable_pages(session, namespace)
        peer_id, peer_block_ids, peer_epochs = self._peer_candidate(session, namespace, token_ids)
        if decision is None and (promote_l3 or peer_block_ids or recompute):
            decision = self._decide(namespace, local_hit_tokens, result.hit_tokens[Tier.L2],
                                    result.hit_tokens.get(Tier.L3, 0) if promote_l3 or recompute else 0, policy,
                                    where="predicted" if recompute else "match",
                                    peer_tokens=len(peer_block_ids) * page_size,
                                    remote_tokens=remote_tokens if promote_l3 or recompute else 0)
            if decision.choice == "remote" and allowed > 0 and not recompute:
                move = self._plan_remote_move(namespace, result, token_ids, remote_tokens // page_size, allowed)
                if move is not None:
                    move.decision = decision
                    return move
            if decision.choice == "l3" and allowed > 0 and not recompute:
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
        model = namespace.geometry.model_id
        self.metrics.add(counters.MATCHES, model=model)
        self.metrics.add(counters.MATCH_TOKENS, num_pages * page_size, model=model)
        self.metrics.add(counters.HIT_TOKENS, hit_tokens, "l2", model=model)
        if Tier.L3 in result.hit_tokens:
            self.metrics.add(counters.HIT_TOKENS, result.hit_tokens[Tier.L3], "l3", model=model)

        # Lock the hit before reserving: the reservation may evict, and must not evict our own hit.
        if locked_node is not None:
            namespace.tree.lock(locked_node, Tier.L2)
        backup_page_ids: list[int] = []
        backup_generation = 0
        backup_skipped = ""
        if reserve_backup and num_pages > hit_pages and (promote_l3 or recompute) and allowed > 0 and \
                self._backup_evicted_before_reuse(namespace, result, decision, policy,
                                                  min(num_pages - hit_pages, allowed)):
            backup_skipped = "evicted_before_reuse"
            self.metrics.add(counters.EVICTED_BEFORE_REUSE_SKIPS)
        elif reserve_backup and num_pages > hit_pages:
            wanted = num_pages - hit_pages
            if wanted > allowed:
                self.metrics.add(counters.RESERVATIONS_CAPPED)
            backup_page_ids = self.pool.reserve_l2(namespace, min(wanted, allowed)) if allowed > 0 else []
            if backup_page_ids:
                backup_generation = next(self._generation_ids)
                namespace.generations.reserve(backup_page_ids, backup_generation)
            self.metrics.add(counters.RESERVED_PAGES, len(backup_page_ids))
        if session.session_id in self.peers.by_session:
            hits["peer"] = len(peer_block_ids) * page_size
            self.metrics.add(counters.HIT_TOKENS, hits["peer"], "peer", model=model)
        if backup_skipped:
            decided["backup_skipped"] = backup_skipped
        host_page_generations = namespace.generations.published_of(host_page_ids)
        if locked_node is None and not backup_page_ids:
            return MatchReply(hits, None, host_page_ids, hit_tokens, [], promoted_tokens, peer_id, peer_block_ids,
                              peer_epochs, **decided, host_page_generations=host_page_generations)

        lease = Lease(
            lease_id=next(self._lease_ids),
            session_id=session_id,
            namespace_id=namespace.namespace_id,
            token_ids=token_ids[: (hit_pages + len(backup_page_ids)) * page_size],
            locked_node=locked_node,
            hit_pages=hit_pages,
            private_page_ids=backup_page_ids,
            generation=backup_generation,
        )
        self.leases[lease.lease_id] = lease
        session.lease_ids.add(lease.lease_id)
        return MatchReply(hits, lease.lease_id, host_page_ids, hit_tokens, backup_page_ids, promoted_tokens,
                          peer_id, peer_block_ids, peer_epochs, **decided,
                          host_page_generations=host_page_generations, backup_generation=backup_generation)

    def _decided(self, decision: Decision, policy: str, loadable_tokens: int | None = None) -> dict[str, Any]:
        """A decision's reply fields (MatchReply's choice, restore_tokens, predicted_s, policy). A
        match's reply names no more tokens to restore from L2 or L3 than its lease can load
        (``loadable_tokens``): a promotion may have failed, been cut to the session's allowance,
        or found no room."""
        if not decision.choice:
            return {}
        restore_tokens = decision.restore_tokens
        if loadable_tokens is not None and decision.choice in ("l2", "l3", "remote"):
            restore_tokens = min(restore_tokens, loadable_tokens)
        return {"choice": decision.choice, "restore_tokens": restore_tokens, "predicted_s": decision.predicted_s,
                "policy": policy or self.cost.policy}

    def lookup(self, session_id: int, token_bytes: bytes, tp_group: bool = False, local_hit_tokens: int = 0,
               policy: str = "", promote_l3: bool = True, remote_tokens: int = 0) -> MatchReply:
        """The hit per tier of a prefix, changing nothing: no lease, no lock, no reservation, no
        LRU update, and no page ids (they are only ever handed out under a lease). It carries the
        cost model's decision (under ``policy``) for the tokens beyond the engine's own
        ``local_hit_tokens``; with promote_l3 False, L3 is no candidate.

        With tp_group, the hit of the session's tensor-parallel group: per tier, the least over
        the namespaces of every rank (the same geometry but for tp_rank); 0 while a rank has none.
        A prefix counts as cached only where every rank holds its shard. ``remote_tokens``: as for
        ``match``, a candidate with promote_l3."""
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
        peer_tokens = 0
        if not tp_group and session_id in self.peers.by_session:
            # Tokens another engine's GPU cache can give (a candidate beside the tiers; no block ids
            # in a lookup: the match that takes the lease names them).
            namespace = self.namespaces[session.namespace_id]
            peer_tokens = len(self._peer_candidate(session, namespace, token_ids)[1]) * geometry.page_size
            hits["peer"] = peer_tokens
            self.metrics.add(counters.LOOKUP_HIT_TOKENS, hits["peer"], "peer", model=geometry.model_id)
        self.metrics.add(counters.LOOKUPS, model=geometry.model_id)
        self.metrics.add(counters.LOOKUP_TOKENS, len(token_ids), model=geometry.model_id)
        self.metrics.add(counters.LOOKUP_HIT_TOKENS, hits["l2"], "l2", model=geometry.model_id)
        if remote_tokens and promote_l3 and not tp_group:
            hits["remote"] = remote_tokens
            self.metrics.add(counters.LOOKUP_HIT_TOKENS, remote_tokens, "remote", model=geometry.model_id)
        else:
            remote_tokens = 0
        decision = self._decide(self.namespaces[session.namespace_id], local_hit_tokens, hits["l2"],
                                hits.get("l3", 0) if promote_l3 else 0, policy, where="lookup", peer_tokens=peer_tokens,
                                remote_tokens=remote_tokens)
        return MatchReply(hits, None, [], hits["l2"], [], **self._decided(decision, policy))

    def peek(self, token_ids: np.ndarray, model_id: str | None = None, cache_salt: str = "",
             geometry: KVGeometry | None = None) -> list[PrefixHits]:
        """For routers that ask (POST /lookup): the hit per tier of a prefix in every namespace of
        ``model_id`` whose salt is ``cache_salt``, or in the namespace of ``geometry``. Needs no
        session and changes nothing a request could see: no lease, lock, reservation, LRU touch,
        decision or count (the match may split a tree node at the hit's end, as every lookup does)."""
        if geometry is not None:
            namespace = self.geometry_to_namespace.get(geometry)
            namespaces = [namespace] if namespace is not None else []
        else:
            namespaces = [ns for ns in self.namespaces.values()
                          if ns.geometry.model_id == model_id and ns.geometry.cache_salt == cache_salt]
        found = []
        for namespace in namespaces:
            page_size = namespace.geometry.page_size
            path = token_ids[: len(token_ids) // page_size * page_size]
            result = namespace.tree.match(path, touch=False)
            ask = self._remote_ask_after(namespace, path, result) if self.remote_enabled else None
            found.append(PrefixHits(namespace.namespace_id, namespace.geometry,
                                    {tier.label: count for tier, count in result.hit_tokens.items()}, ask))
        return found

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
            self.cost.counters.add(counters.BACKGROUND_PROMOTION_SKIPS, 1, "no_gain")
            return None
        if namespace.namespace_id in self._background_move_ids:
            self.cost.counters.add(counters.BACKGROUND_PROMOTION_SKIPS, 1, "busy")
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
            self.cost.counters.add(counters.BACKGROUND_PROMOTIONS)
        return move

    def _backup_evicted_before_reuse(self, namespace: Namespace, result, decision: Decision | None, policy: str,
                                     wanted: int) -> bool:
        """Whether a save of this path (``wanted`` pages; L3 a candidate of the match's decision)
        would only rewrite into L2 what L3 holds (and what follows), for L2 to evict before the path
        is used again: the cost model declined (policy cost) to restore the pages only L3 holds, the
        namespace has fewer free pages than wanted, free chunks of the pool included (the rest would
        be evicted), and the path was last used before the page L2 would evict next (its oldest
        evictable leaf). Under LRU its copy would be gone already; written, it would cost the
        engine the path's DMA (which its next forward waits behind, on the device-to-host copy
        engine) and L2 a page more recently used, for nothing."""
        if decision is None or (policy or self.cost.policy) != "cost" or decision.choice == "l3":
            return False
        if result.hit_tokens.get(Tier.L3, 0) <= result.hit_tokens[Tier.L2]:
            return False            # L3 holds nothing beyond the L2 hit: the save backs up new pages
        last_used = result.previous_access.get(Tier.L3)
        if last_used is None:
            return False
        if self.pool.free_room(namespace, Tier.L2) >= wanted:
            return False
        oldest = namespace.tree.oldest_evictable_access(Tier.L2)
        return oldest is not None and last_used < oldest

    def _reservable_pages(self, session: Session, namespace: Namespace) -> int:
        """How many more L2 pages this session may reserve: ``session_share`` of the namespace's
        pages, less the private pages of all its leases. One cap for every path that reserves L2
        pages for a session (a match's backup pages or its L3 promotion)."""
        held = sum(len(self.leases[lease_id].private_page_ids) for lease_id in session.lease_ids)
        return max(0, int(namespace.num_pages * self.session_share) - held)

    def _held_page_ids(self, namespace: Namespace, tier: Tier) -> list[int]:
        """The namespace's pages in the tier that are private (leases, pending moves) or quarantined."""
        held = [p for m in self.moves.values() if m.namespace_id == namespace.namespace_id and m.destination is tier
                for p in m.private_page_ids]
        if tier is Tier.L2:
            held += [p for lease in self.leases.values() if lease.namespace_id == namespace.namespace_id
                     for p in lease.private_page_ids]
            held += [p for q in self.quarantines.values() if q.session.namespace_id == namespace.namespace_id
                     for p in q.page_ids]
        return held


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
            self.metrics.add(counters.COMMITS_REFUSED)

    def release(self, session_id: int, lease_id: int) -> None:
        _, lease = self._lease_of(session_id, lease_id)
        self._end_lease(lease, LeaseState.RELEASED)
        self.metrics.add(counters.LEASES_ENDED, 1, "released")

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
            # Readers trust these pages while their words hold the generation the writer stamped.
            namespace.generations.publish(sorted(kept), lease.generation)
            lease.private_page_ids = [p for p in lease.private_page_ids if p not in kept]
            new_pages, duplicates = inserted.new_pages, len(inserted.duplicate_page_ids)
        path_tokens = lease.token_ids[:num_tokens]
        self._end_lease(lease, LeaseState.COMMITTED)
        self.metrics.add(counters.LEASES_COMMITTED)
        self.metrics.add(counters.COMMITTED_PAGES, new_pages, model=namespace.geometry.model_id)
        self.metrics.add(counters.DUPLICATE_PAGES, duplicates)
        write_through = self.plan_write_through(namespace, path_tokens) if host_page_ids else None
        if host_page_ids and new_pages and self.remote_enabled:
            self._plan_remote_write(namespace, path_tokens, lease.hit_pages)
        return CommitReply(new_pages, duplicates), write_through

    # ---- peer restores (kvcached/core/residency.py) --------------------------------------------

    def peer_register(self, session_id: int, request: PeerRegister) -> PeerExport:
        """Register the session's KV tensors for engines of its namespace to copy blocks from. Not
        listed until ``peer_ready`` names its epoch file (the I/O layer makes it)."""
        session = self.session(session_id)
        if session_id in self.peers.by_session:
            raise ProtocolError(ErrorCode.BAD_FRAME, "this session has registered its KV tensors already")
        export = self.peers.add(session_id, session.namespace_id, request, session.pid, session.pid_namespace_id,
                                session.process_start_time)
        self.metrics.add(counters.PEER_REGISTRATIONS)
        self._publish_peers(session.namespace_id)
        logger.info("session %x: KV tensors registered for peer restores (%s %s, %d blocks)", session_id,
                    request.transport, request.device_id, request.num_blocks)
        return export

    def peer_ready(self, export: PeerExport, epochs_path: str, epochs_offset_bytes: int) -> None:
        export.epochs_path, export.epochs_offset_bytes = epochs_path, epochs_offset_bytes

    def peer_unregister(self, session_id: int) -> None:
        """Undo a registration whose epoch file could not be made (its session lives on)."""
        self._end_peer_export(session_id, notify=False)

    def _end_peer_export(self, session_id: int, notify: bool = True) -> None:
        export = self.peers.remove(session_id)
        if export is None:
            return
        namespace = self.namespaces.get(export.namespace_id)
        if namespace is not None:
            self.metrics.add(counters.PEER_BLOCKS_FORGOTTEN, namespace.tree.peer_drop(export.peer_id))
        self.metrics.add(counters.PEER_REGISTRATIONS_ENDED)
        self._publish_peers(export.namespace_id)
        if notify and self._peer_end_sink is not None:
            self._peer_end_sink(export)

    def _publish_peers(self, namespace_id: int) -> None:
        namespace = self.namespaces.get(namespace_id)
        if namespace is not None:
            self.hints.set_peers(namespace.hints_slot, sum(export.namespace_id == namespace_id
                                                           for export in self.peers.by_session.values()))

    def peer_publish(self, session_id: int, request: PeerPublish) -> None:
        """What entered and left the session's GPU cache: removals first, then each run."""
        self.session(session_id)
        export = self.peers.by_session.get(session_id)
        if export is None:
            raise ProtocolError(ErrorCode.NOT_ATTACHED, "this session has not registered its KV tensors "
                                "(PEER_REGISTER) or its registration ended")
        num_blocks = export.request.num_blocks
        names = list(request.removed) + [b for run in request.runs for b in run.block_ids]
        if names and max(names) >= num_blocks:
            raise ProtocolError(ErrorCode.BAD_PAGES, f"block id {max(names)} is beyond the registration's "
                                f"{num_blocks} blocks")
        tree = self.namespaces[export.namespace_id].tree
        self.metrics.add(counters.PEER_BLOCKS_REMOVED, tree.peer_remove(export.peer_id, request.removed))
        for run in request.runs:
            try:
                added = tree.peer_put(np.frombuffer(run.token_ids, dtype="<i4"), export.peer_id, run.start_page,
                                      run.block_ids, run.epochs)
            except ValueError as exc:       # what came before in the message stands
                raise ProtocolError(ErrorCode.BAD_PAGES, f"a peer run does not fit: {exc}") from None
            self.metrics.add(counters.PEER_BLOCKS_PUBLISHED, added)
        self.metrics.add(counters.PEER_PUBLICATIONS)

    def peer_list(self, session_id: int) -> list[dict[str, Any]]:
        """The registrations the session may open (none unless it registered itself)."""
        self.session(session_id)
        reader = self.peers.by_session.get(session_id)
        return [export.to_wire() for export in self.peers.readable_by(reader)] if reader is not None else []

    def _peer_candidate(self, session: Session, namespace: Namespace, token_ids: np.ndarray
                        ) -> tuple[int, list[int], list[int]]:
        """The longest run of another engine's blocks this session may copy, for the leading pages
        of token_ids: (peer id, blocks, epochs), or (0, [], []). The first registered wins a tie."""
        reader = self.peers.by_session.get(session.session_id)
        if reader is None:
            return 0, [], []
        owners = [export.peer_id for export in self.peers.readable_by(reader)]
        if not owners:
            return 0, [], []
        hits = namespace.tree.peer_hits(token_ids, owners)
        if not hits:
            return 0, [], []
        peer_id = max(owners, key=lambda owner: len(hits[owner].block_ids) if owner in hits else 0)
        return peer_id, hits[peer_id].block_ids, hits[peer_id].epochs

    # ---- moves between tiers (L3) ------------------------------------------------------------

    # ---- the remote tier (kvcached/core/remote.py) -------------------------------------------

    @property
    def remote_enabled(self) -> bool:
        return self._remote_write_sink is not None

    def remote_namespace_key(self, namespace: Namespace) -> str:
        key = self._remote_namespace_keys.get(namespace.namespace_id)
        if key is None:
            key = self._remote_namespace_keys[namespace.namespace_id] = namespace_key(namespace.geometry)
        return key

    def remote_ask(self, session_id: int, token_bytes: bytes) -> RemoteAsk | None:
        """Which pages to ask the remote store about for this prompt: those after its L2 hit, when L3
        holds no more than L2 (a longer local L3 hit is restored from L3, and the store is not
        asked); None when there is nothing to ask. Changes nothing."""
        if not self.remote_enabled:
            return None
        session = self.session(session_id)
        namespace = self.namespaces[session.namespace_id]
        token_ids = np.frombuffer(token_bytes, dtype="<i4")
        page_size = namespace.geometry.page_size
        num_pages = len(token_ids) // page_size
        result = namespace.tree.match(token_ids[: num_pages * page_size], touch=False)
        return self._remote_ask_after(namespace, token_ids, result)

    def _remote_ask_after(self, namespace: Namespace, token_ids: np.ndarray, result) -> RemoteAsk | None:
        """remote_ask, given the tree's match of the path's whole pages."""
        page_size = namespace.geometry.page_size
        num_pages = len(token_ids) // page_size
        l2_pages = result.hit_tokens[Tier.L2] // page_size
        if l2_pages >= num_pages or result.hit_tokens.get(Tier.L3, 0) > result.hit_tokens[Tier.L2]:
            return None
        return RemoteAsk(namespace.namespace_id, self.remote_namespace_key(namespace), page_size,
                         token_ids[: num_pages * page_size].copy(), l2_pages, num_pages)

    def _plan_remote_move(self, namespace: Namespace, result, token_ids: np.ndarray, remote_pages: int,
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
        private_page_ids = self.pool.reserve(namespace, Tier.L2, end_page - start_page)
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

    def _plan_remote_write(self, namespace: Namespace, token_ids: np.ndarray, start_page: int) -> None:
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
        namespace = self.namespaces.get(write.namespace_id)
        if write.lock is not None and namespace is not None:
            namespace.tree.unlock(write.lock, Tier.L2)
        write.lock = None
        self.metrics.add(counters.REMOTE_WRITTEN_PAGES, num_sent)
        if num_sent and namespace is not None and self._publishes_events(namespace.geometry):
            geometry = namespace.geometry
            path = write.token_ids[: (write.start_page + num_sent) * geometry.page_size].astype("<i4").tobytes()
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
        direction, what = ("h2s", "write-through") if destination is Tier.L3 else ("s2h", "promotion")
        private_page_ids = self.pool.reserve(namespace, destination, end_page - start_page)
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
        namespace = self.namespaces[move.namespace_id]
        allocator = namespace.allocator(move.destination)
        gained = 0
        num_valid = self.l3.num_verified_pages(namespace, move) if ok else 0
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
                self.l3.index_written(namespace, move, set(inserted.duplicate_page_ids))
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
            self.cost.counters.add(counters.BACKGROUND_PROMOTED_PAGES, gained)
        if move.remote and move.mismatch:
            self.metrics.add(counters.REMOTE_CHECKSUM_MISMATCHES)
            logger.warning("namespace %d: a page the remote store gave is not the page asked for (%s); not "
                           "served, the request recomputes it", move.namespace_id, move.mismatch)
        if ok and move.destination is Tier.L2 and num_valid < len(move.source_page_ids):
            self.l3.drop_corrupt_page(namespace, move, move.start_page + num_valid)
        return gained

    # ---- KV events (see kv_events.py) ---------------------------------------------------------

    def _publishes_events(self, geometry: KVGeometry) -> bool:
        """Events are recorded for one rank of a tensor-parallel group (rank 0): its ranks store the
        same pages, and a router routes to the group, not to a rank."""
        return self.kv_events is not None and geometry.tp_rank == 0

    def _residency_event(self, geometry: KVGeometry, node: TreeNode, tier: Tier, delta: int) -> None:
        path = node.path()
        start_page = (len(path) - len(node.key)) // (4 * geometry.page_size)
        self.kv_events.record(TierEvent(EventKind.STORED if delta > 0 else EventKind.REMOVED, geometry.model_id,
                                        geometry.page_size, TIER_WHERE[tier], path, start_page))

    # ---- the persistent L3 index (l3_persistence.py) ------------------------------------------

    def restore_l3(self, saved: list[SavedNamespace], l3_bytes_kept: int) -> int:
        """At start, before any engine attached: rebuild the namespaces of a persistent L3 index
        (``L3Persistence.restore``). Returns the number of L3 pages restored."""
        return self.l3.restore(saved, l3_bytes_kept, self.pool, self._create_namespace, self.geometry_to_namespace,
                               self.max_namespaces)

    def _end_lease(self, lease: Lease, new_state: LeaseState, quarantined: list[int] | None = None) -> None:
        """quarantined: a list that takes the lease's private pages instead of the allocator."""
        lease.transition(new_state)
        namespace = self.namespaces[lease.namespace_id]
        if lease.locked_node is not None:
            namespace.tree.unlock(lease.locked_node, Tier.L2)
        # Unwritten pages: the lease's writer may no longer claim them (a claim read earlier is
        # the residual window, bounded by the quarantine; see Fencing).
        namespace.generations.revoke(lease.private_page_ids)
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
        integrity.check_integrity(self)

    def status(self) -> dict[str, Any]:
        return snapshot.status(self)

