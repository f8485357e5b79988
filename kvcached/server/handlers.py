"""The request handlers: a request's body in, its reply's body out (or an awaitable for a reply
that waits for a tier move, ``moves.py``); and the status and lookup answers of the HTTP listener.

Mixed into ``Server`` (``loop.py``): the socket thread calls each handler under ``state_lock``,
through ``Server._handlers``; a handler raises ``ProtocolError`` for a bad request, which becomes an
error reply to that peer only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import time
from typing import Any, Awaitable

from kvcached.core import counters
from kvcached.core.daemon import RemoteAsk
from kvcached.core.tier_ops import TierMove
from kvcached.server.liveness import open_pidfd
from kvcached.server.lookup import LookupQuery, LookupRefused
from kvcached.server.remote_store import RemoteUnavailable
from kvcached.server.status import hide_salts
from proto.errors import ErrorCode, ProtocolError
from proto.messages import PROTOCOL_VERSION
from proto.replies import AttachInfo, DetachReply, PeerListReply, PeerRegisterReply, to_wire
from proto.schema import (Acquire, Attach, Commit, EngineReport, Lookup, PeerPublish, PeerRegister, Release, SessionRequest,
                          check_protocol_version)

logger = logging.getLogger(__name__)

# An HTTP request waits this long, at most, for the state lock (then 503).
HTTP_SNAPSHOT_TIMEOUT_S = 2.0
# Status snapshots are large: a peer gets at most this many that it has not shown it read
# (kvcached/server/status_credits.py); peers remembered for that, least recent forgotten first;
# a reply unread this long is forgotten.
MAX_UNREAD_STATUS_REPLIES = 2
MAX_STATUS_PEERS = 4096
UNREAD_STATUS_FORGET_S = 60.0


class RequestHandlers:
    """The request handlers of a ``Server``."""

    def _attach(self, body: dict) -> dict[str, Any]:
        check_protocol_version(body)
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

    def _lookup(self, body: dict) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        request = Lookup.parse(body)
        prefetch = request.prefetch and not request.tp_group
        ask = self._remote_ask(request.session_id, request.token_ids) if prefetch else None
        if ask is not None:
            return self._lookup_remote(request, ask)
        reply = self.state.lookup(request)
        if prefetch:
            self._after_reply.append(functools.partial(self._promote_in_background, request.session_id,
                                                       request.token_ids, reply))
        return to_wire(reply)

    def _acquire(self, body: dict) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        request = Acquire.parse(body)
        ask = self._remote_ask(request.session_id, request.token_ids) if request.promote == "wait" else None
        if ask is not None:
            return self._acquire_remote(request, ask)
        outcome = self.state.acquire(request)
        if isinstance(outcome, TierMove):
            return self._acquire_after(request, outcome)
        if request.promote != "none":     # it stands for the request's lookup: a declined L3 hit alike
            self._after_reply.append(functools.partial(self._promote_in_background, request.session_id,
                                                       request.token_ids, outcome))
        return to_wire(outcome)

    def _release(self, body: dict) -> dict[str, Any] | None:
        request = Release.parse(body)
        self.state.release(request)
        return {} if request.ack else None

    def _commit(self, body: dict) -> dict[str, Any] | None:
        request = Commit.parse(body)
        reply, write_through = self.state.commit(request)
        self._write_through(write_through)
        return to_wire(reply) if request.ack else None

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

    def _status(self, body: dict) -> dict[str, Any]:
        read_token = self.status_credits.grant(self._requester, body.get("read_token"))
        if read_token is None:
            raise ProtocolError(ErrorCode.OUT_OF_SPACE, f"{MAX_UNREAD_STATUS_REPLIES} status replies to this "
                                "socket are unread: read them (and give back the last one's read_token)")
        snapshot = self.status_snapshot(check_integrity=body.get("check_integrity", False) is True)
        snapshot["read_token"] = read_token
        return snapshot

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
