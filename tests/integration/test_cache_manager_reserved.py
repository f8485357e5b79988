"""The cache manager with pages reserved ahead (reserve_ahead_pages), against a real daemon:
backups need no round trip, restores of the manager's own backups start from its hints before
the match reply, and whatever the daemon did meanwhile, restored pages are the backed-up ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_client.cache_manager import CacheManager
from engine_client.client import connect
from tests.integration.daemon_proc import DaemonProcess
from tests.integration.engine_proc import GEOMETRY

PAGE = GEOMETRY.page_size
CHUNK = 32


@pytest.fixture
def daemon():
    # No L3: a prefix evicted from L2 is gone (it would come back by promotion otherwise).
    process = DaemonProcess(extra_args=("--l3-size", "0")).start()
    yield process
    process.cleanup()


@pytest.fixture
def make_manager(daemon):
    managers = []

    def build(name: str, reserve_ahead_pages: int = CHUNK) -> CacheManager:
        client = connect(daemon.socket_path, timeout_s=5.0, client_name=name)
        managers.append(CacheManager.attach(client, GEOMETRY, num_l1_pages=64, device="cpu",
                                            reserve_ahead_pages=reserve_ahead_pages))
        return managers[-1]

    yield build
    for manager in managers:
        manager.close()


def random_tokens(rng, num_tokens: int) -> np.ndarray:
    return rng.integers(0, 150_000, size=num_tokens, dtype=np.int32)


def prefill(manager: CacheManager, plan, seed: int) -> None:
    """Random KV into the plan's new pages, as a prefill would write."""
    kv = manager.l1_pool.kv
    generator = torch.Generator().manual_seed(seed)
    for page in plan.new_l1_page_ids:
        kv[:, :, page] = torch.randn(kv[:, :, page].shape, generator=generator).to(kv.dtype)


def prefill_and_finish(manager: CacheManager, tokens: np.ndarray, seed: int) -> torch.Tensor:
    """prepare, write random KV into the new pages (the prefill), finish; returns the KV of the
    request's full pages."""
    plan = manager.prepare(tokens)
    prefill(manager, plan, seed)
    full = len(tokens) // PAGE
    pages = (plan.l1_page_ids + plan.new_l1_page_ids)[:full]
    expected = manager.read_tokens_kv(pages)
    manager.finish(plan)
    return expected


def forget_l1(manager: CacheManager) -> None:
    manager.l1_pool.free(manager.l1_index.evict(manager.l1_index.num_cached_pages))


def assert_daemon_sound(manager: CacheManager) -> dict:
    assert manager.client.flush() == []
    status = manager.client.status(check_integrity=True)
    assert status["integrity"] == "ok"
    return status


def test_backups_into_reserved_pages_restore_speculatively_and_exactly(make_manager):
    """A prefix backed up into reserved pages (no reservation in the match, none held through the
    prefill), then dropped from L1, comes back through a speculative restore that the reply
    confirms, bit for bit; an extension of it is committed below the locked hit and comes back
    the same way."""
    rng = np.random.default_rng()
    manager = make_manager("a")
    tokens = random_tokens(rng, 6 * PAGE + 5)
    plan = manager.prepare(tokens)
    assert plan.lease_id is None and plan.backup_page_ids == []     # nothing reserved by the match
    manager.abort(plan)
    expected = prefill_and_finish(manager, tokens, seed=1)
    status = assert_daemon_sound(manager)
    assert status["leases"] == 1                   # the standing reservation only
    assert status["namespaces"][0]["tiers"]["l2"]["owned_pages"] == 6
    manager.check_integrity()

    forget_l1(manager)
    plan = manager.prepare(tokens, backup=False)
    assert plan.restored_tokens == 6 * PAGE
    assert manager.counters["speculative_restores_confirmed"] == 1
    assert torch.equal(manager.read_tokens_kv(plan.l1_page_ids), expected)
    manager.finish(plan)

    # An extension: the L2 hit (6 pages) stays leased until its 3 new pages are committed below it.
    longer = np.concatenate([tokens[: 6 * PAGE], random_tokens(rng, 3 * PAGE)])
    forget_l1(manager)
    plan = manager.prepare(longer)              # the backed-up 6 pages: found by prefix, read early
    assert plan.lease_id is not None and plan.l2_hit_tokens == plan.restored_tokens == 6 * PAGE
    assert manager.counters["speculative_restores_confirmed"] == 2
    prefill(manager, plan, seed=6)
    extended = manager.read_tokens_kv(plan.l1_page_ids + plan.new_l1_page_ids)
    assert manager.finish(plan) == 3
    status = assert_daemon_sound(manager)
    assert status["leases"] == 1 and status["namespaces"][0]["tiers"]["l2"]["owned_pages"] == 9
    forget_l1(manager)
    plan = manager.prepare(longer, backup=False)
    assert plan.restored_tokens == 9 * PAGE
    assert manager.counters["speculative_restores_confirmed"] == 3
    assert torch.equal(manager.read_tokens_kv(plan.l1_page_ids), extended)
    manager.finish(plan)
    manager.check_integrity()


