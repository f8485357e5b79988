"""An in-process daemon for connector unit tests: ``FakeDaemon`` has the client's request API
(``KVCacheClient``'s calls the connector makes), answered by a small page table here, no socket.

Its L2 pages are a real shared segment (a file in /dev/shm) that the connector maps as it maps
the daemon's pool, with the pages' write generations beside it (``proto.generations``): a save
claims and stamps pages, a load checks them, exactly as against the daemon. What it does not
model: tiers below L2, eviction, the cost model (an acquire's decision is "l2" when L2 holds more
than the engine, else "recompute"), peers, tensor parallelism.

Faults, for the tests to inject:
    hold_replies = True   replies stay unanswered (``ready()`` False) until ``deliver()``
    refuse_next(n)        the next n acquires are refused (DaemonError)
    end_session()         the session ends: its leases are reclaimed, waits fail, listeners told
    reattach()            a new session (the same segment), the re-attach listeners told
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from engine_client.client import Connection, ConnectionState, DaemonDown, DaemonError, DaemonUnavailable
from proto import generations
from proto.errors import ErrorCode
from proto.messages import PROTOCOL_VERSION, KVGeometry, MsgKind
from proto.replies import AcquireReply, AttachInfo, LookupReply
from proto.tokens import token_array, token_bytes


@dataclasses.dataclass(eq=False)
class FakeLease:
    lease_id: int
    token_ids: np.ndarray
    hit_page_ids: list[int]
    reserved_page_ids: list[int]
    generation: int


class FakePending:
    """A reply to come (the calls of the client's pending replies)."""

    def __init__(self, daemon: "FakeDaemon", reply: AcquireReply | LookupReply | None, error: Exception | None, generation: int):
        self._daemon = daemon
        self._reply = reply
        self._error = error
        self.generation = generation
        self._ended = False
        # Whether the reply is in: at once, or (held) at deliver() while its session lasts.
        self.arrived = not daemon.hold_replies
        if not self.arrived:
            daemon.held.append(self)

    def ready(self) -> bool:
        """Whether the reply has come (as the client's: not whether one can still come)."""
        if self._ended:
            raise RuntimeError("this request has already ended (result() or cancel() was called)")
        return self.arrived

    def wait(self, timeout_s: float) -> bool:
        """True once the reply is in or none can come (the session ended); nothing here answers
        while a test waits: held stays held."""
        return self.arrived or self._session_gone()

    def _session_gone(self) -> bool:
        return self._daemon.session_ended or self.generation != self._daemon.generation

    def result(self, timeout_s: float | None = None) -> AcquireReply | LookupReply:
        """As the client's: a reply in is returned, also one whose session has ended since."""
        if self._ended:
            raise RuntimeError("this request has already ended (result() or cancel() was called)")
        if not self.arrived:
            self.cancel()
            if self._session_gone():
                raise DaemonDown("the session ended")
            raise DaemonUnavailable(f"no reply within {timeout_s} s")
        self._ended = True
        if self._error is not None:
            raise self._error
        return self._reply

    def cancel(self) -> None:
        """Give it up: the lease of its reply is released (as the client does), unless its session
        ended (the lease went with it: the client sends nothing)."""
        if not self._ended:
            self._ended = True
            if self._reply is not None and self._reply.lease_id is not None:
                self._daemon.release(self._reply.lease_id, self.generation)


class FakeDaemon:
    """See the module note. ``num_pages`` L2 pages, allocated on attach for the geometry given."""

    def __init__(self, num_pages: int = 64):
        self.num_pages = num_pages
        self._dir = tempfile.mkdtemp(prefix="kvcached-fake-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.socket_path = os.path.join(self._dir, "none.sock")
        self.hold_replies = False
        self.held: list[FakePending] = []        # replies held, to be answered by deliver()
        self.session_ended = False
        self.cost_samples: list[tuple[str, int, float]] = []
        self.reports: list[dict[str, Any]] = []
        self.leases: dict[int, FakeLease] = {}
        self.page_of: dict[bytes, int] = {}       # token bytes of pages [0, i] -> the L2 page of page i
        self._refusals = 0
        self._errors: list[DaemonError] = []
        self._next_lease_id = 1
        self._next_generation = 1
        self._generation = 0
        self._info: AttachInfo | None = None
        self.reattach_listeners: list[Callable] = []
        self.session_end_listeners: list[Callable] = []
        self.drained: list[int] = []
        self.closed = False
        self.words: np.ndarray | None = None
        self.segment: np.ndarray | None = None

    # ---- the client's session calls ---------------------------------------------------------------

    def attach(self, geometry: KVGeometry) -> AttachInfo:
        self.geometry = geometry
        shm_path = os.path.join(self._dir, "l2")
        generations_path = os.path.join(self._dir, "generations")
        for path, size in ((shm_path, self.num_pages * geometry.bytes_per_page),
                           (generations_path, generations.file_bytes(self.num_pages))):
            with open(path, "wb") as f:
                f.truncate(size)
        self.segment = np.memmap(shm_path, dtype=np.uint8, mode="r+")
        self.words = np.memmap(generations_path, dtype="<u8", mode="r+")
        self.free_page_ids = list(range(self.num_pages))
        self._generation += 1
        self._info = AttachInfo(self._generation, 1, shm_path, self.num_pages, geometry.bytes_per_page, 1.0, 10.0,
                                1 << 20, os.getpid(), PROTOCOL_VERSION, generations_path=generations_path)
        return self._info

    def attach_later(self, geometry: KVGeometry, reason: str) -> None:
        raise AssertionError("the fake daemon always takes an attach")

    @property
    def info(self) -> AttachInfo | None:
        return self._info

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def connection(self) -> Connection:
        state = ConnectionState.DOWN if self.session_ended else ConnectionState.ATTACHED
        return Connection(state, self._generation, self._info, 0.0, session_ended=self.session_ended)

    def is_attached(self, generation: int | None = None) -> bool:
        return not self.session_ended and not self.closed and generation in (None, self._generation)

    def add_reattach_listener(self, listener) -> None:
        self.reattach_listeners.append(listener)

    def remove_reattach_listener(self, listener) -> None:
        self.reattach_listeners.remove(listener)

    def add_session_end_listener(self, listener) -> None:
        self.session_end_listeners.append(listener)

    def remove_session_end_listener(self, listener) -> None:
        self.session_end_listeners.remove(listener)

    def mark_drained(self, generation: int) -> None:
        self.drained.append(generation)

    def poll_errors(self) -> list[DaemonError]:
        errors, self._errors = self._errors, []
        return errors

    def flush(self, timeout_s: float | None = None) -> list[DaemonError]:
        return self.poll_errors()

    def report(self, report: dict[str, Any], cost_samples: Sequence[tuple[str, int, float]] = ()) -> bool:
        self.reports.append(report)
        self.cost_samples += [tuple(sample) for sample in cost_samples]
        return True

    def close(self) -> None:
        self.closed = True

    def cleanup(self) -> None:
        """Remove the segment's files (the test's end)."""
        self.segment = self.words = None
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- faults -------------------------------------------------------------------------------------

    def deliver(self) -> None:
        """Answer the replies held so far (those of the live session: an ended one's never come),
        and those to come."""
        self.hold_replies = False
        for pending in self.held:
            pending.arrived = not self.session_ended and pending.generation == self._generation
        self.held = []

    def refuse_next(self, count: int = 1) -> None:
        self._refusals += count

    def end_session(self) -> None:
        """The session ends: every lease reclaimed (its reserved pages revoked), every wait failing."""
        self.session_ended = True
        for lease_id in list(self.leases):
            self._end_lease(lease_id, committed=0)
        for listener in list(self.session_end_listeners):
            listener(self._generation)

    def reattach(self) -> AttachInfo:
        """A new session over the same segment; the re-attach listeners are told."""
        self.session_ended = False
        self._generation += 1
        self._info = self._info._replace(session_id=self._generation)
        for listener in list(self.reattach_listeners):
            listener(self._generation, self._info)
        return self._info

    # ---- acquires, lookups, commits, releases ----------------------------------------------------------

    def acquire_async(self, token_ids, save: bool = False, promote: str = "wait",
                      generation: int | None = None, *, local_hit_tokens: int = 0, policy: str = "") -> FakePending:
        self._check_live(generation)
        if self._refusals:
            self._refusals -= 1
            return FakePending(self, None, DaemonError(ErrorCode.INTERNAL, "refused by the test", MsgKind.ACQUIRE),
                               self._generation)
        return FakePending(self, self._answer(token_ids, local_hit_tokens, lock=True, reserve=save),
                           None, self._generation)

    def lookup_async(self, token_ids, tp_group: bool = False, generation: int | None = None, *,
                     local_hit_tokens: int = 0, policy: str = "", prefetch: bool = False) -> FakePending:
        self._check_live(generation)
        return FakePending(self, self._answer(token_ids, local_hit_tokens, lock=False, reserve=False), None,
                           self._generation)

    def commit(self, lease_id: int, page_ids: Sequence[int], generation: int | None = None) -> bool:
        if self._ended(generation):
            return False                # not sent, as the client's: the lease went with the session
        lease = self.leases.get(lease_id)
        if lease is None:
            self._errors.append(DaemonError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id}", MsgKind.COMMIT))
            return True
        if list(page_ids) != lease.reserved_page_ids[:len(page_ids)]:
            raise AssertionError(f"a commit of pages {list(page_ids)} not a prefix of the reserved ones")
        if not np.all(self.words[np.asarray(page_ids, dtype=np.int64)] == lease.generation):
            raise AssertionError("a commit of pages not stamped with the lease's generation")
        first = len(lease.hit_page_ids)
        page_size = self.geometry.page_size
        for i, page_id in enumerate(page_ids):
            self.page_of[token_bytes(lease.token_ids[:(first + i + 1) * page_size])] = int(page_id)
        self._end_lease(lease_id, committed=len(page_ids))
        return True

    def release(self, lease_id: int, generation: int | None = None) -> bool:
        if self._ended(generation):
            return False                # not sent, as the client's: the lease went with the session
        if lease_id not in self.leases:
            self._errors.append(DaemonError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id}", MsgKind.RELEASE))
            return True
        self._end_lease(lease_id, committed=0)
        return True

    def page_bytes(self, page_id: int) -> np.ndarray:
        """The bytes of one L2 page (a copy)."""
        size = self.geometry.bytes_per_page
        return np.array(self.segment[page_id * size:(page_id + 1) * size])

    def _ended(self, generation: int | None) -> bool:
        """Whether the session of ``generation`` (None: the current one) ended: the client then
        sends no commit or release for it."""
        return self.session_ended or generation not in (None, self._generation)

    def _check_live(self, generation: int | None) -> None:
        if self.closed or self.session_ended or generation not in (None, self._generation):
            raise DaemonDown("the session ended")

    def _answer(self, token_ids, local_hit_tokens: int, *, lock: bool, reserve: bool) -> AcquireReply | LookupReply:
        page_size = self.geometry.page_size
        tokens = token_array(token_bytes(token_ids))
        num_pages = len(tokens) // page_size
        hit: list[int] = []
        while len(hit) < num_pages:
            page_id = self.page_of.get(token_bytes(tokens[:(len(hit) + 1) * page_size]))
            if page_id is None:
                break
            hit.append(page_id)
        hit_tokens = len(hit) * page_size
        own = local_hit_tokens // page_size * page_size
        choice, restore = ("l2", hit_tokens) if hit_tokens > own else ("recompute", own)
        decision = dict(choice=choice, restore_tokens=restore, policy="always")
        if not lock:
            return LookupReply({"l2": hit_tokens}, choice, restore, {}, "always")
        reserved = []
        generation = 0
        if reserve and num_pages > len(hit):
            generation = self._next_generation
            self._next_generation += 1
            reserved = [self.free_page_ids.pop(0) for _ in range(min(num_pages - len(hit), len(self.free_page_ids)))]
            self.words[reserved] = generations.reserved(generation)
        lease_id = None
        if hit or reserved:
            lease_id = self._next_lease_id
            self._next_lease_id += 1
            self.leases[lease_id] = FakeLease(lease_id, tokens[:num_pages * page_size], hit, reserved, generation)
        return AcquireReply({"l2": hit_tokens}, lease_id, hit, [int(self.words[p]) for p in hit],
                            reserved_start_token=hit_tokens, reserved_page_ids=reserved,
                            reserved_generation=generation, **decision)

    def _end_lease(self, lease_id: int, committed: int) -> None:
        """Pages reserved and not committed are revoked (word 0) and free again."""
        lease = self.leases.pop(lease_id)
        unused = lease.reserved_page_ids[committed:]
        self.words[unused] = 0
        self.free_page_ids += unused


@contextlib.contextmanager
def saves_held(connector) -> Iterator[Callable[[], None]]:
    """Saves the connector queues inside the block read their blocks at once, but their DMA stays
    in flight (``done()`` False) until the function it yields is called. Nothing of the hold is
    left on the connector after the block (no view of its pool is kept)."""
    transfer = connector.transfer
    queue_save = transfer.save
    released = []

    class InFlight:
        def __init__(self, queued):
            self.queued = queued

        def __getattr__(self, name):
            return getattr(self.queued, name)

        def done(self) -> bool:
            return bool(released) and self.queued.done()

    transfer.save = lambda *args, **kwargs: InFlight(queue_save(*args, **kwargs))
    try:
        yield lambda: released.append(True)
    finally:
        del transfer.save
