"""The HTTP listener in-process: a snapshot that cannot be taken in time answers 503 and the
listener goes on; connections beyond its bound are refused, not queued; addresses are checked."""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from kvcached.config import DaemonConfig, parse_http_address
from kvcached.server.http import HttpListener


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture
def busy_state():
    """A snapshot function over a lock the test may hold, with a bounded wait (as the server's)."""
    lock = threading.Lock()
    calls = []

    def snapshot() -> dict:
        if not lock.acquire(timeout=0.2):
            raise TimeoutError("the daemon's state was busy for timeout_s=0.2")
        try:
            calls.append(time.monotonic())
            return {"time": time.time(), "metrics": {"matches": len(calls)}, "daemon": {}}
        finally:
            lock.release()

    return lock, snapshot


def test_a_snapshot_not_taken_in_time_answers_503(busy_state):
    """While the state stays locked, /status and /metrics answer 503 (after the bounded wait);
    once it is free, both answer 200 with the snapshot's numbers."""
    lock, snapshot = busy_state
    listener = HttpListener.start(("127.0.0.1", 0), snapshot)
    url = f"http://{listener.address}"
    try:
        with lock:
            assert get(f"{url}/status")[0] == 503
            assert get(f"{url}/metrics")[0] == 503
        status, body = get(f"{url}/status")
        assert status == 200 and b'"matches": 1' in body
        status, body = get(f"{url}/metrics")
        assert status == 200 and b'kvcached_matches_total{model=""} 2.0' in body, body
    finally:
        listener.close()


def test_connections_beyond_the_bound_are_refused(busy_state):
    """With max_connections idle clients connected (sending nothing), one more is closed at
    once, unanswered; once the idle ones leave, requests are answered again."""
    _, snapshot = busy_state
    listener = HttpListener.start(("127.0.0.1", 0), snapshot, max_connections=2)
    host, port = listener.address.rsplit(":", 1)
    idle = []
    try:
        for _ in range(2):
            idle.append(socket.create_connection((host, int(port)), timeout=10))
        deadline = time.monotonic() + 10
        while True:        # the server takes the idle ones in turn: wait until a third is refused
            extra = socket.create_connection((host, int(port)), timeout=10)
            try:
                extra.sendall(b"GET /status HTTP/1.0\r\n\r\n")
                reply = extra.recv(64)
            except ConnectionResetError:       # closed with our request unread: refused too
                reply = b""
            extra.close()
            if reply == b"":
                break
            assert time.monotonic() < deadline, f"a third connection was answered: {reply!r}"
        for connection in idle:
            connection.close()
        deadline = time.monotonic() + 10
        while True:            # the closed ones free their seats when the server sees them closed
            try:
                if get(f"http://{listener.address}/status")[0] == 200:
                    break
            except (ConnectionError, http.client.HTTPException):      # still refused
                pass
            assert time.monotonic() < deadline, "not answered 10 s after the idle connections closed"
            time.sleep(0.02)
    finally:
        for connection in idle:
            connection.close()
        listener.close()


def test_http_addresses_are_checked():
    """HOST:PORT (IPv4, a name, [IPv6]) and off are accepted; anything else is refused, by the
    config too, which takes the default (loopback, best effort) when none is given."""
    assert parse_http_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_http_address("[::1]:0") == ("::1", 0)
    assert parse_http_address("localhost:8080") == ("localhost", 8080)
    assert parse_http_address("off") is None
    for bad in ("9464", ":9464", "host:65536", "a b:1", "http://x:1", ""):
        with pytest.raises(ValueError, match="HTTP listen address"):
            parse_http_address(bad)
    config = DaemonConfig.from_env({}, socket_path="/tmp/kvt-x/s.sock", l2_bytes=64 << 20)
    assert config.http_endpoint == ("127.0.0.1", 9464) and not config.http_required
    config = DaemonConfig.from_env({"KVCACHED_HTTP": "0.0.0.0:9000"}, socket_path="/tmp/kvt-x/s.sock", l2_bytes=64 << 20)
    assert config.http_endpoint == ("0.0.0.0", 9000) and config.http_required
    assert DaemonConfig.from_env({}, socket_path="/tmp/kvt-x/s.sock", l2_bytes=64 << 20, http_address="off").http_endpoint is None
    with pytest.raises(ValueError, match="HTTP listen address"):
        DaemonConfig.from_env({"KVCACHED_HTTP": "nowhere"}, socket_path="/tmp/kvt-x/s.sock", l2_bytes=64 << 20)
