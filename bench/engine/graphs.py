"""Piecewise CUDA graphs of the decoder layers, for forwards of few tokens.

A forward of a few tokens (a decode batch, the short suffix prefilled after a restore) is bound by
the host launching ~60 kernels per layer, not by the GPU: 32 tokens of Qwen3-8B took ~28 ms of
launches for ~4 ms of GPU work. Real engines replay CUDA graphs there (vLLM's piecewise graphs);
so does this one. Each layer is cut around its attention, the only piece whose work depends on
more than its own rows (the paged cache, the batch's sequences):

    pre   norm, QKV projection, q/k norms, RoPE      -> a graph per layer and padded size
    attn  KV store + prefill or decode attention       eager, on the exact rows
    post  output projection, residual, norm, MLP     -> a graph per layer and padded size

Forwards of up to ``DEFAULT_MAX_GRAPH_TOKENS`` (1,024) tokens replay graphs, where they stopped at
512. Continuous batching puts restored suffixes and whole prompts in one step: at batch 4, two
whole prompts of 366 tokens and two restored suffixes make 792 tokens, which ran eagerly. Steps
of restored suffixes alone were graphed and still bound by the host: their attention took two
launches per request and layer, now one per layer for the batch (``attention.PagedPrefill``).
With both, the GPU rather than the host bounds the prefill steps with restores (``stress`` in
docs/benchmarks.md; each row's ``prefill_mean_ms`` has the launch and span times).
Above 512 the sizes step by 128, so that the padding stays under a fifth of a batch's rows;
forwards of more than 1,024 tokens (whole prompts of 1,000 tokens and more, 3 prompts of 366 at
batch 4) stay eager.

The graphed pieces are row by row, so a batch of T tokens runs in the graphs of the smallest
captured size B >= T, its rows [0, T) of static buffers in use; rows [T, B) hold whatever the last
forward left (finite values), and no real row reads them. Static buffers are owned here, allocated
before capture; every graph writes its results into them, so the graphs share one memory pool
(nothing a graph allocates outlives its replay). Forwards of more tokens than the largest size
run eagerly: there the GPU work dominates. ``capture=False`` runs the same padded pieces eagerly
(on CPU, where there are no graphs, it tests the padding).
"""

from __future__ import annotations

import torch

DEFAULT_MAX_GRAPH_TOKENS = 1024
_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 640, 768, 896, 1024)


def graph_sizes(max_tokens: int) -> list[int]:
    """The padded sizes captured for forwards of up to max_tokens tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    sizes = [s for s in _SIZES if s < max_tokens]
    return sizes + [max_tokens]


class _SizeGraphs:
    """The static buffers and the per-layer pre/post pieces of one padded size."""

    def __init__(self, model, size: int, capture: bool, pool):
        c, dtype, device = model.config, model.dtype, model.device
        self.model = model
        self.size = size
        self.x = torch.zeros(size, c.hidden_size, dtype=dtype, device=device)
        self.cos = torch.zeros(size, 1, c.head_dim, dtype=dtype, device=device)
        self.sin = torch.zeros(size, 1, c.head_dim, dtype=dtype, device=device)
        self.q = torch.zeros(size, c.num_heads, c.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(size, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(size, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)
        self.attn = torch.zeros(size, c.num_heads, c.head_dim, dtype=dtype, device=device)
        self.pre: list = []
        self.post: list = []
        for layer in model.layers:
            self.pre.append(self._piece(lambda layer=layer: self._pre(layer), capture, pool))
            self.post.append(self._piece(lambda layer=layer: self._post(layer), capture, pool))

    def _pre(self, layer) -> None:
        q, k, v = layer.pre_attention(self.x, self.cos, self.sin)
        self.q.copy_(q)
        self.k.copy_(k)
        self.v.copy_(v)

    def _post(self, layer) -> None:
        self.x.copy_(layer.post_attention(self.x, self.attn))

    @staticmethod
    def _piece(fn, capture: bool, pool):
        """fn itself (capture=False), or the replay of its CUDA graph."""
        if not capture:
            return fn
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph.replay

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches, slot_mapping, batch):
        num_tokens = x.shape[0]
        rows = slice(0, num_tokens)
        self.x[rows].copy_(x)
        self.cos[rows].copy_(cos)
        self.sin[rows].copy_(sin)
        for layer, kv_cache, pre, post in zip(self.model.layers, kv_caches, self.pre, self.post, strict=True):
            pre()
            attn = layer.attention(self.q[rows], self.k[rows], self.v[rows], kv_cache, slot_mapping, batch)
            self.attn[rows].copy_(attn)
            post()
        return self.x[rows]


class LayerGraphs:
    """The pieces of every padded size up to max_tokens, captured at construction."""

    def __init__(self, model, max_tokens: int, capture: bool):
        if capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.max_tokens = max_tokens
        self.capture = capture
        self.sizes = graph_sizes(max_tokens)
        self._by_size: dict[int, _SizeGraphs] = {}
        if not capture:
            self._by_size = {s: _SizeGraphs(model, s, False, None) for s in self.sizes}
            return
        with torch.inference_mode():
            self._warm_up(model)
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):           # the largest first: the pool is sized once
                self._by_size[size] = _SizeGraphs(model, size, True, pool)
        torch.cuda.synchronize(model.device)

    @staticmethod
    def _warm_up(model) -> None:
        """Each piece once outside capture, on a side stream (cuBLAS and allocator set-up)."""
        stream = torch.cuda.Stream(model.device)
        stream.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(stream):
            pieces = _SizeGraphs(model, 8, False, None)
            for pre, post in zip(pieces.pre, pieces.post):
                pre()
                post()
        torch.cuda.current_stream(model.device).wait_stream(stream)
        torch.cuda.synchronize(model.device)

    def get(self, num_tokens: int) -> _SizeGraphs | None:
        """The pieces for a forward of num_tokens tokens; None past max_tokens (run it eagerly)."""
        if num_tokens > self.max_tokens:
            return None
        for size in self.sizes:
            if size >= num_tokens:
                return self._by_size[size]
        return None
