"""PrefixTree: per-tier residency, splitting, LRU eviction per tier, locks, dedup, integrity."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from kvcached.core.allocator import PageAllocator
from kvcached.core.tiers import IntegrityError, Tier
from kvcached.core.tree import PrefixTree

PAGE = 4
L2, L3 = Tier.L2, Tier.L3


def _tree() -> PrefixTree:
    """A tree on a fake clock that ticks once per call, so LRU order is exact."""
    ticks = itertools.count(1)
    return PrefixTree(PAGE, clock=lambda: float(next(ticks)))


def _tokens(rng: np.random.Generator, num_pages: int) -> np.ndarray:
    return rng.integers(1, 150_000, num_pages * PAGE, dtype=np.int32)


def _page_ids(rng: np.random.Generator, n: int, low: int = 0) -> list[int]:
    """n distinct random page ids (never 0..n-1, so an off-by-one shows)."""
    return [int(p) for p in rng.choice(np.arange(low + 100, low + 100_000), n, replace=False)]


def test_match_on_empty_tree_and_page_alignment(rng):
    """Matching hits nothing in an empty tree; hits are aligned down to whole pages."""
    tree = _tree()
    tokens = _tokens(rng, 5)
    empty = tree.match(tokens)
    assert empty.hit_tokens == {L2: 0, L3: 0} and empty.matched_tokens == 0
    assert empty.last_node == {L2: None, L3: None}
    tree.check_integrity()

    l2_page_ids = _page_ids(rng, 5)
    tree.insert(tokens, L2, l2_page_ids)
    tree.check_integrity()
    # 4 whole pages and 3 tokens of the fifth page: only 4 pages can hit.
    result = tree.match(tokens[:4 * PAGE + 3])
    assert result.hit_tokens == {L2: 4 * PAGE, L3: 0}
    assert result.page_ids[L2] == l2_page_ids[:4]
    assert result.matched_tokens == 4 * PAGE
    tree.check_integrity()


def test_tiers_hit_independently(rng):
    """A prefix resident in L2 for 3 pages and in L3 for 6 pages hits 3 and 6 pages respectively."""
    tree = _tree()
    tokens = _tokens(rng, 6)
    l3_page_ids = _page_ids(rng, 6)
    l2_page_ids = _page_ids(rng, 3)
    tree.insert(tokens, L3, l3_page_ids)
    tree.insert(tokens[:3 * PAGE], L2, l2_page_ids)
    tree.check_integrity()
    result = tree.match(tokens)
    assert result.hit_tokens == {L2: 3 * PAGE, L3: 6 * PAGE}
    assert result.page_ids == {L2: l2_page_ids, L3: l3_page_ids}
    assert result.matched_tokens == 6 * PAGE
    assert result.last_node[L2] is not result.last_node[L3]
    tree.check_integrity()


def test_a_match_without_split_counts_a_partial_edge_and_leaves_the_shape(rng):
    """split=False (what a lookup asks): a hit ending inside an edge counts that edge's matching
    pages in each tier, the same hit and page ids a splitting match finds, with no node added; the
    deepest whole node is the last node (none here: the only node is the partial one)."""
    tree = _tree()
    tokens = _tokens(rng, 6)
    l2_page_ids, l3_page_ids = _page_ids(rng, 6), _page_ids(rng, 6, low=200_000)
    tree.insert(tokens, L2, l2_page_ids)
    tree.insert(tokens, L3, l3_page_ids)
    for query in (tokens[:4 * PAGE], np.concatenate([tokens[:4 * PAGE], _tokens(rng, 1)])):
        peeked = tree.match(query, touch=False, split=False)
        assert tree.num_nodes == 1
        assert peeked.hit_tokens == {L2: 4 * PAGE, L3: 4 * PAGE}
        assert peeked.page_ids == {L2: l2_page_ids[:4], L3: l3_page_ids[:4]}
        assert peeked.last_node == {L2: None, L3: None}
        tree.check_integrity()
    split = tree.match(tokens[:4 * PAGE], touch=False)
    assert tree.num_nodes == 2 and split.page_ids == peeked.page_ids
    tree.check_integrity()


def test_split_on_partial_match_keeps_every_tier(rng):
    """A match ending inside a node splits it; each tier's pages and locks survive on both halves."""
    tree = _tree()
    tokens = _tokens(rng, 6)
    l2_page_ids, l3_page_ids = _page_ids(rng, 6), _page_ids(rng, 6, low=200_000)
    deepest = tree.insert(tokens, L2, l2_page_ids).last_node
    tree.insert(tokens, L3, l3_page_ids)
    tree.lock(deepest, L2)
    assert tree.num_nodes == 1
    tree.check_integrity()

    # Same first 4 pages, then a different fifth page.
    query = np.concatenate([tokens[:4 * PAGE], _tokens(rng, 1)])
    result = tree.match(query)
    assert tree.num_nodes == 2
    assert result.hit_tokens == {L2: 4 * PAGE, L3: 4 * PAGE}
    assert result.page_ids == {L2: l2_page_ids[:4], L3: l3_page_ids[:4]}
    upper = result.last_node[L2]
    assert upper is result.last_node[L3] and upper.num_pages == 4
    assert upper.ref_count[L2] == 1 and deepest.ref_count[L2] == 1
    assert deepest.parent is upper and deepest.num_pages == 2
    assert tree.protected_pages(L2) == 6
    tree.check_integrity()

    full = tree.match(tokens)
    assert full.page_ids == {L2: l2_page_ids, L3: l3_page_ids}
    assert full.last_node[L2] is deepest
    # The lock taken before the split is released through the same node object.
    tree.unlock(deepest, L2)
    assert upper.ref_count[L2] == 0 and tree.protected_pages(L2) == 0
    tree.check_integrity()


