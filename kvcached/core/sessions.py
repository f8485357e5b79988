"""Sessions and the one lease lifecycle: a lease is granted on an acquire, and ends exactly once, by
release, by commit, or by reclaim when its session ends (``LeaseState``'s transitions); the private
pages of a lease reclaimed while its process may still write them go to a ``Quarantine`` (see
"Fencing" in docs/architecture.md). No I/O: the server reports a watched process's exit
(``process_gone``) and calls ``expire`` and ``note_running`` from its reaper.
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
from typing import Callable

from kvcached.core import counters
from kvcached.core.leases import Lease, LeaseState, Quarantine, Session
from kvcached.core.metrics import Metrics
from kvcached.core.namespaces import Namespace
from kvcached.core.tiers import Tier
from kvcached.core.tree import TreeNode
from proto.errors import ErrorCode, ProtocolError
from proto.procfs import ProcessIdentity

logger = logging.getLogger(__name__)

# Ids of ended sessions remembered, so that a late commit from one is told (and counted) apart
# from a request naming a session that never existed.
MAX_ENDED_SESSIONS = 4096


class SessionTable:
    def __init__(self, namespaces: dict[int, Namespace], metrics: Metrics, clock: Callable[[], float], *,
                 session_timeout_s: float, session_grace_s: float, session_share: float,
                 on_session_end: Callable[[int], None]):
        """``namespaces``: the daemon's (a lease's pages and locks are its namespace's).
        ``on_session_end``: called with the id of each session that ends, its leases reclaimed."""
        if session_grace_s < session_timeout_s:
            raise ValueError(f"session_grace_s ({session_grace_s}) must be at least session_timeout_s "
                             f"({session_timeout_s})")
        self.session_timeout_s = session_timeout_s
        self.session_grace_s = session_grace_s
        self.session_share = session_share
        self.sessions: dict[int, Session] = {}
        self.leases: dict[int, Lease] = {}
        self.quarantines: dict[int, Quarantine] = {}        # by the ended session's id
        self._ended_session_ids: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._lease_ids = itertools.count(1)
        self._namespaces = namespaces
        self.metrics = metrics
        self._clock = clock
        self._on_session_end = on_session_end
        self._running_at = clock()

    def open(self, namespace: Namespace, identity: ProcessIdentity, client_name: str, *, pid_watched: bool,
             previous_session_id: int) -> Session:
        """A new session of the namespace (see ``DaemonState.attach``)."""
        namespace.idle_since = None
        now = self._clock()
        session_id = secrets.randbits(62) + 1
        while session_id in self.sessions:
            session_id = secrets.randbits(62) + 1
        session = Session(session_id, namespace.namespace_id, identity, client_name, now, now, pid_watched=pid_watched)
        self.sessions[session_id] = session
        namespace.session_ids.add(session_id)
        self.metrics.add(counters.ATTACHES)
        logger.info("session %x attached: pid %d (%s), %s, namespace %d", session_id, identity.pid,
                    "watched" if pid_watched else "heartbeats only", client_name or "-", namespace.namespace_id)
        if previous_session_id:
            self._end_previous_session(session, previous_session_id)
        return session

    def _end_previous_session(self, session: Session, previous_session_id: int) -> None:
        identity = session.identity
        previous = self.sessions.get(previous_session_id)
        quarantine = self.quarantines.get(previous_session_id)
        if previous is not None and previous is not session and previous.identity.same_process(identity):
            self._end_session(previous, reason="replaced by a new session of its process", quarantine=False)
            self.metrics.add(counters.SESSIONS_ENDED, 1, "replaced")
        elif quarantine is not None and quarantine.session.identity.same_process(identity):
            self._end_quarantine(previous_session_id, "reattach")
        elif previous is not None or quarantine is not None:
            self.metrics.add(counters.PREVIOUS_SESSION_REFUSED)
            logger.warning("session %x names session %x as its previous one, which belongs to another "
                           "process; ignored", session.session_id, previous_session_id)

    def get(self, session_id: int) -> Session:
        """A live session, its last sign of life now; NOT_ATTACHED for one ended or never attached."""
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self._ended_session_ids:
                raise ProtocolError(ErrorCode.NOT_ATTACHED, f"session {session_id:x} has ended (detached, "
                                    "expired or replaced); attach again")
            raise ProtocolError(ErrorCode.NOT_ATTACHED, f"no session {session_id:x} (never attached, detached or expired)")
        session.last_seen = self._clock()
        return session

    def detach(self, session_id: int) -> int:
        """End a session and reclaim its leases; returns how many leases were reclaimed. The engine
        detaches once its transfers are drained, so the pages are free at once."""
        session = self.get(session_id)
        return self._end_session(session, reason="detached", quarantine=False)

    def process_gone(self, session_id: int) -> bool:
        """The watched process of a session (live or quarantined) has exited: nothing of it can
        write any more, so its pages are free at once. Returns whether the session was known."""
        session = self.sessions.get(session_id)
        if session is not None:
            self._end_session(session, reason="ended: its process exited", quarantine=False)
            self.metrics.add(counters.SESSIONS_ENDED, 1, "ended_process_gone")
            return True
        if session_id in self.quarantines:
            self._end_quarantine(session_id, "process_gone")
            return True
        return False

    def watches(self, session_id: int) -> bool:
        """Whether the exit of this session's process still matters (process_gone): a watched
        session that is live, or whose pages are quarantined."""
        session = self.sessions.get(session_id)
        return (session.pid_watched if session is not None
                else session_id in self.quarantines and self.quarantines[session_id].session.pid_watched)

    def note_running(self, max_gap_s: float) -> float:
        """Called at least every ``max_gap_s`` while the daemon runs (the reaper): a longer gap is
        time the daemon was stopped or starved, in which it could see no heartbeat, so it is
        credited to every session and quarantine (their clocks stop). Returns the seconds credited."""
        now = self._clock()
        credit_s = now - self._running_at - max_gap_s
        self._running_at = now
        if credit_s <= 0:
            return 0.0
        for session in itertools.chain(self.sessions.values(), (q.session for q in self.quarantines.values())):
            session.last_seen = min(now, session.last_seen + credit_s)
        self.metrics.add(counters.DAEMON_PAUSES)
        self.metrics.add(counters.DAEMON_PAUSED_SECONDS, credit_s)
        logger.warning("the daemon did not run for %.3f s; sessions are credited that time", credit_s)
        return credit_s

    def expire_sessions(self) -> list[int]:
        """End every session silent for too long (session_timeout_s, or session_grace_s when its
        process is watched), quarantining what it could still write; end the quarantines of
        unwatched processes silent for session_grace_s. Returns the ids of the sessions ended."""
        now = self._clock()
        expired = [s for s in self.sessions.values()
                   if now - s.last_seen > (self.session_grace_s if s.pid_watched else self.session_timeout_s)]
        for session in expired:
            if session.pid_watched:
                self._end_session(session, reason=f"silent for {self.session_grace_s} s (its process lives)",
                                  quarantine=True)
                self.metrics.add(counters.SESSIONS_ENDED, 1, "grace_exceeded")
            else:
                self._end_session(session, reason="expired (missed heartbeats)", quarantine=True)
                self.metrics.add(counters.SESSIONS_ENDED, 1, "expired")
        for session_id, quarantine in list(self.quarantines.items()):
            if not quarantine.session.pid_watched and now - quarantine.session.last_seen > self.session_grace_s:
                self._end_quarantine(session_id, "grace")
        return [s.session_id for s in expired]

    def _end_session(self, session: Session, reason: str, quarantine: bool) -> int:
        """quarantine: its process may still write its private pages (they go to a Quarantine)."""
        reclaimed = 0
        quarantined: list[int] = []
        for lease_id in sorted(session.lease_ids):
            self.end_lease(self.leases[lease_id], LeaseState.RECLAIMED, quarantined if quarantine else None)
            reclaimed += 1
        del self.sessions[session.session_id]
        self._on_session_end(session.session_id)
        self._ended_session_ids[session.session_id] = None
        while len(self._ended_session_ids) > MAX_ENDED_SESSIONS:
            self._ended_session_ids.popitem(last=False)
        namespace = self._namespaces[session.namespace_id]
        namespace.session_ids.discard(session.session_id)
        if not namespace.session_ids:
            namespace.idle_since = self._clock()
        if quarantined:
            self.quarantines[session.session_id] = Quarantine(session, quarantined, reason)
            self.metrics.add(counters.QUARANTINES)
            self.metrics.add(counters.QUARANTINED_PAGES, len(quarantined))
        self.metrics.add(counters.LEASES_ENDED, reclaimed, "reclaimed")
        logger.info("session %x %s; %d leases reclaimed, %d pages quarantined", session.session_id, reason,
                    reclaimed, len(quarantined))
        return reclaimed

    def _end_quarantine(self, session_id: int, cause: str) -> None:
        quarantine = self.quarantines.pop(session_id)
        self._namespaces[quarantine.session.namespace_id].l2_allocator.free(quarantine.page_ids)
        self.metrics.add(counters.QUARANTINES_ENDED, 1, cause)
        logger.info("quarantine of session %x ended (%s): %d pages free", session_id, cause.replace("_", " "),
                    len(quarantine.page_ids))

    def reservable_pages(self, session: Session, namespace: Namespace) -> int:
        """How many more L2 pages this session may reserve: ``session_share`` of the namespace's
        pages, less the private pages of all its leases. One cap for every path that reserves L2
        pages for a session (an acquire's reserved pages or its L3 promotion)."""
        held = sum(len(self.leases[lease_id].private_page_ids) for lease_id in session.lease_ids)
        return max(0, int(namespace.num_pages * self.session_share) - held)

    def grant(self, session: Session, namespace: Namespace, token_ids, locked_node: TreeNode | None, hit_pages: int,
              private_page_ids: list[int], generation: int) -> Lease:
        """A lease on an acquire: ``locked_node`` (the deepest node of its L2 hit, locked by the caller)
        is unlocked and ``private_page_ids`` are freed (or quarantined) when it ends."""
        lease = Lease(
            lease_id=next(self._lease_ids),
            session_id=session.session_id,
            namespace_id=namespace.namespace_id,
            token_ids=token_ids,
            locked_node=locked_node,
            hit_pages=hit_pages,
            private_page_ids=private_page_ids,
            generation=generation,
        )
        self.leases[lease.lease_id] = lease
        session.lease_ids.add(lease.lease_id)
        return lease

    def lease_of(self, session_id: int, lease_id: int) -> tuple[Session, Lease]:
        session = self.get(session_id)
        lease = self.leases.get(lease_id)
        if lease is None or lease.state is not LeaseState.ACTIVE:
            raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id} is not active (already released, "
                                "committed or reclaimed, or never granted)")
        if lease.session_id != session_id:
            raise ProtocolError(ErrorCode.NOT_LEASED, f"lease {lease_id} belongs to another session")
        return session, lease

    def count_commit_of_ended(self, session_id: int) -> None:
        """A commit from a session that has ended is refused (session() raises): the engine may have
        written its pages after they were reclaimed. Counted apart from unknown sessions."""
        if session_id not in self.sessions and session_id in self._ended_session_ids:
            self.metrics.add(counters.COMMITS_REFUSED)

    def release(self, session_id: int, lease_id: int) -> None:
        _, lease = self.lease_of(session_id, lease_id)
        self.end_lease(lease, LeaseState.RELEASED)
        self.metrics.add(counters.LEASES_ENDED, 1, "released")

    def end_lease(self, lease: Lease, new_state: LeaseState, quarantined: list[int] | None = None) -> None:
        """quarantined: a list that takes the lease's private pages instead of the allocator."""
        lease.transition(new_state)
        namespace = self._namespaces[lease.namespace_id]
        if lease.locked_node is not None:
            namespace.tree.unlock(lease.locked_node, Tier.L2)
        # Unwritten pages: the lease's writer may no longer claim them (a claim read earlier is
        # the residual window, bounded by the quarantine; see Fencing).
        namespace.generations.revoke(lease.private_page_ids)
        if quarantined is not None:
            quarantined.extend(lease.private_page_ids)
        elif lease.private_page_ids:
            namespace.l2_allocator.free(lease.private_page_ids)
        lease.private_page_ids = []
        del self.leases[lease.lease_id]
        session = self.sessions.get(lease.session_id)
        if session is not None:
            session.lease_ids.discard(lease.lease_id)

    def held_page_ids(self, namespace: Namespace) -> list[int]:
        """The namespace's L2 pages that are private to a lease or quarantined."""
        return ([p for lease in self.leases.values() if lease.namespace_id == namespace.namespace_id
                 for p in lease.private_page_ids]
                + [p for q in self.quarantines.values() if q.session.namespace_id == namespace.namespace_id
                   for p in q.page_ids])
