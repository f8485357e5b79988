"""A request's lease, got one way, and every lease and lookup call into the client.

Whatever call opens a request (``begin``, ``load``, ``save``), its lease comes the same way:
``open`` builds its acquire (the reservation for its saves included) and sends it (MATCHING), or,
for a predicted decline, keeps it to be sent by the request's next call that needs the reply
(DEFERRED); ``take_reply`` reads the reply into a ``state.Lease`` (LEASED) or fails the request
(FAILED); ``end`` commits the pages its saves wrote, ending the lease, or releases it. The lookups
(``lookups.py``) send and read theirs through ``send_lookup`` and ``lookup_answer``. Nothing else
of the connector calls the client for an acquire, a commit or a release, or reads an acquire reply.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable, Sequence

import numpy as np

from engine_client.client import DaemonDown, DaemonError, DaemonUnavailable, KVCacheClient, PendingLookup
from engine_client.connector.config import ConnectorConfig
from engine_client.connector.state import Cause, Lease, Request, RequestState
from proto import counters
from proto.counters import Counts
from proto.replies import AcquireReply, Decision, LookupReply


def send_lookup(client: KVCacheClient, token_ids, *, tp_group: bool, local_hit_tokens: int, policy: str,
                prefetch: bool) -> PendingLookup:
    return client.lookup_async(token_ids, tp_group=tp_group, local_hit_tokens=local_hit_tokens, policy=policy,
                               prefetch=prefetch)


def lookup_answer(reply: LookupReply) -> tuple[Decision, dict[str, int]]:
    """A lookup's answer: the decision, and the leading tokens each tier holds."""
    return reply.decision, reply.hit_tokens


def _save_skip_cause(save_skipped: str) -> Cause | None:
    """An acquire reply's save_skipped as a Cause; one this connector does not know (a newer daemon
    of the same protocol version may add one) is UNKNOWN, so that the lease is still taken and ended."""
    if not save_skipped:
        return None
    try:
        return Cause(save_skipped)
    except ValueError:
        return Cause.UNKNOWN


