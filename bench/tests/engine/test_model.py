"""The model's shapes and weights: the Qwen3 presets, seeded random weights, and the checks of the
safetensors loader."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.engine import PRESETS, Qwen3Model, load_model
from bench.tests.engine.reference import hf_model

# Published parameter counts (billions) and the KV bytes per bf16 token of the Qwen3 shapes.
QWEN3_SHAPES = {"qwen3-4b": (4.02, 147_456), "qwen3-8b": (8.19, 147_456), "qwen3-32b": (32.8, 262_144)}


@pytest.mark.parametrize("name", sorted(QWEN3_SHAPES))
def test_presets_have_the_released_sizes(name):
    """Each preset built (on the meta device) has the released model's parameter count within 1%
    and its KV bytes per token."""
    billions, kv_bytes = QWEN3_SHAPES[name]
    model = Qwen3Model(PRESETS[name], device="meta")
    num_parameters = sum(p.numel() for p in model.parameters())
    assert abs(num_parameters / 1e9 - billions) < 0.01 * billions, f"{name}: {num_parameters / 1e9:.3f}B"
    assert PRESETS[name].kv_bytes_per_token() == kv_bytes


def test_random_weights_follow_the_seed():
    """The same seed gives the same weights, another seed others; norms start at one."""
    first, again, other = (load_model("tiny", dtype=torch.float32, device="cpu", seed=s) for s in (5, 5, 6))
    for (name, a), b, c in zip(first.named_parameters(), again.parameters(), other.parameters()):
        assert torch.equal(a, b), name
        if name.endswith("norm"):
            assert torch.equal(a, torch.ones_like(a)), name
        else:
            assert not torch.equal(a, c), name


def test_the_loader_refuses_incomplete_foreign_or_misshapen_checkpoints(tmp_path):
    """A checkpoint missing a tensor, holding one the model does not have, or holding one of
    another shape is refused with the tensor's name."""
    hf_model(5000).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.self_attn.k_proj.weight"
    variants = {
        "missing": ({k: v for k, v in tensors.items() if k != name}, "missing"),
        "foreign": (dict(tensors, **{"model.layers.9.mlp.up_proj.weight": tensors[name].clone()}), "unexpected"),
        "misshapen": (dict(tensors, **{name: tensors[name][:-1].clone()}), "shape"),
    }
    for variant, (contents, message) in variants.items():
        save_file(contents, path)
        with pytest.raises(ValueError, match=message):
            load_model(str(tmp_path), dtype=torch.float32, device="cpu")
