"""Start and stop a real ``kvcached serve`` process, for the tests and the benchmarks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

# The directory that holds the kvcached package (the repository in a checkout): what child processes
# get on their PYTHONPATH, so that they run this code and not another installed copy.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def commit_written(client, reply) -> None:
    """Commit an acquire's reserved pages as an engine does once its copy into them is complete: claim
    them, stamp them with the lease's write generation (proto.generations), then commit. These tests
    play an engine that writes nothing; a page committed without its stamp is never read back."""
    from engine_client.shared_pool import PageGenerations

    pages = np.asarray(reply.reserved_page_ids, dtype=np.int64)
    generations = PageGenerations(client.info.generations_path, client.info.num_pages)
    try:
        claimed = generations.claim(pages, reply.reserved_generation)
        assert claimed.all(), "pages of a live lease are still reserved for it"
        generations.stamp(pages, reply.reserved_generation)
    finally:
        generations.close()
    client.commit(reply.lease_id, reply.reserved_page_ids)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("KVCACHED_SOCKET", None)
    return env


# Heartbeats 5 s apart, sessions kept 30 s: a daemon stopped (SIGSTOP) for a moment is a pause, not
# an outage (with the defaults a loaded machine's pause can outlast what a session is known valid for).
PATIENT_DAEMON = ("--heartbeat-interval", "5", "--session-timeout", "30")


def stop_process(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP pid and wait until every thread of it is stopped. The kernel stops the threads one
    by one, so on a loaded machine a running thread can go on serving requests for a while after
    kill() returns; a test that needs the process frozen waits for this."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:       # a thread that exited meanwhile
                pass
        if all(state in ("T", "t") for state in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped within {timeout_s} s: thread states {states}")
        time.sleep(0.001)


class DaemonProcess:
    def __init__(self, l2_size: str = "64MiB", extra_args: tuple[str, ...] = (), socket_dir: str | None = None,
                 socket_arg: str | None = None, env: dict[str, str] | None = None, cwd: str = REPO_ROOT):
        """socket_arg: what --socket is given (default: socket_dir/kvcached.sock; "" gives none,
        so that the daemon takes its default, which must then be socket_dir/kvcached.sock)."""
        # ipc:// paths must stay short (sun_path is 108 bytes), so not under pytest's tmp_path.
        self.socket_dir = socket_dir or tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
        self.socket_path = os.path.join(self.socket_dir, "kvcached.sock")
        socket_arg = self.socket_path if socket_arg is None else socket_arg
        # Every test daemon serves HTTP on a free loopback port (http_url), unless told otherwise.
        http_args = () if "--http" in extra_args else ("--http", "127.0.0.1:0")
        self.args = [sys.executable, "-m", "kvcached.cli", "serve", *(["--socket", socket_arg] if socket_arg else []),
                     "--l2-size", l2_size, *http_args, *extra_args]
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="kvt-log-", dir="/tmp"), "daemon.log")
        self.env = {**child_env(), **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> "DaemonProcess":
        """Start the process and return at once; start() also waits until it serves."""
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=self.cwd)
        return self

    def start(self, timeout_s: float = 20.0) -> "DaemonProcess":
        self.spawn()
        # Ready means: this process answers STATUS on the socket (a stale socket file may exist already).
        from kvcached.server.status import DaemonUnavailable, StatusClient

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon did not answer on its socket within {timeout_s} s: {self.log()}")
            if os.path.exists(self.socket_path):
                try:
                    with StatusClient(self.socket_path, timeout_s=0.2) as client:
                        if client.status()["daemon"]["pid"] == self.proc.pid:
                            break
                except DaemonUnavailable:
                    pass
            time.sleep(0.02)
        return self

    def http_url(self, timeout_s: float = 5.0) -> str:
        """http://HOST:PORT of its HTTP listener, as its status names it."""
        from kvcached.server.status import StatusClient

        with StatusClient(self.socket_path, timeout_s=timeout_s) as client:
            address = client.status()["daemon"]["http"]
        assert address, f"the daemon serves no HTTP: {self.log()}"
        return f"http://{address}"

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop(signal.SIGKILL)
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        shutil.rmtree(os.path.dirname(self.log_path), ignore_errors=True)
        # A daemon killed on purpose leaves its segment behind; do not leak it into /dev/shm.
        from kvcached.server.shm import epoch_file_prefix, hints_file_name, segment_name

        prefix = epoch_file_prefix(self.socket_path)
        for name in [segment_name(self.socket_path), hints_file_name(self.socket_path)] + \
                [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass


def wait_until(condition, timeout_s: float, what: str, poll_s: float = 0.01):
    """Poll ``condition`` until it returns something true, at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(poll_s)
