"""Attention over the paged KV cache: one KV tensor per layer, ``[2, num_blocks, block_size,
kv_heads, head_dim]`` (K then V), a request's tokens in the blocks of its block table.

- ``store_kv``: the step's new K/V into their slots (``block * block_size + offset``).
- ``prefill_attention``: torch SDPA per request over its new tokens; with a cached prefix, over
  prefix + new tokens with the causal diagonal at the bottom right (flash / memory-efficient
  kernels on CUDA, the math kernel on CPU); a few new tokens over a cached prefix (the suffix
  after a restore, ``PAGED_PREFILL_MAX_ROWS``) go to ``paged_prefill_batch`` instead: one
  Triton launch per layer for all such requests of the batch, reading their prefixes' blocks in
  place, causal over the new rows.
- ``paged_decode_attention``: one query token per request read straight from the blocks (a
  Triton kernel; on CPU tensors under the Triton interpreter, for tests), and
  ``paged_decode_attention_torch``, the reference, which copies each request's context out dense.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, bias, sdpa_kernel

import triton
import triton.language as tl


class PrefillSeq(NamedTuple):
    """One request's part of a prefill batch: query rows [start, start + num_new_tokens) of the
    batch, num_cached_tokens already in its blocks before them."""

    start: int
    num_new_tokens: int
    num_cached_tokens: int
    block_table: torch.Tensor | None   # int32 [blocks of the request] on the KV device (None: no cached prefix)
    paged: bool = False                # attention through paged_prefill_attention (else SDPA on a dense copy)


# A prefill of few new tokens over a cached prefix (a restored request's suffix) reads the prefix
# through the block table in one launch per layer (``paged_prefill_attention``), where copying the
# prefix out dense for SDPA takes several launches and a copy of the whole context per layer: a
# forward of a few tokens is bound by the host's launches (bench/engine/graphs.py). Each program
# of the kernel reads the whole prefix for its rows, so it pays for few new rows only.
PAGED_PREFILL_MAX_ROWS = 64


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache [2, N, P, H, D]; k, v [T, H, D]; slot_mapping int64 [T]."""
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def fused_sdpa_only(device: torch.device):
    """On CUDA, SDPA limited to its flash and memory-efficient kernels: a prefill that would fall
    back to the math kernel raises instead of running slowly."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      seqs: Sequence[PrefillSeq], scale: float, paged: PagedPrefill | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k, v [T, Hkv, D] (already stored in kv_cache). Returns [T, Hq, D]. The paged
    requests go in one launch (``paged_prefill_batch``; ``paged``: theirs, built once per forward,
    else built here)."""
    if len(seqs) == 1 and seqs[0].num_cached_tokens == 0:
        return _sdpa(q, k, v, 0, scale)
    out = torch.empty_like(q)
    if paged is not None or any(seq.paged for seq in seqs):
        paged_prefill_batch(q, kv_cache, paged or PagedPrefill(seqs), scale, out)
    block_size = kv_cache.shape[2]
    for seq in seqs:
        rows = slice(seq.start, seq.start + seq.num_new_tokens)
        if seq.paged:
            continue
        if seq.num_cached_tokens == 0:
            out[rows] = _sdpa(q[rows], k[rows], v[rows], 0, scale)
            continue
        num_tokens = seq.num_cached_tokens + seq.num_new_tokens
        blocks = seq.block_table[: triton.cdiv(num_tokens, block_size)]
        context_k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:num_tokens]
        context_v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:num_tokens]
        out[rows] = _sdpa(q[rows], context_k, context_v, seq.num_cached_tokens, scale)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached_tokens: int, scale: float) -> torch.Tensor:
    """Causal attention of the n query rows q [n, Hq, D] at positions [c, c + n) over k, v [c + n, Hkv, D]."""
    num_new_tokens = q.shape[0]
    mask = None if num_cached_tokens == 0 else bias.causal_lower_right(num_new_tokens, k.shape[0])
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# ---- decode ---------------------------------------------------------------------------------------