class Leases:
    """Opens, answers and ends the leases of one connector's requests."""

    def __init__(self, client: KVCacheClient, page_size: int, counts: Counts,
                 warn_once: Callable[[str, str], None], skip: Callable[[int, Cause], None]):
        self.client = client
        self.page_size = page_size
        self.counters = counts
        self._warn_once = warn_once
        self._skip = skip

    def open(self, request_id: Hashable, token_ids: np.ndarray, config: ConnectorConfig, *, session_id: int | None,
             generation: int, promote: str, local_hit_tokens: int = 0) -> Request:
        """A new request of these page-aligned tokens, its acquire sent, or kept (DEFERRED) where
        promote "recompute" (a predicted decline) says nothing waits for its reply."""
        arguments = dict(save=config.save, promote=promote, generation=generation,
                         local_hit_tokens=local_hit_tokens, policy=config.policy)
        predicted = promote == "recompute"
        request = Request(request_id, token_ids, arguments, session_id=session_id, predicted=predicted,
                          state=RequestState.DEFERRED)
        if not predicted:
            self.send(request)
        return request

    def send(self, request: Request) -> None:
        """DEFERRED -> MATCHING (FAILED where the daemon cannot be asked)."""
        request.transition(RequestState.MATCHING)
        request.match_sent_at = time.monotonic()
        try:
            request.match = self.client.acquire_async(request.token_ids, **request.match_arguments)
        except DaemonUnavailable as exc:
            self.fail(request, exc)
        except BaseException:
            # Nothing was leased: the request ends as one whose acquire failed, its saves skipped.
            request.failure = Cause.SEND_FAILED
            request.transition(RequestState.FAILED)
            self.counters.add(counters.ENGINE_ACQUIRE_FAILURES, 1, Cause.SEND_FAILED)
            raise

    def take_reply(self, request: Request, config: ConnectorConfig, peer=None, timeout_s: float | None = None) -> None:
        """Take the match's reply if it is here (or comes within timeout_s; with None, a reply
        later than ``config.reply_timeout_s`` fails the request, and one that cannot come, its
        session known ended, fails it at once): MATCHING -> LEASED or FAILED. A DEFERRED match is
        sent first."""
        if request.state is RequestState.DEFERRED:
            self.send(request)
        if request.state is not RequestState.MATCHING:
            return
        pending = request.match
        try:
            if timeout_s is None and not pending.wait(0):      # wait(0): in, or none can come
                if time.monotonic() - request.match_sent_at < config.reply_timeout_s:
                    return
                pending.cancel()        # a late reply's lease is released by the client
                self.fail(request, None, config.reply_timeout_s)
                return
            reply = pending.result(timeout_s)
        except (DaemonUnavailable, DaemonError) as exc:
            self.fail(request, exc, config.reply_timeout_s)
            return
        request.match = None
        lease = Lease(
            lease_id=reply.lease_id, hit_pages=reply.reserved_start_token // self.page_size,
            host_page_ids=np.asarray(reply.host_page_ids, dtype=np.int64),
            host_page_generations=np.asarray(reply.host_page_generations, dtype=np.uint64),
            reserved_page_ids=np.asarray(reply.reserved_page_ids, dtype=np.int64), generation=reply.reserved_generation,
            reserve_skipped=_save_skip_cause(reply.save_skipped),
            decision=reply.decision if reply.choice else None, tier_hit_tokens=reply.hit_tokens if reply.choice else {},
            peer_plan=self._peer_plan(peer, reply))
        request.lease = lease
        request.written = np.zeros(len(lease.reserved_page_ids), dtype=bool)
        request.queued = np.zeros(len(lease.reserved_page_ids), dtype=bool)
        request.transition(RequestState.LEASED)
        self.counters.add(counters.ENGINE_ACQUIRES)
        self.counters.add(counters.ENGINE_PROMOTED_TOKENS, reply.promoted_tokens)
        if request.predicted and reply.choice and reply.choice not in ("recompute", "engine"):
            self.counters.add(counters.ENGINE_PREDICTION_MISSES)    # a restore the model would have taken
        lacking = len(request.token_ids) // self.page_size - lease.hit_pages
        if config.save and len(lease.reserved_page_ids) < lacking and lease.reserve_skipped is None:
            self.counters.add(counters.ENGINE_RESERVATION_SHORT_PAGES, lacking - len(lease.reserved_page_ids))

    def _peer_plan(self, peer, reply: AcquireReply):
        """Copy from another engine's GPU cache when the acquire's decision chose it (the daemon's
        cost model prices it against L2, L3 and recompute); None otherwise, or while its owner is
        not open here yet."""
        if peer is None or reply.choice != "peer":
            return None
        plan = peer.plan(reply)
        if plan is not None:
            self.counters.add(counters.ENGINE_PEER_PLANS)
        return plan

    def fail(self, request: Request, exc: Exception | None, reply_timeout_s: float = 0.0) -> None:
        """The request's match failed (exc None: no reply in time): FAILED, its loads failing and its
        saves skipped under the cause, counted here too."""
        if isinstance(exc, DaemonDown):
            cause = Cause.DAEMON_DOWN           # logged once per outage, by the client
        elif isinstance(exc, DaemonUnavailable):
            cause = Cause.DAEMON_UNAVAILABLE
        elif isinstance(exc, DaemonError):
            cause = Cause.MATCH_REFUSED
        else:
            cause = Cause.NO_REPLY
        request.match, request.failure = None, cause
        request.transition(RequestState.FAILED)
        self.counters.add(counters.ENGINE_ACQUIRE_FAILURES, 1, cause)
        if cause is not Cause.DAEMON_DOWN:
            why = exc if exc is not None else f"no reply within {reply_timeout_s} s"
            self._warn_once(cause, f"a match failed ({cause}): {why}")

    def give_up(self, request: Request, cause: Cause) -> None:
        """Stop waiting for the match (given up, or closing): FAILED; a late reply's lease is
        released by the client. Nothing to do once the reply is in."""
        if request.state not in (RequestState.DEFERRED, RequestState.MATCHING):
            return
        if request.match is not None:
            request.match.cancel()
        request.match, request.failure = None, cause
        request.transition(RequestState.FAILED)

    def end(self, request: Request, written_page_ids: Sequence[int], *, same_session: bool, generation: int) -> None:
        """Commit the pages its saves wrote (ending the lease), or release the lease. Not sent at
        all for a session other than the mapped pool's: its lease went with it."""
        lease = request.lease
        written = len(written_page_ids)
        if lease.lease_id is None:
            return
        # Every written page's DMA was seen complete and stamped; once the session ended, the
        # daemon refuses the commit.
        try:
            if not same_session:
                sent = False
            elif written:
                sent = self.client.commit(lease.lease_id, list(written_page_ids), generation)
            else:
                sent = self.client.release(lease.lease_id, generation)
            if written and sent:
                self.counters.add(counters.ENGINE_COMMITTED_PAGES, written)
            elif written:
                self._skip(written, Cause.SESSION_LOST)
        except (DaemonUnavailable, DaemonError) as exc:
            if written:
                self._skip(written, Cause.COMMIT_FAILED)
            self._warn_once("end_of_lease_failed", f"could not end a lease: {exc}")
