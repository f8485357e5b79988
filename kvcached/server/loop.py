"""The daemon's I/O layer: one ZeroMQ ROUTER socket, an asyncio (uvloop) loop, file I/O threads.

It decodes a frame, calls one ``DaemonState`` method, and replies to the sender only. Every
request gets a reply or an error reply; a bad frame never reaches the state and never stops
the daemon. One ``contextlib.ExitStack`` owns every resource, so they close once, in reverse
order of creation, also when start-up fails halfway.

Threads. The ROUTER socket belongs to one socket thread that blocks in ``zmq_poll`` and
handles each request as it arrives: waking an event loop for every message cost more than the
request itself (a match is a few microseconds of state work). The asyncio loop owns time and
file I/O: the session reaper, and tier moves (L2<->L3) that await the I/O thread pool; a reply
that waits for such a move is handed back to the socket thread through an outbox and an
inproc wake-up socket, since a ZeroMQ socket is used by one thread only. ``state_lock`` makes
every touch of ``DaemonState`` exclusive; nothing awaits while holding it.

Liveness. The loop reads one pidfd per watched engine (``liveness.PidWatcher``): an engine that
exits loses its session at once. Expiry of silent sessions is decided in the socket thread, right
after it has taken in every request already queued (heartbeats sent while nobody looked), and
time in which the daemon itself did not run is credited to every session (``note_running``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import os
import inspect
import signal
import socket as socket_module
import sqlite3
import threading
import time
from typing import Any, Awaitable, Callable, Iterator

import zmq

from kvcached.config import DaemonConfig
from kvcached.core import counters
from kvcached.core.cost_model import CostModel
from kvcached.core.daemon import DaemonState, RemoteAsk, RemoteWrite
from kvcached.core.hints import AdmissionHints
from kvcached.core.storage import SlotLayout
from kvcached.core.tier_ops import OpState, TierMove
from kvcached.core.tiers import Tier
from kvcached.server.http import HttpAddressTaken, HttpListener, format_http_address
from kvcached.core.kv_events import EventBuffer
from kvcached.server.io_workers import (IoExecutor, StorageFile, UnsafeFileError, WriteBackoff, read_pages,
                                       write_pages)
from kvcached.server.kv_events import KVEventPublisher
from kvcached.server.liveness import PidWatcher, open_pidfd
from kvcached.server.lookup import LookupQuery, LookupRefused
from kvcached.server.l3_index_store import IndexNotWritable, L3IndexStore, index_path
from kvcached.server.refusals import RefusalLog
from kvcached.server.remote_store import RemoteSettings, RemoteStore, RemoteUnavailable
from kvcached.server.shm import (DaemonLock, EpochFiles, GenerationFiles, SharedSegment, SocketDirectory,
                                 StartupError, check_pool_fits, epoch_file_prefix, generation_file_prefix,
                                 hints_file_name, segment_name)
from kvcached.server.status import hide_salts
from kvcached.server.status_credits import StatusCredits
from proto import codec, hints
from proto.errors import ErrorCode, ProtocolError, preview
from proto.messages import PROTOCOL_VERSION, MsgKind
from proto.page_keys import chain_page_keys
from proto.replies import AttachInfo, DetachReply, MatchReply, PeerListReply, PeerRegisterReply, to_wire
from proto.schema import Attach, BackupCommit, EngineReport, Match, PeerPublish, PeerRegister, Release, SessionRequest

logger = logging.getLogger(__name__)

REAPER_INTERVAL_S = 0.1
# A gap between two reaper observations longer than this is time the daemon did not run.
PAUSE_GAP_S = 3 * REAPER_INTERVAL_S
# Sockets remembered per session, to tell each that the daemon stops (a request socket and a
# heartbeat socket; more only when an engine reconnects: the oldest are forgotten first).
MAX_PEERS_PER_SESSION = 4
# How long closing the socket may take to deliver what is queued: the SHUTDOWN frames.
SHUTDOWN_LINGER_MS = 200
# ZeroMQ drops a peer whose message exceeds this; below it, oversize frames get an error reply.
HARD_FRAME_FACTOR = 4
# A write-through waits this long, at most, for the index to forget its slots' old pages.
INDEX_DELETE_TIMEOUT_S = 10.0
# KV events recorded and not yet taken by the loop, at most (their paths' token bytes); beyond it
# they are dropped and counted (a subscriber sees a gap in the sequence numbers).
KV_EVENTS_BUFFER_BYTES = 64 << 20
# An HTTP request waits this long, at most, for the state lock (then 503).
HTTP_SNAPSHOT_TIMEOUT_S = 2.0
# Replies queued for one peer that does not read them; beyond it they are dropped and counted
# (replies_dropped). An engine's ZeroMQ thread reads its replies as they come, so its queue here
# stays short; this bounds the messages of one that stops reading.
MAX_QUEUED_REPLIES_PER_PEER = 1000
# Status snapshots are large: a peer gets at most this many that it has not shown it read
# (kvcached/server/status_credits.py); peers remembered for that, least recent forgotten first;
# a reply unread this long is forgotten.
MAX_UNREAD_STATUS_REPLIES = 2
MAX_STATUS_PEERS = 4096
UNREAD_STATUS_FORGET_S = 60.0
# A write-through to the remote store is on no request's path: it may take this many times a get's
# deadline before it counts as failed (and the breaker opens).
PUT_TIMEOUT_FACTOR = 10


class Server:
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
            MsgKind.MATCH: self._match,
            MsgKind.RELEASE: self._release,
            MsgKind.BACKUP_COMMIT: self._commit,
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
            # I/O, returns its private pages, and a waiting match gets its SHUTTING_DOWN reply.
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

    async def _run_move(self, move: TierMove,
                        then: Callable[[bool], Any] | None = None) -> Any:
        """Run one tier move's file I/O off the loop; publish it on success, return its pages on
        failure. ``then(ok)`` runs under the same hold of the state lock as the publication, so
        nothing (an eviction by another request) can come between them; its result is returned,
        else ``ok``."""
        assert self.storage is not None and self.executor is not None
        namespace = self.state.namespaces[move.namespace_id]
        bytes_per_page = namespace.geometry.bytes_per_page
        assert namespace.l3_allocator is not None
        # Page and slot ids are absolute (kvcached/core/chunks.py): the namespace's pages span the
        # segment from its start, its slots the file.
        layout = SlotLayout(bytes_per_page, namespace.l3_allocator.num_pages)
        pages_end = namespace.num_pages * bytes_per_page
        metrics = self.state.metrics
        direction = move.direction
        enqueued_s = time.perf_counter()
        ok = False
        page_keys: list[bytes] = []
        try:
            with memoryview(self.segment.mapping) as whole, whole[:pages_end] as arena:
                if move.destination is Tier.L3 and self.index is not None:
                    result, page_keys = await self.executor.run(
                        _write_indexed, self.index, self.storage, layout, arena, namespace.geometry.page_size, move)
                elif move.destination is Tier.L3:
                    result = await self.executor.run(write_pages, self.storage, layout, arena, bytes_per_page,
                                                     move.source_page_ids, move.private_page_ids)
                else:
                    result = await self.executor.run(read_pages, self.storage, layout, arena, bytes_per_page,
                                                     move.source_page_ids, move.private_page_ids,
                                                     self.index is not None)
            ok = True
            end_to_end_s = time.perf_counter() - enqueued_s
            with self.state_lock:
                metrics.add(counters.IO_MOVES, 1, direction)
                metrics.add(counters.IO_BYTES, result.num_bytes, direction)
                metrics.add(counters.IO_SERVICE_SECONDS_SUM, result.seconds, direction)
                metrics.add(counters.IO_EXTENTS, result.num_extents, direction)
                metrics.add(counters.IO_QUEUE_WAIT_SECONDS_SUM, max(0.0, end_to_end_s - result.seconds), direction)
                metrics.add(counters.IO_END_TO_END_SECONDS_SUM, end_to_end_s, direction)
                # What a request waiting for such a move would wait: queueing, the file I/O, the hand-back.
                if self.state.cost.add_storage_sample(direction, result.num_bytes, end_to_end_s) and direction == "s2h":
                    self.state.publish_cost_hints()
                metrics.observe(counters.IO_SERVICE_SECONDS, result.seconds, direction)
                metrics.observe(counters.IO_QUEUE_WAIT_SECONDS, max(0.0, end_to_end_s - result.seconds), direction)
                metrics.observe(counters.IO_END_TO_END_SECONDS, end_to_end_s, direction)
        except (OSError, ValueError) as exc:
            if move.destination is Tier.L3:
                with self.state_lock:
                    self.write_backoff.failed(exc)         # one line per cause per interval, a pause
            else:
                logger.warning("%s of %d pages failed: %s", direction, len(move.private_page_ids), exc)
        except BaseException:
            # Cancelled (the daemon is stopping) or our bug: the move still ends, so its pages are
            # not leaked, and the exception goes on (a cancellation must reach the caller).
            with self.state_lock:
                self.state.finish_move(move, ok)
            raise
        with self.state_lock:
            if ok:
                move.page_checksums, move.page_keys = list(result.page_checksums), page_keys
                if move.destination is Tier.L3:
                    self.write_backoff.succeeded()
            self.state.finish_move(move, ok)
            return then(ok) if then is not None else ok

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

    # ---- handlers: body in, reply body out ------------------------------------------------

    def _attach(self, body: dict) -> dict[str, Any]:
        version = body.get("protocol_version")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(ErrorCode.VERSION_MISMATCH,
                                f"daemon speaks protocol {PROTOCOL_VERSION}, engine sent {preview(version)}")
        request = Attach.parse(body)
        pidfd, why = (open_pidfd(request.pid, request.pid_namespace_id, request.process_start_time)
                      if self.config.pid_watch else (None, "pid watching is off"))
        try:
            session, namespace = self.state.attach(
                request.geometry, request.pid, request.client_name, pid_watched=pidfd is not None,
                pid_namespace_id=request.pid_namespace_id, process_start_time=request.process_start_time,
                previous_session_id=request.previous_session_id)
        except BaseException:
            if pidfd is not None:
                os.close(pidfd)
            raise
        if pidfd is not None:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._watch, session.session_id, pidfd)
        else:
            logger.info("session %x: pid %d not watched (%s); heartbeats only", session.session_id,
                        request.pid, why)
        return to_wire(AttachInfo(
            session_id=session.session_id,
            namespace_id=namespace.namespace_id,
            shm_path=self.segment.path,
            arena_offset_bytes=0,           # page ids are absolute: the pages span the whole segment
            num_pages=namespace.num_pages,
            bytes_per_page=namespace.geometry.bytes_per_page,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            session_timeout_s=self.config.session_timeout_s,
            max_frame_bytes=self.config.max_frame_bytes,
            daemon_pid=os.getpid(),
            protocol_version=PROTOCOL_VERSION,
            pid_watched=pidfd is not None,
            session_grace_s=self.config.session_grace_s,
            hints_path=self.hints_path,
            hints_offset_bytes=self.state.hints.offset(namespace.hints_slot) if self.hints_path else 0,
            generations_path=namespace.generations.path,
        ))

    def _detach(self, body: dict) -> dict[str, Any]:
        request = SessionRequest.parse(body)
        return to_wire(DetachReply(self.state.detach(request.session_id)))

    def _heartbeat(self, body: dict) -> dict[str, Any]:
        self.state.heartbeat(SessionRequest.parse(body).session_id)
        return {}

    def _match(self, body: dict) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        request = Match.parse(body)
        ask = self._remote_ask(request)
        if ask is not None:
            return self._match_remote(request, ask)
        if not request.lock:
            reply = self.state.lookup(request.session_id, request.token_ids, request.tp_group,
                                      request.local_hit_tokens, request.policy, request.promote_l3)
            if request.promote_l3 and not request.tp_group:
                self._after_reply.append(functools.partial(self._promote_in_background, request, reply))
            return to_wire(reply)
        outcome = self.state.match(request.session_id, request.token_ids, request.reserve_backup,
                                   promote_l3=request.promote_l3, local_hit_tokens=request.local_hit_tokens,
                                   policy=request.policy, recompute=request.recompute)
        if isinstance(outcome, TierMove):
            return self._match_after_promotion(request, outcome)
        if request.begun and (request.promote_l3 or request.recompute):    # it stands for a lookup: declines alike
            self._after_reply.append(functools.partial(self._promote_in_background, request, outcome))
        return to_wire(outcome)

    # ---- the remote tier (kvcached/server/remote_store.py) ------------------------------------

    def _remote_ask(self, request: Match) -> RemoteAsk | None:
        """What to ask the store before this lookup or match: with a remote tier that is reachable
        now, a request that asks for the lower tiers (promote_l3), one rank, the pages after its
        L2 hit (``DaemonState.remote_ask``)."""
        if self.remote is None or not request.promote_l3 or request.tp_group or request.recompute:
            return None
        ask = self.state.remote_ask(request.session_id, request.token_ids)
        if ask is None:
            return None
        if not self.remote.available():
            self.remote.count(counters.REMOTE_SKIPS, 1, "exist")
            return None
        return ask

    async def _match_remote(self, request: Match, ask: RemoteAsk) -> dict[str, Any]:
        """Ask the store which following pages it holds (one call, its own deadline; a failure or
        a late answer is a miss), then look up or match with them as a candidate; a match whose
        decision takes them gets them into L2 first."""
        assert self.remote is not None
        started_s = time.perf_counter()
        try:
            held = await self.remote.run("exist", self.remote.held_pages, ask.namespace_key, ask.token_ids,
                                         ask.page_size, ask.start_page, ask.end_page,
                                         timeout_s=self.config.remote_exist_timeout_s)
        except RemoteUnavailable:
            held = 0
        self.remote.count(counters.REMOTE_LOOKUPS)
        self.remote.count(counters.REMOTE_LOOKUP_SECONDS, time.perf_counter() - started_s)
        self.remote.count(counters.REMOTE_LOOKUP_HELD_PAGES, held)
        remote_tokens = (ask.start_page + held) * ask.page_size if held else 0
        with self.state_lock:
            if not request.lock:
                reply = self.state.lookup(request.session_id, request.token_ids, request.tp_group,
                                          request.local_hit_tokens, request.policy, request.promote_l3,
                                          remote_tokens=remote_tokens)
                self._promote_in_background(request, reply)
                return to_wire(reply)
            outcome = self.state.match(request.session_id, request.token_ids, request.reserve_backup,
                                       promote_l3=request.promote_l3, local_hit_tokens=request.local_hit_tokens,
                                       policy=request.policy, recompute=request.recompute,
                                       remote_tokens=remote_tokens)
            if not isinstance(outcome, TierMove):
                if request.begun:
                    self._promote_in_background(request, outcome)
                return to_wire(outcome)
        if not outcome.remote:
            return await self._match_after_promotion(request, outcome)
        return await self._match_after_remote(request, outcome)

    async def _match_after_remote(self, request: Match, move: TierMove) -> dict[str, Any]:
        """The store's pages into L2 (R2H), waited for at most their deadline; then the match sees
        what was published as an L2 hit. Past the deadline the match goes on without them (the
        engine recomputes), and the gets finish in the background: their pages stay reserved
        until then, and are published if they verify."""
        assert self.remote is not None
        geometry = self.state.namespaces[move.namespace_id].geometry
        timeout_s = self.remote.get_timeout_s(len(move.private_page_ids) * geometry.bytes_per_page)
        task = self._spawn(self._run_remote_move(move))
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except asyncio.TimeoutError:
            self.remote.count(counters.REMOTE_DEADLINE_MISSES, 1, "get")
            self.remote.note_failure("get", f"no pages within {timeout_s:.3f} s")
        with self.state_lock:
            published = move.num_published_pages if move.state is OpState.PUBLISHED else 0
            self.state.metrics.add(counters.REMOTE_RESTORES if published else counters.REMOTE_FALLBACKS)
            outcome = self.state.match(request.session_id, request.token_ids, request.reserve_backup,
                                       promoted_tokens=published * geometry.page_size,
                                       local_hit_tokens=request.local_hit_tokens, policy=request.policy,
                                       decision=move.decision)
            assert not isinstance(outcome, TierMove)
            return to_wire(outcome)

    async def _run_remote_move(self, move: TierMove) -> None:
        """Get a move's pages from the store into its L2 pages, check each value, finish the move.
        Ends only once the worker has returned: until then its pages stay private."""
        assert self.remote is not None
        namespace = self.state.namespaces[move.namespace_id]
        bytes_per_page = namespace.geometry.bytes_per_page
        num_bytes = len(move.private_page_ids) * bytes_per_page
        started_s = time.perf_counter()
        verified, mismatch, ok = 0, "", False
        try:
            future = self.remote.submit("get", self.remote.get_pages, self.state.remote_namespace_key(namespace),
                                        move.token_ids, namespace.geometry.page_size, move.start_page,
                                        list(move.private_page_ids), bytes_per_page)
            try:
                verified, mismatch = await asyncio.shield(asyncio.wrap_future(future))
                ok = True
            except asyncio.CancelledError:
                await asyncio.gather(asyncio.wrap_future(future), return_exceptions=True)
                raise
            except Exception as exc:
                self.remote.note_failure("get", f"{type(exc).__name__}: {exc}")
        except RemoteUnavailable:
            pass
        except BaseException:
            with self.state_lock:
                self.state.finish_move(move, False)
            raise
        seconds = time.perf_counter() - started_s
        with self.state_lock:
            metrics = self.state.metrics
            if ok:
                move.num_verified_pages, move.mismatch = verified, mismatch
                metrics.add(counters.REMOTE_GET_CALLS)
                metrics.add(counters.REMOTE_HIT_PAGES, verified)
                metrics.add(counters.REMOTE_BYTES, verified * bytes_per_page, "read")
                metrics.observe(counters.IO_END_TO_END_SECONDS, seconds, "r2h")
                if verified == len(move.private_page_ids):     # what a match waiting for such a get waits
                    self.state.cost.add_storage_sample("r2h", num_bytes, seconds)
            self.state.finish_move(move, ok)

    def _queue_remote_write(self, write: RemoteWrite) -> None:
        """The state's sink (under state_lock): send a committed path's pages to the store in the
        background; skipped (its pages unlocked at once) while the store is unreachable or too many
        writes are in flight."""
        assert self.remote is not None
        if len(self.state.remote_writes) > self.config.max_pending_writes:
            self.remote.count(counters.REMOTE_WRITE_BACKLOG_SKIPS)
            self.state.finish_remote_write(write, 0)
        elif not self.remote.available():
            self.remote.count(counters.REMOTE_SKIPS, 1, "put")
            self.state.finish_remote_write(write, 0)
        else:
            self._spawn_threadsafe(self._run_remote_write(write))

    async def _run_remote_write(self, write: RemoteWrite) -> None:
        assert self.remote is not None
        namespace = self.state.namespaces[write.namespace_id]
        generations = namespace.generations

        def intact() -> int:        # a worker asks: the leading pages still holding what was published
            return generations.num_leading_intact(write.page_ids, write.generations)

        stored = 0
        try:
            future = self.remote.submit("put", self.remote.put_pages, write.namespace_key, write.token_ids,
                                        write.page_size, write.start_page, write.page_ids, write.bytes_per_page,
                                        intact)
            try:
                stored = await self.remote.wait("put", future, PUT_TIMEOUT_FACTOR * self.remote.get_timeout_s(
                    len(write.page_ids) * write.bytes_per_page))
            except RemoteUnavailable:
                # Failed or late: the pages stay locked until the worker has returned.
                await asyncio.gather(asyncio.wrap_future(future), return_exceptions=True)
        except RemoteUnavailable:
            pass
        finally:
            with self.state_lock:
                self.state.metrics.add(counters.REMOTE_BYTES, stored * write.bytes_per_page, "written")
                self.state.finish_remote_write(write, stored)

    def _promote_in_background(self, request: Match, reply: MatchReply) -> None:
        """Planned once the answer is sent (``_after_reply``): the promotion (if the model asks for
        one) runs on the loop, and no request waits for it, nor for its planning."""
        if self.storage is None:
            return
        move = self.state.promote_in_background(request.session_id, request.token_ids, reply)
        if move is not None:
            self._spawn_threadsafe(self._run_move(move))

    async def _match_after_promotion(self, request: Match, move: TierMove) -> dict[str, Any]:
        """L3 -> L2 first (S2H), then the match sees the promoted pages as an L2 hit."""
        page_size = self.state.namespaces[move.namespace_id].geometry.page_size

        def match_now(ok: bool) -> dict[str, Any]:
            # On failure (or a page whose checksum failed) the engine recomputes what L3 could not give.
            promoted_pages = move.num_published_pages
            self.state.metrics.add(counters.PROMOTIONS if promoted_pages else counters.PROMOTION_FALLBACKS)
            outcome = self.state.match(request.session_id, request.token_ids, request.reserve_backup,
                                       promoted_tokens=promoted_pages * page_size,
                                       local_hit_tokens=request.local_hit_tokens, policy=request.policy,
                                       decision=move.decision)
            assert not isinstance(outcome, TierMove)
            return to_wire(outcome)

        return await self._run_move(move, then=match_now)

    def _release(self, body: dict) -> dict[str, Any] | None:
        request = Release.parse(body)
        self.state.release(request.session_id, request.lease_id)
        return {} if request.ack else None

    def _commit(self, body: dict) -> dict[str, Any] | None:
        request = BackupCommit.parse(body)
        reply, write_through = self.state.commit_backup(request.session_id, request.lease_id,
                                                        request.host_page_ids)
        self._write_through(write_through)
        return to_wire(reply) if request.ack else None

    def _write_through(self, write_through: TierMove | None) -> None:
        if write_through is not None:
            if self.state.pending_moves("h2s") > self.config.max_pending_writes:
                # L3 admission is best effort: a backlog would keep L2 pages locked and slots reserved.
                self.state.finish_move(write_through, ok=False, skipped=True)
            elif not self.write_backoff.allows():
                # Writes fail (a full disk, an I/O error): none is tried until the pause ends.
                self.state.metrics.add(counters.WRITE_BACKOFF_SKIPS)
                self.state.finish_move(write_through, ok=False, skipped=True)
            else:
                self._spawn_threadsafe(self._run_move(write_through))

    def _engine_report(self, body: dict) -> dict[str, Any] | None:
        request = EngineReport.parse(body)
        self.state.engine_report(request.session_id, request.report, request.cost_samples)
        return {} if request.ack else None

    def _peer_register(self, body: dict) -> dict[str, Any]:
        request = PeerRegister.parse(body)
        if self.epoch_files is None:
            raise ProtocolError(ErrorCode.INTERNAL, "this daemon serves no peer restores")
        export = self.state.peer_register(request.session_id, request)
        try:
            path, offset = self.epoch_files.create(export.peer_id, request.num_blocks)
        except OSError as exc:
            self.state.peer_unregister(request.session_id)
            raise ProtocolError(ErrorCode.OUT_OF_SPACE, f"cannot create the peer epoch file: {exc}") from None
        self.state.peer_ready(export, path, offset)
        return to_wire(PeerRegisterReply(export.peer_id, path, offset))

    def _peer_publish(self, body: dict) -> dict[str, Any] | None:
        request = PeerPublish.parse(body)
        self.state.peer_publish(request.session_id, request)
        return {} if request.ack else None

    def _peer_list(self, body: dict) -> dict[str, Any]:
        return to_wire(PeerListReply(self.state.peer_list(SessionRequest.parse(body).session_id)))

    def _io_status(self) -> dict[str, Any]:
        totals = self.state.metrics.counters
        io = {}
        for direction in counters.L3_DIRECTIONS:
            count, seconds, num_bytes, extents = (totals.value(counter, direction) for counter in (
                counters.IO_MOVES, counters.IO_SERVICE_SECONDS_SUM, counters.IO_BYTES, counters.IO_EXTENTS))
            queue_wait_s = totals.value(counters.IO_QUEUE_WAIT_SECONDS_SUM, direction)
            end_to_end_s = totals.value(counters.IO_END_TO_END_SECONDS_SUM, direction)
            io[direction] = {
                "count": count, "bytes": num_bytes, "seconds": round(seconds, 6),
                "gibps": round(num_bytes / seconds / 2**30, 3) if seconds > 0 else 0.0,
                "extents": extents,
                "extents_per_io": round(extents / count, 3) if count else 0.0,
                "failures": totals.value(counters.IO_FAILURES, direction),
                "mean_queue_wait_s": round(queue_wait_s / count, 6) if count else 0.0,
                "mean_end_to_end_s": round(end_to_end_s / count, 6) if count else 0.0,
            }
        io["in_flight"] = self.executor.num_inflight if self.executor else 0
        return io

    def _status(self, body: dict) -> dict[str, Any]:
        read_token = self.status_credits.grant(self._requester, body.get("read_token"))
        if read_token is None:
            raise ProtocolError(ErrorCode.OUT_OF_SPACE, f"{MAX_UNREAD_STATUS_REPLIES} status replies to this "
                                "socket are unread: read them (and give back the last one's read_token)")
        snapshot = self.status_snapshot(check_integrity=body.get("check_integrity", False) is True)
        snapshot["read_token"] = read_token
        return snapshot

    def status_snapshot(self, check_integrity: bool = False) -> dict[str, Any]:
        """What STATUS replies, ``kvcached status --json`` prints and GET /status serves. Under state_lock."""
        snapshot = hide_salts(self.state.status())
        if check_integrity:
            try:
                self.state.check_integrity()
                snapshot["integrity"] = "ok"
            except Exception as exc:
                logger.error("integrity check failed: %s", exc)
                snapshot["integrity"] = f"FAILED: {exc}"
        snapshot["io"] = self._io_status()
        snapshot["daemon"] = {
            "pid": os.getpid(),
            "socket": self.config.socket_path,
            "uptime_s": round(time.time() - self.started_at, 3),
            "l2_segment": self.segment.path,
            "l2_bytes": self.segment.size_bytes,
            "max_namespaces": self.config.max_namespaces,
            "pid_watch": self.config.pid_watch,
            "session_timeout_s": self.config.session_timeout_s,
            "session_grace_s": self.config.session_grace_s,
            "l3_file": self.storage.path if self.storage else None,
            "l3_bytes": self.storage.size_bytes if self.storage else 0,
            "l3_o_direct": self.storage.o_direct if self.storage else False,
            "l3_temporary": self.storage.is_temporary if self.storage else False,
            "l3_index": self.index.status() if self.index else None,
            "io_threads": self.executor.max_workers if self.executor else 0,
            "remote": self.remote.status() if self.remote else None,
            "kv_events": self.kv_publisher.status() if self.kv_publisher else None,
            "protocol_version": PROTOCOL_VERSION,
            "http": self.http_address,
        }
        snapshot["time"] = time.time()
        return snapshot

    def locked_status_snapshot(self, timeout_s: float) -> dict[str, Any]:
        """From another thread (the HTTP listener's): the snapshot, taken under state_lock within
        timeout_s, else TimeoutError. The socket thread and the loop hold the lock only briefly."""
        if not self.state_lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"the daemon's state was busy for timeout_s={timeout_s}")
        try:
            return self.status_snapshot()
        finally:
            self.state_lock.release()


    def http_lookup(self, query: LookupQuery, timeout_s: float) -> dict[str, Any]:
        """From the HTTP listener's thread: POST /lookup's answer (kvcached/server/lookup.py). The
        tiers are read under state_lock, waited for at most timeout_s (else TimeoutError); with a
        remote tier, the store is then asked for the pages after each L2 hit, as an engine's
        lookup asks it (one call, its own deadline; a failure or a late answer holds nothing)."""
        if not self.state_lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"the daemon's state was busy for timeout_s={timeout_s}")
        try:
            found = self.state.peek(query.token_ids, query.model_id, query.cache_salt, query.geometry)
        finally:
            self.state_lock.release()
        if not found:
            raise LookupRefused(404, query.describe())
        answers = []
        for entry in found:
            hit_tokens = dict(entry.hit_tokens)
            if self.remote is not None:
                hit_tokens["remote"] = self._remote_hit_tokens(entry.remote_ask, hit_tokens["l2"])
            answers.append({"namespace_id": entry.namespace_id, "geometry": entry.geometry.to_wire(),
                            "hit_tokens": hit_tokens})
        hide_salts({"namespaces": answers})
        return {"num_tokens": len(query.token_ids), "namespaces": answers}

    def _remote_hit_tokens(self, ask: RemoteAsk | None, l2_tokens: int) -> int:
        """The prefix that L2 and the store hold together: L2's hit where the store is not asked
        (nothing after it, or L3 holds more) or cannot answer."""
        assert self.remote is not None and self._loop is not None
        if ask is None or not self.remote.available():
            return l2_tokens
        asking = self.remote.run("exist", self.remote.held_pages, ask.namespace_key, ask.token_ids, ask.page_size,
                                 ask.start_page, ask.end_page, timeout_s=self.config.remote_exist_timeout_s)
        try:
            held = asyncio.run_coroutine_threadsafe(asking, self._loop).result(
                self.config.remote_exist_timeout_s + HTTP_SNAPSHOT_TIMEOUT_S)
        except (RemoteUnavailable, concurrent.futures.TimeoutError):
            return l2_tokens
        return (ask.start_page + held) * ask.page_size


class StartupStopped(Exception):
    """SIGTERM or SIGINT came while the daemon was starting; what it had made is removed."""


class StartupSignals:
    """SIGTERM and SIGINT until the daemon serves (the event loop's handlers take over then).

    The loop cannot see a signal while start-up runs on its thread, and Python runs a handler only
    between two bytecodes of the main thread: so the handler only notes the signal, and ``check``
    raises StartupStopped at each step of start-up and after each populated slice of the pool
    (``POPULATE_SLICE_BYTES``), which bounds how long a stop waits. The ExitStack that owns what
    was made then closes it, in reverse order, as for any failed start."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self, resources: contextlib.ExitStack) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.signal(signum, self._note)
            if previous is not None:           # None: set outside Python, it cannot be put back
                resources.callback(signal.signal, signum, previous)

    def _note(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise StartupStopped(signal.Signals(self.signum).name)


async def serve(config: DaemonConfig, on_ready: Callable[[Server], None] | None = None,
                install_signal_handlers: bool = True,
                progress: Callable[[int, int], None] | None = None) -> None:
    """Run the daemon until SIGTERM/SIGINT (or ``server.stop_event``); every resource is released
    on the way out. ``on_ready`` gets the running server once the socket is bound; ``progress``
    how far the L2 segment is populated (SharedSegment.create). A pool that does not fit raises
    PoolTooLarge before anything is made; SIGTERM or SIGINT before the daemon serves,
    StartupStopped once what was made is removed."""
    loop = asyncio.get_running_loop()
    check_pool_fits(config.shm_dir, config.l2_bytes, hints.file_bytes(config.max_namespaces),
                    stale_paths=tuple(os.path.join(config.shm_dir, name(config.socket_path))
                                      for name in (segment_name, hints_file_name)))
    signals = StartupSignals()
    with contextlib.ExitStack() as resources:
        if install_signal_handlers:
            signals.install(resources)
        logger.info("kvcached starting (pid %d): L2 %d bytes, socket ipc://%s", os.getpid(), config.l2_bytes,
                    config.socket_path)
        # Every path is checked (the socket's directory, the lock, the L3 file and its index)
        # before the L2 segment is populated, which takes seconds for a large pool.
        directory = SocketDirectory(config.socket_path)
        resources.callback(directory.close)
        lock = DaemonLock(directory)
        resources.callback(lock.close)
        directory.remove_stale_socket()        # stale: we hold the lock
        signals.check()
        storage = executor = index = None
        saved_l3: list = []
        if config.l3_bytes > 0:
            try:
                storage = StorageFile.open(config.l3_path, config.l3_bytes, o_direct=config.l3_o_direct,
                                           keep_content=not config.l3_fresh)
            except UnsafeFileError as exc:
                raise StartupError(str(exc)) from None
            except (OSError, ValueError) as exc:
                raise StartupError(f"cannot open the L3 file {config.l3_path or '(temporary)'}: {exc}") from None
            resources.callback(storage.close)
            if not storage.is_temporary:
                try:
                    index, saved_l3 = _open_index(config, storage)
                    resources.callback(index.close)    # after the I/O threads, before the file
                except IndexNotWritable as exc:
                    # Never delete what a momentarily full disk keeps from being written: this run
                    # has no L3 (its writes would fail too), the next start has the index back.
                    logger.warning("%s; this run has no L3 (the file and the index are kept for the next start)",
                                   exc)
                    storage.close()
                    storage = None
        # The HTTP address is bound before the pool is populated too (a taken one fails the start
        # at once); until the daemon serves, its requests get 503 (a readiness probe waits).
        serving: list[Server] = []
        listener = _start_http(config, serving)
        if listener is not None:
            resources.callback(listener.close)         # first: no snapshot is taken of a closing daemon
        context = zmq.Context()
        resources.callback(context.term)
        if config.socket_cpu is not None:
            # Set before the first socket starts the I/O thread; the socket thread joins it there.
            context.set(zmq.THREAD_AFFINITY_CPU_ADD, config.socket_cpu)
        # The KV events' endpoint too is bound before the pool is populated (one that cannot be
        # fails the start at once).
        kv_publisher = _start_kv_events(config, context, resources)
        signals.check()
        segment = SharedSegment.create(config.shm_dir, segment_name(config.socket_path), config.l2_bytes,
                                       progress=progress, check_stop=signals.check)
        resources.callback(segment.close)
        epoch_files = EpochFiles(config.shm_dir, epoch_file_prefix(config.socket_path))
        resources.callback(epoch_files.close_all)
        generation_files = GenerationFiles(config.shm_dir, generation_file_prefix(config.socket_path))
        resources.callback(generation_files.close_all)
        hints_file = SharedSegment.create(config.shm_dir, hints_file_name(config.socket_path),
                                          hints.file_bytes(config.max_namespaces), what="admission hints file")
        resources.callback(hints_file.close)
        if storage is not None:
            executor = IoExecutor(config.io_threads)
            resources.callback(executor.shutdown)      # closed before the index, the segment and the file
        remote = None
        serving_remote: list[Server] = []
        if config.remote:
            remote = RemoteStore(RemoteSettings(config.remote_master, config.remote_metadata_server,
                                                config.remote_local_host, config.remote_segment_bytes,
                                                config.remote_exist_timeout_s, config.remote_get_timeout_s,
                                                config.remote_get_min_gibps * 2**30), segment.mapping)
            resources.callback(remote.close)           # its gets land in the segment: closed before it
            remote.probe_if_due()                      # connects in the background
        # The KV events' buffer tells the server when an event lands in it empty (kv_events_recorded).
        serving_events: list[Server] = []
        kv_events = EventBuffer(KV_EVENTS_BUFFER_BYTES, notify=lambda: serving_events and (
            serving_events[0].kv_events_recorded())) if config.kv_events else None
        try:
            state = DaemonState(segment.size_bytes, max_namespaces=config.max_namespaces,
                                session_timeout_s=config.session_timeout_s,
                                session_grace_s=config.session_grace_s,
                                l3_bytes=storage.size_bytes if storage else 0,
                                l3_index_sink=index.submit if index else None,
                                peer_end_sink=lambda export: epoch_files.close(export.peer_id),
                                cost_model=CostModel(config.cost_priors, config.restore_policy),
                                session_share=config.session_share,
                                hints=AdmissionHints(config.max_namespaces, hints_file.mapping),
                                generation_files=generation_files,
                                remote_write_sink=(lambda write: serving_remote[0]._queue_remote_write(write))
                                if remote else None, kv_events=kv_events)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        resources.callback(state.hints.close)          # its views go before the file's mapping
        if index is not None:
            state.restore_l3(saved_l3, storage.kept_content_bytes)
            index.start()
        signals.check()

        socket = context.socket(zmq.ROUTER)
        resources.callback(socket.close, SHUTDOWN_LINGER_MS)     # bounded: context.term() waits for it
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)     # a reply that cannot be delivered raises, and is counted
        socket.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_FACTOR * config.max_frame_bytes)
        socket.setsockopt(zmq.SNDHWM, MAX_QUEUED_REPLIES_PER_PEER)
        socket.setsockopt(zmq.RCVHWM, 10_000)
        socket.bind(f"ipc://{config.socket_path}")
        resources.callback(directory.remove_socket)
        directory.socket_bound()

        server = Server(config, state, socket, segment, storage, executor, index, epoch_files, hints_file.path,
                        remote, kv_publisher)
        serving_remote.append(server)
        if kv_publisher is not None:
            serving_events.append(server)
        resources.callback(server.close_wake_sockets)
        if listener is not None:
            server.http_address = listener.address
            serving.append(server)                     # /status and /metrics answer from now on
        if install_signal_handlers:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, server.stop_event.set)
                resources.callback(loop.remove_signal_handler, signum)
        if signals.signum is not None:     # came after the last check, before the loop's handlers
            server.stop_event.set()
        logger.info("kvcached serving on ipc://%s (pid %d, L2 %d bytes, %d namespaces)",
                    config.socket_path, os.getpid(), config.l2_bytes, config.max_namespaces)
        if on_ready is not None:
            on_ready(server)
        await server.run()
        logger.info("kvcached shutting down")


