"""The paged decode attention kernel against the torch reference: on CPU under the Triton
interpreter (TRITON_INTERPRET=1 must be set before triton is imported, so these start a process
of their own), and compiled on CUDA (marked ``gpu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bench.engine.attention import paged_decode_attention, paged_decode_attention_torch

REPO_ROOT = Path(__file__).resolve().parents[3]

# (query heads, KV heads, head dim, block size, context lengths): GQA, MQA and MHA groups, a
# group of 3 (padded), a block size that is no power of two, contexts of one token, of exactly a
# block, of a block and one, and spanning many kernel tiles.
CASES = [
    (4, 2, 16, 16, [1, 16, 17, 100]),
    (8, 1, 32, 5, [3, 64, 65, 129]),
    (8, 8, 16, 32, [200, 7]),
    (12, 4, 64, 16, [1000]),
]


def decode_case(seed: int, case, dtype: torch.dtype, device: str):
    """Random q and KV, each request's blocks scattered over the cache in random order; returns
    (kernel output, reference output)."""
    num_heads, num_kv_heads, head_dim, block_size, context_lens = case
    generator = torch.Generator().manual_seed(seed)
    blocks_per_request = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_request) + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(context_lens), max(blocks_per_request), dtype=torch.int32)
    for i, n in enumerate(blocks_per_request):
        block_tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    kv_cache, q = kv_cache.to(device, dtype), q.to(device, dtype)
    block_tables = block_tables.to(device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    return (paged_decode_attention(q, kv_cache, block_tables, lens, scale),
            paged_decode_attention_torch(q, kv_cache, block_tables, lens, scale))


def run_interpreted(script: str, *args: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_kernel_matches_the_reference_under_the_triton_interpreter():
    """Under the Triton interpreter (fp32), the kernel's output equals the reference's within
    1e-5 for every case."""
    differences = run_interpreted("""
        import json
        import torch
        from bench.tests.engine.test_paged_decode import CASES, decode_case
        differences = []
        for seed, case in enumerate(CASES):
            out, ref = decode_case(3000 + seed, case, torch.float32, "cpu")
            differences.append((out - ref).abs().max().item())
        print(json.dumps({"differences": differences}))
    """)["differences"]
    for seed, (case, difference) in enumerate(zip(CASES, differences)):
        assert difference < 1e-5, f"seed {3000 + seed}, case {case}: differs by {difference}"


def test_the_engine_on_the_kernel_matches_transformers_under_the_triton_interpreter(tmp_path):
    """The engine decoding with the Triton kernel (interpreted, fp32) gets transformers' greedy
    tokens, its logits within 1e-4, with requests batched and one of them on a prefix-cache hit."""
    result = run_interpreted("""
        import json, sys
        import torch
        from bench.tests.engine.reference import engine_on, hf_greedy, hf_model, random_prompt
        seed = 3100
        hf = hf_model(seed)
        engine = engine_on(hf, sys.argv[1], decode_backend="triton", keep_logits=True)
        generator = torch.Generator().manual_seed(seed)
        shared = random_prompt(generator, 40)
        prompts = [shared + random_prompt(generator, 9), random_prompt(generator, 17)]
        engine.generate([shared], 1)
        requests = engine.generate(prompts, 6)
        expected = [hf_greedy(hf, p, 6) for p in prompts]
        print(json.dumps({
            "tokens_equal": [r.output_token_ids == e[0] for r, e in zip(requests, expected)],
            "differences": [(torch.stack(r.logits) - e[1]).abs().max().item() for r, e in zip(requests, expected)],
            "cached": [r.num_cached_tokens for r in requests],
        }))
    """, str(tmp_path))
    assert result["cached"] == [32, 0], "seed 3100: the shared prefix was not hit"
    assert result["tokens_equal"] == [True, True], "seed 3100"
    assert max(result["differences"]) < 1e-4, f"seed 3100: logits differ by {result['differences']}"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter is on in this process")
def test_the_kernel_on_cpu_without_the_interpreter_is_refused():
    """Without TRITON_INTERPRET=1 the kernel refuses CPU tensors with an error that says so."""
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        decode_case(3200, CASES[0], torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_compiled_kernel_matches_the_reference_on_cuda(dtype):
    """On CUDA the compiled kernel equals the reference: within 1e-5 in fp32 (IEEE dots), within
    bf16 rounding (2e-2) in bf16."""
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for seed, case in enumerate(CASES):
        out, ref = decode_case(3300 + seed, case, dtype, "cuda")
        difference = (out.float() - ref.float()).abs().max().item()
        assert difference < tolerance, f"seed {3300 + seed}, case {case}: differs by {difference}"