def test_divergent_inserts_share_the_common_prefix(rng):
    """Two sequences sharing 3 pages give one shared node and two branches, each matching its own pages."""
    tree = _tree()
    first = _tokens(rng, 5)
    second = np.concatenate([first[:3 * PAGE], _tokens(rng, 4)])
    first_page_ids = _page_ids(rng, 5)
    tree.insert(first, L2, first_page_ids)
    second_page_ids = _page_ids(rng, 4, low=200_000)
    result = tree.insert(second, L2, second_page_ids, start_page=3)
    assert result.new_pages == 4 and result.duplicate_page_ids == []
    assert tree.num_nodes == 3
    tree.check_integrity()
    assert tree.match(first).page_ids[L2] == first_page_ids
    assert tree.match(second).page_ids[L2] == first_page_ids[:3] + second_page_ids
    tree.check_integrity()


def test_evict_one_tier_keeps_the_other(rng):
    """Evicting L2 clears only L2 residency; the node leaves the tree only once L3 is evicted too."""
    tree = _tree()
    tokens = _tokens(rng, 4)
    l2_page_ids, l3_page_ids = _page_ids(rng, 4), _page_ids(rng, 4, low=200_000)
    tree.insert(tokens, L2, l2_page_ids)
    tree.insert(tokens, L3, l3_page_ids)
    tree.check_integrity()

    assert sorted(tree.evict(L2, 1)) == sorted(l2_page_ids)
    tree.check_integrity()
    assert tree.num_nodes == 1 and tree.owned_pages(L2) == 0
    result = tree.match(tokens)
    assert result.hit_tokens == {L2: 0, L3: 4 * PAGE}
    assert result.page_ids[L3] == l3_page_ids

    assert sorted(tree.evict(L3, 4)) == sorted(l3_page_ids)
    assert tree.num_nodes == 0
    assert tree.match(tokens).matched_tokens == 0
    tree.check_integrity()


def test_eviction_is_lru_per_tier(rng):
    """Each tier evicts its own least recently used leaf; a match refreshes recency."""
    tree = _tree()
    sequences = [_tokens(rng, 2) for _ in range(3)]
    page_ids = {tier: [_page_ids(rng, 2, low=i * 1_000_000 + tier * 100_000) for i in range(3)]
                for tier in (L2, L3)}
    for i, tokens in enumerate(sequences):
        tree.insert(tokens, L2, page_ids[L2][i])
    for i, tokens in reversed(list(enumerate(sequences))):
        tree.insert(tokens, L3, page_ids[L3][i])
    tree.check_integrity()

    # L2 recency: 0 < 1 < 2, then sequence 0 is matched and becomes the most recent in both tiers.
    tree.match(sequences[0][:2 * PAGE])
    assert tree.evict(L2, 1) == page_ids[L2][1]
    tree.check_integrity()
    # L3 recency was 2 < 1 < 0 before the match, so L3 evicts sequence 2 first.
    assert tree.evict(L3, 1) == page_ids[L3][2]
    tree.check_integrity()
    assert tree.evict(L2, 1) == page_ids[L2][2]
    assert tree.num_nodes == 2          # sequence 2 is gone from both tiers; 0 and 1 remain
    tree.check_integrity()


