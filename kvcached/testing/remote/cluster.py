"""Several "hosts" on one machine for the remote tier: a real ``mooncake_master`` and real daemons
(``kvcached/testing/daemon_proc.py``), each with its own engines (``engine_proc.py``), all inside
one network namespace that has only loopback (some of the store's listeners bind 0.0.0.0).

A scenario (``kvcached/testing/remote/scenarios.py``) runs as ``python -m kvcached.testing.remote.scenarios NAME`` under
``run_isolated``, which enters a fresh network namespace first, and prints one JSON line of what it
measured; the tests assert on it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from kvcached.testing.daemon_proc import (
    PATIENT_DAEMON,
    REPO_ROOT,
    DaemonProcess,
    child_env,
)

MASTER_PORT = 50051
METADATA_PORT = 8080
MASTER_URL = f"mooncake://127.0.0.1:{MASTER_PORT}"
STORE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "1"}


def master_binary() -> str | None:
    found = shutil.which("mooncake_master")
    if found:
        return found
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "mooncake_master")
    return path if os.access(path, os.X_OK) else None


def missing() -> str:
    """Why the remote tier's scenarios cannot run here ("" when they can)."""
    if importlib.util.find_spec("mooncake") is None:
        return "the Mooncake Store wheel (pip install '.[remote]') is not installed"
    if master_binary() is None:
        return "mooncake_master is not installed"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is missing"
    probe = subprocess.run(_isolating(["true"]), capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot enter a network namespace: {probe.stderr.strip()[:200]}"
    return ""


def _isolating(command: list[str]) -> list[str]:
    """command, run in a new network namespace with loopback up (root: unshare --net; else a user
    namespace mapping us to root)."""
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    script = '"$0" -c "$1" && shift && exec "$@"'
    return ["unshare", "--net", *user, "bash", "-c", script, sys.executable, _LOOPBACK_UP, *command]


# Sets the namespace's loopback up with the SIOCGIFFLAGS/SIOCSIFFLAGS ioctls, so that no iproute2 is
# needed where the scenarios run.
_LOOPBACK_UP = """
import fcntl, socket, struct
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))
"""


def run_isolated(scenario: str, timeout_s: float = 240.0, **options: Any) -> dict[str, Any]:
    """Run one scenario in a fresh network namespace; what it printed last (a JSON object)."""
    env = {**child_env(), **STORE_ENV}
    command = [sys.executable, "-m", "kvcached.testing.remote.scenarios", scenario, json.dumps(options)]
    done = subprocess.run(_isolating(command), capture_output=True, text=True, timeout=timeout_s, env=env,
                          cwd=REPO_ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise AssertionError(f"scenario {scenario} failed ({done.returncode}):\n{done.stdout[-4000:]}\n"
                             f"{done.stderr[-8000:]}")
    return json.loads(lines[-1])


def wait_port(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s") from None
            time.sleep(0.05)


class Master:
    """A real mooncake_master with its own HTTP metadata server, on loopback."""

    def __init__(self, client_ttl_s: int = 2):
        self.client_ttl_s = client_ttl_s
        self.log_dir = tempfile.mkdtemp(prefix="kvt-master-", dir="/tmp")
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Master":
        binary = master_binary()
        assert binary is not None
        args = [binary, f"--rpc_port={MASTER_PORT}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={METADATA_PORT}",
                "--metrics_port=9003", f"--client_ttl={self.client_ttl_s}", "--default_kv_lease_ttl=2000"]
        log = open(os.path.join(self.log_dir, "master.log"), "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **STORE_ENV})
        log.close()
        wait_port(MASTER_PORT)
        wait_port(METADATA_PORT)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        with open(os.path.join(self.log_dir, "master.log"), "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.log_dir, ignore_errors=True)


# Deadlines a loaded 2-core box keeps: a call missed spuriously would make the next requests skip
# the store (the breaker), and a test that expects a restore would see a miss. The scenarios that
# measure a deadline name their own.
PATIENT_REMOTE = ("--remote-exist-timeout", "2", "--remote-get-timeout", "5")


def remote_daemon(segment: str = "64MiB", extra_args: tuple[str, ...] = (),
                  deadlines: tuple[str, ...] = PATIENT_REMOTE) -> DaemonProcess:
    """A daemon of its own "host" with the remote tier on (not started)."""
    return DaemonProcess(extra_args=("--remote", MASTER_URL, "--remote-segment-size", segment,
                                     "--http", "off", *PATIENT_DAEMON, *deadlines, *extra_args), env=STORE_ENV)


def status(daemon: DaemonProcess) -> dict[str, Any]:
    from kvcached.server.status import StatusClient

    with StatusClient(daemon.socket_path, timeout_s=5.0) as client:
        return client.status(check_integrity=True)


def wait_for(daemon: DaemonProcess, condition: Callable[[dict[str, Any]], bool], what: str,
             timeout_s: float = 30.0) -> dict[str, Any]:
    """Poll the daemon's status until condition holds (its integrity checked each time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snapshot = status(daemon)
        assert snapshot["integrity"] == "ok", snapshot["integrity"]
        if condition(snapshot):
            return snapshot
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s; remote: {snapshot['daemon']['remote']}, "
                               f"pending: {snapshot.get('pending')}\n{daemon.log()[-3000:]}")
        time.sleep(0.05)


def connected(snapshot: dict[str, Any]) -> bool:
    remote = snapshot["daemon"]["remote"]
    return remote["connected"] and remote["state"] == "closed"


def writes_done(snapshot: dict[str, Any]) -> bool:
    return snapshot["pending"]["h2r"] == 0


def engine(daemon: DaemonProcess, role: str, state_path: str, seed: int = 0, *extra: str,
           timeout_s: float = 120.0) -> dict[str, Any]:
    """One engine process (``kvcached/testing/engine_proc.py``) on this daemon; its JSON report."""
    done = subprocess.run([sys.executable, "-m", "kvcached.testing.engine_proc", "--socket", daemon.socket_path,
                           "--role", role, "--state", state_path, "--seed", str(seed), *extra],
                          capture_output=True, text=True, timeout=timeout_s, env=child_env(), cwd=REPO_ROOT)
    if done.returncode != 0:
        raise AssertionError(f"engine {role} failed: {done.stdout[-2000:]}\n{done.stderr[-4000:]}\n"
                             f"daemon log: {daemon.log()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
