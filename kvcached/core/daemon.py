"""The daemon's whole state, with no I/O: one facade over small owners.

The server loop decodes a request, calls one method here and sends back what it returns, or
the ``ProtocolError`` it raises. Nothing here blocks or touches a socket, so every rule below
is tested in-process. The facade keeps the request verbs (attach, lookup, acquire, commit, release) and
composes the owners, each with its own state: the namespaces (``namespace_table.py``,
``namespaces.py``), the pool of chunks (``pool.py``), sessions and the one lease lifecycle
(``sessions.py``), tiering (``tiering.py``: moves, write-through, promotion, checksums), L3
persistence (``l3_persistence.py``), peer registrations (``residency.py``); the invariants
(``integrity.py``) and the status snapshot (``snapshot.py``) read them all.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from kvcached.core import counters, integrity, snapshot
from kvcached.core.cost_model import CostModel
from kvcached.core.generations import GenerationFiles, PrivateGenerations
from kvcached.core.hints import AdmissionHints
from kvcached.core.kv_events import EventBuffer
from kvcached.core.l3_index import IndexChange, SavedNamespace
from kvcached.core.l3_persistence import L3Persistence
from kvcached.core.leases import LeaseState, Session
from kvcached.core.metrics import Metrics
from kvcached.core.namespace_table import NamespaceTable
from kvcached.core.namespaces import Namespace
from kvcached.core.pool import Pool
from kvcached.core.residency import PeerExport, PeerRegistry
from kvcached.core.sessions import SessionTable
from kvcached.core.tier_ops import TierMove
from kvcached.core.tiering import RemoteAsk, RemoteWrite, Tiering
from kvcached.core.tiers import Tier
from proto.errors import ErrorCode, ProtocolError
from proto.hints import NEVER
from proto.messages import KVGeometry
from proto.procfs import ProcessIdentity
from proto.tokens import page_aligned, token_array
from proto.replies import NO_DECISION, AcquireReply, CommitReply, Decision, LookupReply
from proto.schema import Acquire, Commit, Lookup, PeerPublish, PeerRegister, Release

logger = logging.getLogger(__name__)

# Of the L2 pool (counted in its namespace's pages), at most this share is reserved by one session
# at a time, over all its leases (the reserved pages of its acquires); an acquire's L3 promotion
# reserves no more than that allowance either. Every reservation may evict cached prefixes, and a
# session keeps what it holds while it lives. The default; ``session_share`` sets another.
MAX_SESSION_RESERVED_SHARE = 0.5


class PrefixHits(NamedTuple):
    """A namespace's cached prefix of a path (``DaemonState.peek``): tokens per tier label, and
    what to ask the remote store (None: nothing, or no remote tier)."""
    namespace_id: int
    geometry: KVGeometry
    hit_tokens: dict[str, int]
    remote_ask: RemoteAsk | None


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
        self.max_namespaces = max_namespaces
        self.clock = clock
        self.namespaces: dict[int, Namespace] = {}
        self.metrics = Metrics()
        self.pool = Pool(l2_bytes, l3_bytes, self.namespaces, self.metrics, clock, self._held_page_ids,
                         lambda namespace, slot_ids: self.l3.unindex_slots(namespace, slot_ids))
        self.l3 = L3Persistence(l3_index_sink if l3_bytes > 0 else None, self.metrics, clock)
        self._generation_ids = itertools.count(1)       # write generations: never 0, never reused
        self.cost = cost_model if cost_model is not None else CostModel()
        self.hints = hints if hints is not None else AdmissionHints(max_namespaces)
        if self.hints.num_slots < max_namespaces:
            raise ValueError(f"the admission hints have {self.hints.num_slots} slots for {max_namespaces} namespaces")
        self.hints.set_policy(self.cost.policy)
        self.kv_events = kv_events
        self.namespace_table = NamespaceTable(
            self.namespaces, max_namespaces, self.metrics, clock, self.pool, self.l3, self.hints, self.cost,
            generation_files if generation_files is not None else PrivateGenerations(), kv_events,
            self._busy_namespace_ids, self.publish_cost_hints)
        self.geometry_to_namespace = self.namespace_table.geometry_to_namespace
        self.peers = PeerRegistry(self.namespaces, self.metrics, self.hints, peer_end_sink)
        self.session_table = SessionTable(self.namespaces, self.metrics, clock, session_timeout_s=session_timeout_s,
                                          session_grace_s=session_grace_s, session_share=session_share,
                                          on_session_end=self.peers.end)
        self.tiering = Tiering(self.namespaces, self.metrics, self.pool, self.l3, self.cost, self._generation_ids,
                               remote_write_sink, kv_events, self._publishes_events)

    # What the owners hold, by the names the server and the tests read.
    chunks = property(lambda self: self.pool.chunks)
    sessions = property(lambda self: self.session_table.sessions)
    leases = property(lambda self: self.session_table.leases)
    quarantines = property(lambda self: self.session_table.quarantines)
    moves = property(lambda self: self.tiering.moves)
    remote_writes = property(lambda self: self.tiering.remote_writes)
    remote_enabled = property(lambda self: self.tiering.remote_enabled)

    # ---- sessions -----------------------------------------------------------------------

    def attach(self, geometry: KVGeometry, pid: int, client_name: str = "", *, pid_watched: bool = False,
               pid_namespace_id: int = 0, process_start_time: int = 0,
               previous_session_id: int = 0) -> tuple[Session, Namespace]:
        """A new session. ``pid_watched``: the I/O layer watches this process and reports its exit
        (process_gone). ``previous_session_id``: a session of the same process that it has given
        up, every transfer into its pages drained: it ends, or its quarantine does."""
        namespace = self.geometry_to_namespace.get(geometry)
        if namespace is None:
            namespace = self.namespace_table.create(geometry)
            for tier in namespace.tree.tiers:
                self.pool.assign_free_chunks(namespace, tier)
        session = self.session_table.open(namespace, ProcessIdentity(pid, pid_namespace_id, process_start_time),
                                          client_name, pid_watched=pid_watched,
                                          previous_session_id=previous_session_id)
        return session, namespace

    def session(self, session_id: int) -> Session:
        return self.session_table.get(session_id)

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
        """End a session and reclaim its leases; returns how many leases were reclaimed."""
        return self.session_table.detach(session_id)

    def process_gone(self, session_id: int) -> bool:
        return self.session_table.process_gone(session_id)

    def watches(self, session_id: int) -> bool:
        return self.session_table.watches(session_id)

    def note_running(self, max_gap_s: float) -> float:
        return self.session_table.note_running(max_gap_s)

    def expire_sessions(self) -> list[int]:
        return self.session_table.expire_sessions()

    # ---- the request verbs: lookup, acquire, commit, release ------------------------------------

    def acquire(self, request: Acquire, remote_tokens: int = 0) -> AcquireReply | TierMove:
        """The hit per tier, a lease on the L2 hit and, with ``save``, private L2 pages reserved for
        the pages the daemon lacks.

        With promote "wait" the cost model decides (under ``policy``, for the tokens beyond the
        engine's own ``local_hit_tokens``) whether the pages only L3 holds are worth restoring; if
        so, returns instead the S2H move that must run first (planned from the same tree walk, the
        decision in ``move.decision``): the caller runs it, finishes it (``finish_move``), then
        calls ``acquire_after`` with it, which answers. ``remote_tokens``: the leading tokens L2 and
        the remote store hold together (what the store answered to ``remote_ask``), a candidate
        with "wait"; where the model takes it, returns the R2H move that gets the store's pages into
        L2 first, resumed alike.

        With promote "recompute" the engine recomputes what lies beyond its own hit whatever the
        reply says (it predicted a decline, ``proto.hints``): nothing is promoted; the decision the
        model would have taken is counted under "predicted" and replied. With "none" no tier below
        L2 is weighed (a decision is taken only for a peer candidate)."""
        return self._acquire(request, remote_tokens, None)

    def acquire_after(self, request: Acquire, move: TierMove) -> AcquireReply:
        """The reply to an ``acquire`` that returned ``move``, once the move is finished (or, for
        a remote one, given up on): what it published is an L2 hit; the engine recomputes what it
        could not give. The decision is the one the move was planned for. An acquire whose session
        ended meanwhile is refused (NOT_ATTACHED), and counted neither served nor fallen back."""
        reply = self._acquire(request, 0, move)
        assert not isinstance(reply, TierMove)
        published = move.num_published_pages
        if move.remote:
            self.metrics.add(counters.REMOTE_RESTORES if published else counters.REMOTE_FALLBACKS)
        else:
            self.metrics.add(counters.PROMOTIONS if published else counters.PROMOTION_FALLBACKS)
        return reply

    def _acquire(self, request: Acquire, remote_tokens: int, after: TierMove | None) -> AcquireReply | TierMove:
        session = self.session(request.session_id)
        namespace = self.namespaces[session.namespace_id]
        page_size = namespace.geometry.page_size
        token_ids = token_array(request.token_ids)
        num_pages = len(token_ids) // page_size
        token_ids = token_ids[: num_pages * page_size]
        local_hit_tokens = page_aligned(min(request.local_hit_tokens, len(token_ids)), page_size)
        policy = request.policy
        # Whether this pass weighs the tiers below L2 (a resumed acquire took its decision already).
        lower_tiers = request.promote != "none" and after is None
        recompute = request.promote == "recompute"
        decision: Decision | None = after.decision if after is not None else None
        promoted_tokens = after.num_published_pages * page_size if after is not None else 0

        result = namespace.tree.match(token_ids, own_pages=local_hit_tokens // page_size)
        allowed = self.session_table.reservable_pages(session, namespace)
        peer_id, peer_block_ids, peer_epochs = self.peers.candidate(session.session_id, namespace, token_ids)
        if decision is None and (lower_tiers or peer_block_ids):
            decision = self._decide(namespace, local_hit_tokens, result.hit_tokens[Tier.L2],
                                    result.hit_tokens.get(Tier.L3, 0) if lower_tiers else 0, policy,
                                    where="predicted" if recompute else "match",
                                    peer_tokens=len(peer_block_ids) * page_size,
                                    remote_tokens=remote_tokens if lower_tiers else 0)
            if decision.choice == "remote" and allowed > 0 and not recompute:
                move = self.tiering.plan_remote_move(namespace, result, token_ids, remote_tokens // page_size, allowed)
                if move is not None:
                    move.decision = decision
                    return move
            if decision.choice == "l3" and allowed > 0 and not recompute:
                start_page = result.hit_tokens[Tier.L2] // page_size
                move = self.tiering.plan_move(namespace, result, token_ids, Tier.L3, Tier.L2, start_page,
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
        self.metrics.add(counters.ACQUIRES, model=model)
        self.metrics.add(counters.ACQUIRE_TOKENS, num_pages * page_size, model=model)
        self.metrics.add(counters.HIT_TOKENS, hit_tokens, "l2", model=model)
        if Tier.L3 in result.hit_tokens:
            self.metrics.add(counters.HIT_TOKENS, result.hit_tokens[Tier.L3], "l3", model=model)

        # Lock the hit before reserving: the reservation may evict, and must not evict our own hit.
        if locked_node is not None:
            namespace.tree.lock(locked_node, Tier.L2)
        reserved_page_ids: list[int] = []
        reserved_generation = 0
        save_skipped = ""
        if request.save and num_pages > hit_pages and lower_tiers and allowed > 0 and \
                self._save_evicted_before_reuse(namespace, result, decision, policy,
                                                min(num_pages - hit_pages, allowed)):
            save_skipped = "evicted_before_reuse"
            self.metrics.add(counters.EVICTED_BEFORE_REUSE_SKIPS)
        elif request.save and num_pages > hit_pages:
            wanted = num_pages - hit_pages
            if wanted > allowed:
                self.metrics.add(counters.RESERVATIONS_CAPPED)
            reserved_page_ids = self.pool.reserve_l2(namespace, min(wanted, allowed)) if allowed > 0 else []
            if reserved_page_ids:
                reserved_generation = next(self._generation_ids)
                namespace.generations.reserve(reserved_page_ids, reserved_generation)
            self.metrics.add(counters.RESERVED_PAGES, len(reserved_page_ids))
        if session.session_id in self.peers.by_session:
            hits["peer"] = len(peer_block_ids) * page_size
            self.metrics.add(counters.HIT_TOKENS, hits["peer"], "peer", model=model)
        lease_id = None
        if locked_node is not None or reserved_page_ids:
            lease = self.session_table.grant(session, namespace,
                                             token_ids[: (hit_pages + len(reserved_page_ids)) * page_size],
                                             locked_node, hit_pages, reserved_page_ids, reserved_generation)
            lease_id = lease.lease_id
        return AcquireReply(hits, lease_id, host_page_ids, namespace.generations.published_of(host_page_ids),
                            reserved_start_token=hit_tokens, reserved_page_ids=reserved_page_ids,
                            reserved_generation=reserved_generation, save_skipped=save_skipped,
                            promoted_tokens=promoted_tokens, peer_id=peer_id, peer_block_ids=peer_block_ids,
                            peer_epochs=peer_epochs, **decided)

    def _decided(self, decision: Decision, policy: str, loadable_tokens: int) -> dict[str, Any]:
        """A decision's reply fields (choice, restore_tokens, predicted_s, policy). An acquire's
        reply names no more tokens to restore from L2 or L3 than its lease can load
        (``loadable_tokens``): a promotion may have failed, been cut to the session's allowance,
        or found no room."""
        if not decision.choice:
            return {}
        if decision.choice in ("l2", "l3", "remote"):
            decision = decision._replace(restore_tokens=min(decision.restore_tokens, loadable_tokens))
        return {**decision._asdict(), "policy": policy or self.cost.policy}

    def lookup(self, request: Lookup, remote_tokens: int = 0) -> LookupReply:
        """The hit per tier of a prefix, changing nothing: no lease, no lock, no reservation, no
        LRU update, and no page ids (they are only ever handed out under a lease). It carries the
        cost model's decision (under ``policy``) for the tokens beyond the engine's own
        ``local_hit_tokens``; without prefetch, L3 is no candidate.

        With tp_group, the hit of the session's tensor-parallel group: per tier, the least over
        the namespaces of every rank (the same geometry but for tp_rank); 0 while a rank has none.
        A prefix counts as cached only where every rank holds its shard. ``remote_tokens``: as for
        ``acquire``, a candidate with prefetch."""
        session = self.session(request.session_id)
        geometry = self.namespaces[session.namespace_id].geometry
        token_ids = token_array(request.token_ids)
        token_ids = token_ids[: page_aligned(len(token_ids), geometry.page_size)]
        local_hit_tokens = page_aligned(min(request.local_hit_tokens, len(token_ids)), geometry.page_size)
        if request.tp_group:
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
                             for tier, count in namespace.tree.match(token_ids, touch=False, split=False).hit_tokens.items()}
            hits = rank_hits if hits is None else {label: min(hits[label], rank_hits.get(label, 0))
                                                   for label in hits}
        assert hits is not None
        peer_tokens = 0
        if not request.tp_group and session.session_id in self.peers.by_session:
            # Tokens another engine's GPU cache can give (a candidate beside the tiers; no block ids
            # in a lookup: the acquire that takes the lease names them).
            namespace = self.namespaces[session.namespace_id]
            peer_tokens = len(self.peers.candidate(session.session_id, namespace, token_ids)[1]) * geometry.page_size
            hits["peer"] = peer_tokens
            self.metrics.add(counters.LOOKUP_HIT_TOKENS, hits["peer"], "peer", model=geometry.model_id)
        self.metrics.add(counters.LOOKUPS, model=geometry.model_id)
        self.metrics.add(counters.LOOKUP_TOKENS, len(token_ids), model=geometry.model_id)
        self.metrics.add(counters.LOOKUP_HIT_TOKENS, hits["l2"], "l2", model=geometry.model_id)
        if remote_tokens and request.prefetch and not request.tp_group:
            hits["remote"] = remote_tokens
            self.metrics.add(counters.LOOKUP_HIT_TOKENS, remote_tokens, "remote", model=geometry.model_id)
        else:
            remote_tokens = 0
        decision = self._decide(self.namespaces[session.namespace_id], local_hit_tokens, hits["l2"],
                                hits.get("l3", 0) if request.prefetch else 0, request.policy, where="lookup",
                                peer_tokens=peer_tokens, remote_tokens=remote_tokens)
        return LookupReply(hits, decision.choice, decision.restore_tokens, decision.predicted_s,
                           request.policy or self.cost.policy)

    def peek(self, token_ids: np.ndarray, model_id: str | None = None, cache_salt: str = "",
             geometry: KVGeometry | None = None) -> list[PrefixHits]:
        """For routers that ask (POST /lookup): the hit per tier of a prefix in every namespace of
        ``model_id`` whose salt is ``cache_salt``, or in the namespace of ``geometry``. Needs no
        session and changes nothing a request could see: no lease, lock, reservation, LRU touch,
        decision or count, nor the tree's shape."""
        if geometry is not None:
            namespace = self.geometry_to_namespace.get(geometry)
            namespaces = [namespace] if namespace is not None else []
        else:
            namespaces = [ns for ns in self.namespaces.values()
                          if ns.geometry.model_id == model_id and ns.geometry.cache_salt == cache_salt]
        found = []
        for namespace in namespaces:
            page_size = namespace.geometry.page_size
            path = token_ids[: page_aligned(len(token_ids), page_size)]
            result = namespace.tree.match(path, touch=False, split=False)
            ask = self.tiering.remote_ask_after(namespace, path, result) if self.remote_enabled else None
            found.append(PrefixHits(namespace.namespace_id, namespace.geometry,
                                    {tier.label: count for tier, count in result.hit_tokens.items()}, ask))
        return found

    def promote_in_background(self, session_id: int, token_bytes: bytes,
                              looked_up: LookupReply | AcquireReply) -> TierMove | None:
        """After a lookup or acquire (of this session, for these tokens) whose decision declined an L3 hit: the
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
        return self.tiering.promote_in_background(namespace, token_bytes,
                                                  self.session_table.reservable_pages(session, namespace))

    def _save_evicted_before_reuse(self, namespace: Namespace, result, decision: Decision | None, policy: str,
                                     wanted: int) -> bool:
        """Whether a save of this path (``wanted`` pages; L3 a candidate of the acquire's decision)
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
            return False            # L3 holds nothing beyond the L2 hit: the save writes new pages
        last_used = result.previous_access.get(Tier.L3)
        if last_used is None:
            return False
        if self.pool.free_room(namespace, Tier.L2) >= wanted:
            return False
        oldest = namespace.tree.oldest_evictable_access(Tier.L2)
        return oldest is not None and last_used < oldest

    def _busy_namespace_ids(self) -> set[int]:
        """Namespaces not idle without a session: a move or remote write pending, or pages
        quarantined (a stale writer may still write them)."""
        return self.tiering.busy_namespace_ids() | {q.session.namespace_id for q in self.quarantines.values()}

    def _held_page_ids(self, namespace: Namespace, tier: Tier) -> list[int]:
        """The namespace's pages in the tier that are private (leases, pending moves) or quarantined."""
        held = self.tiering.held_page_ids(namespace, tier)
        return held + self.session_table.held_page_ids(namespace) if tier is Tier.L2 else held

    def release(self, request: Release) -> None:
        self.session_table.release(request.session_id, request.lease_id)

    def commit(self, request: Commit) -> tuple[CommitReply, TierMove | None]:
        """Publish the written reserved pages (a prefix of the lease's reservation) and end the lease.

        Also returns the write-through of the committed path to L3, when there is one to run."""
        session_id, lease_id, host_page_ids = request.session_id, request.lease_id, request.page_ids
        self.session_table.count_commit_of_ended(session_id)
        _, lease = self.session_table.lease_of(session_id, lease_id)
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
        self.session_table.end_lease(lease, LeaseState.COMMITTED)
        self.metrics.add(counters.LEASES_COMMITTED)
        self.metrics.add(counters.COMMITTED_PAGES, new_pages, model=namespace.geometry.model_id)
        self.metrics.add(counters.DUPLICATE_PAGES, duplicates)
        write_through = self.tiering.plan_write_through(namespace, path_tokens) if host_page_ids else None
        if host_page_ids and new_pages and self.remote_enabled:
            self.tiering.plan_remote_write(namespace, path_tokens, lease.hit_pages)
        return CommitReply(new_pages, duplicates), write_through

    # ---- peer restores (kvcached/core/residency.py) --------------------------------------------

    def peer_register(self, session_id: int, request: PeerRegister) -> PeerExport:
        """Register the session's KV tensors for engines of its namespace to copy blocks from. Not
        listed until ``peer_ready`` names its epoch file (the I/O layer makes it)."""
        return self.peers.register(self.session(session_id), request)

    def peer_ready(self, export: PeerExport, epochs_path: str, epochs_offset_bytes: int) -> None:
        export.epochs_path, export.epochs_offset_bytes = epochs_path, epochs_offset_bytes

    def peer_unregister(self, session_id: int) -> None:
        """Undo a registration whose epoch file could not be made (its session lives on)."""
        self.peers.end(session_id, notify=False)

    def peer_publish(self, session_id: int, request: PeerPublish) -> None:
        """What entered and left the session's GPU cache: removals first, then each run."""
        self.session(session_id)
        self.peers.publish(session_id, request)

    def peer_list(self, session_id: int) -> list[dict[str, Any]]:
        """The registrations the session may open (none unless it registered itself)."""
        self.session(session_id)
        return self.peers.list_for(session_id)

    # ---- tiering (tiering.py) -----------------------------------------------------------------

    def remote_namespace_key(self, namespace: Namespace) -> str:
        return self.tiering.remote_namespace_key(namespace)

    def remote_ask(self, session_id: int, token_bytes: bytes) -> RemoteAsk | None:
        """Which pages to ask the remote store about for this prompt: those after its L2 hit, when L3
        holds no more than L2 (a longer local L3 hit is restored from L3, and the store is not
        asked); None when there is nothing to ask. Changes nothing."""
        if not self.remote_enabled:
            return None
        session = self.session(session_id)
        namespace = self.namespaces[session.namespace_id]
        token_ids = token_array(token_bytes)
        page_size = namespace.geometry.page_size
        num_pages = len(token_ids) // page_size
        result = namespace.tree.match(token_ids[: num_pages * page_size], touch=False, split=False)
        return self.tiering.remote_ask_after(namespace, token_ids, result)

    def finish_remote_write(self, write: RemoteWrite, num_sent: int) -> None:
        self.tiering.finish_remote_write(write, num_sent)

    def pending_moves(self, direction: str) -> int:
        return self.tiering.pending_moves(direction)

    def finish_move(self, move: TierMove, ok: bool, skipped: bool = False) -> int:
        return self.tiering.finish_move(move, ok, skipped)

    def _publishes_events(self, geometry: KVGeometry) -> bool:
        return self.namespace_table.publishes_events(geometry)

    # ---- the persistent L3 index (l3_persistence.py) ------------------------------------------

    def restore_l3(self, saved: list[SavedNamespace], l3_bytes_kept: int) -> int:
        """At start, before any engine attached: rebuild the namespaces of a persistent L3 index
        (``L3Persistence.restore``). Returns the number of L3 pages restored."""
        return self.l3.restore(saved, l3_bytes_kept, self.pool, self.namespace_table.create, self.geometry_to_namespace,
                               self.max_namespaces)

    # ---- integrity and status -------------------------------------------------------------

    def check_integrity(self) -> None:
        integrity.check_integrity(self)

    def status(self) -> dict[str, Any]:
        return snapshot.status(self)

