"""The engine's synchronous client of the kvcached daemon.

Made for an engine's scheduler thread: every call that waits has a bound (``timeout_s``) and
raises ``DaemonUnavailable`` naming what it waited for, never hangs. Releases and backup
commits are sent without waiting (they are off the request's critical path); their error
replies, if any, are collected as they arrive and handed out by ``poll_errors()``. A
background thread sends heartbeats on its own socket so that a long forward pass does not
look like a dead engine.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import zmq

from proto import codec
from proto.errors import ErrorCode
from proto.messages import PROTOCOL_VERSION, KVGeometry, MsgKind
from proto.paths import UntrustedSocket, check_socket  # noqa: F401 (engines catch UntrustedSocket from here)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_SPIN_S = 200e-6       # busy-wait this long for a reply before blocking
MAX_PENDING_ASYNC = 100_000
# Requests whose reply may carry a lease: a reply nobody waits for any more must end it.
LEASE_KINDS = (MsgKind.MATCH, MsgKind.RESERVE_PAGES)


class DaemonUnavailable(Exception):
    """The daemon is not there or did not answer in time."""


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


class AttachInfo(NamedTuple):
    session_id: int
    namespace_id: int
    shm_path: str
    arena_offset_bytes: int
    num_pages: int
    bytes_per_page: int
    heartbeat_interval_s: float
    session_timeout_s: float
    max_frame_bytes: int
    daemon_pid: int
    protocol_version: int


class MatchReply(NamedTuple):
    hit_tokens: dict[str, int]
    lease_id: int | None
    host_page_ids: list[int]
    backup_start_token: int
    backup_page_ids: list[int]
    promoted_tokens: int = 0
    host_page_epochs: list[int] = []      # allocation epochs of host_page_ids (see reserve_pages)
    backup_page_epochs: list[int] = []


class Reservation(NamedTuple):
    """Private L2 pages held by a standing lease (``KVCacheClient.reserve_pages``)."""

    lease_id: int | None           # None: the daemon had no page to give
    page_ids: list[int]
    page_epochs: list[int]         # each page's allocation epoch, to recognise it later (L2Hints)


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {array.shape}")
    if array.dtype == WIRE_TOKEN_DTYPE:       # the engine's usual case: no checks, no copy
        return array.tobytes()
    if array.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {array.dtype}")
    if array.size and (array.min() < _INT32.min or array.max() > _INT32.max):
        raise ValueError("token ids must fit in int32")
    return array.astype(WIRE_TOKEN_DTYPE).tobytes()


WIRE_TOKEN_DTYPE = np.dtype("<i4")
_INT32 = np.iinfo(np.int32)


class _Channel:
    """One DEALER socket with request ids and bounded waits (not thread-safe: one per thread).

    Fire-and-forget requests (releases, commits) ask the daemon not to acknowledge success, so
    they cost the daemon one handler call and no reply; an error still gets a reply, matched
    here to its request by id. The daemon handles one socket's requests in order, so the reply
    to any later request proves every earlier one was handled: that is how ``flush`` works.
    """

    def __init__(self, context: zmq.Context, socket_path: str, timeout_s: float, spin_s: float = 0.0):
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.spin_s = spin_s
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)
        self._rcvtimeo_ms = -2
        self.socket.connect(f"ipc://{socket_path}")
        self._request_ids = itertools.count(1)
        self.pending_async: dict[int, MsgKind] = {}
        self.async_errors: list[DaemonError] = []
        # Requests we stopped waiting for: a late MATCH reply still carries a lease that nobody
        # would ever end (heartbeats keep the session alive), so it is handed to on_orphan_lease.
        self.abandoned: dict[int, tuple[MsgKind, float]] = {}     # request id -> (kind, when given up)
        # Requests sent by begin() whose replies are still to be collected by wait_for() (None
        # until the reply arrives).
        self.awaited: dict[int, codec.Frame | None] = {}
        self.closed = False
        self.on_orphan_lease: Callable[[int], None] | None = None
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

    def request(self, kind: MsgKind, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        return self.wait_for(self.begin(kind, body), kind, timeout_s)

    def begin(self, kind: MsgKind, body: dict[str, Any], urgent: bool = True) -> int:
        """Send a request whose reply ``wait_for`` will collect; replies that arrive meanwhile
        (while other requests are waited for) are kept for it. urgent=False: the reply is not
        awaited soon, so the request may leave whenever ZeroMQ's I/O thread next runs."""
        request_id = self.send(kind, body)
        self.awaited[request_id] = None
        if urgent and self.yield_after_send:
            # ZeroMQ's I/O thread writes the request to the socket. Sharing the engine thread's CPU
            # (connect's cpu), it would wait for whatever the engine does next (say, the gather
            # that a pipelined backup overlaps with this round trip) unless it gets the CPU now.
            os.sched_yield()
        return request_id

    def wait_for(self, request_id: int, kind: MsgKind, timeout_s: float | None = None) -> dict[str, Any]:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if self.closed:
            raise DaemonUnavailable(f"cannot wait for {kind.name}: the client is closed")
        frame = self.awaited[request_id]
        try:
            while frame is None:
                received = self._receive(deadline)
                if received is None:
                    raise DaemonUnavailable(
                        f"no reply to {kind.name} from the kvcached daemon at ipc://{self.socket_path} "
                        f"within timeout_s={timeout_s} (is it running?)")
                self._absorb(received)
                frame = self.awaited[request_id]
        except BaseException:
            # Timed out, interrupted or failed: whatever the reply holds must not be lost.
            self.abandon(request_id, kind)
            raise
        del self.awaited[request_id]
        if frame.kind == MsgKind.ERROR:
            raise DaemonError(frame.body.get("code", 0), frame.body.get("message", ""), kind)
        return frame.body

    def abandon(self, request_id: int, kind: MsgKind) -> None:
        """Stop waiting for a request's reply. A MATCH reply carries a lease that nobody would ever
        end: whether it came already or comes later, its lease goes to on_orphan_lease."""
        if request_id not in self.awaited:
            return
        frame = self.awaited.pop(request_id)
        if frame is None:
            if len(self.abandoned) < MAX_PENDING_ASYNC:
                self.abandoned[request_id] = (kind, time.monotonic())
        elif kind in LEASE_KINDS:
            self._orphan_lease_of(frame)

    def _receive(self, deadline: float) -> codec.Frame | None:
        if self.spin_s > 0:
            # A reply usually comes within tens of microseconds: polling for it is cheaper than
            # sleeping in the kernel and paying a wake-up (large on virtual machines).
            # Each turn yields the CPU, so that ZeroMQ's I/O thread, when it shares it (connect's
            # cpu), runs at once.
            spin_until = time.perf_counter() + self.spin_s
            while True:
                try:
                    return codec.decode(self.socket.recv(flags=zmq.NOBLOCK))
                except zmq.Again:
                    if time.perf_counter() >= spin_until:
                        break
                    os.sched_yield()
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        if remaining_ms != self._rcvtimeo_ms:     # one blocking recv; no poll() per reply
            self.socket.setsockopt(zmq.RCVTIMEO, remaining_ms)
            self._rcvtimeo_ms = remaining_ms
        try:
            return codec.decode(self.socket.recv())
        except zmq.Again:
            return None

    def drain(self) -> None:
        """Collect error replies to earlier fire-and-forget requests without waiting."""
        while True:
            try:
                frame = codec.decode(self.socket.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                return
            self._absorb(frame)

    def _absorb(self, frame: codec.Frame) -> None:
        if frame.request_id in self.awaited:
            self.awaited[frame.request_id] = frame
        elif self.abandoned.pop(frame.request_id, (None, 0.0))[0] in LEASE_KINDS:
            self._orphan_lease_of(frame)
        if frame.kind == MsgKind.ERROR:
            kind = self.pending_async.pop(frame.request_id, None)
            if kind is not None:
                error = DaemonError(frame.body.get("code", 0), frame.body.get("message", ""), kind)
                logger.warning("%s", error)
                self.async_errors.append(error)
        if frame.request_id in self.pending_async or not self.pending_async:
            return
        # Any reply answers every earlier request on this socket: those handled without error are done.
        for request_id in [r for r in self.pending_async if r < frame.request_id]:
            del self.pending_async[request_id]

    def abandoned_matches(self) -> int:
        """Given-up matches and reservations whose replies (and leases) may still come. One given up longer ago than
        the timeout is forgotten: the daemon evidently dropped its reply, and the session's end
        reclaims whatever it held."""
        horizon = time.monotonic() - self.timeout_s
        for request_id in [r for r, (_, given_up) in self.abandoned.items() if given_up < horizon]:
            del self.abandoned[request_id]
        return sum(1 for kind, _ in self.abandoned.values() if kind in LEASE_KINDS)

    def absorb_until(self, done: Callable[[], bool], deadline: float) -> None:
        """Take in replies as they come until done() or the deadline."""
        while not done():
            frame = self._receive(deadline)
            if frame is None:
                return
            self._absorb(frame)

    def _orphan_lease_of(self, frame: codec.Frame) -> None:
        if frame.kind == MsgKind.REPLY and frame.body.get("lease_id") is not None and self.on_orphan_lease is not None:
            self.on_orphan_lease(frame.body["lease_id"])

    def close(self) -> None:
        # Replies still awaited are void: closing detaches the session, whose leases the daemon reclaims.
        self.closed = True
        self.awaited.clear()
        self.socket.close(0)


class PendingMatch:
    """A match sent by ``KVCacheClient.match_async`` whose reply is still to be collected."""

    kind = MsgKind.MATCH
    reply_type: type = MatchReply

    def __init__(self, channel: _Channel, request_id: int):
        self._channel = channel
        self._request_id = request_id
        self._ended = False

    def ready(self) -> bool:
        """Whether the reply has come (takes in what the socket holds; never waits)."""
        if self._ended:
            raise RuntimeError("this request has already ended (result() or cancel() was called)")
        if self._channel.awaited.get(self._request_id) is None and not self._channel.closed:
            self._channel.drain()
        return self._channel.awaited.get(self._request_id) is not None

    def result(self, timeout_s: float | None = None):
        """Wait for the reply (at most timeout_s, default the client's). On a timeout the request
        is given up like ``cancel()`` and DaemonUnavailable is raised."""
        if self._ended:
            raise RuntimeError("this request has already ended (result() or cancel() was called)")
        self._ended = True
        body = self._channel.wait_for(self._request_id, self.kind, timeout_s)
        fields = self.reply_type._fields
        return self.reply_type(**{f: body[f] for f in fields if f in body})

    def cancel(self) -> None:
        """Give the request up: the lease of its reply, whenever that comes, is released."""
        if not self._ended:
            self._ended = True
            if not self._channel.closed:
                self._channel.abandon(self._request_id, self.kind)

    def __del__(self) -> None:
        # Dropped without result() or cancel() (say, an exception in between): give it up, so that
        # its lease is released rather than held for the rest of the session.
        try:
            self.cancel()
        except Exception:
            pass


class PendingReservation(PendingMatch):
    """A reservation sent by ``KVCacheClient.reserve_pages_async``; ``result()`` is a Reservation."""

    kind = MsgKind.RESERVE_PAGES
    reply_type = Reservation


class KVCacheClient:
    """An engine's session with the daemon; see ``connect``."""

    def __init__(self, socket_path: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 client_name: str = "", spin_s: float = DEFAULT_SPIN_S, cpu: int | None = None,
                 daemon_uid: int | str | None = None):
        try:       # a socket another user could have planted raises UntrustedSocket (proto.paths)
            self.socket_path = check_socket(socket_path, daemon_uid)
        except FileNotFoundError as exc:
            raise DaemonUnavailable(f"{exc} (start one with `kvcached serve`)") from None
        if cpu is not None and cpu not in os.sched_getaffinity(0):
            raise ValueError(f"cpu {cpu} is not among the CPUs this process may use: {sorted(os.sched_getaffinity(0))}")
        self.timeout_s = timeout_s
        self.client_name = client_name
        self._context = zmq.Context()
        if cpu is not None:
            self._context.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
        self._channel = _Channel(self._context, self.socket_path, timeout_s, spin_s)
        self._channel.yield_after_send = cpu is not None
        self._channel.on_orphan_lease = self._release_orphan
        self.info: AttachInfo | None = None
        self.geometry: KVGeometry | None = None
        self._heartbeat_thread: threading.Thread | None = None
        self._stop_heartbeats = threading.Event()
        self._session_lost: str | None = None
        self._session_confirmed_at = 0.0     # when the last request the daemon answered for it was sent
        self._closed = False

    # ---- session ----------------------------------------------------------------------------

    def attach(self, geometry: KVGeometry) -> AttachInfo:
        if self.info is not None:
            raise RuntimeError("already attached")
        geometry.validate()
        sent = time.monotonic()
        body = self._channel.request(MsgKind.ATTACH, {
            "protocol_version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "geometry": geometry.to_wire(),
            "client_name": self.client_name,
        })
        self.info = AttachInfo(**{f: body[f] for f in AttachInfo._fields})
        self._session_confirmed_at = sent
        self.geometry = geometry
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="kvcached-heartbeat",
                                                  daemon=True)
        self._heartbeat_thread.start()
        return self.info

    def _heartbeat_loop(self) -> None:
        assert self.info is not None
        interval_s = self.info.heartbeat_interval_s
        channel = _Channel(self._context, self.socket_path, timeout_s=max(interval_s, 0.05))
        try:
            while not self._stop_heartbeats.wait(interval_s):
                try:
                    sent = time.monotonic()
                    channel.request(MsgKind.HEARTBEAT, {"session_id": self.info.session_id})
                    self._session_confirmed_at = sent
                except DaemonError as exc:
                    if exc.code != ErrorCode.NOT_ATTACHED:
                        logger.warning("heartbeat refused: %s", exc)
                        continue
                    self._session_lost = str(exc)
                    logger.error("kvcached session lost: %s", exc)
                    return
                except DaemonUnavailable as exc:
                    logger.warning("%s", exc)
        finally:
            channel.close()

    def _session(self) -> int:
        if self._closed:
            raise RuntimeError("client is closed")
        if self.info is None:
            raise RuntimeError("attach() first")
        if self._session_lost is not None:
            raise DaemonUnavailable(f"the daemon no longer knows this session: {self._session_lost}")
        return self.info.session_id

    # ---- requests ---------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int] | np.ndarray, reserve_backup: bool = False,
              promote_l3: bool = True) -> MatchReply:
        """The one blocking round trip of a request: hits per tier, a lease on the L2 hit,
        and (with reserve_backup) private L2 pages for the pages the daemon lacks."""
        return self.match_async(token_ids, reserve_backup, promote_l3).result()

    def match_async(self, token_ids: Sequence[int] | np.ndarray, reserve_backup: bool = False,
                    promote_l3: bool = True) -> PendingMatch:
        """Send a match now and collect its reply later (``result()``), so that the round trip
        overlaps the engine's own work, e.g. the gather of a backup (TransferEngine.start_backup).
        Every pending match must end by ``result()`` or ``cancel()``: its reply may hold a lease."""
        request_id = self._channel.begin(MsgKind.MATCH, {
            "session_id": self._session(),
            "token_ids": token_bytes(token_ids),
            "reserve_backup": reserve_backup,
            "promote_l3": promote_l3,
        })
        return PendingMatch(self._channel, request_id)

    def _release_orphan(self, lease_id: int) -> None:
        logger.warning("releasing lease %d granted by a match that was given up (cancelled or timed out)", lease_id)
        if self.info is not None and self._session_lost is None:
            try:
                self._channel.send_async(MsgKind.RELEASE, {"session_id": self.info.session_id, "lease_id": lease_id})
            except DaemonUnavailable as exc:    # the session's end reclaims it
                logger.warning("could not release lease %d: %s", lease_id, exc)

    def session_valid_for(self) -> float:
        """Seconds for which the daemon keeps this session, and so its leases and their pages,
        even if no heartbeat gets through from now on: the session timeout counted from the
        sending of the last request the daemon answered for it (0 once lost or closed)."""
        if self.info is None or self._closed or self._session_lost is not None:
            return 0.0
        return max(0.0, self._session_confirmed_at + self.info.session_timeout_s - time.monotonic())

    @property
    def session_lost(self) -> bool:
        """True once the daemon no longer knows this session (its leases are reclaimed already)."""
        return self._session_lost is not None

    def release(self, lease_id: int) -> None:
        self._channel.send_async(MsgKind.RELEASE, {"session_id": self._session(), "lease_id": lease_id})

    def commit_backup(self, lease_id: int, host_page_ids: Sequence[int]) -> None:
        self._channel.send_async(MsgKind.BACKUP_COMMIT, {
            "session_id": self._session(), "lease_id": lease_id,
            "host_page_ids": [int(p) for p in host_page_ids]})

    def reserve_pages(self, num_pages: int) -> Reservation:
        """A standing lease on up to num_pages private L2 pages (fewer, or none, when the daemon
        cannot free that many), into which backups are written before their prefix is known to
        the daemon: a backup then needs no round trip before its DMA (``commit_pages``). The pages
        stay this session's until committed, released with the lease, or reclaimed."""
        return self.reserve_pages_async(num_pages).result()

    def reserve_pages_async(self, num_pages: int, urgent: bool = True) -> PendingReservation:
        """Like ``reserve_pages``, collected later; urgent=False for a top-up whose reply is not
        waited for soon (the send then costs the caller less)."""
        if type(num_pages) is not int or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        request_id = self._channel.begin(MsgKind.RESERVE_PAGES, {"session_id": self._session(),
                                                                 "num_pages": num_pages}, urgent)
        return PendingReservation(self._channel, request_id)

    def commit_pages(self, lease_id: int, token_ids: Sequence[int] | np.ndarray, start_page: int,
                     host_page_ids: Sequence[int]) -> None:
        """Publish pages of a standing lease, written (and waited for) with pages [start_page,
        start_page + n) of the prefix token_ids; without waiting. The pages leave the lease: the
        daemon keeps those it lacks and frees the rest; a lease left with no pages ends."""
        self._channel.send_async(MsgKind.COMMIT_PAGES, {
            "session_id": self._session(), "lease_id": lease_id, "token_ids": token_bytes(token_ids),
            "start_page": start_page, "host_page_ids": [int(p) for p in host_page_ids]})

    def report(self, report: dict[str, Any]) -> None:
        """Tell the daemon facts about this engine (e.g. transfer backends); shown in its status."""
        self._channel.send_async(MsgKind.ENGINE_REPORT, {"session_id": self._session(), "report": report})

    def status(self, check_integrity: bool = False) -> dict[str, Any]:
        return self._channel.request(MsgKind.STATUS, {"check_integrity": check_integrity})

    def poll_errors(self) -> list[DaemonError]:
        """Error replies to releases and commits received so far (each handed out once)."""
        self._channel.drain()
        errors, self._channel.async_errors = self._channel.async_errors, []
        return errors

    def flush(self, timeout_s: float | None = None) -> list[DaemonError]:
        """Wait until the daemon has handled every release/commit sent so far, including the
        releases of leases from matches given up; returns their errors like ``poll_errors``."""
        channel = self._channel
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if self.info is None:
            return self.poll_errors()
        # The daemon answers one socket's requests in order, except a match that waits for an L3
        # promotion, which is answered when the read is done: the heartbeat's reply comes after
        # every other earlier reply, then late match replies are waited for. A given-up match's
        # reply triggers the release of its lease: that release needs a last round.
        if channel.pending_async or channel.abandoned:
            channel.request(MsgKind.HEARTBEAT, {"session_id": self.info.session_id}, timeout_s)
        channel.absorb_until(lambda: channel.abandoned_matches() == 0, deadline)
        if channel.pending_async:
            channel.request(MsgKind.HEARTBEAT, {"session_id": self.info.session_id},
                            max(0.001, deadline - time.monotonic()))
        return self.poll_errors()

    def request_raw(self, kind: MsgKind, body: dict[str, Any]) -> dict[str, Any]:
        """Send any body of any kind and wait for the reply (diagnostics and tests)."""
        return self._channel.request(kind, body)

    def detach(self) -> None:
        if self.info is None or self._closed:
            return
        self._stop_heartbeats.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join()
        try:
            self._channel.request(MsgKind.DETACH, {"session_id": self.info.session_id})
        finally:
            self.info = None

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.detach()
        except (DaemonUnavailable, DaemonError) as exc:
            logger.warning("detach on close failed: %s", exc)
        finally:
            self._stop_heartbeats.set()
            if self._heartbeat_thread is not None:
                self._heartbeat_thread.join()
            self._channel.close()
            self._context.term()
            self._closed = True

    def __enter__(self) -> "KVCacheClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def connect(socket_path: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
            client_name: str = "", spin_s: float = DEFAULT_SPIN_S, cpu: int | None = None,
            daemon_uid: int | str | None = None) -> KVCacheClient:
    """Connect to the daemon at ``socket_path`` (a path or an ipc:// URL; default: the per-user
    path, see ``proto.paths.default_socket_path``); then ``attach``.

    The socket and its directory must belong to ``daemon_uid`` (a uid or user name; default
    $KVCACHED_DAEMON_UID, else this process's uid) and be writable by no one else, else
    ``proto.paths.UntrustedSocket`` is raised: another local user could have planted them.

    ``spin_s``: how long a blocking request busy-waits for its reply before sleeping (0: never).
    ``cpu``: run the client's ZeroMQ I/O thread on this CPU. An engine whose scheduler thread is
    pinned to the same CPU then hands its requests and replies to a thread on a busy CPU, which
    is cheaper than waking an idle one (large on virtual machines); a request that awaits a reply
    yields the CPU once it is sent, so that it leaves at once."""
    return KVCacheClient(socket_path, timeout_s, client_name, spin_s, cpu, daemon_uid)