def _start_kv_events(config: DaemonConfig, context: zmq.Context,
                     resources: contextlib.ExitStack) -> KVEventPublisher | None:
    """The KV events' sockets (--kv-events), closed before the context; an endpoint that cannot be
    bound or connected to stops the start."""
    if not config.kv_events:
        return None
    node = config.kv_events_node or socket_module.gethostname()
    try:
        publisher = KVEventPublisher(context, config.kv_events, node, config.kv_events_replay or None)
    except zmq.ZMQError as exc:
        raise StartupError(f"cannot publish KV events on {config.kv_events}"
                           f"{' (replay ' + config.kv_events_replay + ')' if config.kv_events_replay else ''}: "
                           f"{exc} (--kv-events)") from None
    resources.callback(publisher.close)
    logger.info("KV events on %s (topics kv@%s@MODEL%s)", config.kv_events, node,
                f", replay on {config.kv_events_replay}" if config.kv_events_replay else "")
    return publisher


def _start_http(config: DaemonConfig, serving: list[Server]) -> HttpListener | None:
    """The /metrics, /status, / and /lookup listener, answering 503 until ``serving`` holds the server. An
    address that was asked for and cannot be bound stops the start; the default one, taken
    (another daemon on the host), is skipped with a warning."""
    endpoint = config.http_endpoint
    if endpoint is None:
        return None

    def snapshot() -> dict[str, Any]:
        if not serving:
            raise TimeoutError("the daemon is starting (populating its L2 pool)")
        return serving[0].locked_status_snapshot(HTTP_SNAPSHOT_TIMEOUT_S)

    def lookup(query: LookupQuery) -> dict[str, Any]:
        if not serving:
            raise TimeoutError("the daemon is starting (populating its L2 pool)")
        return serving[0].http_lookup(query, HTTP_SNAPSHOT_TIMEOUT_S)

    try:
        listener = HttpListener.start(endpoint, snapshot, allowed_hosts=config.http_allow_hosts, lookup=lookup)
    except OSError as exc:
        where = format_http_address(endpoint)
        if config.http_required:
            raise HttpAddressTaken(f"cannot serve HTTP on {where}: {exc.strerror or exc} "
                                   "(--http HOST:PORT, or --http off)") from None
        logger.warning("HTTP is off (no /metrics, /status): the default address %s is taken (%s), maybe by "
                       "another user's process; pass --http HOST:PORT, or --http off", where, exc.strerror or exc)
        return None
    logger.info("HTTP on http://%s/ (/metrics, /status)", listener.address)
    return listener


