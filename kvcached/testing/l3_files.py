"""The L3 file and its index as an operator may leave them: files planted at --l3-path, a real
``kvcached serve`` started once on them, and a disk too full (a private tmpfs, as root) at start
and for write-throughs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvcached.testing.daemon_proc import REPO_ROOT, child_env
from kvcached.testing.l3_rebuild import write_branchy_index

OTHER_UID = 65534


IS_ROOT = os.geteuid() == 0


L3_NAMES = ("l3.bin", "l3.bin.index", "l3.bin.index-wal", "l3.bin.index-shm")


def serve_once(l3_path: str, timeout_s: float = 20.0) -> tuple[int | None, str]:
    """Start a daemon on l3_path; (exit code, output) if it exits, else (None, output) once it
    answered on its socket and was stopped with SIGTERM."""
    socket_dir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    socket_path = os.path.join(socket_dir, "kvcached.sock")
    args = [sys.executable, "-m", "kvcached.cli", "serve", "--socket", socket_path, "--l2-size", "4MiB",
            "--http", "off", "--l3-path", l3_path, "--l3-size", "16MiB"]
    proc = subprocess.Popen(args, env=child_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and not os.path.exists(socket_path) and time.monotonic() < deadline:
            time.sleep(0.02)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            output, _ = proc.communicate(timeout=timeout_s)
            return None, output
        return proc.returncode, proc.communicate()[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(socket_dir, ignore_errors=True)


def fingerprint(path: str) -> tuple:
    info = os.lstat(path)
    with open(path, "rb") as f:
        data = f.read()
    return info.st_ino, info.st_uid, info.st_mode, hashlib.sha256(data).hexdigest()


def random_file(path: str, rng: np.random.Generator, mode: int = 0o600) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
        f.write(rng.integers(0, 256, size=8192, dtype=np.uint8).tobytes())
    os.chmod(path, mode)


ENOSPC_ROWS = 2000


def enospc_start(directory: str, seed: int) -> dict:
    """Run inside a mount namespace with a small tmpfs at ``directory``: an index of ENOSPC_ROWS
    rows, the tmpfs then filled up, a daemon started on it, the space freed, a daemon started
    again. Prints what was seen, as JSON."""
    from kvcached.server.status import StatusClient
    from kvcached.testing.daemon_proc import DaemonProcess

    l3_path = os.path.join(directory, "l3.bin")
    size_bytes = write_branchy_index(l3_path, ENOSPC_ROWS, seed)
    index_before = fingerprint(l3_path + ".index")
    filler = os.path.join(directory, "filler")
    result = {}
    fill(filler)
    for phase in ("full", "freed"):
        daemon = DaemonProcess(l2_size="4MiB", extra_args=("--max-namespaces", "1", "--l3-path", l3_path,
                                                           "--l3-size", str(size_bytes)))
        try:
            daemon.start(timeout_s=60.0)
            with StatusClient(daemon.socket_path, timeout_s=10.0) as client:
                status = client.status(check_integrity=True)
            result[phase] = {
                "l3_pages": sum(ns["tiers"].get("l3", {}).get("owned_pages", 0) for ns in status["namespaces"]),
                "index_exists": os.path.exists(l3_path + ".index"),
                "index_unchanged": fingerprint(l3_path + ".index") == index_before,
                "integrity": status["integrity"],
                "warning": [line for line in daemon.log().splitlines() if "cannot be written now" in line][:1],
            }
        finally:
            daemon.stop()
            daemon.cleanup()
        if phase == "full":
            os.unlink(filler)
    print(json.dumps(result))
    return result


def run_in_tmpfs(entry: str, seed: int, tmpfs_size: str = "4m") -> dict:
    """This module's function ``entry(directory, seed)`` in a private mount namespace (unshare
    --mount) with a tmpfs of tmpfs_size at directory; what it printed last, as JSON."""
    directory = tempfile.mkdtemp(prefix="kvt-full-", dir="/tmp")
    try:
        script = (f'mount -t tmpfs -o size={tmpfs_size},mode=0700 kvcached-test "$1" && exec "$0" -c "import sys; '
                  f'from kvcached.testing.l3_files import {entry}; {entry}(sys.argv[1], int(sys.argv[2]))" '
                  '"$1" "$2"')
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                               sys.executable, directory, str(seed)],
                              env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_enospc_start(seed: int) -> dict:
    return run_in_tmpfs("enospc_start", seed)


def fill(path: str) -> None:
    with open(path, "wb") as f:
        try:
            while True:
                f.write(os.urandom(1 << 16))
                f.flush()
        except OSError:
            pass


WRITE_THROUGHS = 40


def failing_write_throughs(directory: str, seed: int) -> dict:
    """In a small tmpfs: a daemon on an L3 file there, the tmpfs then filled; WRITE_THROUGHS
    prefixes backed up (each a write-through that cannot be written); then space freed, the pause
    waited out, and one more backed up. Prints the counters and the log's lines about it, as JSON."""
    from engine_client.client import connect
    from kvcached.testing.daemon_proc import DaemonProcess
    from kvcached.testing.engine_proc import GEOMETRY
    from kvcached.testing.l3 import back_up_random, wait_for_write_through

    rng = np.random.default_rng(seed)
    daemon = DaemonProcess(l2_size="4MiB", extra_args=("--max-namespaces", "1", "--l3-path",
                                                       os.path.join(directory, "l3.bin"), "--l3-size", "64MiB"))
    try:
        daemon.start(timeout_s=60.0)
        filler = os.path.join(directory, "filler")
        with connect(daemon.socket_path, timeout_s=10.0) as client:
            client.attach(GEOMETRY)
            fill(filler)
            for _ in range(WRITE_THROUGHS):
                back_up_random(client, 2, rng)
            failing = wait_for_write_through(client)["metrics"]
            os.unlink(filler)
            # Past the pause: it doubles from 0.1 s with each failure that starts one (30 s at most).
            time.sleep(min(30.0, 0.1 * 2 ** (failing.get("h2s_failures", 1) - 1)) + 0.5)
            back_up_random(client, 2, rng)
            after = wait_for_write_through(client)["metrics"]
        lines = [line for line in daemon.log().splitlines() if "write-through" in line or "h2s of" in line]
    finally:
        daemon.stop()
        daemon.cleanup()
    result = {key: failing.get(key, 0) for key in ("h2s_failures", "h2s_backoff_skips", "h2s_count")}
    result["h2s_count_after"] = after.get("h2s_count", 0)
    result["log_lines"] = lines
    print(json.dumps(result))
    return result


def can_mount_tmpfs() -> bool:
    if not IS_ROOT or shutil.which("unshare") is None:
        return False
    probe = tempfile.mkdtemp(prefix="kvt-probe-", dir="/tmp")
    try:
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               f"mount -t tmpfs -o size=64k kvcached-probe {probe}"],
                              capture_output=True).returncode == 0
    finally:
        os.rmdir(probe)
