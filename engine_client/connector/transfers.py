"""A request's copies: each load and save queued as a job through the handler of its route
(``jobs.py``) once the request's reply is in, and completed, counted and timed once seen done."""

from __future__ import annotations

import numpy as np

from engine_client.connector.jobs import Route
from engine_client.connector.state import Cause, Load, Request, Save
from engine_client.engine_api import LoadResult
from proto import counters


class RequestTransfers:
    """``KVConnector``'s queueing and completing of its requests' loads and saves (a mixin)."""

    def _queue_load(self, request: Request, load: Load) -> None:
        load.queued = True
        num_pages = len(load.block_ids)
        lease = request.lease
        if load.reason is not None:             # set by request_finished
            usable = 0
        elif request.failure is not None:
            usable, load.reason = 0, request.failure
        elif lease.peer_plan is not None:
            usable = self._queue_peer_load(lease.peer_plan, load)
        else:
            usable = max(0, min(load.start_page + num_pages, lease.hit_pages) - load.start_page)
            if usable < num_pages:
                load.reason = Cause.NOT_CACHED  # evicted since the lookup, or this rank holds less
            if usable:
                usable = self._queue_l2_load(request, load, usable)
        load.num_pages_queued = usable

    def _queue_l2_load(self, request: Request, load: Load, usable: int) -> int:
        """Queue the copy of the first ``usable`` pages of the load from the request's L2 pages;
        the pages queued (its reason set for the rest)."""
        lease = request.lease
        with self._pool_section(request.session_id) as pool:
            if pool is None:
                load.reason = Cause.SESSION_LOST    # its page ids name another pool's pages (or none)
                return 0
            pages = slice(load.start_page, load.start_page + usable)
            try:
                queued = self.jobs.handler("l2", "gpu").queue(pool, lease.host_page_ids[pages],
                                                              lease.host_page_generations[pages],
                                                              load.block_ids[:usable], load.after)
            except Exception as exc:            # the blocks are recomputed; nothing else depends on them
                self._warn_once("load_transfer_failed", f"a load's transfer failed: {exc!r}")
                load.reason = Cause.TRANSFER_FAILED
                return 0
            if queued.cause is not None:
                load.reason = queued.cause
            if queued.job is None:
                return 0
            load.job = queued.job
            self._track(queued.job.transfer)
        usable = queued.num_pages
        self.counters.add(counters.ENGINE_QUEUED_PAGES, usable, "load")
        load.session_id = request.session_id
        self._queued_loads.append(self._result(load, usable))
        return usable

    def _queue_peer_load(self, plan, load: Load) -> int:
        """Queue the copy of the load's pages from another engine's blocks; the pages queued."""
        num_pages = len(load.block_ids)
        usable = max(0, min(load.start_page + num_pages, plan.num_pages) - load.start_page)
        if usable < num_pages:
            load.reason = Cause.NOT_CACHED
        if not usable:
            return 0
        try:
            queued = self.jobs.handler("peer_gpu", "gpu").queue(plan, load.start_page, load.block_ids[:usable],
                                                                load.after)
        except Exception as exc:                # the blocks are recomputed; nothing else depends on them
            self._warn_once("peer_transfer_failed", f"a peer load's transfer failed: {exc!r}")
            load.reason = Cause.TRANSFER_FAILED
            return 0
        if queued.num_pages < usable:
            usable, load.reason = queued.num_pages, Cause.PEER_CHANGED
        if queued.job is not None:
            load.job = queued.job
            self.counters.add(counters.ENGINE_PEER_QUEUED_PAGES, usable)
            # Provisional, as a load from L2 is: the epochs checked at completion may void it.
            self._queued_loads.append(self._result(load, usable))
        return usable

    def _complete_load(self, request: Request, load: Load) -> None:
        usable, reason, transfer_s = load.num_pages_queued, load.reason, 0.0
        job = load.job
        if job is not None:
            if job.route is Route.PEER_TO_GPU:
                result = self.jobs.complete(job)
            else:
                with self._pool_section(load.session_id, job.transfer) as pool:
                    result = self.jobs.complete(job, pool)
            self._cost_samples.append(result.cost_sample)
            transfer_s = result.device_s
            if result.num_pages < usable:
                usable, reason = result.num_pages, result.cause
            if job.route is Route.PEER_TO_GPU:
                self.counters.add(counters.ENGINE_PEER_LOADED_PAGES, usable)
        failed = len(load.block_ids) - usable
        if failed:
            self._count_failure(failed, reason or Cause.UNKNOWN)
        self.counters.add(counters.ENGINE_LOADED_PAGES, usable)
        load.reason = reason
        self._finished_loads.append(self._result(load, usable, transfer_s))
        request.loads.remove(load)

    def _result(self, load: Load, num_pages: int, transfer_s: float = 0.0) -> LoadResult:
        failed = load.block_ids[num_pages:].tolist()
        reason = load.reason.value if failed and load.reason is not None else None
        return LoadResult(load.request_id, num_pages * self.page_size, failed, reason, transfer_s)

    def _queue_save(self, request: Request, save: Save) -> None:
        save.queued = True
        lease = request.lease
        first, end = save.first_page, save.first_page + len(save.block_ids)
        cached_end = min(end, lease.hit_pages)
        self.counters.add(counters.ENGINE_SAVE_CACHED_PAGES, max(0, cached_end - first))
        first = max(first, lease.hit_pages)
        if first >= end:
            return
        if request.failure is not None:
            self._skip(end - first, request.failure)
            return
        # The lease covers the pages of the tokens its match was sent with; of those the daemon
        # reserved what it could free (hit_pages on): the rest cannot be written.
        lease_end = len(request.token_ids) // self.page_size
        reserved_end = lease.hit_pages + len(lease.reserved_page_ids)
        self._skip(end - max(first, lease_end), Cause.BEYOND_LEASE)
        self._skip(min(end, lease_end) - max(first, reserved_end), lease.reserve_skipped or Cause.NO_SPACE)
        end = min(end, reserved_end)
        if first >= end:
            return
        lo, hi = first - lease.hit_pages, end - lease.hit_pages
        already = int(request.queued[lo:hi].sum())
        if already:          # saved before by this request: written once is enough
            self.counters.add(counters.ENGINE_SAVE_PAGES_AGAIN, already)
        todo = np.flatnonzero(~request.queued[lo:hi]) + lo
        if not len(todo):
            return
        blocks = save.block_ids[todo + lease.hit_pages - save.first_page]
        with self._pool_section(request.session_id) as pool:
            if pool is None:
                self._skip(len(todo), Cause.SESSION_LOST)   # its page ids name another pool's pages (or none)
                return
            try:
                job, claimed = self.jobs.handler("gpu", "l2").queue(blocks, lease.reserved_page_ids[todo], save.after,
                                                                    lease.generation)
            except Exception as exc:            # never committed: the pages go back with the lease
                self._warn_once("save_transfer_failed", f"a save's transfer failed: {exc!r}")
                self._skip(len(todo), Cause.TRANSFER_FAILED)
                return
            if job is not None:
                self._track(job.transfer)
        request.queued[todo] = True
        # Pages no longer reserved for this lease (it ended, they went to another writer): not written.
        self._skip(int((~claimed).sum()), Cause.STALE_GENERATION)
        if job is None:
            return
        save.job = job
        save.reserve_indices = todo[claimed]
        save.session_id = request.session_id
        self.counters.add(counters.ENGINE_QUEUED_PAGES, job.num_pages, "save")

    def _complete_save(self, request: Request, save: Save) -> None:
        job = save.job
        with self._pool_section(save.session_id, job.transfer) as pool:
            result = self.jobs.complete(job, pool)
        self._cost_samples.append(result.cost_sample)
        if result.cause is not None:
            self._skip(job.num_pages - result.num_pages, result.cause)  # its lease went with the session
        else:
            request.written[save.reserve_indices] = True
            self.counters.add(counters.ENGINE_SAVED_PAGES, result.num_pages)
        save.job = None
