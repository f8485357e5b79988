"""The cost model alone, no daemon: how each direction learns from samples, and what it decides."""

from __future__ import annotations

import itertools

import pytest

from kvcached.core.cost_model import (EWMA_ALPHA, MAX_STALE_BACKOFF, STALE_DECLINES, WINDOW, CostModel, CostPriors, LineModel,
                                      fit_non_negative)
from proto.replies import Decision

ENGINE = 7
BYTES_PER_TOKEN = 147_456          # a Qwen3-8B token, bf16


def squared_error(samples, fixed, slope) -> float:
    return sum((fixed + slope * size - seconds) ** 2 for size, seconds in samples)


def test_equal_size_samples_keep_the_bandwidth_prior_and_learn_the_fixed_term_by_ewma(rng):
    """Samples whose sizes differ by at most 5% of the largest leave the slope at its prior; the
    fixed term is the EWMA (alpha 0.2) of seconds - prior_slope * size, seeded by the first sample."""
    prior_slope = 1 / (3 * 2**30)
    model = LineModel(prior_slope)
    size = int(rng.integers(1 << 20, 1 << 30))
    expected_fixed = None
    for _ in range(40):
        sample_size = size + int(rng.integers(0, size // 25))           # within 4%
        seconds = 0.002 + sample_size * prior_slope * float(rng.uniform(1.0, 3.0))
        assert model.add(sample_size, seconds)
        target = seconds - prior_slope * sample_size
        expected_fixed = target if expected_fixed is None else expected_fixed + EWMA_ALPHA * (target - expected_fixed)
        assert model.mode == "ewma" and model.slope_s == prior_slope
        assert model.fixed_s == pytest.approx(expected_fixed, rel=1e-12)
    assert model.num_samples == 40 and len(model.samples) == WINDOW


def test_equal_size_samples_faster_than_the_prior_lower_the_slope_and_keep_the_model_non_negative(rng):
    """Equal-size samples faster than the prior slope allows with no fixed cost: the fixed term is
    0 (never negative) and the slope is what the samples show, so the prediction at that size is
    the measured time."""
    prior_slope = 1 / (3 * 2**30)
    model = LineModel(prior_slope)
    size = int(rng.integers(1 << 20, 1 << 30))
    seconds = size * prior_slope * float(rng.uniform(0.1, 0.5))        # a page-cache read, say
    for _ in range(5):
        model.add(size, seconds)
    assert model.mode == "ewma" and model.fixed_s == 0.0 and 0 < model.slope_s < prior_slope
    assert model.predict(size) == pytest.approx(seconds, rel=1e-9)


def test_varied_sizes_fit_the_line_they_lie_on(rng):
    """Samples of varied sizes on a line with a positive intercept and slope are fitted exactly,
    whatever the prior was."""
    fixed, slope = float(rng.uniform(1e-4, 1e-2)), float(rng.uniform(1e-10, 1e-8))
    model = LineModel(prior_slope_s=1e-6)
    for size in rng.integers(1 << 16, 1 << 28, size=WINDOW).tolist():
        model.add(size, fixed + slope * size)
    assert model.mode == "fit"
    assert model.fixed_s == pytest.approx(fixed, rel=1e-6) and model.slope_s == pytest.approx(slope, rel=1e-6)


@pytest.mark.parametrize("shape", ["negative_slope", "negative_intercept"])
def test_data_that_would_fit_negative_terms_yields_the_best_non_negative_model(rng, shape):
    """Times falling with size (a negative slope by least squares) or rising steeply from below
    zero (a negative intercept) give a model with both terms >= 0, and no non-negative line fits
    the samples better (checked against a grid of candidates)."""
    sizes = rng.integers(100, 10_000, size=20).tolist()
    if shape == "negative_slope":
        samples = [(s, max(1e-4, 0.05 - 4e-6 * s + float(rng.normal(0, 1e-4)))) for s in sizes]
    else:
        samples = [(s, max(0.0, -0.02 + 5e-6 * s + float(rng.normal(0, 1e-5)))) for s in sizes]
    fixed, slope = fit_non_negative(samples)
    assert fixed >= 0 and slope >= 0
    best = squared_error(samples, fixed, slope)
    for a, b in itertools.product([i * 1e-3 for i in range(0, 60)], [i * 2e-7 for i in range(0, 40)]):
        assert best <= squared_error(samples, a, b) + 1e-15, (a, b)
    model = LineModel(1e-6)
    for sample in samples:
        model.add(*sample)
    assert model.mode == "fit" and model.fixed_s >= 0 and model.slope_s >= 0


def test_prefill_samples_under_16_tokens_and_bad_samples_are_ignored():
    """A prefill of fewer than 16 tokens is no sample, nor are negative, infinite or NaN times."""
    model = CostModel()
    assert not model.add_engine_sample(ENGINE, "prefill", 15, 0.5)
    for seconds in (-1.0, float("inf"), float("nan")):
        assert not model.add_engine_sample(ENGINE, "h2d", 4096, seconds)
    prefill = model.engine(ENGINE).directions["prefill"]
    assert prefill.num_samples == 0 and prefill.mode == "prior"
    assert model.add_engine_sample(ENGINE, "prefill", 16, 0.5) and prefill.num_samples == 1


def test_storage_read_estimates_are_unaffected_by_write_samples(rng):
    """Slow storage writes teach the write model only: the read model, and so the decision for an
    L3 hit, stay what they were."""
    model = CostModel()
    before = model.decide(ENGINE, BYTES_PER_TOKEN, 0, 0, 32_000)
    read_model = model.storage["s2h"]
    for size in rng.integers(1 << 20, 1 << 30, size=40).tolist():
        model.add_storage_sample("h2s", size, 5.0 + size * 1e-6)
    assert model.storage["h2s"].mode == "fit" and model.storage["h2s"].fixed_s == pytest.approx(5.0)
    assert read_model.mode == "prior" and read_model.num_samples == 0 and read_model.fixed_s == 0
    assert model.decide(ENGINE, BYTES_PER_TOKEN, 0, 0, 32_000) == before


def learn(model: CostModel, rng, *, h2d_fixed_s: float, h2d_bytes_per_s: float, prefill_fixed_s: float,
          prefill_s_per_token: float) -> None:
    """Samples of varied sizes from an engine whose transfers and prefills take these times."""
    for tokens in rng.integers(64, 8192, size=WINDOW).tolist():
        num_bytes = tokens * BYTES_PER_TOKEN
        model.add_engine_sample(ENGINE, "h2d", num_bytes, h2d_fixed_s + num_bytes / h2d_bytes_per_s)
        model.add_engine_sample(ENGINE, "prefill", tokens, prefill_fixed_s + tokens * prefill_s_per_token)


def test_short_prefixes_recompute_and_long_ones_restore_once_learned(rng):
    """With a restore that costs 20 ms before any byte moves and a prefill of 100 us per token, a
    64-token L2 hit is recomputed (6.4 ms < 1.1 x 20 ms) and a 4,096-token one is restored; before
    any sample (no fixed cost known) both were restored."""
    model = CostModel()
    assert model.decide(ENGINE, BYTES_PER_TOKEN, 0, 64, 0).choice == "l2"
    learn(model, rng, h2d_fixed_s=0.020, h2d_bytes_per_s=50e9, prefill_fixed_s=0.005, prefill_s_per_token=100e-6)
    short = model.decide(ENGINE, BYTES_PER_TOKEN, 0, 64, 0)
    long = model.decide(ENGINE, BYTES_PER_TOKEN, 0, 4096, 0)
    assert (short.choice, short.restore_tokens) == ("recompute", 0)
    assert (long.choice, long.restore_tokens) == ("l2", 4096)
    assert long.predicted_s["l2"] < long.predicted_s["recompute"] == pytest.approx(4096 * 100e-6)


def test_the_engine_own_hit_is_not_priced_and_nothing_beyond_it_is_engine():
    """Only the tokens beyond the engine's own hit are priced: an L2 hit that adds 16 tokens to a
    3,000-token local hit is priced as 16 tokens; a daemon holding no more than the engine: "engine"."""
    model = CostModel()
    decision = model.decide(ENGINE, BYTES_PER_TOKEN, 3000, 3016, 0)
    assert decision.predicted_s["recompute"] == pytest.approx(16 * 50e-6)
    assert model.decide(ENGINE, BYTES_PER_TOKEN, 3016, 3016, 3016) == Decision("engine", 3016, {})


def test_always_and_never_do_what_they_say(rng):
    """always takes the longest hit (L3 here, though the model says it is slow); never restores
    nothing (the engine keeps its own hit); cost declines the slow L3 and takes L2."""
    model = CostModel()
    for size in rng.integers(1 << 20, 1 << 28, size=8).tolist():
        model.add_storage_sample("s2h", size, 0.5 + size / 100e6)        # a slow disk
    args = (ENGINE, BYTES_PER_TOKEN, 160, 1600, 3200)
    assert model.decide(*args, policy="always")[:2] == ("l3", 3200)
    assert model.decide(*args, policy="never")[:2] == ("recompute", 160)
    assert model.decide(*args, policy="cost")[:2] == ("l2", 1600)
    decisions = model.engine(ENGINE).decisions["lookup"]
    assert decisions == {"l3": 1, "recompute": 1, "l2": 1}
    assert model.engine(ENGINE).policy_skips["lookup"] == {"l3": 2}


def test_the_peer_is_priced_by_its_d2d_line_and_chosen_where_it_pays(rng):
    """Another engine's GPU cache is a candidate priced by the engine's d2d line: at the prior (1000
    GiB/s) it beats an L2 hit of the same length, and a longer peer hit restores all it holds; once
    d2d samples show copies with a 30 ms fixed cost, L2 (at its prior) is taken instead, for a
    1,024- and a 64-token prefix alike. d2d samples leave the h2d line as it was."""
    model = CostModel()
    tie = model.decide(ENGINE, BYTES_PER_TOKEN, 0, 1024, 0, peer_tokens=1024)
    assert (tie.choice, tie.restore_tokens) == ("peer", 1024)
    assert set(tie.predicted_s) == {"peer", "l2", "recompute"} and tie.predicted_s["peer"] < tie.predicted_s["l2"]
    longer = model.decide(ENGINE, BYTES_PER_TOKEN, 256, 512, 0, peer_tokens=2048)
    assert (longer.choice, longer.restore_tokens) == ("peer", 2048)
    assert longer.predicted_s["l2"] == pytest.approx(model.engine(ENGINE).h2d.predict(256 * BYTES_PER_TOKEN)
                                                     + (2048 - 512) * 50e-6)
    h2d_before = model.engine(ENGINE).h2d.status("byte")
    for tokens in rng.integers(64, 4096, size=WINDOW).tolist():
        model.add_engine_sample(ENGINE, "d2d", tokens * BYTES_PER_TOKEN, 0.030 + tokens * BYTES_PER_TOKEN / 1e12)
    assert model.engine(ENGINE).h2d.status("byte") == h2d_before
    assert model.engine(ENGINE).d2d.fixed_s == pytest.approx(0.030)
    assert model.decide(ENGINE, BYTES_PER_TOKEN, 0, 1024, 0, peer_tokens=1024)[:2] == ("l2", 1024)
    assert model.decide(ENGINE, BYTES_PER_TOKEN, 0, 64, 0, peer_tokens=64)[:2] == ("l2", 64)
    assert model.engine(ENGINE).policy_skips["lookup"] == {"peer": 2}


def test_always_takes_the_longest_hit_and_the_peer_on_a_tie(rng):
    """always: the source holding the most tokens; a peer holding as much as L2 or L3 is taken
    (the faster source for the same tokens), a shorter one is not."""
    model = CostModel()
    assert model.decide(ENGINE, BYTES_PER_TOKEN, 0, 512, 0, "always", peer_tokens=512)[:2] == ("peer", 512)
    assert model.decide(ENGINE, BYTES_PER_TOKEN, 0, 512, 1024, "always", peer_tokens=1024)[:2] == ("peer", 1024)
    assert model.decide(ENGINE, BYTES_PER_TOKEN, 0, 512, 1024, "always", peer_tokens=768)[:2] == ("l3", 1024)
    assert model.decide(ENGINE, BYTES_PER_TOKEN, 0, 0, 0, "never", peer_tokens=768)[:2] == ("recompute", 0)


class Machine:
    """What the engine's paths really take: a prefill of fixed + per token, a DMA of 20 ms before
    any byte moves, a slow disk. Each run returns the samples the engine and the daemon measure."""

    def __init__(self, rng):
        self.rng = rng

    def noise(self) -> float:
        return float(self.rng.uniform(0.98, 1.02))

    def prefill_s(self, tokens: int) -> float:
        return (0.005 + tokens * 100e-6) * self.noise()

    def h2d_s(self, num_bytes: int) -> float:
        return (0.020 + num_bytes / 10e9) * self.noise()

    def s2h_s(self, num_bytes: int) -> float:
        return (0.001 + num_bytes / 0.5e9) * self.noise()

    def best(self, prefix: int, tier: str, margin: float) -> str:
        """The choice the true costs make, by the same rule (None: too close to call)."""
        num_bytes = prefix * BYTES_PER_TOKEN
        restore = self.h2d_s(num_bytes) + (self.s2h_s(num_bytes) if tier == "l3" else 0)
        benefit = prefix * 100e-6 - margin * restore
        if abs(benefit) < 0.1 * prefix * 100e-6:
            return None
        return tier if benefit > 0 else "recompute"


def test_a_model_that_starts_from_wrong_priors_converges_within_32_requests(rng):
    """Priors that make recompute look 100x cheaper than it is and the disk 6x faster: fed only
    what each request's chosen path measures (prefix lengths varying), the model takes the right
    decision (by the true costs, the same margin) for every request from the 33rd on, but for at
    most one restore tried at a size its tier was never measured near (one small read leaves the
    disk's prior slope standing, its excess taken for a fixed cost), and the samples of that one
    correct the model: the same request decided again is right. It never declines a restore that
    would win (that would teach it nothing)."""
    model = CostModel(CostPriors(recompute_s_per_token=1e-6, storage_bytes_per_s=3 * 2**30))
    machine = Machine(rng)
    suffix = 32
    wrong_after, wrong_again = [], []
    for request in range(96):
        prefix = int(rng.integers(4, 512)) * 16
        tier = "l2" if rng.random() < 0.5 else "l3"
        hits = (prefix, 0) if tier == "l2" else (0, prefix)
        decision = model.decide(ENGINE, BYTES_PER_TOKEN, 0, *hits)
        expected = machine.best(prefix, tier, model.priors.margin)
        wrong = request >= 32 and expected is not None and decision.choice != expected
        if wrong:
            wrong_after.append((request, prefix, tier, decision.choice, expected))
        num_bytes = prefix * BYTES_PER_TOKEN
        if decision.choice == "recompute":
            model.add_engine_sample(ENGINE, "prefill", prefix + suffix, machine.prefill_s(prefix + suffix))
        else:
            if decision.choice == "l3":
                model.add_storage_sample("s2h", num_bytes, machine.s2h_s(num_bytes))
            model.add_engine_sample(ENGINE, "h2d", num_bytes, machine.h2d_s(num_bytes))
            model.add_engine_sample(ENGINE, "prefill", suffix, machine.prefill_s(suffix))
        if wrong and model.decide(ENGINE, BYTES_PER_TOKEN, 0, *hits).choice != expected:
            wrong_again.append((request, prefix, tier))
    assert len(wrong_after) <= 1, wrong_after
    assert all(choice != "recompute" for _, _, _, choice, _ in wrong_after), wrong_after
    assert not wrong_again, wrong_again


def test_a_later_l2_restore_wins_only_where_recompute_costs_more():
    """What a background promotion is for: a later request restoring n tokens from L2 beats
    recomputing them when n * prefill slope > margin * the DMA's predicted time."""
    model = CostModel()
    per_token_dma = BYTES_PER_TOKEN / (12 * 2**30)
    assert model.later_restore_wins(ENGINE, BYTES_PER_TOKEN, 1000)            # 50 us vs 12.5 us per token
    cheap = CostModel(CostPriors(recompute_s_per_token=per_token_dma))       # recompute as cheap as the DMA
    assert not cheap.later_restore_wins(ENGINE, BYTES_PER_TOKEN, 1000)


def test_status_shows_each_direction_and_the_decisions(rng):
    """Status names, per engine and direction, the fixed term, slope, samples and mode, and the
    decisions per choice; storage reads and writes apart."""
    model = CostModel()
    learn(model, rng, h2d_fixed_s=0.001, h2d_bytes_per_s=50e9, prefill_fixed_s=0.002, prefill_s_per_token=30e-6)
    model.decide(ENGINE, BYTES_PER_TOKEN, 0, 4096, 0)
    status = model.status({ENGINE: "qwen3-8b"})
    (engine,) = status["engines"]
    assert engine["model_id"] == "qwen3-8b" and engine["decisions_total"] == {"lookup": {"l2": 1}}
    h2d = engine["directions"]["h2d"]
    assert h2d["mode"] == "fit" and h2d["samples_total"] == WINDOW
    assert h2d["fixed_s"] == pytest.approx(0.001) and h2d["slope_s_per_byte"] == pytest.approx(1 / 50e9)
    assert engine["directions"]["prefill"]["slope_s_per_token"] == pytest.approx(30e-6)
    assert engine["directions"]["d2h"]["mode"] == "prior"
    assert set(status["storage"]) == {"s2h", "h2s", "r2h"} and status["policy"] == "cost"


def l2_hit_tokens(rng) -> int:
    return int(rng.integers(64, 256)) * 16


def test_one_slow_h2d_sample_stops_declining_l2_within_stale_declines(rng):
    """One 1-s h2d sample (a stall inside the timed copies) makes every L2 hit look slower than its
    prefill, and a declined path sends no samples: yet within STALE_DECLINES + 1 decisions (well
    under 200 requests) the model restores from L2 again, and once the restores' own samples (fast)
    are in, it keeps restoring."""
    model = CostModel()
    assert model.add_engine_sample(ENGINE, "h2d", l2_hit_tokens(rng) * BYTES_PER_TOKEN, 1.0)
    declined = 0
    while model.decide(ENGINE, BYTES_PER_TOKEN, 0, l2_hit_tokens(rng), 0).choice == "recompute":
        declined += 1
        assert declined <= STALE_DECLINES, "restores never resumed"
    assert declined == STALE_DECLINES and STALE_DECLINES + 1 <= 200
    assert model.counters["stale_line_resets_total"] == 1 and model.engine(ENGINE).h2d.mode == "prior"
    for _ in range(200):
        tokens = l2_hit_tokens(rng)
        decision = model.decide(ENGINE, BYTES_PER_TOKEN, 0, tokens, 0)
        assert decision.choice == "l2", decision
        model.add_engine_sample(ENGINE, "h2d", tokens * BYTES_PER_TOKEN,
                                0.0002 + tokens * BYTES_PER_TOKEN / 20e9 * float(rng.uniform(0.95, 1.05)))
    assert model.counters["stale_line_resets_total"] == 1


def test_a_path_rightly_declined_is_re_probed_less_and_less_often(rng):
    """A DMA that really takes 1 s: after its first sample the model takes it again only once its
    samples went stale, after STALE_DECLINES declines, then (once a probe measured it slow again)
    twice, four times ... as many, at most STALE_DECLINES << MAX_STALE_BACKOFF: the loss of the
    self-correction is bounded, and shrinks while the path stays slow."""
    model = CostModel()
    restored_at = []
    for decision in range(40 * (STALE_DECLINES + 1)):
        tokens = l2_hit_tokens(rng)
        if model.decide(ENGINE, BYTES_PER_TOKEN, 0, tokens, 0).choice == "l2":
            restored_at.append(decision)
            model.add_engine_sample(ENGINE, "h2d", tokens * BYTES_PER_TOKEN, float(rng.uniform(0.9, 1.1)))
        else:
            model.add_engine_sample(ENGINE, "prefill", tokens, tokens * 50e-6 * float(rng.uniform(0.95, 1.05)))
    gaps = [b - a for a, b in zip(restored_at, restored_at[1:])]
    # the first gap follows the first sample; each probe after it is confirmed at the drop after it
    expected = [1 + (STALE_DECLINES << min(max(k - 1, 0), MAX_STALE_BACKOFF)) for k in range(len(gaps))]
    assert restored_at[0] == 0 and gaps == expected and len(gaps) >= MAX_STALE_BACKOFF + 1, restored_at
    assert model.counters["stale_line_resets_total"] in (len(gaps), len(gaps) + 1)


def test_a_path_taken_again_after_a_probe_is_re_probed_as_at_first(rng):
    """The back-off starts over once a source is taken again after a drop (a second sample): a
    later slow sample is healed within STALE_DECLINES + 1 decisions again."""
    line = CostModel().engine(ENGINE).h2d
    line.add(1 << 20, 1.0)
    for _ in range(3):                          # three drops, each confirmed by one slow probe
        while not line.declined():
            pass
        line.add(1 << 20, 1.0)
    assert line.stale_declines == STALE_DECLINES << 2     # the third probe counts at the next drop
    line.add(1 << 20, 1e-3)                     # taken again: a second sample since the drop
    assert line.stale_declines == STALE_DECLINES
    drops = [line.declined() for _ in range(STALE_DECLINES)]
    assert drops == [False] * (STALE_DECLINES - 1) + [True]


def test_a_line_that_some_decisions_still_take_keeps_its_samples(rng):
    """A DMA with a real 20 ms fixed cost: short L2 hits are declined, long ones restored (and
    sampled), so the h2d line is never stale and never dropped, whatever the number of declines;
    nor are declines under the policies always and never counted."""
    model = CostModel()
    learn(model, rng, h2d_fixed_s=0.020, h2d_bytes_per_s=50e9, prefill_fixed_s=0.005, prefill_s_per_token=100e-6)
    declined = 0
    for request in range(10 * STALE_DECLINES):
        tokens = 4096 if request % 16 == 0 else 64
        decision = model.decide(ENGINE, BYTES_PER_TOKEN, 0, tokens, 0)
        if decision.choice == "l2":
            model.add_engine_sample(ENGINE, "h2d", tokens * BYTES_PER_TOKEN, 0.020 + tokens * BYTES_PER_TOKEN / 50e9)
        else:
            declined += 1
        model.decide(ENGINE, BYTES_PER_TOKEN, 0, 64, 0, policy="never")
    assert declined > 5 * STALE_DECLINES and model.counters["stale_line_resets_total"] == 0
    assert model.engine(ENGINE).h2d.mode == "fit" and model.engine(ENGINE).h2d.fixed_s == pytest.approx(0.020)
