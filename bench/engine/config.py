"""The model's shape (``ModelConfig``: presets, or a Hugging Face ``config.json``) and the engine's
knobs (``EngineConfig``)."""

from __future__ import annotations

import dataclasses
import json
import os


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40_960
    qk_norm: bool = True               # Qwen3's RMSNorm of each head's q and k; False: Llama's architecture

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """KV bytes of one token, all layers (bf16 by default)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_hf(cls, path: str) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` (a file, or the directory holding it) of Qwen3, or of
        Llama (Qwen3 without the q/k norms: small real checkpoints of it exist, e.g. SmolLM2)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            hf = json.load(f)
        if hf.get("model_type") not in ("qwen3", "llama"):
            raise ValueError(f"{path}: model_type {hf.get('model_type')!r}, not 'qwen3' or 'llama'")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError(f"{path}: biases are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported")
        rope_theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        rope_type = (hf.get("rope_scaling") or hf.get("rope_parameters") or {}).get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"{path}: rope_type {rope_type!r} is not supported")
        return cls(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                   intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
                   num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                   rope_theta=float(rope_theta), rms_norm_eps=hf["rms_norm_eps"],
                   tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                   max_position_embeddings=hf["max_position_embeddings"], qk_norm=hf["model_type"] == "qwen3")


# The released Qwen3 shapes, and one small enough for CPU tests.
PRESETS = {
    "qwen3-4b": ModelConfig(vocab_size=151_936, hidden_size=2560, intermediate_size=9728, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": ModelConfig(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128),
    "qwen3-32b": ModelConfig(vocab_size=151_936, hidden_size=5120, intermediate_size=25_600, num_layers=64,
                             num_heads=64, num_kv_heads=8, head_dim=128),
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position_embeddings=2048),
}


# While a request's load is pending the other requests are scheduled as usual (decode goes on), except
# under "blocking"; then the request's prefill starts:
LOAD_MODES = {
    "layerwise": "once the load's copies are queued: its attention of layer i waits (on the GPU) for layer i",
    "async": "once the load is done (whole load, then prefill)",
    "blocking": "once the load is done, the host waiting for it at admission: nothing else runs meanwhile",
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_blocks: int                    # KV blocks per layer (the GPU prefix cache lives in them too)
    block_size: int = 16               # tokens per block (the connector's page size)
    max_num_seqs: int = 64             # requests admitted at once (loading, prefilling or decoding)
    max_prefill_tokens: int = 8192     # tokens prefilled per step, over all requests (the chunk limit)
    decode_backend: str = "auto"       # paged decode attention: "triton", "torch" (reference), "auto":
                                       # triton on CUDA, torch on CPU
    keep_logits: bool = False          # keep each sampled position's logits on the request (tests, checks)
    graph_max_tokens: int = 1024       # on CUDA, forwards of up to this many tokens replay CUDA graphs
                                       # of the layers' pieces (bench/engine/graphs.py); 0: never
    load_mode: str = "layerwise"       # how a request waits for the connector's load of its prefix (LOAD_MODES)
    load_timeout_s: float = 60.0       # "blocking": the longest the host waits for the loads of a step
    lookup_timeout_s: float = 5.0      # a connector lookup unanswered this long is given up (recomputed)
    lookup_wait_s: float = 0.002       # in a step with nothing else to run, the host waits at most this
                                       # long in all for the lookup replies of the requests it admits
                                       # (then they share this step's batch, not a later one); 0: never
    begin_lookups: bool = True         # where the connector can (can_begin), a request's lookup is its
                                       # match (connector.begin): its load needs no round trip of its own

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1 or self.max_num_seqs < 1 or self.max_prefill_tokens < 1:
            raise ValueError(f"every size must be positive: {self}")
        if not self.lookup_timeout_s > 0 or not self.load_timeout_s > 0:
            raise ValueError(f"lookup_timeout_s and load_timeout_s must be positive: {self}")
        if not 0 <= self.lookup_wait_s < self.lookup_timeout_s:
            raise ValueError(f"lookup_wait_s must be >= 0 and below lookup_timeout_s: {self}")
        if self.graph_max_tokens < 0:
            raise ValueError(f"graph_max_tokens must be >= 0, got {self.graph_max_tokens}")
        if self.decode_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"decode_backend must be auto, triton or torch, got {self.decode_backend!r}")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {sorted(LOAD_MODES)}, got {self.load_mode!r}")
