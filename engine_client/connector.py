"""The engine connector: an engine keeps its own KV tensors; kvcached loads and saves its blocks.

Shaped like vLLM's KV-connector v1, per scheduler step and never waiting on the host:

    connector = KVConnector.register(client, kv_caches, "layer", model_id=..., page_size=16, ...)
    n = connector.lookup(token_ids, local_hit_tokens=h) # side-effect free; the daemon's decision: hold
                                                        # n leading tokens (restore [h, n)), recompute the rest
    ... the engine allocates its own blocks for the request ...
    connector.load(rid, token_ids, block_ids, n)        # queued: a match takes the lease, the DMA and
                                                        # scatter follow its reply (poll)
    connector.poll()                                    # once per step: replies in, transfers queued
    connector.finished().loads                          # LoadResult per load: loaded or failed blocks
    connector.finished().queued                         # or earlier: its copies are queued, and
    connector.wait_for_layer_load(layer, None, [rid])   # the engine's stream waits for layer i alone
    ... prefill the rest ...
    connector.save(rid, token_ids, block_ids, start)    # the new full blocks, queued
    if connector.request_finished(rid): ...             # True: keep the blocks until finished().released

The daemon decides, at the lookup, whether restoring beats recomputing (its cost model: the
lookup's ``decision()`` has the chosen source and the predicted costs); the connector feeds that
model: each transfer's time (CUDA events; no host wait) and the engine's prefill times
(``report_prefill``) go to the daemon with the periodic report.

An engine whose scheduler holds the connector may instead ``begin(rid, token_ids, hit)``: a
lookup that is the request's match (the decision, the lease and the reservation in one round trip),
so that its ``load`` queues the copies at the call, a round trip sooner. Where the daemon's
admission hints (``engine_client.hints``, read from shared memory) show that it would decline every
restore of the request (no L2 hit, no peer, no L3 hit long enough to win), ``begin``'s lookup is
ready at once with "recompute": the engine admits the request with no round trip. Its match
(``recompute``) is sent by the request's next connector call (its save, or a poll), which an
engine makes once its forward is launched: the send, and the reply that brings the save's
reservation, take the host while the GPU runs, not between admission and launch. A stale hint
costs at most a restore not taken, never a wrong byte: loads only ever read under a lease.

One lease per request. The request's first load or save sends one match with a reservation
(``MATCH(reserve_backup)``): it locks the L2 hit (what a load reads) and reserves private L2 pages
for the pages the daemon lacks (what saves write). The replies of a step's matches are collected by
``poll`` in one sweep, so a step costs one round trip at most, and nobody waits for it. When the
request is finished and its transfers are done, the written pages are committed (``BACKUP_COMMIT``,
which ends the lease) or, with none written, the lease is released.

Loads go layer by layer (``engine_client.kv_transfer``), an event per layer: a prefill may start
once ``finished().queued`` names its load, its attention of layer i waiting (on the GPU) for layer
i alone while later layers are still copied; the load's entry in ``finished().loads`` then confirms
what it read (or, rarely, voids it: see Fencing).

Fencing (``proto.generations``). A save copies only into the pages it claims at the copy (those
the daemon still reserves for its lease's generation) and stamps them once the copy is complete; a
load copies a page only while it holds the generation the daemon published it with, and keeps it
only if it still does once the copy is seen complete: a page rewritten (or given to another
writer) meanwhile is reported failed, to be recomputed (``stale_generation``). No time margin is
asked of the session: a stall anywhere costs at most a miss.

Nothing is skipped silently: a page a save could not write, or a load could not fill, is counted
by cause (``stats()``), logged once per cause, and reported to the daemon, whose status shows it.
While the daemon is down (``DaemonDown``: the client logs each outage once) requests skip it at
once, counted under ``daemon_down``.

Re-attach. When the client attaches a new session (the daemon restarted, or ended the old one),
the new session's L2 pool is mapped and pinned on a thread of its own; ``poll`` swaps it in once
no transfer is in flight. The ended session's pool is unmapped sooner, a one-page placeholder
taking its place (a restarted daemon needs its room in /dev/shm): as soon as the client learns
that the session surely ended (its session-end listener, on the heartbeat thread: an engine that
makes no call frees it too) if no copy into or out of it is being queued or in flight, else by
the call that ends the last such copy. Until then new requests skip the daemon, and a request of
the ended session moves nothing and ends nothing: its pages and lease went with it. While the
client is down, the drop or ``poll`` says when nothing writes the ended session's pages any more
(``KVCacheClient.mark_drained``), so that the re-attach lets the daemon free them.

Peer restores (``ConnectorConfig.peer``, ``engine_client/peer.py``): the engine's tensors are
registered for other engines on its GPU to copy from; the engine says which blocks it is about to
write (``will_write_blocks``) and which hold a prompt's pages (``blocks_cached``), published at
``poll``. A match whose decision is "peer" (another engine's blocks, priced by the daemon's cost
model against L2, L3 and recompute) loads from them, GPU to GPU, each copy's time a "d2d" sample;
blocks that engine changed during the copy are reported failed (``peer_changed``).

Tensor parallelism: each rank registers its own shard (its ``tp_rank``, its own namespace) and
moves only that; ``lookup`` answers for the whole group (the daemon takes the least hit over the
ranks), so a prefix counts as cached only where every rank holds its shard. A rank whose own hit
is shorter than asked loads what it has and reports the rest failed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Hashable, Iterable, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from engine_client.client import DaemonDown, DaemonError, DaemonUnavailable, KVCacheClient, PendingMatch
from engine_client.engine_api import Finished, LoadResult
from engine_client.hints import HintsView
from engine_client.kv_transfer import DEFAULT_WORKSPACE_BYTES, KVTransfer, Transfer
from engine_client.layout import KVLayout, describe_layout
from engine_client.peer import PeerCopy, PeerError, PeerPlan, PeerSharing, share_host_tensors
from engine_client.shared_pool import SharedHostPool
from proto import counters
from proto.counters import Counts
from proto.errors import ErrorCode
from proto.messages import RESTORE_POLICIES, KVGeometry
from proto.replies import NO_DECISION, AttachInfo, Decision
from proto.schema import MAX_COST_SAMPLES
from proto.tokens import page_aligned, token_array, token_bytes

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    save: bool = True                  # reserve L2 pages for each request's new blocks, and save them
    promote_l3: bool = True            # a load's match first brings pages only L3 holds into L2
    backend: str = "auto"              # gather/scatter: "auto" (timed on CUDA; torch on CPU), "triton", "torch"
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES     # packed device buffer, per direction
    reply_timeout_s: float = 5.0       # a match unanswered this long is given up (loads fail, saves skip)
    report_interval_s: float = 1.0     # how often changed counters (and timings) go to the daemon
    policy: str = ""                   # restore policy: "cost", "always", "never" ("": the daemon's)
    # Loads go group by group of layers, so that wait_for_layer_load waits for a layer's group
    # alone (engines whose prefill runs while a load is in flight); False: every load whole, the
    # fewest host calls (engines that wait for a load's result). A load under layered_min_bytes
    # goes whole anyway: queueing it group by group would take the host about as long as its DMA.
    layered_loads: bool = True
    layered_min_bytes: int = 64 << 20
    # Peer restores (engine_client/peer.py): register this engine's KV tensors for other engines of
    # the namespace on its device to copy from, and load a prefix from theirs when the daemon's
    # decision chooses another engine's GPU cache (asynchronous loads only; one tensor-parallel
    # rank only).
    peer: bool = False
    # ``begin`` answers "recompute" at once where the daemon's admission hints show it would
    # decline every restore (no round trip before the request's prefill); False: always wait.
    predict: bool = True


class RequestLease(NamedTuple):
    """What a request's match gave it (``KVConnector.wait_for_match``)."""

    lease_id: int | None               # None: nothing leased (nothing hit or reserved, or no match)
    hit_tokens: int                    # leading tokens its loads can fill: the L2 hit (L3 promotions in)
    host_page_ids: np.ndarray          # the hit's L2 pages, locked by the lease
    reserved_page_ids: np.ndarray      # private L2 pages its saves write, pages hit_tokens // page_size on
    failure: str | None                # why the match failed (None when it did not)


# Timings go to the daemon this soon (with a report), so that its cost model decides on fresh ones.
COST_REPORT_INTERVAL_S = 0.1


# A lookup's answer: the decision, and the leading tokens each tier holds (the reply's hit_tokens).
_NO_ANSWER: tuple[Decision, dict[str, int]] = (NO_DECISION, {})


