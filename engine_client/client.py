"""The engine's synchronous client of the kvcached daemon.

Made for an engine's scheduler thread: every call that waits has a bound (``timeout_s``) and
raises ``DaemonUnavailable`` naming what it waited for, never hangs. Releases and backup
commits are sent without waiting (they are off the request's critical path); their error
replies, if any, are collected as they arrive and handed out by ``poll_errors()``. A
background thread sends heartbeats on its own socket so that a long forward pass does not
look like a dead engine.

Outages. The client's connection is in one of the states of ``ConnectionState``, changed in one
place (``KVCacheClient._transition``). The heartbeat thread learns that the daemon is gone from
its socket's monitor (the daemon's end closed: its process exited), from the daemon's SHUTDOWN
message (sent to each socket of a live session when it stops), or from a heartbeat whose reply
does not come (a stalled daemon); the connection is then DOWN, a request that would wait for the
daemon (a match, a lookup) raises ``DaemonDown`` at once, without sending anything, and one
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
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import zmq
from zmq.utils import monitor as zmq_monitor

from proto import codec, procfs
from proto.errors import ErrorCode, ProtocolError
from proto.messages import PROTOCOL_VERSION, KVGeometry, MsgKind
from proto.replies import AttachInfo, MatchReply, from_wire
from proto.tokens import token_bytes
from proto.paths import UntrustedSocket, check_socket  # noqa: F401 (engines catch UntrustedSocket from here)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_SPIN_S = 200e-6       # busy-wait this long for a reply before blocking
MAX_PENDING_ASYNC = 100_000
# Requests whose reply may carry a lease: a reply nobody waits for any more must end it.
LEASE_KINDS = (MsgKind.MATCH,)
# A heartbeat not answered within this many heartbeat intervals, and at least STALL_AFTER_S, means
# the daemon stalled (one that exited is known at once from its socket's close). The floor keeps a
# starved host (a daemon and an engine sharing 2 busy cores) from reading a slow reply as an outage.
HEARTBEAT_REPLY_INTERVALS = 2.0
STALL_AFTER_S = 3.0
# While a session request waits, how often it checks whether the connection went down meanwhile:
# a request in flight when the daemon is found dead ends this long after, at most.
DOWN_CHECK_INTERVAL_S = 0.01
# While no session was ever attached (attach_later), how often the heartbeat thread tries ATTACH.
ATTACH_PROBE_INTERVAL_S = 0.5
# How often connect(wait_s=...) looks for the daemon's socket.
SOCKET_WAIT_POLL_S = 0.05
# How long a re-attach waits for the listeners to drain the ended session (mark_drained) before it
# attaches without naming it; counted from the start of the outage.
REATTACH_DRAIN_WAIT_S = 1.0


class DaemonUnavailable(Exception):
    """The daemon is not there or did not answer in time."""


class DaemonDown(DaemonUnavailable):
    """Raised at once, nothing sent: the daemon is known to be down, or the session a request
    belongs to (its generation) has ended. Requests skip the daemon until it is back."""


class DaemonPeerGone(DaemonUnavailable):
    """A wait on the heartbeat thread's socket ended: the daemon's process exited."""


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


class DaemonError(Exception):
    """The daemon refused a request: ``code`` and ``message`` say why."""

    def __init__(self, code: int, message: str, kind: MsgKind | None = None):
        try:
            code = ErrorCode(code)
        except ValueError:
            pass
        self.code = code
        self.message = message
        self.kind = kind
        name = getattr(code, "name", str(code))
        super().__init__(f"{kind.name if kind else 'request'} refused: {name}: {message}")


class Connection(NamedTuple):
    """One consistent view of the client's connection (replaced whole at each transition)."""

    state: ConnectionState
    generation: int                 # attaches so far: the current (or last) session's number
    info: "AttachInfo | None"       # the current session, or while DOWN the one that ended
    since: float                    # time.monotonic() when this state was entered
    reason: str = ""                # why DOWN
    session_ended: bool = False     # DOWN, and the daemon surely no longer knows the session


