"""The paged prefill attention kernel (a few new rows over a cached prefix, read from the blocks
in place) against a dense causal reference: on CPU under the Triton interpreter (a process of its
own, TRITON_INTERPRET=1 set before triton is imported), and compiled on CUDA (marked ``gpu``)."""

from __future__ import annotations

import pytest
import torch

from bench.engine.attention import PagedPrefill, PrefillSeq, paged_prefill_attention, paged_prefill_batch
from bench.tests.engine.test_paged_decode import run_interpreted

# (query heads, KV heads, head dim, block size, cached tokens, new rows): GQA groups of 4 (the
# Qwen3 shapes) and 3 (padded), MQA and MHA; no prefix (few rows, many), a prefix of one token, of
# exactly a block, of a block and one, spanning many tiles; one new row, rows within one program
# and across several (a group of 4 takes 16 rows a program), a block size that is no power of two.
CASES = [
    (8, 2, 16, 16, 0, 5),
    (8, 2, 16, 16, 0, 40),
    (8, 2, 16, 16, 1, 1),
    (12, 4, 32, 16, 16, 17),
    (6, 2, 16, 5, 17, 40),
    (4, 1, 16, 16, 100, 64),
    (4, 4, 64, 16, 1000, 44),
    (16, 4, 16, 32, 333, 33),
]


