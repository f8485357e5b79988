"""The client's connection: its states, the heartbeat thread, outages and re-attach; mixed into
``KVCacheClient`` (``client.py``), whose ``__init__`` makes the fields used here.

Outages. The client's connection is in one of the states of ``ConnectionState``, changed in one
place (``_transition``). The heartbeat thread learns that the daemon is gone from
its socket's monitor (the daemon's end closed: its process exited), from the daemon's SHUTDOWN
message (sent to each socket of a live session when it stops), or from a heartbeat whose reply
does not come (a stalled daemon); the connection is then DOWN, a request that would wait for the
daemon (an acquire, a lookup) raises ``DaemonDown`` at once, without sending anything, and one
already waiting gives up within DOWN_CHECK_INTERVAL_S.
While DOWN, the heartbeat thread keeps probing, off every request's path: a heartbeat answered
for the old session resumes it; a daemon that no longer knows it (restarted, or it expired the
session) gets a new ATTACH with the same geometry, a new session of the next ``generation``.
Objects that hold pages of a session (the connector) tag what they do with its generation,
learn of a re-attach from ``add_reattach_listener`` and of a session's sure end from
``add_session_end_listener`` (so that an engine that makes no call drops the ended session's
pool), and say when nothing of theirs will write the ended session's pages any more
(``mark_drained``): only then does the ATTACH name that session (``previous_session_id``). One
warning per outage, one info line when it ends.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from typing import Any, NamedTuple

import zmq

from engine_client.channel import Channel, DaemonError, DaemonPeerGone, DaemonUnavailable
from proto.errors import ErrorCode, ProtocolError
from proto.messages import MsgKind
from proto.replies import AttachInfo, from_wire

logger = logging.getLogger(__name__)

# A heartbeat not answered within this many heartbeat intervals, and at least STALL_AFTER_S, means
# the daemon stalled (one that exited is known at once from its socket's close). The floor keeps a
# starved host (a daemon and an engine sharing 2 busy cores) from reading a slow reply as an outage.
HEARTBEAT_REPLY_INTERVALS = 2.0
STALL_AFTER_S = 3.0
# While no session was ever attached (attach_later), how often the heartbeat thread tries ATTACH.
ATTACH_PROBE_INTERVAL_S = 0.5
# How long a re-attach waits for the listeners to drain the ended session (mark_drained) before it
# attaches without naming it; counted from the start of the outage.
REATTACH_DRAIN_WAIT_S = 1.0


class ConnectionState(enum.Enum):
    DETACHED = "detached"     # before attach() and after detach()
    ATTACHED = "attached"     # a live session: requests go to the daemon
    DOWN = "down"             # no live session: requests that would wait fail at once; re-attaching
    CLOSED = "closed"


# The legal transitions (KVCacheClient._transition); DOWN -> DOWN updates the reason.
_NEXT_STATES = {
    ConnectionState.DETACHED: {ConnectionState.ATTACHED, ConnectionState.DOWN, ConnectionState.CLOSED},
    ConnectionState.ATTACHED: {ConnectionState.DOWN, ConnectionState.DETACHED, ConnectionState.CLOSED},
    ConnectionState.DOWN: {ConnectionState.DOWN, ConnectionState.ATTACHED, ConnectionState.DETACHED,
                           ConnectionState.CLOSED},
    ConnectionState.CLOSED: set(),
}


class Connection(NamedTuple):
    """One consistent view of the client's connection (replaced whole at each transition)."""

    state: ConnectionState
    generation: int                 # attaches so far: the current (or last) session's number
    info: "AttachInfo | None"       # the current session, or while DOWN the one that ended
    since: float                    # time.monotonic() when this state was entered
    reason: str = ""                # why DOWN
    session_ended: bool = False     # DOWN, and the daemon surely no longer knows the session


