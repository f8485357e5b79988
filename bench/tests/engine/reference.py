"""Shared by the engine's tests: a tiny random Hugging Face Qwen3 (the reference), the engine on
its weights (read through the safetensors loader), greedy decoding with transformers."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from bench.engine import Engine, EngineConfig, load_model

VOCAB_SIZE = 512


def hf_model(seed: int, tie_word_embeddings: bool = False, architecture: str = "qwen3") -> Qwen3ForCausalLM:
    """Two layers, GQA 4:2, head_dim 16, fp32. initializer_range 0.1 so that logits are not flat.
    architecture "llama": the same without the q/k norms."""
    torch.manual_seed(seed)
    config_class, model_class = {"qwen3": (Qwen3Config, Qwen3ForCausalLM),
                                 "llama": (LlamaConfig, LlamaForCausalLM)}[architecture]
    config = config_class(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                          tie_word_embeddings=tie_word_embeddings, initializer_range=0.1,
                          attn_implementation="sdpa")
    return model_class(config).eval()


def engine_on(hf: Qwen3ForCausalLM, directory, **config) -> Engine:
    """An fp32 CPU engine on hf's weights, saved to directory and read back by load_model."""
    hf.save_pretrained(directory)
    config.setdefault("num_blocks", 64)
    config.setdefault("block_size", 16)
    return Engine(load_model(str(directory), dtype=torch.float32, device="cpu"), EngineConfig(**config))


@torch.no_grad()
def hf_greedy(hf: Qwen3ForCausalLM, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens, each from a full forward over all tokens so far, and the
    logits they were taken from [max_new_tokens, vocab]."""
    token_ids = list(prompt)
    logits = []
    for _ in range(max_new_tokens):
        last = hf(torch.tensor([token_ids])).logits[0, -1]
        logits.append(last)
        token_ids.append(int(last.argmax()))
    return token_ids[len(prompt):], torch.stack(logits)


def random_prompt(generator: torch.Generator, num_tokens: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (num_tokens,), generator=generator).tolist()
