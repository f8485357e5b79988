"""The daemon's I/O layer: an asyncio (uvloop) loop around one ZeroMQ ROUTER socket.

It decodes a frame, calls one ``DaemonState`` method, and replies to the sender only. Every
request gets a reply or an error reply; a bad frame never reaches the state and never stops
the loop. One ``contextlib.ExitStack`` owns every resource, so they close once, in reverse
order of creation, also when start-up fails halfway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import Any, Callable

import zmq

from kvcached.config import DaemonConfig
from kvcached.core.daemon import ArenaPlan, DaemonState
from kvcached.server.shm import DaemonLock, SharedSegment, ensure_private_dir, segment_name
from proto import codec
from proto.errors import ErrorCode, ProtocolError
from proto.messages import PROTOCOL_VERSION, MsgKind
from proto.schema import Attach, BackupCommit, EngineReport, Match, Release, SessionRequest

logger = logging.getLogger(__name__)

REAPER_INTERVAL_S = 0.1
# ZeroMQ drops a peer whose message exceeds this; below it, oversize frames get an error reply.
HARD_FRAME_FACTOR = 4


class Server:
    def __init__(self, config: DaemonConfig, state: DaemonState, socket: zmq.Socket,
                 segment: SharedSegment):
        self.config = config
        self.state = state
        self.socket = socket
        self.segment = segment
        self.started_at = time.time()
        self.stop_event = asyncio.Event()
        self._handlers: dict[MsgKind, Callable[[dict], dict[str, Any] | None]] = {
            MsgKind.ATTACH: self._attach,
            MsgKind.DETACH: self._detach,
            MsgKind.HEARTBEAT: self._heartbeat,
            MsgKind.MATCH: self._match,
            MsgKind.BACKUP_RESERVE: self._backup_reserve,
            MsgKind.RELEASE: self._release,
            MsgKind.BACKUP_COMMIT: self._commit,
            MsgKind.STATUS: self._status,
            MsgKind.ENGINE_REPORT: self._engine_report,
        }

    async def run(self) -> None:
        # The socket is read from a reader callback, not through zmq.asyncio: a future per
        # message costs more than the request itself. ZeroMQ's FD is edge-triggered, so each
        # wake-up drains every queued message until EAGAIN.
        loop = asyncio.get_running_loop()
        loop.add_reader(self.socket.getsockopt(zmq.FD), self._on_readable)
        loop.call_soon(self._on_readable)     # messages queued before the reader was added
        reaper = asyncio.create_task(self._reap_loop(), name="reap")
        try:
            await self.stop_event.wait()
        finally:
            loop.remove_reader(self.socket.getsockopt(zmq.FD))
            reaper.cancel()
            await asyncio.gather(reaper, return_exceptions=True)

    def _on_readable(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                # A DEALER sends [identity, payload]; anything else has no single payload to answer.
                if frames:
                    self._send(frames[0], MsgKind.ERROR, 0,
                               codec.error_body(ErrorCode.BAD_FRAME, f"expected one frame, got {len(frames) - 1}"))
                continue
            identity, payload = frames
            self._handle(identity, payload)

    def _handle(self, identity: bytes, payload: bytes) -> None:
        request_id = 0
        try:
            frame = codec.decode(payload, self.config.max_frame_bytes)
            request_id = frame.request_id
            handler = self._handlers.get(frame.kind)
            if handler is None:
                raise ProtocolError(ErrorCode.UNKNOWN_KIND, f"{frame.kind.name} is not a request")
            reply = handler(frame.body)
            if reply is not None:      # None: a request that asked for no success reply
                self._send(identity, MsgKind.REPLY, request_id, reply)
        except ProtocolError as exc:
            if request_id == 0:
                request_id = codec.peek_request_id(payload)
            self.state.metrics.add(f"errors_{exc.code.name.lower()}")
            logger.info("refused a request: %s", exc)
            self._send(identity, MsgKind.ERROR, request_id, codec.error_body(exc.code, exc.message))
        except Exception as exc:  # our bug: report it to the peer, keep serving the others
            logger.exception("internal error while handling a request")
            self.state.metrics.add("errors_internal")
            self._send(identity, MsgKind.ERROR, request_id,
                       codec.error_body(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))

    def _send(self, identity: bytes, kind: MsgKind, request_id: int, body: dict[str, Any]) -> None:
        try:
            self.socket.send_multipart([identity, codec.encode(kind, request_id, body)], flags=zmq.NOBLOCK)
        except zmq.Again:
            # The peer is not reading; we never block the loop on one engine.
            self.state.metrics.add("replies_dropped")
            logger.warning("dropped a reply to a peer that is not reading")
        except zmq.ZMQError as exc:
            self.state.metrics.add("replies_dropped")
            logger.warning("could not reply to a peer: %s", exc)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            self.state.expire_sessions()

    # ---- handlers: body in, reply body out ------------------------------------------------

    def _attach(self, body: dict) -> dict[str, Any]:
        version = body.get("protocol_version")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(ErrorCode.VERSION_MISMATCH,
                                f"daemon speaks protocol {PROTOCOL_VERSION}, engine sent {version!r}")
        request = Attach.parse(body)
        session, namespace = self.state.attach(request.geometry, request.pid, request.client_name)
        return {
            "session_id": session.session_id,
            "namespace_id": namespace.namespace_id,
            "shm_path": self.segment.path,
            "arena_offset_bytes": namespace.arena_offset_bytes,
            "num_pages": namespace.num_pages,
            "bytes_per_page": namespace.geometry.bytes_per_page,
            "heartbeat_interval_s": self.config.heartbeat_interval_s,
            "session_timeout_s": self.config.session_timeout_s,
            "max_frame_bytes": self.config.max_frame_bytes,
            "daemon_pid": os.getpid(),
            "protocol_version": PROTOCOL_VERSION,
        }

    def _detach(self, body: dict) -> dict[str, Any]:
        request = SessionRequest.parse(body)
        return {"leases_reclaimed": self.state.detach(request.session_id)}

    def _heartbeat(self, body: dict) -> dict[str, Any]:
        self.state.heartbeat(SessionRequest.parse(body).session_id)
        return {}

    def _match(self, body: dict) -> dict[str, Any]:
        request = Match.parse(body)
        return self.state.match(request.session_id, request.token_ids, request.reserve_backup).to_wire()

    def _backup_reserve(self, body: dict) -> dict[str, Any]:
        request = Match.parse(body)
        return self.state.match(request.session_id, request.token_ids, reserve_backup=True).to_wire()

    def _release(self, body: dict) -> dict[str, Any] | None:
        request = Release.parse(body)
        self.state.release(request.session_id, request.lease_id)
        return {} if request.ack else None

    def _commit(self, body: dict) -> dict[str, Any] | None:
        request = BackupCommit.parse(body)
        reply = self.state.commit_backup(request.session_id, request.lease_id, request.host_page_ids)
        return reply.to_wire() if request.ack else None

    def _engine_report(self, body: dict) -> dict[str, Any] | None:
        request = EngineReport.parse(body)
        self.state.engine_report(request.session_id, request.report)
        return {} if request.ack else None

    def _status(self, body: dict) -> dict[str, Any]:
        snapshot = self.state.status()
        if body.get("check_integrity", False) is True:
            try:
                self.state.check_integrity()
                snapshot["integrity"] = "ok"
            except Exception as exc:
                logger.error("integrity check failed: %s", exc)
                snapshot["integrity"] = f"FAILED: {exc}"
        snapshot["daemon"] = {
            "pid": os.getpid(),
            "socket": self.config.socket_path,
            "uptime_s": round(time.time() - self.started_at, 3),
            "l2_segment": self.segment.path,
            "l2_bytes": self.segment.size_bytes,
            "max_namespaces": self.config.max_namespaces,
            "protocol_version": PROTOCOL_VERSION,
        }
        snapshot["time"] = time.time()
        return snapshot


async def serve(config: DaemonConfig, on_ready: Callable[[], None] | None = None) -> None:
    """Run the daemon until SIGTERM/SIGINT; every resource is released on the way out."""
    loop = asyncio.get_running_loop()
    with contextlib.ExitStack() as resources:
        socket_dir = os.path.dirname(os.path.abspath(config.socket_path))
        ensure_private_dir(socket_dir)
        lock = DaemonLock(config.socket_path)
        resources.callback(lock.close)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.socket_path)      # stale: we hold the lock
        segment = SharedSegment.create(config.shm_dir, segment_name(config.socket_path), config.l2_bytes)
        resources.callback(segment.close)
        state = DaemonState(ArenaPlan(segment.size_bytes, config.max_namespaces),
                            session_timeout_s=config.session_timeout_s)

        context = zmq.Context()
        resources.callback(context.term)
        socket = context.socket(zmq.ROUTER)
        resources.callback(socket.close, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_FACTOR * config.max_frame_bytes)
        socket.setsockopt(zmq.SNDHWM, 10_000)
        socket.setsockopt(zmq.RCVHWM, 10_000)
        socket.bind(f"ipc://{config.socket_path}")
        resources.callback(_unlink_quietly, config.socket_path)
        os.chmod(config.socket_path, 0o600)

        server = Server(config, state, socket, segment)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, server.stop_event.set)
            resources.callback(loop.remove_signal_handler, signum)
        logger.info("kvcached serving on ipc://%s (pid %d, L2 %d bytes, %d namespaces)",
                    config.socket_path, os.getpid(), config.l2_bytes, config.max_namespaces)
        if on_ready is not None:
            on_ready()
        await server.run()
        logger.info("kvcached shutting down")


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def run(config: DaemonConfig, on_ready: Callable[[], None] | None = None) -> None:
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; plain asyncio still works if it is missing
        asyncio.run(serve(config, on_ready))
        return
    uvloop.run(serve(config, on_ready))