def paged_decode_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference: q [B, Hq, D] (the last token of each request), block_tables int32 [B, M],
    context_lens int32 [B] (tokens in the cache, the query's own included). Returns [B, Hq, D]."""
    block_size = kv_cache.shape[2]
    out = torch.empty_like(q)
    # A reference, not a fast path: the plain math kernel is allowed here even where the engine's
    # forward admits only the fused ones (they take no 3-D inputs).
    with sdpa_kernel([SDPBackend.MATH]):
        for i, num_tokens in enumerate(context_lens.tolist()):
            blocks = block_tables[i, : triton.cdiv(num_tokens, block_size)].long()
            k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:num_tokens]
            v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:num_tokens]
            out[i] = F.scaled_dot_product_attention(q[i][:, None], k.transpose(0, 1), v.transpose(0, 1),
                                                    scale=scale, enable_gqa=True)[:, 0]
    return out


@triton.jit
def _online_softmax_tile(q, k_ptrs, stride_kv, valid, seen, scale, m, l, acc, IEEE: tl.constexpr):
    """One tile of keys into the running softmax (m, l, acc) of the query rows q: K at k_ptrs
    (V stride_kv further), tokens loaded where ``valid``, scores kept where ``seen`` [rows, tile]."""
    k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
    v = tl.load(k_ptrs + stride_kv, mask=valid[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(seen, s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # A row that has seen no token yet (a split of the context before its position) keeps m -inf
    # and sums of 0: exp of -inf - -inf would be NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l, acc * alpha[:, None] + pv


@triton.jit
def _paged_decode_kernel(q_ptr, kv_ptr, out_ptr, block_tables_ptr, context_lens_ptr, scale,
                         stride_qb, stride_qh, stride_kv, stride_block, stride_token, stride_head,
                         stride_ob, stride_oh, stride_table,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr):
    # One program per (request, KV head): the GROUP query heads that share the KV head, online
    # softmax over the context TILE tokens at a time, each token found through the block table.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_tokens = tl.load(context_lens_ptr + seq)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE)
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=offs_g[:, None] < GROUP, other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for tile_start in range(0, num_tokens, TILE):
        tokens = tile_start + offs_t
        valid = tokens < num_tokens
        blocks = tl.load(block_tables_ptr + seq * stride_table + tokens // BLOCK_SIZE, mask=valid, other=0)
        rows = blocks.to(tl.int64) * stride_block + (tokens % BLOCK_SIZE) * stride_token + kv_head * stride_head
        m, l, acc = _online_softmax_tile(q, kv_ptr + rows[:, None] + offs_d[None, :], stride_kv, valid,
                                         valid[None, :], scale, m, l, acc, IEEE)
    out = acc / l[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=offs_g[:, None] < GROUP)


def _kernel_for(kernel, device: torch.device):
    """The compiled kernel on CUDA. On CPU the Triton interpreter runs it, which takes
    TRITON_INTERPRET=1 before triton is imported (the tests start a process so)."""
    if device.type == "cuda":
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    if device.type != "cpu" or not isinstance(kernel, InterpretedFunction):
        raise ValueError(f"the paged attention kernels run on cuda, or on cpu with TRITON_INTERPRET=1 set before "
                         f"triton is imported; not on {device} here")
    return kernel


def _check_paged(q: torch.Tensor, kv_cache: torch.Tensor, tile_tokens: int) -> tuple[int, int, int]:
    """What both paged kernels need of q [rows, Hq, D] and kv_cache [2, N, P, Hkv, D]; returns
    (block size P, KV heads, head dim)."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, N, P, H, D], got {tuple(kv_cache.shape)}")
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be [rows, Hq, {head_dim}] with Hq a multiple of {num_kv_heads}, got {tuple(q.shape)}")
    if q.dtype != kv_cache.dtype or q.device != kv_cache.device:
        raise ValueError(f"q ({q.dtype}, {q.device}) and kv_cache ({kv_cache.dtype}, {kv_cache.device}) differ")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("q and kv_cache need a contiguous head_dim")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if tile_tokens < 16 or tile_tokens & (tile_tokens - 1):
        raise ValueError(f"tile_tokens must be a power of two >= 16, got {tile_tokens}")
    return block_size, num_kv_heads, head_dim


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, tile_tokens: int = 64) -> torch.Tensor:
    """Same contract as ``paged_decode_attention_torch``; reads the blocks in place."""
    block_size, num_kv_heads, head_dim = _check_paged(q, kv_cache, tile_tokens)
    batch = q.shape[0]
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch \
            or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 [{batch}, M] with unit stride, got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (batch,):
        raise ValueError(f"context_lens must be int32 [{batch}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    if block_tables.device != q.device or context_lens.device != q.device:
        raise ValueError("block_tables and context_lens must be on q's device")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = q.shape[1] // num_kv_heads
    _kernel_for(_paged_decode_kernel, q.device)[(batch, num_kv_heads)](
        q, kv_cache, out, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        TILE=tile_tokens, IEEE=q.dtype == torch.float32)
    return out


# ---- prefill over a cached prefix ----------------------------------------------------------------


@triton.jit(do_not_specialize=["max_blocks", "split_tokens", "num_rows"])
def _paged_prefill_kernel(q_ptr, kv_ptr, out_ptr, m_ptr, l_ptr, block_tables_ptr, seqs_ptr, max_blocks, split_tokens,
                          num_rows, scale, stride_qt, stride_qh, stride_kv, stride_block, stride_token, stride_head,
                          stride_ot, stride_oh, stride_table,
                          NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                          BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          TILE: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr):
    # One program per (request and BLOCK_M of its new rows, KV head, split of the context): its
    # rows x the GROUP query heads sharing the KV head as one [BLOCK_M * GROUP_PAD, HEAD_DIM] query
    # tile; online softmax over its split_tokens of the context (up to its last row's), TILE tokens
    # at a time through the request's block table; row i (position num_cached + i) sees the tokens
    # up to its own (causal). A request's entry in seqs_ptr (int32 [requests, 4]): its first row in
    # q and out, its first row among all requests' new rows (num_rows of them), its new rows, its
    # cached tokens. Programs past a request's rows, or splits past its context, compute nothing.
    # PARTIAL (more than one split): the unnormalised sums and their max and sum go to out_ptr
    # [splits, num_rows, Hq, D] (fp32), m_ptr and l_ptr [splits, num_rows, Hq], for
    # _combine_splits_kernel. The ints are not specialised on: nothing compiles per size.
    seq = tl.program_id(0) // max_blocks
    block = tl.program_id(0) % max_blocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(seqs_ptr + seq * 4)
    row_start = tl.load(seqs_ptr + seq * 4 + 1)
    num_new = tl.load(seqs_ptr + seq * 4 + 2)
    num_cached = tl.load(seqs_ptr + seq * 4 + 3)
    offs_r = tl.arange(0, BLOCK_M * GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE)
    rows = block * BLOCK_M + offs_r // GROUP_PAD
    group = offs_r % GROUP_PAD
    valid_rows = (rows < num_new) & (group < GROUP)
    heads = kv_head * GROUP + group
    q = tl.load(q_ptr + (q_start + rows[:, None]) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=valid_rows[:, None], other=0.0)
    positions = num_cached + rows
    start = split * split_tokens
    end = tl.minimum(num_cached + tl.minimum(num_new, (block + 1) * BLOCK_M), start + split_tokens)
    end = tl.where(block * BLOCK_M < num_new, end, start)
    table = block_tables_ptr + seq * stride_table
    m = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], tl.float32)
    for tile_start in range(start, end, TILE):
        tokens = tile_start + offs_t
        valid = tokens < end
        blocks = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0)
        kv_rows = blocks.to(tl.int64) * stride_block + (tokens % BLOCK_SIZE) * stride_token + kv_head * stride_head
        seen = valid[None, :] & (tokens[None, :] <= positions[:, None])   # token 0 is seen by every row
        m, l, acc = _online_softmax_tile(q, kv_ptr + kv_rows[:, None] + offs_d[None, :], stride_kv, valid, seen,
                                         scale, m, l, acc, IEEE)
    if PARTIAL:
        # A split a row sees nothing of: m -inf, l and acc 0 (the combine weighs it 0).
        at = (split * num_rows + row_start + rows) * NUM_HEADS + heads
        tl.store(m_ptr + at, m, mask=valid_rows)
        tl.store(l_ptr + at, l, mask=valid_rows)
        tl.store(out_ptr + at[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=valid_rows[:, None])
    else:
        tl.store(out_ptr + (q_start + rows[:, None]) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=valid_rows[:, None])


@triton.jit(do_not_specialize=["num_splits", "num_rows"])
def _combine_splits_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, row_to_q_ptr, num_splits, num_rows, stride_ot, stride_oh,
                           NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    # One program per new row of any request, all its query heads: the splits' partial sums
    # rescaled to their common max, into the row's place in out (row_to_q_ptr).
    row = tl.program_id(0)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = offs_h < NUM_HEADS
    m_max = tl.full([HEADS_PAD], float("-inf"), tl.float32)
    for split in range(0, num_splits):
        at = (split * num_rows + row) * NUM_HEADS + offs_h
        m_max = tl.maximum(m_max, tl.load(m_ptr + at, mask=heads, other=float("-inf")))
    # Split 0 holds the row's first token, which every row sees: m_max is finite for every head
    # (padding heads aside, kept at 0 here and never stored).
    m_max = tl.where(heads, m_max, 0.0)
    l_sum = tl.zeros([HEADS_PAD], tl.float32)
    acc = tl.zeros([HEADS_PAD, HEAD_DIM], tl.float32)
    for split in range(0, num_splits):
        at = (split * num_rows + row) * NUM_HEADS + offs_h
        weight = tl.exp(tl.load(m_ptr + at, mask=heads, other=float("-inf")) - m_max)
        l_sum += weight * tl.load(l_ptr + at, mask=heads, other=0.0)
        acc += weight[:, None] * tl.load(acc_ptr + at[:, None] * HEAD_DIM + offs_d[None, :], mask=heads[:, None],
                                         other=0.0)
    q_row = tl.load(row_to_q_ptr + row)
    tl.store(out_ptr + q_row * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=heads[:, None])


# The context is split so that a forward's few rows still keep the GPU's SMs busy: at least this
# many programs over (row blocks, KV heads, splits), each split at least PREFILL_SPLIT_MIN_TOKENS.
PREFILL_TARGET_PROGRAMS = 256
PREFILL_SPLIT_MIN_TOKENS = 256


class PagedPrefill:
    """The requests of one prefill forward whose attention goes through ``paged_prefill_batch``
    (``PrefillSeq.paged``): their block tables and rows on the device, built once per forward and
    read by every layer's one launch (and, where the context is split, one more combining the
    splits), where a launch per request and layer left a forward of a few requests' suffixes bound
    by the host's launches."""

    def __init__(self, seqs: Sequence[PrefillSeq]):
        paged = [seq for seq in seqs if seq.paged]
        if not paged:
            raise ValueError("no request of the batch is paged")
        device = paged[0].block_table.device
        width = max(seq.block_table.shape[0] for seq in paged)
        self.block_tables = torch.zeros(len(paged), width, dtype=torch.int32, device=device)
        entries, row_to_q = [], []
        for i, seq in enumerate(paged):
            if seq.num_new_tokens < 1 or seq.num_cached_tokens < 0:
                raise ValueError(f"a paged request needs new rows and no negative prefix, got {seq}")
            table = seq.block_table
            if table.dtype != torch.int32 or table.dim() != 1 or table.stride(0) != 1 or table.device != device:
                raise ValueError(f"block_table must be int32 [M] with unit stride on {device}, got "
                                 f"{table.dtype} {tuple(table.shape)} on {table.device}")
            self.block_tables[i, : table.shape[0]].copy_(table)
            entries.append((seq.start, len(row_to_q), seq.num_new_tokens, seq.num_cached_tokens))
            row_to_q.extend(range(seq.start, seq.start + seq.num_new_tokens))
        self.seqs = paged
        self.num_rows = len(row_to_q)
        self.max_new = max(seq.num_new_tokens for seq in paged)
        self.max_context = max(seq.num_cached_tokens + seq.num_new_tokens for seq in paged)
        self.entries = _small_ints(entries, device)          # int32 [requests, 4]
        self.row_to_q = _small_ints(row_to_q, device)        # int32 [rows]
        self._partials: tuple[torch.Tensor, ...] | None = None

    def partials(self, num_splits: int, num_heads: int, head_dim: int,
                 device: torch.device) -> tuple[torch.Tensor, ...]:
        """The splits' sums, maxes and totals (fp32), kept for the next layer (same shapes)."""
        shape = (num_splits, self.num_rows, num_heads)
        if self._partials is None or tuple(self._partials[1].shape) != shape:
            self._partials = (torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
                              torch.empty(shape, dtype=torch.float32, device=device),
                              torch.empty(shape, dtype=torch.float32, device=device))
        return self._partials


def _small_ints(values, device: torch.device) -> torch.Tensor:
    """int32 values on the device, through pinned memory on CUDA (no host wait)."""
    host = torch.tensor(values, dtype=torch.int32)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def paged_prefill_batch(q: torch.Tensor, kv_cache: torch.Tensor, paged: PagedPrefill, scale: float,
                        out: torch.Tensor, tile_tokens: int = 64, num_splits: int | None = None) -> None:
    """Causal attention of each paged request's new rows of the batch, q [T, Hq, D] (rows
    [start, start + n) at positions [c, c + n), their K/V already stored), over its c cached
    tokens and themselves, read from its blocks in place, into the same rows of out [T, Hq, D];
    the other rows of out are not written. The context goes in ``num_splits`` parts (default:
    enough for PREFILL_TARGET_PROGRAMS programs over all requests), each a program of its own,
    then one launch combines them."""
    block_size, num_kv_heads, head_dim = _check_paged(q, kv_cache, tile_tokens)
    num_heads = q.shape[1]
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
        raise ValueError(f"out must be like q {tuple(q.shape)}, got {tuple(out.shape)} {out.dtype}")
    if paged.block_tables.device != q.device:
        raise ValueError(f"the paged requests' block tables are on {paged.block_tables.device}, q on {q.device}")
    for seq in paged.seqs:
        if seq.start + seq.num_new_tokens > q.shape[0]:
            raise ValueError(f"a paged request's rows [{seq.start}, {seq.start + seq.num_new_tokens}) pass q's "
                             f"{q.shape[0]}")
        if seq.block_table.shape[0] * block_size < seq.num_cached_tokens + seq.num_new_tokens:
            raise ValueError(f"block_table must cover {seq.num_cached_tokens + seq.num_new_tokens} tokens: "
                             f"[M >= {-(-(seq.num_cached_tokens + seq.num_new_tokens) // block_size)}], got "
                             f"{tuple(seq.block_table.shape)}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(1, 64 // group_pad)          # a query tile of at least 64 rows (heads x new rows)
    max_blocks = triton.cdiv(paged.max_new, block_m)
    num_programs = max_blocks * len(paged.seqs) * num_kv_heads
    if num_splits is None:
        num_splits = max(1, min(triton.cdiv(PREFILL_TARGET_PROGRAMS, num_programs),
                                paged.max_context // PREFILL_SPLIT_MIN_TOKENS))
    split_tokens = triton.cdiv(triton.cdiv(paged.max_context, num_splits), tile_tokens) * tile_tokens
    num_splits = triton.cdiv(paged.max_context, split_tokens)
    partial = num_splits > 1
    if partial:
        sums, maxes, totals = paged.partials(num_splits, num_heads, head_dim, q.device)
    else:
        sums = out
        maxes = totals = out                   # not read
    _kernel_for(_paged_prefill_kernel, q.device)[(max_blocks * len(paged.seqs), num_kv_heads, num_splits)](
        q, kv_cache, sums, maxes, totals, paged.block_tables, paged.entries, max_blocks, split_tokens,
        paged.num_rows, scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        out.stride(0), out.stride(1), paged.block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE=tile_tokens, PARTIAL=partial, IEEE=q.dtype == torch.float32)
    if partial:
        _kernel_for(_combine_splits_kernel, q.device)[(paged.num_rows,)](
            sums, maxes, totals, out, paged.row_to_q, num_splits, paged.num_rows, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim)


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            num_cached_tokens: int, scale: float, tile_tokens: int = 64,
                            num_splits: int | None = None) -> torch.Tensor:
    """Causal attention of one request's n new rows q [n, Hq, D] (positions [c, c + n), their K/V
    already stored) over its c cached tokens and themselves, read from the blocks in place
    (block_table int32 [M], covering c + n tokens). Returns [n, Hq, D]. ``paged_prefill_batch``
    for one request."""
    if num_cached_tokens < 0:
        raise ValueError(f"num_cached_tokens must be >= 0, got {num_cached_tokens}")
    _check_paged(q, kv_cache, tile_tokens)
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    paged = PagedPrefill([PrefillSeq(0, q.shape[0], num_cached_tokens, block_table, True)])
    paged_prefill_batch(q, kv_cache, paged, scale, out, tile_tokens, num_splits)
    return out