def _open_index(config: DaemonConfig, storage: StorageFile) -> tuple[L3IndexStore, list]:
    """The L3 file's index and what it holds; empty when the file kept nothing (new, or --l3-fresh)."""
    assert config.l3_path is not None
    path = index_path(config.l3_path)
    fresh = storage.kept_content_bytes == 0
    try:
        index, saved = L3IndexStore.open(path, fresh=fresh)
    except UnsafeFileError as exc:
        raise StartupError(str(exc)) from None
    except (OSError, sqlite3.Error) as exc:
        raise StartupError(f"cannot open the L3 index {path}: {exc}") from None
    logger.info("L3 index %s: %s", path, "starting empty" + (" (--l3-fresh)" if config.l3_fresh else "")
                if fresh else f"{sum(len(entry.rows) for entry in saved)} pages of {len(saved)} namespaces")
    return index, saved


def _write_indexed(index: L3IndexStore, storage: StorageFile, layout: SlotLayout, arena: memoryview,
                   page_size: int, move: TierMove) -> tuple[Any, list[bytes]]:
    """A write-through with a persistent index, in an I/O thread: the index forgets what the
    slots held before (so it never names them with another page's bytes), then the bytes go in
    with their checksums; returns them with the keys of the path's pages."""
    index.wait_for_deletes(INDEX_DELETE_TIMEOUT_S)
    result = write_pages(storage, layout, arena, layout.bytes_per_page, move.source_page_ids,
                         move.private_page_ids, checksum=True)
    return result, chain_page_keys(move.token_ids, page_size, move.start_page + len(move.source_page_ids))


def run(config: DaemonConfig, on_ready: Callable[[Server], None] | None = None,
        progress: Callable[[int, int], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT; one that comes while starting ends it too, nothing left behind."""
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # uvloop is a dependency; plain asyncio still works if it is missing
        runner = asyncio.run
    try:
        runner(serve(config, on_ready, progress=progress))
    except StartupStopped as exc:
        logger.info("kvcached stopped by %s while starting; what it had made is removed", exc)
