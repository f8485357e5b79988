"""Fairness in L2 over the real wire: a daemon process and two plain clients (two engines' sessions
of one model) over ipc://. Engine A reuses hot prefixes while engine B floods one-use prompts: A's
prefixes keep their hit share. The policy and its trace on the state: tests/core/test_fairness.py."""

from __future__ import annotations

import numpy as np

from engine_client.client import connect
from kvcached.testing.daemon_proc import DaemonProcess
from kvcached.testing.engine_proc import GEOMETRY

PAGE = GEOMETRY.page_size


def request(client, tokens: np.ndarray) -> int:
    """One request's match (reserving what L2 lacks) and the save of its pages; its L2 hit in tokens."""
    reply = client.acquire(tokens, save=True)
    if reply.lease_id is not None:
        if reply.reserved_page_ids:
            client.commit(reply.lease_id, reply.reserved_page_ids)
        else:
            client.release(reply.lease_id)
    return reply.hit_tokens["l2"]


def test_hot_prefixes_keep_their_hit_share_under_another_engines_one_use_flood(rng):
    """A 2 MiB L2 (256 pages): engine A reuses 8 hot 4-page prefixes, each request one of them and
    a page of its own; engine B sends 16 one-use 4-page prompts (a quarter of L2) per A request.
    After a warm-up, A's hot prefixes hit in L2 for at least 80% of its requests (LRU: about a
    quarter); the daemon's integrity check holds."""
    daemon = DaemonProcess(l2_size="2MiB", extra_args=("--l3-size", "0")).start()
    try:
        with connect(daemon.socket_path, timeout_s=5.0, client_name="hot") as a, \
                connect(daemon.socket_path, timeout_s=5.0, client_name="flood") as b:
            a.attach(GEOMETRY)
            b.attach(GEOMETRY)
            hot = [rng.integers(0, 150_000, size=4 * PAGE, dtype=np.int32) for _ in range(8)]
            hits = requests = 0
            for number in range(120):
                prefix = hot[int(rng.integers(len(hot)))]
                own_page = rng.integers(0, 150_000, size=PAGE, dtype=np.int32)
                hit = request(a, np.concatenate([prefix, own_page])) >= len(prefix)
                if number >= 40:
                    requests += 1
                    hits += hit
                for _ in range(16):
                    request(b, rng.integers(0, 150_000, size=4 * PAGE, dtype=np.int32))
            assert a.flush() == [] and b.flush() == []
            assert a.status(check_integrity=True)["integrity"] == "ok"
        assert hits >= 0.8 * requests, (hits, requests)
    finally:
        daemon.stop()
        daemon.cleanup()
