"""`kvcached status` against a real daemon: one table, one JSON snapshot, JSON lines with --follow."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np

from engine_client.client import connect
from kvcached.testing.daemon_proc import REPO_ROOT, child_env
from kvcached.testing.engine_proc import GEOMETRY


def status_command(socket_path: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvcached.cli", "status", "--socket", socket_path, *args]


def test_status_table_and_json(daemon, rng):
    """`status` prints a table naming the namespace and tiers; `status --json` one parseable snapshot
    with the tiers' page counts and the attached session."""
    with connect(daemon.socket_path, timeout_s=5.0, client_name="cli-test") as client:
        client.attach(GEOMETRY)
        reply = client.acquire(rng.integers(0, 1000, size=64, dtype=np.int32), save=True)
        client.commit(reply.lease_id, reply.reserved_page_ids)
        assert client.flush() == []
        table = subprocess.run(status_command(daemon.socket_path), env=child_env(), cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=30)
        assert table.returncode == 0, table.stderr
        assert "e2e-model" in table.stdout and " l2 " in table.stdout and "cli-test" in table.stdout
        snapshot = subprocess.run(status_command(daemon.socket_path, "--json", "--check-integrity"), env=child_env(),
                                  cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
        data = json.loads(snapshot.stdout)
        assert data["integrity"] == "ok"
        assert data["namespaces"][0]["tiers"]["l2"]["owned_pages"] == 4
        assert [s["client_name"] for s in data["sessions"]] == ["cli-test"]


def test_status_follow_prints_json_lines_until_interrupted(daemon):
    """`status --follow --json` keeps printing one snapshot per line until SIGINT, then exits 0."""
    # SIGINT at its default in the child, as in a terminal: a test run started in the background
    # by a non-interactive shell ignores SIGINT, the child would inherit that, and Python keeps an
    # inherited SIGINT ignored (the command then never stops).
    proc = subprocess.Popen(status_command(daemon.socket_path, "--follow", "--json", "--interval-s", "0.1"),
                            env=child_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = [proc.stdout.readline() for _ in range(3)]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 0
    times = [json.loads(line)["time"] for line in lines]
    assert times == sorted(times) and len(set(times)) == 3


def test_status_without_daemon_fails_clearly(tmp_path):
    """`status` with no daemon on the socket exits non-zero with a message naming the socket."""
    path = str(tmp_path / "absent.sock")
    started = time.monotonic()
    result = subprocess.run(status_command(path), env=child_env(), cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 1 and "absent.sock" in result.stderr
    assert time.monotonic() - started < 10
