"""A socket no one else can take: real ``kvcached serve`` processes meet planted symlinks, hard links,
directories and files of other users, and refuse them with a message, touching no file they did not
make; engines refuse a daemon socket that another user could control; ipc:// URLs work everywhere.

Another user is uid 65534 (nobody). The tests run as root in CI, where files really change owner
(os.chown); as another user, the same comparisons are made through the expected uid, or a
directory that root owns.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import NamedTuple

import numpy as np
import pytest

from engine_client.client import connect
from kvcached.server.shm import hints_file_name, segment_name
from proto.messages import KVGeometry
from proto.paths import MAX_SOCKET_PATH_BYTES, UntrustedSocket
from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess, child_env

GEOMETRY = KVGeometry("socket-model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", page_size=4)
OTHER_UID = 65534
IS_ROOT = os.geteuid() == 0


class Victim(NamedTuple):
    """A file the daemon must not touch, and what it was."""

    path: str
    data: bytes
    inode: int

    def assert_untouched(self) -> None:
        info = os.lstat(self.path)
        with open(self.path, "rb") as f:
            data = f.read()
        assert (info.st_ino, data) == (self.inode, self.data), f"{self.path} was changed"


def make_victim(directory: str, name: str, rng) -> Victim:
    path = os.path.join(directory, name)
    data = rng.integers(0, 256, size=4096, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    return Victim(path, data, os.lstat(path).st_ino)


@pytest.fixture
def scratch():
    """Fresh private directories under /tmp (short paths: sun_path), removed afterwards."""
    made = []

    def make() -> str:
        made.append(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
        return made[-1]

    yield make
    for directory in made:
        with contextlib.suppress(OSError):
            os.chown(directory, os.geteuid(), os.getegid())
            os.chmod(directory, 0o700)
        shutil.rmtree(directory, ignore_errors=True)


def serve_refused(socket_arg: str | None, env: dict[str, str] | None = None, expect_rc: int = 1) -> str:
    """Run `kvcached serve`; it must exit with expect_rc at start. Returns what it printed."""
    args = [sys.executable, "-m", "kvcached.cli", "serve", "--l2-size", "8MiB", "--l3-size", "0"]
    if socket_arg is not None:
        args += ["--socket", socket_arg]
    proc = subprocess.run(args, env={**child_env(), **(env or {})}, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == expect_rc, output
    assert "Traceback" not in output, output
    return output


def test_a_symlink_at_the_lock_path_is_refused_and_its_target_untouched(scratch, rng):
    """A symlink planted at <socket>.lock makes the daemon refuse to start; the file it points to keeps
    its bytes and inode (it used to be truncated), and no socket or segment is made."""
    socket_dir, elsewhere = scratch(), scratch()
    victim = make_victim(elsewhere, "precious", rng)
    socket_path = os.path.join(socket_dir, "kvcached.sock")
    os.symlink(victim.path, socket_path + ".lock")
    output = serve_refused(socket_path)
    assert "lock file" in output and "is a symlink" in output
    victim.assert_untouched()
    assert os.path.islink(socket_path + ".lock") and not os.path.exists(socket_path)
    assert not os.path.exists(os.path.join("/dev/shm", segment_name(socket_path)))


def test_a_hard_link_at_the_lock_path_is_refused_and_its_file_untouched(scratch, rng):
    socket_dir = scratch()
    victim = make_victim(scratch(), "precious", rng)
    socket_path = os.path.join(socket_dir, "kvcached.sock")
    os.link(victim.path, socket_path + ".lock")
    output = serve_refused(socket_path)
    assert "with 2 links" in output
    victim.assert_untouched()


def test_a_symlinked_socket_directory_is_refused_and_nothing_in_it_is_removed(scratch, rng):
    """The socket's directory is a symlink to a directory holding a file named kvcached.sock (and a
    lock file): the daemon refuses, and both files stay as they were (the socket used to be unlinked)."""
    base, target = scratch(), scratch()
    victims = [make_victim(target, "kvcached.sock", rng), make_victim(target, "kvcached.sock.lock", rng)]
    link = os.path.join(base, "run")
    os.symlink(target, link)
    output = serve_refused(os.path.join(link, "kvcached.sock"))
    assert f"the socket directory {link} is a symlink" in output
    for victim in victims:
        victim.assert_untouched()
    assert sorted(os.listdir(target)) == ["kvcached.sock", "kvcached.sock.lock"]


def test_a_socket_directory_made_first_by_another_user_is_refused(scratch):
    """The default directory (here under $XDG_RUNTIME_DIR), created beforehand by another user, makes the
    daemon refuse to start with a message naming the owner and what to do, and it writes nothing there.
    Not as root: a directory root owns stands in for it."""
    if IS_ROOT:
        runtime_dir = scratch()
        taken = os.path.join(runtime_dir, "kvcached")
        os.mkdir(taken, 0o755)
        os.chown(taken, OTHER_UID, OTHER_UID)
        output = serve_refused(None, env={"XDG_RUNTIME_DIR": runtime_dir})
        owner = OTHER_UID
    else:
        taken = "/usr"
        output = serve_refused(os.path.join(taken, "kvcached.sock"))
        owner = 0
    assert f"the socket directory {taken} belongs to uid {owner}" in output
    assert "another user created it first" in output and "Remove it" in output
    if IS_ROOT:
        assert os.listdir(taken) == []


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_a_socket_directory_others_may_write_is_refused(scratch, mode):
    socket_dir = scratch()
    os.chmod(socket_dir, mode)
    output = serve_refused(os.path.join(socket_dir, "kvcached.sock"))
    assert "writable by other users" in output
    assert os.listdir(socket_dir) == []


def test_a_file_or_symlink_at_the_socket_path_is_refused_not_removed(scratch, rng):
    """Only a stale socket of the daemon's own user is removed at start: a regular file, or a symlink,
    at the socket path is refused, and it (and what it points to) stays."""
    socket_dir = scratch()
    socket_path = os.path.join(socket_dir, "kvcached.sock")
    planted = make_victim(socket_dir, "kvcached.sock", rng)
    output = serve_refused(socket_path)
    assert "is a regular file" in output and "does not remove it" in output
    planted.assert_untouched()
    os.unlink(socket_path)
    victim = make_victim(scratch(), "precious", rng)
    os.symlink(victim.path, socket_path)
    output = serve_refused(socket_path)
    assert "is a symlink" in output
    assert os.readlink(socket_path) == victim.path
    victim.assert_untouched()


@pytest.mark.parametrize("name_of, what", [(segment_name, "L2 segment"), (hints_file_name, "admission hints file")])
def test_a_file_planted_at_a_shared_memory_name_is_refused_and_untouched(scratch, rng, name_of, what):
    """/dev/shm is shared by every user: a symlink (or, as root, another user's file) at the L2 segment's
    name, or at the admission hints file's, makes the daemon refuse, and neither it nor its target is
    changed or removed; the daemon leaves neither name behind."""
    socket_path = os.path.join(scratch(), "kvcached.sock")
    planted = os.path.join("/dev/shm", name_of(socket_path))
    other = os.path.join("/dev/shm", (hints_file_name if name_of is segment_name else segment_name)(socket_path))
    victim = make_victim(scratch(), "precious", rng)
    try:
        os.symlink(victim.path, planted)
        output = serve_refused(socket_path)
        assert "is a symlink" in output and f"not an {what} this daemon left behind" in output
        assert os.readlink(planted) == victim.path and not os.path.exists(other)
        victim.assert_untouched()
        if IS_ROOT:
            os.unlink(planted)
            theirs = make_victim("/dev/shm", name_of(socket_path), rng)
            os.chown(planted, OTHER_UID, OTHER_UID)
            output = serve_refused(socket_path)
            assert f"of uid {OTHER_UID}" in output
            theirs.assert_untouched()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(planted)


def test_an_engine_refuses_a_daemon_socket_of_another_uid_unless_told_to_expect_it(rng, monkeypatch):
    """A daemon whose socket and directory belong to another uid: connect() and `kvcached status` refuse
    it, saying whose it is; with that uid expected (daemon_uid=, $KVCACHED_DAEMON_UID, --daemon-uid) the
    engine attaches and is served. As root the daemon's files are given to uid 65534; otherwise our
    own daemon is checked against another expected uid, the same comparison."""
    daemon = DaemonProcess(l2_size="8MiB", extra_args=("--l3-size", "0"))
    try:
        daemon.start()
        if IS_ROOT:
            os.chown(daemon.socket_dir, OTHER_UID, OTHER_UID)
            os.chown(daemon.socket_path, OTHER_UID, OTHER_UID)
            owner, stranger = OTHER_UID, None           # None: expect our own uid, the default
        else:
            owner, stranger = os.geteuid(), os.geteuid() + 1
        with pytest.raises(UntrustedSocket, match=f"belongs to uid {owner}"):
            connect(daemon.socket_path, daemon_uid=stranger)
        status = [sys.executable, "-m", "kvcached.cli", "status", "--socket", daemon.socket_path]
        refused = subprocess.run(status + ([] if stranger is None else ["--daemon-uid", str(stranger)]),
                                 env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and f"belongs to uid {owner}" in refused.stderr, refused.stderr
        accepted = subprocess.run(status + ["--daemon-uid", str(owner)], env=child_env(), cwd=REPO_ROOT,
                                  capture_output=True, text=True, timeout=60)
        assert accepted.returncode == 0, accepted.stderr
        with connect(daemon.socket_path, timeout_s=5.0, daemon_uid=owner) as client:
            client.attach(GEOMETRY)
            assert client.acquire(rng.integers(0, 50_000, size=16, dtype=np.int32)).hit_tokens["l2"] == 0
        monkeypatch.setenv("KVCACHED_DAEMON_UID", str(owner))
        with connect(daemon.socket_path, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
        assert daemon.stop() == 0
        assert not os.path.exists(daemon.socket_path)
    finally:
        daemon.cleanup()


def test_ipc_urls_work_for_serve_status_and_connect(scratch, rng):
    """`--socket ipc:///path` serves on /path (no ./ipc: directory appears where the daemon runs); an
    engine connecting to the same URL backs up and finds its prefix; `kvcached status` takes the URL."""
    workdir = scratch()
    socket_dir = scratch()
    url = f"ipc://{socket_dir}/kvcached.sock"
    daemon = DaemonProcess(l2_size="8MiB", extra_args=("--l3-size", "0"), socket_dir=socket_dir, socket_arg=url,
                           cwd=workdir)
    try:
        daemon.start()
        assert os.listdir(workdir) == []
        assert sorted(os.listdir(socket_dir)) == ["kvcached.sock", "kvcached.sock.lock"]
        with connect(url, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
            tokens = rng.integers(0, 50_000, size=8 * GEOMETRY.page_size, dtype=np.int32)
            reply = client.acquire(tokens, save=True)
            client.commit(reply.lease_id, reply.reserved_page_ids)
            assert client.flush() == []
            hit = client.acquire(tokens)
            assert hit.hit_tokens["l2"] == len(tokens)
            client.release(hit.lease_id)
        status = subprocess.run([sys.executable, "-m", "kvcached.cli", "status", "--socket", url, "--json"],
                                env=child_env(), cwd=workdir, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and f'"socket": "{socket_dir}/kvcached.sock"' in status.stdout, status.stderr
        assert daemon.stop() == 0
        assert os.listdir(workdir) == []
    finally:
        daemon.cleanup()


def test_the_default_socket_is_under_xdg_runtime_dir(scratch, monkeypatch):
    """With no --socket and $XDG_RUNTIME_DIR set, the daemon makes $XDG_RUNTIME_DIR/kvcached (0700) and
    serves there; an engine's default connect() finds it."""
    runtime_dir = scratch()
    daemon = DaemonProcess(l2_size="8MiB", extra_args=("--l3-size", "0"),
                           socket_dir=os.path.join(runtime_dir, "kvcached"), socket_arg="",
                           env={"XDG_RUNTIME_DIR": runtime_dir})
    try:
        daemon.start()
        assert os.stat(daemon.socket_dir).st_mode & 0o7777 == 0o700
        monkeypatch.setenv("XDG_RUNTIME_DIR", runtime_dir)
        monkeypatch.delenv("KVCACHED_SOCKET", raising=False)
        with connect(timeout_s=5.0) as client:
            assert client.socket_path == daemon.socket_path
            client.attach(GEOMETRY)
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_a_socket_path_too_long_for_a_socket_address_is_a_clear_error():
    """A path over sun_path's 107 bytes: serve exits 2 with the limit in its message; connect raises ValueError."""
    too_long = "/tmp/" + "k" * MAX_SOCKET_PATH_BYTES + ".sock"
    output = serve_refused(f"ipc://{too_long}", expect_rc=2)
    assert f"at most {MAX_SOCKET_PATH_BYTES}" in output
    with pytest.raises(ValueError, match=f"at most {MAX_SOCKET_PATH_BYTES}"):
        connect(too_long)


def test_a_daemon_killed_leaves_files_that_the_next_one_takes_back(scratch):
    """The checks refuse only what the daemon did not make: after SIGKILL, its own socket, lock file and
    segment are taken back by the next daemon on the same path."""
    socket_dir = scratch()
    first = DaemonProcess(l2_size="8MiB", extra_args=("--l3-size", "0"), socket_dir=socket_dir)
    second = DaemonProcess(l2_size="8MiB", extra_args=("--l3-size", "0"), socket_dir=socket_dir)
    try:
        first.start().stop(signal.SIGKILL)
        assert sorted(os.listdir(socket_dir)) == ["kvcached.sock", "kvcached.sock.lock"]
        second.start()
        with connect(second.socket_path, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
        assert second.stop() == 0
        assert os.listdir(socket_dir) == []
    finally:
        first.cleanup()
        second.cleanup()
