"""Gather and scatter through a segment table, both backends (Triton interpreted on CPU), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_client.block_copy import BACKENDS, SegmentTable, gather_triton, scatter_triton, triton_available
from engine_client.layout import describe_layout

L, N, P, H, D = 3, 9, 4, 2, 8
SEED = 20261201


def random_bits(shape, generator, dtype=torch.bfloat16) -> torch.Tensor:
    """Random bits, NaN and infinity patterns included (never zeros)."""
    return torch.randint(-2**15, 2**15, shape, generator=generator, dtype=torch.int16).view(dtype)


def make_case(name: str, generator):
    """(kind, tensors as the engine holds them, page_of(block) -> the L2 page's bytes, reference)."""
    if name == "pool":
        pool = random_bits((2, L, N, P, H, D), generator)
        return "pool", pool, lambda b: pool[:, :, b].contiguous().view(torch.uint8).reshape(-1)
    if name == "layer":
        layers = [random_bits((2, N, P, H, D), generator) for _ in range(L)]
        return "layer", layers, lambda b: torch.stack([layers[l][kv, b] for kv in range(2) for l in range(L)]
                                                      ).view(torch.uint8).reshape(-1)
    if name == "layer_hnd":    # vLLM's HND stride order: the view is [2, N, P, H, D], memory [2, N, H, P, D]
        physical = [random_bits((2, N, H, P, D), generator) for _ in range(L)]
        return "layer", [t.transpose(2, 3) for t in physical], lambda b: torch.stack(
            [physical[l][kv, b] for kv in range(2) for l in range(L)]).view(torch.uint8).reshape(-1)
    if name == "blocks":
        layers = [random_bits((N, 2, H, P, D), generator) for _ in range(L)]
        return "blocks", layers, lambda b: torch.stack([layers[l][b] for l in range(L)]).view(torch.uint8).reshape(-1)
    if name == "blocks_padded":  # opaque fp8 blocks of 520 bytes 528 bytes apart
        full = [random_bits((N, 264), generator).view(torch.float8_e4m3fn) for _ in range(L)]
        layers = [t.view(torch.uint8)[:, :520].view(torch.float8_e4m3fn) for t in full]
        return "blocks", layers, lambda b: torch.stack([layers[l][b] for l in range(L)]).view(torch.uint8).reshape(-1)
    raise AssertionError(name)


CASES = ["pool", "layer", "layer_hnd", "blocks", "blocks_padded"]
BACKEND_NAMES = ["torch"] + (["triton"] if triton_available() else [])


def snapshot(tensors) -> list[torch.Tensor]:
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("case", CASES)
def test_gather_packs_each_block_as_its_l2_page(case, backend):
    """Page i of the packed buffer holds block block_ids[i] of every segment, in the L2 page order
    ([2, L, *block] or [L, *block]), bit for bit, for random blocks in random order."""
    generator = torch.Generator().manual_seed(SEED)
    kind, tensors, page_of = make_case(case, generator)
    table = SegmentTable(describe_layout(kind, tensors))
    block_ids = np.random.default_rng(SEED).permutation(N)[:5]
    packed = torch.empty(table.packed_shape(5), dtype=table.word_dtype)
    BACKENDS[backend][0](table, torch.from_numpy(block_ids).to(torch.int32), packed)
    for i, block in enumerate(block_ids):
        assert torch.equal(packed[i].view(torch.uint8).reshape(-1), page_of(block)), (case, backend, SEED, block)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("case", CASES)
def test_scatter_writes_exactly_the_named_blocks(case, backend):
    """A scatter of random pages writes them into the named blocks (a gather of those blocks gives
    them back bit for bit) and leaves every other block's bytes as they were."""
    generator = torch.Generator().manual_seed(SEED + 1)
    kind, tensors, page_of = make_case(case, generator)
    table = SegmentTable(describe_layout(kind, tensors))
    rng = np.random.default_rng(SEED + 1)
    block_ids = rng.permutation(N)[:4]
    num_bytes = 4 * table.num_segments * table.segment_words * table.word_bytes
    pages = torch.from_numpy(rng.integers(0, 256, size=num_bytes, dtype=np.uint8))
    packed = pages.view(table.word_dtype).view(table.packed_shape(4))
    before = [page_of(b).clone() for b in range(N)]
    BACKENDS[backend][1](table, packed, torch.from_numpy(block_ids))
    for block in range(N):
        if block in block_ids:
            i = int(np.flatnonzero(block_ids == block)[0])
            assert torch.equal(page_of(block), packed[i].view(torch.uint8).reshape(-1)), (case, backend, block)
        else:
            assert torch.equal(page_of(block), before[block]), (case, backend, block)


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize("bad", ["dtype", "shape", "strided", "ids_2d", "ids_float"])
def test_the_triton_wrappers_check_before_they_launch(bad):
    """Wrong word dtype, a shape that is not [n, S, words], a non-contiguous buffer, 2-D or float
    block ids: refused with TypeError/ValueError, and no engine byte changes."""
    generator = torch.Generator().manual_seed(SEED + 2)
    kind, tensors, _ = make_case("layer", generator)
    table = SegmentTable(describe_layout(kind, tensors))
    before = snapshot(tensors)
    ids = torch.tensor([1, 2], dtype=torch.int32)
    packed = torch.zeros(table.packed_shape(2), dtype=table.word_dtype)
    if bad == "dtype":
        packed = packed.view(torch.int32)
    elif bad == "shape":
        packed = packed[:, :-1].contiguous()
    elif bad == "strided":
        packed = torch.zeros((2, table.num_segments, 2 * table.segment_words), dtype=table.word_dtype)[..., ::2]
    elif bad == "ids_2d":
        ids = ids.view(2, 1)
    else:
        ids = ids.float()
    for call in (lambda: gather_triton(table, ids, packed), lambda: scatter_triton(table, packed, ids)):
        with pytest.raises((TypeError, ValueError)):
            call()
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(tensors, before))
