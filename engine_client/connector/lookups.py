"""Lookups: side-effect-free questions to the daemon (``PrefixLookup``, ``PendingLookup``), and
``BegunLookup``, a request's match read as a lookup (``KVConnector.begin``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import numpy as np

from engine_client.client import DaemonDown, DaemonError, DaemonUnavailable, KVCacheClient, PendingReply
from engine_client.connector.lease import lookup_answer, send_lookup
from engine_client.connector.state import Cause, Request, RequestState
from proto import counters
from proto.counters import Counts
from proto.replies import NO_DECISION, Decision

if TYPE_CHECKING:
    from engine_client.connector.kv_connector import KVConnector

logger = logging.getLogger(__name__)

# A lookup's answer: the decision, and the leading tokens each tier holds (the reply's hit_tokens).
_NO_ANSWER: tuple[Decision, dict[str, int]] = (NO_DECISION, {})


class PendingLookup:
    """A lookup sent; ``result()`` is the number of leading tokens to hold once restored: the
    daemon's decision (0 on any failure); ``decision()`` the whole of it; ``hit_tokens()`` what
    each tier holds."""

    def __init__(self, lookup: "PrefixLookup", pending: PendingReply | None):
        self._lookup = lookup
        self._pending = pending
        self._answer: tuple[Decision, dict[str, int]] | None = None if pending is not None else _NO_ANSWER

    def ready(self) -> bool:
        """Whether ``result()`` answers without waiting: the reply is in, or none can come (the
        session known ended: it answers 0). Never waits."""
        if self._answer is not None:
            return True
        try:
            return self._pending.wait(0)
        except (DaemonUnavailable, RuntimeError):
            return True

    def wait(self, timeout_s: float) -> bool:
        """Wait at most timeout_s for the reply; True once it is in (or the lookup failed)."""
        if self._answer is not None:
            return True
        try:
            return self._pending.wait(timeout_s)
        except (DaemonUnavailable, RuntimeError):
            return True

    def result(self, timeout_s: float | None = None) -> int:
        return self.decision(timeout_s).restore_tokens

    def cancel(self) -> None:
        """Give the lookup up (its reply, if it comes, is dropped); result() is 0 from now on."""
        if self._answer is None:
            self._pending.cancel()
            self._answer = _NO_ANSWER

    def give_up(self, waited_s: float) -> None:
        """cancel() a lookup whose reply did not come in time: counted (lookup_failures_no_reply)
        and logged once."""
        if self._answer is None:
            self._lookup._failed("no_reply", DaemonUnavailable(f"no reply to a lookup within {waited_s:.1f} s"))
            self.cancel()

    def decision(self, timeout_s: float | None = None) -> Decision:
        return self._answered(timeout_s)[0]

    def hit_tokens(self, timeout_s: float | None = None) -> dict[str, int]:
        """The leading tokens each tier holds ({} on any failure)."""
        return self._answered(timeout_s)[1]

    def _answered(self, timeout_s: float | None) -> tuple[Decision, dict[str, int]]:
        if self._answer is None:
            self._answer = self._lookup._answer_of(self._pending, timeout_s)
        return self._answer


class BegunLookup:
    """``KVConnector.begin``'s lookup: the request's match, read as a lookup (``PendingLookup``'s
    calls); its decision is the match reply's."""

    def __init__(self, connector: "KVConnector", request: Request, local_hit_tokens: int = 0):
        self._connector = connector
        self._request = request
        self._cancelled = False
        self._counted = False
        self._local_hit_tokens = local_hit_tokens

    def ready(self) -> bool:
        request = self._request
        if request.predicted:
            return True             # the decision needs no reply (the connector's polls take it)
        if request.state is RequestState.MATCHING:
            self._connector._take_reply(request)
        return request.state is not RequestState.MATCHING

    def wait(self, timeout_s: float) -> bool:
        """Wait at most timeout_s for the reply; True once it is in (or the match failed, or the
        decline was predicted: the decision needs no reply)."""
        request = self._request
        if request.state is RequestState.MATCHING and not request.predicted:
            try:
                request.match.wait(timeout_s)
            except (DaemonUnavailable, RuntimeError):
                pass
        return self.ready()

    def result(self, timeout_s: float | None = None) -> int:
        return self.decision(timeout_s).restore_tokens

    def decision(self, timeout_s: float | None = None) -> Decision:
        return self._answered(timeout_s)[0]

    def hit_tokens(self, timeout_s: float | None = None) -> dict[str, int]:
        """The leading tokens each tier holds, by the match reply ({} without one: failed, or a
        predicted decline)."""
        return self._answered(timeout_s)[1]

    def _answered(self, timeout_s: float | None) -> tuple[Decision, dict[str, int]]:
        request = self._request
        connector = self._connector
        if request.predicted and not self._cancelled:
            if not self._counted:
                self._counted = True
                connector.counters.add(counters.ENGINE_LOOKUP_CHOICES, 1, "recompute")
            return Decision("recompute", self._local_hit_tokens), {}
        if request.state is RequestState.MATCHING and not self._cancelled:
            connector._take_reply(request, connector.config.reply_timeout_s if timeout_s is None else timeout_s)
        if request.failure is not None and not self._cancelled:
            self.cancel()           # ended: a later save opens a request (and a match) of its own
        decision = request.lease.decision
        if self._cancelled or request.failure is not None or decision is None:
            return _NO_ANSWER
        if not self._counted:
            self._counted = True
            connector.counters.add(counters.ENGINE_LOOKUP_CHOICES, 1, decision.choice)
            connector.counters.add(counters.ENGINE_LOOKUP_HIT_TOKENS, decision.restore_tokens)
        return decision, request.lease.tier_hit_tokens

    def cancel(self) -> None:
        """Give the request up: it ends (its lease once the reply is in); result() is 0 from now on."""
        if not self._cancelled:
            self._cancelled = True
            request = self._request
            self._connector.leases.give_up(request, Cause.GIVEN_UP)     # a late reply's lease: the client's
            if self._connector._requests.get(request.request_id) is request:    # not ended by the engine
                self._connector.request_finished(request.request_id)

    def give_up(self, waited_s: float) -> None:
        """cancel() a match whose reply did not come in time, counted (lookup_failures_no_reply)."""
        if not self._cancelled and self._request.state is RequestState.MATCHING and not self._request.predicted:
            self._connector.lookups._failed("no_reply",
                                            DaemonUnavailable(f"no reply to a lookup within {waited_s:.1f} s"))
        self.cancel()


