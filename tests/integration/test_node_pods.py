"""One daemon per node, engines in pods: engine processes in pid and mount namespaces of their own
(unshare, as root), which see the node's files only through the socket directory and the shared-
memory directory bound into them (deploy/k8s/kvcached-daemonset.yaml's hostPath volumes), share
prefixes through one daemon bit for bit, and a stalled then killed one never makes another read a
wrong byte."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from engine_client.client import connect
from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess, wait_until
from kvcached.testing.fencing import Engine, session_names
from kvcached.testing.fencing_engine import PREFIX_PAGES

SESSION_TIMEOUT_S = 1.5          # the daemon's default
GRACE_S = 3.0
# sh -c POD_SETUP pod NODE_DIR CODE_DIR COMMAND...: in a new mount namespace (private propagation),
# the node's /tmp and /dev/shm give way to empty tmpfs of the pod's own; then the code the engine
# runs (CODE_DIR, the pod's image: a checkout may lie under /tmp) and only the volumes of NODE_DIR
# (each reached through a descriptor opened before /tmp was covered) are bound back, at the same
# paths, the code and the socket directory read-only (as the engines of deploy/k8s mount it), and
# COMMAND runs as the pod's first process.
POD_SETUP = """set -e
node=$1; code=$2; shift 2
exec 3<"$node" 4<"$code"
mount -t tmpfs -o size=64m,mode=1777 pod-tmp /tmp
mount -t tmpfs -o size=64m,mode=1777 pod-shm /dev/shm
mkdir -p "$code"
mount --no-canonicalize --bind /proc/self/fd/4 "$code"
mount -o remount,bind,ro "$code"
exec 4<&-
for volume in sock shm exchange; do
    mkdir -p "$node/$volume"
    mount --no-canonicalize --bind "/proc/self/fd/3/$volume" "$node/$volume"
done
mount -o remount,bind,ro "$node/sock"
exec 3<&-
exec "$@"
"""


def pod(node_dir: str) -> tuple[str, ...]:
    return ("unshare", "--pid", "--mount", "--fork", "--propagation", "private",
            "sh", "-c", POD_SETUP, "pod", node_dir, REPO_ROOT)


def can_make_pods() -> str | None:
    """Why pods cannot be made here (None: they can): they need root and util-linux's unshare."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare (pid and mount namespaces)"
    node_dir = tempfile.mkdtemp(prefix="kvt-node-", dir="/tmp")
    try:
        for volume in ("sock", "shm", "exchange"):
            os.mkdir(os.path.join(node_dir, volume))
            with open(os.path.join(node_dir, volume, "seen"), "w") as f:
                f.write(volume)
        # The pod is its pid namespace's first process, sees none of the node's /tmp (the marker)
        # but its volumes.
        marker = node_dir + "-marker"
        open(marker, "w").close()
        script = (f"test $$ = 1 && test ! -e {marker} && "
                  f"cat {node_dir}/sock/seen {node_dir}/shm/seen {node_dir}/exchange/seen")
        done = subprocess.run([*pod(node_dir), "sh", "-c", script], capture_output=True, text=True, timeout=30)
        if done.returncode != 0 or done.stdout.split() != ["sockshmexchange"]:
            return f"cannot make a pod here: {done.stderr.strip() or done.stdout.strip()}"
    finally:
        shutil.rmtree(node_dir)
        if os.path.exists(node_dir + "-marker"):
            os.unlink(node_dir + "-marker")
    return None


@pytest.fixture
def node():
    """A node's directory (sock/ for the daemon's socket, shm/ for its shared memory, exchange/ for
    the test's own files: each engine's KV, to compare) and its one daemon: engines in other pid
    namespaces are not pid-watched, so a silent one's session ends after SESSION_TIMEOUT_S and its
    pages stay quarantined for GRACE_S."""
    why = can_make_pods()
    if why:
        pytest.skip(why)
    node_dir = tempfile.mkdtemp(prefix="kvt-node-", dir="/tmp")
    for volume in ("shm", "exchange"):
        os.mkdir(os.path.join(node_dir, volume), 0o700)
    daemon = DaemonProcess(socket_dir=os.path.join(node_dir, "sock"), extra_args=(
        "--shm-dir", os.path.join(node_dir, "shm"), "--l3-size", "0", "--session-timeout", str(SESSION_TIMEOUT_S),
        "--session-grace", str(GRACE_S))).start()
    try:
        yield node_dir, daemon
    finally:
        daemon.cleanup()
        shutil.rmtree(node_dir, ignore_errors=True)


