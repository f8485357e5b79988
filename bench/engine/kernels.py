"""Fused element-wise kernels of the decoder layer (Triton), with the torch code they replace.

A layer's norms, q/k norms, RoPE and SwiGLU are ~45 small kernels in torch; on a forward of few
tokens (a decode batch, a suffix after a restore) their launches and their each ~2-3 us of GPU
time cost more than the matrix products. Here they are four kernels, computing what the torch
code computes, rounding where it rounds (the norms in fp32, cast back, then times the weight in
the activations' dtype; RoPE's products rounded before their sum; SiLU rounded before the
product), as transformers' Qwen3 does:

    rms_norm(x, w, eps, residual)   [residual + x ->] RMSNorm; returns (normed, the sum)
    qk_norm_rope(qkv, ...)          q/k RMSNorm per head and RoPE, q, k, v out of the QKV product
    silu_mul(gate_up)               SiLU(gate) * up

On CUDA the model calls these; on CPU the torch code below runs (``*_torch``); the kernels run
on CPU tensors too under the Triton interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import triton
import triton.language as tl


# ---- the torch code (CPU, and the reference) --------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos, sin [T, 1, D] (each frequency twice, as transformers lays them out)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope_torch(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                       cos: torch.Tensor, sin: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int):
    num_tokens, head_dim = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    if q_weight is not None:
        q, k = rms_norm_torch(q, q_weight, eps), rms_norm_torch(k, k_weight, eps)
    return rope_torch(q, cos, sin), rope_torch(k, cos, sin), v.view(num_tokens, num_kv_heads, head_dim)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


# ---- the kernels --------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, eps, n_cols,
                     stride_x, stride_r, stride_o, stride_s, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
             ).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, 0) / n_cols + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _round(x, dtype):
    """x (fp32) rounded to dtype, and back to fp32: where the torch code rounds."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _norm_rope_head(x_ptr, out_ptr, weight_ptr, cos_ptr, sin_ptr, eps, dtype: tl.constexpr,
                    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    """One head: RMSNorm (NORM), then RoPE over its halves x1, x2 (rotated = -x2, x1)."""
    lo = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + lo).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + lo).to(tl.float32)
    if NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HEAD_DIM + eps)
        x1 = _round(tl.load(weight_ptr + lo).to(tl.float32) * _round(x1 * inv, dtype), dtype)
        x2 = _round(tl.load(weight_ptr + HALF + lo).to(tl.float32) * _round(x2 * inv, dtype), dtype)
    cos1 = tl.load(cos_ptr + lo).to(tl.float32)
    cos2 = tl.load(cos_ptr + HALF + lo).to(tl.float32)
    sin1 = tl.load(sin_ptr + lo).to(tl.float32)
    sin2 = tl.load(sin_ptr + HALF + lo).to(tl.float32)
    tl.store(out_ptr + lo, (_round(x1 * cos1, dtype) + _round(-x2 * sin1, dtype)).to(dtype))
    tl.store(out_ptr + HALF + lo, (_round(x2 * cos2, dtype) + _round(x1 * sin2, dtype)).to(dtype))


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, eps,
                         stride_qkv, stride_cos, stride_q, stride_qh, stride_k, stride_kh, stride_v, stride_vh,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HALF: tl.constexpr, NORM: tl.constexpr):
    # One program per (token, head of q, k or v): heads [0, Hq) are q's, then Hkv of k, then Hkv of v.
    token = tl.program_id(0)
    head = tl.program_id(1)
    x_ptr = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    cos_ptr += token * stride_cos
    sin_ptr += token * stride_cos
    dtype = q_ptr.dtype.element_ty
    if head < NUM_HEADS:
        _norm_rope_head(x_ptr, q_ptr + token * stride_q + head * stride_qh, q_weight_ptr, cos_ptr, sin_ptr, eps,
                        dtype, HEAD_DIM, HALF, NORM)
    elif head < NUM_HEADS + NUM_KV_HEADS:
        _norm_rope_head(x_ptr, k_ptr + token * stride_k + (head - NUM_HEADS) * stride_kh, k_weight_ptr, cos_ptr,
                        sin_ptr, eps, dtype, HEAD_DIM, HALF, NORM)
    else:
        dims = tl.arange(0, HEAD_DIM)
        tl.store(v_ptr + token * stride_v + (head - NUM_HEADS - NUM_KV_HEADS) * stride_vh + dims,
                 tl.load(x_ptr + dims))


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n_cols, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the last dimension of (residual + x): (normed, residual + x) (x itself without
    a residual)."""
    rows = _rows(x)
    out = torch.empty_like(rows)
    total = torch.empty_like(rows) if residual is not None else rows
    res = _rows(residual) if residual is not None else rows
    n_cols = rows.shape[1]
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, out, total, eps, n_cols, rows.stride(0), res.stride(0),
                                           out.stride(0), total.stride(0), HAS_RESIDUAL=residual is not None,
                                           BLOCK=triton.next_power_of_2(n_cols))
    return out.view(x.shape), total.view(x.shape)


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int):
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k and v [T, Hkv, D]; q/k normed (weights given)
    and rotated; cos, sin [T, 1, D] contiguous in D."""
    num_tokens, head_dim = qkv.shape[0], cos.shape[-1]
    if qkv.stride(1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("qkv, cos and sin need a contiguous last dimension, cos and sin the same strides")
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    norm = q_weight is not None
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
            qkv, q_weight if norm else qkv, k_weight if norm else qkv, cos, sin, q, k, v, eps,
            qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2, NORM=norm)
    return q, k, v


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] -> SiLU(gate) * up [T, I]."""
    rows = _rows(gate_up)
    n_cols = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], n_cols, dtype=rows.dtype, device=rows.device)
    block = 1024
    if rows.shape[0]:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(n_cols, block))](rows, out, n_cols, rows.stride(0), out.stride(0),
                                                                       BLOCK=block)
    return out
