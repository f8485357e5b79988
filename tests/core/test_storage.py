"""Tests for the L3 slot arithmetic: extent coalescing and slot offsets."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvcached.core.storage import Extent, SlotLayout, coalesce_extents


def _expand(extents: list[Extent]) -> tuple[list[int], list[int]]:
    src_page_ids: list[int] = []
    dst_page_ids: list[int] = []
    for extent in extents:
        src_page_ids.extend(range(extent.src_start, extent.src_start + extent.num_pages))
        dst_page_ids.extend(range(extent.dst_start, extent.dst_start + extent.num_pages))
    return src_page_ids, dst_page_ids


def test_contiguous_map_is_one_extent():
    """8 pages consecutive on both sides merge into one extent covering them all."""
    assert coalesce_extents(list(range(0, 8)), list(range(10, 18))) == [Extent(0, 10, 8)]


def test_alternating_source_gives_one_extent_per_page():
    """Source pages 0,2,4,... to consecutive destinations cannot merge: 8 pages -> 8 extents."""
    extents = coalesce_extents(list(range(0, 16, 2)), list(range(8)))
    assert len(extents) == 8
    assert all(extent.num_pages == 1 for extent in extents)


def test_alternating_destination_gives_one_extent_per_page():
    """Consecutive sources into destinations 1,3,5,... cannot merge either: both sides must be consecutive."""
    extents = coalesce_extents(list(range(8)), list(range(1, 17, 2)))
    assert len(extents) == 8


def test_runs_break_where_either_side_breaks():
    """A run ends exactly where the source or the destination stops stepping by +1."""
    extents = coalesce_extents([3, 4, 5, 9, 10], [7, 8, 20, 21, 22])
    assert extents == [Extent(3, 7, 2), Extent(5, 20, 1), Extent(9, 21, 2)]


def test_descending_and_repeated_ids_do_not_merge():
    """Only +1 steps merge: descending or repeated ids give one extent per pair."""
    assert len(coalesce_extents([5, 4, 3], [0, 1, 2])) == 3
    assert len(coalesce_extents([2, 2], [0, 1])) == 2


def test_map_order_is_preserved():
    """Extents come out in map order, not sorted by page id."""
    assert coalesce_extents([10, 11, 0, 1], [0, 1, 2, 3]) == [Extent(10, 0, 2), Extent(0, 2, 2)]


def test_random_maps_expand_back_exactly_and_are_maximal(seed):
    """On random maps, extents expand back to the exact input map, and no two neighbours could merge."""
    rng = random.Random(seed)
    for _ in range(200):
        num_pages = rng.randrange(0, 64)
        # Random runs of random length, so both merged and broken runs occur.
        src_page_ids: list[int] = []
        dst_page_ids: list[int] = []
        while len(src_page_ids) < num_pages:
            run_len = rng.randrange(1, 6)
            src_start, dst_start = rng.randrange(0, 100), rng.randrange(0, 100)
            src_page_ids.extend(range(src_start, src_start + run_len))
            dst_page_ids.extend(range(dst_start, dst_start + run_len))
        src_page_ids, dst_page_ids = src_page_ids[:num_pages], dst_page_ids[:num_pages]
        extents = coalesce_extents(src_page_ids, dst_page_ids)
        assert _expand(extents) == (src_page_ids, dst_page_ids), f"seed {seed}"
        for left, right in zip(extents, extents[1:]):
            mergeable = (right.src_start == left.src_start + left.num_pages
                         and right.dst_start == left.dst_start + left.num_pages)
            assert not mergeable, f"seed {seed}: {left} and {right} should have merged"


def test_numpy_ids_are_accepted_and_give_python_ints():
    """numpy integer arrays work as page maps and the extents hold plain ints."""
    extents = coalesce_extents(np.arange(4, dtype=np.int64), np.arange(100, 104, dtype=np.int32))
    assert extents == [Extent(0, 100, 4)]
    assert all(type(value) is int for value in extents[0])


def test_empty_map_gives_no_extents():
    """An empty map is valid and moves nothing."""
    assert coalesce_extents([], []) == []


def test_unequal_lengths_raise():
    """Maps of different lengths are refused."""
    with pytest.raises(ValueError, match="length"):
        coalesce_extents([0, 1, 2], [0, 1])


def test_negative_ids_raise():
    """A negative id on either side is refused."""
    with pytest.raises(ValueError, match="negative"):
        coalesce_extents([0, -1], [0, 1])
    with pytest.raises(ValueError, match="negative"):
        coalesce_extents([0, 1], [-3, 1])


def test_float_ids_raise():
    """A float id is refused rather than truncated."""
    with pytest.raises(TypeError):
        coalesce_extents([0.0], [1])


def test_slot_offset_formula_and_size():
    """offset(slot) = slot * bytes_per_page; size_bytes is one byte past the last slot."""
    layout = SlotLayout(bytes_per_page=8192, num_slots=5)
    assert [layout.offset(slot) for slot in range(5)] == [slot * 8192 for slot in range(5)]
    assert layout.size_bytes == 5 * 8192
    assert layout.offset(4) + layout.bytes_per_page == layout.size_bytes


def test_slot_out_of_range_raises():
    """Slots below 0 or at/after num_slots are refused."""
    layout = SlotLayout(bytes_per_page=4096, num_slots=3)
    for slot in (-1, 3, 100):
        with pytest.raises(ValueError, match="out of range"):
            layout.offset(slot)


@pytest.mark.parametrize("fields", [
    dict(bytes_per_page=0, num_slots=1),
    dict(bytes_per_page=4096, num_slots=-1),
])
def test_invalid_layout_raises(fields):
    """A negative count and a zero page size are refused at construction."""
    with pytest.raises(ValueError):
        SlotLayout(**fields)


def test_non_int_layout_field_raises():
    """A float field is refused (byte offsets are exact)."""
    with pytest.raises(TypeError):
        SlotLayout(bytes_per_page=4096.0, num_slots=1)