class PendingLookup:
    """A lookup sent; ``result()`` is the number of leading tokens to hold once restored: the
    daemon's decision (0 on any failure); ``decision()`` the whole of it; ``hit_tokens()`` what
    each tier holds."""

    def __init__(self, lookup: "PrefixLookup", pending: PendingMatch | None):
        self._lookup = lookup
        self._pending = pending
        self._answer: tuple[Decision, dict[str, int]] | None = None if pending is not None else _NO_ANSWER

    def ready(self) -> bool:
        if self._answer is not None:
            return True
        try:
            return self._pending.ready()
        except (DaemonUnavailable, RuntimeError):
            return True

    def wait(self, timeout_s: float) -> bool:
        """Wait at most timeout_s for the reply; True once it is in (or the lookup failed)."""
        if self._answer is not None:
            return True
        try:
            return self._pending.wait(timeout_s)
        except (DaemonUnavailable, RuntimeError):
            return True

    def result(self, timeout_s: float | None = None) -> int:
        return self.decision(timeout_s).restore_tokens

    def cancel(self) -> None:
        """Give the lookup up (its reply, if it comes, is dropped); result() is 0 from now on."""
        if self._answer is None:
            self._pending.cancel()
            self._answer = _NO_ANSWER

    def give_up(self, waited_s: float) -> None:
        """cancel() a lookup whose reply did not come in time: counted (lookup_failures_no_reply)
        and logged once."""
        if self._answer is None:
            self._lookup._failed("no_reply", DaemonUnavailable(f"no reply to a lookup within {waited_s:.1f} s"))
            self.cancel()

    def decision(self, timeout_s: float | None = None) -> Decision:
        return self._answered(timeout_s)[0]

    def hit_tokens(self, timeout_s: float | None = None) -> dict[str, int]:
        """The leading tokens each tier holds ({} on any failure)."""
        return self._answered(timeout_s)[1]

    def _answered(self, timeout_s: float | None) -> tuple[Decision, dict[str, int]]:
        if self._answer is None:
            self._answer = self._lookup._answer_of(self._pending, timeout_s)
        return self._answer


class BegunLookup:
    """``KVConnector.begin``'s lookup: the request's match, read as a lookup (``PendingLookup``'s
    calls); its decision is the match reply's."""

    def __init__(self, connector: "KVConnector", request: "_Request", local_hit_tokens: int = 0):
        self._connector = connector
        self._request = request
        self._cancelled = False
        self._counted = False
        self._local_hit_tokens = local_hit_tokens

    def ready(self) -> bool:
        request = self._request
        if request.predicted:
            return True             # the decision needs no reply (the connector's polls take it)
        if request.match is not None:
            self._connector._take_reply(request)
        return request.match is None

    def wait(self, timeout_s: float) -> bool:
        """Wait at most timeout_s for the reply; True once it is in (or the match failed, or the
        decline was predicted: the decision needs no reply)."""
        request = self._request
        if request.match is not None and not request.predicted:
            try:
                request.match.wait(timeout_s)
            except (DaemonUnavailable, RuntimeError):
                pass
        return self.ready()

    def result(self, timeout_s: float | None = None) -> int:
        return self.decision(timeout_s).restore_tokens

    def decision(self, timeout_s: float | None = None) -> Decision:
        return self._answered(timeout_s)[0]

    def hit_tokens(self, timeout_s: float | None = None) -> dict[str, int]:
        """The leading tokens each tier holds, by the match reply ({} without one: failed, or a
        predicted decline)."""
        return self._answered(timeout_s)[1]

    def _answered(self, timeout_s: float | None) -> tuple[Decision, dict[str, int]]:
        request = self._request
        if request.predicted and not self._cancelled:
            if not self._counted:
                self._counted = True
                self._connector.counters.add(counters.ENGINE_LOOKUP_CHOICES, 1, "recompute")
            return Decision("recompute", self._local_hit_tokens), {}
        if request.match is not None and not self._cancelled:
            self._connector._take_reply(request, self._connector.config.reply_timeout_s if timeout_s is None
                                        else timeout_s)
        if request.failure is not None and not self._cancelled:
            self.cancel()           # ended: a later save opens a request (and a match) of its own
        if self._cancelled or request.failure is not None or request.decision is None:
            return _NO_ANSWER
        if not self._counted:
            self._counted = True
            counts = self._connector.counters
            counts.add(counters.ENGINE_LOOKUP_CHOICES, 1, request.decision.choice)
            counts.add(counters.ENGINE_LOOKUP_HIT_TOKENS, request.decision.restore_tokens)
        return request.decision, request.tier_hit_tokens

    def cancel(self) -> None:
        """Give the request up: it ends (its lease once the reply is in); result() is 0 from now on."""
        if not self._cancelled:
            self._cancelled = True
            request = self._request
            if request.match is not None:       # given up, not failed: a late reply's lease is
                request.match.cancel()          # released by the client
                request.match, request.failure = None, "given_up"
            if self._connector._requests.get(request.request_id) is request:    # not ended by the engine
                self._connector.request_finished(request.request_id)

    def give_up(self, waited_s: float) -> None:
        """cancel() a match whose reply did not come in time, counted (lookup_failures_no_reply)."""
        if not self._cancelled and self._request.match is not None and not self._request.predicted:
            self._connector.lookups._failed("no_reply",
                                            DaemonUnavailable(f"no reply to a lookup within {waited_s:.1f} s"))
        self.cancel()


class PrefixLookup:
    """Side-effect-free lookups of a namespace (or of its whole tensor-parallel group): no lease,
    no lock, no LRU update. Usable alone by a scheduler process that holds no KV tensors (attach a
    client with any rank's geometry)."""

    def __init__(self, client: KVCacheClient, *, tp_group: bool, promote_l3: bool = True, policy: str = ""):
        self.client = client
        self.tp_group = tp_group
        self.promote_l3 = promote_l3
        self.policy = policy
        self.counters = Counts(counters.ENGINE)

    def lookup_async(self, token_ids: Sequence[int] | np.ndarray, local_hit_tokens: int = 0) -> PendingLookup:
        """``local_hit_tokens``: leading tokens the engine holds itself; the daemon decides for the rest."""
        self.counters.add(counters.ENGINE_LOOKUPS)
        try:
            pending = self.client.lookup_async(token_ids, tp_group=self.tp_group, local_hit_tokens=local_hit_tokens,
                                               policy=self.policy, promote_l3=self.promote_l3)
            return PendingLookup(self, pending)
        except DaemonDown:                  # the client logs the outage once
            self.counters.add(counters.ENGINE_LOOKUP_FAILURES, 1, "daemon_down")
            return PendingLookup(self, None)
        except DaemonUnavailable as exc:
            self._failed("unavailable", exc)
            return PendingLookup(self, None)

    def lookup(self, token_ids: Sequence[int] | np.ndarray, timeout_s: float | None = None,
               local_hit_tokens: int = 0) -> int:
        """How many leading tokens of token_ids to hold once restored, by the daemon's decision:
        whole pages, ``local_hit_tokens`` or less when nothing beyond it is worth restoring (0 when
        the daemon is away)."""
        return self.lookup_async(token_ids, local_hit_tokens).result(timeout_s)

    def _answer_of(self, pending: PendingMatch, timeout_s: float | None) -> tuple[Decision, dict[str, int]]:
        try:
            reply = pending.result(timeout_s)
        except DaemonDown:
            self.counters.add(counters.ENGINE_LOOKUP_FAILURES, 1, "daemon_down")
            return _NO_ANSWER
        except DaemonUnavailable as exc:
            self._failed("unavailable", exc)
            return _NO_ANSWER
        except DaemonError as exc:
            self._failed("refused", exc)
            return _NO_ANSWER
        self.counters.add(counters.ENGINE_LOOKUP_CHOICES, 1, reply.choice)
        self.counters.add(counters.ENGINE_LOOKUP_HIT_TOKENS, reply.restore_tokens)
        return reply.decision, reply.hit_tokens

    def _failed(self, cause: str, exc: Exception) -> None:
        if not self.counters.value(counters.ENGINE_LOOKUP_FAILURES, cause):
            logger.warning("lookup failed (counted as %s, reported once): %s",
                           self.counters.key_of(counters.ENGINE_LOOKUP_FAILURES, cause), exc)
        self.counters.add(counters.ENGINE_LOOKUP_FAILURES, 1, cause)


# ---- per request --------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Load:
    request_id: Hashable
    start_page: int
    block_ids: np.ndarray
    after: Any                          # the caller's stream event at load()
    synchronous: bool
    transfer: Transfer | None = None
    num_pages_queued: int = 0
    session_id: int | None = None
    queued: bool = False
    reason: str | None = None           # why pages beyond num_pages_queued are not loaded
    peer_copy: PeerCopy | None = None   # loaded from another engine's blocks, checked at completion