def test_an_l2_hit_longer_than_the_hint_is_restored_whole(make_manager):
    """The manager backed up 6 pages; another engine extended them by 3: the restore of all 9
    reads the manager's 6 early, the reply proves them, and the other 3 follow from the reply."""
    rng = np.random.default_rng()
    a, b = make_manager("a"), make_manager("b", reserve_ahead_pages=0)
    head = random_tokens(rng, 6 * PAGE)
    prefill_and_finish(a, head, seed=4)
    assert a.client.flush() == []          # a's commit is handled, so b's match sees it
    whole = np.concatenate([head, random_tokens(rng, 3 * PAGE)])
    expected = prefill_and_finish(b, whole, seed=5)          # b restores the 6 from L2, adds 3
    assert b.client.flush() == []          # b's commit is handled, so a's match sees it
    forget_l1(a)
    plan = a.prepare(whole, backup=False)
    assert plan.l2_hit_tokens == plan.restored_tokens == 9 * PAGE
    assert a.counters["speculative_restores_confirmed"] == 1
    assert torch.equal(a.read_tokens_kv(plan.l1_page_ids), expected)
    a.finish(plan)
    a.check_integrity()
    assert_daemon_sound(a)


def test_a_stale_hint_is_redone_from_the_reply_and_exact(make_manager):
    """Another engine's backups evict the prefix from L2 and reuse its pages; the first engine backs
    the prefix up again (other pages), but restores from its old hint: the reply disproves it, the
    restore is redone from the pages the reply names, and the pages are exact."""
    rng = np.random.default_rng()
    a, b = make_manager("a"), make_manager("b", reserve_ahead_pages=0)
    tokens = random_tokens(rng, 4 * PAGE)
    expected = prefill_and_finish(a, tokens, seed=2)
    stale = a.hints.get(tokens)
    num_l2_pages = a.client.info.num_pages
    for seed in range(2 * num_l2_pages // 8):              # b fills L2 over and over
        prefill_and_finish(b, random_tokens(rng, 8 * PAGE), seed=100 + seed)
        forget_l1(b)
    assert_daemon_sound(a)
    # a backs the same prefix up again, with the same KV bits (it still has them in L1).
    plan = a.prepare(tokens)
    assert plan.l1_hit_tokens == 4 * PAGE and plan.l2_hit_tokens == 0
    a.finish(plan)
    assert a.hints.get(tokens) != stale
    a.hints.record(tokens, *stale)                           # as if a had never backed it up again
    forget_l1(a)
    plan = a.prepare(tokens, backup=False)
    assert plan.restored_tokens == 4 * PAGE
    assert a.counters["speculative_restores_redone"] == 1
    assert torch.equal(a.read_tokens_kv(plan.l1_page_ids), expected)
    a.finish(plan)
    a.check_integrity()
    assert_daemon_sound(a)


def test_a_backup_larger_than_a_chunk_is_skipped_and_close_gives_everything_back(make_manager, daemon):
    rng = np.random.default_rng()
    manager = make_manager("a", reserve_ahead_pages=4)
    prefill_and_finish(manager, random_tokens(rng, 6 * PAGE), seed=3)
    assert manager.counters["backups_without_reserved_pages"] == 1
    status = assert_daemon_sound(manager)
    assert status["namespaces"][0]["tiers"]["l2"]["owned_pages"] == 0
    manager.close()
    with connect(daemon.socket_path, timeout_s=5.0) as observer:
        status = observer.status(check_integrity=True)
    assert status["integrity"] == "ok" and status["leases"] == 0
    assert status["namespaces"][0]["tiers"]["l2"]["private_pages"] == 0
