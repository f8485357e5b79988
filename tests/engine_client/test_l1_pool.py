"""The L1 pool's tensor layout and page allocator, and the dtype names it accepts."""

from __future__ import annotations

import random

import pytest
import torch

from engine_client.dtypes import torch_dtype
from engine_client.l1_pool import L1Pool
from proto.messages import DTYPE_ITEMSIZE, KVGeometry


def make_geometry(dtype: str = "bfloat16") -> KVGeometry:
    return KVGeometry(model_id="test-model", num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=4)


@pytest.mark.parametrize("name", sorted(DTYPE_ITEMSIZE))
def test_torch_dtype_maps_every_wire_dtype_to_a_torch_dtype_of_the_same_width(name):
    """Each wire dtype name maps to the torch dtype of that name, whose itemsize matches the wire's."""
    dtype = torch_dtype(name)
    assert dtype == getattr(torch, name)
    assert dtype.itemsize == DTYPE_ITEMSIZE[name]


@pytest.mark.parametrize("name", ["int8", "float64", "torch.bfloat16", ""])
def test_torch_dtype_rejects_names_outside_the_wire_contract(name):
    """A dtype name the wire contract does not list raises ValueError."""
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        torch_dtype(name)


@pytest.mark.parametrize("dtype", sorted(DTYPE_ITEMSIZE))
def test_kv_tensor_has_the_attention_layout_and_dtype(dtype):
    """kv is [2, layers, num_pages, page_size, kv_heads, head_dim] in the geometry's dtype, and one page
    spans bytes_per_page."""
    geometry = make_geometry(dtype)
    pool = L1Pool(geometry, num_pages=5)
    assert tuple(pool.kv.shape) == (2, 3, 5, 4, 2, 8)
    assert pool.kv.dtype == torch_dtype(dtype)
    assert pool.kv[:, :, 0].numel() * pool.kv.element_size() == geometry.bytes_per_page
    pool.check_integrity()


def test_allocate_and_free_account_for_every_page():
    """Allocated pages are distinct, leave the free count, and come back on free."""
    pool = L1Pool(make_geometry(), num_pages=8)
    first = pool.allocate(3)
    second = pool.allocate(5)
    pool.check_integrity()
    assert first is not None and second is not None
    assert sorted(first + second) == list(range(8))
    assert pool.num_free == 0
    assert not pool.can_allocate(1)
    pool.free(first)
    pool.check_integrity()
    assert pool.num_free == 3
    assert all(pool.is_free(page_id) for page_id in first)
    assert not any(pool.is_free(page_id) for page_id in second)


def test_allocate_more_than_free_returns_none_and_takes_nothing():
    """Asking for more pages than are free returns None and leaves the free count unchanged."""
    pool = L1Pool(make_geometry(), num_pages=4)
    assert pool.allocate(3) is not None
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    assert pool.allocate(2) is None
    pool.check_integrity()
    assert pool.num_free == 1


def test_allocate_zero_pages_returns_an_empty_list():
    """allocate(0) succeeds with no pages."""
    pool = L1Pool(make_geometry(), num_pages=2)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


@pytest.mark.parametrize("count", [-1, 1.5, "2"])
def test_bad_page_counts_raise(count):
    """A negative or non-integer page count raises ValueError."""
    pool = L1Pool(make_geometry(), num_pages=2)
    with pytest.raises(ValueError):
        pool.allocate(count)


def test_double_free_raises_and_changes_nothing():
    """Freeing a free page (alone or listed twice) raises ValueError and frees none of the batch."""
    pool = L1Pool(make_geometry(), num_pages=6)
    page_ids = pool.allocate(4)
    assert page_ids is not None
    pool.free(page_ids[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free([page_ids[1], page_ids[0]])
    with pytest.raises(ValueError, match="double free"):
        pool.free([page_ids[2], page_ids[2]])
    pool.check_integrity()
    assert pool.num_free == 3
    assert not pool.is_free(page_ids[1]) and not pool.is_free(page_ids[2])


@pytest.mark.parametrize("bad_page_id", [-1, 6, 100])
def test_out_of_range_free_raises_and_changes_nothing(bad_page_id):
    """Freeing an id outside 0..num_pages-1 raises ValueError and frees none of the batch."""
    pool = L1Pool(make_geometry(), num_pages=6)
    page_ids = pool.allocate(2)
    assert page_ids is not None
    with pytest.raises(ValueError, match="out of range"):
        pool.free([page_ids[0], bad_page_id])
    pool.check_integrity()
    assert pool.num_free == 4 and not pool.is_free(page_ids[0])


def test_random_allocate_free_sequence_keeps_integrity():
    """Under a random mix of allocations and frees the pool's own accounting matches a reference set."""
    rng = random.Random(1234)
    pool = L1Pool(make_geometry(), num_pages=32)
    held: set[int] = set()
    for _ in range(500):
        if held and rng.random() < 0.5:
            batch = rng.sample(sorted(held), rng.randint(1, len(held)))
            pool.free(batch)
            held.difference_update(batch)
        else:
            count = rng.randint(0, 10)
            page_ids = pool.allocate(count)
            if count > 32 - len(held):
                assert page_ids is None
            else:
                assert page_ids is not None and not held.intersection(page_ids)
                held.update(page_ids)
        pool.check_integrity()
        assert pool.num_free == 32 - len(held)


@pytest.mark.parametrize("num_pages", [0, -3, 2.0])
def test_pool_size_must_be_a_positive_integer(num_pages):
    """An L1 pool of zero, negative or non-integer size is refused."""
    with pytest.raises(ValueError):
        L1Pool(make_geometry(), num_pages=num_pages)
