"""PageAllocator: contiguous preference, fragmentation, rejected frees, integrity."""

from __future__ import annotations

import itertools
import random

import pytest

from kvcached.core.allocator import PageAllocator
from kvcached.core.tiers import IntegrityError


@pytest.fixture
def rng(seed) -> random.Random:
    """A Python generator from the test's seed (kvcached/testing/pytest_plugin.py: a failure names it)."""
    return random.Random(seed)


def _with_free_runs(num_pages: int, runs: list[tuple[int, int]]) -> PageAllocator:
    """An allocator whose free space is exactly the given (start, length) runs."""
    allocator = PageAllocator(num_pages)
    assert allocator.allocate(num_pages) == list(range(num_pages))
    for start, length in runs:
        allocator.free(range(start, start + length))
    allocator.check_integrity()
    return allocator


def test_fresh_allocator_hands_out_one_contiguous_run():
    """A fresh allocator serves a request from one run starting at page 0."""
    allocator = PageAllocator(1000)
    allocator.check_integrity()
    assert allocator.allocate(300) == list(range(300))
    assert allocator.allocate(200) == list(range(300, 500))
    assert allocator.num_free == 500
    assert allocator.free_page_ids() == set(range(500, 1000))
    allocator.check_integrity()


def test_allocate_takes_smallest_run_that_fits():
    """Best fit: the smallest free run holding n wins (lowest start on ties); taken from its start."""
    allocator = _with_free_runs(100, [(10, 5), (30, 3), (50, 8), (70, 3)])
    assert allocator.allocate(3) == [30, 31, 32]              # two runs of 3: lowest start
    allocator.check_integrity()
    assert allocator.allocate(4) == [10, 11, 12, 13]           # 5 is the best fit, not 8
    allocator.check_integrity()
    assert allocator.allocate(6) == list(range(50, 56))
    allocator.check_integrity()
    assert allocator.free_page_ids() == {14, 56, 57, 70, 71, 72}


def test_fragmented_allocate_takes_largest_runs_first():
    """With no run big enough, whole runs go largest-first and the last piece is best fit."""
    allocator = _with_free_runs(100, [(5, 2), (20, 3), (40, 4), (60, 2)])
    # 4 whole, 3 whole, then 1 page from the first run of 2.
    assert allocator.allocate(8) == [40, 41, 42, 43, 20, 21, 22, 5]
    allocator.check_integrity()
    assert allocator.free_page_ids() == {6, 60, 61}
    assert allocator.num_free == 3


def test_allocate_refuses_more_than_free_and_changes_nothing():
    """allocate() returns None when fewer than n pages are free, and the free set is unchanged."""
    allocator = _with_free_runs(50, [(3, 4), (20, 5)])
    before = allocator.free_page_ids()
    assert not allocator.can_allocate(10)
    assert allocator.allocate(10) is None
    assert allocator.free_page_ids() == before
    assert allocator.can_allocate(9)
    assert sorted(allocator.allocate(9)) == sorted(before)
    assert allocator.num_free == 0
    allocator.check_integrity()
    with pytest.raises(ValueError):
        allocator.allocate(0)


def test_free_merges_neighbours_back_into_one_run(rng):
    """Freeing every page in random order, in random batches, leaves one run of all pages."""
    allocator = PageAllocator(500)
    page_ids = allocator.allocate(500)
    rng.shuffle(page_ids)
    position = 0
    while position < len(page_ids):
        size = rng.randint(1, 20)
        allocator.free(page_ids[position:position + size])
        position += size
        allocator.check_integrity()
    assert allocator.allocate(500) == list(range(500))


@pytest.mark.parametrize("bad_ids", [[7, 500], [-1], [8, 8], [7, 30], [28, 29, 30, 31], [38, 39, 40, 41],
                                     [32, 33], list(range(25, 45)), [1, 2, 35], [41, 40, 39]])
def test_bad_free_is_rejected_and_changes_nothing(bad_ids):
    """free() raises ValueError on out-of-range, repeated or already-free ids and frees nothing."""
    allocator = _with_free_runs(500, [(30, 10)])
    before = allocator.free_page_ids()
    with pytest.raises(ValueError):
        allocator.free(bad_ids)
    assert allocator.free_page_ids() == before
    assert allocator.num_free == 10
    allocator.check_integrity()


def test_free_names_the_lowest_page_already_free():
    """A run of ids that overlaps free runs is refused naming its lowest free page, whichever
    free runs it spans."""
    allocator = _with_free_runs(500, [(30, 10), (45, 5)])
    for ids, first_free in [(range(20, 60), 30), (range(41, 60), 45), (range(35, 47), 35), (range(48, 52), 48)]:
        with pytest.raises(ValueError, match=f"page id {first_free} is already free"):
            allocator.free(list(ids))
        assert allocator.num_free == 15
        allocator.check_integrity()


def test_double_free_is_rejected():
    """Freeing the same pages twice fails the second time and leaves them free once."""
    allocator = PageAllocator(64)
    page_ids = allocator.allocate(5)
    allocator.free(page_ids)
    with pytest.raises(ValueError):
        allocator.free(page_ids)
    assert allocator.num_free == 64
    allocator.check_integrity()


