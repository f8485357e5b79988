"""The remote tier's scenarios, each on a real mooncake_master, real daemons and real engine
processes (``kvcached/testing/remote/cluster.py``). Run inside a network namespace of loopback only:

    python -m kvcached.testing.remote.scenarios NAME '{"option": value}'

Each prints one JSON line of what it saw; ``tests/remote/test_remote.py`` asserts on it and
``bench/drills.py`` reports it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any, Callable

from kvcached.server.metrics import metric_families
from kvcached.server.status import render_table
from kvcached.testing.daemon_proc import stop_process
from kvcached.testing.remote.cluster import (
    Master,
    connected,
    engine,
    remote_daemon,
    status,
    wait_for,
    writes_done,
)

ALWAYS = ("--restore-policy", "always")


def _counters(snapshot: dict[str, Any]) -> dict[str, Any]:
    return snapshot["daemon"]["remote"]["counters"]


def _metrics(snapshot: dict[str, Any]) -> dict[str, Any]:
    return snapshot["metrics"]


def _save_on(daemon, state_path: str, seed: int) -> dict[str, Any]:
    """Engine X on this host prefills and saves three prefixes; waits for their write-through."""
    saved = engine(daemon, "backup", state_path, seed)
    wait_for(daemon, lambda s: writes_done(s) and _metrics(s).get("remote_pages_written", 0) >= saved["pages"],
             "the saved pages written through to the store")
    return saved


def restore_across_hosts(options: dict[str, Any]) -> dict[str, Any]:
    """X on host A saves; Y on host B, whose daemon never saw the prefixes, restores them."""
    master = Master().start()
    a, b = remote_daemon(extra_args=ALWAYS).start(), remote_daemon(extra_args=ALWAYS).start()
    state = os.path.join(tempfile.mkdtemp(prefix="kvt-remote-"), "saved.pt")
    try:
        for daemon in (a, b):
            wait_for(daemon, connected, "connected to the store")
        saved = _save_on(a, state, seed=int(options.get("seed", 1)))
        before = status(b)
        restored = engine(b, "restore", state, 7)
        after = status(b)
        return {"saved": saved, "restored": restored,
                "b_lookups_before": before["metrics"].get("matches", 0),
                "b_remote_hit_pages": _metrics(after).get("remote_hit_pages", 0),
                "b_remote_bytes_read": _metrics(after).get("remote_bytes_read", 0),
                "b_checksum_mismatches": _metrics(after).get("remote_checksum_mismatches", 0),
                "b_r2h_line": after["cost_model"]["storage"]["r2h"],
                "b_remote": after["daemon"]["remote"],
                "b_table": render_table(after),
                "b_metrics": {family.name: [[sample.labels, sample.value] for sample in family.samples]
                              for family in metric_families(after) if "remote" in family.name}}
    finally:
        for daemon in (a, b):
            daemon.cleanup()
        master.cleanup()


def master_killed(options: dict[str, Any]) -> dict[str, Any]:
    """The master hung (SIGSTOP: calls block) then killed mid-run: requests cost a miss within
    the deadline (host C, deadlines of ``deadline_s``) or at once (host B); restarted, the daemons
    reconnect by themselves and a new prefix goes across again."""
    deadline_s = str(options.get("deadline_s", 0.3))
    master = Master().start()
    a, b = remote_daemon(extra_args=ALWAYS).start(), remote_daemon(extra_args=ALWAYS).start()
    c = remote_daemon(extra_args=ALWAYS, deadlines=("--remote-exist-timeout", deadline_s,
                                                    "--remote-get-timeout", deadline_s)).start()
    work = tempfile.mkdtemp(prefix="kvt-remote-")
    try:
        for daemon in (a, b, c):
            wait_for(daemon, connected, "connected to the store")
        _save_on(a, os.path.join(work, "first.pt"), seed=11)
        stop_process(master.proc.pid)
        hung = engine(c, "restore", os.path.join(work, "first.pt"), 3)
        hung_remote = status(c)["daemon"]["remote"]
        master.kill()
        killed = engine(b, "restore", os.path.join(work, "first.pt"), 3)
        killed_remote = status(b)["daemon"]["remote"]
        master = Master().start()
        reconnect_started = time.monotonic()
        for daemon in (a, b):
            wait_for(daemon, connected, "reconnected to the restarted master", timeout_s=60.0)
        reconnect_s = time.monotonic() - reconnect_started
        _save_on(a, os.path.join(work, "second.pt"), seed=12)
        after = engine(b, "restore", os.path.join(work, "second.pt"), 4)
        return {"deadline_s": float(deadline_s), "hung": hung, "hung_remote": hung_remote, "killed": killed,
                "killed_remote": killed_remote, "reconnect_s": reconnect_s, "after": after}
    finally:
        for daemon in (a, b, c):
            daemon.cleanup()
        master.cleanup()


def contributor_killed(options: dict[str, Any]) -> dict[str, Any]:
    """Host A lends the store all its memory and is SIGKILLed: B serves no wrong byte (misses,
    within the deadline); a new daemon on A's host lends memory again and prefixes go across."""
    master = Master(client_ttl_s=2).start()
    a = remote_daemon(segment="64MiB", extra_args=ALWAYS).start()
    b = remote_daemon(segment="0", extra_args=ALWAYS).start()
    work = tempfile.mkdtemp(prefix="kvt-remote-")
    a2 = None
    try:
        for daemon in (a, b):
            wait_for(daemon, connected, "connected to the store")
        _save_on(a, os.path.join(work, "first.pt"), seed=21)
        a.stop(9)
        during = engine(b, "restore", os.path.join(work, "first.pt"), 5)
        during_status = status(b)
        a2 = remote_daemon(segment="64MiB", extra_args=ALWAYS).start()
        wait_for(a2, connected, "the new contributor connected")
        # B's breaker may be open after the dead host's gets: it closes by itself (a probe).
        wait_for(b, connected, "B's breaker closed again", timeout_s=60.0)
        # The dead host's segment is unmounted once the master's client TTL has passed.
        deadline = time.monotonic() + 60.0
        while True:
            saved = engine(a2, "backup", os.path.join(work, "second.pt"), 22)
            snapshot = wait_for(a2, writes_done, "write-through done")
            if _metrics(snapshot).get("remote_pages_written", 0) >= saved["pages"] or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        after = engine(b, "restore", os.path.join(work, "second.pt"), 6)
        return {"during": during, "during_remote": during_status["daemon"]["remote"], "after": after,
                "during_metrics": {k: v for k, v in _metrics(during_status).items() if "r2h" in k or "remote" in k},
                "b_checksum_mismatches": _metrics(status(b)).get("remote_checksum_mismatches", 0)}
    finally:
        for daemon in (a, b) + ((a2,) if a2 else ()):
            daemon.cleanup()
        master.cleanup()


