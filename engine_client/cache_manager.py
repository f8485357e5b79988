"""The reference cache manager: L1 for a simple engine, on the connector. The worked example.

    manager = CacheManager.attach(connect(), geometry, num_l1_pages=4096, device="cuda")
    plan = manager.prepare(token_ids)     # L1 match, one round trip, the load of what L2 adds
    ... the engine prefills tokens [plan.num_cached_tokens, len) into plan.new_l1_page_ids ...
    manager.finish(plan)                  # publish the new full pages in L1, save them to L2

It owns an ``L1Pool`` (one tensor ``[2, L, N, P, H, D]``, registered with a ``KVConnector`` as a
"pool" layout) and an ``L1PrefixIndex``, and drives the connector the simplest way, blocking:

    prepare   L1 match -> connector.load(rid, tokens, [], 0): the match goes out (lease on the L2
              hit, private pages for what L2 lacks) -> wait_for_match -> load the part of the L2
              hit beyond L1 into the request's new L1 pages -> wait for its LoadResult -> publish
              the loaded pages in the L1 index
    finish    connector.save(the full pages) + request_finished -> wait until the lease ended (the
              commit sent) -> publish the new full pages in L1
    abort     request_finished

Waiting is fine here: this is the simple example. The reference engine (bench/engine) and the vLLM
adapter use the connector asynchronously, one poll per scheduler step.

Everything the connector guarantees holds here: a load is published only once complete and only
if its session held throughout (else its pages are recomputed), a save's DMA starts only while the
session is sure to outlive it, nothing is skipped silently (``stats()``; the daemon's status shows
the same counters). While the daemon is down ``prepare`` is a plain miss and ``finish`` saves
nothing, both at once; after a re-attach the connector maps the new session's pool in the
background and swaps it in (see ``engine_client.connector``); a plan of the ended session finishes
in L1 only.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Sequence

import numpy as np
import torch

from engine_client.client import KVCacheClient
from engine_client.connector import ConnectorConfig, KVConnector, LoadResult
from engine_client.l1_index import L1PrefixIndex
from engine_client.l1_pool import L1Pool
from engine_client.shared_pool import SharedHostPool
from proto.messages import RESTORE_POLICIES, KVGeometry
from proto.tokens import token_array

# Of RESTORE_POLICIES, those a manager follows: it loads every hit (always) or none (never), and asks
# no decision of the daemon's cost model, so "cost" is not one of them.
MANAGER_POLICIES = tuple(policy for policy in RESTORE_POLICIES if policy != "cost")


class L1Full(Exception):
    """Not enough L1 pages for the request, even after evicting every unlocked cached page."""


@dataclasses.dataclass(eq=False)      # identity: two plans are never the same request
class RequestPlan:
    token_ids: np.ndarray
    num_cached_tokens: int              # tokens whose KV is in L1 now (a multiple of page_size)
    l1_page_ids: list[int]              # L1 pages holding tokens [0, num_cached_tokens)
    new_l1_page_ids: list[int]          # L1 pages for tokens [num_cached_tokens, len), for the prefill
    l1_hit_tokens: int                  # of num_cached_tokens, how many were already in L1
    restored_tokens: int                # of num_cached_tokens, how many were loaded from L2
    l2_hit_tokens: int                  # what the daemon's L2 held (L3 promotions included)
    lease_id: int | None                # the request's lease while it is open (None: none, or ended)
    reserved_start_token: int           # saves write pages from here on (the L2 hit)
    reserved_page_ids: list[int]        # the private L2 pages reserved for them
    restore_seconds: float = 0.0        # wall time of the load, from queueing to its result
    finished: bool = False
    save: bool = True                   # save the new full pages at finish
    request_id: int | None = None       # the connector's, while the request is open there


class CacheManager:
    def __init__(self, connector: KVConnector, l1_pool: L1Pool, restore_policy: str = "always"):
        if restore_policy not in MANAGER_POLICIES:
            raise ValueError(f"restore_policy must be one of {MANAGER_POLICIES}")
        self.connector = connector
        self.l1_pool = l1_pool
        self.geometry = l1_pool.geometry
        self.page_size = self.geometry.page_size
        self.l1_index = L1PrefixIndex(self.page_size)
        self.restore_policy = restore_policy
        self._open_plans: list[RequestPlan] = []
        self._request_ids = itertools.count(1)

    @classmethod
    def attach(cls, client: KVCacheClient, geometry: KVGeometry, num_l1_pages: int,
               device: str | torch.device = "cpu", backend: str = "auto", restore_policy: str = "always",
               config: ConnectorConfig | None = None) -> "CacheManager":
        """Make the L1 pool and register it with a connector: ``client`` is attached with
        ``geometry``, the L2 pool mapped (on a GPU, pinned) and the transfers warmed. ``backend``
        picks the gather/scatter ("auto" times torch against Triton on a GPU)."""
        # The daemon's restore policy follows the manager's: always (every hit restored, L3 promoted
        # whatever the cost model says) or never.
        config = config or ConnectorConfig(backend=backend, policy=restore_policy)
        l1_pool = L1Pool(geometry, num_l1_pages, device)
        connector = KVConnector.register(
            client, l1_pool.kv, "pool", model_id=geometry.model_id, page_size=geometry.page_size,
            num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim, dtype=geometry.dtype,
            model_revision=geometry.model_revision, cache_salt=geometry.cache_salt, tp_rank=geometry.tp_rank,
            tp_size=geometry.tp_size, config=config)
        if connector.geometry != geometry:
            connector.close()
            raise ValueError(f"an L1 pool of {geometry} registers as {connector.geometry}")
        return cls(connector, l1_pool, restore_policy)

    @property
    def client(self) -> KVCacheClient:
        return self.connector.client

    @property
    def host_pool(self) -> SharedHostPool:
        """The L2 pool in use (a new one after a re-attach)."""
        return self.connector.host_pool

    def stats(self) -> dict[str, int]:
        """The connector's counters: loads, saves, and every skip and failure by cause."""
        return self.connector.stats()

    # ---- per request ----------------------------------------------------------------------------

    def prepare(self, token_ids: Sequence[int] | np.ndarray, save: bool = True) -> RequestPlan:
        """L1 match, then the daemon's match (one round trip), then the load of what L2 adds.

        A daemon that is down or does not answer, or a load that fails, is not the request's
        failure: the plan then covers what L1 holds, and the engine recomputes the rest (counted
        in ``stats()``). L1Full when L1 cannot hold the request; then nothing is left behind."""
        tokens = token_array(token_ids)
        if tokens.size == 0:
            raise ValueError("token_ids must be a non-empty 1-D sequence")
        self.connector.poll()               # a re-attach's pool is swapped in here
        page_size = self.page_size
        l1_match = self.l1_index.match(tokens)
        l1_page_ids = list(l1_match.page_ids)
        self.l1_index.lock(l1_page_ids)
        try:
            # Every page past the L1 hit: loaded ones first (a load fills full pages), then the
            # ones the prefill fills.
            new_l1_page_ids = self._allocate_l1(-(-len(tokens) // page_size) - len(l1_page_ids))
        except BaseException:
            self.l1_index.unlock(l1_page_ids)
            raise
        request_id = next(self._request_ids)
        try:
            # The match, the request's lease; the daemon prices restoring what lies beyond L1.
            self.connector.load(request_id, tokens, [], 0, start_token=len(l1_page_ids) * page_size)
            lease = self.connector.wait_for_match(request_id)
            first = len(l1_page_ids)
            num_loaded = 0
            restore_seconds = 0.0
            num_loadable = min(lease.hit_tokens, len(tokens)) // page_size - first
            if self.restore_policy == "always" and num_loadable > 0:
                started = time.perf_counter()
                result = self._load(request_id, tokens, new_l1_page_ids[:num_loadable], first)
                restore_seconds = time.perf_counter() - started
                num_loaded = result.num_tokens // page_size
            if not save:                    # nothing to save: the lease ends now
                self._end_request(request_id)
        except BaseException:
            self._end_request(request_id)   # nothing of it writes the pages freed below any more
            self.l1_index.unlock(l1_page_ids)
            self.l1_pool.free(new_l1_page_ids)
            raise
        if num_loaded:
            # Published in the L1 index only now that the load is complete. The prefix was locked
            # and absent before; nobody else inserts in between.
            loaded = new_l1_page_ids[:num_loaded]
            end = (first + num_loaded) * page_size
            duplicates = self.l1_index.insert(tokens[:end], loaded, start_page=first)
            assert not duplicates, "loaded pages were already cached in L1"
            self.l1_index.lock(loaded)
            l1_page_ids += loaded
            new_l1_page_ids = new_l1_page_ids[num_loaded:]
        is_open = self.connector.is_open(request_id)
        plan = RequestPlan(
            token_ids=tokens, num_cached_tokens=len(l1_page_ids) * page_size, l1_page_ids=l1_page_ids,
            new_l1_page_ids=new_l1_page_ids, l1_hit_tokens=l1_match.num_tokens,
            restored_tokens=num_loaded * page_size, l2_hit_tokens=lease.hit_tokens,
            lease_id=lease.lease_id if is_open else None, reserved_start_token=lease.hit_tokens,
            reserved_page_ids=lease.reserved_page_ids.tolist() if is_open else [],
            restore_seconds=restore_seconds, save=save, request_id=request_id if is_open else None)
        self._open_plans.append(plan)
        return plan

    def _load(self, request_id: int, tokens: np.ndarray, block_ids: list[int], first_page: int) -> LoadResult:
        """Load pages [first_page, first_page + len(block_ids)) of tokens into block_ids and wait
        for the result: on a GPU the host waits for the device, then the connector sees it done."""
        self.connector.load(request_id, tokens, block_ids, len(block_ids) * self.page_size,
                            start_token=first_page * self.page_size)
        self._synchronize()
        results = [r for r in self.connector.finished().loads if r.request_id == request_id]
        assert len(results) == 1, f"a complete load has one result, got {results}"
        return results[0]

    def finish(self, plan: RequestPlan) -> int:
        """After the prefill: save the full pages the daemon lacks, wait until the request's lease
        has ended, and publish the new full pages in L1. Returns how many pages were saved (0 when
        the daemon is down or the plan's session has ended: those pages stay in L1 only)."""
        self._check_open(plan)
        page_size = self.page_size
        full_pages = len(plan.token_ids) // page_size
        num_known = len(plan.l1_page_ids)
        new_full = plan.new_l1_page_ids[: full_pages - num_known]
        tail = plan.new_l1_page_ids[full_pages - num_known:]
        saved = 0
        try:
            if plan.request_id is not None:
                request_id, plan.request_id, plan.lease_id = plan.request_id, None, None
                committed_before = self.stats().get("committed_pages", 0)
                try:
                    self.connector.save(request_id, plan.token_ids, plan.l1_page_ids + new_full)
                finally:
                    self._end_request(request_id)
                saved = self.stats().get("committed_pages", 0) - committed_before
        finally:
            if new_full:
                duplicates = self.l1_index.insert(plan.token_ids[: full_pages * page_size], new_full,
                                                  start_page=num_known)
                if duplicates:
                    self.l1_pool.free(duplicates)
            self.l1_index.unlock(plan.l1_page_ids)
            if tail:
                self.l1_pool.free(tail)
            self._close_plan(plan)
        return saved

    def abort(self, plan: RequestPlan) -> None:
        """Give up a request: end its lease, free its new pages, unlock its cached ones."""
        self._check_open(plan)
        try:
            if plan.request_id is not None:
                request_id, plan.request_id, plan.lease_id = plan.request_id, None, None
                self._end_request(request_id)
        finally:
            self.l1_index.unlock(plan.l1_page_ids)
            self.l1_pool.free(plan.new_l1_page_ids)
            self._close_plan(plan)

    def _end_request(self, request_id: int) -> None:
        """request_finished, then wait (bounded) until the connector has ended the request: its
        transfers done, its saves committed or its lease released."""
        self.connector.request_finished(request_id)
        deadline = time.monotonic() + self.connector.config.reply_timeout_s
        while self.connector.is_open(request_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id}'s transfers were not done within "
                                   f"{self.connector.config.reply_timeout_s} s")
            self._synchronize()
            self.connector.finished()

    def _synchronize(self) -> None:
        if self.l1_pool.device.type == "cuda":
            torch.cuda.synchronize(self.l1_pool.device)

    def _check_open(self, plan: RequestPlan) -> None:
        if plan.finished:
            raise ValueError("this request plan is already finished or aborted")

    def _close_plan(self, plan: RequestPlan) -> None:
        plan.finished = True
        self._open_plans.remove(plan)

    def _allocate_l1(self, num_pages: int) -> list[int]:
        if num_pages == 0:
            return []
        if not self.l1_pool.can_allocate(num_pages):
            evicted = self.l1_index.evict(num_pages - self.l1_pool.num_free)
            if evicted:
                self.l1_pool.free(evicted)
        page_ids = self.l1_pool.allocate(num_pages)
        if page_ids is None:
            raise L1Full(f"need {num_pages} L1 pages, {self.l1_pool.num_free} free after evicting "
                         "every unlocked cached page")
        return page_ids

    # ---- introspection and shutdown ---------------------------------------------------------------

    def read_tokens_kv(self, page_ids: Sequence[int]) -> torch.Tensor:
        """The KV of the given L1 pages in page-major order [n, 2, L, P, H, D] (a copy, for checks)."""
        index = torch.as_tensor(list(page_ids), dtype=torch.long, device=self.l1_pool.kv.device)
        return self.l1_pool.kv.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()

    def check_integrity(self) -> None:
        self.l1_pool.check_integrity()
        self.l1_index.check_integrity()
        cached = {p for p in range(self.l1_pool.num_pages) if self.l1_index.contains_page(p)}
        in_plans = {p for plan in self._open_plans for p in plan.new_l1_page_ids}
        free = {p for p in range(self.l1_pool.num_pages) if self.l1_pool.is_free(p)}
        if cached & free or in_plans & free or cached & in_plans:
            raise AssertionError("an L1 page is at once cached, free or owned by a request")
        if len(cached) + len(free) + len(in_plans) != self.l1_pool.num_pages:
            raise AssertionError("L1 pages are leaked: cached + free + in requests != capacity")
        open_requests = {plan.request_id for plan in self._open_plans if plan.request_id is not None}
        if self.connector.num_open_requests != len(open_requests) \
                or not all(self.connector.is_open(r) for r in open_requests):
            raise AssertionError("the connector's open requests are not the open plans'")

    def close(self) -> None:
        """Abort open requests, then close the connector (its pool and the client), even if an
        abort failed."""
        try:
            for plan in list(self._open_plans):
                self.abort(plan)
        finally:
            self.connector.close()