def test_eviction_goes_leaves_first_and_keeps_hits_prefix_closed(rng):
    """Within a tier, children go before their parent: after each eviction the hit is still a prefix."""
    tree = _tree()
    base = _tokens(rng, 6)
    l2_page_ids = _page_ids(rng, 6)
    tree.insert(base, L2, l2_page_ids)
    # Split the path into three nodes of 2 pages each.
    tree.match(base[:2 * PAGE])
    tree.match(base[:4 * PAGE])
    assert tree.num_nodes == 3
    tree.check_integrity()
    for remaining_pages in (4, 2, 0):
        tree.evict(L2, 1)
        tree.check_integrity()
        result = tree.match(base)
        assert result.page_ids[L2] == l2_page_ids[:remaining_pages]
    assert tree.num_nodes == 0


def test_locked_nodes_are_never_evicted(rng):
    """A locked path survives evict(all); unlocking makes it evictable again."""
    tree = _tree()
    locked_tokens, other_tokens = _tokens(rng, 3), _tokens(rng, 2)
    locked_page_ids, other_page_ids = _page_ids(rng, 3), _page_ids(rng, 2, low=200_000)
    locked_node = tree.insert(locked_tokens, L2, locked_page_ids).last_node
    tree.insert(other_tokens, L2, other_page_ids)
    tree.lock(locked_node, L2)
    assert tree.protected_pages(L2) == 3 and tree.evictable_pages(L2) == 2
    tree.check_integrity()

    assert sorted(tree.evict(L2, 100)) == sorted(other_page_ids)
    assert tree.match(locked_tokens).page_ids[L2] == locked_page_ids
    assert tree.evict(L2, 100) == []
    tree.check_integrity()

    tree.unlock(locked_node, L2)
    assert tree.protected_pages(L2) == 0 and tree.evictable_pages(L2) == 3
    assert sorted(tree.evict(L2, 100)) == sorted(locked_page_ids)
    tree.check_integrity()


def test_lock_and_unlock_reject_bad_calls(rng):
    """lock() needs residency in the tier; unlock() below zero raises and changes nothing."""
    tree = _tree()
    tokens = _tokens(rng, 2)
    node = tree.insert(tokens, L3, _page_ids(rng, 2)).last_node
    with pytest.raises(ValueError):
        tree.lock(node, L2)
    with pytest.raises(ValueError):
        tree.unlock(node, L3)
    assert node.ref_count == {L2: 0, L3: 0} and tree.root.ref_count == {L2: 0, L3: 0}
    tree.lock(node, L3)
    tree.unlock(node, L3)
    with pytest.raises(ValueError):
        tree.unlock(node, L3)
    assert node.ref_count[L3] == 0 and tree.protected_pages(L3) == 0
    tree.check_integrity()


def test_insert_dedup_returns_our_duplicate_page_ids(rng):
    """Pages already resident are kept; the caller's ids for them come back as duplicates."""
    tree = _tree()
    tokens = _tokens(rng, 6)
    first_page_ids = _page_ids(rng, 4)
    tree.insert(tokens[:4 * PAGE], L2, first_page_ids)
    second_page_ids = _page_ids(rng, 6, low=200_000)
    result = tree.insert(tokens, L2, second_page_ids)
    assert result.new_pages == 2
    assert result.duplicate_page_ids == second_page_ids[:4]
    assert tree.match(tokens).page_ids[L2] == first_page_ids + second_page_ids[4:]
    assert tree.check_integrity()[L2] == set(first_page_ids + second_page_ids[4:])

    # Re-inserting a prefix that is resident and ends inside a node splits there.
    third_page_ids = _page_ids(rng, 3, low=400_000)
    result = tree.insert(tokens[:3 * PAGE], L2, third_page_ids)
    assert result.new_pages == 0 and result.duplicate_page_ids == third_page_ids
    assert result.last_node.num_pages == 3
    tree.check_integrity()


def test_insert_gains_residency_on_existing_nodes(rng):
    """Inserting into a tier a prefix the tree holds only in another tier adds residency, splitting as needed."""
    tree = _tree()
    tokens = _tokens(rng, 6)
    l3_page_ids = _page_ids(rng, 6)
    tree.insert(tokens, L3, l3_page_ids)
    l2_page_ids = _page_ids(rng, 4, low=200_000)
    result = tree.insert(tokens[:4 * PAGE], L2, l2_page_ids)
    assert result.new_pages == 4 and result.duplicate_page_ids == []
    assert tree.num_nodes == 2
    tree.check_integrity()
    hit = tree.match(tokens)
    assert hit.page_ids == {L2: l2_page_ids, L3: l3_page_ids}
    # Continue in L2 from the resident prefix: extends the lower node's residency.
    more_l2_page_ids = _page_ids(rng, 2, low=400_000)
    result = tree.insert(tokens, L2, more_l2_page_ids, start_page=4)
    assert result.new_pages == 2
    assert tree.match(tokens).page_ids[L2] == l2_page_ids + more_l2_page_ids
    tree.check_integrity()


