"""Gather and scatter through a segment table, and block copies between two tables, both backends
(Triton interpreted on CPU; on CUDA too where there is a GPU), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_client.block_copy import (BACKENDS, SegmentTable, copy_blocks_torch, copy_blocks_triton, gather_triton,
                                      scatter_triton, triton_available)
from engine_client.layout import describe_layout
from kvcached.testing.blocks import distinct_block_pairs, random_bits

L, N, P, H, D = 3, 9, 4, 2, 8
SEED = 20261201


def make_case(name: str, generator, device="cpu"):
    """(kind, tensors as the engine holds them on ``device``, page_of(block) -> the L2 page's bytes,
    reference)."""
    def bits(shape):
        return random_bits(shape, generator, device=device)

    if name == "pool":
        pool = bits((2, L, N, P, H, D))
        return "pool", pool, lambda b: pool[:, :, b].contiguous().view(torch.uint8).reshape(-1)
    if name == "layer":
        layers = [bits((2, N, P, H, D)) for _ in range(L)]
        return "layer", layers, lambda b: torch.stack([layers[l][kv, b] for kv in range(2) for l in range(L)]
                                                      ).view(torch.uint8).reshape(-1)
    if name == "layer_hnd":    # vLLM's HND stride order: the view is [2, N, P, H, D], memory [2, N, H, P, D]
        physical = [bits((2, N, H, P, D)) for _ in range(L)]
        return "layer", [t.transpose(2, 3) for t in physical], lambda b: torch.stack(
            [physical[l][kv, b] for kv in range(2) for l in range(L)]).view(torch.uint8).reshape(-1)
    if name == "blocks":
        layers = [bits((N, 2, H, P, D)) for _ in range(L)]
        return "blocks", layers, lambda b: torch.stack([layers[l][b] for l in range(L)]).view(torch.uint8).reshape(-1)
    if name == "blocks_padded":  # opaque fp8 blocks of 520 bytes 528 bytes apart
        full = [bits((N, 264)).view(torch.float8_e4m3fn) for _ in range(L)]
        layers = [t.view(torch.uint8)[:, :520].view(torch.float8_e4m3fn) for t in full]
        return "blocks", layers, lambda b: torch.stack([layers[l][b] for l in range(L)]).view(torch.uint8).reshape(-1)
    if name == "blocks_dense":   # the same blocks of 520 bytes, side by side
        layers = [bits((N, 260)).view(torch.float8_e4m3fn) for _ in range(L)]
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


# Layouts of one page format: each with itself, the two "kv" kinds (one tensor, one per layer) with
# each other (a peer may hold its blocks in either), and blocks of one size at two block strides.
COPY_PAIRS = [(case, case) for case in CASES] + [("pool", "layer"), ("layer", "pool"),
                                                 ("blocks_padded", "blocks_dense"), ("blocks_dense", "blocks_padded")]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("source_case,target_case", COPY_PAIRS)
def test_a_block_copy_moves_each_source_block_into_its_target_block(source_case, target_case, backend, device,
                                                                    seed):
    """A block copy from one engine's tensors into another's (two sets of tensors, of one page format,
    of the same layout kind or the other "kv" one) gives target block block_ids[i] the bytes of source
    block source_block_ids[i] in every segment, bit for bit, for random blocks each copied into another
    block number; every other target block, and every source block, keeps its bytes."""
    generator = torch.Generator().manual_seed(seed)
    source_kind, source_tensors, source_page = make_case(source_case, generator, device)
    target_kind, target_tensors, target_page = make_case(target_case, generator, device)
    source = SegmentTable(describe_layout(source_kind, source_tensors))
    target = SegmentTable(describe_layout(target_kind, target_tensors))
    source_ids, block_ids = distinct_block_pairs(np.random.default_rng(seed), 5, N)
    source_before = [source_page(b).clone() for b in range(N)]
    target_before = [target_page(b).clone() for b in range(N)]
    BACKENDS[backend].copy_blocks(source, torch.from_numpy(source_ids).to(device), target,
                                  torch.from_numpy(block_ids).to(torch.int32).to(device))
    for block in range(N):
        if block in block_ids:
            expected = source_before[int(source_ids[np.flatnonzero(block_ids == block)[0]])]
        else:
            expected = target_before[block]
        assert torch.equal(target_page(block), expected), (source_case, target_case, backend, seed, block)
        assert torch.equal(source_page(block), source_before[block]), (source_case, backend, seed, block)


@pytest.mark.parametrize("copy_blocks", [copy_blocks_torch] + ([copy_blocks_triton] if triton_available() else []))
@pytest.mark.parametrize("bad", ["segments", "words", "word_size", "count", "ids_float", "ids_2d"])
def test_a_block_copy_of_other_pages_or_bad_ids_is_refused(bad, copy_blocks, seed):
    """A source table with other pages than the target's (one layer's segments of all, segments of
    twice the words, the same bytes in 2-byte words), ids of two lengths, float or 2-D ids: refused
    with TypeError/ValueError, and no byte of the source or the target changes."""
    generator = torch.Generator().manual_seed(seed)
    _, source_tensors, _ = make_case("layer", generator)
    _, target_tensors, _ = make_case("layer", generator)
    source_layout = describe_layout("layer", source_tensors)
    source = SegmentTable(source_layout)
    target = SegmentTable(describe_layout("layer", target_tensors))
    source_ids, block_ids = torch.tensor([1, 2]), torch.tensor([3, 4])
    if bad == "segments":
        source = SegmentTable(source_layout, source_layout.layer_segments(0))
    elif bad == "words":
        source_tensors = [random_bits((2, N, P, H, 2 * D), generator) for _ in range(L)]
        source = SegmentTable(describe_layout("layer", source_tensors))
    elif bad == "word_size":        # each tensor starts 2 bytes into its storage
        source_tensors = [random_bits((2 * N * P * H * D + 1,), generator)[1:].view(2, N, P, H, D) for _ in range(L)]
        source = SegmentTable(describe_layout("layer", source_tensors))
        assert source.segment_words * source.word_bytes == target.segment_words * target.word_bytes
        assert source.word_bytes == 2 and target.word_bytes == 8
    elif bad == "count":
        block_ids = torch.tensor([3, 4, 5])
    elif bad == "ids_float":
        block_ids = block_ids.float()
    else:
        source_ids, block_ids = source_ids.view(2, 1), block_ids.view(2, 1)
    before = snapshot(source_tensors) + snapshot(target_tensors)
    with pytest.raises((TypeError, ValueError)):
        copy_blocks(source, source_ids, target, block_ids)
    after = snapshot(source_tensors) + snapshot(target_tensors)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(after, before)), (bad, seed)
