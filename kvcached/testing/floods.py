"""Floods a daemon must survive: a client that sends STATUS requests and never reads the replies
(a real process, over ipc://), and idle HTTP connections held open while /metrics is scraped."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np

from engine_client.client import connect
from kvcached.server.status import StatusClient
from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess, child_env
from kvcached.testing.engine_proc import GEOMETRY

NUM_REPORTING_ENGINES = 12            # each with a ~60 KB report: a ~0.7 MB status snapshot


REPORT_HEX_BYTES = 30_000


MAX_RSS_GROWTH_BYTES = 100 * 10**6    # the bound


# Sends STATUS requests as fast as it can and never reads: ZeroMQ's receive queue holds one
# message and the kernel's receive buffer 4 KiB, so the daemon's replies back up at the daemon.
NEVER_READS = """
import sys, zmq
from proto import codec
from proto.messages import MsgKind
socket_path, count = sys.argv[1], int(sys.argv[2])
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.RCVHWM, 1)
sock.setsockopt(zmq.RCVBUF, 4096)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(f"ipc://{socket_path}")
for request_id in range(1, count + 1):
    sock.send(codec.encode(MsgKind.STATUS, request_id, {"check_integrity": False}))
print("sent", flush=True)
sys.stdin.read()
"""


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def never_reading_flood(daemon: DaemonProcess, num_requests: int, seed: int) -> dict:
    """Engines with large reports make each snapshot large; a never-reading process sends
    num_requests STATUS requests while a reading client asks for status every 0.1 s. Returns the
    daemon's RSS growth (from before the flood until every request of it was handled), the reading
    client's status round trips, the snapshot's size and the daemon's counts."""
    rng = np.random.default_rng(seed)
    engines = []
    flood = None
    try:
        for i in range(NUM_REPORTING_ENGINES):
            engine = connect(daemon.socket_path, client_name=f"reporter-{i}")
            engines.append(engine)
            engine.attach(GEOMETRY)
            engine.report({"notes": rng.bytes(REPORT_HEX_BYTES).hex()})
        with StatusClient(daemon.socket_path, timeout_s=10.0) as reader:
            deadline = time.monotonic() + 20
            while len(reader.status()["sessions"]) < NUM_REPORTING_ENGINES or \
                    any(not s.get("report") for s in reader.status()["sessions"]):
                assert time.monotonic() < deadline, "the engines' reports did not reach the daemon"
                time.sleep(0.02)
            snapshot = reader.status()
            snapshot_bytes = len(str(snapshot).encode())
            refused_before = snapshot["metrics"].get("errors_out_of_space", 0)
            rss_before = rss_bytes(daemon.proc.pid)
            flood = subprocess.Popen([sys.executable, "-c", NEVER_READS, daemon.socket_path, str(num_requests)],
                                     env=child_env(), cwd=REPO_ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
            assert flood.stdout.readline().strip() == "sent"
            round_trips = []
            deadline = time.monotonic() + 60
            while True:
                started = time.monotonic()
                metrics = reader.status()["metrics"]
                round_trips.append(time.monotonic() - started)
                refused = metrics.get("errors_out_of_space", 0) - refused_before
                if refused >= num_requests - 2 and len(round_trips) >= 10:
                    break
                assert time.monotonic() < deadline, f"the daemon handled {refused} of the flood within 60 s"
                time.sleep(0.1)
            rss_after = rss_bytes(daemon.proc.pid)
        return {"rss_growth_bytes": rss_after - rss_before, "round_trips_s": round_trips,
                "snapshot_bytes": snapshot_bytes, "refused": refused,
                "replies_dropped": metrics.get("replies_dropped", 0)}
    finally:
        if flood is not None:
            flood.kill()
            flood.wait()
        for engine in engines:
            engine.close()


def get(url: str, method: str = "GET", headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def idle_flood_scrapes(url: str, num_idle: int, num_scrapes: int, interval_s: float = 1.0) -> list[tuple[int, float]]:
    """Open num_idle idle connections to the listener at url, then scrape /metrics num_scrapes
    times, interval_s apart: (status, seconds) of each (status 0: the scrape failed)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    idle = []
    try:
        for _ in range(num_idle):
            idle.append(socket.create_connection((host, int(port)), timeout=10))
        scrapes = []
        for _ in range(num_scrapes):
            started = time.monotonic()
            try:
                status = get(f"{url}/metrics")[0]
            except OSError:
                status = 0
            scrapes.append((status, time.monotonic() - started))
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
        return scrapes
    finally:
        for connection in idle:
            connection.close()