def test_insert_without_resident_prefix_is_rejected(rng):
    """insert() with start_page beyond the tier's resident prefix raises and changes nothing."""
    tree = _tree()
    tokens = _tokens(rng, 5)
    tree.insert(tokens[:2 * PAGE], L3, _page_ids(rng, 2))
    owned_before = tree.check_integrity()
    with pytest.raises(ValueError):
        tree.insert(tokens, L2, _page_ids(rng, 3, low=200_000), start_page=2)   # resident only in L3
    with pytest.raises(ValueError):
        tree.insert(tokens, L3, _page_ids(rng, 2, low=200_000), start_page=3)   # L3 holds 2 pages
    assert tree.check_integrity() == owned_before
    assert tree.num_nodes == 1


def test_insert_rejects_page_ids_the_tree_owns(rng):
    """A page id already owned in the tier, or repeated in the call, raises and changes nothing."""
    tree = _tree()
    first, second = _tokens(rng, 2), _tokens(rng, 2)
    first_page_ids = _page_ids(rng, 2)
    tree.insert(first, L2, first_page_ids)
    owned_before = tree.check_integrity()
    with pytest.raises(ValueError):
        tree.insert(second, L2, [first_page_ids[0], 999_999])
    with pytest.raises(ValueError):
        tree.insert(second, L2, [999_999, 999_999])
    assert tree.check_integrity() == owned_before
    assert tree.num_nodes == 1
    # The same id in another tier is fine: tiers have separate page spaces.
    tree.insert(second, L3, first_page_ids)
    tree.check_integrity()


def test_discard_clears_a_page_and_everything_below_it_in_one_tier(rng):
    """discard(path, L3, k) frees the L3 ids of page k of the path and of every page below it (both
    branches), keeps pages 0..k-1 in L3, and leaves L2 residency and other paths as they were."""
    tree = _tree()
    head = _tokens(rng, 5)
    left, right, other = (np.concatenate([head, _tokens(rng, 2)]), np.concatenate([head, _tokens(rng, 3)]),
                          _tokens(rng, 3))
    l3_ids = {name: _page_ids(rng, 10, low=i * 200_000) for i, name in enumerate(("left", "right", "other"))}
    tree.insert(left, L3, l3_ids["left"][:7])
    tree.insert(right, L3, l3_ids["right"][:3], start_page=5)
    tree.insert(other, L3, l3_ids["other"][:3])
    l2_ids = _page_ids(rng, 8, low=900_000)
    tree.insert(right, L2, l2_ids)
    tree.check_integrity()

    freed = tree.discard(left, L3, 3)
    tree.check_integrity()
    assert sorted(freed) == sorted(l3_ids["left"][3:7] + l3_ids["right"][:3])
    assert tree.match(left).hit_tokens == {L2: 5 * PAGE, L3: 3 * PAGE}
    assert tree.match(right).hit_tokens == {L2: 8 * PAGE, L3: 3 * PAGE}
    assert tree.match(other).hit_tokens == {L2: 0, L3: 3 * PAGE}
    # The left branch held nothing else: it left the tree. L3 evicts what remains of the head last.
    assert tree.match(left).matched_tokens == 5 * PAGE
    assert sorted(tree.evict(L3, 100)) == sorted(l3_ids["left"][:3] + l3_ids["other"][:3])
    tree.check_integrity()


def test_discard_of_a_locked_missing_or_unmatched_page_frees_nothing(rng):
    """A page locked in the tier (or below a lock), not resident there, or off the path: discard
    returns [] and changes no residency."""
    tree = _tree()
    tokens = _tokens(rng, 6)
    ids = _page_ids(rng, 6)
    tree.insert(tokens, L3, ids)
    node = tree.match(tokens).last_node[L3]
    tree.lock(node, L3)
    assert tree.discard(tokens, L3, 2) == []
    tree.unlock(node, L3)
    assert tree.discard(tokens, L2, 0) == []
    assert tree.discard(tokens, L3, 6) == []
    diverging = tokens.copy()
    diverging[2 * PAGE] += 1
    assert tree.discard(diverging, L3, 3) == []
    tree.check_integrity()
    assert tree.match(tokens).page_ids[L3] == ids


