"""The L3 file and its index are the daemon's own: real ``kvcached serve`` processes refuse a
symlink or another user's file planted at --l3-path, its index or sqlite's -wal and -shm files
beside it, with one line, touching nothing; a disk too full to write the index at start keeps it.

Another user is uid 65534 (nobody): the tests that chown run as root (as CI does).
"""

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
import pytest

from kvcached.testing.daemon_proc import REPO_ROOT, child_env
from tests.integration.test_l3_rebuild import write_branchy_index

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


def refusal_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines, "the daemon said nothing"
    return lines[-1]


@pytest.mark.parametrize("name", L3_NAMES)
def test_a_symlink_planted_at_an_l3_file_is_refused_and_its_target_untouched(tmp_path, rng, name):
    """A symlink at --l3-path, its index, or the index's -wal or -shm file, pointing at another
    file of the daemon's user: the daemon exits with status 1 and one line naming the symlink; the
    file it points at keeps its inode, size and bytes."""
    victim = str(tmp_path / "victim")
    random_file(victim, rng)
    before = fingerprint(victim)
    directory = tmp_path / "l3"
    directory.mkdir(mode=0o700)
    os.symlink(victim, directory / name)
    rc, output = serve_once(str(directory / "l3.bin"))
    assert rc == 1, output
    line = refusal_line(output)
    assert "symlink" in line and name in line, line
    assert fingerprint(victim) == before


@pytest.mark.skipif(not IS_ROOT, reason="chown to another user needs root")
@pytest.mark.parametrize("name", L3_NAMES)
def test_another_users_l3_file_is_refused_untouched(tmp_path, rng, name):
    """A root daemon does not adopt a file of another user (uid 65534) at --l3-path, its index or
    the index's -wal or -shm file, though it could open it: exit status 1, one line naming the file
    and its owner, and the file keeps its owner, mode and bytes (no forged KV served, no prompt
    tokens written where that user reads them)."""
    directory = tmp_path / "l3"
    directory.mkdir(mode=0o700)
    planted = str(directory / name)
    random_file(planted, rng)
    os.chown(planted, OTHER_UID, OTHER_UID)
    before = fingerprint(planted)
    rc, output = serve_once(str(directory / "l3.bin"))
    assert rc == 1, output
    line = refusal_line(output)
    assert name in line and f"uid {OTHER_UID}" in line, line
    assert fingerprint(planted) == before


@pytest.mark.parametrize("name", L3_NAMES)
def test_an_l3_file_others_may_read_is_refused_untouched(tmp_path, rng, name):
    """A file of the daemon's user that group or others may read (0644) at --l3-path, its index or
    a sidecar: refused with one line naming its mode, and left as it was (not made 0600 and used:
    whoever could read it may hold it open)."""
    directory = tmp_path / "l3"
    directory.mkdir(mode=0o700)
    planted = str(directory / name)
    random_file(planted, rng, mode=0o644)
    before = fingerprint(planted)
    rc, output = serve_once(str(directory / "l3.bin"))
    assert rc == 1, output
    line = refusal_line(output)
    assert name in line and "0644" in line, line
    assert fingerprint(planted) == before


def test_new_l3_files_are_private_and_a_second_start_uses_them(tmp_path):
    """A daemon makes its L3 file and index 0600 (whatever the umask), and a second start on them
    is not refused."""
    directory = tmp_path / "l3"
    directory.mkdir(mode=0o700)
    l3_path = str(directory / "l3.bin")
    old_umask = os.umask(0)
    try:
        assert serve_once(l3_path)[0] is None
    finally:
        os.umask(old_umask)
    for name in os.listdir(directory):
        assert os.stat(directory / name).st_mode & 0o777 == 0o600, name
    rc, output = serve_once(l3_path)
    assert rc is None, output


# ---- ENOSPC at start ----------------------------------------------------------------------------

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
                  f'from tests.integration.test_l3_files import {entry}; {entry}(sys.argv[1], int(sys.argv[2]))" '
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
    from tests.integration.test_l3 import back_up_random, wait_for_write_through

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


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root and unshare --mount to make a small tmpfs")
def test_a_full_disk_at_start_keeps_the_index(rng):
    """On a tmpfs filled up after the index was written, a daemon still starts (without L3 for
    that run, saying why in one warning) and leaves the index as it was: not removed, not
    emptied; once space is free again, a restart has every row back."""
    result = run_enospc_start(int(rng.integers(1 << 31)))
    full, freed = result["full"], result["freed"]
    assert full["index_exists"] and full["index_unchanged"], result
    assert full["warning"] and full["l3_pages"] == 0 and full["integrity"] == "ok", result
    assert freed["l3_pages"] == ENOSPC_ROWS and freed["integrity"] == "ok", result


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root and unshare --mount to make a small tmpfs")
def test_failing_write_throughs_back_off_and_log_a_line_per_cause(rng):
    """With the L3 file's disk full, WRITE_THROUGHS prefixes backed up: every write-through fails
    or is skipped while write-throughs are paused (counted: h2s_failures, h2s_backoff_skips),
    fewer fail than were asked for, the log has one line for the cause (ENOSPC) rather than one
    per failure; with space again, write-throughs resume and say so."""
    result = run_in_tmpfs("failing_write_throughs", int(rng.integers(1 << 31)))
    assert result["h2s_count"] == 0, result
    assert result["h2s_failures"] + result["h2s_backoff_skips"] == WRITE_THROUGHS, result
    assert result["h2s_backoff_skips"] > 0 and result["h2s_failures"] >= 1, result
    failed_lines = [line for line in result["log_lines"] if "failed" in line]
    assert 1 <= len(failed_lines) <= 3 and "ENOSPC" in failed_lines[0], result["log_lines"]
    assert result["h2s_count_after"] == 1, result
    assert any("succeed again" in line for line in result["log_lines"]), result["log_lines"]
