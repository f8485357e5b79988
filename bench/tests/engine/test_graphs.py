"""The layers' pieces run on padded batches (bench/engine/graphs.py): on CPU eagerly (the padding
logic), on CUDA as captured graphs (marked ``gpu``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.engine import PRESETS, Engine, EngineConfig, load_model
from bench.engine.graphs import graph_sizes
from bench.tests.engine.reference import random_prompt


def generate(model, prompts, max_new_tokens, **config):
    engine = Engine(model, EngineConfig(num_blocks=128, keep_logits=True, **config))
    return engine.generate(prompts, max_new_tokens)


def test_graph_sizes_cover_every_count_up_to_the_largest():
    """Every token count from 1 to max_tokens has a padded size at least as large, and the largest
    is max_tokens itself."""
    for max_tokens in (1, 7, 512, 600):
        sizes = graph_sizes(max_tokens)
        assert sizes[-1] == max_tokens and sizes == sorted(set(sizes))
        assert all(any(s >= n for s in sizes) for n in range(1, max_tokens + 1))
    with pytest.raises(ValueError):
        graph_sizes(0)


def test_padded_pieces_give_the_eager_tokens_and_ignore_the_padding(seed):
    """A prefill with a cached prefix and a decode batch, run through the padded pieces, give the
    greedy tokens of the eager forward with logits within fp32 rounding; and what the padding rows
    hold (noise put there before the run) changes no bit of the real rows' logits."""
    model = load_model("tiny", dtype=torch.float32, device="cpu", seed=seed)
    generator = torch.Generator().manual_seed(seed)
    shared = random_prompt(generator, 70)
    prompts = [shared + random_prompt(generator, 9),
               shared + random_prompt(generator, 21)]
    eager = generate(model, prompts, 6)
    graphs = model.use_graphs(48, capture=False)
    try:
        padded = generate(model, prompts, 6)
        for pieces in graphs._by_size.values():          # noise in every static buffer
            for buffer in (pieces.x, pieces.cos, pieces.sin, pieces.q, pieces.k, pieces.v, pieces.attn):
                buffer.copy_(torch.randn(buffer.shape, generator=generator))
        noisy = generate(model, prompts, 6)
    finally:
        model.graphs = None
    for e, p, n in zip(eager, padded, noisy):
        assert p.output_token_ids == e.output_token_ids, f"seed {seed}"
        for le, lp, ln in zip(e.logits, p.logits, n.logits):
            assert torch.allclose(lp, le, rtol=1e-4, atol=1e-5), f"seed {seed}: {(lp - le).abs().max()}"
            assert torch.equal(ln, lp), f"seed {seed}: the padding rows changed a real row"


@pytest.mark.gpu
def test_cuda_graphs_give_the_eager_tokens(seed):
    """On CUDA in bf16, forwards replayed from CUDA graphs (a short prefill after a prefix hit, and
    decode batches) give the greedy tokens of the eager forwards, logits within bf16 rounding, and
    the same bits every time they run."""
    config = dataclasses.replace(PRESETS["tiny"], hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=128,
                                 intermediate_size=512)
    model = load_model(config, dtype=torch.bfloat16, device="cuda", seed=seed)
    generator = torch.Generator().manual_seed(seed)
    shared = random_prompt(generator, 600)
    prompts = [shared + random_prompt(generator, 30), random_prompt(generator, 200)]
    eager = generate(model, prompts, 8, graph_max_tokens=0)
    assert model.graphs is None
    graphed = generate(model, prompts, 8)
    assert model.graphs is not None and model.graphs.capture
    again = generate(model, prompts, 8)
    for e, g, a in zip(eager, graphed, again):
        assert g.output_token_ids == e.output_token_ids, f"seed {seed}"
        for le, lg, la in zip(e.logits, g.logits, a.logits):
            assert (lg - le).abs().max() <= 0.02 * le.abs().max() + 0.05, f"seed {seed}"
            assert torch.equal(lg, la), f"seed {seed}: a replay is not deterministic"