def test_check_integrity_detects_corruption(rng):
    """check_integrity() raises on a repeated page id, a residency hole, a lock off the path and a bad link."""
    def build():
        tree = _tree()
        tokens = _tokens(rng, 4)
        tree.insert(tokens, L2, _page_ids(rng, 4))
        tree.insert(np.concatenate([tokens[:2 * PAGE], _tokens(rng, 2)]), L2,
                    _page_ids(rng, 2, low=200_000), start_page=2)
        tree.check_integrity()
        upper = tree.match(tokens[:2 * PAGE]).last_node[L2]
        lower = next(iter(upper.children.values()))
        return tree, upper, lower

    tree, upper, lower = build()
    lower.page_ids[L2][0] = upper.page_ids[L2][1]                 # a page id owned twice
    with pytest.raises(IntegrityError):
        tree.check_integrity()

    tree, upper, lower = build()
    upper.page_ids[L2] = None                                      # child resident, parent not
    with pytest.raises(IntegrityError):
        tree.check_integrity()

    tree, upper, lower = build()
    lower.ref_count[L2] = 1                                        # child locked, parent not
    with pytest.raises(IntegrityError):
        tree.check_integrity()

    tree, upper, lower = build()
    lower.parent = tree.root                                       # broken parent link
    with pytest.raises(IntegrityError):
        tree.check_integrity()


def test_eviction_heap_stays_bounded_under_repeated_matches(rng):
    """Repeated matches (each an LRU touch) do not grow the eviction heaps without bound."""
    tree = _tree()
    sequences = [_tokens(rng, 3) for _ in range(10)]
    for i, tokens in enumerate(sequences):
        tree.insert(tokens, L2, _page_ids(rng, 3, low=i * 100_000))
    for i in range(5000):
        tree.match(sequences[i % 10])
    assert all(len(heap) <= 2 * tree.num_nodes + 64 for heap in tree._eviction._heaps.values())
    tree.check_integrity()


def test_match_is_fast_with_many_prefixes(rng):
    """With 10,000 prefixes in the tree an 8,192-token match (page 16) takes well under 100 us."""
    page_size = 16
    tree = PrefixTree(page_size)
    roots = [rng.integers(1, 150_000, 512, dtype=np.int32) for _ in range(100)]
    next_page_id = 0
    for i in range(10_000):
        tail = rng.integers(1, 150_000, int(rng.integers(1, 8)) * page_size, dtype=np.int32)
        tokens = np.concatenate([roots[i % 100], tail])
        num_resident = tree.match(tokens).hit_tokens[L2] // page_size
        num_new = len(tokens) // page_size - num_resident
        tree.insert(tokens, L2, range(next_page_id, next_page_id + num_new), start_page=num_resident)
        next_page_id += num_new
    query = np.concatenate([roots[7], rng.integers(1, 150_000, 8192 - 512, dtype=np.int32)])
    num_resident = tree.match(query).hit_tokens[L2] // page_size
    tree.insert(query, L2, range(next_page_id, next_page_id + 512 - num_resident),
                start_page=num_resident)
    tree.check_integrity()
    timings = []
    for _ in range(200):
        start = time.perf_counter()
        result = tree.match(query)
        timings.append(time.perf_counter() - start)
    assert result.hit_tokens[L2] == 8192
    assert float(np.median(timings)) < 100e-6


def _resident_run(model: dict[bytes, int], keys: list[bytes]) -> int:
    """Pages of the prefix resident in a tier model (dict full-prefix bytes -> page id)."""
    count = 0
    while count < len(keys) and keys[count] in model:
        count += 1
    return count


