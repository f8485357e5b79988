"""Fairness in L2 (issue 41, item 10) on the daemon's state: an engine's hot prefixes keep their
hit share under another engine's flood of one-use prompts, in the same model and across two
models, and an active model keeps its share of the pool. The trace: kvcached/testing/flood_trace.py."""

from __future__ import annotations

import logging

import pytest

from kvcached.testing.flood_trace import FloodTrace, run

FLOOD = 16                  # B's one-use prompts (4 pages each) per request of A: 64 pages, a quarter of L2


@pytest.fixture(autouse=True)
def quiet():
    logging.disable(logging.WARNING)          # the pressure warnings, once per episode
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("same_model", [True, False], ids=["same model", "two models"])
def test_hot_prefixes_keep_80_percent_of_their_hit_share_under_a_one_use_flood(same_model, rng):
    """Engine A reuses 12 hot prefixes (48 pages, under a fifth of L2); engine B sends 16 one-use
    prompts per A request (a quarter of L2 each round), in A's namespace or in another one. A's
    hit share keeps at least 80% of what it is without the flood (LRU kept 0.25 and 0.51 of it)."""
    seed = int(rng.integers(1 << 31))
    alone = run(FloodTrace(requests=300, same_model=same_model), seed)
    flooded = run(FloodTrace(requests=300, same_model=same_model, flood_per_request=FLOOD), seed)
    assert alone.hit_share == 1.0
    assert flooded.hit_share >= 0.8 * alone.hit_share, (alone, flooded)


@pytest.mark.parametrize("flood_first", [False, True], ids=["A first", "B first"])
def test_another_models_one_use_flood_takes_no_more_than_an_even_share_of_l2(flood_first, rng):
    """Two models: B's one-use prompts take chunks of A (active) only while A holds more of the
    pool than B, and never a chunk holding a page A reused. Whoever attached first (and so held
    the whole pool), A ends with half of L2 and its hot prefixes hit."""
    trace = FloodTrace(requests=300, same_model=False, flood_per_request=FLOOD, flood_first=flood_first)
    result = run(trace, int(rng.integers(1 << 31)))
    assert result.a_l2_capacity >= 0.5 * (trace.l2_bytes >> 17) - 1, result      # 128 KiB pages
    assert result.hit_share >= 0.8, result
