"""The daemon's HTTP listener: GET /metrics, GET /status, GET / (the live status page).

A standard-library ``ThreadingHTTPServer`` on a thread of its own, never the event loop's or the
socket thread's: a request takes one status snapshot through ``snapshot()`` (the server holds the
state lock for that copy only, with a bounded wait), then encodes it with no lock held. So a slow
or stuck HTTP client costs the daemon nothing but a thread, and at most MAX_CONNECTIONS of them.

- ``/metrics``: the Prometheus text format (OpenMetrics when the scraper asks for it), made by
  prometheus_client from the snapshot (kvcached/server/metrics.py).
- ``/status``: the snapshot as JSON, byte for byte what ``kvcached status --json`` prints.
- ``/``: one self-contained HTML file (kvcached/server/status_page.html) that polls /status.

Anything else is 404; a method other than GET or HEAD is 405. Bind it to loopback unless the
network it is on may read the status (k8s probes and scrapes reach the pod's IP: see deploy/).
"""

from __future__ import annotations

import http.server
import importlib.resources
import logging
import socket
import threading
import urllib.parse
from typing import Any, Callable

from prometheus_client.exposition import choose_encoder

from kvcached.server.metrics import make_registry
from kvcached.server.status import status_json

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 16                 # handled at once; more are closed unanswered
REQUEST_TIMEOUT_S = 10.0             # a client that sends or reads nothing for this long is dropped
SHUTDOWN_TIMEOUT_S = 5.0


def format_http_address(endpoint: tuple[str, int]) -> str:
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _page() -> bytes:
    return importlib.resources.files("kvcached.server").joinpath("status_page.html").read_bytes()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True            # a stuck client never holds up the daemon's exit

    def __init__(self, endpoint: tuple[str, int], handler: type, max_connections: int):
        host, port = endpoint
        self.address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__((host, port), handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)       # at the bound: refused, not queued
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _handler(snapshot: Callable[[], dict[str, Any]], page: bytes) -> type:
    registry = make_registry(snapshot)

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S
        server_version = "kvcached"

        def do_GET(self) -> None:
            self._respond(send_body=True)

        def do_HEAD(self) -> None:
            self._respond(send_body=False)

        def _respond(self, send_body: bool) -> None:
            path = urllib.parse.urlsplit(self.path).path
            try:
                if path == "/metrics":
                    encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                    status, body = 200, encoder(registry)
                elif path == "/status":
                    status, body, content_type = 200, status_json(snapshot()).encode(), "application/json"
                elif path in ("/", "/index.html"):
                    status, body, content_type = 200, page, "text/html; charset=utf-8"
                else:
                    status, body, content_type = 404, b"not found: try /, /status or /metrics\n", "text/plain"
            except TimeoutError as exc:
                status, body, content_type = 503, f"{exc}\n".encode(), "text/plain"
            except Exception:
                logger.exception("HTTP %s failed", path)
                status, body, content_type = 500, b"internal error (see the daemon's log)\n", "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            # The page loads nothing from anywhere but this listener, and only /status.
            self.send_header("Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; "
                             "style-src 'unsafe-inline'; connect-src 'self'; img-src data:")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def _not_allowed(self) -> None:
            body = b"only GET and HEAD\n"
            self.send_response(405)
            self.send_header("Allow", "GET, HEAD")
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("%s %s", self.address_string(), format % args)

    return Handler


class HttpListener:
    def __init__(self, server: _Server):
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="kvcached-http", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, endpoint: tuple[str, int], snapshot: Callable[[], dict[str, Any]],
              max_connections: int = MAX_CONNECTIONS) -> "HttpListener":
        """Bind (OSError if the address is taken or not ours) and serve on a thread of its own."""
        return cls(_Server(endpoint, _handler(snapshot, _page()), max_connections))

    @property
    def address(self) -> str:
        """HOST:PORT it serves on (the port the kernel chose, for port 0)."""
        host, port = self._server.server_address[:2]
        return format_http_address((host, port))

    def close(self) -> None:
        """Stop serving; requests still running finish on their own (daemon threads)."""
        self._server.shutdown()
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        self._server.server_close()
