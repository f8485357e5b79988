"""The fused element-wise kernels (bench/engine/kernels.py) against the torch code they replace:
under the Triton interpreter on CPU (a process of its own, as TRITON_INTERPRET=1 must be set
before triton is imported), and compiled on CUDA (marked ``gpu``)."""

from __future__ import annotations

import pytest
import torch

from bench.engine import kernels
from bench.tests.engine.test_paged_decode import run_interpreted

# (tokens, query heads, KV heads, head dim, hidden, intermediate): GQA and MHA; rows and widths
# that are no power of two, and an intermediate size past one kernel block.
SHAPES = [(5, 4, 2, 16, 64, 160), (3, 8, 8, 32, 96, 1500)]


def kernel_differences(seed: int, shape, dtype: torch.dtype, device: str, qk_norm: bool = True) -> dict:
    """Each kernel and its torch code on the same random inputs (a QKV product's rows, random
    norm weights, RoPE angles of random positions); the largest difference of each output, in
    units of its largest magnitude."""
    tokens, num_heads, num_kv_heads, head_dim, hidden, intermediate = shape
    g = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=g).to(device, dtype)

    x, residual, weight = randn(tokens, hidden), randn(tokens, hidden), 1 + 0.1 * randn(hidden)
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    q_weight, k_weight = (1 + 0.1 * randn(head_dim), 1 + 0.1 * randn(head_dim)) if qk_norm else (None, None)
    angles = torch.randint(0, 4000, (tokens, 1, 1), generator=g) * (
        1e4 ** (-torch.arange(0, head_dim // 2) / (head_dim // 2)))
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    gate_up = randn(tokens, 2 * intermediate)

    def diff(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    normed, total = kernels.rms_norm(x, weight, 1e-6, residual=residual)
    alone, same = kernels.rms_norm(x, weight, 1e-6)
    q, k, v = kernels.qk_norm_rope(qkv, q_weight, k_weight, cos, sin, 1e-6, num_heads, num_kv_heads)
    rq, rk, rv = kernels.qk_norm_rope_torch(qkv, q_weight, k_weight, cos, sin, 1e-6, num_heads, num_kv_heads)
    return {
        "sum": diff(total, residual + x),
        "norm_residual": diff(normed, kernels.rms_norm_torch(residual + x, weight, 1e-6)),
        "norm": diff(alone, kernels.rms_norm_torch(x, weight, 1e-6)),
        "norm_returns_input": bool(same.data_ptr() == x.data_ptr() or torch.equal(same, x)),
        "q": diff(q, rq), "k": diff(k, rk), "v_equal": bool(torch.equal(v, rv)),
        "silu_mul": diff(kernels.silu_mul(gate_up), kernels.silu_mul_torch(gate_up)),
    }


def check(result: dict, bound: float, what: str) -> None:
    assert result["v_equal"] and result["norm_returns_input"], what
    for name in ("sum", "norm_residual", "norm", "q", "k", "silu_mul"):
        assert result[name] <= bound, f"{what}: {name} differs by {result[name]} of its largest value"


def test_the_kernels_compute_the_torch_code_under_the_triton_interpreter():
    """Under the Triton interpreter in fp32, every kernel's output equals its torch code's within
    1e-5 of the output's largest value, on every shape, with and without the q/k norms."""
    results = run_interpreted("""
        import json
        import torch
        from bench.tests.engine.test_kernels import SHAPES, kernel_differences
        print(json.dumps([kernel_differences(3200 + i, shape, torch.float32, "cpu", qk_norm)
                          for i, shape in enumerate(SHAPES) for qk_norm in (True, False)]))
    """)
    cases = [(i, shape, qk_norm) for i, shape in enumerate(SHAPES) for qk_norm in (True, False)]
    for (i, shape, qk_norm), result in zip(cases, results, strict=True):
        check(result, 1e-5, f"seed {3200 + i}, shape {shape}, qk_norm {qk_norm}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_kernels_compute_the_torch_code(dtype):
    """Compiled on CUDA, every kernel's output equals its torch code's within rounding: 1e-5 of
    the largest value in fp32, one bf16 step (2^-7 of it) in bf16."""
    bound = 1e-5 if dtype == torch.float32 else 2 ** -7
    for i, shape in enumerate(SHAPES + [(40, 32, 8, 128, 4096, 12288)]):
        for qk_norm in (True, False):
            check(kernel_differences(3300 + i, shape, dtype, "cuda", qk_norm), bound,
                  f"seed {3300 + i}, shape {shape}, {dtype}, qk_norm {qk_norm}")