@dataclasses.dataclass(eq=False)
class _Save:
    first_page: int
    block_ids: np.ndarray               # block of page first_page + i
    after: Any
    transfer: Transfer | None = None
    reserve_indices: np.ndarray | None = None  # which pages of the request's reservation it writes
    session_id: int | None = None
    queued: bool = False


class _Unsent(NamedTuple):
    """The match of a request whose send is deferred (a predicted decline): its arguments to
    ``match_async``, sent by ``KVConnector._take_reply``. No reply is in."""
    arguments: dict

    def cancel(self) -> None:
        """Nothing was sent: nothing to give up."""


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: Hashable
    token_ids: np.ndarray               # int32, whole pages: what the lease covers
    match: PendingMatch | _Unsent | None
    match_sent_at: float
    failure: str | None = None          # the match failed: why (loads fail, saves skip with it)
    session_id: int | None = None
    lease_id: int | None = None
    hit_pages: int = 0
    host_page_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))
    reserved: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))
    written: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, bool))
    queued: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, bool))
    loads: list[_Load] = dataclasses.field(default_factory=list)
    saves: list[_Save] = dataclasses.field(default_factory=list)
    finished: bool = False
    hold_blocks: bool = False           # request_finished returned True, and finished() has not released it
    peer_plan: PeerPlan | None = None   # its loads copy from another engine's GPU cache
    decision: Decision | None = None    # the match reply's (the cost model's, where it asked)
    tier_hit_tokens: dict[str, int] = dataclasses.field(default_factory=dict)   # the match reply's hit_tokens
    predicted: bool = False             # begun on a predicted decline: recomputed whatever the reply says
    backup_skipped: str = ""            # why the daemon reserved no pages for its saves (the reply's)
    host_page_generations: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.uint64))
    generation: int = 0                 # its saves' write generation (the reply's backup_generation)


# ---- the connector ------------------------------------------------------------------------------


def _open_pool(layout: KVLayout, geometry: KVGeometry, info: AttachInfo) -> SharedHostPool:
    """Map a session's L2 pool; on CUDA pin it for the device of the engine's tensors."""
    is_cuda = layout.device.type == "cuda"
    return SharedHostPool.open(info.shm_path, info.arena_offset_bytes, info.num_pages, geometry,
                               pin=is_cuda, device=layout.device if is_cuda else None,
                               generations_path=info.generations_path)


def _placeholder_pool(layout: KVLayout, geometry: KVGeometry) -> SharedHostPool:
    """One page of this process's own memory in place of a session's pool, while there is none
    (before the first attach, or once the ended session's pool is dropped): no transfer uses it,
    since no request has a lease or reserved pages without a session."""
    fd = os.memfd_create("kvcached-no-session", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, geometry.bytes_per_page)
        is_cuda = layout.device.type == "cuda"
        return SharedHostPool.open(f"/proc/self/fd/{fd}", 0, 1, geometry, pin=is_cuda,
                                   device=layout.device if is_cuda else None)
    finally:
        os.close(fd)


class _NoSession(NamedTuple):
    """``KVConnector._session`` while no session's pool is mapped (before the first attach, or once
    the ended session's pool is dropped): requests made then belong to no session."""

    session_id: None = None
    shm_path: str = ""
    hints_path: str = ""


