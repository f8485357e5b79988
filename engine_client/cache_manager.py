"""The engine side of a request's path: match (L1, then the daemon), restore, publish, back up.

    plan = manager.prepare(token_ids)     # L1 match + ONE round trip to the daemon (+ restore, made
                                          # ready while the round trip is in flight)
    ... the engine prefills tokens [plan.num_cached_tokens, len) into plan.new_l1_page_ids ...
    manager.finish(plan)                  # publish the new full pages in L1, back them up to L2

Ordering, per SPEC: a restore's transfer completes, then its pages are published in the L1
index, and only then does the request's cached length include them. A backup's transfer
completes before its commit is sent, so the daemon never publishes pages that are not written.
The daemon lease of a plan locks the matched L2 prefix (the backup is inserted below it) and owns
the reserved backup pages; it ends by commit or release, never by being forgotten: ``abort`` and
``close`` end it too, and the daemon reclaims it if this process dies.

With ``reserve_ahead_pages`` (engine_client.reserved), the manager holds L2 pages ahead of its
backups instead: the match reserves nothing, ``finish`` writes the new pages into pages it
already holds and commits them with their prefix (no round trip), and it remembers where each
backup went. A later request that begins with such a prefix starts that part's restore from
those pages before the match reply comes; the reply confirms it (same pages, same allocation
epochs) or the restore is redone from the pages it names.

Fencing (docs/architecture.md). A DMA into private L2 pages starts only while the daemon is sure
to keep this session, and so those pages, a while longer (``KVCacheClient.session_valid_for``);
otherwise the backup is skipped. A restore's pages are published only if the session was still
valid once its DMA completed: then the lease held the pages it read throughout.

Outages and re-attach (engine_client.client has the connection's states). While the daemon is
down, ``prepare`` skips it (a miss, counted, nothing logged per request) and ``finish`` backs up
nothing. When the client re-attaches, the new session's L2 pool is mapped and pinned on a thread
of its own; the next ``prepare`` with no transfer in flight swaps it in and unmaps the old one.
Every plan carries the generation of the session its lease and page ids belong to: a plan of an
ended session is finished or aborted in L1 only (no DMA with its page ids, no release of its
lease on another session).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Sequence

import numpy as np
import torch

from engine_client.client import AttachInfo, DaemonDown, DaemonError, DaemonUnavailable, KVCacheClient
from engine_client.l1_index import L1PrefixIndex
from engine_client.l1_pool import L1Pool
from engine_client.reserved import L2Hints, ReservedPages, TakenPages, confirm_restore
from engine_client.shared_pool import SharedHostPool
from engine_client.transfer import TransferEngine
from proto.messages import KVGeometry

logger = logging.getLogger(__name__)

RESTORE_POLICIES = ("always", "never")
# A backup's DMA starts only while the session is known valid for this share of its timeout: enough
# for the DMA and its commit (what a stall beyond it writes, the daemon keeps in quarantine).
BACKUP_SESSION_MARGIN_SHARE = ReservedPages.MIN_SESSION_SHARE


class L1Full(Exception):
    """Not enough L1 pages for the request, even after evicting every unlocked cached page."""


@dataclasses.dataclass(eq=False)      # identity: two plans are never the same request
class RequestPlan:
    token_ids: np.ndarray
    num_cached_tokens: int              # tokens whose KV is in L1 now (a multiple of page_size)
    l1_page_ids: list[int]              # L1 pages holding tokens [0, num_cached_tokens)
    new_l1_page_ids: list[int]          # L1 pages for tokens [num_cached_tokens, len), for the prefill
    l1_hit_tokens: int                  # of num_cached_tokens, how many were already in L1
    restored_tokens: int                # of num_cached_tokens, how many were restored from L2
    l2_hit_tokens: int
    lease_id: int | None
    backup_start_token: int
    backup_page_ids: list[int]
    restore_seconds: float = 0.0
    finished: bool = False
    backup: bool = True                 # back up the new full pages at finish
    hit_page_ids: list[int] = dataclasses.field(default_factory=list)      # the L2 hit's pages and
    hit_page_epochs: list[int] = dataclasses.field(default_factory=list)   # epochs (for hints)
    generation: int = 0                 # the client session's that lease_id and the page ids belong to


class CacheManager:
    def __init__(self, client: KVCacheClient, l1_pool: L1Pool, host_pool: SharedHostPool,
                 transfer: TransferEngine, restore_policy: str = "always", reserve_ahead_pages: int = 0):
        """``reserve_ahead_pages`` > 0: back up into L2 pages held ahead, in chunks of that many
        (another is asked for once half is used; a backup larger than what one chunk has left is
        skipped and counted), and restore speculatively from where this manager's own backups
        went (see the module note)."""
        if restore_policy not in RESTORE_POLICIES:
            raise ValueError(f"restore_policy must be one of {RESTORE_POLICIES}")
        if type(reserve_ahead_pages) is not int or reserve_ahead_pages < 0:
            raise ValueError(f"reserve_ahead_pages must be an integer >= 0, got {reserve_ahead_pages!r}")
        self.client = client
        self.l1_pool = l1_pool
        self.host_pool = host_pool
        self.transfer = transfer
        self.geometry = l1_pool.geometry
        self.page_size = self.geometry.page_size
        self.l1_index = L1PrefixIndex(self.page_size)
        self.restore_policy = restore_policy
        self._open_plans: list[RequestPlan] = []
        self.counters: collections.Counter[str] = collections.Counter()   # fallbacks to recompute
        self._logged_causes: set[str] = set()
        self._pin_report_pending = False
        self.reserve_ahead_pages = reserve_ahead_pages
        self.reserved: ReservedPages | None = None
        self.hints: L2Hints | None = None
        if reserve_ahead_pages:
            self.reserved = self._new_reserved_pages()
            self.hints = L2Hints(self.page_size)
            try:
                self.reserved.fill()
            except (DaemonUnavailable, DaemonError) as exc:    # later takes find none: backups skip
                logger.warning("could not reserve L2 pages ahead: %s", exc)
        # The client session that host_pool, reserved and hints belong to; a re-attach's pool is
        # opened in the background (_open_next_pool) and swapped in by prepare (_follow_session).
        self._generation = client.generation
        self._next_pool_lock = threading.Lock()
        self._next_pool: tuple[int, SharedHostPool] | None = None
        self._next_pool_threads: list[threading.Thread] = []
        self._closed = False
        client.add_reattach_listener(self._on_reattach)

    def _new_reserved_pages(self) -> ReservedPages:
        return ReservedPages(self.client, chunk_pages=self.reserve_ahead_pages,
                             low_water_pages=max(1, self.reserve_ahead_pages // 2))

    @classmethod
    def attach(cls, client: KVCacheClient, geometry: KVGeometry, num_l1_pages: int,
               device: str | torch.device = "cpu", backend: str = "auto",
               restore_policy: str = "always", pin_in_background: bool = True,
               reserve_ahead_pages: int = 0) -> "CacheManager":
        """Attach ``client`` with ``geometry``, make the L1 pool, and map (and on a GPU, pin) the L2 pool.

        ``backend`` picks the page gather/scatter ("auto" times torch against Triton on this
        geometry). On a GPU the L2 pool is pinned in the background by default: attach returns
        once it is mapped, and a transfer waits only for the pinned chunks it touches. The daemon
        is told the chosen backends and the pinning time (``kvcached status``)."""
        info = client.attach(geometry)
        l1_pool = L1Pool(geometry, num_l1_pages, device)
        is_cuda = l1_pool.kv.device.type == "cuda"
        host_pool = SharedHostPool.open(info.shm_path, info.arena_offset_bytes, info.num_pages, geometry,
                                        pin=is_cuda, pin_in_background=pin_in_background,
                                        device=l1_pool.kv.device if is_cuda else None)
        try:
            transfer = TransferEngine(l1_pool, host_pool, backend=backend)
        except BaseException:
            host_pool.close()
            raise
        manager = cls(client, l1_pool, host_pool, transfer, restore_policy, reserve_ahead_pages)
        manager._report_transfer_facts()
        return manager

    def _report_transfer_facts(self) -> None:
        """Tell the daemon the transfer backends and the pinning state; again once pinning is done."""
        pinned = self.host_pool.is_pinned
        self.client.report({"transfer": self.transfer.backend_report(),
                            "pin_seconds": self.host_pool.pin_seconds if pinned else None,
                            "pin": self.host_pool.pin_report()})
        self._pin_report_pending = self.host_pool.pin_requested and not pinned

    # ---- after a re-attach ------------------------------------------------------------------------

    def _on_reattach(self, generation: int, info: AttachInfo) -> None:
        """The client's listener (on its heartbeat thread): map and pin the new session's pool on a
        thread of its own, never on a request's path."""
        thread = threading.Thread(target=self._open_next_pool, args=(generation, info),
                                  name="kvcached-remap", daemon=True)
        with self._next_pool_lock:
            if self._closed:
                return
            self._next_pool_threads = [t for t in self._next_pool_threads if t.is_alive()] + [thread]
        thread.start()

    def _open_next_pool(self, generation: int, info: AttachInfo) -> None:
        kv_device = self.l1_pool.kv.device
        is_cuda = kv_device.type == "cuda"
        try:
            pool = SharedHostPool.open(info.shm_path, info.arena_offset_bytes, info.num_pages, self.geometry,
                                       pin=is_cuda, device=kv_device if is_cuda else None)
        except Exception as exc:       # L2 stays off until the next re-attach
            logger.error("cannot map the L2 pool of the new kvcached session: %s", exc)
            return
        with self._next_pool_lock:
            if self._closed or (self._next_pool is not None and self._next_pool[0] > generation):
                superseded = pool          # closed meanwhile, or a later re-attach's pool is ready
            else:
                superseded = self._next_pool[1] if self._next_pool is not None else None
                self._next_pool = (generation, pool)
        if superseded is not None:
            superseded.close()

    def _follow_session(self) -> None:
        """On the scheduler thread, while the client has no live session of this manager's
        generation: say when nothing writes the ended session's pages any more, and swap in the pool
        of a newer session once it is mapped and pinned and no transfer is in flight."""
        if self.transfer.num_in_flight:
            return
        generation = self.client.generation
        if generation == self._generation:
            self.client.mark_drained(generation)    # DOWN: no transfer starts until it is back
            return
        with self._next_pool_lock:
            if self._next_pool is None or self._next_pool[0] != generation:
                return
            (_, pool), self._next_pool = self._next_pool, None
        self._swap_pool(generation, pool)

    def _swap_pool(self, generation: int, pool: SharedHostPool) -> None:
        """Move to the session of ``generation`` and its pool; the old pool is unpinned and unmapped.
        What belonged to the old session (reserved pages, hints) is dropped, nothing released."""
        old_pool = self.host_pool
        self.transfer.use_host_pool(pool)
        self.host_pool = pool
        if self.reserved is not None:
            self.reserved.close()            # of an ended session: sends nothing
            self.reserved = self._new_reserved_pages()
            self.reserved.top_up()
            self.hints = L2Hints(self.page_size)
        self._generation = generation
        try:
            old_pool.close()
        except RuntimeError as exc:          # a view of it still lives: it is unmapped with the view
            logger.error("the ended session's L2 pool stays mapped: %s", exc)
        logger.info("L2 pool of the new kvcached session (generation %d) in use: %s", generation,
                    self.client.info.shm_path if self.client.info is not None else "?")
        self._report_transfer_facts()

    # ---- per request ----------------------------------------------------------------------------

    def prepare(self, token_ids: Sequence[int] | np.ndarray, backup: bool = True) -> RequestPlan:
        """L1 match, then one round trip to the daemon, then the restore of what L2 adds.

        While the match is in flight, the request's L1 pages beyond the L1 hit are allocated and the
        restore into them is made ready (TransferEngine.start_restore), so that only its DMAs and
        scatters follow the reply. A daemon that does not answer, or a restore that fails, is not
        the request's failure: the plan then covers what L1 holds, and the engine recomputes the
        rest (counted in ``counters``)."""
        generation = self._generation
        if not self.client.is_attached(generation):
            self._follow_session()
            generation = self._generation
        if self._pin_report_pending and self.host_pool.is_pinned:
            self._report_transfer_facts()
        tokens = np.ascontiguousarray(np.asarray(token_ids), dtype=np.int32)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError("token_ids must be a non-empty 1-D sequence")
        page_size = self.page_size
        l1_match = self.l1_index.match(tokens)
        l1_page_ids = list(l1_match.page_ids)
        l1_hit_pages = len(l1_page_ids)
        self.l1_index.lock(l1_page_ids)
        lease_id = None
        pending = prepared = speculative = hint = None
        new_l1_page_ids: list[int] = []
        try:
            try:
                pending = self.client.match_async(tokens, reserve_backup=backup and self.reserved is None,
                                                  generation=generation)
            except DaemonDown:                  # reported once per outage, by the client
                self.counters["daemon_down_skips"] += 1
            except (DaemonUnavailable, DaemonError) as exc:
                logger.warning("match failed, recomputing: %s", exc)
                self.counters["match_failures"] += 1
            # Every page past the L1 hit: restored ones first (a restore covers full pages), then
            # the ones the prefill fills.
            new_l1_page_ids = self._allocate_l1(-(-len(tokens) // page_size) - l1_hit_pages)
            num_restorable = len(tokens) // page_size - l1_hit_pages
            if pending is not None and self.restore_policy == "always" and num_restorable > 0:
                hint = self.hints.longest(tokens) if self.hints is not None else None
                if hint is not None and len(hint.page_ids) > l1_hit_pages:
                    # This manager backed these pages up: read them now, before the reply.
                    speculative = self.transfer.restore(
                        hint.page_ids[l1_hit_pages:], new_l1_page_ids[:len(hint.page_ids) - l1_hit_pages])
                else:
                    hint = None
                    prepared = self.transfer.start_restore(new_l1_page_ids[:num_restorable])
            reply = None
            if pending is not None:
                try:
                    reply = pending.result()
                except DaemonDown:
                    self.counters["daemon_down_skips"] += 1
                except (DaemonUnavailable, DaemonError) as exc:
                    logger.warning("match failed, recomputing: %s", exc)
                    self.counters["match_failures"] += 1
            lease_id = reply.lease_id if reply is not None else None
            l2_hit_tokens = reply.hit_tokens["l2"] if reply is not None else 0
            restored_page_ids: list[int] = []
            restore_seconds = 0.0
            if speculative is not None:
                restored_page_ids, restore_seconds = self._confirm_speculation(
                    speculative, hint, reply, new_l1_page_ids[:num_restorable], l1_hit_pages)
                speculative = None
                if restored_page_ids and not self._session_held_through_restore(generation):
                    restored_page_ids, restore_seconds = [], 0.0
            elif prepared is not None and l2_hit_tokens > l1_match.num_tokens:
                host_page_ids = reply.host_page_ids[l1_hit_pages: l2_hit_tokens // page_size]
                restore_pages = new_l1_page_ids[:len(host_page_ids)]
                try:
                    transfer = prepared.receive_from(host_page_ids)
                    transfer.wait()
                    if self._session_held_through_restore(generation):
                        restore_seconds = transfer.seconds
                        restored_page_ids = restore_pages
                except Exception as exc:       # the transfer failed: recompute instead
                    self._restore_failed(len(host_page_ids), exc)
            elif prepared is not None:
                prepared.cancel()
            prepared = None
            if restored_page_ids:
                # Published in the L1 index only now that the copy is complete. The prefix was
                # locked and absent before; nobody else inserts in between.
                end = (l1_hit_pages + len(restored_page_ids)) * page_size
                duplicates = self.l1_index.insert(tokens[:end], restored_page_ids, start_page=l1_hit_pages)
                assert not duplicates, "restored pages were already cached in L1"
                self.l1_index.lock(restored_page_ids)
                l1_page_ids += restored_page_ids
                new_l1_page_ids = new_l1_page_ids[len(restored_page_ids):]
            # After a failed restore the prefill recomputes from the L1 hit on, so the reserved pages
            # (from the L2 hit on) are still produced and can still be backed up.
            backup_page_ids = list(reply.backup_page_ids) if reply is not None else []
            # With pages reserved ahead, the lease locks the L2 hit until finish commits the pages
            # that follow it (the commit needs the hit still in L2).
            backs_up_after_hit = (self.reserved is not None and backup
                                  and len(tokens) // page_size > l2_hit_tokens // page_size)
            if lease_id is not None and not backup_page_ids and not backs_up_after_hit:
                self._end_lease(lease_id, generation)   # nothing to back up: the read lock is done
                lease_id = None
            num_cached_tokens = len(l1_page_ids) * page_size
        except BaseException:
            if pending is not None:
                pending.cancel()
            if prepared is not None:
                prepared.cancel()
            if prepared is not None or speculative is not None:
                self.transfer.drain()
            self.l1_index.unlock(l1_page_ids)
            self.l1_pool.free(new_l1_page_ids)
            if lease_id is not None:
                self._end_lease(lease_id, generation)
            raise
        plan = RequestPlan(
            token_ids=tokens, num_cached_tokens=num_cached_tokens, l1_page_ids=l1_page_ids,
            new_l1_page_ids=new_l1_page_ids, l1_hit_tokens=l1_match.num_tokens,
            restored_tokens=len(restored_page_ids) * page_size, l2_hit_tokens=l2_hit_tokens, lease_id=lease_id,
            backup_start_token=reply.backup_start_token if reply is not None else 0,
            backup_page_ids=backup_page_ids if lease_id is not None else [],
            restore_seconds=restore_seconds,
            backup=backup,
            hit_page_ids=list(reply.host_page_ids) if reply is not None else [],
            hit_page_epochs=list(reply.host_page_epochs) if reply is not None else [],
            generation=generation,
        )
        self._open_plans.append(plan)
        return plan

    def _confirm_speculation(self, speculative, hint, reply, l1_page_ids: list[int],
                             first: int) -> tuple[list[int], float]:
        """The L1 pages (of l1_page_ids, in order) restored once the reply is in, and the time.
        The speculative restore read the hint's pages from ``first`` on into the leading ones; a
        hint the reply proves is followed by the rest of the L2 hit, if longer; a disproved one is
        restored again from the reply's pages. A failed transfer restores nothing (the request
        recomputes)."""
        if reply is None:                       # no reply: nothing is leased, nothing is proved
            speculative.wait()
            return [], 0.0
        try:
            restore, held = confirm_restore(self.transfer, speculative, hint, reply, l1_page_ids, first)
            self.counters["speculative_restores_confirmed" if held else "speculative_restores_redone"] += 1
            if restore is None:
                return [], 0.0
            done = restore.num_pages
            hit_pages = min(len(reply.host_page_ids) - first, len(l1_page_ids))
            rest = None
            if held and hit_pages > done:       # L2 holds more than this manager's backup did
                rest = self.transfer.restore(reply.host_page_ids[first + done:first + hit_pages],
                                             l1_page_ids[done:hit_pages])
            restore.wait()
            seconds = restore.seconds
            if rest is not None:
                rest.wait()
                seconds += rest.seconds
                done = hit_pages
            return l1_page_ids[:done], seconds
        except Exception as exc:                # the transfer failed: recompute instead
            self._restore_failed(len(l1_page_ids), exc)
            return [], 0.0

    def _session_held_through_restore(self, generation: int) -> bool:
        """Called once a restore's DMA has completed: whether the session, and so the lease on the
        pages it read, was still valid then. If not, those pages may have been given to another
        engine and rewritten under the copy: the request recomputes them."""
        if self.client.session_valid_for(generation) > 0:
            return True
        self._count_once("restores_discarded_session_ended",
                         "a restore completed after its session may have ended; recomputing instead")
        return False

    def _session_allows_backup(self, generation: int) -> bool:
        """Whether a backup's DMA into private L2 pages may start: the daemon keeps the session (and
        the pages) at least BACKUP_SESSION_MARGIN_SHARE of its timeout longer."""
        margin_s = BACKUP_SESSION_MARGIN_SHARE * self.client.info.session_timeout_s
        if self.client.session_valid_for(generation) >= margin_s:
            return True
        if not self.client.is_attached(generation):
            self._count_once("backups_skipped_session_lost", "backups skipped: the daemon ended this session")
        else:
            self._count_once("backups_skipped_session_unconfirmed",
                             f"backups skipped: the session is not known valid for {margin_s:.2f} s more "
                             "(heartbeats late)")
        return False

    def _count_once(self, counter: str, message: str) -> None:
        """Count a fallback; log it the first time this cause is seen."""
        self.counters[counter] += 1
        if counter not in self._logged_causes:
            self._logged_causes.add(counter)
            logger.warning("%s (counted in %s)", message, counter)

    def _restore_failed(self, num_pages: int, exc: Exception) -> None:
        logger.warning("restore of %d pages failed, recomputing: %s", num_pages, exc)
        self.counters["restore_failures"] += 1
        self.transfer.drain()               # nothing of it may still write into these pages

    def _end_lease(self, lease_id: int, generation: int) -> None:
        """Release a lease of the session of ``generation``; once that session has ended nothing
        is sent (the daemon reclaimed the lease with it)."""
        try:
            self.client.release(lease_id, generation)
        except (DaemonUnavailable, DaemonError) as exc:
            logger.warning("could not release lease %d (the daemon reclaims it with the session): %s",
                           lease_id, exc)

    def finish(self, plan: RequestPlan) -> int:
        """After the prefill: publish the new full pages in L1 and back up what the daemon lacks.

        Returns how many pages were backed up."""
        self._check_open(plan)
        page_size = self.page_size
        full_pages = len(plan.token_ids) // page_size
        num_known = len(plan.l1_page_ids)
        new_full = plan.new_l1_page_ids[: full_pages - num_known]
        tail = plan.new_l1_page_ids[full_pages - num_known:]
        all_pages = plan.l1_page_ids + new_full
        backed_up = 0
        try:
            if plan.generation != self._generation or not self.client.is_attached(plan.generation):
                # The daemon is down, or the plan's session ended: its page ids may not be written.
                if plan.backup and (plan.lease_id is not None or self.reserved is not None):
                    self.counters["backups_skipped_daemon_down"] += 1
            elif self.reserved is not None:
                if plan.backup:
                    backed_up = self._back_up_into_reserved(plan, all_pages, full_pages)
            elif plan.lease_id is not None:
                start = plan.backup_start_token // page_size
                count = min(len(plan.backup_page_ids), full_pages - start)
                host_page_ids = plan.backup_page_ids[:count]
                if count > 0 and self._session_allows_backup(plan.generation):
                    self.transfer.backup(all_pages[start:start + count], host_page_ids).wait()
                    self.client.commit_backup(plan.lease_id, host_page_ids, plan.generation)
                    plan.lease_id = None
                    backed_up = count
        except Exception as exc:      # a failed backup loses nothing: the pages stay in L1
            logger.warning("backup of a request failed: %s", exc)
            self.counters["backup_failures"] += 1
        finally:
            if plan.lease_id is not None:
                self._end_lease(plan.lease_id, plan.generation)
                plan.lease_id = None
            if new_full:
                duplicates = self.l1_index.insert(plan.token_ids[: full_pages * page_size], new_full,
                                                  start_page=num_known)
                if duplicates:
                    self.l1_pool.free(duplicates)
            self.l1_index.unlock(plan.l1_page_ids)
            if tail:
                self.l1_pool.free(tail)
            self._close_plan(plan)
        return backed_up

    def _back_up_into_reserved(self, plan: RequestPlan, all_pages: list[int], full_pages: int) -> int:
        """finish's backup with pages reserved ahead: the full pages from the L2 hit on, written
        and committed with their prefix; returns how many. Where they went is remembered."""
        start = plan.backup_start_token // self.page_size
        count = full_pages - start
        if count <= 0 or not self._session_allows_backup(plan.generation):
            return 0
        taken: TakenPages | None = self.reserved.take(count)
        if taken is None:
            self.counters["backups_without_reserved_pages"] += 1
            self.reserved.top_up()
            return 0
        try:
            transfer = self.transfer.backup(all_pages[start:start + count], taken.page_ids)
            self.reserved.top_up()         # while the DMA runs
            transfer.wait()
        except BaseException:
            self.reserved.put_back(taken)
            raise
        tokens = plan.token_ids[: full_pages * self.page_size]
        self.reserved.commit(taken, tokens, start_page=start)
        if len(plan.hit_page_ids) >= start:
            self.hints.record(tokens, plan.hit_page_ids[:start] + taken.page_ids,
                              plan.hit_page_epochs[:start] + taken.page_epochs)
        return count

    def abort(self, plan: RequestPlan) -> None:
        """Give up a request: end its lease, free its new pages, unlock its cached ones."""
        self._check_open(plan)
        if plan.lease_id is not None:
            self._end_lease(plan.lease_id, plan.generation)
            plan.lease_id = None
        self.l1_index.unlock(plan.l1_page_ids)
        self.l1_pool.free(plan.new_l1_page_ids)
        self._close_plan(plan)

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
        self.transfer.check_integrity()
        cached = {p for p in range(self.l1_pool.num_pages) if self.l1_index.contains_page(p)}
        in_plans = {p for plan in self._open_plans for p in plan.new_l1_page_ids}
        free = {p for p in range(self.l1_pool.num_pages) if self.l1_pool.is_free(p)}
        if cached & free or in_plans & free or cached & in_plans:
            raise AssertionError("an L1 page is at once cached, free or owned by a request")
        if len(cached) + len(free) + len(in_plans) != self.l1_pool.num_pages:
            raise AssertionError("L1 pages are leaked: cached + free + in requests != capacity")

    def close(self) -> None:
        """Abort open requests, then close the transfers, the host pool and the client, each even if
        an earlier step failed."""
        with self._next_pool_lock:
            closed_before, self._closed = self._closed, True
            next_pool, self._next_pool = self._next_pool, None
            threads = list(self._next_pool_threads)
        try:
            if not closed_before:
                self.client.remove_reattach_listener(self._on_reattach)
            for plan in list(self._open_plans):
                self.abort(plan)
            if self.reserved is not None:
                self.reserved.close()
        finally:
            try:
                self.transfer.close()
            finally:
                try:
                    self.host_pool.close()
                    if next_pool is not None:
                        next_pool[1].close()
                finally:
                    self.client.close()
                    for thread in threads:      # one still mapping closes what it maps (_closed)
                        thread.join()