def test_zero_page_allocator():
    """An allocator of zero pages is valid, has nothing to give and rejects every free."""
    allocator = PageAllocator(0)
    allocator.check_integrity()
    assert allocator.allocate(1) is None
    assert allocator.free_page_ids() == set()
    with pytest.raises(ValueError):
        allocator.free([0])


def test_check_integrity_detects_corruption():
    """check_integrity() raises on touching runs, a wrong free count and an out-of-range run."""
    allocator = _with_free_runs(100, [(10, 5), (30, 5)])
    allocator._start_to_length[10] = 20           # [10, 30) now touches [30, 35)
    with pytest.raises(IntegrityError):
        allocator.check_integrity()

    allocator = _with_free_runs(100, [(10, 5)])
    allocator._num_free += 1
    with pytest.raises(IntegrityError):
        allocator.check_integrity()

    allocator = _with_free_runs(100, [(90, 10)])
    allocator._start_to_length[90] = 11
    with pytest.raises(IntegrityError):
        allocator.check_integrity()


def longest_run(page_ids: set[int]) -> int:
    """The most consecutive ids in page_ids."""
    return max((next(length for length in itertools.count() if start + length not in page_ids)
                for start in page_ids if start - 1 not in page_ids), default=0)


def test_random_operations_match_a_set_model(rng):
    """Random allocate/free agree with a plain set of free ids; a fitting run is always used whole."""
    num_pages = 3000
    allocator = PageAllocator(num_pages)
    free_model = set(range(num_pages))
    held: list[list[int]] = []
    for _ in range(3000):
        if held and rng.random() < 0.45:
            page_ids = held.pop(rng.randrange(len(held)))
            allocator.free(page_ids)
            free_model.update(page_ids)
        else:
            n = rng.randint(1, 80)
            largest_before = longest_run(free_model)
            page_ids = allocator.allocate(n)
            if n > len(free_model):
                assert page_ids is None
            else:
                assert len(page_ids) == n and set(page_ids) <= free_model
                if largest_before >= n:
                    assert page_ids == list(range(page_ids[0], page_ids[0] + n))
                free_model.difference_update(page_ids)
                held.append(page_ids)
        assert allocator.num_free == len(free_model)
        assert allocator.free_page_ids() == free_model
        allocator.check_integrity()


def test_many_runs_stay_fast():
    """With 20,000 one-page runs, allocate/free cost no O(num_pages) scan (1,000 pairs well under 1 s)."""
    import time

    allocator = PageAllocator(40_000)
    page_ids = allocator.allocate(40_000)
    allocator.free(page_ids[::2])
    allocator.check_integrity()
    start = time.perf_counter()
    for _ in range(1000):
        allocator.free(allocator.allocate(3))
    assert time.perf_counter() - start < 1.0
    allocator.check_integrity()


def test_take_allocates_exactly_the_ids_named(rng):
    """take(ids) leaves every other id free and merges the rest into maximal runs; a not-free,
    repeated or out-of-range id raises and changes nothing."""
    allocator = PageAllocator(64)
    taken = sorted(rng.sample(range(64), 20))
    allocator.take(taken)
    allocator.check_integrity()
    assert allocator.free_page_ids() == set(range(64)) - set(taken)
    for bad in ([taken[0]], [64], [-1], [p for p in range(64) if p not in taken][:1] * 2):
        with pytest.raises(ValueError):
            allocator.take(bad)
        allocator.check_integrity()
        assert allocator.free_page_ids() == set(range(64)) - set(taken)
    rest = allocator.allocate(44)
    assert sorted(rest) == sorted(set(range(64)) - set(taken))
    assert allocator.allocate(1) is None


def test_ranges_given_and_taken_back_keep_the_free_set_exact(rng):
    """An allocator that starts with nothing free is given ranges (free_range) and has ranges
    taken back (take_range) at random: its free set is always the union of what it holds, runs
    merge and split as needed, and a range that is partly free (give) or partly not (take) is
    refused with nothing changed."""
    num_pages = 400
    allocator = PageAllocator(num_pages, all_free=False)
    assert allocator.num_free == 0 and allocator.allocate(1) is None
    model: set[int] = set()
    for _ in range(300):
        start = rng.randrange(num_pages)
        stop = rng.randrange(start, min(num_pages, start + 40) + 1)
        span = set(range(start, stop))
        if rng.random() < 0.5:
            if span & model:
                with pytest.raises(ValueError):
                    allocator.free_range(start, stop)
            else:
                allocator.free_range(start, stop)
                model |= span
        else:
            if span <= model:
                allocator.take_range(start, stop)
                model -= span
            else:
                with pytest.raises(ValueError):
                    allocator.take_range(start, stop)
        allocator.check_integrity()
        assert allocator.free_page_ids() == model and allocator.num_free == len(model)
    with pytest.raises(ValueError):
        allocator.free_range(0, num_pages + 1)
