"""The daemon's whole state, with no I/O: namespaces, sessions, leases and metrics.

The server loop decodes a request, calls one method here and sends back what it returns, or
the ``ProtocolError`` it raises. Nothing here blocks or touches a socket, so every rule below
is tested in-process.

Ownership of L2 pages, per namespace, is a partition: every page is exactly one of
tree-owned, free (in the allocator), private (reserved by an active lease for a backup, or by a
pending tier move) or quarantined (private to a session that ended while its process may still be
writing them; see "Fencing" in docs/architecture.md). Which pages a namespace may use at all
follows from the chunks of the pool it owns (``chunks.py``; "Tiers" in docs/architecture.md):
one geometry gets the whole pool, several share it, and a chunk changes hands only once every
page of its old owner in it is free.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import logging
import secrets
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from kvcached.core import counters
from kvcached.core.allocator import PageAllocator
from kvcached.core.chunks import ChunkMap
from kvcached.core.cost_model import NO_DECISION, CostModel, Decision
from kvcached.core.generations import GenerationFiles, PageGenerations, PrivateGenerations
from kvcached.core.hints import AdmissionHints
from kvcached.core.kv_events import REMOTE_WHERE, TIER_WHERE, EventBuffer, EventKind, TierEvent
from kvcached.core.l3_index import (ROOT_KEY, DeleteSlots, DropNamespace, IndexChange, NamespaceLayout, PutNamespace,
                                    PutSlots, SavedNamespace, SlotRow, namespace_key, plan_rebuild)
from kvcached.core.leases import Lease, LeaseState, Quarantine, Session
from kvcached.core.metrics import Metrics
from kvcached.core.residency import PeerExport, PeerRegistry
from kvcached.core.tier_ops import OpState, TierMove
from kvcached.core.tiers import IntegrityError, Tier
from kvcached.core.tree import PrefixTree, TreeNode
from proto.errors import ErrorCode, ProtocolError
from proto import hints
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
# A namespace that evicted cached pages to make room is "under pressure" until it has gone this
# long without evicting; each such episode is logged once.
PRESSURE_QUIET_S = 60.0
# A search of the other namespaces for a chunk to take that found none is not repeated for this
# long by the same namespace and tier (it walks their trees); meanwhile it evicts its own pages.
CHUNK_SCAN_INTERVAL_S = 1.0


@dataclasses.dataclass
class Pressure:
    """Evictions a namespace suffered to make room in one tier (its own LRU pages, or the pages of
    a chunk another namespace took)."""

    evicted_pages: int = 0
    episodes: int = 0
    last_eviction_at: float | None = None


@dataclasses.dataclass(eq=False)
class Namespace:
    namespace_id: int
    geometry: KVGeometry
    num_pages: int                                 # L2 page ids 0..num_pages-1 span the whole segment
    tree: PrefixTree
    l2_allocator: PageAllocator
    l3_allocator: PageAllocator | None = None      # None: no L3 for this namespace
    session_ids: set[int] = dataclasses.field(default_factory=set)
    idle_since: float | None = None                # when its last session ended; None while attached
    index_key: str = ""                            # with a persistent L3 index: namespace_key(geometry)
    l3_checksums: np.ndarray | None = None         # with a persistent L3 index: crc32 per L3 slot held
    # Pages it may use now per tier: those of the chunks it owns (chunks.py).
    capacity: dict[Tier, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(Tier, 0))
    pressure: dict[Tier, Pressure] = dataclasses.field(default_factory=lambda: {t: Pressure() for t in Tier})
    hints_slot: int = -1                           # its slot of the admission hints
    generations: PageGenerations | None = None     # the write generation of each L2 page

    def allocator(self, tier: Tier) -> PageAllocator:
        allocator = self.l2_allocator if tier is Tier.L2 else self.l3_allocator
        assert allocator is not None, f"namespace {self.namespace_id} has no {tier.label}"
        return allocator


class ChunkOffer(NamedTuple):
    """A chunk another namespace could give up: its pages are free or cached and unlocked."""

    namespace: Namespace
    chunk: int
    newest_access: float       # the LRU time of its most recently used page; -inf if it caches none
    # (holds a reused page, LRU time of its newest such page, else of its newest page): the page
    # its owner's evict() would keep longest, as PrefixTree.next_eviction_rank ranks them
    newest_rank: tuple[bool, float] = (False, -np.inf)


def session_tag(session_id: int) -> str:
    """How status names a session: session ids are capabilities (a peer that knows one can detach
    that engine or release its leases), so status shows a digest, never the id."""
    return hashlib.blake2b(session_id.to_bytes(8, "little"), digest_size=6).hexdigest()


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
        self.chunks: dict[Tier, ChunkMap] = {Tier.L2: ChunkMap(l2_bytes)}
        if l3_bytes > 0:
            self.chunks[Tier.L3] = ChunkMap(l3_bytes)
        self.moves: dict[int, TierMove] = {}
        self._move_ids = itertools.count(1)
        self._namespace_ids = itertools.count()
        # (namespace id, tier) -> when it may search the other namespaces for a chunk again
        self._chunk_scan_not_before: dict[tuple[int, Tier], float] = {}
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
        self._generation_ids = itertools.count(1)       # write generations: never 0, never reused
        self._generation_files = generation_files if generation_files is not None else PrivateGenerations()
        self._running_at = clock()
        self._l3_index_sink = l3_index_sink if Tier.L3 in self.chunks else None
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
                self._assign_free_chunks(namespace, tier)
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
        reserves pages: _make_room)."""
        bytes_per_page = geometry.bytes_per_page
        if not self.namespaces:
            # The first geometry: where its page is larger than a chunk (a small pool: chunks are
            # 1/64 of it), the pool is cut in chunks of whole pages of it instead (none straddles
            # two); nothing is in the pool yet.
            for tier, chunks in self.chunks.items():
                if bytes_per_page > chunks.chunk_bytes:
                    self.chunks[tier] = ChunkMap(chunks.space_bytes, min(bytes_per_page, chunks.space_bytes))
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
            self._index_namespace(namespace)
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
        for tier, chunks in self.chunks.items():
            for chunk in chunks.owned_by(victim.namespace_id):
                chunks.owner[chunk] = None
            self._chunk_scan_not_before.pop((victim.namespace_id, tier), None)
        if victim.l3_checksums is not None:
            self._l3_index_sink(DropNamespace(victim.index_key))
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
            backup_page_ids = self._reserve_l2(namespace, min(wanted, allowed)) if allowed > 0 else []
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
        room = namespace.allocator(Tier.L2).num_free + sum(
            len(self._pages_if_gained(namespace, Tier.L2, chunk)) for chunk in self.chunks[Tier.L2].free_chunks())
        if room >= wanted:
            return False
        oldest = namespace.tree.oldest_evictable_access(Tier.L2)
        return oldest is not None and last_used < oldest

    def _reservable_pages(self, session: Session, namespace: Namespace) -> int:
        """How many more L2 pages this session may reserve: ``session_share`` of the namespace's
        pages, less the private pages of all its leases. One cap for every path that reserves L2
        pages for a session (a match's backup pages or its L3 promotion)."""
        held = sum(len(self.leases[lease_id].private_page_ids) for lease_id in session.lease_ids)
        return max(0, int(namespace.num_pages * self.session_share) - held)

    def _reserve_l2(self, namespace: Namespace, num_pages: int) -> list[int]:
        page_ids = self._reserve(namespace, Tier.L2, num_pages)
        if not page_ids:
            self.metrics.add(counters.RESERVATION_FAILURES)
        return page_ids

    def _reserve(self, namespace: Namespace, tier: Tier, num_pages: int) -> list[int]:
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

    # ---- the pool: chunks moving between namespaces (chunks.py) ----------------------------

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
                    self._unindex_slots(namespace, evicted)
                self._note_eviction(namespace, tier, len(evicted), "its own least recently used pages")

    def _gain_chunk(self, namespace: Namespace, tier: Tier) -> bool:
        """Give the namespace more of the tier, if it can be had and yields pages: every free chunk,
        else the coldest chunk another namespace can give up (_chunk_to_take). Returns whether it
        gained any."""
        if self._assign_free_chunks(namespace, tier):
            return True
        now = self.clock()
        scan_key = (namespace.namespace_id, tier)
        if now < self._chunk_scan_not_before.get(scan_key, -np.inf):
            return False
        offer = self._chunk_to_take(namespace, tier)
        if offer is None:
            self._chunk_scan_not_before[scan_key] = now + CHUNK_SCAN_INTERVAL_S
            return False
        self._take_chunk(offer, namespace, tier)
        return True

    def _pages_if_gained(self, namespace: Namespace, tier: Tier, chunk: int) -> range:
        return self.chunks[tier].usable_pages(chunk, namespace.namespace_id, namespace.geometry.bytes_per_page,
                                              namespace.allocator(tier).num_pages)

    def _assign_free_chunks(self, namespace: Namespace, tier: Tier) -> int:
        """Every free chunk of the tier that yields pages becomes the namespace's (a new namespace
        gets them at once: one geometry alone holds the whole pool). Returns how many."""
        free = [chunk for chunk in self.chunks[tier].free_chunks() if self._pages_if_gained(namespace, tier, chunk)]
        for chunk in free:
            self._assign_chunk(namespace, tier, chunk)
        return len(free)

    def _assign_chunk(self, namespace: Namespace, tier: Tier, chunk: int) -> None:
        """A free chunk becomes the namespace's: its pages there join its free pages."""
        chunks = self.chunks[tier]
        assert chunks.owner[chunk] is None, f"chunk {chunk} of {tier.label} is owned already"
        chunks.owner[chunk] = namespace.namespace_id
        pages = self._pages_if_gained(namespace, tier, chunk)
        namespace.allocator(tier).free_range(pages.start, pages.stop)
        namespace.capacity[tier] += len(pages)

    def _release_chunk(self, namespace: Namespace, tier: Tier, chunk: int) -> None:
        """The namespace gives a chunk back to the pool; every page of it there must be free."""
        chunks = self.chunks[tier]
        assert chunks.owner[chunk] == namespace.namespace_id
        pages = self._pages_if_gained(namespace, tier, chunk)
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
        for other in self.namespaces.values():
            if other is namespace or tier not in other.tree.tiers:
                continue
            idle = not other.session_ids
            larger = len(self.chunks[tier].owned_by(other.namespace_id)) > own_chunks
            for offer in self._chunk_offers(other, tier):
                if not self._pages_if_gained(namespace, tier, offer.chunk):
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

    def _take_chunk(self, offer: ChunkOffer, namespace: Namespace, tier: Tier) -> None:
        """Move a chunk from its owner to ``namespace``: the owner's cached pages in it are evicted
        (with what lies below them: residency is prefix-closed), then it changes hands."""
        victim = offer.namespace
        pages = self._pages_if_gained(victim, tier, offer.chunk)
        evicted = victim.tree.discard_pages(tier, pages)
        if evicted:
            victim.allocator(tier).free(evicted)
            if tier is Tier.L3:
                self._unindex_slots(victim, evicted)
            self._note_eviction(victim, tier, len(evicted), f"a chunk of the pool went to namespace "
                                f"{namespace.namespace_id} ({namespace.geometry.model_id})")
        self._release_chunk(victim, tier, offer.chunk)
        self._assign_chunk(namespace, tier, offer.chunk)
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
        now = self.clock()
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
        private_page_ids = self._reserve(namespace, Tier.L2, end_page - start_page)
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
        private_page_ids = self._reserve(namespace, destination, end_page - start_page)
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
        num_valid = self._num_verified_pages(namespace, move) if ok else 0
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
                self._index_written(namespace, move, set(inserted.duplicate_page_ids))
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
            self._drop_corrupt_l3_page(namespace, move, move.start_page + num_valid)
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

    # ---- the persistent L3 index (see l3_index.py) -------------------------------------------

    def _index_namespace(self, namespace: Namespace) -> None:
        if self._l3_index_sink is None:
            return
        assert namespace.l3_allocator is not None
        namespace.index_key = namespace_key(namespace.geometry)
        namespace.l3_checksums = np.zeros(namespace.l3_allocator.num_pages, dtype=np.uint32)
        self._l3_index_sink(PutNamespace(NamespaceLayout(namespace.index_key, namespace.geometry,
                                                         namespace.geometry.bytes_per_page)))

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
        for i, slot in enumerate(move.private_page_ids[:move.num_published_pages]):
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

    def _drop_corrupt_l3_page(self, namespace: Namespace, move: TierMove, page: int) -> None:
        """A slot did not hold what its checksum says: drop that page (and what lies below it)
        from L3 and the index. While another move still locks it, it stays until read again."""
        slot = move.source_page_ids[page - move.start_page]
        self.metrics.add(counters.L3_CHECKSUM_MISMATCHES)
        freed = namespace.tree.discard(move.token_ids, Tier.L3, page)
        if freed:
            namespace.l3_allocator.free(freed)
            self._unindex_slots(namespace, freed)
            self.metrics.add(counters.L3_CORRUPT_PAGES, len(freed))
        logger.warning("namespace %d: L3 slot %d does not hold the page its index names (checksum mismatch); "
                       "not served, %d slots dropped", namespace.namespace_id, slot, len(freed))

    def restore_l3(self, saved: list[SavedNamespace], l3_bytes_kept: int) -> int:
        """At start, before any engine attached: rebuild each namespace of a persistent index from
        its rows, and give it back the chunks of the file its slots lie in. Namespaces with more
        rows go first; a row whose slot lies (now) in a chunk another namespace took back, past
        the file's end, or in bytes the file did not keep, is dropped, as is what cannot be trusted
        (torn rows, rows whose parent is gone) and what no longer fits at all (another page size,
        more namespaces than served). What is dropped leaves the index and is logged.
        ``l3_bytes_kept``: how much of the file kept its content. Returns the number of L3 pages
        restored."""
        assert not self.namespaces, "restore_l3 runs before the first attach"
        restored = 0
        for entry in sorted(saved, key=lambda e: (-len(e.rows), e.layout.namespace_key)):
            layout = entry.layout
            reason = self._l3_layout_unusable(layout, l3_bytes_kept)
            if reason is not None:
                logger.warning("L3 index: %d pages of %s dropped: %s", len(entry.rows), layout.geometry.model_id,
                               reason)
                self.metrics.add(counters.L3_INDEX_ROWS_DROPPED, len(entry.rows))
                if self._l3_index_sink is not None:
                    self._l3_index_sink(DropNamespace(layout.namespace_key))
                continue
            namespace = self._create_namespace(layout.geometry)
            namespace.idle_since = self.clock()
            chunks = self.chunks[Tier.L3]
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
                self._assign_chunk(namespace, Tier.L3, chunk)
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
                self._unindex_slots(namespace, dropped)
                self.metrics.add(counters.L3_INDEX_ROWS_DROPPED, len(dropped))
            restored += len(slot_ids)
            self.metrics.add(counters.L3_RESTORED_PAGES, len(slot_ids))
            logger.info("L3 index: namespace %d (%s) back with %d pages in %d chunks; dropped %d rows past the file's "
                        "end or the bytes it kept, %d in chunks of another namespace, %d torn, %d whose parent "
                        "page is gone", namespace.namespace_id, layout.geometry.model_id, len(slot_ids),
                        len(chunks.owned_by(namespace.namespace_id)), plan.num_beyond, len(foreign_slots),
                        plan.num_torn, plan.num_orphans)
        return restored

    def _l3_layout_unusable(self, layout: NamespaceLayout, l3_bytes_kept: int) -> str | None:
        """Why a saved namespace cannot be rebuilt at all now, or None."""
        l3_chunks = self.chunks.get(Tier.L3)
        if l3_chunks is None:
            return "this daemon has no L3"
        if len(self.namespaces) >= self.max_namespaces:
            return f"the index holds more namespaces than the {self.max_namespaces} served now (--max-namespaces)"
        if layout.geometry in self.geometry_to_namespace:
            return "another namespace of the index has the same geometry"
        if layout.bytes_per_page != layout.geometry.bytes_per_page:
            return f"its pages of {layout.bytes_per_page} bytes do not match its geometry's"
        if layout.bytes_per_page > min(l3_chunks.chunk_bytes, self.chunks[Tier.L2].chunk_bytes):
            return "one of its pages is larger than a chunk of the pool now (a smaller --l2-size or --l3-size)"
        if l3_bytes_kept < layout.bytes_per_page:
            return f"the L3 file kept only {l3_bytes_kept} bytes"
        return None

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
        for tier, chunks in self.chunks.items():
            for chunk, owner in enumerate(chunks.owner):
                if owner is not None and (owner not in self.namespaces
                                          or tier not in self.namespaces[owner].tree.tiers):
                    raise IntegrityError(f"{tier.label} chunk {chunk} belongs to namespace {owner}, which has no "
                                         f"{tier.label}")
        for namespace in self.namespaces.values():
            self._check_namespace(namespace)

    def _check_namespace(self, namespace: Namespace) -> None:
        owned_by_tier = namespace.tree.check_integrity()
        head = self.hints.head(namespace.hints_slot)
        if head["tag"] != namespace.namespace_id + 1:
            raise IntegrityError(f"namespace {namespace.namespace_id}: its hints slot {namespace.hints_slot} is "
                                 f"tagged {head['tag']}")
        expected_roots = np.zeros(self.hints.num_buckets, dtype=np.int64)
        for key, child in namespace.tree.root.children.items():
            if child.is_resident(Tier.L2):
                expected_roots[hints.bucket(key, self.hints.num_buckets)] += 1
        if not np.array_equal(expected_roots, self.hints.l2_roots(namespace.hints_slot)):
            raise IntegrityError(f"namespace {namespace.namespace_id}: the published first pages in L2 differ from "
                                 "the tree's")
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
        for write in self.remote_writes.values():
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
            usable = self.chunks[tier].page_ids_of(namespace.namespace_id, namespace.geometry.bytes_per_page,
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

    def _tier_status(self, namespace: Namespace, tier: Tier) -> dict[str, int]:
        private = sum(len(m.private_page_ids) for m in self.moves.values()
                      if m.namespace_id == namespace.namespace_id and m.destination is tier)
        if tier is Tier.L2:
            private += sum(len(l.private_page_ids) for l in self.leases.values()
                           if l.namespace_id == namespace.namespace_id)
        quarantined = sum(len(q.page_ids) for q in self.quarantines.values()
                          if q.session.namespace_id == namespace.namespace_id) if tier is Tier.L2 else 0
        allocator = namespace.allocator(tier)
        pressure = namespace.pressure[tier]
        return {
            "capacity_pages": namespace.capacity[tier],
            "chunks": len(self.chunks[tier].owned_by(namespace.namespace_id)),
            "free_pages": allocator.num_free,
            "owned_pages": namespace.tree.owned_pages(tier),
            "protected_pages": namespace.tree.protected_pages(tier),
            "evictable_pages": namespace.tree.evictable_pages(tier),
            "private_pages": private,
            "quarantined_pages": quarantined,
            "evicted_pages": pressure.evicted_pages,
            "pressure_episodes": pressure.episodes,
            "under_pressure": (pressure.last_eviction_at is not None
                               and self.clock() - pressure.last_eviction_at <= PRESSURE_QUIET_S),
        }

    def _peer_status(self, session: Session) -> dict[str, Any]:
        export = self.peers.by_session.get(session.session_id)
        if export is None:
            return {}
        tree = self.namespaces[export.namespace_id].tree
        return {"peer": {"transport": export.request.transport, "device_id": export.request.device_id,
                         "num_blocks": export.request.num_blocks, "published_blocks": tree.peer_blocks(export.peer_id),
                         "readers_may_open": len(self.peers.readable_by(export))}}

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
                 "pid_watched": s.pid_watched, "report": s.report, **self._peer_status(s)}
                for s in self.sessions.values()
            ],
            "quarantines": [
                {"session": session_tag(session_id), "pid": q.session.pid, "client_name": q.session.client_name,
                 "namespace_id": q.session.namespace_id, "pages": len(q.page_ids), "reason": q.reason,
                 "pid_watched": q.session.pid_watched, "idle_s": round(self.clock() - q.session.last_seen, 3)}
                for session_id, q in self.quarantines.items()
            ],
            "leases": len(self.leases),
            "pending": {"h2s": self.pending_moves("h2s"), "s2h": self.pending_moves("s2h"),
                        "r2h": self.pending_moves("r2h"), "h2r": len(self.remote_writes)},
            "namespaces": namespaces,
            "cost_model": self.cost.status({ns.namespace_id: ns.geometry.model_id for ns in self.namespaces.values()}),
            "pool": {tier.label: {"chunk_bytes": chunks.chunk_bytes, "chunks": chunks.num_chunks,
                                  "free_chunks": len(chunks.free_chunks())}
                     for tier, chunks in self.chunks.items()},
            "metrics": self.metrics.snapshot(),
            "metrics_by_model": self.metrics.model_snapshot(),
            "histograms": self.metrics.histogram_snapshot(),
        }