def test_engines_in_pods_share_prefixes_and_a_stalled_killed_one_corrupts_nothing(node):
    """Engines A, B and C each in a pid and mount namespace of its own, seeing only the node's
    socket and shared-memory directories. B restores the prefix A saved, all 8 pages bit for bit
    (A's random KV, into B's own blocks). Then A starts saving a second prefix and is SIGSTOPped
    between its checks and its copy: the daemon ends A's session (heartbeats only, as it cannot
    watch a pid of another namespace) and, after the grace, gives A's pages to B, which saves the
    prefix with its own KV; A resumes and its copy writes none of them (stale generation); A (which
    re-attached on resuming) is SIGKILLed and the daemon ends its session by heartbeats. C restores
    B's bytes exactly, and the daemon's integrity check passes."""
    node_dir, daemon = node
    seed = 4400
    exchange = os.path.join(node_dir, "exchange")
    a_kv, b_kv = os.path.join(exchange, "a.kv"), os.path.join(exchange, "b.kv")
    a = Engine(daemon.socket_path, "pod-A", seed, kv_seed=seed + 1, state=a_kv, hold_before_save_copy=True,
               launcher=pod(node_dir))
    b = Engine(daemon.socket_path, "pod-B", seed, kv_seed=seed + 2, state=b_kv, compare=a_kv, launcher=pod(node_dir))
    c = Engine(daemon.socket_path, "pod-C", seed + 10, compare=b_kv, launcher=pod(node_dir))
    a_pid = None
    try:
        for engine in (a, b, c):
            assert engine.read()["attached"] == engine.name
        with connect(daemon.socket_path, timeout_s=5.0) as observer:
            sessions = observer.status()["sessions"]
            assert {s["client_name"]: s["pid_watched"] for s in sessions} == dict.fromkeys(("pod-A", "pod-B", "pod-C"), False)
            assert {s["pid"] for s in sessions} == {1}           # each is its pod's first process

            assert len(a.ask("prepare")["reserved_page_ids"]) == PREFIX_PAGES
            a_pid = a.ask("finish")["at_copy"]
            a.send("")
            assert a.read()["backed_up"] == PREFIX_PAGES
            shared = b.ask("restore")
            assert shared["restored_tokens"] == PREFIX_PAGES * 16, shared
            assert shared["equal_pages"] == shared["pages"] == PREFIX_PAGES, shared

            for engine in (a, b):
                assert engine.ask(f"prefix {seed + 10}")["prefix"] == seed + 10
            a_prepared = a.ask("prepare")
            assert len(a_prepared["reserved_page_ids"]) == PREFIX_PAGES, a_prepared
            assert a.ask("finish")["at_copy"] == a_pid
            os.kill(a_pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            wait_until(lambda: "pod-A" not in session_names(observer), 10.0, "A's session ended")
            time.sleep(max(0.0, stopped_at + GRACE_S + 0.5 - time.monotonic()))
            b_prepared = b.ask("prepare")
            assert b_prepared["cached_tokens"] == 0, b_prepared
            b_finished = b.ask("finish")
            assert b_finished["backed_up"] == PREFIX_PAGES and b_finished["errors"] == [], b_finished
            os.kill(a_pid, signal.SIGCONT)
            a.send("")                                   # on with A's copy, into pages now B's
            a_finished = a.read()
            os.kill(a_pid, signal.SIGKILL)     # A had re-attached when it resumed: the daemon must see it gone
            a.proc.wait(timeout=10)
            wait_until(lambda: "pod-A" not in session_names(observer), 10.0, "killed A's session ended")

            restored = c.ask("restore")
            final = observer.status(check_integrity=True)
    finally:
        a.close(a_pid)
        b.close()
        c.close()
    assert b_prepared["reserved_page_ids"] == a_prepared["reserved_page_ids"], (a_prepared, b_prepared)
    assert a_finished["backed_up"] == 0, a_finished
    assert a_finished["stats"]["save_skipped_pages_stale_generation"] == PREFIX_PAGES, a_finished
    assert restored["restored_tokens"] == PREFIX_PAGES * 16, restored
    assert restored["equal_pages"] == restored["pages"] == PREFIX_PAGES, restored
    assert restored["integrity"] == final["integrity"] == "ok", final["integrity"]
    assert "pod-A" not in [s["client_name"] for s in final["sessions"]]
