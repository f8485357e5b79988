"""The daemon's HTTP listener: GET /metrics, GET /status, GET / (the live status page), and
POST /lookup for routers.

aiohttp's HTTP server on an asyncio loop of its own, in a thread of its own: never the daemon's
event loop or its socket thread. A request takes one status snapshot through ``snapshot()`` in a
small thread pool (the daemon holds its state lock for that copy only, with a bounded wait), then
encodes it with no lock held. So a slow or stuck HTTP client costs the daemon one idle connection
on this loop, and the listener holds at most MAX_CONNECTIONS of them:

- a connection that completes no request for IDLE_TIMEOUT_S (headers included: a client that
  sends a request slowly, or never) is closed by aiohttp's keep-alive timer;
- at the bound, a new connection closes the one that has waited longest without a request in
  progress, so idle connections can never lock scrapes out; only when every connection is
  being answered is the new one refused.

- ``/metrics``: the Prometheus text format (OpenMetrics when the scraper asks for it), made by
  prometheus_client from the snapshot (kvcached/server/metrics.py).
- ``/status``: the snapshot as JSON, byte for byte what ``kvcached status --json`` prints.
- ``/``: one self-contained HTML file (kvcached/server/status_page.html) that polls /status.
- ``POST /lookup``: which prefix of a prompt each tier holds, changing nothing (the request, its
  answer and its bounds: kvcached/server/lookup.py). Its body is read within
  LOOKUP_BODY_TIMEOUT_S (else 408), so a slow sender cannot hold a connection busy for long.

Anything else is 404; a method other than GET or HEAD (POST for /lookup) is 405. A request whose Host header names
neither a loopback name, the bound address, an IP address (when bound to all addresses) nor a
name of ``allowed_hosts`` is 421: a web page whose name was rebound to this address (DNS
rebinding) cannot read the status. Bind it to loopback unless the network it is on may read the
status (k8s probes and scrapes reach the pod's IP: see deploy/).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.resources
import ipaddress
import json
import logging
import socket
import sys
import threading
import urllib.parse
from typing import Any, Callable, Iterable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client.exposition import choose_encoder

from kvcached.server.lookup import (LOOKUP_BODY_TIMEOUT_S, MAX_LOOKUP_BODY_BYTES, LookupQuery, LookupRefused,
                                   error_body)
from kvcached.server.metrics import make_registry
from kvcached.server.shm import StartupError
from kvcached.server.status import status_json

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 64                 # open at once; beyond it the longest idle one is closed
IDLE_TIMEOUT_S = 10.0                # a connection that completes no request for this long is closed
SNAPSHOT_THREADS = 2                 # snapshots and encodings run at once (each waits for the state lock)
MAX_HEADER_BYTES = 8190              # one request line or header field
MAX_HEADERS = 64
SHUTDOWN_TIMEOUT_S = 5.0
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
HEADERS = {
    "Cache-Control": "no-store",
    # The page loads nothing from anywhere but this listener, and only /status.
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:",
    "X-Content-Type-Options": "nosniff",
}


class HttpAddressTaken(StartupError):
    """The HTTP address asked for cannot be bound: a usage error (exit status 2), not a fault."""
    exit_status = 2


def format_http_address(endpoint: tuple[str, int]) -> str:
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _page() -> bytes:
    return importlib.resources.files("kvcached.server").joinpath("status_page.html").read_bytes()


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


class HostCheck:
    """Which Host headers a request may carry: loopback names and addresses, the bound host, any
    IP address when bound to all of them (an address cannot be rebound: a page that reaches us by
    one has that address as its origin), and the names given. A request without Host (HTTP/1.0,
    never a browser's) passes."""

    def __init__(self, bound_host: str, allowed_hosts: Iterable[str] = ()):
        bound = _ip(bound_host)
        self.any_address = bound is not None and bound.is_unspecified
        self.names = {name.lower().rstrip(".") for name in (*LOOPBACK_NAMES, bound_host, *allowed_hosts)}

    def allows(self, host_header: str | None) -> bool:
        if host_header is None:
            return True
        host = urllib.parse.urlsplit(f"//{host_header}").hostname     # the port and [] stripped
        if host is None:
            return False
        host = host.lower().rstrip(".")
        address = _ip(host)
        if address is not None:
            return self.any_address or address.is_loopback or host in self.names
        return host in self.names


class _ClientFaultsQuiet(logging.LoggerAdapter):
    """What aiohttp logs for a connection: a client's malformed request or a connection it cut is
    ordinary (answered 400, or closed), logged at DEBUG in one line; anything else as it comes."""

    def log(self, level: int, msg: object, *args: Any, exc_info: Any = None, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1] if exc_info else None
        if isinstance(exc, (HttpProcessingError, ConnectionError, TimeoutError)):
            level, msg, args, exc_info = logging.DEBUG, "%s: %s", (msg % args if args else msg, exc), None
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)


