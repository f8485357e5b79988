"""Tier moves the daemon's loop runs: L2<->L3 through the I/O threads, the remote store's gets
and puts, and the lookups and acquires that wait for them.

Mixed into ``Server`` (``loop.py``): it uses the server's state, ``state_lock``, ``storage``,
``executor``, ``index``, ``remote`` and ``_spawn``/``_spawn_threadsafe``. Each move runs on the
event loop; its file or store I/O runs in a worker thread, and the state is touched only under
``state_lock``. A move always ends (``finish_move``), also when it fails or is cancelled, so its
pages are never leaked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from kvcached.core import counters
from kvcached.core.daemon import RemoteAsk, RemoteWrite
from kvcached.core.storage import SlotLayout
from kvcached.core.tier_ops import TierMove
from kvcached.core.tiers import Tier
from kvcached.server.io_workers import read_pages, write_pages
from kvcached.server.l3_index_store import L3IndexStore
from kvcached.server.remote_store import RemoteUnavailable
from kvcached.server.storage_file import StorageFile
from proto.page_keys import chain_page_keys
from proto.replies import AcquireReply, LookupReply, to_wire
from proto.schema import Acquire, Lookup

logger = logging.getLogger(__name__)

# A write-through waits this long, at most, for the index to forget its slots' old pages.
INDEX_DELETE_TIMEOUT_S = 10.0
# A write-through to the remote store is on no request's path: it may take this many times a get's
# deadline before it counts as failed (and the breaker opens).
PUT_TIMEOUT_FACTOR = 10


class TierMoves:
    """The tier moves of a ``Server``."""

    async def _run_move(self, move: TierMove,
                        then: Callable[[bool], Any] | None = None) -> Any:
        """Run one tier move's file I/O off the loop; publish it on success, return its pages on
        failure. ``then(ok)`` runs under the same hold of the state lock as the publication, so
        nothing (an eviction by another request) can come between them; its result is returned,
        else ``ok``."""
        assert self.storage is not None and self.executor is not None
        namespace = self.state.namespaces[move.namespace_id]
        bytes_per_page = namespace.geometry.bytes_per_page
        assert namespace.l3_allocator is not None
        # Page and slot ids are absolute (kvcached/core/chunks.py): the namespace's pages span the
        # segment from its start, its slots the file.
        layout = SlotLayout(bytes_per_page, namespace.l3_allocator.num_pages)
        pages_end = namespace.num_pages * bytes_per_page
        metrics = self.state.metrics
        direction = move.direction
        enqueued_s = time.perf_counter()
        ok = False
        page_keys: list[bytes] = []
        try:
            with memoryview(self.segment.mapping) as whole, whole[:pages_end] as arena:
                if move.destination is Tier.L3 and self.index is not None:
                    result, page_keys = await self.executor.run(
                        _write_indexed, self.index, self.storage, layout, arena, namespace.geometry.page_size, move)
                elif move.destination is Tier.L3:
                    result = await self.executor.run(write_pages, self.storage, layout, arena, bytes_per_page,
                                                     move.source_page_ids, move.private_page_ids)
                else:
                    result = await self.executor.run(read_pages, self.storage, layout, arena, bytes_per_page,
                                                     move.source_page_ids, move.private_page_ids,
                                                     self.index is not None)
            ok = True
            end_to_end_s = time.perf_counter() - enqueued_s
            with self.state_lock:
                metrics.add(counters.IO_MOVES, 1, direction)
                metrics.add(counters.IO_BYTES, result.num_bytes, direction)
                metrics.add(counters.IO_SERVICE_SECONDS_SUM, result.seconds, direction)
                metrics.add(counters.IO_EXTENTS, result.num_extents, direction)
                metrics.add(counters.IO_QUEUE_WAIT_SECONDS_SUM, max(0.0, end_to_end_s - result.seconds), direction)
                metrics.add(counters.IO_END_TO_END_SECONDS_SUM, end_to_end_s, direction)
                # What a request waiting for such a move would wait: queueing, the file I/O, the hand-back.
                if self.state.cost.add_storage_sample(direction, result.num_bytes, end_to_end_s) and direction == "s2h":
                    self.state.publish_cost_hints()
                metrics.observe(counters.IO_SERVICE_SECONDS, result.seconds, direction)
                metrics.observe(counters.IO_QUEUE_WAIT_SECONDS, max(0.0, end_to_end_s - result.seconds), direction)
                metrics.observe(counters.IO_END_TO_END_SECONDS, end_to_end_s, direction)
        except (OSError, ValueError) as exc:
            if move.destination is Tier.L3:
                with self.state_lock:
                    self.write_backoff.failed(exc)         # one line per cause per interval, a pause
            else:
                logger.warning("%s of %d pages failed: %s", direction, len(move.private_page_ids), exc)
        except BaseException:
            # Cancelled (the daemon is stopping) or our bug: the move still ends, so its pages are
            # not leaked, and the exception goes on (a cancellation must reach the caller).
            with self.state_lock:
                self.state.finish_move(move, ok)
            raise
        with self.state_lock:
            if ok:
                move.page_checksums, move.page_keys = list(result.page_checksums), page_keys
                if move.destination is Tier.L3:
                    self.write_backoff.succeeded()
            self.state.finish_move(move, ok)
            return then(ok) if then is not None else ok

    def _write_through(self, write_through: TierMove | None) -> None:
        if write_through is not None:
            if self.state.pending_moves("h2s") > self.config.max_pending_writes:
                # L3 admission is best effort: a backlog would keep L2 pages locked and slots reserved.
                self.state.finish_move(write_through, ok=False, skipped=True)
            elif not self.write_backoff.allows():
                # Writes fail (a full disk, an I/O error): none is tried until the pause ends.
                self.state.metrics.add(counters.WRITE_BACKOFF_SKIPS)
                self.state.finish_move(write_through, ok=False, skipped=True)
            else:
                self._spawn_threadsafe(self._run_move(write_through))

    def _promote_in_background(self, session_id: int, token_ids: bytes, reply: LookupReply | AcquireReply) -> None:
        """Planned once the answer is sent (``_after_reply``): the promotion (if the model asks for
        one) runs on the loop, and no request waits for it, nor for its planning."""
        if self.storage is None:
            return
        move = self.state.promote_in_background(session_id, token_ids, reply)
        if move is not None:
            self._spawn_threadsafe(self._run_move(move))

    async def _acquire_after(self, request: Acquire, move: TierMove) -> dict[str, Any]:
        """The move an acquire returned runs first (S2H from L3; R2H from the store, waited for at
        most its deadline); then ``acquire_after`` answers, what the move published an L2 hit (the
        engine recomputes what it could not give)."""
        if not move.remote:
            return await self._run_move(move, then=lambda ok: to_wire(self.state.acquire_after(request, move)))
        await self._wait_remote_move(move)
        with self.state_lock:
            return to_wire(self.state.acquire_after(request, move))

    def _remote_ask(self, session_id: int, token_ids: bytes) -> RemoteAsk | None:
        """What to ask the store before a lookup with prefetch or an acquire that waits for its
        promotion: with a remote tier that is reachable now, the pages after the L2 hit
        (``DaemonState.remote_ask``)."""
        if self.remote is None:
            return None
        ask = self.state.remote_ask(session_id, token_ids)
        if ask is None:
            return None
        if not self.remote.available():
            self.remote.count(counters.REMOTE_SKIPS, 1, "exist")
            return None
        return ask

    async def _remote_held_tokens(self, ask: RemoteAsk) -> int:
        """Ask the store which following pages it holds (one call, its own deadline; a failure or
        a late answer is a miss): the leading tokens L2 and the store hold together (0: none)."""
        assert self.remote is not None
        started_s = time.perf_counter()
        try:
            held = await self.remote.run("exist", self.remote.held_pages, ask.namespace_key, ask.token_ids,
                                         ask.page_size, ask.start_page, ask.end_page,
                                         timeout_s=self.config.remote_exist_timeout_s)
        except RemoteUnavailable:
            held = 0
        self.remote.count(counters.REMOTE_LOOKUPS)
        self.remote.count(counters.REMOTE_LOOKUP_SECONDS, time.perf_counter() - started_s)
        self.remote.count(counters.REMOTE_LOOKUP_HELD_PAGES, held)
        return (ask.start_page + held) * ask.page_size if held else 0

    async def _lookup_remote(self, request: Lookup, ask: RemoteAsk) -> dict[str, Any]:
        """A lookup with the store's answer as a candidate."""
        remote_tokens = await self._remote_held_tokens(ask)
        with self.state_lock:
            reply = self.state.lookup(request, remote_tokens)
            self._promote_in_background(request.session_id, request.token_ids, reply)
            return to_wire(reply)

    async def _acquire_remote(self, request: Acquire, ask: RemoteAsk) -> dict[str, Any]:
        """An acquire with the store's answer as a candidate; one whose decision takes it (or L3)
        gets the pages into L2 first."""
        remote_tokens = await self._remote_held_tokens(ask)
        with self.state_lock:
            outcome = self.state.acquire(request, remote_tokens)
            if not isinstance(outcome, TierMove):
                self._promote_in_background(request.session_id, request.token_ids, outcome)
                return to_wire(outcome)
        return await self._acquire_after(request, outcome)

    async def _wait_remote_move(self, move: TierMove) -> None:
        """The store's pages into L2 (R2H), waited for at most their deadline. Past it the acquire
        goes on without them (the engine recomputes), and the gets finish in the background: their
        pages stay reserved until then, and are published if they verify."""
        assert self.remote is not None
        geometry = self.state.namespaces[move.namespace_id].geometry
        timeout_s = self.remote.get_timeout_s(len(move.private_page_ids) * geometry.bytes_per_page)
        task = self._spawn(self._run_remote_move(move))
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except asyncio.TimeoutError:
            self.remote.count(counters.REMOTE_DEADLINE_MISSES, 1, "get")
            self.remote.note_failure("get", f"no pages within {timeout_s:.3f} s")

    async def _run_remote_move(self, move: TierMove) -> None:
        """Get a move's pages from the store into its L2 pages, check each value, finish the move.
        Ends only once the worker has returned: until then its pages stay private."""
        assert self.remote is not None
        namespace = self.state.namespaces[move.namespace_id]
        bytes_per_page = namespace.geometry.bytes_per_page
        num_bytes = len(move.private_page_ids) * bytes_per_page
        started_s = time.perf_counter()
        verified, mismatch, ok = 0, "", False
        try:
            future = self.remote.submit("get", self.remote.get_pages, self.state.remote_namespace_key(namespace),
                                        move.token_ids, namespace.geometry.page_size, move.start_page,
                                        list(move.private_page_ids), bytes_per_page)
            try:
                verified, mismatch = await asyncio.shield(asyncio.wrap_future(future))
                ok = True
            except asyncio.CancelledError:
                await asyncio.gather(asyncio.wrap_future(future), return_exceptions=True)
                raise
            except Exception as exc:
                self.remote.note_failure("get", f"{type(exc).__name__}: {exc}")
        except RemoteUnavailable:
            pass
        except BaseException:
            with self.state_lock:
                self.state.finish_move(move, False)
            raise
        seconds = time.perf_counter() - started_s
        with self.state_lock:
            metrics = self.state.metrics
            if ok:
                move.num_verified_pages, move.mismatch = verified, mismatch
                metrics.add(counters.REMOTE_GET_CALLS)
                metrics.add(counters.REMOTE_HIT_PAGES, verified)
                metrics.add(counters.REMOTE_BYTES, verified * bytes_per_page, "read")
                metrics.observe(counters.IO_END_TO_END_SECONDS, seconds, "r2h")
                if verified == len(move.private_page_ids):     # what an acquire waiting for such a get waits
                    self.state.cost.add_storage_sample("r2h", num_bytes, seconds)
            self.state.finish_move(move, ok)

    def _queue_remote_write(self, write: RemoteWrite) -> None:
        """The state's sink (under state_lock): send a committed path's pages to the store in the
        background; skipped (its pages unlocked at once) while the store is unreachable or too many
        writes are in flight."""
        assert self.remote is not None
        if len(self.state.remote_writes) > self.config.max_pending_writes:
            self.remote.count(counters.REMOTE_WRITE_BACKLOG_SKIPS)
            self.state.finish_remote_write(write, 0)
        elif not self.remote.available():
            self.remote.count(counters.REMOTE_SKIPS, 1, "put")
            self.state.finish_remote_write(write, 0)
        else:
            self._spawn_threadsafe(self._run_remote_write(write))

    async def _run_remote_write(self, write: RemoteWrite) -> None:
        assert self.remote is not None
        namespace = self.state.namespaces[write.namespace_id]
        generations = namespace.generations

        def intact() -> int:        # a worker asks: the leading pages still holding what was published
            return generations.num_leading_intact(write.page_ids, write.generations)

        stored = 0
        try:
            future = self.remote.submit("put", self.remote.put_pages, write.namespace_key, write.token_ids,
                                        write.page_size, write.start_page, write.page_ids, write.bytes_per_page,
                                        intact)
            try:
                stored = await self.remote.wait("put", future, PUT_TIMEOUT_FACTOR * self.remote.get_timeout_s(
                    len(write.page_ids) * write.bytes_per_page))
            except RemoteUnavailable:
                # Failed or late: the pages stay locked until the worker has returned.
                await asyncio.gather(asyncio.wrap_future(future), return_exceptions=True)
        except RemoteUnavailable:
            pass
        finally:
            with self.state_lock:
                self.state.metrics.add(counters.REMOTE_BYTES, stored * write.bytes_per_page, "written")
                self.state.finish_remote_write(write, stored)


def _write_indexed(index: L3IndexStore, storage: StorageFile, layout: SlotLayout, arena: memoryview,
                   page_size: int, move: TierMove) -> tuple[Any, list[bytes]]:
    """A write-through with a persistent index, in an I/O thread: the index forgets what the
    slots held before (so it never names them with another page's bytes), then the bytes go in
    with their checksums; returns them with the keys of the path's pages."""
    index.wait_for_deletes(INDEX_DELETE_TIMEOUT_S)
    result = write_pages(storage, layout, arena, layout.bytes_per_page, move.source_page_ids,
                         move.private_page_ids, checksum=True)
    return result, chain_page_keys(move.token_ids, page_size, move.start_page + len(move.source_page_ids))