def test_random_operations_match_a_reference_model(rng):
    """Random inserts, matches, locks, unlocks and evictions on both tiers agree with a dict model.

    The model maps each resident page-aligned prefix (its token bytes) to its page id, per tier,
    and counts locks per prefix.
    """
    tree = _tree()
    allocators = {L2: PageAllocator(60), L3: PageAllocator(120)}
    model: dict[Tier, dict[bytes, int]] = {L2: {}, L3: {}}
    lock_counts: dict[Tier, dict[bytes, int]] = {L2: {}, L3: {}}
    held_locks: list[tuple[object, Tier, list[bytes]]] = []
    # Few distinct pages, so sequences share and diverge at many depths.
    page_pool = [rng.integers(1, 150_000, PAGE, dtype=np.int32) for _ in range(3)]

    def random_sequence() -> tuple[np.ndarray, list[bytes]]:
        num_pages = int(rng.integers(1, 9))
        tokens = np.concatenate([page_pool[int(rng.integers(0, 3))] for _ in range(num_pages)])
        prefix_keys = [tokens[:(k + 1) * PAGE].tobytes() for k in range(num_pages)]
        return tokens, prefix_keys

    for _ in range(1500):
        tokens, keys = random_sequence()
        tier = (L2, L3)[int(rng.integers(0, 2))]
        operation = rng.random()
        if operation < 0.35:
            resident = _resident_run(model[tier], keys)
            start_page = resident if rng.random() < 0.7 else int(rng.integers(0, len(keys) + 1))
            page_ids = allocators[tier].allocate(len(keys) - start_page) if start_page < len(keys) else []
            if page_ids is None:
                continue
            if start_page > resident:
                with pytest.raises(ValueError):
                    tree.insert(tokens, tier, page_ids, start_page=start_page)
                allocators[tier].free(page_ids)
            else:
                result = tree.insert(tokens, tier, page_ids, start_page=start_page)
                expected_duplicates = []
                for k, page_id in zip(range(start_page, len(keys)), page_ids):
                    if keys[k] in model[tier]:
                        expected_duplicates.append(page_id)
                    else:
                        model[tier][keys[k]] = page_id
                assert result.duplicate_page_ids == expected_duplicates
                assert result.new_pages == len(page_ids) - len(expected_duplicates)
                if expected_duplicates:
                    allocators[tier].free(expected_duplicates)
        elif operation < 0.6:
            result = tree.match(tokens)
            for t in (L2, L3):
                resident = _resident_run(model[t], keys)
                assert result.hit_tokens[t] == resident * PAGE
                assert result.page_ids[t] == [model[t][key] for key in keys[:resident]]
            union = {**model[L2], **model[L3]}
            assert result.matched_tokens == _resident_run(union, keys) * PAGE
            if result.hit_tokens[tier] and rng.random() < 0.5:
                num_locked = result.hit_tokens[tier] // PAGE
                tree.lock(result.last_node[tier], tier)
                held_locks.append((result.last_node[tier], tier, keys[:num_locked]))
                for key in keys[:num_locked]:
                    lock_counts[tier][key] = lock_counts[tier].get(key, 0) + 1
        elif operation < 0.75:
            if held_locks:
                node, lock_tier, locked_keys = held_locks.pop(int(rng.integers(0, len(held_locks))))
                tree.unlock(node, lock_tier)
                for key in locked_keys:
                    lock_counts[lock_tier][key] -= 1
        else:
            want = int(rng.integers(1, 12))
            freed = tree.evict(tier, want)
            page_to_key = {page_id: key for key, page_id in model[tier].items()}
            for page_id in freed:
                key = page_to_key[page_id]
                assert lock_counts[tier].get(key, 0) == 0, "a locked page was evicted"
                del model[tier][key]
            assert len(freed) >= want or tree.evictable_pages(tier) == 0
            allocators[tier].free(freed)

        owned = tree.check_integrity()
        for t in (L2, L3):
            assert owned[t] == set(model[t].values())
            # Tree-owned and free pages are disjoint and together make up the capacity.
            assert owned[t].isdisjoint(allocators[t].free_page_ids())
            assert len(owned[t]) + allocators[t].num_free == allocators[t].num_pages
            assert tree.protected_pages(t) == sum(1 for c in lock_counts[t].values() if c > 0)
            allocators[t].check_integrity()
        assert tree.num_nodes <= len({**model[L2], **model[L3]})

    for node, lock_tier, _ in held_locks:
        tree.unlock(node, lock_tier)
    for tier in (L2, L3):
        tree.evict(tier, 10**6)
    assert tree.num_nodes == 0
    assert tree.check_integrity() == {L2: set(), L3: set()}


def test_discard_of_a_page_whose_whole_subtree_empties_leaves_no_node(rng):
    """Discarding page 0 of a head held only in L3, with two branches below it held only in L3,
    frees every page and leaves an empty tree: each emptied node leaves once, whichever child
    emptied it."""
    tree = _tree()
    head = _tokens(rng, 3)
    left, right = np.concatenate([head, _tokens(rng, 2)]), np.concatenate([head, _tokens(rng, 4)])
    left_ids, right_ids = _page_ids(rng, 5), _page_ids(rng, 4, low=200_000)
    tree.insert(left, L3, left_ids)
    tree.insert(right, L3, right_ids, start_page=3)
    assert tree.num_nodes == 3
    freed = tree.discard(left, L3, 0)
    assert sorted(freed) == sorted(left_ids + right_ids)
    assert tree.num_nodes == 0 and tree.check_integrity() == {L2: set(), L3: set()}


