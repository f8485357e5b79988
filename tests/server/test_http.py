"""The HTTP listener in-process: a snapshot that cannot be taken in time answers 503 and the
listener goes on; idle connections beyond its bound make room rather than lock requests out, and
idle or slow ones are closed after the idle timeout; the Host header and addresses are checked."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from kvcached.config import DaemonConfig, parse_http_address
from kvcached.server import http as http_module
from kvcached.server.http import HostCheck, HttpListener


def get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
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


def wait_closed(connection: socket.socket, timeout_s: float) -> bool:
    """Whether the server closed this connection (end of stream or reset) within timeout_s."""
    connection.settimeout(timeout_s)
    try:
        return connection.recv(64) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_beyond_the_bound_make_room(busy_state):
    """With twice max_connections idle clients connected (sending nothing), a request is still
    answered at once: each connection beyond the bound closed the one idle longest, so the first
    ones are closed and the last ones stay open."""
    _, snapshot = busy_state
    listener = HttpListener.start(("127.0.0.1", 0), snapshot, max_connections=4)
    host, port = listener.address.rsplit(":", 1)
    idle = []
    try:
        for _ in range(8):
            idle.append(socket.create_connection((host, int(port)), timeout=10))
            time.sleep(0.05)       # accepted in this order
        started = time.monotonic()
        assert get(f"http://{listener.address}/status")[0] == 200
        assert time.monotonic() - started < 5.0
        closed = [wait_closed(connection, 2.0) for connection in idle[:5]]
        assert closed == [True] * 5, closed
        assert not any(wait_closed(connection, 0.2) for connection in idle[5:])
    finally:
        for connection in idle:
            connection.close()
        listener.close()


def test_idle_and_slow_connections_are_closed_after_the_idle_timeout(busy_state, monkeypatch):
    """A connection that sends nothing, one that sends half a request line and stops, and one
    that sent a whole request and then stays idle are each closed within the idle timeout (plus
    a margin for a loaded machine), not held open."""
    _, snapshot = busy_state
    monkeypatch.setattr(http_module, "IDLE_TIMEOUT_S", 0.5)
    listener = HttpListener.start(("127.0.0.1", 0), snapshot)
    host, port = listener.address.rsplit(":", 1)
    try:
        silent = socket.create_connection((host, int(port)), timeout=10)
        partial = socket.create_connection((host, int(port)), timeout=10)
        partial.sendall(b"GET /sta")
        answered = socket.create_connection((host, int(port)), timeout=10)
        answered.sendall(b"GET /status HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert answered.recv(12) == b"HTTP/1.1 200"
        answered.recv(65536)
        for connection in (silent, partial, answered):
            assert wait_closed(connection, 5.0)
            connection.close()
    finally:
        listener.close()


@pytest.mark.parametrize("host,allowed", [
    ("127.0.0.1", True), ("127.0.0.1:{port}", True), ("localhost:{port}", True), ("LOCALHOST.", True),
    ("[::1]:{port}", True), ("metrics.example:{port}", True),
    ("attacker.example:{port}", False), ("attacker.example", False), ("10.1.2.3:{port}", False),
    ("localhost.attacker.example", False), ("", False), ("@:80", False),
])
def test_the_host_header_is_checked(busy_state, host, allowed):
    """A Host header that names a loopback name or address, the bound address, or a name given
    in allowed_hosts is served; any other (a name rebound to this address, another IP) gets 421
    and no status. A request with no Host header at all (HTTP/1.0, not a browser) is served."""
    _, snapshot = busy_state
    listener = HttpListener.start(("127.0.0.1", 0), snapshot, allowed_hosts=["metrics.example"])
    port = listener.address.rsplit(":", 1)[1]
    try:
        status, body = get(f"http://{listener.address}/status", headers={"Host": host.format(port=port)})
        assert status == (200 if allowed else 421), (host, status, body)
        assert (b'"metrics"' in body) == allowed
        with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as bare:
            bare.sendall(b"GET /status HTTP/1.0\r\n\r\n")
            assert bare.recv(12) == b"HTTP/1.0 200"
    finally:
        listener.close()


def test_any_address_is_allowed_when_bound_to_all():
    """Bound to 0.0.0.0, any IP address in Host is served (what probes and scrapers of the pod's
    IP send; an address cannot be rebound), names other than loopback and the given ones are not."""
    check = HostCheck("0.0.0.0", ["kvcached.svc"])
    assert check.allows("10.1.2.3:9464") and check.allows("[fe80::1]:9464") and check.allows("kvcached.svc:80")
    assert not check.allows("rebound.example:9464")
    loopback = HostCheck("127.0.0.1")
    assert loopback.allows("127.0.0.1:1") and not loopback.allows("10.1.2.3:9464")


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


def test_a_taken_default_address_turns_http_off_with_one_warning(monkeypatch, caplog):
    """The default address (no --http given) taken by another process: the daemon goes on without
    HTTP and says so in one warning line naming the address; it does not serve elsewhere."""
    from kvcached import config as config_module
    from kvcached.server.startup import _start_http

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        monkeypatch.setattr(config_module, "DEFAULT_HTTP_ADDRESS", address)
        config = DaemonConfig.from_env({}, socket_path="/tmp/kvt-x/s.sock", l2_bytes=64 << 20)
        assert not config.http_required
        with caplog.at_level("WARNING", logger="kvcached.server.startup"):
            assert _start_http(config, []) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "HTTP is off" in warnings[0] and address in warnings[0], warnings
    assert "\n" not in warnings[0]


def test_allowed_host_names_are_checked():
    """--http-allow-host names (and KVCACHED_HTTP_ALLOW_HOST, comma-separated) are host names;
    anything else is refused by the config."""
    config = DaemonConfig.from_env({"KVCACHED_HTTP_ALLOW_HOST": "a.example, B.example."},
                                   socket_path="/tmp/kvt-x/s.sock", l2_bytes=64 << 20)
    assert config.http_allow_hosts == ("a.example", "b.example")
    for bad in ("a b", "http://x", "x:80", ""):
        with pytest.raises(ValueError, match="not a host name"):
            DaemonConfig.from_env({}, socket_path="/tmp/kvt-x/s.sock", l2_bytes=64 << 20, http_allow_hosts=[bad])


def test_a_lookup_body_sent_too_slowly_is_refused(monkeypatch):
    """A POST /lookup whose body does not arrive within the body timeout is answered 408 and its
    connection freed; a lookup sent whole is answered by the lookup function."""
    monkeypatch.setattr(http_module, "LOOKUP_BODY_TIMEOUT_S", 0.3)
    listener = HttpListener.start(("127.0.0.1", 0), lambda: {}, lookup=lambda query: {"n": len(query.token_ids)})
    host, port = listener.address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5) as connection:
            connection.sendall(b"POST /lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                               b"Content-Length: 100\r\n\r\n{\"model\": ")
            reply = connection.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        request = urllib.request.Request(f"http://{listener.address}/lookup", method="POST",
                                         data=b'{"model": "m", "token_ids": [1, 2, 3]}',
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.read() == b'{"n": 3}'
    finally:
        listener.close()
