"""The engine's L1 prefix index: matching, insertion, locking and LRU eviction."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine_client.l1_index import L1Match, L1PrefixIndex

PAGE_SIZE = 4


def random_tokens(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(num_tokens)]


@pytest.fixture
def rng() -> random.Random:
    return random.Random(20240607)


def test_match_on_empty_index_finds_nothing(rng):
    """An empty index matches zero tokens."""
    index = L1PrefixIndex(PAGE_SIZE)
    assert index.match(random_tokens(rng, 10)) == L1Match(0, [])
    index.check_integrity()


def test_inserted_pages_match_page_aligned_and_partial_pages_are_ignored(rng):
    """After inserting 3 full pages, a query extending them matches exactly those 3 pages (12 tokens)."""
    index = L1PrefixIndex(PAGE_SIZE)
    tokens = random_tokens(rng, 3 * PAGE_SIZE + 2)          # 2 tokens of a partial page are not cached
    assert index.insert(tokens, [7, 3, 9]) == []
    index.check_integrity()
    assert index.match(tokens + random_tokens(rng, 5)) == L1Match(12, [7, 3, 9])
    assert index.match(tokens[:2 * PAGE_SIZE + 3]) == L1Match(8, [7, 3])
    assert index.num_cached_pages == 3


def test_match_stops_at_the_first_differing_page(rng):
    """A query that differs in one token of page 1 matches only page 0, even though page 2 matches."""
    index = L1PrefixIndex(PAGE_SIZE)
    tokens = random_tokens(rng, 3 * PAGE_SIZE)
    index.insert(tokens, [0, 1, 2])
    query = list(tokens)
    query[PAGE_SIZE + 2] += 1
    assert index.match(query) == L1Match(PAGE_SIZE, [0])


def test_same_page_tokens_under_different_prefixes_are_distinct_pages(rng):
    """Identical token pages after different first pages are keyed apart (the key covers the prefix)."""
    index = L1PrefixIndex(PAGE_SIZE)
    shared_page = random_tokens(rng, PAGE_SIZE)
    first_a, first_b = random_tokens(rng, PAGE_SIZE), random_tokens(rng, PAGE_SIZE)
    index.insert(first_a + shared_page, [10, 11])
    assert index.match(first_b + shared_page) == L1Match(0, [])
    index.insert(first_b + shared_page, [20, 21])
    index.check_integrity()
    assert index.match(first_a + shared_page).page_ids == [10, 11]
    assert index.match(first_b + shared_page).page_ids == [20, 21]


def test_token_id_containers_give_the_same_keys(rng):
    """A list, an int64 array and an int32 array of the same tokens match the same pages."""
    index = L1PrefixIndex(PAGE_SIZE)
    tokens = random_tokens(rng, 2 * PAGE_SIZE)
    index.insert(np.asarray(tokens, dtype=np.int64), [4, 5])
    assert index.match(tokens).page_ids == [4, 5]
    assert index.match(np.asarray(tokens, dtype=np.int32)).page_ids == [4, 5]


def test_insert_with_start_page_extends_a_cached_prefix(rng):
    """insert(start_page=2) adds pages 2.. after a cached 2-page prefix, and the whole chain then matches."""
    index = L1PrefixIndex(PAGE_SIZE)
    tokens = random_tokens(rng, 4 * PAGE_SIZE)
    index.insert(tokens[:2 * PAGE_SIZE], [1, 2])
    assert index.insert(tokens, [3, 4], start_page=2) == []
    index.check_integrity()
    assert index.match(tokens) == L1Match(4 * PAGE_SIZE, [1, 2, 3, 4])


def test_insert_without_cached_prefix_raises_and_changes_nothing(rng):
    """insert(start_page=2) when page 1 is not cached raises ValueError and caches nothing."""
    index = L1PrefixIndex(PAGE_SIZE)
    tokens = random_tokens(rng, 4 * PAGE_SIZE)
    index.insert(tokens[:PAGE_SIZE], [1])
    with pytest.raises(ValueError, match="prefix page 1 is not cached"):
        index.insert(tokens, [3, 4], start_page=2)
    index.check_integrity()
    assert index.num_cached_pages == 1
    assert not index.contains_page(3) and not index.contains_page(4)


def test_insert_of_cached_pages_keeps_existing_and_returns_callers_duplicates(rng):
    """Re-inserting a cached prefix keeps the cached L1 pages and returns the caller's ids for those pages."""
    index = L1PrefixIndex(PAGE_SIZE)
    tokens = random_tokens(rng, 3 * PAGE_SIZE)
    index.insert(tokens[:2 * PAGE_SIZE], [1, 2])
    duplicates = index.insert(tokens, [11, 12, 13])
    index.check_integrity()
    assert duplicates == [11, 12]
    assert index.match(tokens).page_ids == [1, 2, 13]
    assert not index.contains_page(11) and not index.contains_page(12)