def test_discard_pages_clears_each_page_and_what_lies_below_it(rng):
    """discard_pages(L2, ids) frees those L2 pages wherever they lie in the tree, with every L2
    page below each (other branches and L3 residency untouched), splitting a node at its first
    named page; with a locked page among them it raises and changes nothing."""
    tree = _tree()
    head = _tokens(rng, 4)
    left, right, other = (np.concatenate([head, _tokens(rng, 3)]), np.concatenate([head, _tokens(rng, 2)]),
                          _tokens(rng, 5))
    ids = {name: _page_ids(rng, 7, low=i * 200_000) for i, name in enumerate(("left", "right", "other"))}
    tree.insert(left, L2, ids["left"][:7])
    tree.insert(right, L2, ids["right"][:2], start_page=4)
    tree.insert(other, L2, ids["other"][:5])
    tree.insert(other, L3, ids["other"][:5])
    node = tree.match(other).last_node[L2]
    tree.lock(node, L2)
    with pytest.raises(ValueError, match="locked"):
        tree.discard_pages(L2, [ids["left"][5], ids["other"][3]])
    tree.check_integrity()
    assert tree.match(other).hit_tokens[L2] == 5 * PAGE
    tree.unlock(node, L2)

    # Page 2 of the head: the head's pages 2-3 and both branches go; page 3 of `other` and its last.
    freed = tree.discard_pages(L2, [ids["left"][2], ids["other"][3], ids["left"][5]])
    tree.check_integrity()
    assert sorted(freed) == sorted(ids["left"][2:7] + ids["right"][:2] + ids["other"][3:5])
    assert tree.match(left).hit_tokens == {L2: 2 * PAGE, L3: 0}
    assert tree.match(right).hit_tokens == {L2: 2 * PAGE, L3: 0}
    assert tree.match(other).hit_tokens == {L2: 3 * PAGE, L3: 5 * PAGE}
    assert tree.discard_pages(L2, [12345678]) == []


def test_resident_pages_and_the_oldest_evictable_access(rng):
    """resident_pages(tier) lists every resident page once with its node's LRU time, lock and reuse;
    oldest_evictable_access(tier) is the LRU time of the leaf evict() frees first (None when
    nothing is evictable)."""
    tree = _tree()
    assert tree.oldest_evictable_access(L2) is None
    first, second = _tokens(rng, 3), _tokens(rng, 2)
    first_ids, second_ids = _page_ids(rng, 3), _page_ids(rng, 2, low=200_000)
    tree.insert(first, L2, first_ids)
    tree.insert(second, L2, second_ids)
    first_node, second_node = tree.match(first).last_node[L2], tree.match(second).last_node[L2]
    assert tree.oldest_evictable_access(L2) == first_node.last_access[L2] < second_node.last_access[L2]
    tree.lock(first_node, L2)
    assert tree.oldest_evictable_access(L2) == second_node.last_access[L2]
    resident = tree.resident_pages(L2)
    by_page = {int(p): (float(t), bool(k), bool(r)) for p, t, k, r in zip(*resident)}
    assert len(resident.page_ids) == 5 and set(by_page) == set(first_ids + second_ids)
    assert all(by_page[p] == (first_node.last_access[L2], True, True) for p in first_ids)
    assert all(by_page[p] == (second_node.last_access[L2], False, True) for p in second_ids)
    tree.lock(second_node, L2)
    assert tree.oldest_evictable_access(L2) is None
    tree.check_integrity()


