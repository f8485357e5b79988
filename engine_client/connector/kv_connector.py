"""``KVConnector``: one engine rank's connector to the daemon (the package note tells its shape).

Per request, one state (``state.RequestState``) moved by ``_advance``: the lease comes one way
(``lease.py``), and the copies are jobs queued and checked by the handler of their route
(``jobs.py``). Following the session (``session.py``) and reporting (``reporting.py``) are its
other parts.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Hashable, Iterable, Mapping, Sequence

import numpy as np
import torch

from engine_client.client import DaemonError, DaemonUnavailable, KVCacheClient
from engine_client.connector.config import ConnectorConfig, RequestLease
from engine_client.connector.jobs import Jobs
from engine_client.connector.lease import Leases
from engine_client.connector.lookups import BegunLookup, PendingLookup, PrefixLookup
from engine_client.connector.reporting import Reporting
from engine_client.connector.session import SessionPools, _open_pool, _placeholder_pool
from engine_client.connector.state import Cause, Load, Request, RequestState, Save
from engine_client.connector.transfers import RequestTransfers
from engine_client.engine_api import Finished, LoadResult
from engine_client.kv_transfer import KVTransfer
from engine_client.layout import KVLayout, describe_layout
from engine_client.peer import PeerSharing
from engine_client.peer_memory import PeerError, share_host_tensors
from engine_client.shared_pool import SharedHostPool
from proto import counters
from proto.counters import Counts
from proto.errors import ErrorCode
from proto.messages import RESTORE_POLICIES, KVGeometry
from proto.schema import MAX_COST_SAMPLES
from proto.tokens import page_aligned, token_array, token_bytes

logger = logging.getLogger(__name__)

_MATCHING = (RequestState.DEFERRED, RequestState.MATCHING)


class KVConnector(RequestTransfers, SessionPools, Reporting):
    """One engine rank's connector to the daemon; see the package note. Not thread-safe: one
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
        self.leases = Leases(client, self.page_size, self.counters, self._warn_once, self._skip)
        self.jobs = Jobs(transfer, peer, geometry.bytes_per_page, lambda: self.config)
        # Timings kept for the daemon while it cannot be told (oldest dropped first): what one report carries.
        self._cost_samples: collections.deque[tuple[str, int, float]] = collections.deque(maxlen=MAX_COST_SAMPLES)
        self._requests: dict[Hashable, Request] = {}       # open, by id: not finished yet
        # Finished, their leases not ended yet (transfers in flight, a reply or a commit to come):
        # apart from _requests, so that the engine may reuse the id at once (vLLM resumes a
        # preempted request under its id once its blocks are released).
        self._ending: list[Request] = []
        self._finished_loads: list[LoadResult] = []
        self._queued_loads: list[LoadResult] = []
        self._released: list[Hashable] = []
        self._reported: dict | None = None
        self._reported_at = 0.0
        self._warned: set[str] = set()
        self._closed = False
        self._init_session(client)
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
              local_hit_tokens: int = 0) -> BegunLookup:
        """A lookup that is the request's match: the daemon's decision in the one round trip a
        lookup takes, with the lease on the L2 hit and the reservation for the request's saves.
        Its ``load`` (and ``save``) then send nothing: the copies are queued at the call. An engine
        that decides where a request's tokens come from in its own scheduler process (vLLM) looks
        up instead; this is for one whose scheduler holds the connector (``can_begin``). Where the
        admission hints show that the daemon would decline every restore, it answers "recompute"
        at once, the match sent by the request's next call. A request given up (``cancel``, or
        no reply in time: ``give_up``) ends like ``request_finished``."""
        if not self.can_begin:
            raise RuntimeError("begin needs one rank (tp_size 1) and promote_l3")
        self.counters.add(counters.ENGINE_LOOKUPS)
        predicted = request_id not in self._requests and self._predicts_recompute(token_ids, local_hit_tokens)
        if predicted:
            self.counters.add(counters.ENGINE_LOOKUPS_PREDICTED)
        request = self._request(request_id, token_ids, "recompute" if predicted else "wait",
                                local_hit_tokens=local_hit_tokens)
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
             num_tokens: int, start_token: int = 0) -> None:
        """Queue the load of tokens [start_token, start_token + num_tokens) of token_ids (whole pages)
        into block_ids (block_ids[i] gets page start_token // page_size + i). Its LoadResult comes
        through ``finished()``. num_tokens=0 only takes the request's lease (reserving L2 pages for
        its saves)."""
        start_page, num_pages = self._pages(start_token, num_tokens, "load")
        block_ids = self._block_ids(block_ids, num_pages)
        if (start_page + num_pages) * self.page_size > len(token_ids):
            raise ValueError(f"tokens [{start_token}, {start_token + num_tokens}) are beyond the {len(token_ids)} given")
        # The request's match (if this call sends it) may promote what only L3 holds: the daemon's
        # cost model decides, for the tokens beyond those the engine holds (start_token).
        request = self._request(request_id, token_ids, "wait" if self.config.promote_l3 else "none",
                                local_hit_tokens=start_token)
        if request.finished:
            raise ValueError(f"request {request_id!r} is finished: its blocks may be reused already")
        if num_pages:
            request.loads.append(Load(request_id, start_page, block_ids, self._caller_event()))
            self.counters.add(counters.ENGINE_LOADS)
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
        request = self._request(request_id, tokens, "none")
        if request.finished:
            raise ValueError(f"request {request_id!r} is finished: its blocks may be reused already")
        covered = min(len(request.token_ids), end_page * self.page_size)
        if not np.array_equal(request.token_ids[:covered], tokens[:covered]):
            raise ValueError(f"request {request_id!r}: these tokens differ from those its first call gave")
        self.counters.add(counters.ENGINE_SAVES)
        if not self.config.save:
            self._skip(end_page - start_page, Cause.SAVING_OFF)
            return
        request.saves.append(Save(start_page, block_ids, self._caller_event()))
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

    def finished(self) -> Finished:
        """Loads completed (or failed) and requests released since the last call; polls first."""
        self.poll()
        loads, self._finished_loads = self._finished_loads, []
        released, self._released = self._released, []
        queued, self._queued_loads = self._queued_loads, []
        return Finished(loads, released, queued)

    def wait_for_layer_load(self, layer: int, stream: torch.cuda.Stream | None = None,
                            request_ids: Iterable[Hashable] | None = None) -> None:
        """Make ``stream`` (default: the current one) wait until ``layer`` of the blocks of the
        loads of ``request_ids`` (None: of every open request) not yet reported is written. No host
        wait for the copies: the stream waits on the layer's event, while the later layers are
        still copied. A load whose match has no reply yet is waited for here, on the host (bounded
        by reply_timeout_s): wait on a load once ``finished().queued`` named it, or issue it a step
        ahead, to avoid that."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer must be in [0, {self.layout.num_layers}), got {layer}")
        if request_ids is None:
            request_ids = list(self._requests)
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
            if load.job is not None:
                load.job.transfer.wait_layer_on(layer, stream)

    @property
    def num_open_requests(self) -> int:
        """Requests whose lease has not ended yet (finished or not)."""
        return len(self._requests) + len(self._ending)

    def is_open(self, request_id: Hashable) -> bool:
        """Whether a request of this id has a lease not ended yet (finished or not)."""
        return request_id in self._requests or any(r.request_id == request_id for r in self._ending)

    def _all_requests(self) -> list[Request]:
        return [*self._requests.values(), *self._ending]

    def wait_for_match(self, request_id: Hashable, timeout_s: float | None = None) -> RequestLease:
        """What the open request's match gave it, waiting for the reply on the host if it has not
        come (at most timeout_s, default reply_timeout_s), then queueing what it allows. For a
        blocking caller (the reference ``CacheManager``); a scheduler polls instead."""
        request = self._requests[request_id]
        self._take_reply(request, self.config.reply_timeout_s if timeout_s is None else timeout_s)
        self._advance(request)
        lease = request.lease
        return RequestLease(lease.lease_id, lease.hit_pages * self.page_size, lease.host_page_ids.copy(),
                            lease.reserved_page_ids.copy(), None if request.failure is None else request.failure.value)

    def leased_pages(self, request_id: Hashable) -> np.ndarray | None:
        """The L2 pages of an open request's locked hit, in order (None before the reply; diagnostics)."""
        request = self._requests.get(request_id)
        return None if request is None or request.state in _MATCHING else request.lease.host_page_ids.copy()

    # ---- the request's state machine ------------------------------------------------------------

    def _request(self, request_id: Hashable, token_ids, promote: str, local_hit_tokens: int = 0) -> Request:
        """The open request of this id, or a new one with its lease asked for (``lease.Leases.open``)."""
        request = self._requests.get(request_id)
        if request is not None:
            return request
        tokens = self._tokens(token_ids)
        tokens = tokens[: page_aligned(len(tokens), self.page_size)]
        self._follow_session()
        # For the session of the mapped pool (DaemonDown at the send if that one has ended): the
        # lease, if any, is that session's.
        request = self.leases.open(request_id, tokens, self.config, session_id=self._session.session_id,
                                   generation=self._generation, promote=promote, local_hit_tokens=local_hit_tokens)
        self._requests[request_id] = request
        return request

    def _take_reply(self, request: Request, timeout_s: float | None = None) -> None:
        self.leases.take_reply(request, self.config, self.peer, timeout_s)

    def _advance(self, request: Request) -> None:
        # What was queued by an earlier call is seen done first, then what the reply allows is
        # queued: a transfer is checked for completion (and its session for validity) on a later
        # call than the one that queued it, also on CPU, where copies are done on return.
        for load in list(request.loads):
            if load.queued and (load.job is None or load.job.done()):
                self._complete_load(request, load)
        for save in request.saves:
            if save.job is not None and save.job.done():
                self._complete_save(request, save)
        if request.state in _MATCHING:
            self._take_reply(request)
        if request.state in (RequestState.LEASED, RequestState.FAILED, RequestState.ENDING):
            for load in request.loads:
                if not load.queued:
                    self._queue_load(request, load)
            for save in request.saves:
                if not save.queued:
                    self._queue_save(request, save)
            if request.finished and request.state is not RequestState.ENDING:
                request.transition(RequestState.ENDING)
        if request.state is RequestState.ENDING and request.settled():
            self._end(request)
        elif request.hold_blocks and not self._touches_blocks(request):
            # Its saves' gathers are done (their DMA to L2 and the commit may not be): the engine
            # may reuse the blocks now rather than a DMA later.
            request.hold_blocks = False
            self._released.append(request.request_id)

    @staticmethod
    def _finish(request: Request) -> None:
        request.finished = True
        for load in request.loads:          # a load not started for a finished request is not wanted
            if not load.queued:
                load.queued, load.reason = True, Cause.REQUEST_FINISHED

    def _touches_blocks(self, request: Request) -> bool:
        return any(load.job is not None and not load.job.blocks_free() for load in request.loads) \
            or any(not save.queued and request.state in _MATCHING for save in request.saves) \
            or any(save.job is not None and not save.job.blocks_free() for save in request.saves)

    def _end(self, request: Request) -> None:
        """ENDING -> ENDED: commit the written prefix of the reservation (ending the lease), or
        release the lease."""
        request.transition(RequestState.ENDED)
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
        else:
            self._ending.remove(request)
        if request.hold_blocks:
            self._released.append(request.request_id)
        written = int(np.argmin(request.written)) if not request.written.all() else len(request.written)
        stranded = int(request.written[written:].sum())
        if stranded:
            self._skip(stranded, Cause.GAP)      # written after a page that was not: not a prefix
        self.leases.end(request, request.lease.reserved_page_ids[:written].tolist(),
                        same_session=request.session_id == self._session.session_id, generation=self._generation)

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
                self.leases.give_up(request, Cause.CLOSING)
            while self.num_open_requests and time.monotonic() < deadline:
                self.poll()
                if self.num_open_requests:
                    time.sleep(0.001)
            if self.layout.device.type == "cuda":
                torch.cuda.synchronize(self.layout.device)
            self.poll()
            for request in self._all_requests():     # past the deadline: nothing is waited for
                for save in request.saves:
                    if save.job is not None:
                        self._skip(save.job.num_pages, Cause.CLOSING)
                        save.job = None
                request.loads.clear()
                self._end(request)
            self.flush_report()
        finally:
            try:
                if self.peer is not None:
                    self.peer.close()
                    self.peer = None
                del self.transfer, self.jobs   # the handlers hold the transfer, which views the pool
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
