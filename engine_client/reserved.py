"""Backups with no round trip before their DMA, and restores that start before the match reply.

A backup normally waits for the daemon to say where to write (a match with reserve_backup).
``ReservedPages`` holds private L2 pages ahead of time (standing leases, topped up in the
background), so a backup's DMA goes into them at once; the commit that follows tells the daemon
which prefix they hold (``KVCacheClient.commit_pages``).

A restore normally waits for the match reply to know which L2 pages to read. ``L2Hints``
remembers where this engine's own backups went, with each page's allocation epoch. A restore
of such a prefix is queued from those pages before the reply comes; the reply then either
confirms it (the same pages at the same epochs: no page was handed to anyone else since the
backup, so its bytes are the backup's, and the lease keeps them so) or not, and the restore
is queued again from the pages the reply names (``confirm_restore``). A speculative restore
writes only the L1 pages the engine is restoring into, which nothing reads before the restore
is confirmed.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from typing import NamedTuple, Sequence

import numpy as np

from engine_client.client import (WIRE_TOKEN_DTYPE, DaemonDown, DaemonError, DaemonUnavailable, KVCacheClient,
                                  MatchReply, PendingReservation, token_bytes)
from engine_client.transfer import Transfer, TransferEngine

logger = logging.getLogger(__name__)


class TakenPages(NamedTuple):
    """Pages taken from a standing lease for one backup; commit or put back exactly once."""

    lease_id: int
    page_ids: list[int]
    page_epochs: list[int]


@dataclasses.dataclass(eq=False)
class _Chunk:
    lease_id: int
    page_ids: list[int]          # not taken yet, in the daemon's order
    page_epochs: list[int]
    taken: set[int] = dataclasses.field(default_factory=set)    # taken, neither committed nor put back


class ReservedPages:
    """Private L2 pages held ahead of backups, in chunks of ``chunk_pages`` (one standing lease
    each). When fewer than ``low_water_pages`` are left, ``top_up`` asks for one more chunk without
    waiting (call it while a backup's DMA runs; ``commit`` calls it too); its reply is taken in by
    a later ``take``. ``close`` releases what is left. The leases are the session's that was current
    at construction (its ``generation``): once that session has ended they are void, nothing is
    taken or released any more, and a re-attached client needs a new ReservedPages."""

    # Pages are taken only while the daemon is sure to keep the session (and these leases) alive at
    # least this share of its timeout longer: enough for the backup's DMA and its commit.
    MIN_SESSION_SHARE = 0.5

    def __init__(self, client: KVCacheClient, chunk_pages: int, low_water_pages: int | None = None):
        if type(chunk_pages) is not int or chunk_pages < 1:
            raise ValueError(f"chunk_pages must be a positive integer, got {chunk_pages!r}")
        if client.info is None or client.geometry is None:
            raise ValueError("attach the client first")
        self.client = client
        self.generation = client.generation
        self.chunk_pages = chunk_pages
        self.low_water_pages = chunk_pages if low_water_pages is None else low_water_pages
        self._chunks: list[_Chunk] = []
        self._pending: PendingReservation | None = None
        self._closed = False

    @property
    def num_free(self) -> int:
        return sum(len(chunk.page_ids) for chunk in self._chunks)

    def fill(self) -> None:
        """Wait until a chunk is held (or the daemon had none to give): for start-up."""
        self._collect(wait=True)
        if not self._chunks or self.num_free < self.low_water_pages:
            self._pending = self.client.reserve_pages_async(self.chunk_pages, generation=self.generation)
            self._collect(wait=True)

    def take(self, num_pages: int) -> TakenPages | None:
        """num_pages pages of one standing lease, or None when no chunk has that many (back up
        through a match's reservation instead). Sends nothing (see top_up)."""
        if self._closed:
            raise RuntimeError("closed")
        if self.client.generation != self.generation:
            # The session ended (the client re-attached): its leases, and their pages, are void.
            self._chunks.clear()
            return None
        if self.client.session_valid_for() < self.MIN_SESSION_SHARE * self.client.info.session_timeout_s:
            return None      # heartbeats are late: the leases may not outlive the backup
        self._collect(wait=False)
        taken = None
        for chunk in self._chunks:
            if len(chunk.page_ids) >= num_pages:
                taken = TakenPages(chunk.lease_id, chunk.page_ids[:num_pages], chunk.page_epochs[:num_pages])
                del chunk.page_ids[:num_pages], chunk.page_epochs[:num_pages]
                chunk.taken.update(taken.page_ids)
                break
        return taken

    def top_up(self) -> None:
        """Ask for one more chunk, without waiting, if fewer than low_water_pages are left and none
        is asked for yet."""
        if not self._closed and self._pending is None and self.num_free < self.low_water_pages:
            try:
                self._pending = self.client.reserve_pages_async(self.chunk_pages, urgent=False,
                                                                generation=self.generation)
            except DaemonDown as exc:       # asked again by a later top-up, if the session resumes
                logger.debug("no reservation while the daemon is down: %s", exc)

    def commit(self, taken: TakenPages, token_ids: Sequence[int] | np.ndarray, start_page: int = 0) -> None:
        """The backup into ``taken`` has completed (its Transfer waited for): publish it as pages
        [start_page, start_page + n) of token_ids. The pages are the daemon's from now on."""
        chunk = self._outstanding_chunk_of(taken)
        page_size = self.client.geometry.page_size
        if type(start_page) is not int or start_page < 0 \
                or len(token_ids) < (start_page + len(taken.page_ids)) * page_size:
            raise ValueError(f"{len(token_ids)} tokens from start_page={start_page!r} do not cover "
                             f"{len(taken.page_ids)} pages of {page_size} tokens")
        self.client.commit_pages(taken.lease_id, token_ids, start_page, taken.page_ids, generation=self.generation)
        chunk.taken.difference_update(taken.page_ids)
        if not chunk.page_ids and not chunk.taken:     # the daemon ended the lease with this commit
            self._chunks.remove(chunk)
        self.top_up()

    def put_back(self, taken: TakenPages) -> None:
        """The backup into ``taken`` did not happen (or failed): its pages can be taken again."""
        chunk = self._outstanding_chunk_of(taken)
        chunk.page_ids[:0] = taken.page_ids
        chunk.page_epochs[:0] = taken.page_epochs
        chunk.taken.difference_update(taken.page_ids)

    def close(self) -> None:
        """Release every standing lease (pages taken and not committed go back with them)."""
        if self._closed:
            return
        self._closed = True
        if self._pending is not None:
            self._pending.cancel()       # its lease, whenever the reply comes, is released
            self._pending = None
        chunks, self._chunks = self._chunks, []
        for chunk in chunks:
            try:
                self.client.release(chunk.lease_id, generation=self.generation)
            except (DaemonUnavailable, DaemonError) as exc:     # its session's end reclaims it
                logger.warning("could not release reserved pages (lease %d): %s", chunk.lease_id, exc)

    def _outstanding_chunk_of(self, taken: TakenPages) -> _Chunk:
        """The chunk ``taken`` came from, if its pages are still out (not committed or put back)."""
        for chunk in self._chunks:
            if chunk.lease_id == taken.lease_id:
                if not taken.page_ids or not chunk.taken.issuperset(taken.page_ids):
                    raise ValueError("these pages are not out: committed or put back already, or never taken")
                return chunk
        raise ValueError(f"lease {taken.lease_id} is not one of this reservation's (or was given up)")

    def _collect(self, wait: bool) -> None:
        if self._pending is None or not (wait or self._pending.ready()):
            return
        pending, self._pending = self._pending, None
        try:
            reservation = pending.result()
        except DaemonDown as exc:
            logger.debug("reserving L2 pages ahead skipped: %s", exc)
            return
        except (DaemonError, DaemonUnavailable) as exc:    # backups go through matches meanwhile
            logger.warning("reserving L2 pages ahead failed: %s", exc)
            return
        if reservation.lease_id is None:
            logger.debug("the daemon had no L2 page to reserve ahead")
            return
        self._chunks.append(_Chunk(reservation.lease_id, list(reservation.page_ids),
                                   list(reservation.page_epochs)))


class L2Hint(NamedTuple):
    page_ids: list[int]          # L2 pages of the prefix's pages [0, n)
    page_epochs: list[int]


class L2Hints:
    """Where this engine's own backups went: for each, the L2 pages and epochs of its prefix's
    pages [0, n), found again by any whole-page prefix of it (a later request that extends a
    backed-up prompt finds that part). Every page boundary of a recorded prefix is keyed by a
    64-bit hash of the tokens up to it; the ``max_pages`` most recently recorded pages are kept
    (whole records, oldest out first). A hash collision can only make the engine read the wrong
    pages speculatively, which the match reply then disproves (hint_holds)."""

    def __init__(self, page_size: int, max_pages: int = 1 << 20, seed: int | None = None):
        if type(page_size) is not int or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        rng = np.random.default_rng(seed)
        self.page_size = page_size
        self.max_pages = max_pages
        self._weights = rng.integers(1, 2**63, size=page_size, dtype=np.uint64) | np.uint64(1)
        self._base = int(rng.integers(1, 2**63)) | 1          # odd: invertible modulo 2**64
        self._powers = np.ones(1, dtype=np.uint64)            # base**k, and its inverse's, mod 2**64
        self._inverse_powers = np.ones(1, dtype=np.uint64)
        self._records: collections.OrderedDict[int, tuple[L2Hint, list[int]]] = collections.OrderedDict()
        self._by_key: dict[int, tuple[int, int]] = {}         # prefix hash -> (record, pages)
        self._record_ids = itertools.count()
        self._num_pages = 0

    def __len__(self) -> int:
        return len(self._records)

    def _prefix_hashes(self, token_ids: Sequence[int] | np.ndarray, num_pages: int) -> np.ndarray:
        """The hash of tokens [0, k * page_size) for k = 1..num_pages: per page a keyed sum of its
        tokens, mixed; chained as sum over pages i < k of h_i * base**(k - 1 - i) (mod 2**64),
        computed all at once as base**(k - 1) * cumsum(h_i * base**-i)."""
        size = num_pages * self.page_size
        tokens = token_ids if isinstance(token_ids, np.ndarray) and token_ids.dtype == WIRE_TOKEN_DTYPE else None
        if tokens is None or not tokens.flags.c_contiguous:
            tokens = np.frombuffer(token_bytes(token_ids)[: size * 4], dtype=WIRE_TOKEN_DTYPE)
        pages = tokens[:size].view(np.uint32).reshape(num_pages, self.page_size).astype(np.uint64)
        hashes = pages @ self._weights
        hashes ^= hashes >> np.uint64(31)
        hashes *= np.uint64(0x9E3779B97F4A7C15)
        hashes ^= hashes >> np.uint64(29)
        self._grow_powers(num_pages)
        chained = np.cumsum(hashes * self._inverse_powers[:num_pages], dtype=np.uint64)
        return chained * self._powers[:num_pages]

    def _grow_powers(self, count: int) -> None:
        have = len(self._powers)
        if have >= count:
            return
        size = max(count, 2 * have)
        inverse = pow(self._base, -1, 1 << 64)
        powers, inverse_powers = [], []
        power, inverse_power = int(self._powers[-1]), int(self._inverse_powers[-1])
        for _ in range(size - have):
            power, inverse_power = power * self._base % (1 << 64), inverse_power * inverse % (1 << 64)
            powers.append(power)
            inverse_powers.append(inverse_power)
        self._powers = np.concatenate([self._powers, np.array(powers, dtype=np.uint64)])
        self._inverse_powers = np.concatenate([self._inverse_powers, np.array(inverse_powers, dtype=np.uint64)])

    def record(self, token_ids: Sequence[int] | np.ndarray, page_ids: Sequence[int],
               page_epochs: Sequence[int]) -> None:
        """Pages [0, len(page_ids)) of token_ids are in these L2 pages, at these epochs. Only once
        their backups have completed (a staged backup writes the pages when it is waited for):
        the reply checks which pages hold the prefix and that they were not handed out again, not
        when they were written."""
        if len(page_ids) != len(page_epochs):
            raise ValueError(f"{len(page_ids)} page ids but {len(page_epochs)} epochs")
        if not page_ids or len(token_ids) < len(page_ids) * self.page_size:
            raise ValueError(f"{len(token_ids)} tokens do not cover {len(page_ids)} pages")
        record_id = next(self._record_ids)
        keys = self._prefix_hashes(token_ids, len(page_ids)).tolist()
        self._records[record_id] = (L2Hint(list(page_ids), list(page_epochs)), keys)
        for count, key in enumerate(keys, 1):
            self._by_key[key] = (record_id, count)            # the newest record wins a shared prefix
        self._num_pages += len(keys)
        while self._num_pages > self.max_pages and len(self._records) > 1:
            old_id, (_, old_keys) = self._records.popitem(last=False)
            self._num_pages -= len(old_keys)
            for key in old_keys:
                if self._by_key.get(key, (None, 0))[0] == old_id:
                    del self._by_key[key]

    def longest(self, token_ids: Sequence[int] | np.ndarray) -> L2Hint | None:
        """The hint for the longest whole-page prefix of token_ids that a recorded backup began
        with (its pages [0, k) only), or None."""
        num_pages = len(token_ids) // self.page_size
        if num_pages == 0 or not self._by_key:
            return None
        keys = self._prefix_hashes(token_ids, num_pages)
        for count in range(num_pages, 0, -1):
            found = self._by_key.get(int(keys[count - 1]))
            if found is not None and found[1] == count:
                hint, _ = self._records[found[0]]
                return L2Hint(hint.page_ids[:count], hint.page_epochs[:count])
        return None

    def get(self, token_ids: Sequence[int] | np.ndarray) -> L2Hint | None:
        """The hint for all the whole pages of token_ids, if a recorded backup covers them."""
        hint = self.longest(token_ids)
        if hint is None or len(hint.page_ids) != len(token_ids) // self.page_size:
            return None
        return hint


def hint_holds(hint: L2Hint, reply: MatchReply) -> bool:
    """Whether the reply proves the hint: its L2 hit starts with the hint's pages at the hint's
    epochs (then no page was reallocated since the backup, and the reply's lease holds them)."""
    count = len(hint.page_ids)
    return (len(reply.host_page_ids) >= count and list(reply.host_page_ids[:count]) == hint.page_ids
            and list(reply.host_page_epochs[:count]) == hint.page_epochs)


def confirm_restore(engine: TransferEngine, speculative: Transfer, hint: L2Hint, reply: MatchReply,
                    l1_page_ids: Sequence[int], first: int = 0) -> tuple[Transfer | None, bool]:
    """The restore to wait for once the match reply of a speculative restore is in, and whether
    the speculation held. The speculative restore read the hint's pages from ``first`` on into
    l1_page_ids. When the hint does not hold, it is waited for, and the restore is queued again
    from the pages the reply names from ``first`` on, for as many of l1_page_ids as the L2 hit
    covers; None when it covers none."""
    if hint_holds(hint, reply):
        return speculative, True
    speculative.wait()       # it writes the same L1 pages: let it finish before the real one
    count = min(len(reply.host_page_ids) - first, len(l1_page_ids))
    if count <= 0:
        return None, False
    return engine.restore(reply.host_page_ids[first:first + count], list(l1_page_ids)[:count]), False
