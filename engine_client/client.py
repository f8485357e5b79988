"""The engine's synchronous client of the kvcached daemon.

Made for an engine's scheduler thread: every call that waits has a bound (``timeout_s``) and
raises ``DaemonUnavailable`` naming what it waited for, never hangs. Releases and
commits are sent without waiting (they are off the request's critical path); their error
replies, if any, are collected as they arrive and handed out by ``poll_errors()``. A
background thread sends heartbeats on its own socket so that a long forward pass does not
look like a dead engine.

Outages, heartbeats and re-attach: ``connection.py``; the socket and its replies: ``channel.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from engine_client.channel import (LEASE_KINDS, Channel, DaemonDown, DaemonError, DaemonUnavailable, PendingAcquire,
                                    PendingLookup, PendingReply)
from engine_client.connection import Connection, ConnectionKeeper, ConnectionState
from proto import procfs
from proto.messages import PROTOCOL_VERSION, KVGeometry, MsgKind
from proto.replies import AcquireReply, AttachInfo, LookupReply, from_wire
from proto.tokens import token_bytes
from proto.paths import UntrustedSocket, check_socket  # noqa: F401 (engines catch UntrustedSocket from here)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_SPIN_S = 200e-6       # busy-wait this long for a reply before blocking
# How often connect(wait_s=...) looks for the daemon's socket.
SOCKET_WAIT_POLL_S = 0.05


class KVCacheClient(ConnectionKeeper):
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
        self._channel = Channel(self._context, self.socket_path, timeout_s, spin_s)
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

    # ---- attach (heartbeats and re-attach: connection.py) -----------------------------------

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

    # ---- requests ---------------------------------------------------------------------------

    def acquire(self, token_ids: Sequence[int] | np.ndarray, save: bool = False, promote: str = "wait",
                generation: int | None = None, *, local_hit_tokens: int = 0, policy: str = "") -> AcquireReply:
        """The one blocking round trip of a request (``acquire_async``, waited for): hits per tier,
        a lease on the L2 hit, and (with save) private L2 pages reserved for the pages the daemon lacks."""
        return self.acquire_async(token_ids, save, promote, generation, local_hit_tokens=local_hit_tokens,
                                  policy=policy).result()

    def acquire_async(self, token_ids: Sequence[int] | np.ndarray, save: bool = False, promote: str = "wait",
                      generation: int | None = None, *, local_hit_tokens: int = 0,
                      policy: str = "") -> PendingAcquire:
        """Send an acquire now and collect its reply later (``result()``), so that the round trip
        overlaps the engine's own work (the connector sends a step's acquires together).
        Every pending acquire must end by ``result()`` or ``cancel()``: its reply may hold a lease
        (one given up is released when its reply comes). ``generation``: the session it is for
        (DaemonDown at once if that one has ended). ``promote``: one of proto.messages.PROMOTE_MODES
        ("wait": the daemon's cost model decides, under ``policy`` ("": the daemon's) and for the
        tokens beyond the engine's own ``local_hit_tokens``, whether to promote what only L3 or the
        remote store holds before replying; "recompute": the engine recomputes beyond its own hit
        whatever the reply says, nothing is promoted; "none": no tier below L2 is weighed)."""
        session_id, generation = self._session(generation, live=True)
        request_id = self._channel.begin(MsgKind.ACQUIRE, {
            "session_id": session_id, "token_ids": token_bytes(token_ids), "local_hit_tokens": local_hit_tokens,
            "policy": policy, "save": save, "promote": promote})
        return PendingAcquire(self._channel, request_id, generation, self._on_not_attached)

    def lookup(self, token_ids: Sequence[int] | np.ndarray, tp_group: bool = False, generation: int | None = None,
               *, local_hit_tokens: int = 0, policy: str = "", prefetch: bool = False) -> LookupReply:
        """``lookup_async``, waited for."""
        return self.lookup_async(token_ids, tp_group, generation, local_hit_tokens=local_hit_tokens, policy=policy,
                                 prefetch=prefetch).result()

    def lookup_async(self, token_ids: Sequence[int] | np.ndarray, tp_group: bool = False,
                     generation: int | None = None, *, local_hit_tokens: int = 0, policy: str = "",
                     prefetch: bool = False) -> PendingLookup:
        """Ask how much of a prefix is cached, changing nothing (no lease, no LRU update): the reply
        (``result()``) has the hit per tier and the daemon's decision (where the tokens beyond the
        engine's own ``local_hit_tokens`` should come from, under ``policy``).
        prefetch: what an engine's lookups ask: L3 and the remote store are candidates too, and an
        L3 hit the decision declines may be promoted in the background (a tool that only reads the
        hits does not). tp_group: the least hit over every rank of this engine's tensor-parallel
        group. DaemonDown at once while it is down."""
        session_id, generation = self._session(generation, live=True)
        request_id = self._channel.begin(MsgKind.LOOKUP, {
            "session_id": session_id, "token_ids": token_bytes(token_ids), "local_hit_tokens": local_hit_tokens,
            "policy": policy, "tp_group": tp_group, "prefetch": prefetch})
        return PendingLookup(self._channel, request_id, generation, self._on_not_attached)

    def request_async(self, kind: MsgKind, body: dict[str, Any], reply_type: type,
                      generation: int | None = None) -> PendingReply:
        """Send a request of the session (of ``generation``) now; ``result()`` decodes its reply as
        ``reply_type`` later. DaemonDown at once unless that session is attached. Not for requests
        whose reply may carry a lease (``acquire_async``)."""
        assert kind not in LEASE_KINDS, kind
        session_id, generation = self._session(generation, live=True)
        request_id = self._channel.begin(kind, {"session_id": session_id, **body})
        return PendingReply(self._channel, request_id, generation, self._on_not_attached, kind, reply_type)

    def send_async(self, kind: MsgKind, body: dict[str, Any], generation: int | None = None) -> bool:
        """Send a request of the session (of ``generation``) that is not waited for; its error
        reply, if any, comes through ``poll_errors``. False: not sent, the session has ended."""
        return self._send_async(kind, body, generation)

    def _release_orphan(self, lease_id: int, generation: int) -> None:
        if self._connection.state in (ConnectionState.DETACHED, ConnectionState.CLOSED):
            return                # no session: the daemon reclaimed its leases when it ended
        session = self._session(generation or None, live=False)
        if session is None:       # its session ended, and with it the lease
            return
        logger.info("releasing lease %d granted by an acquire that was given up (cancelled or timed out)", lease_id)
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

    def commit(self, lease_id: int, page_ids: Sequence[int], generation: int | None = None) -> bool:
        """Publish the written reserved pages of a lease (a prefix of its reservation, in order) and
        end it, without waiting. False: not sent, the session has ended (and the lease with it)."""
        return self._send_async(MsgKind.COMMIT, {"lease_id": lease_id, "page_ids": [int(p) for p in page_ids]},
                                generation)

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
        releases of leases from acquires given up; returns their errors like ``poll_errors``.
        DaemonDown at once while the daemon is down."""
        channel = self._channel
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if self._connection.state is ConnectionState.DETACHED:
            return self.poll_errors()
        session_id, generation = self._session(None, live=True)
        heartbeat = {"session_id": session_id}
        # The daemon answers one socket's requests in order, except an acquire that waits for a
        # promotion, which is answered when the read is done: the heartbeat's reply comes after
        # every other earlier reply, then late acquire replies are waited for. A given-up acquire's
        # reply triggers the release of its lease: that release needs a last round.
        channel.give_up_dropped()       # their releases are sent now, and waited for below
        if channel.pending_async or channel.abandoned:
            channel.request(MsgKind.HEARTBEAT, heartbeat, timeout_s, generation)
        channel.absorb_until(lambda: channel.abandoned_acquires() == 0, deadline)
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
