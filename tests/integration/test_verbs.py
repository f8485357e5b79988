"""Protocol 2's verbs over the wire, a real daemon and real clients: LOOKUP changes nothing in the
tree, and ACQUIRE reserves pages only for a request that saves."""

from __future__ import annotations

import numpy as np
import pytest

from engine_client.client import connect
from kvcached.testing.daemon_proc import DaemonProcess
from proto.messages import KVGeometry

GEOMETRY = KVGeometry("verbs-model", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", page_size=16)
L2_PAGES = 256                 # 2 MiB of 8 KiB pages
PREFIX_PAGES = 120             # two prefixes leave 16 pages free


@pytest.fixture
def client():
    """An engine of a daemon whose L2 holds L2_PAGES pages and that has no L3 (nothing can be
    promoted, so a lookup with prefetch has nothing to start either)."""
    daemon = DaemonProcess(l2_size="2MiB", extra_args=("--l3-size", "0")).start()
    try:
        with connect(daemon.socket_path, timeout_s=5.0, client_name="verbs") as engine:
            info = engine.attach(GEOMETRY)
            assert info.num_pages == L2_PAGES
            yield engine
    finally:
        daemon.cleanup()


def committed(client, rng, num_pages: int) -> np.ndarray:
    tokens = rng.integers(1, 2**31 - 1, size=num_pages * GEOMETRY.page_size, dtype=np.int32)
    reply = client.acquire(tokens, save=True)
    assert len(reply.reserved_page_ids) == num_pages, reply
    client.commit(reply.lease_id, reply.reserved_page_ids)
    assert client.flush() == []
    return tokens


def tree_facts(client) -> dict:
    """What a request could change in the daemon: its leases, each tier's pages by state, the tree's
    shape (its node count), and every counter but the lookups' own (``lookup*``) and the cost model's
    count of decisions."""
    status = client.status(check_integrity=True)
    assert status["integrity"] == "ok"
    metrics = {name: value for name, value in status["metrics"].items() if not name.startswith("lookup")}
    namespace = status["namespaces"][0]
    return {"leases": status["leases"], "tiers": namespace["tiers"], "tree_nodes": namespace["tree_nodes"],
            "metrics": metrics}


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_a_lookup_changes_nothing_in_the_tree(client, rng, prefetch):
    """Lookups of the older of two cached prefixes (whole, longer than cached, and a part of it)
    leave the leases, the pages of each tier, the tree's nodes (a hit ending inside an edge does not
    split it) and the counters as they were, and the LRU order too:
    a save that must evict then evicts the older prefix's pages, not the newer one's. (An acquire of it instead
    would have made it the newer: see test_an_acquire_touches_what_it_hits.)"""
    older = committed(client, rng, PREFIX_PAGES)
    newer = committed(client, rng, PREFIX_PAGES)
    before = tree_facts(client)
    longer = np.concatenate([older, rng.integers(1, 2**31 - 1, size=4 * GEOMETRY.page_size, dtype=np.int32)])
    for tokens in (older, longer, older[: 7 * GEOMETRY.page_size]):
        for _ in range(3):
            reply = client.lookup(tokens, prefetch=prefetch)
            assert reply.hit_tokens["l2"] == min(len(tokens), len(older)), reply.hit_tokens
    assert tree_facts(client) == before
    committed(client, rng, 32)                  # 16 pages free: at least 16 evicted
    assert client.lookup(older).hit_tokens["l2"] < len(older)
    assert client.lookup(newer).hit_tokens["l2"] == len(newer)


def test_an_acquire_touches_what_it_hits(client, rng):
    """The control of the test above: an acquire of the older prefix (its lease then released)
    makes it the more recently used, so the same save evicts the other prefix's pages."""
    older = committed(client, rng, PREFIX_PAGES)
    newer = committed(client, rng, PREFIX_PAGES)
    client.release(client.acquire(older).lease_id)
    assert client.flush() == []
    committed(client, rng, 32)
    assert client.lookup(older).hit_tokens["l2"] == len(older)
    assert client.lookup(newer).hit_tokens["l2"] < len(newer)


@pytest.mark.parametrize("promote", ["none", "recompute", "wait"])
def test_an_acquire_without_save_reserves_nothing(client, rng, promote):
    """An acquire without save, whatever it promotes, of a prefix partly cached: its lease locks
    the hit and holds no reserved pages (none in the reply, none private in L2, free pages as
    before); of a prefix not cached at all, no lease is granted."""
    cached = committed(client, rng, 6)
    tokens = np.concatenate([cached, rng.integers(1, 2**31 - 1, size=5 * GEOMETRY.page_size, dtype=np.int32)])
    free_before = tree_facts(client)["tiers"]["l2"]["free_pages"]
    reply = client.acquire(tokens, promote=promote)
    assert reply.lease_id is not None and len(reply.host_page_ids) == 6, reply
    assert reply.reserved_page_ids == [] and reply.reserved_start_token == len(cached), reply
    l2 = tree_facts(client)["tiers"]["l2"]
    assert (l2["private_pages"], l2["free_pages"], l2["protected_pages"]) == (0, free_before, 6), l2
    client.release(reply.lease_id)
    miss = client.acquire(rng.integers(1, 2**31 - 1, size=3 * GEOMETRY.page_size, dtype=np.int32), promote=promote)
    assert (miss.lease_id, miss.host_page_ids, miss.reserved_page_ids) == (None, [], []), miss
    assert client.flush() == []
    assert tree_facts(client)["leases"] == 0
