"""A request's state in the connector: one enum, its legal transitions in one table, and the causes
a page is not moved for.

    DEFERRED --send--> MATCHING --reply--> LEASED --finished--> ENDING --transfers done--> ENDED
        |                  |                                      ^
        +------------------+--failed, given up, closing--> FAILED-+

DEFERRED: its match built, not sent yet: sent at once, except for a predicted decline (``begin``),
whose match is sent by the request's next call that needs the reply. MATCHING: the match is sent,
its reply not taken. LEASED: the reply is in (its lease holds the L2 hit and the pages reserved
for its saves, or nothing); its loads and saves are queued as they come.
FAILED: no lease (the match failed, was given up, or the connector is closing); its loads fail and
its saves are skipped under the request's ``failure``. ENDING: the engine finished it; its lease is
committed or released once no transfer of it is in flight. ENDED: nothing of it remains.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Hashable

import numpy as np

from proto.replies import Decision


class Cause(str, enum.Enum):
    """Why a load's pages were not filled or a save's not written (the counters' labels,
    ``proto.counters``; a load's ``LoadResult.reason``)."""

    # a request's match failed: its loads fail, its saves are skipped
    DAEMON_DOWN = "daemon_down"
    DAEMON_UNAVAILABLE = "daemon_unavailable"
    MATCH_REFUSED = "match_refused"
    NO_REPLY = "no_reply"
    SEND_FAILED = "send_failed"
    GIVEN_UP = "given_up"
    CLOSING = "closing"
    # one load's or save's pages
    NOT_CACHED = "not_cached"
    SESSION_LOST = "session_lost"
    STALE_GENERATION = "stale_generation"
    TRANSFER_FAILED = "transfer_failed"
    PEER_CHANGED = "peer_changed"
    REQUEST_FINISHED = "request_finished"
    UNKNOWN = "unknown"
    # saves only
    SAVING_OFF = "saving_off"
    BEYOND_LEASE = "beyond_lease"
    NO_SPACE = "no_space"
    EVICTED_BEFORE_REUSE = "evicted_before_reuse"   # the daemon's choice (a reply's save_skipped)
    GAP = "gap"
    COMMIT_FAILED = "commit_failed"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class RequestState(enum.Enum):
    DEFERRED = "deferred"
    MATCHING = "matching"
    LEASED = "leased"
    FAILED = "failed"
    ENDING = "ending"
    ENDED = "ended"


_NEXT_STATES: dict[RequestState, frozenset[RequestState]] = {
    RequestState.DEFERRED: frozenset({RequestState.MATCHING, RequestState.FAILED}),
    RequestState.MATCHING: frozenset({RequestState.LEASED, RequestState.FAILED}),
    RequestState.LEASED: frozenset({RequestState.ENDING}),
    RequestState.FAILED: frozenset({RequestState.ENDING}),
    RequestState.ENDING: frozenset({RequestState.ENDED}),
    RequestState.ENDED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A request asked to move to a state its state does not lead to (a bug of the connector)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Lease:
    """What a request's match reply gave it (``lease.py`` reads the reply into one)."""

    lease_id: int | None = None         # None: nothing locked or reserved
    hit_pages: int = 0                  # leading pages its loads can read: the L2 hit
    host_page_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))
    host_page_generations: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.uint64))
    reserved_page_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))
    generation: int = 0                 # its saves' write generation
    reserve_skipped: Cause | None = None    # why the daemon reserved no pages for its saves
    decision: Decision | None = None    # the reply's (the cost model's, where it asked)
    tier_hit_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    peer_plan: Any = None               # engine_client.peer.PeerPlan: its loads copy from another engine's GPU


NO_LEASE = Lease()


@dataclasses.dataclass(eq=False)
class Load:
    request_id: Hashable
    start_page: int
    block_ids: np.ndarray
    after: Any                          # the caller's stream event at load()
    job: Any = None                     # its jobs.TransferJob once queued with pages to copy
    num_pages_queued: int = 0
    session_id: int | None = None
    queued: bool = False
    reason: Cause | None = None         # why pages beyond num_pages_queued are not loaded

    @property
    def transfer(self):
        return None if self.job is None else self.job.transfer


@dataclasses.dataclass(eq=False)
class Save:
    first_page: int
    block_ids: np.ndarray               # block of page first_page + i
    after: Any
    job: Any = None                     # its jobs.TransferJob while in flight
    reserve_indices: np.ndarray | None = None  # which pages of the request's reservation it writes
    session_id: int | None = None
    queued: bool = False


@dataclasses.dataclass(eq=False)
class Request:
    request_id: Hashable
    token_ids: np.ndarray               # int32, whole pages: what the lease covers
    match_arguments: dict               # what its match asks (lease.py sends it)
    session_id: int | None = None
    predicted: bool = False             # begun on a predicted decline: recomputed whatever the reply says
    state: RequestState = RequestState.MATCHING
    match: Any = None                   # the client's PendingAcquire while MATCHING
    match_sent_at: float = 0.0
    failure: Cause | None = None        # FAILED: why (loads fail, saves skip with it)
    lease: Lease = NO_LEASE
    written: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, bool))  # per reserved page
    queued: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, bool))   # per reserved page
    loads: list[Load] = dataclasses.field(default_factory=list)
    saves: list[Save] = dataclasses.field(default_factory=list)
    finished: bool = False              # the engine finished it (request_finished)
    hold_blocks: bool = False           # request_finished returned True, and finished() has not released it

    def transition(self, new_state: RequestState) -> None:
        """Move to ``new_state``; raises IllegalTransition (changing nothing) unless the table allows it."""
        if new_state not in _NEXT_STATES[self.state]:
            raise IllegalTransition(f"request {self.request_id!r}: {self.state.value} -> {new_state.value}")
        self.state = new_state

    @property
    def answered(self) -> bool:
        """Whether its match is settled (a lease, or none for good): its transfers may be queued."""
        return self.state in (RequestState.LEASED, RequestState.FAILED, RequestState.ENDING)

    def settled(self) -> bool:
        """Whether none of its loads is left to report and none of its saves is in flight."""
        return not self.loads and all(save.job is None for save in self.saves)
