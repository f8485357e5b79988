"""The daemon's I/O layer: one ZeroMQ ROUTER socket, an asyncio (uvloop) loop, file I/O threads.

It decodes a frame, calls one ``DaemonState`` method, and replies to the sender only. Every
request gets a reply or an error reply; a bad frame never reaches the state and never stops
the daemon. One ``contextlib.ExitStack`` owns every resource, so they close once, in reverse
order of creation, also when start-up fails halfway.

Threads. The ROUTER socket belongs to one socket thread that blocks in ``zmq_poll`` and
handles each request as it arrives: waking an event loop for every message cost more than the
request itself (a lookup or an acquire is a few microseconds of state work). The asyncio loop owns time and
file I/O: the session reaper, and tier moves (L2<->L3) that await the I/O thread pool; a reply
that waits for such a move is handed back to the socket thread through an outbox and an
inproc wake-up socket, since a ZeroMQ socket is used by one thread only. ``state_lock`` makes
every touch of ``DaemonState`` exclusive; nothing awaits while holding it.

Liveness. The loop reads one pidfd per watched engine (``liveness.PidWatcher``): an engine that
exits loses its session at once. Expiry of silent sessions is decided in the socket thread, right
after it has taken in every request already queued (heartbeats sent while nobody looked), and
time in which the daemon itself did not run is credited to every session (``note_running``).

Beside it: the request handlers (``handlers.py``) and the tier moves (``moves.py``), mixed into
``Server``; start-up and the resources' owner (``startup.py``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import inspect
import os
import threading
import time
from typing import Any, Awaitable, Callable, Iterator

import zmq

from kvcached.config import DaemonConfig
from kvcached.core import counters
from kvcached.core.daemon import DaemonState
from kvcached.server.handlers import (MAX_STATUS_PEERS, MAX_UNREAD_STATUS_REPLIES, UNREAD_STATUS_FORGET_S,
                                      RequestHandlers)
from kvcached.server.io_workers import IoExecutor, WriteBackoff
from kvcached.server.kv_events import KVEventPublisher
from kvcached.server.liveness import PidWatcher
from kvcached.server.l3_index_store import L3IndexStore
from kvcached.server.moves import TierMoves
from kvcached.server.refusals import RefusalLog
from kvcached.server.remote_store import RemoteStore
from kvcached.server.shm import EpochFiles, SharedSegment
from kvcached.server.status_credits import StatusCredits
from kvcached.server.storage_file import StorageFile
from proto import codec
from proto.errors import ErrorCode, ProtocolError
from proto.messages import MsgKind

logger = logging.getLogger(__name__)

REAPER_INTERVAL_S = 0.1
# A gap between two reaper observations longer than this is time the daemon did not run.
PAUSE_GAP_S = 3 * REAPER_INTERVAL_S
# Sockets remembered per session, to tell each that the daemon stops (a request socket and a
# heartbeat socket; more only when an engine reconnects: the oldest are forgotten first).
MAX_PEERS_PER_SESSION = 4


class Server(RequestHandlers, TierMoves):
    def __init__(self, config: DaemonConfig, state: DaemonState, socket: zmq.Socket,
                 segment: SharedSegment, storage: StorageFile | None = None,
                 executor: IoExecutor | None = None, index: L3IndexStore | None = None,
                 epoch_files: EpochFiles | None = None, hints_path: str = "", remote: RemoteStore | None = None,
                 kv_publisher: KVEventPublisher | None = None):
        self.config = config
        self.kv_publisher = kv_publisher
        self.remote = remote
        self.hints_path = hints_path
        self.state = state
        self.socket = socket
        self.segment = segment
        self.storage = storage
        self.executor = executor
        self.index = index
        self.epoch_files = epoch_files
        self.started_at = time.time()
        self.http_address: str | None = None       # HOST:PORT of the HTTP listener, once it serves
        self.stop_event = asyncio.Event()
        self.state_lock = threading.Lock()
        self.refusals = RefusalLog(config.refusal_log_interval_s)
        self.status_credits = StatusCredits(MAX_UNREAD_STATUS_REPLIES, MAX_STATUS_PEERS,
                                            UNREAD_STATUS_FORGET_S)
        self._requester = b""           # socket thread: the identity of the peer whose request is handled
        self.write_backoff = WriteBackoff(log_interval_s=config.refusal_log_interval_s)
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._socket_thread: threading.Thread | None = None
        self._outbox: collections.deque[list[bytes]] = collections.deque()
        self._kv_slices: Iterator[None] | None = None       # socket thread: the KV events being sent
        self._socket_thread_id: int | None = None
        # Socket thread: what a handler leaves for after its reply is sent (``_handle``), such as
        # planning a background promotion: it does not change the reply, so no engine waits for it.
        self._after_reply: list[Callable[[], None]] = []
        self._stopping = False
        self._reap_requested = False
        self.watcher: PidWatcher | None = None
        # session id -> the identities (an ordered set) of the sockets that sent its requests
        self._session_peers: dict[int, dict[bytes, None]] = {}
        context = socket.context
        self._wake_address = f"inproc://kvcached-wake-{id(self)}"
        self._wake_receiver = context.socket(zmq.PAIR)
        self._wake_receiver.bind(self._wake_address)
        self._wake_sender = context.socket(zmq.PAIR)
        self._wake_sender.connect(self._wake_address)
        self._handlers: dict[MsgKind, Callable[[dict], dict[str, Any] | None]] = {
            MsgKind.ATTACH: self._attach,
            MsgKind.DETACH: self._detach,
            MsgKind.HEARTBEAT: self._heartbeat,
            MsgKind.LOOKUP: self._lookup,
            MsgKind.ACQUIRE: self._acquire,
            MsgKind.COMMIT: self._commit,
            MsgKind.RELEASE: self._release,
            MsgKind.STATUS: self._status,
            MsgKind.ENGINE_REPORT: self._engine_report,
            MsgKind.PEER_REGISTER: self._peer_register,
            MsgKind.PEER_PUBLISH: self._peer_publish,
            MsgKind.PEER_LIST: self._peer_list,
        }

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.watcher = PidWatcher(self._loop, self._process_gone)
        self._socket_thread = threading.Thread(target=self._socket_loop, name="kvcached-socket", daemon=True)
        self._socket_thread.start()
        reaper = asyncio.create_task(self._reap_loop(), name="reap")
        try:
            await self.stop_event.wait()
        finally:
            reaper.cancel()
            await asyncio.gather(reaper, return_exceptions=True)
            # Pending tier moves first, while the socket thread still sends: each waits for its
            # I/O, returns its private pages, and a waiting acquire gets its SHUTTING_DOWN reply.
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._stop_socket_thread()
            await self._loop.run_in_executor(None, self._socket_thread.join)
            self.watcher.close()
            self.refusals.flush()

    def _stop_socket_thread(self) -> None:
        self._stopping = True
        self._wake_socket_thread()

    def _wake_socket_thread(self) -> None:
        try:
            self._wake_sender.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass      # wake-ups are queued already

    def close_wake_sockets(self) -> None:
        """Owned by serve()'s ExitStack, so that they close even if run() never ran or was cut short
        (the context's term() would wait for them forever)."""
        if self._socket_thread is not None and self._socket_thread.is_alive():
            self._stop_socket_thread()
            self._socket_thread.join(timeout=5.0)
        self._wake_sender.close(0)
        self._wake_receiver.close(0)

    def _socket_loop(self) -> None:
        self._socket_thread_id = threading.get_ident()
        try:
            poller = zmq.Poller()
            poller.register(self.socket, zmq.POLLIN)
            poller.register(self._wake_receiver, zmq.POLLIN)
            replay = self.kv_publisher.replay if self.kv_publisher is not None else None
            if replay is not None:
                poller.register(replay, zmq.POLLIN)
            spin_s = self.config.socket_spin_us / 1e6
            spin_until = 0.0
            if self.config.socket_cpu is not None:
                try:
                    os.sched_setaffinity(0, {self.config.socket_cpu})     # this thread only
                except OSError as exc:      # checked at start; the CPU set may have changed since
                    logger.warning("socket thread not pinned to CPU %d: %s", self.config.socket_cpu, exc)
            while True:
                # After a request, poll without sleeping for spin_s: the next request of a busy
                # engine usually follows within microseconds, and a sleeping thread's wake-up
                # costs more than that on virtual machines. Each turn yields the CPU, so that
                # ZeroMQ's I/O thread, when it shares it (socket_cpu), runs at once.
                if spin_s and time.perf_counter() < spin_until:
                    ready = dict(poller.poll(0))
                    if not ready:
                        os.sched_yield()
                        continue
                elif self._kv_events_due():
                    # KV events are hashed and sent a slice at a time while no request waits, on
                    # this thread: a request waits for one slice at most, never for a lock or the GIL.
                    ready = dict(poller.poll(0))
                    if not ready:
                        self._publish_kv_slice()
                        continue
                else:
                    ready = dict(poller.poll())
                if replay is not None and replay in ready:
                    self.kv_publisher.serve_replay()
                    if len(ready) == 1:
                        continue
                spin_until = time.perf_counter() + spin_s
                if self._wake_receiver in ready:
                    while self._wake_receiver.poll(0):
                        self._wake_receiver.recv()
                    with self.state_lock:       # _send_frames may count a dropped reply
                        while self._outbox:
                            self._send_frames(self._outbox.popleft())
                        if self._stopping:
                            self._send_shutdown()
                    if self._stopping:
                        return
                    if self._reap_requested:
                        self._reap_requested = False
                        self._reap()
                        continue
                if self.socket in ready:
                    self._receive_all()
        except Exception:
            logger.exception("the socket thread failed; stopping the daemon")
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self.stop_event.set)

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            with self.state_lock:
                if len(frames) == 2:
                    self._handle(frames[0], frames[1])
                elif frames:
                    # A DEALER sends [identity, payload]; anything else has no single payload to answer.
                    message = f"expected one frame, got {len(frames) - 1}"
                    self._refused(ErrorCode.BAD_FRAME, message)
                    self._send(frames[0], MsgKind.ERROR, 0, codec.error_body(ErrorCode.BAD_FRAME, message))

    def _handle(self, identity: bytes, payload: bytes) -> None:
        try:
            if self._answer(identity, payload):
                for work in self._after_reply:
                    try:
                        work()
                    except Exception:       # our bug: the reply is out; the socket thread serves on
                        logger.exception("work after a reply failed")
                        self.state.metrics.add(counters.INTERNAL_ERRORS)
        finally:
            self._after_reply.clear()       # a refused request's: it was not answered as they expect

    def _answer(self, identity: bytes, payload: bytes) -> bool:
        """Handle one request and send its reply (or its error); False for an error."""
        request_id = 0
        try:
            frame = codec.decode(payload, self.config.max_frame_bytes)
            request_id = frame.request_id
            handler = self._handlers.get(frame.kind)
            if handler is None:
                raise ProtocolError(ErrorCode.UNKNOWN_KIND, f"{frame.kind.name} is not a request")
            started_s = time.perf_counter()
            self._requester = identity
            reply = handler(frame.body)
            self.state.metrics.observe(counters.REQUEST_SECONDS, time.perf_counter() - started_s,
                                       frame.kind.name.lower())
            self._note_peer(identity, frame, reply)
            if inspect.isawaitable(reply):    # finishes after file I/O; other peers are served meanwhile
                self._spawn_threadsafe(self._reply_later(identity, request_id, reply))
            elif reply is not None:           # None: a request that asked for no success reply
                self._send(identity, MsgKind.REPLY, request_id, reply)
            return True
        except ProtocolError as exc:
            if request_id == 0:
                request_id = codec.peek_request_id(payload)
            self._refused(exc.code, exc.message)
            self._send(identity, MsgKind.ERROR, request_id, codec.error_body(exc.code, exc.message))
        except Exception as exc:  # our bug: report it to the peer, keep serving the others
            logger.exception("internal error while handling a request")
            self.state.metrics.add(counters.INTERNAL_ERRORS)
            self._send(identity, MsgKind.ERROR, request_id,
                       codec.error_body(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        return False

    def _note_peer(self, identity: bytes, frame: codec.Frame, reply: Any) -> None:
        """Remember which socket served a live session (a request of it was handled), so that a
        stopping daemon can tell it (_send_shutdown)."""
        if frame.kind == MsgKind.ATTACH:
            session_id = reply["session_id"]
            # A new session: forget those that ended (their sockets need no SHUTDOWN).
            for ended in [s for s in self._session_peers if s not in self.state.sessions]:
                del self._session_peers[ended]
        else:
            session_id = frame.body.get("session_id")
            if type(session_id) is not int or session_id not in self.state.sessions:
                return
        peers = self._session_peers.setdefault(session_id, {})
        if identity not in peers:
            peers[identity] = None
            if len(peers) > MAX_PEERS_PER_SESSION:
                del peers[next(iter(peers))]

    def _send_shutdown(self) -> None:
        """On the socket thread, last: each socket of a live session learns that the daemon stops,
        so that its engine skips the daemon at once instead of waiting for a heartbeat to fail."""
        for session_id, peers in self._session_peers.items():
            if session_id not in self.state.sessions:
                continue
            frame = codec.encode(MsgKind.SHUTDOWN, 0, {"session_id": session_id,
                                                       "reason": "the daemon is shutting down"})
            for identity in peers:
                try:
                    self.socket.send_multipart([identity, frame], flags=zmq.NOBLOCK)
                except zmq.ZMQError:        # gone, or not reading: it learns from its heartbeats
                    pass
        self._session_peers.clear()

    async def _reply_later(self, identity: bytes, request_id: int, reply: Awaitable[dict[str, Any]]) -> None:
        """Runs on the event loop; the reply goes out through the socket thread."""
        try:
            body = await reply
            self._post(identity, MsgKind.REPLY, request_id, body)
        except ProtocolError as exc:
            with self.state_lock:
                self._refused(exc.code, exc.message)
            self._post(identity, MsgKind.ERROR, request_id, codec.error_body(exc.code, exc.message))
        except asyncio.CancelledError:
            self._post(identity, MsgKind.ERROR, request_id,
                       codec.error_body(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
            raise
        except Exception as exc:
            logger.exception("internal error while finishing a request")
            with self.state_lock:
                self.state.metrics.add(counters.INTERNAL_ERRORS)
            self._post(identity, MsgKind.ERROR, request_id,
                       codec.error_body(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))

    def _refused(self, code: ErrorCode, message: str) -> None:
        """Count a refused request; logged at DEBUG, summarised per interval (RefusalLog). Under state_lock."""
        self.state.metrics.add(counters.REFUSED_REQUESTS, 1, code.name.lower())
        self.refusals.note(code.name, message)

    def _post(self, identity: bytes, kind: MsgKind, request_id: int, body: dict[str, Any]) -> None:
        """Send from the event loop: queue the frames and wake the socket thread."""
        self._outbox.append([identity, codec.encode(kind, request_id, body)])
        self._wake_socket_thread()      # it drains the whole outbox

    def _spawn_threadsafe(self, coroutine: Awaitable[Any]) -> None:
        """From the socket thread: run a coroutine on the event loop."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._spawn, coroutine)

    def _spawn(self, coroutine: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _send(self, identity: bytes, kind: MsgKind, request_id: int, body: dict[str, Any]) -> None:
        """Send from the socket thread."""
        self._send_frames([identity, codec.encode(kind, request_id, body)])

    def _send_frames(self, frames: list[bytes]) -> None:
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            # The peer is not reading; we never block the loop on one engine.
            self.state.metrics.add(counters.REPLIES_DROPPED)
            logger.warning("dropped a reply to a peer that is not reading")
        except zmq.ZMQError as exc:
            self.state.metrics.add(counters.REPLIES_DROPPED)
            logger.warning("could not reply to a peer: %s", exc)

    def kv_events_recorded(self) -> None:
        """The KV events' buffer got its first event (under state_lock): the socket thread sends
        them, woken here unless it recorded them itself (it looks at the buffer after each request)."""
        if threading.get_ident() != self._socket_thread_id:
            self._wake_socket_thread()

    def _kv_events_due(self) -> bool:
        """Events to hash and send (socket thread)."""
        return self._kv_slices is not None or (self.kv_publisher is not None and len(self.state.kv_events) > 0)

    def _publish_kv_slice(self) -> None:
        """Socket thread, while no request waits: one slice of the KV events' work (events recorded
        since the last take are taken under the lock; hashing and sending go on without it)."""
        assert self.kv_publisher is not None
        if self._kv_slices is None:
            with self.state_lock:
                events, dropped = self.state.kv_events.take()
                self.state.metrics.add(counters.KV_EVENTS_SENT, len(events))
                self.state.metrics.add(counters.KV_EVENTS_DROPPED, dropped)
            if not events and not dropped:
                return
            self._kv_slices = self.kv_publisher.publish(events, dropped)
        try:
            next(self._kv_slices)
        except StopIteration:
            self._kv_slices = None
        except Exception:       # our bug: those events are lost (a gap); requests are served on
            self._kv_slices = None
            logger.exception("publishing KV events failed")
            self.state.metrics.add(counters.INTERNAL_ERRORS)

    async def _reap_loop(self) -> None:
        assert self.watcher is not None
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            with self.state_lock:
                self.state.note_running(PAUSE_GAP_S)
                for session_id in self.watcher.session_ids():
                    if not self.state.watches(session_id):     # detached, or its quarantine ended
                        self.watcher.discard(session_id)
            self._reap_requested = True
            self._wake_socket_thread()
            if self.remote is not None:
                self.remote.probe_if_due()

    def _reap(self) -> None:
        """In the socket thread: take in the requests already queued (heartbeats that came while
        the daemon was busy or stopped), then end what has been silent too long."""
        self._receive_all()
        with self.state_lock:
            self.state.note_running(PAUSE_GAP_S)
            self.state.expire_sessions()
            self.refusals.flush_due()

    def _watch(self, session_id: int, pidfd: int) -> None:
        """On the loop: read the pidfd of a session attached by the socket thread."""
        assert self.watcher is not None
        with self.state_lock:
            if self.state.watches(session_id):
                self.watcher.add(session_id, pidfd)
                return
        os.close(pidfd)       # it ended already (detached)

    def _process_gone(self, session_id: int) -> None:
        with self.state_lock:
            self.state.process_gone(session_id)
