"""Following the client's session: the mapped L2 pool is the live session's, or a placeholder.

When the client attaches a new session (the daemon restarted, or ended the old one), the new
session's L2 pool is mapped and pinned on a thread of its own; ``poll`` swaps it in once no
transfer is in flight. The ended session's pool is unmapped sooner, a one-page placeholder taking
its place (a restarted daemon needs its room in /dev/shm): as soon as the client learns that the
session surely ended (its session-end listener, on the heartbeat thread: an engine that makes no
call frees it too) if no copy into or out of it is being queued or in flight, else by the call that
ends the last such copy. Until then new requests skip the daemon, and a request of the ended
session moves nothing and ends nothing: its pages and lease went with it. While the client is
down, the drop or ``poll`` says when nothing writes the ended session's pages any more
(``KVCacheClient.mark_drained``), so that the re-attach lets the daemon free them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import NamedTuple

from engine_client.hints import HintsView
from engine_client.kv_transfer import Transfer
from engine_client.layout import KVLayout
from engine_client.shared_pool import SharedHostPool
from proto.messages import KVGeometry
from proto.replies import AttachInfo

logger = logging.getLogger(__name__)


def _open_pool(layout: KVLayout, geometry: KVGeometry, info: AttachInfo) -> SharedHostPool:
    """Map a session's L2 pool; on CUDA pin it for the device of the engine's tensors."""
    is_cuda = layout.device.type == "cuda"
    return SharedHostPool.open(info.shm_path, info.num_pages, geometry,
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
        return SharedHostPool.open(f"/proc/self/fd/{fd}", 1, geometry, pin=is_cuda,
                                   device=layout.device if is_cuda else None)
    finally:
        os.close(fd)


class _NoSession(NamedTuple):
    """``KVConnector._session`` while no session's pool is mapped (before the first attach, or once
    the ended session's pool is dropped): requests made then belong to no session."""

    session_id: None = None
    shm_path: str = ""
    hints_path: str = ""


class SessionPools:
    """``KVConnector``'s part that follows the client's session (a mixin: the client's listeners
    are its methods). Its state is set up by ``_init_session``, from ``KVConnector.__init__``."""

    def _init_session(self, client) -> None:
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
        if any(t.job is not None and not t.job.done()
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