class PrefixLookup:
    """Side-effect-free lookups of a namespace (or of its whole tensor-parallel group): no lease,
    no lock, no LRU update. Usable alone by a scheduler process that holds no KV tensors (attach a
    client with any rank's geometry)."""

    def __init__(self, client: KVCacheClient, *, tp_group: bool, promote_l3: bool = True, policy: str = ""):
        self.client = client
        self.tp_group = tp_group
        self.promote_l3 = promote_l3
        self.policy = policy
        self.counters = Counts(counters.ENGINE)

    def lookup_async(self, token_ids: Sequence[int] | np.ndarray, local_hit_tokens: int = 0) -> PendingLookup:
        """``local_hit_tokens``: leading tokens the engine holds itself; the daemon decides for the rest."""
        self.counters.add(counters.ENGINE_LOOKUPS)
        try:
            pending = send_lookup(self.client, token_ids, tp_group=self.tp_group, local_hit_tokens=local_hit_tokens,
                                  policy=self.policy, prefetch=self.promote_l3)
            return PendingLookup(self, pending)
        except DaemonDown:                  # the client logs the outage once
            self.counters.add(counters.ENGINE_LOOKUP_FAILURES, 1, "daemon_down")
            return PendingLookup(self, None)
        except DaemonUnavailable as exc:
            self._failed("unavailable", exc)
            return PendingLookup(self, None)

    def lookup(self, token_ids: Sequence[int] | np.ndarray, timeout_s: float | None = None,
               local_hit_tokens: int = 0) -> int:
        """How many leading tokens of token_ids to hold once restored, by the daemon's decision:
        whole pages, ``local_hit_tokens`` or less when nothing beyond it is worth restoring (0 when
        the daemon is away)."""
        return self.lookup_async(token_ids, local_hit_tokens).result(timeout_s)

    def _answer_of(self, pending: PendingReply, timeout_s: float | None) -> tuple[Decision, dict[str, int]]:
        try:
            decision, hit_tokens = lookup_answer(pending.result(timeout_s))
        except DaemonDown:
            self.counters.add(counters.ENGINE_LOOKUP_FAILURES, 1, "daemon_down")
            return _NO_ANSWER
        except DaemonUnavailable as exc:
            self._failed("unavailable", exc)
            return _NO_ANSWER
        except DaemonError as exc:
            self._failed("refused", exc)
            return _NO_ANSWER
        self.counters.add(counters.ENGINE_LOOKUP_CHOICES, 1, decision.choice)
        self.counters.add(counters.ENGINE_LOOKUP_HIT_TOKENS, decision.restore_tokens)
        return decision, hit_tokens

    def _failed(self, cause: str, exc: Exception) -> None:
        if not self.counters.value(counters.ENGINE_LOOKUP_FAILURES, cause):
            logger.warning("lookup failed (counted as %s, reported once): %s",
                           self.counters.key_of(counters.ENGINE_LOOKUP_FAILURES, cause), exc)
        self.counters.add(counters.ENGINE_LOOKUP_FAILURES, 1, cause)
