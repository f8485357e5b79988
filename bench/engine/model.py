"""A Qwen3 decoder over the paged KV cache: RMSNorm, q/k norm, RoPE, GQA, SwiGLU, tied or untied
embeddings (without the q/k norm: Llama's architecture, for small real checkpoints). Projections are
fused (one QKV matrix, one gate+up matrix), and on CUDA the element-wise steps are Triton kernels
(``kernels.py``: norms, q/k norm + RoPE, SwiGLU); the numerics otherwise
follow Hugging Face transformers' Qwen3 step for step (the norms compute in fp32 and cast back,
RoPE's cos/sin are cast to the activations' dtype). Weights are random (``init_random``) or read
from a safetensors directory with Hugging Face names (``load_safetensors``)."""

from __future__ import annotations

import glob
import os
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bench.engine import kernels
from bench.engine.attention import (PagedPrefill, PrefillSeq, fused_sdpa_only, paged_decode_attention,
                                    paged_decode_attention_torch, prefill_attention, store_kv)
from bench.engine.config import PRESETS, ModelConfig
from bench.engine.graphs import DEFAULT_MAX_GRAPH_TOKENS, LayerGraphs


class PrefillBatch(NamedTuple):
    seqs: Sequence[PrefillSeq]
    # Called with each layer's index before its attention reads the cache: the engine's stream
    # waits there for that layer of the loads in flight (None: nothing to wait for).
    wait_for_layer: Callable[[int], None] | None = None
    # The paged requests' block tables and rows, built once for every layer (None: built per layer).
    paged: PagedPrefill | None = None