class _BoundedServer(web.Server):
    """aiohttp's low-level server, holding at most ``max_connections``: a new connection at the
    bound closes the one idle longest (no request in progress), or itself if none is idle."""

    def __init__(self, handler: Callable, max_connections: int, **kwargs: Any):
        super().__init__(handler, **kwargs)
        self.max_connections = max_connections
        self.idle_since: dict[Any, float] = {}        # connection (its RequestHandler) -> loop time
        self.busy: set[Any] = set()                   # connections with a request in progress

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if len(self.idle_since) >= self.max_connections:
            idle = [h for h in self.idle_since if h not in self.busy]
            victim = min(idle, key=self.idle_since.__getitem__) if idle else handler
            victim.force_close()
            if victim is handler:
                return
            self._forget(victim)
        self.idle_since[handler] = self._loop.time()

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self._forget(handler)

    def _forget(self, handler: Any) -> None:
        self.idle_since.pop(handler, None)
        self.busy.discard(handler)

    def request_started(self, handler: Any) -> None:
        if handler in self.idle_since:
            self.busy.add(handler)

    def request_finished(self, handler: Any) -> None:
        if handler in self.idle_since:
            self.busy.discard(handler)
            self.idle_since[handler] = self._loop.time()


class HttpListener:
    def __init__(self, sock: socket.socket, snapshot: Callable[[], dict[str, Any]], max_connections: int,
                 host_check: HostCheck, lookup: Callable[[LookupQuery], dict[str, Any]] | None = None):
        self._socket = sock
        self._snapshot = snapshot
        self._lookup = lookup
        self._registry = make_registry(snapshot)
        self._page = _page()
        self._host_check = host_check
        self._max_connections = max_connections
        self._pool = concurrent.futures.ThreadPoolExecutor(SNAPSHOT_THREADS, thread_name_prefix="kvcached-http-snap")
        self._loop = asyncio.new_event_loop()
        self._server: _BoundedServer | None = None
        self._stopped = asyncio.Event()
        started = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(started,), name="kvcached-http", daemon=True)
        self._thread.start()
        started.result()                # the server accepts from now on (or its error is raised here)

    @classmethod
    def start(cls, endpoint: tuple[str, int], snapshot: Callable[[], dict[str, Any]],
              max_connections: int = MAX_CONNECTIONS, allowed_hosts: Iterable[str] = (),
              lookup: Callable[[LookupQuery], dict[str, Any]] | None = None) -> "HttpListener":
        """Bind (OSError if the address is taken or not ours) and serve on a thread of its own;
        ``lookup`` answers POST /lookup (None: 404)."""
        host, port = endpoint
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # SO_REUSEADDR (not SO_REUSEPORT): a restart may bind while old connections linger,
            # but no other process can bind the port while we listen.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            sock.setblocking(False)
            return cls(sock, snapshot, max_connections, HostCheck(host, allowed_hosts), lookup)
        except BaseException:
            sock.close()
            raise

    @property
    def address(self) -> str:
        """HOST:PORT it serves on (the port the kernel chose, for port 0)."""
        host, port = self._socket.getsockname()[:2]
        return format_http_address((host, port))

    def close(self) -> None:
        """Stop serving: the listening socket and every connection close; requests in progress end."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(SHUTDOWN_TIMEOUT_S)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, started: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve(started))
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            else:
                logger.exception("the HTTP listener failed; /metrics and /status are off")
        finally:
            self._loop.close()

    async def _serve(self, started: concurrent.futures.Future) -> None:
        self._server = _BoundedServer(self._handle, self._max_connections, keepalive_timeout=IDLE_TIMEOUT_S,
                                      access_log=None, max_line_size=MAX_HEADER_BYTES,
                                      max_field_size=MAX_HEADER_BYTES, max_headers=MAX_HEADERS,
                                      lingering_time=1.0, logger=_ClientFaultsQuiet(logger, {}))
        listening = await self._loop.create_server(self._server, sock=self._socket)
        started.set_result(None)
        try:
            await self._stopped.wait()
        finally:
            listening.close()
            self._server.pre_shutdown()
            await asyncio.wait_for(self._server.shutdown(1.0), SHUTDOWN_TIMEOUT_S)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        assert self._server is not None
        self._server.request_started(request.protocol)
        try:
            return await self._respond(request)
        finally:
            self._server.request_finished(request.protocol)

    async def _respond(self, request: web.BaseRequest) -> web.StreamResponse:
        if not self._host_check.allows(request.headers.get("Host")):
            return _text(421, "misdirected request: this listener does not serve that host name "
                              "(kvcached serve --http-allow-host NAME)\n")
        if request.path == "/lookup" and self._lookup is not None:
            if request.method != "POST":
                response = _text(405, "only POST, with a JSON body\n")
                response.headers["Allow"] = "POST"
                return response
            return await self._answer_lookup(request)
        if request.method not in ("GET", "HEAD"):
            response = _text(405, "only GET and HEAD\n")
            response.headers["Allow"] = "GET, HEAD"
            return response
        path = request.path
        try:
            if path == "/metrics":
                encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
                status, body = 200, await self._off_loop(encoder, self._registry)
            elif path == "/status":
                status, body = 200, await self._off_loop(lambda: status_json(self._snapshot()).encode())
                content_type = "application/json"
            elif path in ("/", "/index.html"):
                status, body, content_type = 200, self._page, "text/html; charset=utf-8"
            else:
                return _text(404, "not found: try /, /status or /metrics\n")
        except TimeoutError as exc:
            return _text(503, f"{exc}\n")
        except Exception:
            logger.exception("HTTP %s failed", path)
            return _text(500, "internal error (see the daemon's log)\n")
        return _response(status, body, content_type)

    async def _answer_lookup(self, request: web.BaseRequest) -> web.Response:
        assert self._lookup is not None
        lookup = self._lookup

        def answer(body: bytes) -> bytes:
            return json.dumps(lookup(LookupQuery.parse(body))).encode()

        try:
            if request.content_type != "application/json":
                raise LookupRefused(415, "send the body as Content-Type: application/json")
            try:
                body = await asyncio.wait_for(_read_body(request), LOOKUP_BODY_TIMEOUT_S)
            except TimeoutError:
                raise LookupRefused(408, f"the body did not arrive within {LOOKUP_BODY_TIMEOUT_S} s") from None
            status, content = 200, await self._off_loop(answer, body)
        except LookupRefused as exc:
            status, content = exc.status, error_body(str(exc))
        except TimeoutError as exc:
            status, content = 503, error_body(str(exc))
        except Exception:
            logger.exception("HTTP /lookup failed")
            status, content = 500, error_body("internal error (see the daemon's log)")
        return _response(status, content, "application/json")

    async def _off_loop(self, work: Callable, *args: Any) -> Any:
        return await self._loop.run_in_executor(self._pool, work, *args)


async def _read_body(request: web.BaseRequest) -> bytes:
    """The request's body, refused (413) once it passes MAX_LOOKUP_BODY_BYTES."""
    too_large = LookupRefused(413, f"the body is over max_lookup_body_bytes={MAX_LOOKUP_BODY_BYTES}")
    if request.content_length is not None and request.content_length > MAX_LOOKUP_BODY_BYTES:
        raise too_large
    body = bytearray()
    while chunk := await request.content.readany():
        body += chunk
        if len(body) > MAX_LOOKUP_BODY_BYTES:
            raise too_large
    return bytes(body)


def _response(status: int, body: bytes, content_type: str) -> web.Response:
    response = web.Response(status=status, body=body, headers=HEADERS)
    response.headers["Content-Type"] = content_type       # as given: with its charset, if any
    return response


def _text(status: int, text: str) -> web.Response:
    return _response(status, text.encode(), "text/plain")
