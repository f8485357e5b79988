"""Admission hints (proto.hints, kvcached.core.hints, engine_client.hints): what the daemon
publishes for an engine to predict a decline without a round trip, and what the engine reads from it."""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np
import pytest

from engine_client.hints import HintsView
from kvcached.core.cost_model import CostModel, CostPriors
from kvcached.core.daemon import DaemonState
from kvcached.core.hints import AdmissionHints
from kvcached.core.tiers import Tier
from kvcached.core.tree import PrefixTree
from proto import hints
from proto.hints import NEVER
from proto.messages import KVGeometry
from proto.schema import Acquire, Commit

PAGE = 4
BUCKETS = 64            # few buckets: collisions happen, and must be counted right


def recount(tree: PrefixTree, num_buckets: int) -> np.ndarray:
    counts = np.zeros(num_buckets, dtype=np.int64)
    for key, child in tree.root.children.items():
        if child.is_resident(Tier.L2):
            counts[hints.bucket(key, num_buckets)] += 1
    return counts


def test_the_published_first_pages_follow_every_change_of_l2_residency(rng):
    """Random inserts (sharing first pages and longer prefixes, so that nodes split), evictions,
    discards from a page and discards of page sets: after each, the published count per bucket
    equals a recount of the tree's root children resident in L2, and L3-only changes move none."""
    published = AdmissionHints(1, num_buckets=BUCKETS)
    slot = published.assign(7)
    tree = PrefixTree(PAGE, on_l2_root=lambda key, delta: published.l2_root(slot, key, delta))
    firsts = [rng.integers(0, 1000, size=PAGE, dtype=np.int32) for _ in range(6)]
    paths: list[np.ndarray] = []
    next_page = {Tier.L2: 0, Tier.L3: 0}
    most, last, fell = 0, 0, False
    for step in range(400):
        op = rng.choice(["insert", "insert", "evict", "discard", "discard_pages"])
        tier = Tier.L2 if rng.random() < 0.75 else Tier.L3
        if op == "insert" or not paths:
            num_pages = int(rng.integers(1, 6))
            tokens = np.concatenate([firsts[int(rng.integers(len(firsts)))],
                                     rng.integers(0, 3, size=(num_pages - 1) * PAGE, dtype=np.int32)])
            paths.append(tokens)
            resident = tree.match(tokens, touch=False).hit_tokens[tier] // PAGE
            ids = list(range(next_page[tier], next_page[tier] + num_pages - resident))
            next_page[tier] += len(ids)
            tree.insert(tokens, tier, ids, start_page=resident)
        elif op == "evict":
            tree.evict(tier, int(rng.integers(1, 4)))
        elif op == "discard":
            path = paths[int(rng.integers(len(paths)))]
            tree.discard(path, tier, int(rng.integers(0, len(path) // PAGE)))
        else:
            owned = tree.resident_pages(tier).page_ids
            if len(owned):
                tree.discard_pages(tier, rng.choice(owned, size=min(2, len(owned)), replace=False).tolist())
        assert np.array_equal(published.l2_roots(slot), recount(tree, BUCKETS)), f"step {step}: {op} in {tier}"
        total = int(published.l2_roots(slot).sum())
        most, fell = max(most, total), fell or total < last
        last = total
    assert most >= 3 and fell, (most, fell)      # paths entered L2 and left it


def test_the_least_winning_l3_restore_bounds_the_decisions(rng):
    """For random priors and prefill samples: every L3-only hit of fewer tokens than the published
    bound is declined, one token past it is restored, and where there is no bound no length wins."""
    bounded = 0
    for trial in range(200):
        priors = CostPriors(recompute_s_per_token=float(rng.uniform(5e-6, 200e-6)),
                            host_bytes_per_s=float(rng.uniform(1, 30)) * 2**30,
                            storage_bytes_per_s=float(rng.uniform(0.2, 10)) * 2**30,
                            margin=float(rng.uniform(1.0, 1.5)))
        model = CostModel(priors)
        for _ in range(int(rng.integers(0, 4))):       # fixed terms and slopes learned from samples
            model.add_storage_sample("s2h", int(rng.integers(1, 1 << 24)), float(rng.uniform(0, 0.05)))
            model.add_engine_sample(0, "h2d", int(rng.integers(1, 1 << 24)), float(rng.uniform(0, 0.01)))
            num_tokens = int(rng.integers(16, 8192))
            model.add_engine_sample(0, "prefill", num_tokens, num_tokens * float(rng.uniform(5e-6, 200e-6)))
        bytes_per_token = int(rng.integers(1 << 10, 1 << 18))
        least = model.l3_min_tokens(0, bytes_per_token)
        local = int(rng.integers(0, 64))
        if least is None:
            for n in (1, 1000, 1 << 20):
                assert model.decide(0, bytes_per_token, local, 0, local + n).choice == "recompute", trial
            continue
        bounded += 1
        for n in {1, max(1, least // 2), least}:
            if 1 <= n <= least:
                assert model.decide(0, bytes_per_token, local, 0, local + n).choice == "recompute", (trial, n, least)
        assert model.decide(0, bytes_per_token, 0, 0, least + 1).choice == "l3", (trial, least)
    assert 20 < bounded < 180, bounded


@pytest.fixture
def hints_file():
    """A hints file of 2 slots written through a real shared mapping, and a reader's path to it."""
    fd, path = tempfile.mkstemp(prefix="kvh-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    size = hints.file_bytes(2, BUCKETS)
    os.ftruncate(fd, size)
    mapping = mmap.mmap(fd, size)
    os.close(fd)
    published = AdmissionHints(2, mapping, num_buckets=BUCKETS)
    yield published, path
    published.close()
    mapping.close()
    os.unlink(path)


def test_a_reader_predicts_recompute_only_where_the_daemon_would_decline(hints_file, rng):
    """The engine's view of its slot: recompute is predicted for a first page L2 does not hold,
    under cost with no long-enough L3 restore, and always under never; not under always, not where
    the first page's bucket is held, not past the L3 bound, not with another peer registered
    (for a registered reader), and not once the slot is another namespace's."""
    published, path = hints_file
    slot = published.assign(3)
    published.set_l3_min_tokens(slot, 64)
    view = HintsView.open(path, published.offset(slot), namespace_id=3)
    page = rng.integers(0, 1 << 20, size=PAGE, dtype="<i4").tobytes()
    assert view.predicts_recompute(page, 60, promote_l3=True, policy="")
    assert not view.predicts_recompute(page, 64, promote_l3=True, policy="")
    assert view.predicts_recompute(page, 64, promote_l3=False, policy="")
    assert not view.predicts_recompute(page, 4, promote_l3=True, policy="always")
    assert view.predicts_recompute(page, 1 << 20, promote_l3=True, policy="never")
    published.set_policy("always")
    assert not view.predicts_recompute(page, 4, promote_l3=True, policy="")
    assert view.predicts_recompute(page, 4, promote_l3=True, policy="cost")
    published.set_policy("cost")
    published.set_peers(slot, 2)
    assert view.predicts_recompute(page, 4, promote_l3=True, policy="", peer_registered=False)
    assert not view.predicts_recompute(page, 4, promote_l3=True, policy="", peer_registered=True)
    published.set_peers(slot, 1)                    # the reader's own registration
    assert view.predicts_recompute(page, 4, promote_l3=True, policy="", peer_registered=True)
    published.l2_root(slot, page, 1)
    assert not view.predicts_recompute(page, 4, promote_l3=True, policy="")
    published.l2_root(slot, page, -1)
    published.set_l3_min_tokens(slot, NEVER * 4)
    assert view.predicts_recompute(page, 1 << 40, promote_l3=True, policy="")
    published.release(slot)
    assert not view.predicts_recompute(page, 4, promote_l3=True, policy="")
    other = published.assign(9)                     # the slot reused by another namespace
    assert other == slot and not view.predicts_recompute(page, 4, promote_l3=True, policy="")
    view.close()


def test_a_reader_refuses_a_file_that_is_not_hints_or_a_slot_outside_it(hints_file, tmp_path):
    published, path = hints_file
    with pytest.raises(ValueError, match="no slot at offset"):
        HintsView.open(path, published.offset(1) + 8, namespace_id=0)
    with pytest.raises(ValueError, match="no slot at offset"):
        HintsView.open(path, published.offset(2), namespace_id=0)
    other = tmp_path / "other"
    other.write_bytes(os.urandom(hints.file_bytes(2, BUCKETS)))
    with pytest.raises(ValueError, match="not an admission hints file"):
        HintsView.open(str(other), published.offset(0), namespace_id=0)


def geometry(model_id: str) -> KVGeometry:
    return KVGeometry(model_id=model_id, num_layers=2, num_kv_heads=2, head_dim=8, page_size=PAGE, dtype="float16")


def test_the_daemon_state_keeps_one_slot_per_namespace_and_publishes_its_l3_bound(rng):
    """Each namespace gets a slot tagged with it; a reclaimed one's slot is freed and taken by the
    next; prefill samples move the published L3 bound; a namespace with no L3 publishes NEVER;
    the integrity check compares the published first pages with the tree."""
    state = DaemonState(1 << 22, max_namespaces=2, session_timeout_s=5.0, l3_bytes=1 << 22)
    a_session, a = state.attach(geometry("a"), pid=1)
    b_session, b = state.attach(geometry("b"), pid=1)
    assert {a.hints_slot, b.hints_slot} == {0, 1}
    assert state.hints.head(a.hints_slot)["tag"] == a.namespace_id + 1
    before = state.hints.head(a.hints_slot)["l3_min_tokens"]
    state.engine_report(a_session.session_id, {}, [("prefill", n, n * 1e-9) for n in (100, 2000, 30000)])
    assert before < NEVER and state.hints.head(a.hints_slot)["l3_min_tokens"] == NEVER
    tokens = rng.integers(0, 1000, size=3 * PAGE, dtype="<i4")
    reply = state.acquire(Acquire(a_session.session_id, tokens.tobytes(), save=True))
    state.commit(Commit(a_session.session_id, reply.lease_id, reply.reserved_page_ids))
    assert state.hints.l2_roots(a.hints_slot)[hints.bucket(tokens[:PAGE].tobytes(), state.hints.num_buckets)] == 1
    state.check_integrity()
    state.detach(b_session.session_id)
    _, c = state.attach(geometry("c"), pid=1)      # b, idle, is reclaimed for it
    assert c.hints_slot == b.hints_slot and state.hints.head(c.hints_slot)["tag"] == c.namespace_id + 1
    state.check_integrity()

    no_l3 = DaemonState(1 << 22, max_namespaces=1, session_timeout_s=5.0)
    _, namespace = no_l3.attach(geometry("a"), pid=1)
    assert no_l3.hints.head(namespace.hints_slot)["l3_min_tokens"] == NEVER