class ConnectionKeeper:
    """The connection's transitions and the heartbeat thread of a ``KVCacheClient``."""

    def _transition(self, expected: Connection, state: ConnectionState, *, info: AttachInfo | None = None,
                    reason: str = "", session_ended: bool = False) -> bool:
        """The one place where the connection changes (legal moves: _NEXT_STATES). ``info``: a new
        session, of the next generation. False, and nothing changed, when the connection is no
        longer ``expected`` (another thread moved it first)."""
        with self._state_condition:
            current = self._connection
            if current is not expected:
                return False
            if state not in _NEXT_STATES[current.state]:
                raise RuntimeError(f"illegal connection transition {current.state.value} -> {state.value}")
            now = time.monotonic()
            if info is not None:
                new = Connection(state, current.generation + 1, info, now)
            else:
                since = current.since if state is current.state else now
                new = Connection(state, current.generation, current.info, since, reason, session_ended)
            if state is not ConnectionState.DOWN:
                self._drained_generation = 0
            self._connection = new
            self._state_condition.notify_all()
        if current.state is ConnectionState.ATTACHED and state is ConnectionState.DOWN:
            logger.warning("kvcached daemon at ipc://%s unavailable: %s; requests skip it until it is back "
                           "(re-attaching in the background)", self.socket_path, reason)
        elif current.state is ConnectionState.DOWN and state is ConnectionState.ATTACHED:
            logger.info("kvcached daemon back after %.1f s: %s", now - current.since,
                        f"new session (generation {new.generation})" if info is not None else "session resumed")
        elif state is ConnectionState.DOWN:
            logger.debug("kvcached daemon still unavailable: %s", reason)
        if new.session_ended and not current.session_ended and current.info is not None:
            for listener in list(self._session_end_listeners):
                try:
                    listener(new.generation)
                except Exception:
                    logger.exception("a kvcached session-end listener failed")
        return True

    def _daemon_down(self, seen: Connection, reason: str, session_ended: bool) -> None:
        """What was ``seen`` attached (or down, its session maybe alive) is down now."""
        if seen.state is ConnectionState.ATTACHED or (
                seen.state is ConnectionState.DOWN and session_ended and not seen.session_ended):
            self._transition(seen, ConnectionState.DOWN, reason=reason, session_ended=session_ended)

    def _on_shutdown(self, body: dict[str, Any]) -> None:
        """The daemon's SHUTDOWN, on either socket (either thread); one that names another session
        (an older one, read late) changes nothing."""
        connection = self._connection
        if connection.info is not None and body.get("session_id") == connection.info.session_id:
            self._daemon_down(connection, "the daemon is shutting down", session_ended=True)

    def _on_not_attached(self, generation: int, message: str) -> None:
        """A request of the session of ``generation`` was refused: the daemon does not know it."""
        connection = self._connection
        if connection.generation == generation:
            self._daemon_down(connection, f"the daemon no longer knows the session ({message[:200]})",
                              session_ended=True)

    def _session_gone(self, generation: int) -> str | None:
        """Why requests of the session of ``generation`` will not be answered, or None."""
        connection = self._connection
        if connection.generation != generation:
            return f"the session of generation {generation} has ended"
        if connection.state is ConnectionState.ATTACHED:
            return None
        if connection.state is ConnectionState.DOWN:
            return f"the kvcached daemon is unavailable: {connection.reason}"
        return f"the client is {connection.state.value}"

    def _start_heartbeat_thread(self, channel: Channel) -> None:
        self._stop_heartbeats.clear()
        self._wake_fds = os.pipe()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, args=(channel,),
                                                  name="kvcached-heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def _stop_heartbeat_thread(self) -> None:
        if self._heartbeat_thread is None:
            return
        self._stop_heartbeats.set()
        with self._state_condition:
            self._state_condition.notify_all()      # a re-attach waiting for mark_drained
        os.write(self._wake_fds[1], b"x")
        self._heartbeat_thread.join()
        self._heartbeat_thread = None
        for fd in self._wake_fds:
            os.close(fd)
        self._wake_fds = None

    def _heartbeat_channel(self) -> Channel:
        channel = Channel(self._context, self.socket_path, timeout_s=self.timeout_s, watch_peer=True)
        channel.on_shutdown = self._on_shutdown
        return channel

    def _heartbeat_interval_s(self) -> float:
        info = self._connection.info
        return ATTACH_PROBE_INTERVAL_S if info is None else info.heartbeat_interval_s

    def _heartbeat_loop(self, channel: Channel) -> None:
        try:
            while self._idle(channel, time.monotonic() + self._heartbeat_interval_s()):
                channel = self._beat(channel)
        except Exception:
            logger.exception("the kvcached heartbeat thread failed")
        finally:
            channel.close()

    def _idle(self, channel: Channel, until: float) -> bool:
        """Wait until ``until``, taking in what the heartbeat socket receives meanwhile (a SHUTDOWN
        is heeded at once). False once the thread is to stop."""
        poller = zmq.Poller()
        poller.register(channel.socket, zmq.POLLIN)
        poller.register(channel.monitor, zmq.POLLIN)
        poller.register(self._wake_fds[0], zmq.POLLIN)
        while not self._stop_heartbeats.is_set():
            remaining_s = until - time.monotonic()
            if remaining_s <= 0:
                return True
            ready = dict(poller.poll(max(1, int(remaining_s * 1000))))
            if channel.socket in ready:
                channel.drain()
            if channel.monitor in ready and channel.take_monitor_events():
                return True         # the daemon exited: _beat says so at once
        return False

    def _beat(self, channel: Channel) -> Channel:
        """One heartbeat, or while DOWN one probe: a heartbeat answered resumes the session; a
        session the daemon no longer knows is replaced (_reattach). Returns the channel to go on
        with (a fresh one after a missed reply: what the old one queued is void)."""
        if channel.peer_gone:
            channel = self._daemon_exited(channel)
        connection = self._connection
        reply_timeout_s = max(HEARTBEAT_REPLY_INTERVALS * self._heartbeat_interval_s(), STALL_AFTER_S)
        if connection.state is ConnectionState.DOWN and connection.session_ended:
            return self._reattach(channel, connection, reply_timeout_s)
        sent = time.monotonic()
        try:
            channel.request(MsgKind.HEARTBEAT, {"session_id": connection.info.session_id}, reply_timeout_s)
        except DaemonPeerGone:
            return self._daemon_exited(channel)
        except DaemonError as exc:
            if exc.code != ErrorCode.NOT_ATTACHED:
                logger.warning("heartbeat refused: %s", exc)
                return channel
            self._daemon_down(connection, f"the daemon no longer knows the session ({exc.message[:200]})",
                              session_ended=True)
            return self._reattach(channel, self._connection, reply_timeout_s)
        except DaemonUnavailable:
            self._daemon_down(connection, f"no heartbeat reply within {reply_timeout_s:.2f} s",
                              session_ended=False)
            channel.close()
            return self._heartbeat_channel()
        if self._connection.generation == connection.generation:
            self._session_confirmed_at = sent
        if connection.state is ConnectionState.DOWN:
            self._transition(connection, ConnectionState.ATTACHED)
        return channel

    def _daemon_exited(self, channel: Channel) -> Channel:
        """The daemon's end of the heartbeat socket closed: its process exited, and every session
        with it. DOWN at once, the session ended; a fresh channel waits for the next daemon."""
        self._daemon_down(self._connection, "the daemon exited (its end of the socket closed)", session_ended=True)
        channel.close()
        return self._heartbeat_channel()

    def _reattach(self, channel: Channel, ended: Connection, reply_timeout_s: float) -> Channel:
        """A new session with the same geometry in place of ``ended``'s, naming that one once the
        listeners have drained it; then the listeners learn of the new one."""
        if ended.state is not ConnectionState.DOWN or not ended.session_ended:
            return channel
        if self._reattach_listeners and ended.info is not None:
            with self._state_condition:
                self._state_condition.wait_for(
                    lambda: (self._drained_generation == ended.generation or self._stop_heartbeats.is_set()
                             or self._connection is not ended),
                    timeout=max(0.0, ended.since + REATTACH_DRAIN_WAIT_S - time.monotonic()))
            if self._stop_heartbeats.is_set() or self._connection is not ended:
                return channel
        previous = ended.info.session_id if ended.info is not None and self._drained_generation == ended.generation \
            else None
        sent = time.monotonic()
        try:
            body = channel.request(MsgKind.ATTACH, self._attach_body(self.geometry, previous), reply_timeout_s)
        except DaemonError as exc:
            self._transition(ended, ConnectionState.DOWN, reason=f"re-attach refused: {exc}", session_ended=True)
            return channel
        except DaemonUnavailable:       # no daemon yet (or it exited meanwhile): a fresh channel
            channel.close()
            return self._heartbeat_channel()
        try:
            info = from_wire(AttachInfo, body)
        except ProtocolError as exc:
            self._transition(ended, ConnectionState.DOWN, reason=f"re-attach reply unusable: {exc}",
                             session_ended=True)
            return channel
        self._session_confirmed_at = sent
        if self._transition(ended, ConnectionState.ATTACHED, info=info):
            for listener in list(self._reattach_listeners):
                try:
                    listener(self._connection.generation, info)
                except Exception:
                    logger.exception("a kvcached re-attach listener failed")
        return channel