def test_reinserting_the_same_page_ids_returns_nothing_to_free(rng):
    """Inserting a page under the id it is already cached with is a no-op, not a duplicate."""
    index = L1PrefixIndex(PAGE_SIZE)
    tokens = random_tokens(rng, 2 * PAGE_SIZE)
    index.insert(tokens, [5, 6])
    assert index.insert(tokens, [5, 6]) == []
    index.check_integrity()
    assert index.num_cached_pages == 2


def test_insert_of_a_page_id_cached_for_another_prefix_raises_and_changes_nothing(rng):
    """Inserting an L1 page id that already holds a different prefix raises ValueError; nothing is cached."""
    index = L1PrefixIndex(PAGE_SIZE)
    index.insert(random_tokens(rng, PAGE_SIZE), [5])
    other = random_tokens(rng, 2 * PAGE_SIZE)
    with pytest.raises(ValueError, match="already cached for a different prefix"):
        index.insert(other, [6, 5])
    index.check_integrity()
    assert index.num_cached_pages == 1 and not index.contains_page(6)


@pytest.mark.parametrize("page_ids, num_tokens, error", [
    ([1, 1], 2 * PAGE_SIZE, "duplicates"),
    ([1, 2, 3], 2 * PAGE_SIZE, "need 12 tokens"),
    ([-1], PAGE_SIZE, ">= 0"),
])
def test_insert_rejects_malformed_input(rng, page_ids, num_tokens, error):
    """Duplicate ids, too few tokens for the pages, or negative ids raise ValueError and cache nothing."""
    index = L1PrefixIndex(PAGE_SIZE)
    with pytest.raises(ValueError, match=error):
        index.insert(random_tokens(rng, num_tokens), page_ids)
    index.check_integrity()
    assert index.num_cached_pages == 0


def test_evict_frees_least_recently_used_leaves_first(rng):
    """With two cached sequences, the one not matched recently is evicted first, leaf before parent."""
    index = L1PrefixIndex(PAGE_SIZE)
    old_tokens, new_tokens = random_tokens(rng, 2 * PAGE_SIZE), random_tokens(rng, 2 * PAGE_SIZE)
    index.insert(old_tokens, [1, 2])
    index.insert(new_tokens, [3, 4])
    index.match(old_tokens)                    # now `new_tokens` is the least recently used
    assert index.evict(1) == [4]
    index.check_integrity()
    assert index.evict(1) == [3]
    index.check_integrity()
    assert index.match(old_tokens).page_ids == [1, 2]


def test_evict_cascades_from_leaf_to_parent_in_one_call(rng):
    """evict(3) on one 3-page chain frees all three pages, deepest first."""
    index = L1PrefixIndex(PAGE_SIZE)
    index.insert(random_tokens(rng, 3 * PAGE_SIZE), [1, 2, 3])
    assert index.evict(3) == [3, 2, 1]
    index.check_integrity()
    assert index.num_cached_pages == 0


def test_evict_keeps_a_parent_while_another_child_remains(rng):
    """A shared first page is not evicted while one of its two children is still cached."""
    index = L1PrefixIndex(PAGE_SIZE)
    root_page = random_tokens(rng, PAGE_SIZE)
    branch_a, branch_b = root_page + random_tokens(rng, PAGE_SIZE), root_page + random_tokens(rng, PAGE_SIZE)
    index.insert(branch_a, [1, 2])
    index.insert(branch_b, [3], start_page=1)
    index.match(branch_b)
    assert index.evict(1) == [2]
    index.check_integrity()
    assert index.contains_page(1)
    assert index.match(branch_b).page_ids == [1, 3]


def test_locked_pages_and_their_ancestors_are_never_evicted(rng):
    """Locking a leaf protects its whole path: evicting everything frees only the other sequence."""
    index = L1PrefixIndex(PAGE_SIZE)
    locked_tokens, free_tokens = random_tokens(rng, 2 * PAGE_SIZE), random_tokens(rng, 2 * PAGE_SIZE)
    index.insert(locked_tokens, [1, 2])
    index.insert(free_tokens, [3, 4])
    index.lock([2])
    assert index.num_evictable_pages() == 2
    assert sorted(index.evict(10)) == [3, 4]
    index.check_integrity()
    assert index.match(locked_tokens).page_ids == [1, 2]
    index.unlock([2])
    assert index.num_evictable_pages() == 2
    assert index.evict(10) == [2, 1]
    index.check_integrity()


