"""bench_stress --engines sizes the engine count to the GPU's free memory (stress_engines.size_engines)."""

from __future__ import annotations

import torch

from bench import stress_engines
from bench.engine import PRESETS, load_model
from bench.stress_engines import Spec, engine_bytes, size_engines


def test_an_engine_is_counted_at_its_weights_kv_pool_workspaces_and_overhead():
    """engine_bytes counts the model's weights and buffers as the engine allocates them (the same
    model built on the CPU), its block pool of pool_requests requests, two transfer workspaces and
    the fixed overhead."""
    spec = Spec("tiny", seed=3)
    model = load_model("tiny", dtype=torch.bfloat16, device=torch.device("cpu"), seed=3)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    parts = engine_bytes(spec)
    assert parts["weights"] == weights
    assert parts["kv_pool"] == spec.pool_requests * spec.blocks_per_request * 16 * PRESETS["tiny"].kv_bytes_per_token(2)
    assert parts["overhead"] == stress_engines.ENGINE_OVERHEAD_BYTES and parts["transfer_workspaces"] > 0


def test_no_more_engines_run_than_the_free_memory_holds(monkeypatch):
    """On a GPU whose free memory holds 3 engines (within MEMORY_HEADROOM), 8 asked for run as 3,
    2 asked for run as 2, and with memory for none, 1 runs; the sizing says what it was given."""
    spec = Spec("qwen3-4b", seed=1)
    per_engine = sum(engine_bytes(spec).values())
    free_bytes = int(3.5 * per_engine / stress_engines.MEMORY_HEADROOM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free_bytes, 2 * free_bytes))
    sizing = size_engines(8, spec)
    assert (sizing["asked"], sizing["engines"], sizing["fit"]) == (8, 3, 3), sizing
    assert sizing["free_bytes"] == free_bytes and sizing["per_engine_bytes"] == per_engine, sizing
    assert size_engines(2, spec)["engines"] == 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (per_engine // 2, per_engine))
    assert size_engines(8, spec)["engines"] == 1
