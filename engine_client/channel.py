"""The client's socket: one ZeroMQ DEALER with request ids, bounded waits and replies collected
later (``PendingReply``); the errors a request raises.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import time
from typing import Any, Callable

import zmq
from zmq.utils import monitor as zmq_monitor

from proto import codec
from proto.errors import ErrorCode, ProtocolError
from proto.messages import MsgKind
from proto.replies import AcquireReply, LookupReply, from_wire

logger = logging.getLogger(__name__)

MAX_PENDING_ASYNC = 100_000
# Requests whose reply may carry a lease: a reply nobody waits for any more must end it.
LEASE_KINDS = (MsgKind.ACQUIRE,)
# While a session request waits, how often it checks whether the connection went down meanwhile:
# a request in flight when the daemon is found dead ends this long after, at most.
DOWN_CHECK_INTERVAL_S = 0.01


class DaemonUnavailable(Exception):
    """The daemon is not there or did not answer in time."""


class DaemonDown(DaemonUnavailable):
    """Raised at once, nothing sent: the daemon is known to be down, or the session a request
    belongs to (its generation) has ended. Requests skip the daemon until it is back."""


class DaemonPeerGone(DaemonUnavailable):
    """A wait on the heartbeat thread's socket ended: the daemon's process exited."""


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


class Channel:
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
        # Requests we stopped waiting for: a late ACQUIRE reply still carries a lease that nobody
        # would ever end (heartbeats keep the session alive), so it is handed to on_orphan_lease
        # with the generation of the session it was asked for.
        self.abandoned: dict[int, tuple[MsgKind, float, int]] = {}   # request id -> (kind, when given up, generation)
        # Requests whose PendingReply was dropped unended, (request id, kind, generation): appended on
        # whatever thread the garbage collector ran, given up here at the owner's next send or drain.
        self.dropped: collections.deque[tuple[int, MsgKind, int]] = collections.deque()
        self._warned_abandoned_full = False
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
        self.give_up_dropped()
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
        """Stop waiting for a request's reply. An ACQUIRE reply carries a lease that nobody would ever
        end: whether it came already or comes later, its lease goes to on_orphan_lease, with the
        generation of the session the request was sent for."""
        if request_id not in self.awaited:
            return
        frame = self.awaited.pop(request_id)
        if frame is None:
            if len(self.abandoned) < MAX_PENDING_ASYNC:
                self.abandoned[request_id] = (kind, time.monotonic(), generation)
            elif kind in LEASE_KINDS and not self._warned_abandoned_full:
                self._warned_abandoned_full = True
                logger.warning("%d requests given up are awaited already: the lease of a late %s reply with no "
                               "record is released under the session current when it comes (logged once)",
                               MAX_PENDING_ASYNC, kind.name)
        elif kind in LEASE_KINDS:
            self._orphan_lease_of(frame, generation)

    def give_up_dropped(self) -> None:
        """Give up the requests whose PendingReply was dropped unended (``dropped``)."""
        while self.dropped:
            self.abandon(*self.dropped.popleft())

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
        self.give_up_dropped()
        while self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._absorb(codec.decode(self.socket.recv(flags=zmq.NOBLOCK)))

    def _absorb(self, frame: codec.Frame) -> None:
        if frame.kind == MsgKind.SHUTDOWN:       # unsolicited: no request of ours is answered by it
            if self.on_shutdown is not None:
                self.on_shutdown(frame.body)
            return
        if frame.request_id in self.awaited:
            self.awaited[frame.request_id] = frame
        elif frame.request_id in self.abandoned:
            kind, _, generation = self.abandoned.pop(frame.request_id)
            if kind in LEASE_KINDS:
                self._orphan_lease_of(frame, generation)
        else:
            # A reply nobody keeps a record of (given up beyond the MAX_PENDING_ASYNC records, or
            # forgotten): a lease it names is nobody's. Released under the current session (the
            # daemon refuses it if it was another's; an ended session's went with it).
            self._orphan_lease_of(frame, 0)
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

    def abandoned_acquires(self) -> int:
        """Given-up acquires whose replies (and leases) a flush still waits for: those given up
        within the timeout. One given up longer ago is not waited for (an acquire that waits for a
        promotion is answered once the read is done; or the daemon dropped its reply), but stays
        known, so that its lease is still released if its reply comes (the session's end reclaims
        it otherwise). Other given-up requests hold nothing: past the timeout they are forgotten."""
        horizon = time.monotonic() - self.timeout_s
        for request_id in [r for r, (kind, given_up, _) in self.abandoned.items()
                           if given_up < horizon and kind not in LEASE_KINDS]:
            del self.abandoned[request_id]
        return sum(1 for kind, given_up, _ in self.abandoned.values() if kind in LEASE_KINDS and given_up >= horizon)

    def absorb_until(self, done: Callable[[], bool], deadline: float) -> None:
        """Take in replies as they come until done() or the deadline."""
        while not done():
            frame = self._receive(deadline)
            if frame is None:
                return
            self._absorb(frame)

    def _orphan_lease_of(self, frame: codec.Frame, generation: int) -> None:
        if frame.kind == MsgKind.REPLY:
            self.orphan_lease_of(frame.body, generation)

    def orphan_lease_of(self, body: Any, generation: int) -> None:
        """Hand the lease a reply body names (if any) to on_orphan_lease: nobody will end it."""
        lease_id = body.get("lease_id") if type(body) is dict else None
        if type(lease_id) is int and self.on_orphan_lease is not None:
            self.on_orphan_lease(lease_id, generation)

    def close(self) -> None:
        # Replies still awaited are void: closing detaches the session, whose leases the daemon reclaims.
        self.closed = True
        self.awaited.clear()
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(0)
        self.socket.close(0)


class PendingReply:
    """A request sent whose reply is still to be collected (``KVCacheClient.request_async``,
    ``lookup_async``, ``acquire_async``)."""

    kind = MsgKind.ACQUIRE
    reply_type: type = AcquireReply

    def __init__(self, channel: Channel, request_id: int, generation: int,
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
        try:
            return from_wire(self.reply_type, body)
        except ProtocolError:
            # Nobody gets this reply: the lease it names would be held for the rest of the session.
            if self.kind in LEASE_KINDS:
                self._channel.orphan_lease_of(body, self.generation)
            raise

    def cancel(self) -> None:
        """Give the request up: the lease of its reply, whenever that comes, is released."""
        if not self._ended:
            self._ended = True
            if not self._channel.closed:
                self._channel.abandon(self._request_id, self.kind, self.generation)

    def __del__(self) -> None:
        # Dropped without result() or cancel() (say, an exception in between): it must be given up,
        # so that its lease is released rather than held for the rest of the session. The collector
        # may run this on any thread and the channel is its owner's: only noted here (a deque's
        # append is thread-safe), given up by the owner at its next send or drain.
        if not getattr(self, "_ended", True) and not self._channel.closed:
            self._ended = True
            self._channel.dropped.append((self._request_id, self.kind, self.generation))


class PendingAcquire(PendingReply):
    """An acquire sent by ``KVCacheClient.acquire_async`` whose reply (and the lease it may carry)
    is still to be collected."""

    kind = MsgKind.ACQUIRE
    reply_type = AcquireReply


class PendingLookup(PendingReply):
    """A lookup sent by ``KVCacheClient.lookup_async`` whose reply is still to be collected."""

    kind = MsgKind.LOOKUP
    reply_type = LookupReply