class KVConnector:
    """One engine rank's connector to the daemon; see the module note. Not thread-safe: one
    scheduler thread calls it."""

    def __init__(self, client: KVCacheClient, layout: KVLayout, geometry: KVGeometry, host_pool: SharedHostPool,
                 transfer: KVTransfer, config: ConnectorConfig, counts: Counts | None = None,
                 peer: PeerSharing | None = None):
        self.client = client
        self.layout = layout
        self.geometry = geometry
        self.page_size = geometry.page_size
        self.host_pool = host_pool
        self.transfer = transfer
        self.config = config
        self.peer = peer
        self.lookups = PrefixLookup(client, tp_group=geometry.tp_size > 1, promote_l3=config.promote_l3,
                                    policy=config.policy)
        self.counters = counts if counts is not None else Counts(counters.ENGINE)
        # Timings kept for the daemon while it cannot be told (oldest dropped first): what one report carries.
        self._cost_samples: collections.deque[tuple[str, int, float]] = collections.deque(maxlen=MAX_COST_SAMPLES)
        self._requests: dict[Hashable, _Request] = {}      # open, by id: not finished yet
        # Finished, their leases not ended yet (transfers in flight, a reply or a commit to come):
        # apart from _requests, so that the engine may reuse the id at once (vLLM resumes a
        # preempted request under its id once its blocks are released).
        self._ending: list[_Request] = []
        self._finished_loads: list[LoadResult] = []
        self._queued_loads: list[LoadResult] = []
        self._released: list[Hashable] = []
        self._sync_loads: list[_Load] = []
        self._reported: dict[str, Any] | None = None
        self._reported_at = 0.0
        self._warned: set[str] = set()
        self._closed = False
        # The session whose pool is mapped (host_pool): every lease and page id in use is its.
        self._generation = client.generation
        self._session: AttachInfo | _NoSession = client.info or _NoSession()
        # host_pool is a placeholder (_placeholder_pool): no session's pool is mapped.
        self._pool_dropped = client.info is None
        # A re-attach's pool, mapped in the background (_open_next_pool), swapped in by poll.
        self._next_lock = threading.Lock()
        self._next_pool: tuple[int, AttachInfo, SharedHostPool] | None = None
        # Ended sessions' pools that a caller's view kept open: closed (unpinned, then unmapped) by
        # a later poll once the view is gone. Dropped instead, a pinned pool would be unmapped by
        # the view's end still registered with CUDA, and a later mapping at its address not pinned.
        self._ended_pools: list[SharedHostPool] = []
        self._remap_threads: list[threading.Thread] = []
        self._hints: HintsView | None = self._open_hints(self._session)
        # The mapped session's memory (host_pool, its generations, _hints) is used by the scheduler
        # thread and may be dropped by another (_on_session_end). _pool_lock guards what says which
        # session's memory is mapped (_generation, _session, host_pool, the transfer's pool, _hints,
        # _pool_dropped), _pool_users (the scheduler's sections that use that memory now: a copy
        # being queued, generations read or stamped; _pool_section) and _pool_transfers (copies
        # queued into or out of it, until seen complete). Held for that bookkeeping only: never
        # across a copy, a wait or a call to the client.
        self._pool_lock = threading.Lock()
        self._pool_users = 0
        self._pool_transfers: set[Transfer] = set()
        # An ended session's generation whose pool a drop found in use: dropped by the section that
        # ends the use, or by the poll that sees the last copy done.
        self._drop_wanted: int | None = None
        client.add_reattach_listener(self._on_reattach)
        client.add_session_end_listener(self._on_session_end)
        self._report(force=True)

    @classmethod
    def register(cls, client: KVCacheClient, kv_caches: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
                 kind: str, *, model_id: str, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: str | None = None, model_revision: str = "", cache_salt: str = "", tp_rank: int = 0,
                 tp_size: int = 1, config: ConnectorConfig = ConnectorConfig()) -> "KVConnector":
        """Describe the engine's KV tensors (``engine_client.layout``), attach ``client`` with the
        namespace they make, map (on CUDA: pin) the L2 pool, and build and warm the transfers.
        The connector owns the client from here on (``close`` closes it).

        A daemon that does not answer the ATTACH, or cannot take the engine (``--max-namespaces``
        reached, shutting down), does not fail the engine: it runs without the cache (one warning;
        every request a miss, counted daemon_down) and the client attaches by itself once the
        daemon takes it (``KVCacheClient.attach_later``); the session's pool is then swapped in
        like a re-attach's."""
        if config.peer:
            share_host_tensors(kv_caches)       # CPU tensors: into shared memory, before their addresses are taken
        layout = describe_layout(kind, kv_caches)
        geometry = layout.geometry(model_id, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                   dtype=dtype, tp_rank=tp_rank, tp_size=tp_size, model_revision=model_revision,
                                   cache_salt=cache_salt)
        try:
            info = client.attach(geometry)
        except (DaemonUnavailable, DaemonError) as exc:
            if isinstance(exc, DaemonError) and exc.code not in (ErrorCode.OUT_OF_SPACE, ErrorCode.SHUTTING_DOWN):
                raise       # a geometry or version the daemon refuses: the engine's own error
            reason = str(exc)       # not the exception: its traceback would keep this frame alive
            logger.warning("running without the kvcached cache for now: %s; the engine attaches by itself "
                           "once the daemon takes it", reason)
            client.attach_later(geometry, reason)
            info = None
        host_pool = _open_pool(layout, geometry, info) if info is not None else _placeholder_pool(layout, geometry)
        try:
            transfer = KVTransfer(layout, host_pool, backend=config.backend, workspace_bytes=config.workspace_bytes)
        except BaseException:
            host_pool.close()
            raise
        counts = Counts(counters.ENGINE)          # the connector's, its peer sharing's too
        peer = None
        if config.peer and tp_size == 1 and info is None:
            logger.warning("peer restores off: the engine runs without the kvcached cache")
        elif config.peer and tp_size == 1:
            try:
                peer = PeerSharing.register(client, layout, transfer, page_size, counts)
            except (PeerError, DaemonUnavailable, DaemonError, OSError) as exc:
                logger.warning("peer restores off: the KV tensors could not be registered: %s", str(exc))
        elif config.peer:
            logger.warning("peer restores off: not with tensor parallelism (tp_size %d)", tp_size)
        try:
            return cls(client, layout, geometry, host_pool, transfer, config, counts, peer)
        except BaseException:       # what was opened here is closed here: a pinned pool unpinned
            if peer is not None:
                peer.close()
            host_pool.close()
            raise

    # ---- lookups ------------------------------------------------------------------------------

    def set_policy(self, policy: str) -> None:
        """The restore policy of the lookups and matches sent from now on: "cost", "always",
        "never", or "" (the daemon's). Those already sent keep theirs: switch it between requests,
        not between a request's lookup and its load (where the load sends the match, its policy
        would be the new one)."""
        if policy and policy not in RESTORE_POLICIES:
            raise ValueError(f"policy must be one of {RESTORE_POLICIES} (or empty: the daemon's), got {policy!r}")
        self.config = dataclasses.replace(self.config, policy=policy)
        self.lookups.policy = policy

    def lookup(self, token_ids: Sequence[int] | np.ndarray, timeout_s: float | None = None,
               local_hit_tokens: int = 0) -> int:
        """Leading tokens of token_ids to hold once restored, for this engine (its whole TP group),
        which holds the first ``local_hit_tokens`` itself: the daemon's decision, whole pages (at
        most local_hit_tokens when restoring does not pay; 0 when the daemon is away). Changes
        nothing; one round trip."""
        return self.lookups.lookup(token_ids, timeout_s, local_hit_tokens)

    def lookup_async(self, token_ids: Sequence[int] | np.ndarray, local_hit_tokens: int = 0) -> PendingLookup:
        """Send a lookup now, collect it later (``ready()``, ``result()``, ``decision()``): a step's
        lookups in one round trip."""
        return self.lookups.lookup_async(token_ids, local_hit_tokens)

    @property
    def can_begin(self) -> bool:
        """Whether ``begin`` may stand for a lookup: one rank (a lookup of a TP group takes the
        least hit over its ranks; a match is one rank's) whose matches ask the cost model."""
        return self.geometry.tp_size == 1 and self.config.promote_l3

    def begin(self, request_id: Hashable, token_ids: Sequence[int] | np.ndarray,
              local_hit_tokens: int = 0) -> "BegunLookup":
        """A lookup that is the request's match: the daemon's decision in the one round trip a
        lookup takes, with the lease on the L2 hit and the reservation for the request's saves.
        Its ``load`` (and ``save``) then send nothing: the copies are queued at the call. An engine
        that decides where a request's tokens come from in its own scheduler process (vLLM) looks
        up instead; this is for one whose scheduler holds the connector (``can_begin``). A request
        given up (``cancel``, or no reply in time: ``give_up``) ends like ``request_finished``."""
        if not self.can_begin:
            raise RuntimeError("begin needs one rank (tp_size 1) and promote_l3")
        self.counters.add(counters.ENGINE_LOOKUPS)
        predicted = request_id not in self._requests and self._predicts_recompute(token_ids, local_hit_tokens)
        if predicted:
            self.counters.add(counters.ENGINE_LOOKUPS_PREDICTED)
        request = self._request(request_id, token_ids, promote_l3=not predicted, local_hit_tokens=local_hit_tokens,
                                begun=True, recompute=predicted, defer=predicted)
        return BegunLookup(self, request, page_aligned(local_hit_tokens, self.page_size))

    def _predicts_recompute(self, token_ids, local_hit_tokens: int) -> bool:
        """Whether the admission hints show that the daemon would decline every restore of these
        tokens beyond the engine's own hit (``engine_client.hints.HintsView.predicts_recompute``)."""
        if self._hints is None or not self.config.predict:
            return False
        tokens = self._tokens(token_ids)
        num_tokens = page_aligned(len(tokens), self.page_size)
        beyond = num_tokens - page_aligned(min(local_hit_tokens, num_tokens), self.page_size)
        with self._pool_lock:       # a few reads of the hints' mapping, which another thread may drop
            hints = self._hints
            return hints is not None and hints.predicts_recompute(
                tokens[:self.page_size].tobytes(), beyond, self.config.promote_l3, self.config.policy,
                peer_registered=self.peer is not None)

    def report_prefill(self, num_tokens: int, seconds: float) -> None:
        """The engine computed num_tokens in a prefill forward of this many seconds: a sample for
        the daemon's cost model (sent with the next report; never waits)."""
        self._cost_samples.append(("prefill", int(num_tokens), float(seconds)))

    # ---- the engine's own GPU cache (peer restores) ---------------------------------------------

    def will_write_blocks(self, block_ids: Sequence[int]) -> None:
        """The engine is about to write these blocks (it allocated them), or drops what they hold:
        call before it queues any work that writes them. Other engines stop copying them. No-op
        without peer restores."""
        if self.peer is not None:
            self.peer.will_write(block_ids)

    def blocks_cached(self, token_ids: Sequence[int] | np.ndarray, block_ids: Sequence[int]) -> None:
        """block_ids[i] holds page i of token_ids (its own GPU prefix cache has them), written by
        the work queued so far on the current stream: other engines may copy them once that work is
        done (published at a later ``poll``). No-op without peer restores."""
        if self.peer is not None:
            self.peer.cached(token_ids, block_ids)

    # ---- loads and saves ---------------------------------------------------------------------

    def load(self, request_id: Hashable, token_ids: Sequence[int] | np.ndarray, block_ids: Sequence[int],
             num_tokens: int, start_token: int = 0, *, asynchronous: bool = True) -> None:
        """Queue the load of tokens [start_token, start_token + num_tokens) of token_ids (whole pages)
        into block_ids (block_ids[i] gets page start_token // page_size + i). Its LoadResult comes
        through ``finished()``; an asynchronous=False load is also waited for by the engine's stream
        in ``wait_for_layer_load``. num_tokens=0 only takes the request's lease (reserving L2 pages
        for its saves)."""
        start_page, num_pages = self._pages(start_token, num_tokens, "load")
        block_ids = self._block_ids(block_ids, num_pages)
        if (start_page + num_pages) * self.page_size > len(token_ids):
            raise ValueError(f"tokens [{start_token}, {start_token + num_tokens}) are beyond the {len(token_ids)} given")
        # The request's match (if this call sends it) may promote what only L3 holds: the daemon's
        # cost model decides, for the tokens beyond those the engine holds (start_token).
        request = self._request(request_id, token_ids, promote_l3=self.config.promote_l3, local_hit_tokens=start_token)
        if request.finished:
            raise ValueError(f"request {request_id!r} is finished: its blocks may be reused already")
        if num_pages:
            load = _Load(request_id, start_page, block_ids, self._caller_event(), not asynchronous)
            request.loads.append(load)
            self.counters.add(counters.ENGINE_LOADS)
            if not asynchronous:
                self._sync_loads.append(load)
        self._advance(request)

    def save(self, request_id: Hashable, token_ids: Sequence[int] | np.ndarray, block_ids: Sequence[int],
             start_token: int = 0) -> None:
        """Queue the save of the full pages of token_ids from start_token on (block_ids[i] holds page
        start_token // page_size + i). The blocks are read after the work queued so far on the
        engine's stream; the engine reuses them once ``request_finished`` says so, or
        ``finished().released`` names the request."""
        tokens = self._tokens(token_ids)
        start_page, _ = self._pages(start_token, 0, "save")
        end_page = len(tokens) // self.page_size
        if end_page < start_page:
            raise ValueError(f"start_token {start_token} is beyond the {len(tokens)} tokens given")
        block_ids = self._block_ids(block_ids, end_page - start_page)
        # A request's first call a save: nothing is loaded, so nothing is promoted for it (the
        # reservation covers what L2 lacks, written from the engine's blocks).
        request = self._request(request_id, tokens, promote_l3=False)
        if request.finished:
            raise ValueError(f"request {request_id!r} is finished: its blocks may be reused already")
        covered = min(len(request.token_ids), end_page * self.page_size)
        if not np.array_equal(request.token_ids[:covered], tokens[:covered]):
            raise ValueError(f"request {request_id!r}: these tokens differ from those its first call gave")
        self.counters.add(counters.ENGINE_SAVES)
        if not self.config.save:
            self._skip(end_page - start_page, "saving_off")
            return
        request.saves.append(_Save(start_page, block_ids, self._caller_event()))
        self._advance(request)

    def request_finished(self, request_id: Hashable) -> bool:
        """The engine is done with the request. True: a transfer may still touch its blocks; keep
        them until ``finished().released`` names it. Its lease ends once its transfers are done."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._finish(request)
        self._advance(request)
        if self._requests.get(request_id) is not request:
            return False
        del self._requests[request_id]
        self._ending.append(request)
        request.hold_blocks = self._touches_blocks(request)
        return request.hold_blocks

    def poll(self) -> None:
        """Take in the daemon's replies, queue the transfers they allow, see which are done, end
        the leases of finished requests; after a re-attach, swap in the new session's pool once it
        is mapped. Never waits."""
        for request in self._all_requests():
            self._advance(request)
        self._follow_session()
        if self._ended_pools:
            self._close_ended_pools()
        if self.peer is not None:
            self.peer.poll()
        self._count_refusals(self.client.poll_errors())
        self._report()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the daemon has handled every commit and release sent so far (so that another
        engine sees them). A host wait: for tests, benchmarks and shutdown, not a scheduler step."""
        try:
            self._count_refusals(self.client.flush(timeout_s))
        except DaemonUnavailable as exc:
            self._warn_once("flush_failed", f"could not flush: {exc}")

    def _count_refusals(self, errors) -> None:
        for error in errors:
            self.counters.add(counters.ENGINE_REFUSALS, 1, getattr(error.kind, 'name', 'request').lower())
            if error.code != ErrorCode.NOT_ATTACHED:    # sent for a session that ended since: the
                logger.warning("the daemon refused a request: %s", error)   # end was logged already

    def finished(self) -> Finished:
        """Loads completed (or failed) and requests released since the last call; polls first."""
        self.poll()
        loads, self._finished_loads = self._finished_loads, []
        released, self._released = self._released, []
        queued, self._queued_loads = self._queued_loads, []
        return Finished(loads, released, queued)

    def wait_for_layer_load(self, layer: int, stream: torch.cuda.Stream | None = None,
                            request_ids: Iterable[Hashable] | None = None) -> None:
        """Make ``stream`` (default: the current one) wait until ``layer`` of the blocks of some
        loads is written: of the loads of ``request_ids`` not yet reported, or (None) of the
        synchronous loads (load(..., asynchronous=False)) not yet reported. No host wait for the
        copies: the stream waits on the layer's event, while the later layers are still copied. A
        load whose match has no reply yet is waited for here, on the host (bounded by
        reply_timeout_s): wait on a load once ``finished().queued`` named it, or issue it a step
        ahead, to avoid that."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer must be in [0, {self.layout.num_layers}), got {layer}")
        if request_ids is None:
            loads = list(self._sync_loads)
        else:
            loads = [load for request_id in request_ids if request_id in self._requests
                     for load in self._requests[request_id].loads]
        for load in loads:
            request = self._requests.get(load.request_id)
            if request is not None and not load.queued:
                self._take_reply(request, self.config.reply_timeout_s)
                self._advance(request)
        if self.layout.device.type != "cuda":
            return
        stream = stream or torch.cuda.current_stream(self.layout.device)
        for load in loads:
            if load.transfer is not None:
                load.transfer.wait_layer_on(layer, stream)

    @property
    def num_open_requests(self) -> int:
        """Requests whose lease has not ended yet (finished or not)."""
        return len(self._requests) + len(self._ending)

    def is_open(self, request_id: Hashable) -> bool:
        """Whether a request of this id has a lease not ended yet (finished or not)."""
        return request_id in self._requests or any(r.request_id == request_id for r in self._ending)

    def _all_requests(self) -> list[_Request]:
        return [*self._requests.values(), *self._ending]

    def wait_for_match(self, request_id: Hashable, timeout_s: float | None = None) -> RequestLease:
        """What the open request's match gave it, waiting for the reply on the host if it has not
        come (at most timeout_s, default reply_timeout_s), then queueing what it allows. For a
        blocking caller (the reference ``CacheManager``); a scheduler polls instead."""
        request = self._requests[request_id]
        self._take_reply(request, self.config.reply_timeout_s if timeout_s is None else timeout_s)
        self._advance(request)
        return RequestLease(request.lease_id, request.hit_pages * self.page_size, request.host_page_ids.copy(),
                            request.reserved.copy(), request.failure)

    def leased_pages(self, request_id: Hashable) -> np.ndarray | None:
        """The L2 pages of an open request's locked hit, in order (None before the reply; diagnostics)."""
        request = self._requests.get(request_id)
        return None if request is None or request.match is not None else request.host_page_ids.copy()

    def stats(self) -> dict[str, int]:
        stats = self.counters + self.lookups.counters + self.transfer.load_paths
        stats[counters.REQUESTS_OPEN] = self.num_open_requests
        return dict(sorted(stats.items()))

    # ---- the request's state machine ------------------------------------------------------------

    def _request(self, request_id: Hashable, token_ids, promote_l3: bool, local_hit_tokens: int = 0,
                 begun: bool = False, recompute: bool = False, defer: bool = False) -> _Request:
        """The open request of this id, or a new one with its match sent (``defer``: kept to be
        sent by ``_take_reply``, the first step of any call that needs the reply)."""
        request = self._requests.get(request_id)
        if request is not None:
            return request
        tokens = self._tokens(token_ids)
        tokens = tokens[: page_aligned(len(tokens), self.page_size)]
        self._follow_session()
        # For the session of the mapped pool (DaemonDown at the send if that one has ended): the
        # lease, if any, is that session's.
        unsent = _Unsent(dict(reserve_backup=self.config.save, promote_l3=promote_l3, generation=self._generation,
                              local_hit_tokens=local_hit_tokens, policy=self.config.policy, begun=begun,
                              recompute=recompute))
        request = _Request(request_id, tokens, unsent, time.monotonic(), session_id=self._session.session_id,
                           predicted=recompute)
        if not defer:
            self._send_match(request)
        self._requests[request_id] = request
        return request

    def _send_match(self, request: _Request) -> None:
        unsent, request.match = request.match, None
        request.match_sent_at = time.monotonic()
        try:
            request.match = self.client.match_async(request.token_ids, **unsent.arguments)
        except DaemonUnavailable as exc:
            self._match_failed(request, exc)
        except BaseException:
            # Nothing was leased: the request ends as one whose match failed, its saves skipped.
            request.failure = "send_failed"
            self.counters.add(counters.ENGINE_MATCH_FAILURES, 1, "send_failed")
            raise

    def _take_reply(self, request: _Request, timeout_s: float | None = None) -> None:
        """Take the match's reply if it is here (or comes within timeout_s): the lease, the hit's
        pages, the reservation. A deferred match is sent first."""
        if isinstance(request.match, _Unsent):
            self._send_match(request)
        if request.match is None:
            return
        pending = request.match
        try:
            if timeout_s is None and not pending.ready():
                if time.monotonic() - request.match_sent_at < self.config.reply_timeout_s:
                    return
                pending.cancel()        # a late reply's lease is released by the client
                self._match_failed(request, None)
                return
            reply = pending.result(timeout_s)
        except (DaemonUnavailable, DaemonError) as exc:
            self._match_failed(request, exc)
            return
        request.match = None
        request.lease_id = reply.lease_id
        request.hit_pages = reply.backup_start_token // self.page_size
        request.host_page_ids = np.asarray(reply.host_page_ids, dtype=np.int64)
        request.reserved = np.asarray(reply.backup_page_ids, dtype=np.int64)
        request.host_page_generations = np.asarray(reply.host_page_generations, dtype=np.uint64)
        request.generation = reply.backup_generation
        request.written = np.zeros(len(request.reserved), dtype=bool)
        request.queued = np.zeros(len(request.reserved), dtype=bool)
        request.backup_skipped = reply.backup_skipped
        if self.peer is not None:
            request.peer_plan = self._peer_plan(reply)
        self.counters.add(counters.ENGINE_MATCHES)
        self.counters.add(counters.ENGINE_PROMOTED_TOKENS, reply.promoted_tokens)
        if reply.choice:
            request.decision, request.tier_hit_tokens = reply.decision, reply.hit_tokens
            if request.predicted and reply.choice not in ("recompute", "engine"):
                self.counters.add(counters.ENGINE_PREDICTION_MISSES)    # a restore the model would have taken
        lacking = len(request.token_ids) // self.page_size - request.hit_pages
        if self.config.save and len(request.reserved) < lacking and not request.backup_skipped:   # by cause, at save
            self.counters.add(counters.ENGINE_RESERVATION_SHORT_PAGES, lacking - len(request.reserved))

    def _match_failed(self, request: _Request, exc: Exception | None) -> None:
        """The request's match failed (exc None: no reply in time): its loads fail and its saves
        are skipped under the cause, counted here too."""
        if isinstance(exc, DaemonDown):
            cause = "daemon_down"           # logged once per outage, by the client
        elif isinstance(exc, DaemonUnavailable):
            cause = "daemon_unavailable"
        elif isinstance(exc, DaemonError):
            cause = "match_refused"
        else:
            cause = "no_reply"
        request.match, request.failure = None, cause
        self.counters.add(counters.ENGINE_MATCH_FAILURES, 1, cause)
        if cause != "daemon_down":
            why = exc if exc is not None else f"no reply within {self.config.reply_timeout_s} s"
            self._warn_once(cause, f"a match failed ({cause}): {why}")

    def _advance(self, request: _Request) -> None:
        # What was queued by an earlier call is seen done first, then what the reply allows is
        # queued: a transfer is checked for completion (and its session for validity) on a later
        # call than the one that queued it, also on CPU, where copies are done on return.
        for load in list(request.loads):
            if load.queued and (load.transfer is None or load.transfer.done()):
                self._complete_load(request, load)
        for save in request.saves:
            if save.transfer is not None and save.transfer.done():
                self._complete_save(request, save)
        self._take_reply(request)
        if request.match is None:
            for load in request.loads:
                if not load.queued:
                    self._queue_load(request, load)
            for save in request.saves:
                if not save.queued:
                    self._queue_save(request, save)
        if request.finished and request.match is None and not request.loads \
                and all(s.transfer is None for s in request.saves):
            self._end(request)
        elif request.hold_blocks and not self._touches_blocks(request):
            # Its saves' gathers are done (their DMA to L2 and the commit may not be): the engine
            # may reuse the blocks now rather than a DMA later.
            request.hold_blocks = False
            self._released.append(request.request_id)

    def _queue_load(self, request: _Request, load: _Load) -> None:
        load.queued = True
        num_pages = len(load.block_ids)
        if load.reason is not None:             # set by request_finished
            usable = 0
        elif request.failure is not None:
            usable, load.reason = 0, request.failure
        elif request.peer_plan is not None and not load.synchronous:
            self._queue_peer_load(request.peer_plan, load)
            return
        else:
            usable = max(0, min(load.start_page + num_pages, request.hit_pages) - load.start_page)
            if usable < num_pages:
                load.reason = "not_cached"      # evicted since the lookup, or this rank holds less
            if usable:
                usable = self._queue_l2_load(request, load, usable)
        load.num_pages_queued = usable

    def _queue_l2_load(self, request: _Request, load: _Load, usable: int) -> int:
        """Queue the copy of the first ``usable`` pages of the load from the request's L2 pages;
        the pages queued (its reason set for the rest)."""
        with self._pool_section(request.session_id) as pool:
            if pool is None:
                load.reason = "session_lost"        # its page ids name another pool's pages (or none)
                return 0
            pages = slice(load.start_page, load.start_page + usable)
            intact = pool.generations.num_leading_intact(request.host_page_ids[pages],
                                                         request.host_page_generations[pages])
            if intact < usable:
                usable, load.reason = intact, "stale_generation"
            if not usable:
                return 0
            try:
                layered = self.config.layered_loads and usable * self.geometry.bytes_per_page >= \
                    self.config.layered_min_bytes
                load.transfer = self.transfer.load(request.host_page_ids[load.start_page: load.start_page + usable],
                                                   load.block_ids[:usable], load.after, layered)
            except Exception as exc:            # the blocks are recomputed; nothing else depends on them
                self._warn_once("load_transfer_failed", f"a load's transfer failed: {exc!r}")
                load.reason = "transfer_failed"
                return 0
            self._track(load.transfer)
        self.counters.add(counters.ENGINE_QUEUED_PAGES, usable, "load")
        load.session_id = request.session_id
        self._queued_loads.append(LoadResult(request.request_id, usable * self.page_size,
                                             load.block_ids[usable:].tolist(), load.reason))
        return usable

    def _peer_plan(self, reply) -> PeerPlan | None:
        """Copy from another engine's GPU cache when the match's decision chose it (the daemon's
        cost model prices it against L2, L3 and recompute); None otherwise, or while its owner is
        not open here yet."""
        if reply.choice != "peer":
            return None
        plan = self.peer.plan(reply)
        if plan is not None:
            self.counters.add(counters.ENGINE_PEER_PLANS)
        return plan

    def _queue_peer_load(self, plan: PeerPlan, load: _Load) -> None:
        num_pages = len(load.block_ids)
        usable = max(0, min(load.start_page + num_pages, plan.num_pages) - load.start_page)
        if usable < num_pages:
            load.reason = "not_cached"
        if usable:
            try:
                load.peer_copy = self.peer.copy(plan, load.start_page, load.block_ids[:usable], load.after)
            except Exception as exc:            # the blocks are recomputed; nothing else depends on them
                self._warn_once("peer_transfer_failed", f"a peer load's transfer failed: {exc!r}")
                usable, load.reason = 0, "transfer_failed"
            else:
                copied = 0 if load.peer_copy is None else len(load.peer_copy.source_block_ids)
                if copied < usable:
                    usable, load.reason = copied, "peer_changed"
                if load.peer_copy is not None:
                    load.transfer = load.peer_copy.transfer
                    self.counters.add(counters.ENGINE_PEER_QUEUED_PAGES, usable)
                    # Provisional, as a load from L2 is: the epochs checked at completion may void it.
                    self._queued_loads.append(LoadResult(load.request_id, usable * self.page_size,
                                                         load.block_ids[usable:].tolist(), load.reason))
        load.num_pages_queued = usable

    def _complete_load(self, request: _Request, load: _Load) -> None:
        usable = load.num_pages_queued
        reason = load.reason
        transfer_s = 0.0
        if load.transfer is not None:           # a peer copy: device to device; else L2 to the GPU
            transfer_s = load.transfer.seconds()
            self._cost_samples.append(("d2d" if load.peer_copy is not None else "h2d",
                                       usable * self.geometry.bytes_per_page, transfer_s))
        if load.peer_copy is not None:
            # Only blocks the owner did not touch during the copy count (their epochs unchanged).
            verified = self.peer.finish(load.peer_copy)
            if verified < usable:
                usable, reason = verified, "peer_changed"
            self.counters.add(counters.ENGINE_PEER_LOADED_PAGES, usable)
        elif load.transfer is not None:
            with self._pool_section(load.session_id, load.transfer) as pool:
                if pool is None:    # the ended session's pool was dropped once the copy was done
                    usable, reason = 0, "session_lost"
                else:
                    # A page whose generation changed while the DMA read it may hold another's bytes.
                    pages = slice(load.start_page, load.start_page + usable)
                    intact = pool.generations.num_leading_intact(request.host_page_ids[pages],
                                                                 request.host_page_generations[pages])
                    if intact < usable:
                        usable, reason = intact, "stale_generation"
        failed = load.block_ids[usable:].tolist()
        if failed:
            self._count_failure(len(failed), reason or "unknown")
        self.counters.add(counters.ENGINE_LOADED_PAGES, usable)
        self._finished_loads.append(LoadResult(request.request_id, usable * self.page_size, failed,
                                               reason if failed else None, transfer_s))
        request.loads.remove(load)
        if load in self._sync_loads:
            self._sync_loads.remove(load)

    def _queue_save(self, request: _Request, save: _Save) -> None:
        save.queued = True
        first, end = save.first_page, save.first_page + len(save.block_ids)
        cached_end = min(end, request.hit_pages)
        self.counters.add(counters.ENGINE_SAVE_CACHED_PAGES, max(0, cached_end - first))
        first = max(first, request.hit_pages)
        if first >= end:
            return
        if request.failure is not None:
            self._skip(end - first, request.failure)
            return
        # The lease covers the pages of the tokens its match was sent with; of those the daemon
        # reserved what it could free (hit_pages on): the rest cannot be written.
        lease_end = len(request.token_ids) // self.page_size
        reserved_end = request.hit_pages + len(request.reserved)
        self._skip(end - max(first, lease_end), "beyond_lease")
        self._skip(min(end, lease_end) - max(first, reserved_end), request.backup_skipped or "no_space")
        end = min(end, reserved_end)
        if first >= end:
            return
        lo, hi = first - request.hit_pages, end - request.hit_pages
        already = int(request.queued[lo:hi].sum())
        if already:          # saved before by this request: written once is enough
            self.counters.add(counters.ENGINE_SAVE_PAGES_AGAIN, already)
        todo = np.flatnonzero(~request.queued[lo:hi]) + lo
        if not len(todo):
            return
        blocks = save.block_ids[todo + request.hit_pages - save.first_page]
        with self._pool_section(request.session_id) as pool:
            if pool is None:
                self._skip(len(todo), "session_lost")   # its page ids name another pool's pages (or none)
                return
            try:
                transfer = self.transfer.save(blocks, request.reserved[todo], save.after, request.generation)
            except Exception as exc:            # never committed: the pages go back with the lease
                self._warn_once("save_transfer_failed", f"a save's transfer failed: {exc!r}")
                self._skip(len(todo), "transfer_failed")
                return
            self._track(transfer)
        request.queued[todo] = True
        # Pages no longer reserved for this lease (it ended, they went to another writer): not written.
        self._skip(int((~transfer.claimed).sum()), "stale_generation")
        todo = todo[transfer.claimed]
        if not len(todo):
            return
        save.transfer = transfer
        save.reserve_indices = todo
        save.session_id = request.session_id
        self.counters.add(counters.ENGINE_QUEUED_PAGES, len(todo), "save")

    def _complete_save(self, request: _Request, save: _Save) -> None:
        self._cost_samples.append(("d2h", save.transfer.num_pages * self.geometry.bytes_per_page,
                                   save.transfer.seconds()))
        with self._pool_section(save.session_id, save.transfer) as pool:
            if pool is None:
                self._skip(save.transfer.num_pages, "session_lost")     # its lease went with the session
            else:
                # Complete: stamped with the lease's generation, readers may trust them once committed.
                pool.generations.stamp(request.reserved[save.reserve_indices], request.generation)
                request.written[save.reserve_indices] = True
                self.counters.add(counters.ENGINE_SAVED_PAGES, save.transfer.num_pages)
        save.transfer = None

    @staticmethod
    def _finish(request: _Request) -> None:
        request.finished = True
        for load in request.loads:          # a load not started for a finished request is not wanted
            if not load.queued:
                load.queued, load.reason = True, "request_finished"

    def _touches_blocks(self, request: _Request) -> bool:
        return any(load.transfer is not None and not load.transfer.blocks_free() for load in request.loads) \
            or any(not save.queued and request.match is not None for save in request.saves) \
            or any(save.transfer is not None and not save.transfer.blocks_free() for save in request.saves)

    def _end(self, request: _Request) -> None:
        """Commit the written prefix of the reservation (ending the lease), or release the lease."""
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
        else:
            self._ending.remove(request)
        if request.hold_blocks:
            self._released.append(request.request_id)
        written = int(np.argmin(request.written)) if not request.written.all() else len(request.written)
        stranded = int(request.written[written:].sum())
        if stranded:
            self._skip(stranded, "gap")      # written after a page that was not: not a prefix
        if request.lease_id is None:
            return
        # Every written page's DMA was seen complete and stamped (_complete_save); once the session
        # ended, the daemon refuses the commit. Not sent at all for a session the pool is not of.
        try:
            if request.session_id != self._session.session_id:
                sent = False        # of a session replaced by the pool's: its lease went with it
            elif written:
                sent = self.client.commit_backup(request.lease_id, request.reserved[:written].tolist(),
                                                 self._generation)
            else:
                sent = self.client.release(request.lease_id, self._generation)
            if written and sent:
                self.counters.add(counters.ENGINE_COMMITTED_PAGES, written)
            elif written:
                self._skip(written, "session_lost")
        except (DaemonUnavailable, DaemonError) as exc:
            if written:
                self._skip(written, "commit_failed")
            self._warn_once("end_of_lease_failed", f"could not end a lease: {exc}")

    # ---- helpers ------------------------------------------------------------------------------------

    def _caller_event(self):
        if self.layout.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.layout.device))
        return event

    def _tokens(self, token_ids) -> np.ndarray:
        return token_array(token_bytes(token_ids))        # a copy: the engine may reuse its array

    def _pages(self, start_token: int, num_tokens: int, what: str) -> tuple[int, int]:
        for name, value in (("start_token", start_token), ("num_tokens", num_tokens)):
            if type(value) is not int or value < 0 or value % self.page_size:
                raise ValueError(f"{what}: {name} must be a non-negative multiple of the page size "
                                 f"{self.page_size}, got {value!r}")
        return start_token // self.page_size, num_tokens // self.page_size

    def _block_ids(self, block_ids: Sequence[int], num_pages: int) -> np.ndarray:
        block_ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if len(block_ids) != num_pages:
            raise ValueError(f"{len(block_ids)} block ids given for {num_pages} pages")
        self.layout.check_block_ids(block_ids)
        return block_ids

    def _skip(self, num_pages: int, cause: str) -> None:
        """A save's pages not written: counted, logged once per cause, reported to the daemon."""
        if num_pages <= 0:
            return
        # An outage is logged once, by the client; a policy skip is the daemon's choice (counted).
        if cause not in ("daemon_down", "evicted_before_reuse"):
            self._warn_once(f"save_{cause}", f"save pages skipped: {cause}")
        self.counters.add(counters.ENGINE_SAVE_SKIPPED_PAGES, num_pages, cause)
        self.counters.add(counters.ENGINE_SAVE_SKIPPED_PAGES_SUM, num_pages)

    def _count_failure(self, num_pages: int, cause: str) -> None:
        if cause != "daemon_down":
            self._warn_once(f"load_{cause}", f"load pages not loaded (to be recomputed): {cause}")
        self.counters.add(counters.ENGINE_LOAD_FAILED_PAGES, num_pages, cause)
        self.counters.add(counters.ENGINE_LOAD_FAILED_PAGES_SUM, num_pages)

    def _warn_once(self, cause: str, message: str) -> None:
        key = f"warned_{cause}"
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s (each further one is counted, not logged)", message)

    def _report(self, force: bool = False) -> None:
        """Send changed counters (its status shows them) and the timings taken since the last report
        (its cost model learns from them) to the daemon, at most every report_interval_s."""
        now = time.monotonic()
        if not self.client.is_attached(self._generation):
            return                          # sent again once the session is back (or its successor's pool is in)
        since_s = now - self._reported_at
        if not force and since_s < self.config.report_interval_s and not (
                self._cost_samples and since_s >= COST_REPORT_INTERVAL_S):
            return
        stats = self.stats()
        if not force and stats == self._reported and not self._cost_samples:
            return
        samples = list(self._cost_samples)
        try:
            self.client.report({"connector": {"layout": self.layout.kind, "page_layout": self.layout.page_layout,
                                              "block_shape": list(self.layout.block_shape),
                                              "transfer": self.transfer.report(), "pin": self.host_pool.pin_report(),
                                              "counters": stats}}, samples)
        except (DaemonUnavailable, RuntimeError) as exc:
            logger.debug("report not sent: %s", exc)
            return
        for _ in samples:
            self._cost_samples.popleft()
        self._reported, self._reported_at = stats, now

    def flush_report(self) -> None:
        """Send the counters now (tests, shutdown)."""
        self._report(force=True)

    # ---- after a re-attach -----------------------------------------------------------------------

    def _on_reattach(self, generation: int, info: AttachInfo) -> None:
        """The client's listener (on its heartbeat thread): map and pin the new session's pool on a
        thread of its own, never on the scheduler's path."""
        thread = threading.Thread(target=self._open_next_pool, args=(generation, info),
                                  name="kvcached-remap", daemon=True)
        with self._next_lock:
            if self._closed:
                return
            self._remap_threads = [t for t in self._remap_threads if t.is_alive()] + [thread]
        thread.start()

    def _open_next_pool(self, generation: int, info: AttachInfo) -> None:
        try:
            pool = _open_pool(self.layout, self.geometry, info)
        except Exception as exc:        # requests skip the daemon until the next re-attach
            logger.error("cannot map the L2 pool of the new kvcached session (generation %d): %s", generation, exc)
            return
        with self._next_lock:
            if self._closed or (self._next_pool is not None and self._next_pool[0] > generation) \
                    or self._ended(generation):
                superseded = pool       # closed meanwhile, a later re-attach's pool is ready, or it ended
            else:
                superseded = self._next_pool[2] if self._next_pool is not None else None
                self._next_pool = (generation, info, pool)
        if superseded is not None:
            superseded.close()

    def _ended(self, generation: int) -> bool:
        """Whether the session of ``generation`` surely ended (a later one exists, or it is down
        for good): what the client says, read without waiting."""
        connection = self.client.connection
        return connection.generation > generation or (connection.generation == generation
                                                      and connection.session_ended)

    def _on_session_end(self, generation: int) -> None:
        """The client's listener (mostly on its heartbeat thread): the session of ``generation``
        surely ended. Its pool (or a later one's, mapped meanwhile) is dropped at once where no
        copy is being queued and every copy queued into or out of it is complete, so that an
        engine that makes no call frees it too; otherwise the poll that sees the last one done
        drops it (_follow_session)."""
        with self._next_lock:
            stale = self._next_pool if self._next_pool is not None and self._next_pool[0] <= generation else None
            if stale is not None:
                self._next_pool = None
        if stale is not None:
            stale[2].close()
        if self._drop_pool(generation):
            self.client.mark_drained(generation)    # nothing of ours writes that session's pages

    def _follow_session(self) -> None:
        """While the mapped pool's session is not the client's live one: with no transfer in
        flight, say that the ended session's pages are drained (client DOWN), drop its pool once
        the session surely ended, or swap in the pool of the client's newer session once mapped."""
        if self._closed or self.client.is_attached(self._generation):
            return
        if any(t.transfer is not None and not t.transfer.done()
               for request in self._all_requests() for t in (*request.loads, *request.saves)):
            return
        connection = self.client.connection
        if connection.generation == self._generation:
            self.client.mark_drained(self._generation)    # DOWN: no transfer starts until it is back
            if connection.session_ended:
                self._drop_pool(self._generation)
            return
        with self._next_lock:
            ready = self._next_pool is not None and self._next_pool[0] == connection.generation
            if ready:
                (generation, info, pool), self._next_pool = self._next_pool, None
        if not ready:               # a newer session exists, its pool still being mapped
            self._drop_pool(self._generation)
            return
        hints = self._open_hints(info)
        with self._pool_lock:
            replaced = self._use_pool(pool, generation, info, hints)
        self._close_replaced(*replaced)
        logger.info("L2 pool of the new kvcached session (generation %d) in use: %s", generation, info.shm_path)
        self._report(force=True)

    def _drop_pool(self, ended_generation: int) -> bool:
        """Unpin and unmap the mapped pool if its session is that of ``ended_generation`` or an
        older one (surely ended), no copy is being queued and every copy queued into or out of it
        is complete (none can start after: its generation never attaches again), so that the
        segment's memory is freed now: where /dev/shm cannot hold two pools, a restarted daemon
        needs it to start. Found in use, it is left to the section that ends the use
        (_pool_section) or to a poll. True once dropped (now or before)."""
        if self._pool_dropped or self._closed:
            return self._pool_dropped
        placeholder = _placeholder_pool(self.layout, self.geometry)
        replaced = None
        with self._pool_lock:
            if not (self._closed or self._pool_dropped) and self._generation <= ended_generation:
                if not self._pool_users and all(t.done() for t in self._pool_transfers):
                    # The ended session's requests now hold page ids of no mapped pool: they move
                    # nothing and end nothing (session_lost), as after a swap.
                    replaced = self._use_pool(placeholder, self._generation, _NoSession(), None)
                else:
                    self._drop_wanted = max(ended_generation, self._drop_wanted or 0)
            dropped = self._pool_dropped
        if replaced is None:
            placeholder.close()
            return dropped
        self._close_replaced(*replaced)
        logger.info("the ended kvcached session's L2 pool is unmapped")
        return True

    def _use_pool(self, pool: SharedHostPool, generation: int, session: AttachInfo | _NoSession,
                  hints: HintsView | None) -> tuple[SharedHostPool, HintsView | None]:
        """With _pool_lock held and no copy of the mapped pool being queued or in flight: transfers
        use ``pool`` (``session``'s, or a placeholder) from now on. Returns the replaced pool and
        hints, for the caller to close once the lock is released."""
        replaced = self.host_pool, self._hints
        self.transfer.use_host_pool(pool)
        self.host_pool, self._hints = pool, hints
        self._generation, self._session = generation, session
        self._pool_dropped = isinstance(session, _NoSession)
        self._pool_transfers.clear()
        self._drop_wanted = None
        return replaced

    def _close_replaced(self, pool: SharedHostPool, hints: HintsView | None) -> None:
        if hints is not None:
            hints.close()
        try:
            pool.close()
        except RuntimeError as exc:     # a view of it still lives: closed by a poll once it is gone
            logger.warning("the ended session's L2 pool stays mapped until its last view is dropped: %s", exc)
            with self._pool_lock:
                self._ended_pools.append(pool)

    @contextlib.contextmanager
    def _pool_section(self, session_id: int | None, complete: Transfer | None = None):
        """Use the mapped pool for the scheduler's work of ``session_id``'s requests: yields the
        pool, not dropped or replaced until the section ends, or None when it is not that
        session's (the session ended and its pool was dropped or replaced). ``complete``: a copy
        seen complete, no longer in flight. A drop asked for meanwhile is tried at the end."""
        with self._pool_lock:
            if complete is not None:
                self._pool_transfers.discard(complete)
            pool = self.host_pool if session_id == self._session.session_id else None
            if pool is not None:
                self._pool_users += 1
        if pool is None:
            yield None
            return
        try:
            yield pool
        finally:
            with self._pool_lock:
                self._pool_users -= 1
                wanted = self._drop_wanted if not self._pool_users else None
            if wanted is not None and self._drop_pool(wanted):
                self.client.mark_drained(wanted)

    def _track(self, transfer: Transfer) -> None:
        """A copy just queued (in a _pool_section) into or out of the mapped pool: in flight."""
        with self._pool_lock:
            self._pool_transfers.add(transfer)

    def _open_hints(self, info: AttachInfo) -> HintsView | None:
        """The session's admission hints (None: the daemon publishes none, or they cannot be read:
        every begun lookup then waits for its reply)."""
        if not info.hints_path:
            return None
        try:
            return HintsView.open(info.hints_path, info.hints_offset_bytes, info.namespace_id)
        except (OSError, ValueError) as exc:
            self._warn_once("hints_unreadable", f"the daemon's admission hints cannot be read ({exc}); "
                            "every lookup waits for its reply")
            return None

    def _close_ended_pools(self) -> None:
        with self._pool_lock:
            ended, self._ended_pools = self._ended_pools, []
        still_viewed = []
        for pool in ended:
            try:
                pool.close()
            except RuntimeError:
                still_viewed.append(pool)
            else:
                logger.info("the ended session's L2 pool is closed")
        with self._pool_lock:
            self._ended_pools += still_viewed

    # ---- shutdown ---------------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait (bounded) for the transfers in flight, end every lease, report, and close the pool and
        the client. Loads not done are reported failed; saves not done are skipped and counted."""
        with self._next_lock:
            if self._closed:
                return
            with self._pool_lock:       # no drop starts from here on (_drop_pool)
                self._closed = True
            next_pool, self._next_pool = self._next_pool, None
            remap_threads = list(self._remap_threads)
        self.client.remove_reattach_listener(self._on_reattach)
        self.client.remove_session_end_listener(self._on_session_end)
        try:
            deadline = time.monotonic() + timeout_s
            for request in self._all_requests():
                self._finish(request)
                if request.match is not None:
                    request.match.cancel()
                    request.match, request.failure = None, "closing"
            while self.num_open_requests and time.monotonic() < deadline:
                self.poll()
                if self.num_open_requests:
                    time.sleep(0.001)
            if self.layout.device.type == "cuda":
                torch.cuda.synchronize(self.layout.device)
            self.poll()
            for request in self._all_requests():     # past the deadline: nothing is waited for
                for save in request.saves:
                    if save.transfer is not None:
                        self._skip(save.transfer.num_pages, "closing")
                        save.transfer = None
                request.loads.clear()
                self._end(request)
            self.flush_report()
        finally:
            try:
                if self.peer is not None:
                    self.peer.close()
                    self.peer = None
                del self.transfer
                if self._hints is not None:
                    self._hints.close()
                    self._hints = None
                self.host_pool.close()
                if next_pool is not None:
                    next_pool[2].close()
                self._close_ended_pools()
                if self._ended_pools:
                    logger.error("%d ended sessions' L2 pools stay mapped and pinned: a view of each is alive",
                                 len(self._ended_pools))
            finally:
                self.client.close()
                for thread in remap_threads:    # one still mapping closes what it maps (_closed)
                    thread.join()

    def __enter__(self) -> "KVConnector":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