def test_locks_are_reference_counted(rng):
    """A page locked twice stays unevictable after one unlock and becomes evictable after the second."""
    index = L1PrefixIndex(PAGE_SIZE)
    index.insert(random_tokens(rng, PAGE_SIZE), [8])
    index.lock([8, 8])
    assert index.ref_count(8) == 2
    index.unlock([8])
    assert index.evict(1) == []
    index.unlock([8])
    index.check_integrity()
    assert index.evict(1) == [8]


def test_unlock_below_zero_raises_and_changes_nothing(rng):
    """Unlocking more times than locked raises ValueError and leaves every refcount as it was."""
    index = L1PrefixIndex(PAGE_SIZE)
    index.insert(random_tokens(rng, 2 * PAGE_SIZE), [1, 2])
    index.lock([1, 2])
    with pytest.raises(ValueError, match="cannot unlock 2"):
        index.unlock([1, 2, 2])
    index.check_integrity()
    assert index.ref_count(1) == 1 and index.ref_count(2) == 1


def test_lock_of_an_uncached_page_raises_and_changes_nothing(rng):
    """lock([cached, uncached]) raises ValueError and does not lock the cached page."""
    index = L1PrefixIndex(PAGE_SIZE)
    index.insert(random_tokens(rng, PAGE_SIZE), [1])
    with pytest.raises(ValueError, match="not in the prefix index"):
        index.lock([1, 99])
    assert index.ref_count(1) == 0


def test_evict_more_than_evictable_returns_what_there_is(rng):
    """evict(n) with fewer evictable pages returns only those, and evict(0) returns nothing."""
    index = L1PrefixIndex(PAGE_SIZE)
    index.insert(random_tokens(rng, 2 * PAGE_SIZE), [1, 2])
    assert index.evict(0) == []
    assert index.evict(5) == [2, 1]
    assert index.evict(5) == []
    with pytest.raises(ValueError):
        index.evict(-1)


def test_random_operations_keep_integrity_and_page_accounting(rng):
    """Under random insert/match/lock/unlock/evict, no page id is lost or cached twice, locked pages
    survive, and num_evictable_pages predicts what a full eviction frees."""
    index = L1PrefixIndex(PAGE_SIZE)
    free_page_ids = list(range(200))
    cached: set[int] = set()
    lock_counts: dict[int, int] = {}
    prompts = [random_tokens(rng, rng.randint(1, 6) * PAGE_SIZE) for _ in range(8)]
    for _ in range(400):
        action = rng.random()
        prompt = rng.choice(prompts)
        if rng.random() < 0.3:
            prompt = prompt[:rng.randint(0, len(prompt))] + random_tokens(rng, rng.randint(0, 2 * PAGE_SIZE))
        if action < 0.4:
            match = index.match(prompt)
            num_new = len(prompt) // PAGE_SIZE - len(match.page_ids)
            if 0 < num_new <= len(free_page_ids):
                new_ids = [free_page_ids.pop() for _ in range(num_new)]
                duplicates = index.insert(prompt, new_ids, start_page=len(match.page_ids))
                assert duplicates == []
                cached.update(new_ids)
        elif action < 0.6 and cached:
            page_id = rng.choice(sorted(cached))
            index.lock([page_id])
            lock_counts[page_id] = lock_counts.get(page_id, 0) + 1
        elif action < 0.8 and lock_counts:
            page_id = rng.choice(sorted(lock_counts))
            index.unlock([page_id])
            lock_counts[page_id] -= 1
            if lock_counts[page_id] == 0:
                del lock_counts[page_id]
        else:
            evictable = index.num_evictable_pages()
            evicted = index.evict(rng.randint(0, 6))
            assert len(evicted) <= evictable
            assert cached.issuperset(evicted) and not set(evicted) & set(lock_counts)
            cached.difference_update(evicted)
            free_page_ids.extend(evicted)
        index.check_integrity()
        assert index.num_cached_pages == len(cached)
        assert len(cached) + len(free_page_ids) == 200
    evictable = index.num_evictable_pages()
    num_cached_before = index.num_cached_pages
    assert len(index.evict(1000)) == evictable
    index.check_integrity()
    assert index.num_evictable_pages() == 0
    assert index.num_cached_pages == num_cached_before - evictable
    for page_id in lock_counts:
        assert index.contains_page(page_id)