class DecodeBatch(NamedTuple):
    block_tables: torch.Tensor        # int32 [B, M]
    context_lens: torch.Tensor        # int32 [B], the new token included
    backend: str                      # "triton" or "torch"


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, layer_index: int = 0):
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.input_norm = _empty(config.hidden_size, dtype=dtype, device=device)
        self.qkv_proj = _empty(q_size + 2 * kv_size, config.hidden_size, dtype=dtype, device=device)
        self.q_norm = _empty(config.head_dim, dtype=dtype, device=device) if config.qk_norm else None
        self.k_norm = _empty(config.head_dim, dtype=dtype, device=device) if config.qk_norm else None
        self.o_proj = _empty(config.hidden_size, q_size, dtype=dtype, device=device)
        self.post_attention_norm = _empty(config.hidden_size, dtype=dtype, device=device)
        self.gate_up_proj = _empty(2 * config.intermediate_size, config.hidden_size, dtype=dtype, device=device)
        self.down_proj = _empty(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor, batch: PrefillBatch | DecodeBatch) -> torch.Tensor:
        q, k, v = self.pre_attention(x, cos, sin)
        return self.post_attention(x, self.attention(q, k, v, kv_cache, slot_mapping, batch))

    # The three pieces of a layer: the first and last are row by row (a token's rows never mix
    # with another's), so they can run on a batch padded to a fixed size (bench/engine/graphs.py).

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden] -> q [T, Hq, D], k and v [T, Hkv, D], q/k normed and rotated."""
        c = self.config
        if x.is_cuda:                       # fused (bench/engine/kernels.py)
            h, _ = kernels.rms_norm(x, self.input_norm, c.rms_norm_eps)
            return kernels.qk_norm_rope(F.linear(h, self.qkv_proj), self.q_norm, self.k_norm, cos, sin,
                                        c.rms_norm_eps, c.num_heads, c.num_kv_heads)
        h = kernels.rms_norm_torch(x, self.input_norm, c.rms_norm_eps)
        return kernels.qk_norm_rope_torch(F.linear(h, self.qkv_proj), self.q_norm, self.k_norm, cos, sin,
                                          c.rms_norm_eps, c.num_heads, c.num_kv_heads)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, batch: PrefillBatch | DecodeBatch) -> torch.Tensor:
        """The step's K/V stored into the paged cache, then attention over it: [T, Hq, D]."""
        store_kv(kv_cache, k, v, slot_mapping)
        scale = self.config.head_dim ** -0.5
        if isinstance(batch, PrefillBatch):
            if batch.wait_for_layer is not None:       # this layer's loaded blocks (layer-wise loads)
                batch.wait_for_layer(self.layer_index)
            return prefill_attention(q, k, v, kv_cache, batch.seqs, scale, batch.paged)
        if batch.backend == "triton":
            return paged_decode_attention(q, kv_cache, batch.block_tables, batch.context_lens, scale)
        return paged_decode_attention_torch(q, kv_cache, batch.block_tables, batch.context_lens, scale)

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention output and the MLP: [T, hidden]."""
        eps = self.config.rms_norm_eps
        attn_out = F.linear(attn.reshape(x.shape[0], -1), self.o_proj)
        if x.is_cuda:
            h, x = kernels.rms_norm(attn_out, self.post_attention_norm, eps, residual=x)
            return x + F.linear(kernels.silu_mul(F.linear(h, self.gate_up_proj)), self.down_proj)
        x = x + attn_out
        h = kernels.rms_norm_torch(x, self.post_attention_norm, eps)
        return x + F.linear(kernels.silu_mul_torch(F.linear(h, self.gate_up_proj)), self.down_proj)


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda"):
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.embed_tokens = _empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device, i) for i in range(config.num_layers))
        self.norm = _empty(config.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else \
            _empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        # inv_freq on the CPU, as transformers computes it; the angles on the device, as it does.
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32)
                                                / config.head_dim))
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq.to(device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(dtype), persistent=False)
        self.graphs: LayerGraphs | None = None      # use_graphs()

    def use_graphs(self, max_tokens: int = DEFAULT_MAX_GRAPH_TOKENS, capture: bool | None = None) -> "LayerGraphs":
        """Run forwards of at most max_tokens tokens through the layers' pieces replayed as CUDA
        graphs (captured now, once per model; ``bench/engine/graphs.py``); capture=False runs the
        same padded pieces eagerly (CPU). Idempotent."""
        if self.graphs is None or self.graphs.max_tokens < max_tokens:
            self.graphs = LayerGraphs(self, max_tokens, self.device.type == "cuda" if capture is None else capture)
        return self.graphs

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                slot_mapping: torch.Tensor, batch: PrefillBatch | DecodeBatch,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions, slot_mapping int64 [T]; returns fp32 logits of the rows logits_rows."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        with fused_sdpa_only(self.device):
            graphs = self.graphs.get(x.shape[0]) if self.graphs is not None else None
            if graphs is not None:
                x = graphs.run(x, cos, sin, kv_caches, slot_mapping, batch)
            else:
                for layer, kv_cache in zip(self.layers, kv_caches):
                    x = layer(x, cos, sin, kv_cache, slot_mapping, batch)
        x = kernels.rms_norm_torch(x.index_select(0, logits_rows), self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head).float()

    # ---- weights ---------------------------------------------------------------------------------

    @torch.no_grad()
    def init_random(self, seed: int, std: float = 0.02) -> "Qwen3Model":
        """Normal(0, std) matrices and embeddings, norms at one (transformers' initialisation)."""
        generator = torch.Generator(self.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
        return self

    @torch.no_grad()
    def load_safetensors(self, directory: str) -> "Qwen3Model":
        """Read every ``*.safetensors`` file of directory (Hugging Face Qwen3 names); every weight
        of the model must be found, and no tensor of the files may be left unused."""
        from safetensors import safe_open

        paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not paths:
            raise FileNotFoundError(f"no *.safetensors file in {directory}")
        targets = self._hf_targets()
        filled: set[str] = set()
        for path in paths:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in targets:
                        if name == "lm_head.weight" and self.config.tie_word_embeddings:
                            continue        # some checkpoints keep the tied copy
                        raise ValueError(f"{path}: unexpected tensor {name}")
                    target = targets[name]
                    tensor = f.get_tensor(name)
                    if target.shape != tensor.shape:
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
                    target.copy_(tensor)
                    filled.add(name)
        missing = sorted(set(targets) - filled)
        if missing:
            raise ValueError(f"{directory}: missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        return self

    def _hf_targets(self) -> dict[str, torch.Tensor]:
        """Hugging Face name -> the parameter, or the rows of a fused matrix, it fills."""
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        targets = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if not c.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            targets.update({
                p + "input_layernorm.weight": layer.input_norm,
                p + "post_attention_layernorm.weight": layer.post_attention_norm,
                p + "self_attn.q_proj.weight": layer.qkv_proj[:q_size],
                p + "self_attn.k_proj.weight": layer.qkv_proj[q_size: q_size + kv_size],
                p + "self_attn.v_proj.weight": layer.qkv_proj[q_size + kv_size:],
                p + "self_attn.o_proj.weight": layer.o_proj,
                p + "mlp.gate_proj.weight": layer.gate_up_proj[: c.intermediate_size],
                p + "mlp.up_proj.weight": layer.gate_up_proj[c.intermediate_size:],
                p + "mlp.down_proj.weight": layer.down_proj,
            })
            if c.qk_norm:
                targets.update({p + "self_attn.q_norm.weight": layer.q_norm, p + "self_attn.k_norm.weight": layer.k_norm})
        return targets


def load_model(source: str | ModelConfig, *, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cuda", seed: int = 0) -> Qwen3Model:
    """A model from a preset name ("qwen3-8b", ...) or a ModelConfig, with random weights drawn
    from seed; or from a directory with a Hugging Face config.json and *.safetensors."""
    if isinstance(source, ModelConfig):
        return Qwen3Model(source, dtype, device).init_random(seed)
    if os.path.isdir(source):
        return Qwen3Model(ModelConfig.from_hf(source), dtype, device).load_safetensors(source)
    if source not in PRESETS:
        raise ValueError(f"{source!r} is neither a directory nor one of the presets {sorted(PRESETS)}")
    return Qwen3Model(PRESETS[source], dtype, device).init_random(seed)