def test_insert_child_builds_the_tree_a_chain_at_a_time(rng):
    """insert_child below the root and below another chain gives the same residency as insert of
    the whole paths (a match returns each path's page ids in order), evicts like it, and refuses a
    parent not resident in the tier, a taken first page, a key not of whole pages and ids owned."""
    tree = _tree()
    trunk, branch = _tokens(rng, 3), _tokens(rng, 2)
    trunk_ids, branch_ids = _page_ids(rng, 3), _page_ids(rng, 2, low=200_000)
    top = tree.insert_child(None, L3, trunk.tobytes(), trunk_ids)
    tree.insert_child(top, L3, branch.tobytes(), branch_ids)
    assert tree.match(np.concatenate([trunk, branch])).page_ids[L3] == trunk_ids + branch_ids
    assert tree.match(trunk).page_ids[L3] == trunk_ids
    tree.check_integrity()
    with pytest.raises(ValueError, match="not in the tree, resident"):
        tree.insert_child(top, L2, branch.tobytes(), [1, 2])
    with pytest.raises(ValueError, match="child starting with that page"):
        tree.insert_child(top, L3, branch.tobytes(), [1, 2])
    with pytest.raises(ValueError, match="whole pages|bytes for"):
        tree.insert_child(None, L3, branch.tobytes()[:-4], [1, 2])
    with pytest.raises(ValueError, match="already owned"):
        tree.insert_child(None, L3, _tokens(rng, 1).tobytes(), trunk_ids[:1])
    tree.check_integrity()
    assert sorted(tree.evict(L3, 5)) == sorted(trunk_ids + branch_ids)


def test_leaves_never_reused_are_evicted_before_reused_ones_whatever_their_age(rng):
    """A prefix a match hit (reused) outlives a flood of newer prefixes inserted and never hit:
    evict() frees the never-reused leaves first, least recently used first among them, and only
    then the reused one; next_eviction_rank names each choice before it is made."""
    tree = _tree()
    hot = _tokens(rng, 2)
    tree.insert(hot, L2, _page_ids(rng, 2, low=900_000))
    tree.match(hot)                                    # reused: hit once after its insertion
    flood = [_tokens(rng, 1) for _ in range(6)]
    flood_ids = [[1000 + i] for i in range(6)]
    for tokens, ids in zip(flood, flood_ids):
        tree.insert(tokens, L2, ids)
    assert tree.reused_pages(L2) == 2
    for ids in flood_ids:
        assert tree.next_eviction_rank(L2)[0] is False
        assert tree.evict(L2, 1) == ids
        tree.check_integrity()
    assert tree.next_eviction_rank(L2)[0] is True and tree.match(hot).hit_tokens[L2] == 2 * PAGE
    assert len(tree.evict(L2, 1)) == 2 and tree.reused_pages(L2) == 0
    tree.check_integrity()


def test_reused_pages_above_the_main_share_are_evicted_first(rng):
    """Reuse does not hold a tier for good: once reused pages exceed MAIN_SHARE (90%) of the
    tier's pages, the least recently used reused leaf goes before the never-reused ones, so a
    new working set still has room to be reused."""
    tree = _tree()
    old = [_tokens(rng, 1) for _ in range(19)]
    for i, tokens in enumerate(old):
        tree.insert(tokens, L2, [i])
        tree.match(tokens)
    fresh = _tokens(rng, 1)
    tree.insert(fresh, L2, [100])                     # 19 reused of 20: 95% > 90%
    assert tree.evict(L2, 1) == [0] and tree.match(fresh).hit_tokens[L2] == PAGE
    tree.check_integrity()


def test_a_prefix_reused_before_returns_to_l2_as_reused(rng):
    """The node outlives its L2 residency while L3 holds it: re-inserted into L2 (a promotion), a
    prefix that had been reused there counts as reused at once (a ghost entry, as S3-FIFO's)."""
    tree = _tree()
    tokens = _tokens(rng, 3)
    tree.insert(tokens, L3, _page_ids(rng, 3, low=500_000))
    tree.insert(tokens, L2, [1, 2, 3])
    tree.match(tokens)
    assert tree.reused_pages(L2) == 3
    assert sorted(tree.evict(L2, 3)) == [1, 2, 3] and tree.reused_pages(L2) == 0
    tree.insert(tokens, L2, [7, 8, 9])
    assert tree.reused_pages(L2) == 3 and tree.next_eviction_rank(L2)[0] is True
    tree.match(tokens[:PAGE])                          # a split keeps the count
    tree.check_integrity()
    assert tree.reused_pages(L2) == 3


def test_a_hit_within_the_callers_own_pages_is_no_reuse(rng):
    """A match that hits only pages the caller holds itself (own_pages: an engine's GPU hit, a
    write-through copying the path, a backup extended in steps) touches them but does not make
    them reused; a hit reaching beyond them does."""
    tree = _tree()
    tokens = _tokens(rng, 4)
    tree.insert(tokens[:2 * PAGE], L2, [1, 2])
    tree.match(tokens, own_pages=2)
    assert tree.reused_pages(L2) == 0 and tree.next_eviction_rank(L2)[0] is False
    tree.match(tokens, own_pages=1)
    assert tree.reused_pages(L2) == 2
    tree.check_integrity()