def reference(q, kv_cache, block_table, num_cached):
    """Row i at position c + i over tokens [0, c + i], the K/V copied out dense, in fp64."""
    num_new, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_tokens = num_cached + num_new
    blocks = block_table[: -(-num_tokens // block_size)].long()
    k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:num_tokens].double()
    v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:num_tokens].double()
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # [T, Hq, D]
    scores = torch.einsum("nhd,thd->hnt", q.double(), k) * head_dim ** -0.5
    seen = torch.arange(num_tokens)[None, :] <= (num_cached + torch.arange(num_new))[:, None]
    scores = scores.masked_fill(~seen[None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", scores.softmax(-1), v)


def prefill_case(seed: int, case, dtype: torch.dtype, device: str, num_splits: int | None = None,
                 tile_tokens: int = 64):
    """Random q and KV, the request's blocks scattered over the cache in random order, q a slice of
    a wider tensor (the batch's rows), the context in num_splits parts (None: the default); returns
    (kernel output, reference output)."""
    num_heads, num_kv_heads, head_dim, block_size, num_cached, num_new = case
    generator = torch.Generator().manual_seed(seed)
    num_request_blocks = -(-(num_cached + num_new) // block_size)
    num_blocks = num_request_blocks + 5
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    batch_q = torch.randn(num_new + 7, num_heads, head_dim, generator=generator)
    block_table = torch.randperm(num_blocks, generator=generator)[:num_request_blocks].to(torch.int32)
    kv_cache, batch_q = kv_cache.to(dtype), batch_q.to(dtype)      # the reference of the rounded inputs
    expected = reference(batch_q[3: 3 + num_new], kv_cache, block_table, num_cached)
    kv_cache, batch_q, block_table = kv_cache.to(device), batch_q.to(device), block_table.to(device)
    out = paged_prefill_attention(batch_q[3: 3 + num_new], kv_cache, block_table, num_cached, head_dim ** -0.5,
                                  tile_tokens=tile_tokens, num_splits=num_splits)
    return out.cpu().double(), expected


# (parts of the context, tokens per tile): one part, the default number, and more parts than some
# row blocks see tokens of; with 16-token tiles as well, so that short contexts (padded groups, no
# prefix) go in several parts too (a part is a whole number of tiles).
SPLITS = [(1, 64), (None, 64), (7, 64), (7, 16)]


def test_the_kernel_matches_a_dense_causal_reference_under_the_triton_interpreter():
    """Under the Triton interpreter (fp32), the kernel's output equals the dense causal
    reference's within 1e-5 for every case, with the context in one part, in the default number
    of parts, and in 7 (splits that some rows see nothing of), the last also with 16-token tiles."""
    differences = run_interpreted("""
        import json
        import torch
        from bench.tests.engine.test_paged_prefill import CASES, SPLITS, prefill_case
        differences = []
        for seed, case in enumerate(CASES):
            for splits, tile in SPLITS:
                out, ref = prefill_case(3400 + seed, case, torch.float32, "cpu", splits, tile)
                differences.append((out - ref).abs().max().item())
        print(json.dumps({"differences": differences}))
    """)["differences"]
    runs = [(seed, case, split) for seed, case in enumerate(CASES) for split in SPLITS]
    for (seed, case, splits), difference in zip(runs, differences, strict=True):
        assert difference < 1e-5, f"seed {3400 + seed}, case {case}, (splits, tile) {splits}: differs by {difference}"


# Batches of paged requests in one launch: (query heads, KV heads, head dim, block size) and per
# request (cached tokens, new rows): restored suffixes of several lengths over prefixes of several
# lengths (one of them spanning many splits, one a single row, one with no prefix), GQA padded.
BATCHES = [
    ((8, 2, 16, 16), [(352, 14), (17, 1), (100, 64), (0, 5)]),
    ((6, 2, 16, 5), [(40, 30), (3, 2), (121, 9)]),
]
GAP_ROWS = 3              # rows of other (not paged) requests before each paged one: never written


def batch_case(seed: int, batch, dtype: torch.dtype, device: str, num_splits: int | None = None,
               tile_tokens: int = 64):
    """Random q and KV, each request's blocks scattered over one cache in random order, its rows
    after GAP_ROWS rows of another request; out full of a sentinel before the launch. Returns, per
    request, (its rows of out, the reference), and whether the other rows kept the sentinel."""
    (num_heads, num_kv_heads, head_dim, block_size), requests = batch
    generator = torch.Generator().manual_seed(seed)
    blocks_each = [-(-(cached + new) // block_size) for cached, new in requests]
    num_blocks = sum(blocks_each) + 5
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    num_rows = sum(GAP_ROWS + new for _, new in requests) + GAP_ROWS
    q = torch.randn(num_rows, num_heads, head_dim, generator=generator).to(dtype)
    seqs, expected, first_block, start = [], [], 0, GAP_ROWS
    for (cached, new), count in zip(requests, blocks_each):
        table = order[first_block: first_block + count]
        expected.append(reference(q[start: start + new], kv_cache, table, cached))
        seqs.append(PrefillSeq(start, new, cached, table.to(device), True))
        first_block, start = first_block + count, start + new + GAP_ROWS
    sentinel = torch.full_like(q, 7.0).to(device)
    out = sentinel.clone()
    paged_prefill_batch(q.to(device), kv_cache.to(device), PagedPrefill(seqs), head_dim ** -0.5, out,
                        tile_tokens=tile_tokens, num_splits=num_splits)
    written = torch.zeros(num_rows, dtype=torch.bool)
    for seq in seqs:
        written[seq.start: seq.start + seq.num_new_tokens] = True
    untouched = bool(torch.equal(out[~written.to(device)], sentinel[~written.to(device)]))
    return [(out[s.start: s.start + s.num_new_tokens].cpu().double(), ref) for s, ref in zip(seqs, expected)], untouched


def test_a_batch_of_requests_in_one_launch_matches_the_reference_under_the_triton_interpreter():
    """Under the Triton interpreter (fp32), each request of a batch launched together equals the
    dense causal reference of its own prefix and rows within 1e-5, in one part, the default number
    of parts and 7 (of 16-token tiles), and the rows of the batch's other requests are not written."""
    results = run_interpreted("""
        import json
        import torch
        from bench.tests.engine.test_paged_prefill import BATCHES, batch_case
        results = []
        for seed, batch in enumerate(BATCHES):
            for splits, tile in [(1, 64), (None, 64), (7, 16)]:
                pairs, untouched = batch_case(3600 + seed, batch, torch.float32, "cpu", splits, tile)
                results.append({"differences": [(out - ref).abs().max().item() for out, ref in pairs],
                                "untouched": untouched})
        print(json.dumps({"results": results}))
    """)["results"]
    runs = [(seed, batch, split) for seed, batch in enumerate(BATCHES) for split in ((1, 64), (None, 64), (7, 16))]
    for (seed, batch, splits), result in zip(runs, results, strict=True):
        assert result["untouched"], f"seed {3600 + seed}, {batch}, {splits}: another request's rows were written"
        for request, difference in zip(batch[1], result["differences"], strict=True):
            assert difference < 1e-5, \
                f"seed {3600 + seed}, {batch}, request {request}, {splits}: differs by {difference}"


def test_a_block_table_too_short_for_the_rows_is_refused():
    """A block table that does not cover the cached tokens and the new rows is refused, naming it."""
    kv_cache = torch.zeros(2, 4, 16, 2, 16)
    with pytest.raises(ValueError, match="block_table"):
        paged_prefill_attention(torch.zeros(5, 4, 16), kv_cache, torch.zeros(2, dtype=torch.int32), 30, 0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_compiled_batch_matches_the_reference_on_cuda(dtype):
    """On CUDA each request of a batch launched together equals its reference (within 1e-5 in fp32,
    bf16 rounding in bf16), and the other requests' rows are not written."""
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for seed, batch in enumerate(BATCHES):
        for splits, tile in [(1, 64), (None, 64), (7, 16)]:
            pairs, untouched = batch_case(3700 + seed, batch, dtype, "cuda", splits, tile)
            assert untouched, f"seed {3700 + seed}, {batch}, {splits}: another request's rows were written"
            for request, (out, ref) in zip(batch[1], pairs, strict=True):
                difference = (out - ref).abs().max().item()
                assert difference < tolerance, f"seed {3700 + seed}, {batch}, {request}, {splits}: {difference}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_compiled_kernel_matches_the_reference_on_cuda(dtype):
    """On CUDA the compiled kernel equals the reference, in each number of parts: within 1e-5 in
    fp32 (IEEE dots), within bf16 rounding (3e-2) in bf16."""
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for seed, case in enumerate(CASES):
        for splits, tile in SPLITS:
            out, ref = prefill_case(3500 + seed, case, dtype, "cuda", splits, tile)
            difference = (out - ref).abs().max().item()
            assert difference < tolerance, f"seed {3500 + seed}, case {case}, {splits} splits, tile {tile}, {dtype}: " \
                                           f"differs by {difference}"
