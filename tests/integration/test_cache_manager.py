"""The engine's cache manager against a real daemon when things go wrong: nothing leaks, requests recompute."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine_client.cache_manager import CacheManager, L1Full
from engine_client.client import connect
from engine_client.kv_transfer import KVTransfer
from proto.messages import MsgKind
from kvcached.testing.engine_proc import GEOMETRY

PAGE = GEOMETRY.page_size


@pytest.fixture
def manager(daemon):
    manager = CacheManager.attach(connect(daemon.socket_path, timeout_s=5.0, client_name="cm"), GEOMETRY,
                                  num_l1_pages=64, device="cpu")
    yield manager
    manager.close()


def random_tokens(num_tokens: int) -> np.ndarray:
    return np.random.randint(0, 150_000, size=num_tokens, dtype=np.int32)      # seeded (kvcached/testing/pytest_plugin.py)


def test_lost_session_leaks_no_l1_pages(manager):
    """When the daemon drops the session (here: detached behind the engine's back), the client
    re-attaches, and finishing and aborting the ended session's requests still frees or publishes
    every L1 page, without a save (its pages counted as skipped, session_lost) or a release sent
    for them."""
    finished, aborted = manager.prepare(random_tokens(5 * PAGE + 3)), manager.prepare(random_tokens(3 * PAGE))
    assert finished.lease_id is not None and aborted.lease_id is not None
    generation = manager.client.generation
    manager.client.request_raw(MsgKind.DETACH, {"session_id": manager.client.info.session_id})
    deadline = time.monotonic() + 20.0     # noticed at the next heartbeat, replaced once drained
    while not manager.client.is_attached(generation + 1):
        assert time.monotonic() < deadline, f"the client did not re-attach: {manager.client.connection}"
        manager.connector.poll()      # as the engine's steps do: says the ended session is drained
        time.sleep(0.02)
    assert manager.finish(finished) == 0             # no save into the ended session's pages
    manager.abort(aborted)
    manager.check_integrity()
    stats = manager.stats()
    assert stats["save_skipped_pages_session_lost"] == stats["save_skipped_pages"] == 5, stats
    assert stats.get("save_pages_queued", 0) == 0
    assert manager.l1_index.num_cached_pages == 5     # the finished request's full pages stay in L1
    assert manager.l1_pool.num_free == 64 - 5
    assert manager.client.flush() == []               # nothing was sent for the ended session


def test_failed_restore_recomputes_and_keeps_nothing_locked(manager, monkeypatch):
    """A load whose transfer fails leaves the request to recompute from L1's hit (its pages counted
    as failed, transfer_failed): no L1 page leaks, the lease ends, and the daemon's integrity holds."""
    tokens = random_tokens(6 * PAGE)
    plan = manager.prepare(tokens)
    manager.finish(plan)
    evicted = manager.l1_index.evict(manager.l1_index.num_cached_pages)   # L1 forgets it; L2 still has it
    manager.l1_pool.free(evicted)

    def broken_load(*args, **kwargs):
        raise RuntimeError("injected transfer failure")

    monkeypatch.setattr(KVTransfer, "load", broken_load)
    plan = manager.prepare(tokens, save=False)
    assert plan.l2_hit_tokens == 6 * PAGE and plan.restored_tokens == 0 and plan.num_cached_tokens == 0
    assert len(plan.new_l1_page_ids) == 6 and plan.lease_id is None
    assert manager.stats()["load_failed_pages_transfer_failed"] == 6
    manager.check_integrity()
    manager.finish(plan)
    manager.check_integrity()
    assert manager.client.flush() == []
    status = manager.client.status(check_integrity=True)
    assert status["integrity"] == "ok" and status["leases"] == 0


def test_l1_full_leaks_nothing(manager):
    """When the request needs more pages than L1 has, L1Full is raised and neither a lease (with
    reserved pages) nor any L1 page is left behind."""
    cached = random_tokens(4 * PAGE)
    manager.finish(manager.prepare(cached))
    with pytest.raises(L1Full):
        manager.prepare(np.concatenate([cached, random_tokens(70 * PAGE)]))
    manager.check_integrity()
    assert manager.l1_pool.num_free + manager.l1_index.num_cached_pages == 64
    assert manager.client.flush() == []
    status = manager.client.status(check_integrity=True)
    assert status["integrity"] == "ok" and status["leases"] == 0
