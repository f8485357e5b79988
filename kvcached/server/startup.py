"""Start-up and the one owner of the daemon's resources: ``serve`` makes them in order (paths
checked before the L2 pool is populated), hands them to a ``Server`` (``loop.py``) and closes them
once, in reverse order, also when start-up fails halfway or is stopped by a signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket as socket_module
import sqlite3
from typing import Any, Callable

import zmq

from kvcached.config import DaemonConfig
from kvcached.core.cost_model import CostModel
from kvcached.core.daemon import DaemonState
from kvcached.core.hints import AdmissionHints
from kvcached.core.kv_events import EventBuffer
from kvcached.server.handlers import HTTP_SNAPSHOT_TIMEOUT_S
from kvcached.server.http import HttpAddressTaken, HttpListener, format_http_address
from kvcached.server.io_workers import IoExecutor
from kvcached.server.kv_events import KVEventPublisher
from kvcached.server.l3_index_store import IndexNotWritable, L3IndexStore, index_path
from kvcached.server.lookup import LookupQuery
from kvcached.server.loop import Server
from kvcached.server.remote_store import RemoteSettings, RemoteStore
from kvcached.server.shm import (DaemonLock, EpochFiles, GenerationFiles, SharedSegment, SocketDirectory,
                                 StartupError, check_pool_fits, epoch_file_prefix, generation_file_prefix,
                                 hints_file_name, segment_name)
from kvcached.server.storage_file import StorageFile, UnsafeFileError
from proto import hints

logger = logging.getLogger(__name__)

# How long closing the socket may take to deliver what is queued: the SHUTDOWN frames.
SHUTDOWN_LINGER_MS = 200
# ZeroMQ drops a peer whose message exceeds this; below it, oversize frames get an error reply.
HARD_FRAME_FACTOR = 4
# KV events recorded and not yet taken by the loop, at most (their paths' token bytes); beyond it
# they are dropped and counted (a subscriber sees a gap in the sequence numbers).
KV_EVENTS_BUFFER_BYTES = 64 << 20
# Replies queued for one peer that does not read them; beyond it they are dropped and counted
# (replies_dropped). An engine's ZeroMQ thread reads its replies as they come, so its queue here
# stays short; this bounds the messages of one that stops reading.
MAX_QUEUED_REPLIES_PER_PEER = 1000


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