def decision(options: dict[str, Any]) -> dict[str, Any]:
    """Priced like every tier: B (policy cost) declines the store where its prior makes a remote
    read slower than recompute, and takes it where the read is cheaper."""
    master = Master().start()
    a = remote_daemon(extra_args=ALWAYS).start()
    slow = remote_daemon(extra_args=("--prior-remote-gibps", "0.00001", "--prior-recompute-us", "50")).start()
    fast = remote_daemon(extra_args=("--prior-remote-gibps", "10", "--prior-recompute-us", "50")).start()
    state = os.path.join(tempfile.mkdtemp(prefix="kvt-remote-"), "saved.pt")
    try:
        for daemon in (a, slow, fast):
            wait_for(daemon, connected, "connected to the store")
        _save_on(a, state, seed=31)
        declined = engine(slow, "lookup", state, 0, "--policy", "cost")
        taken = engine(fast, "lookup", state, 0, "--policy", "cost")
        slow_status = status(slow)
        return {"declined": declined, "taken": taken,
                "slow_get_calls": _metrics(slow_status).get("remote_get_calls", 0),
                "slow_decisions": slow_status["cost_model"]["engines"][0]["decisions_total"],
                "slow_skips": slow_status["cost_model"]["engines"][0]["policy_skips_total"]}
    finally:
        for daemon in (a, slow, fast):
            daemon.cleanup()
        master.cleanup()


def router_lookup(options: dict[str, Any]) -> dict[str, Any]:
    """X on host A saves; B's daemon, whose namespace of that model an engine opened and left
    without loading anything, answers a router's POST /lookup of each saved prefix."""
    import urllib.request

    import torch

    from engine_client.client import connect
    from kvcached.testing.engine_proc import GEOMETRY

    master = Master().start()
    a, b = remote_daemon().start(), remote_daemon(extra_args=("--http", "127.0.0.1:0")).start()
    state = os.path.join(tempfile.mkdtemp(prefix="kvt-remote-"), "saved.pt")
    try:
        for daemon in (a, b):
            wait_for(daemon, connected, "connected to the store")
        saved = _save_on(a, state, seed=int(options.get("seed", 1)))
        with connect(b.socket_path, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
        before = status(b)
        answers = []
        for prefix in torch.load(state, weights_only=False):
            body = json.dumps({"model": GEOMETRY.model_id, "token_ids": prefix["tokens"].tolist()}).encode()
            request = urllib.request.Request(f"{b.http_url()}/lookup", data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                [entry] = json.loads(response.read())["namespaces"]
            answers.append({"tokens": len(prefix["tokens"]), "hit_tokens": entry["hit_tokens"]})
        after = status(b)
        return {"saved": saved, "answers": answers,
                "b_metrics_before": _metrics(before), "b_metrics_after": _metrics(after)}
    finally:
        for daemon in (a, b):
            daemon.cleanup()
        master.cleanup()


SCENARIOS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "router_lookup": router_lookup,
    "restore_across_hosts": restore_across_hosts,
    "master_killed": master_killed,
    "contributor_killed": contributor_killed,
    "decision": decision,
}


def main() -> int:
    name = sys.argv[1]
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    print(json.dumps(SCENARIOS[name](options)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