class _Channel:
    """One DEALER socket with request ids and bounded waits (not thread-safe: one per thread).

    Fire-and-forget requests (releases, commits) ask the daemon not to acknowledge success, so
    they cost the daemon one handler call and no reply; an error still gets a reply, matched
    here to its request by id. The daemon handles one socket's requests in order, so the reply
    to any later request proves every earlier one was handled: that is how ``flush`` works.
    """

    def __init__(self, context: zmq.Context, socket_path: str, timeout_s: float, spin_s: float = 0.0,
                 watch_peer: bool = False):
        """watch_peer: learn at once when the daemon's end of the connection closes (``peer_gone``),
        from the socket's monitor events; a wait then ends with DaemonPeerGone."""
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.spin_s = spin_s
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)
        self._rcvtimeo_ms = -2
        # The daemon never closes a connection it serves while it runs: a DISCONNECTED event on the
        # ipc socket means its process is gone, and with it every session (a SIGSTOPped daemon
        # keeps its end open: that is a missed heartbeat reply).
        self.monitor: zmq.Socket | None = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED) if watch_peer else None
        self.peer_gone = False
        self.socket.connect(f"ipc://{socket_path}")
        self._request_ids = itertools.count(1)
        self.pending_async: dict[int, MsgKind] = {}
        self.async_errors: list[DaemonError] = []
        # Requests we stopped waiting for: a late MATCH reply still carries a lease that nobody
        # would ever end (heartbeats keep the session alive), so it is handed to on_orphan_lease
        # with the generation of the session it was asked for.
        self.abandoned: dict[int, tuple[MsgKind, float, int]] = {}   # request id -> (kind, when given up, generation)
        # Requests sent by begin() whose replies are still to be collected by wait_for() (None
        # until the reply arrives).
        self.awaited: dict[int, codec.Frame | None] = {}
        self.closed = False
        self.on_orphan_lease: Callable[[int, int], None] | None = None     # (lease id, generation)
        self.on_shutdown: Callable[[dict[str, Any]], None] | None = None   # the daemon's SHUTDOWN body
        # (generation) -> why that session's requests cannot be answered any more, or None
        self.session_gone: Callable[[int], str | None] | None = None
        self.yield_after_send = False      # set when ZeroMQ's I/O thread is pinned (connect's cpu)

    def send(self, kind: MsgKind, body: dict[str, Any]) -> int:
        request_id = next(self._request_ids)
        try:
            self.socket.send(codec.encode(kind, request_id, body), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise DaemonUnavailable(f"cannot send {kind.name} to ipc://{self.socket_path}: "
                                    "the daemon is not reading (send queue full)") from None
        return request_id

    def send_async(self, kind: MsgKind, body: dict[str, Any]) -> None:
        body["ack"] = False
        request_id = self.send(kind, body)
        if len(self.pending_async) < MAX_PENDING_ASYNC:
            self.pending_async[request_id] = kind

    def request(self, kind: MsgKind, body: dict[str, Any], timeout_s: float | None = None,
                generation: int | None = None) -> dict[str, Any]:
        return self.wait_for(self.begin(kind, body), kind, timeout_s, generation)

    def begin(self, kind: MsgKind, body: dict[str, Any]) -> int:
        """Send a request whose reply ``wait_for`` will collect; replies that arrive meanwhile
        (while other requests are waited for) are kept for it."""
        request_id = self.send(kind, body)
        self.awaited[request_id] = None
        if self.yield_after_send:
            # ZeroMQ's I/O thread writes the request to the socket. Sharing the engine thread's CPU
            # (connect's cpu), it would wait for whatever the engine does next (say, the gathers
            # queued while the reply is on its way) unless it gets the CPU now.
            os.sched_yield()
        return request_id

    def wait_for(self, request_id: int, kind: MsgKind, timeout_s: float | None = None,
                 generation: int | None = None) -> dict[str, Any]:
        """The reply to request_id, within timeout_s. A request of the session of ``generation``
        gives up (DaemonDown) as soon as that session is known to be gone (session_gone)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if self.closed:
            raise DaemonUnavailable(f"cannot wait for {kind.name}: the client is closed")
        watch = generation is not None and self.session_gone is not None
        frame = self.awaited[request_id]
        try:
            while frame is None:
                gone = self.session_gone(generation) if watch else None
                if gone is not None:
                    raise DaemonDown(f"gave up waiting for {kind.name}: {gone}")
                if self.peer_gone:
                    raise DaemonPeerGone(f"gave up waiting for {kind.name}: the kvcached daemon's end of "
                                         f"ipc://{self.socket_path} closed (its process exited)")
                now = time.monotonic()
                if now >= deadline:
                    raise DaemonUnavailable(
                        f"no reply to {kind.name} from the kvcached daemon at ipc://{self.socket_path} "
                        f"within timeout_s={timeout_s} (is it running?)")
                received = self._receive(min(deadline, now + DOWN_CHECK_INTERVAL_S) if watch else deadline)
                if received is not None:
                    self._absorb(received)
                    frame = self.awaited[request_id]
        except BaseException:
            # Timed out, interrupted or failed: whatever the reply holds must not be lost.
            self.abandon(request_id, kind, generation or 0)
            raise
        del self.awaited[request_id]
        if frame.kind == MsgKind.ERROR:
            raise DaemonError(frame.body.get("code", 0), frame.body.get("message", ""), kind)
        return frame.body

    def abandon(self, request_id: int, kind: MsgKind, generation: int = 0) -> None:
        """Stop waiting for a request's reply. A MATCH reply carries a lease that nobody would ever
        end: whether it came already or comes later, its lease goes to on_orphan_lease, with the
        generation of the session the request was sent for."""
        if request_id not in self.awaited:
            return
        frame = self.awaited.pop(request_id)
        if frame is None:
            if len(self.abandoned) < MAX_PENDING_ASYNC:
                self.abandoned[request_id] = (kind, time.monotonic(), generation)
        elif kind in LEASE_KINDS:
            self._orphan_lease_of(frame, generation)

    def _receive(self, deadline: float) -> codec.Frame | None:
        # A reply usually comes within tens of microseconds: polling for it is cheaper than
        # sleeping in the kernel and paying a wake-up (large on virtual machines). Never past the
        # deadline.
        if self.monitor is not None:
            return self._receive_watching_peer(deadline)
        if self.spin_s > 0:
            frame = self._poll_for(min(self.spin_s, deadline - time.monotonic()))
            if frame is not None:
                return frame
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            return None
        if remaining_s < 0.001:         # less than the 1 ms a blocking recv waits at least
            return self._poll_for(remaining_s)
        remaining_ms = int(remaining_s * 1000)
        if remaining_ms != self._rcvtimeo_ms:     # one blocking recv; no poll() per reply
            self.socket.setsockopt(zmq.RCVTIMEO, remaining_ms)
            self._rcvtimeo_ms = remaining_ms
        try:
            return codec.decode(self.socket.recv())
        except zmq.Again:
            return None

    def _receive_watching_peer(self, deadline: float) -> codec.Frame | None:
        """_receive for a watched channel (the heartbeat thread's): the socket and its monitor polled
        together, so that the daemon's exit ends the wait at once (``peer_gone``)."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while not self.peer_gone:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return None
            ready = dict(poller.poll(max(1, int(remaining_s * 1000))))
            if self.monitor in ready:
                self.take_monitor_events()
            if self.socket in ready:
                return codec.decode(self.socket.recv(flags=zmq.NOBLOCK))
        return None

    def take_monitor_events(self) -> bool:
        """Read the monitor's events without waiting; True once the daemon's end has closed."""
        while self.monitor is not None and self.monitor.poll(0):
            event = zmq_monitor.recv_monitor_message(self.monitor, flags=zmq.NOBLOCK)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.peer_gone = True
        return self.peer_gone

    def _poll_for(self, seconds: float) -> codec.Frame | None:
        """A frame the socket holds or gets within seconds, polled without blocking. Each turn
        yields the CPU, so that ZeroMQ's I/O thread, when it shares it (connect's cpu), runs at once."""
        until = time.perf_counter() + seconds
        while True:
            try:
                return codec.decode(self.socket.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                if time.perf_counter() >= until:
                    return None
                os.sched_yield()

    def await_reply(self, request_id: int, timeout_s: float) -> bool:
        """Take in replies until request_id's has come (True) or timeout_s has passed (False); the
        reply stays to be collected, and nothing is given up."""
        deadline = time.monotonic() + timeout_s
        while self.awaited.get(request_id) is None and not self.closed:
            if time.monotonic() >= deadline:
                return False
            received = self._receive(deadline)
            if received is not None:
                self._absorb(received)
        return self.awaited.get(request_id) is not None

    def drain(self) -> None:
        """Take in what the socket holds without waiting: error replies to earlier fire-and-forget
        requests, replies to awaited ones. (Asking ZMQ_EVENTS first: an empty socket's zmq.Again
        costs tens of microseconds, and a scheduler drains once per step.)"""
        while self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._absorb(codec.decode(self.socket.recv(flags=zmq.NOBLOCK)))

    def _absorb(self, frame: codec.Frame) -> None:
        if frame.kind == MsgKind.SHUTDOWN:       # unsolicited: no request of ours is answered by it
            if self.on_shutdown is not None:
                self.on_shutdown(frame.body)
            return
        if frame.request_id in self.awaited:
            self.awaited[frame.request_id] = frame
        else:
            kind, _, generation = self.abandoned.pop(frame.request_id, (None, 0.0, 0))
            if kind in LEASE_KINDS:
                self._orphan_lease_of(frame, generation)
        if frame.kind == MsgKind.ERROR:
            kind = self.pending_async.pop(frame.request_id, None)
            if kind is not None:
                error = DaemonError(frame.body.get("code", 0), frame.body.get("message", ""), kind)
                if error.code == ErrorCode.NOT_ATTACHED:
                    # Sent for a session that has ended since: its end reclaimed what it held, and
                    # the outage (or the session's end) was reported once already.
                    logger.debug("%s", error)
                else:
                    logger.warning("%s", error)
                self.async_errors.append(error)
        if frame.request_id in self.pending_async or not self.pending_async:
            return
        # Any reply answers every earlier request on this socket: those handled without error are done.
        for request_id in [r for r in self.pending_async if r < frame.request_id]:
            del self.pending_async[request_id]

    def abandoned_matches(self) -> int:
        """Given-up matches whose replies (and leases) may still come. One given up longer ago than
        the timeout is forgotten: the daemon evidently dropped its reply, and the session's end
        reclaims whatever it held."""
        horizon = time.monotonic() - self.timeout_s
        for request_id in [r for r, (_, given_up, _) in self.abandoned.items() if given_up < horizon]:
            del self.abandoned[request_id]
        return sum(1 for kind, _, _ in self.abandoned.values() if kind in LEASE_KINDS)

    def absorb_until(self, done: Callable[[], bool], deadline: float) -> None:
        """Take in replies as they come until done() or the deadline."""
        while not done():
            frame = self._receive(deadline)
            if frame is None:
                return
            self._absorb(frame)

    def _orphan_lease_of(self, frame: codec.Frame, generation: int) -> None:
        if frame.kind == MsgKind.REPLY and frame.body.get("lease_id") is not None and self.on_orphan_lease is not None:
            self.on_orphan_lease(frame.body["lease_id"], generation)

    def close(self) -> None:
        # Replies still awaited are void: closing detaches the session, whose leases the daemon reclaims.
        self.closed = True
        self.awaited.clear()
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(0)
        self.socket.close(0)


class PendingReply:
    """A request sent whose reply is still to be collected (``KVCacheClient.request_async``)."""

    kind = MsgKind.MATCH
    reply_type: type = MatchReply

    def __init__(self, channel: _Channel, request_id: int, generation: int,
                 on_not_attached: Callable[[int, str], None] | None = None, kind: MsgKind | None = None,
                 reply_type: type | None = None):
        if kind is not None:
            self.kind = kind
        if reply_type is not None:
            self.reply_type = reply_type
        self._channel = channel
        self._request_id = request_id
        self.generation = generation          # of the session it was sent for
        self._on_not_attached = on_not_attached
        self._ended = False

    def ready(self) -> bool:
        """Whether the reply has come (takes in what the socket holds; never waits)."""
        if self._ended:
            raise RuntimeError("this request has already ended (result() or cancel() was called)")
        if self._channel.awaited.get(self._request_id) is None and not self._channel.closed:
            self._channel.drain()
        return self._channel.awaited.get(self._request_id) is not None

    def wait(self, timeout_s: float) -> bool:
        """Wait at most timeout_s for the reply to come; True once it has, or once none can come
        (the client closed, the request's session known to be gone: ``result`` then raises at
        once). Unlike ``result``, a reply not in by then is not given up."""
        if self.ready():
            return True
        channel = self._channel
        if channel.closed or (channel.session_gone is not None and channel.session_gone(self.generation) is not None):
            return True
        return timeout_s > 0 and channel.await_reply(self._request_id, timeout_s)

    def result(self, timeout_s: float | None = None):
        """Wait for the reply (at most timeout_s, default the client's). On a timeout the request
        is given up like ``cancel()`` and DaemonUnavailable is raised."""
        if self._ended:
            raise RuntimeError("this request has already ended (result() or cancel() was called)")
        self._ended = True
        try:
            body = self._channel.wait_for(self._request_id, self.kind, timeout_s, self.generation)
        except DaemonError as exc:
            if exc.code == ErrorCode.NOT_ATTACHED and self._on_not_attached is not None:
                self._on_not_attached(self.generation, exc.message)
            raise
        return from_wire(self.reply_type, body)

    def cancel(self) -> None:
        """Give the request up: the lease of its reply, whenever that comes, is released."""
        if not self._ended:
            self._ended = True
            if not self._channel.closed:
                self._channel.abandon(self._request_id, self.kind, self.generation)

    def __del__(self) -> None:
        # Dropped without result() or cancel() (say, an exception in between): give it up, so that
        # its lease is released rather than held for the rest of the session.
        try:
            self.cancel()
        except Exception:
            pass


class PendingMatch(PendingReply):
    """A match sent by ``KVCacheClient.match_async`` whose reply is still to be collected."""

    kind = MsgKind.MATCH       # lookups are matches too (lock=false)
    reply_type = MatchReply


class KVCacheClient:
    """An engine's session with the daemon; see ``connect``, and the module note for outages."""

    def __init__(self, socket_path: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 client_name: str = "", spin_s: float = DEFAULT_SPIN_S, cpu: int | None = None,
                 daemon_uid: int | str | None = None, wait_s: float = 0.0):
        deadline = time.monotonic() + wait_s
        while True:
            try:       # a socket another user could have planted raises UntrustedSocket (proto.paths)
                self.socket_path = check_socket(socket_path, daemon_uid)
                break
            except FileNotFoundError as exc:
                if time.monotonic() >= deadline:
                    waited = f"; waited wait_s={wait_s} for it" if wait_s > 0 else ""
                    raise DaemonUnavailable(f"{exc} (start one with `kvcached serve`){waited}") from None
                time.sleep(SOCKET_WAIT_POLL_S)
        if cpu is not None and cpu not in os.sched_getaffinity(0):
            raise ValueError(f"cpu {cpu} is not among the CPUs this process may use: {sorted(os.sched_getaffinity(0))}")
        self.timeout_s = timeout_s
        self.client_name = client_name
        self._context = zmq.Context()
        if cpu is not None:
            self._context.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
        self._channel = _Channel(self._context, self.socket_path, timeout_s, spin_s)
        self._channel.yield_after_send = cpu is not None
        self._status_read_token: bytes | None = None    # of the last status reply (``status``)
        self._channel.on_orphan_lease = self._release_orphan
        self._channel.on_shutdown = self._on_shutdown
        self._channel.session_gone = self._session_gone
        # Dropped without close() (say, after a failed registration), the client must not leave
        # the context with a live socket: a later garbage collection would wait for ever in term().
        # (While the heartbeat thread runs, it holds the client: only close() ends it.)
        self._finalizer = weakref.finalize(self, _close_zmq, self._channel.socket, self._context)
        self._finalizer.atexit = False
        self.geometry: KVGeometry | None = None
        # _connection is replaced whole, under _state_condition, by _transition only; readers take
        # it once and use that snapshot (its state, generation and session agree).
        self._state_condition = threading.Condition()
        self._connection = Connection(ConnectionState.DETACHED, 0, None, time.monotonic())
        self._drained_generation = 0         # mark_drained's, for the session that is DOWN
        self._reattach_listeners: list[Callable[[int, AttachInfo], None]] = []
        self._session_end_listeners: list[Callable[[int], None]] = []
        self._heartbeat_thread: threading.Thread | None = None
        self._stop_heartbeats = threading.Event()
        self._wake_fds: tuple[int, int] | None = None     # a pipe that wakes the heartbeat thread
        self._session_confirmed_at = 0.0     # when the last request the daemon answered for it was sent

    # ---- the connection ---------------------------------------------------------------------

    @property
    def connection(self) -> Connection:
        return self._connection

    @property
    def state(self) -> ConnectionState:
        return self._connection.state

    @property
    def generation(self) -> int:
        """How many sessions this client has attached: the current session's number."""
        return self._connection.generation

    @property
    def info(self) -> AttachInfo | None:
        """The current session; while DOWN, the one that ended; None when detached or closed."""
        connection = self._connection
        return connection.info if connection.state in (ConnectionState.ATTACHED, ConnectionState.DOWN) else None

    def is_attached(self, generation: int | None = None) -> bool:
        """Whether a session is live (and, with ``generation``, is that generation's)."""
        connection = self._connection
        return connection.state is ConnectionState.ATTACHED and generation in (None, connection.generation)

    def add_reattach_listener(self, listener: Callable[[int, AttachInfo], None]) -> None:
        """``listener(generation, info)`` runs on the heartbeat thread after each re-attach; it must
        return quickly. Whoever registers one writes into the session's pages: a re-attach then
        waits (at most REATTACH_DRAIN_WAIT_S from the outage's start) for its ``mark_drained``."""
        self._reattach_listeners.append(listener)

    def remove_reattach_listener(self, listener: Callable[[int, AttachInfo], None]) -> None:
        self._reattach_listeners.remove(listener)

    def add_session_end_listener(self, listener: Callable[[int], None]) -> None:
        """``listener(generation)`` runs once the session of ``generation`` surely ended (the daemon
        exited, said SHUTDOWN or no longer knows it), on the thread that learnt it (mostly the
        heartbeat thread), with no lock of the client held; it must return quickly."""
        self._session_end_listeners.append(listener)

    def remove_session_end_listener(self, listener: Callable[[int], None]) -> None:
        self._session_end_listeners.remove(listener)

    def mark_drained(self, generation: int) -> None:
        """Nothing writes pages of the session of ``generation`` any more (every transfer into them
        has completed, and none will start): the ATTACH that replaces that session may name it
        (previous_session_id), so that the daemon frees them. Heeded only while it is DOWN."""
        with self._state_condition:
            connection = self._connection
            if connection.state is ConnectionState.DOWN and connection.generation == generation:
                self._drained_generation = generation
                self._state_condition.notify_all()

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

    def _session(self, generation: int | None, live: bool) -> tuple[int, int] | None:
        """(session id, generation) to send a request with: of ``generation``'s session if given,
        else of the current one. ``live``: a request that would wait, DaemonDown at once unless the
        session is attached. Otherwise (sent without waiting) None when the session surely ended."""
        connection = self._connection
        if connection.state is ConnectionState.CLOSED:
            raise RuntimeError("client is closed")
        if connection.state is ConnectionState.DETACHED:
            raise RuntimeError("attach() first")
        reason = self._session_gone(connection.generation if generation is None else generation)
        if reason is None:
            return connection.info.session_id, connection.generation
        if live:
            raise DaemonDown(reason)
        if connection.generation == generation or generation is None:
            if not connection.session_ended:      # DOWN, but the session may resume: send it
                return connection.info.session_id, connection.generation
        return None

    # ---- attach, heartbeats, re-attach ------------------------------------------------------

    def _attach_body(self, geometry: KVGeometry, previous_session_id: int | None = None) -> dict[str, Any]:
        """The ATTACH request, first or re-attach."""
        body: dict[str, Any] = {
            "protocol_version": PROTOCOL_VERSION,
            "geometry": geometry.to_wire(),
            "client_name": self.client_name,
            **procfs.own_identity()._asdict(),          # pid, pid_namespace_id, process_start_time
        }
        if previous_session_id is not None:
            body["previous_session_id"] = previous_session_id
        return body

    def attach(self, geometry: KVGeometry) -> AttachInfo:
        connection = self._connection
        if connection.state is ConnectionState.CLOSED:
            raise RuntimeError("client is closed")
        if connection.state is not ConnectionState.DETACHED:
            raise RuntimeError("already attached")
        geometry.validate()
        # The session's own socket attaches, then goes to the heartbeat thread: the daemon knows it
        # from the start, so a SHUTDOWN reaches the thread that watches for it.
        channel = self._heartbeat_channel()
        try:
            sent = time.monotonic()
            body = channel.request(MsgKind.ATTACH, self._attach_body(geometry))
            info = from_wire(AttachInfo, body)
        except BaseException:
            channel.close()
            raise
        self.geometry = geometry
        self._session_confirmed_at = sent
        self._transition(connection, ConnectionState.ATTACHED, info=info)
        self._start_heartbeat_thread(channel)
        return info

    def attach_later(self, geometry: KVGeometry, reason: str) -> None:
        """Go on without a session for now (DOWN, ``reason``): the heartbeat thread tries ATTACH
        with ``geometry`` every ATTACH_PROBE_INTERVAL_S until the daemon takes it (it starts, or a
        namespace frees up); the re-attach listeners then learn of the session (generation 1).
        Meanwhile requests fail at once with DaemonDown, as in an outage."""
        connection = self._connection
        if connection.state is not ConnectionState.DETACHED:
            raise RuntimeError(f"attach_later() on a {connection.state.value} client")
        geometry.validate()
        self.geometry = geometry
        self._transition(connection, ConnectionState.DOWN, reason=reason, session_ended=True)
        self._start_heartbeat_thread(self._heartbeat_channel())

    def _start_heartbeat_thread(self, channel: _Channel) -> None:
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

    def _heartbeat_channel(self) -> _Channel:
        channel = _Channel(self._context, self.socket_path, timeout_s=self.timeout_s, watch_peer=True)
        channel.on_shutdown = self._on_shutdown
        return channel

    def _heartbeat_interval_s(self) -> float:
        info = self._connection.info
        return ATTACH_PROBE_INTERVAL_S if info is None else info.heartbeat_interval_s

    def _heartbeat_loop(self, channel: _Channel) -> None:
        try:
            while self._idle(channel, time.monotonic() + self._heartbeat_interval_s()):
                channel = self._beat(channel)
        except Exception:
            logger.exception("the kvcached heartbeat thread failed")
        finally:
            channel.close()

    def _idle(self, channel: _Channel, until: float) -> bool:
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

    def _beat(self, channel: _Channel) -> _Channel:
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

    def _daemon_exited(self, channel: _Channel) -> _Channel:
        """The daemon's end of the heartbeat socket closed: its process exited, and every session
        with it. DOWN at once, the session ended; a fresh channel waits for the next daemon."""
        self._daemon_down(self._connection, "the daemon exited (its end of the socket closed)", session_ended=True)
        channel.close()
        return self._heartbeat_channel()

    def _reattach(self, channel: _Channel, ended: Connection, reply_timeout_s: float) -> _Channel:
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

    # ---- requests ---------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int] | np.ndarray, reserve_backup: bool = False,
              promote_l3: bool = True, generation: int | None = None, *, local_hit_tokens: int = 0,
              policy: str = "") -> MatchReply:
        """The one blocking round trip of a request: hits per tier, a lease on the L2 hit,
        and (with reserve_backup) private L2 pages for the pages the daemon lacks."""
        return self.match_async(token_ids, reserve_backup, promote_l3, generation, local_hit_tokens=local_hit_tokens,
                                policy=policy).result()

    def match_async(self, token_ids: Sequence[int] | np.ndarray, reserve_backup: bool = False,
                    promote_l3: bool = True, generation: int | None = None, *, local_hit_tokens: int = 0,
                    policy: str = "", begun: bool = False, recompute: bool = False) -> PendingMatch:
        """Send a match now and collect its reply later (``result()``), so that the round trip
        overlaps the engine's own work (the connector sends a step's matches together).
        Every pending match must end by ``result()`` or ``cancel()``: its reply may hold a lease.
        ``generation``: the session it is for (DaemonDown at once if that one has ended).
        With promote_l3 the daemon's cost model decides, under ``policy`` ("": the daemon's) and for
        the tokens beyond the engine's own ``local_hit_tokens``, whether to promote what only L3 holds.
        ``begun``: the match stands for the request's lookup (an L3 hit it declines may be promoted
        in the background, as after a lookup). ``recompute``: the engine recomputes what lies beyond
        its own hit whatever the reply says (it predicted a decline, ``proto.hints``): nothing is
        promoted for it."""
        session_id, generation = self._session(generation, live=True)
        body = {
            "session_id": session_id,
            "token_ids": token_bytes(token_ids),
            "reserve_backup": reserve_backup,
            "promote_l3": promote_l3,
            "local_hit_tokens": local_hit_tokens,
            "policy": policy,
        }
        if begun:
            body["begun"] = True
        if recompute:
            body["recompute"] = True
        request_id = self._channel.begin(MsgKind.MATCH, body)
        return PendingMatch(self._channel, request_id, generation, self._on_not_attached)

    def lookup_async(self, token_ids: Sequence[int] | np.ndarray, tp_group: bool = False,
                     generation: int | None = None, *, local_hit_tokens: int = 0, policy: str = "",
                     promote_l3: bool = False) -> PendingMatch:
        """Ask how much of a prefix is cached, changing nothing (no lease, no LRU update): the reply
        (``result()``) has the hit per tier and no lease or pages, and the daemon's decision (where
        the tokens beyond the engine's own ``local_hit_tokens`` should come from, under ``policy``).
        promote_l3: L3 is a candidate too, and an L3 hit the decision declines may be promoted in
        the background (what an engine's lookups ask for; a tool that only reads the hits does not).
        tp_group: the least hit over every rank of this engine's tensor-parallel group. DaemonDown at
        once while it is down."""
        session_id, generation = self._session(generation, live=True)
        request_id = self._channel.begin(MsgKind.MATCH, {
            "session_id": session_id, "token_ids": token_bytes(token_ids),
            "lock": False, "tp_group": tp_group, "local_hit_tokens": local_hit_tokens, "policy": policy,
            "promote_l3": promote_l3})
        return PendingMatch(self._channel, request_id, generation, self._on_not_attached)

    def request_async(self, kind: MsgKind, body: dict[str, Any], reply_type: type,
                      generation: int | None = None) -> PendingReply:
        """Send a request of the session (of ``generation``) now; ``result()`` decodes its reply as
        ``reply_type`` later. DaemonDown at once unless that session is attached. Not for requests
        whose reply may carry a lease (matches: ``match_async``)."""
        assert kind not in LEASE_KINDS, kind
        session_id, generation = self._session(generation, live=True)
        request_id = self._channel.begin(kind, {"session_id": session_id, **body})
        return PendingReply(self._channel, request_id, generation, self._on_not_attached, kind, reply_type)

    def send_async(self, kind: MsgKind, body: dict[str, Any], generation: int | None = None) -> bool:
        """Send a request of the session (of ``generation``) that is not waited for; its error
        reply, if any, comes through ``poll_errors``. False: not sent, the session has ended."""
        return self._send_async(kind, body, generation)

    def _release_orphan(self, lease_id: int, generation: int) -> None:
        session = self._session(generation or None, live=False)
        if session is None:       # its session ended, and with it the lease
            return
        logger.info("releasing lease %d granted by a match that was given up (cancelled or timed out)", lease_id)
        try:
            self._channel.send_async(MsgKind.RELEASE, {"session_id": session[0], "lease_id": lease_id})
        except DaemonUnavailable as exc:    # the session's end reclaims it
            logger.warning("could not release lease %d: %s", lease_id, exc)

    def session_valid_for(self, generation: int | None = None) -> float:
        """Seconds for which the daemon keeps this session (of ``generation``, default the current
        one), and so its leases and their pages, even if no heartbeat gets through from now on:
        the session timeout counted from the sending of the last request the daemon answered for
        it (0 unless that session is the attached one)."""
        connection = self._connection
        if connection.state is not ConnectionState.ATTACHED:
            return 0.0
        if generation is not None and generation != connection.generation:
            return 0.0
        return max(0.0, self._session_confirmed_at + connection.info.session_timeout_s - time.monotonic())

    def release(self, lease_id: int, generation: int | None = None) -> bool:
        """End a lease (of the session of ``generation``), without waiting. False: not sent, the
        session has ended (and the lease with it)."""
        return self._send_async(MsgKind.RELEASE, {"lease_id": lease_id}, generation)

    def commit_backup(self, lease_id: int, host_page_ids: Sequence[int], generation: int | None = None) -> bool:
        return self._send_async(MsgKind.BACKUP_COMMIT, {
            "lease_id": lease_id, "host_page_ids": [int(p) for p in host_page_ids]}, generation)

    def _send_async(self, kind: MsgKind, body: dict[str, Any], generation: int | None) -> bool:
        """Send a request that is not waited for, to the session of ``generation`` (default: the
        current one), even while DOWN unless that session surely ended. Returns whether it was sent."""
        session = self._session(generation, live=False)
        if session is None:
            return False
        self._channel.send_async(kind, {"session_id": session[0], **body})
        return True

    def report(self, report: dict[str, Any], cost_samples: Sequence[tuple[str, int, float]] = ()) -> bool:
        """Tell the daemon facts about this engine (e.g. transfer backends; shown in its status) and
        timings for its cost model: (direction, size, seconds), see ``proto.schema.EngineReport``."""
        return self._send_async(MsgKind.ENGINE_REPORT, {"report": report, "cost_samples": [list(s) for s in cost_samples]},
                                None)

    def status(self, check_integrity: bool = False) -> dict[str, Any]:
        """The daemon's status snapshot. Each reply's read_token goes back with the next request:
        it shows the daemon the reply was read (it keeps few unread snapshots per socket)."""
        body: dict[str, Any] = {"check_integrity": check_integrity}
        if self._status_read_token is not None:
            body["read_token"] = self._status_read_token
        snapshot = self._channel.request(MsgKind.STATUS, body)
        self._status_read_token = snapshot.pop("read_token", None)
        return snapshot

    def poll_errors(self) -> list[DaemonError]:
        """Error replies to releases and commits received so far (each handed out once)."""
        self._channel.drain()
        errors, self._channel.async_errors = self._channel.async_errors, []
        return errors

    def flush(self, timeout_s: float | None = None) -> list[DaemonError]:
        """Wait until the daemon has handled every release/commit sent so far, including the
        releases of leases from matches given up; returns their errors like ``poll_errors``.
        DaemonDown at once while the daemon is down."""
        channel = self._channel
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if self._connection.state is ConnectionState.DETACHED:
            return self.poll_errors()
        session_id, generation = self._session(None, live=True)
        heartbeat = {"session_id": session_id}
        # The daemon answers one socket's requests in order, except a match that waits for an L3
        # promotion, which is answered when the read is done: the heartbeat's reply comes after
        # every other earlier reply, then late match replies are waited for. A given-up match's
        # reply triggers the release of its lease: that release needs a last round.
        if channel.pending_async or channel.abandoned:
            channel.request(MsgKind.HEARTBEAT, heartbeat, timeout_s, generation)
        channel.absorb_until(lambda: channel.abandoned_matches() == 0, deadline)
        if channel.pending_async:
            channel.request(MsgKind.HEARTBEAT, heartbeat, max(0.001, deadline - time.monotonic()), generation)
        return self.poll_errors()

    def request_raw(self, kind: MsgKind, body: dict[str, Any]) -> dict[str, Any]:
        """Send any body of any kind and wait for the reply (diagnostics and tests)."""
        return self._channel.request(kind, body)

    def detach(self) -> None:
        """End the session (a session the daemon is down for just ends here)."""
        if self._connection.state not in (ConnectionState.ATTACHED, ConnectionState.DOWN):
            return
        self._stop_heartbeat_thread()
        connection = self._connection
        try:
            if connection.state is ConnectionState.ATTACHED:
                self._channel.request(MsgKind.DETACH, {"session_id": connection.info.session_id})
        finally:
            self._transition(self._connection, ConnectionState.DETACHED)

    def close(self) -> None:
        if self._connection.state is ConnectionState.CLOSED:
            return
        try:
            self.detach()
        except (DaemonUnavailable, DaemonError) as exc:
            logger.warning("detach on close failed: %s", exc)
        finally:
            self._stop_heartbeat_thread()
            self._transition(self._connection, ConnectionState.CLOSED)
            self._channel.close()
            self._finalizer()

    def __enter__(self) -> "KVCacheClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _close_zmq(socket: zmq.Socket, context: zmq.Context) -> None:
    """The client's finalizer (and the end of close()): the request socket, then the context."""
    socket.close(0)
    context.term()


def connect(socket_path: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
            client_name: str = "", spin_s: float = DEFAULT_SPIN_S, cpu: int | None = None,
            daemon_uid: int | str | None = None, wait_s: float = 0.0) -> KVCacheClient:
    """Connect to the daemon at ``socket_path`` (a path or an ipc:// URL; default: the per-user
    path, see ``proto.paths.default_socket_path``); then ``attach``.

    The socket and its directory must belong to ``daemon_uid`` (a uid or user name; default
    $KVCACHED_DAEMON_UID, else this process's uid) and be writable by no one else, else
    ``proto.paths.UntrustedSocket`` is raised: another local user could have planted them.

    ``spin_s``: how long a blocking request busy-waits for its reply before sleeping (0: never).
    ``cpu``: run the client's ZeroMQ I/O thread on this CPU. An engine whose scheduler thread is
    pinned to the same CPU then hands its requests and replies to a thread on a busy CPU, which
    is cheaper than waking an idle one (large on virtual machines); a request that awaits a reply
    yields the CPU once it is sent, so that it leaves at once.
    ``wait_s``: how long to wait for the daemon's socket to appear (an engine started before its
    daemon); DaemonUnavailable after that. ``KVConnector.register`` goes further: a daemon that
    does not answer or cannot take the engine yet is attached later, by the client itself."""
    return KVCacheClient(socket_path, timeout_s, client_name, spin_s, cpu, daemon_uid, wait_s)
