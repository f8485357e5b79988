"""The engine in bf16 on CUDA (marked ``gpu``): the paths the benchmarks take, with head_dim 128
as in the Qwen3 shapes (flash / memory-efficient SDPA only: a fallback to the math kernel raises)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from bench.engine import Engine, EngineConfig, load_model
from bench.tests.engine.reference import random_prompt

pytestmark = pytest.mark.gpu

VOCAB_SIZE = 512


def cuda_pair(seed: int, tmp_path):
    """transformers' Qwen3 in bf16 on CUDA (SDPA) and a model of the engine on its weights."""
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
                         initializer_range=0.05, attn_implementation="sdpa")
    hf = Qwen3ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    return hf.to("cuda", torch.bfloat16), load_model(str(tmp_path), dtype=torch.bfloat16, device="cuda")


def test_bf16_prefill_on_cuda_is_as_exact_as_transformers_prefill(tmp_path):
    """The engine's last-token logits of a 700-token bf16 prefill on CUDA are as close to the same
    model's fp32 logits as transformers' bf16 SDPA prefill's are (at most twice its error, plus
    1% of the largest logit): the engine computes the same model, with no more rounding."""
    seed = 4000
    hf, model = cuda_pair(seed, tmp_path)
    hf32 = Qwen3ForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).to("cuda").eval()
    engine = Engine(model, EngineConfig(num_blocks=256, keep_logits=True))
    prompt = random_prompt(torch.Generator().manual_seed(seed), 700)
    (request,) = engine.generate([prompt], 1)
    tokens = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        exact = hf32(tokens).logits[0, -1].float().cpu()
        hf_bf16 = hf(tokens).logits[0, -1].float().cpu()
    engine_error = (request.logits[0].float() - exact).abs().max().item()
    hf_error = (hf_bf16 - exact).abs().max().item()
    bound = 2 * hf_error + 0.01 * exact.abs().max().item()
    assert engine_error <= bound, f"seed {seed}: engine error {engine_error}, transformers bf16 error {hf_error}"


def test_bf16_prefix_hits_chunks_and_batches_on_cuda(tmp_path):
    """On CUDA in bf16, a prefix-cache hit, chunked prefill and a decode batch (Triton kernel) give
    logits within bf16 rounding of a cold, whole, lone run, and the Triton decode gives the same
    logits as the torch reference decode."""
    seed = 4100
    _, model = cuda_pair(seed, tmp_path)
    generator = torch.Generator().manual_seed(seed)
    shared = random_prompt(generator, 600)
    prompts = [shared + random_prompt(generator, 50), random_prompt(generator, 333)]
    cold = []
    for prompt in prompts:
        (request,) = Engine(model, EngineConfig(num_blocks=256, keep_logits=True, decode_backend="torch")) \
            .generate([prompt], 8)
        cold.append(request)
    engine = Engine(model, EngineConfig(num_blocks=256, max_prefill_tokens=256, keep_logits=True))
    engine.generate([shared], 1)
    warm = engine.generate(prompts, 8)
    assert warm[0].num_cached_tokens == 592, f"seed {seed}"
    for request, reference in zip(warm, cold):
        scale = torch.stack(reference.logits).abs().max().item()
        difference = (torch.stack(request.logits[:1]) - torch.stack(reference.logits[:1])).abs().max().item()
        assert difference < 0.02 * scale, f"seed {seed}: first logits differ by {difference}"
    # Decode alone: the same prompt and the same first token, Triton against the reference.
    by_backend = {}
    for backend in ("triton", "torch"):
        (request,) = Engine(model, EngineConfig(num_blocks=256, keep_logits=True, decode_backend=backend)) \
            .generate([prompts[1]], 8)
        by_backend[backend] = torch.stack(request.logits)
    difference = (by_backend["triton"][:2] - by_backend["torch"][:2]).abs().max().item()
    assert difference < 0.02 * by_backend["torch"].abs().max().item(), f"seed {seed}: decode differs by {difference}"
