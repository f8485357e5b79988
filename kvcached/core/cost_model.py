"""The online cost model: whether restoring a cached prefix beats recomputing it, learned from the
times the engines and the daemon measure on this machine. No I/O; the daemon asks it at every
lookup and acquire that may restore, and feeds it samples.

Each direction is a line, ``seconds = fixed_s + size * slope_s`` (size in bytes for transfers, in
tokens for prefill), learned from the last ``WINDOW`` samples (size, seconds):

- while their sizes barely differ (spread <= max(1, 5% of the largest)), one size cannot tell a
  fixed cost from a slope: the prior slope (the bandwidth prior) is kept and only the fixed term is
  learned, as an EWMA (alpha 0.2) of ``seconds - prior_slope * size``. Where that goes negative (the
  samples are faster than the prior allows even with no fixed cost), the fixed term is 0 and the
  slope is what the samples show;
- once they vary, a non-negative intercept and slope are fitted by least squares over the window
  (a two-variable non-negative least squares problem, solved in closed form).

Directions: ``h2d`` and ``d2h`` (L2 <-> GPU), ``d2d`` (a copy out of another engine's GPU memory)
and ``prefill`` per engine (the engines measure them); ``s2h`` (storage reads, L3 -> L2) and ``h2s``
(storage writes) for the daemon's one L3 file, apart; ``r2h`` (remote reads, the remote store -> L2:
the daemon's own gets, end to end).

A decision prices, for the tokens beyond the engine's own hit, recomputing them against restoring
them from each source that holds more (another engine's GPU cache, L2, L3):
benefit(c) = recompute(tokens c adds) - margin * restore(c); the largest positive benefit wins,
none: recompute. A prefill's fixed term is paid whatever is restored (the engine computes at least
the prompt's last token), so recomputing n tokens is priced ``n * prefill_slope``. An L3 restore is
the read of the pages L2 lacks, then the DMA of them all; a peer restore one device-to-device copy.

A declined source sends no samples, so the evidence that declined it could never be corrected (one
slow sample would decline a path for good). So a line counts the decisions (policy cost) that
declined a source it prices since its last sample; at ``STALE_DECLINES`` its samples are dropped and
it prices by its prior again, until the restores that prior takes measure it anew. A line that some
decisions still take is sampled and never drops anything. One the model declines rightly is
re-probed less and less often: each drop that only one sample follows (the probe's, which declined
the source again) doubles the declines the next drop waits for, up to ``STALE_DECLINES <<
MAX_STALE_BACKOFF``; a second sample after a drop (the source taken again) starts over. So one slow
sample is healed within ``STALE_DECLINES + 1`` decisions, and a rightly declined source costs a
probe per 65, 129, 257, ... decisions.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from kvcached.core import counters
from proto.counters import Counts
from proto.messages import RESTORE_POLICIES
from proto.replies import Decision
from proto.schema import COST_SAMPLE_DIRECTIONS, MAX_COST_SAMPLE_SECONDS, MAX_COST_SAMPLE_SIZE

WINDOW = 32
EWMA_ALPHA = 0.2
SPREAD_SHARE = 0.05
MIN_PREFILL_TOKENS = 16            # shorter prefills are mostly fixed overhead: not samples
STORAGE_DIRECTIONS = ("s2h", "h2s", "r2h")
STALE_DECLINES = 64                # decisions declining a line's source, no sample between: back to its prior
MAX_STALE_BACKOFF = 4               # ... doubled per drop the probe confirmed, at most 2**this times
# The lines a restore from each source is priced by (and samples): declining the source starves them.
SOURCE_DIRECTIONS = {"peer": ("d2d",), "l2": ("h2d",), "l3": ("s2h", "h2d"), "remote": ("r2h", "h2d")}


@dataclasses.dataclass(frozen=True)
class CostPriors:
    recompute_s_per_token: float = 50e-6
    host_bytes_per_s: float = 12 * 2**30       # L2 <-> GPU, each way
    storage_bytes_per_s: float = 3 * 2**30     # L3 reads and writes
    margin: float = 1.1                        # a restore must beat recompute by this factor
    peer_bytes_per_s: float = 1000 * 2**30     # another engine's GPU memory -> this engine's (CUDA IPC)
    remote_bytes_per_s: float = 1 * 2**30      # remote store reads (TCP)

    def __post_init__(self) -> None:
        for name in ("recompute_s_per_token", "host_bytes_per_s", "storage_bytes_per_s", "peer_bytes_per_s",
                     "remote_bytes_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive, got {value}")
        if not (math.isfinite(self.margin) and self.margin >= 1.0):
            raise ValueError(f"margin must be at least 1, got {self.margin}")


class LineModel:
    """``fixed_s + size * slope_s`` for one direction; see the module note."""

    def __init__(self, prior_slope_s: float, min_size: int = 1):
        self.prior_slope_s = prior_slope_s
        self.min_size = min_size
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=WINDOW)
        self.num_samples = 0                # taken in, ever
        self.fixed_s = 0.0
        self.slope_s = prior_slope_s
        self.mode = "prior"                 # "prior" (no sample yet, or dropped), "ewma" or "fit"
        self._ewma_fixed_s: float | None = None
        self.declines_since_sample = 0      # decisions that declined a source this line prices
        self.num_stale_resets = 0
        self._confirmed_resets = 0          # drops in a row that only the probe's sample followed
        self._samples_since_reset = 0

    def declined(self) -> bool:
        """Count one decision that declined a source this line prices; at ``STALE_DECLINES`` since
        its last sample, drop its samples (back to the prior) and return True. A line at its prior
        has nothing to drop: its declines are the prior's, which no sample has contradicted."""
        if not self.samples:
            return False
        self.declines_since_sample += 1
        if self.declines_since_sample < self.stale_declines:
            return False
        if self.num_stale_resets and self._samples_since_reset <= 1:
            self._confirmed_resets += 1         # the probe since the last drop declined it again
        self.samples.clear()
        self.fixed_s, self.slope_s, self.mode, self._ewma_fixed_s = 0.0, self.prior_slope_s, "prior", None
        self.declines_since_sample = 0
        self.num_stale_resets += 1
        self._samples_since_reset = 0
        return True

    @property
    def stale_declines(self) -> int:
        """Declines without a sample that drop this line's samples now."""
        return STALE_DECLINES << min(self._confirmed_resets, MAX_STALE_BACKOFF)

    def add(self, size: int, seconds: float) -> bool:
        """Take in one sample; False (ignored) when it is not one: below min_size, or not finite."""
        if not (self.min_size <= size <= MAX_COST_SAMPLE_SIZE and math.isfinite(seconds)
                and 0 <= seconds <= MAX_COST_SAMPLE_SECONDS):
            return False
        self.samples.append((size, seconds))
        self.num_samples += 1
        self.declines_since_sample = 0
        self._samples_since_reset += 1
        if self._samples_since_reset > 1:
            self._confirmed_resets = 0          # taken again since the last drop: re-probe as at first
        target = seconds - self.prior_slope_s * size
        self._ewma_fixed_s = target if self._ewma_fixed_s is None else \
            self._ewma_fixed_s + EWMA_ALPHA * (target - self._ewma_fixed_s)
        sizes = [s for s, _ in self.samples]
        largest = max(sizes)
        if largest - min(sizes) <= max(1.0, SPREAD_SHARE * largest):
            self.mode = "ewma"
            if self._ewma_fixed_s >= 0:
                self.fixed_s, self.slope_s = self._ewma_fixed_s, self.prior_slope_s
            else:
                mean_size = sum(sizes) / len(sizes)
                self.fixed_s, self.slope_s = 0.0, max(0.0, self.prior_slope_s + self._ewma_fixed_s / mean_size)
        else:
            self.mode = "fit"
            self.fixed_s, self.slope_s = fit_non_negative(self.samples)
        return True

    def predict(self, size: float) -> float:
        """Seconds for a transfer (or prefill) of this size; nothing to move costs nothing."""
        return self.fixed_s + size * self.slope_s if size > 0 else 0.0

    def status(self, unit: str) -> dict[str, Any]:
        return {"fixed_s": self.fixed_s, f"slope_s_per_{unit}": self.slope_s,
                f"prior_slope_s_per_{unit}": self.prior_slope_s, "samples_total": self.num_samples,
                "window": len(self.samples), "mode": self.mode, "declines_since_sample": self.declines_since_sample,
                "stale_resets_total": self.num_stale_resets}


def fit_non_negative(samples) -> tuple[float, float]:
    """(intercept, slope), both >= 0, minimising the squared error of intercept + slope * size over
    the samples. The objective is convex and the feasible set a quadrant: the unconstrained least
    squares solution when it is feasible, else the best of the two edges' own optima (each clamped)."""
    n = len(samples)
    mean_x = sum(s for s, _ in samples) / n
    mean_y = sum(t for _, t in samples) / n
    var_x = sum((s - mean_x) ** 2 for s, _ in samples)        # centred: sizes in bytes are large
    if var_x > 0:
        slope = sum((s - mean_x) * (t - mean_y) for s, t in samples) / var_x
        intercept = mean_y - slope * mean_x
        if slope >= 0 and intercept >= 0:
            return intercept, slope

    def squared_error(a: float, b: float) -> float:
        return sum((a + b * s - t) ** 2 for s, t in samples)

    sxx = sum(s * s for s, _ in samples)
    through_origin = max(0.0, sum(s * t for s, t in samples) / sxx) if sxx > 0 else 0.0
    edges = [(max(0.0, mean_y), 0.0), (0.0, through_origin)]
    return min(edges, key=lambda ab: squared_error(*ab))


class EngineModel:
    """One engine's directions (an engine, here, is a namespace: the sessions of one KV geometry,
    e.g. a vLLM scheduler's lookups and its worker's transfers) and the decisions taken for it."""

    def __init__(self, priors: CostPriors):
        host_slope = 1.0 / priors.host_bytes_per_s
        self.h2d, self.d2h = LineModel(host_slope), LineModel(host_slope)
        self.d2d = LineModel(1.0 / priors.peer_bytes_per_s)
        self.prefill = LineModel(priors.recompute_s_per_token, min_size=MIN_PREFILL_TOKENS)
        self.directions = {"h2d": self.h2d, "d2h": self.d2h, "d2d": self.d2d, "prefill": self.prefill}
        # where ("lookup", "match" or "predicted") -> choice -> count; skips: where -> tier not restored -> count
        self.decisions: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.policy_skips: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


class CostModel:
    def __init__(self, priors: CostPriors = CostPriors(), policy: str = "cost"):
        if policy not in RESTORE_POLICIES:
            raise ValueError(f"policy must be one of {RESTORE_POLICIES}, got {policy!r}")
        self.priors = priors
        self.policy = policy
        storage_slope = 1.0 / priors.storage_bytes_per_s
        self.storage = {"s2h": LineModel(storage_slope), "h2s": LineModel(storage_slope),
                        "r2h": LineModel(1.0 / priors.remote_bytes_per_s)}
        self.engines: dict[int, EngineModel] = {}
        self.counters = Counts(counters.COST_MODEL)

    def engine(self, engine_id: int) -> EngineModel:
        model = self.engines.get(engine_id)
        if model is None:
            model = self.engines[engine_id] = EngineModel(self.priors)
        return model

    def forget_engine(self, engine_id: int) -> None:
        self.engines.pop(engine_id, None)

    # ---- samples ----------------------------------------------------------------------------

    def add_engine_sample(self, engine_id: int, direction: str, size: int, seconds: float) -> bool:
        assert direction in COST_SAMPLE_DIRECTIONS, direction
        return self.engine(engine_id).directions[direction].add(size, seconds)

    def add_storage_sample(self, direction: str, num_bytes: int, seconds: float) -> bool:
        assert direction in STORAGE_DIRECTIONS, direction
        return self.storage[direction].add(num_bytes, seconds)

    # ---- decisions --------------------------------------------------------------------------

    def decide(self, engine_id: int, bytes_per_token: int, local_tokens: int, l2_tokens: int, l3_tokens: int,
               policy: str = "", where: str = "lookup", peer_tokens: int = 0, remote_tokens: int = 0) -> Decision:
        """Where the tokens beyond the engine's own hit (local_tokens) should come from: the leading
        tokens L2, L3, another engine's GPU cache (peer_tokens) and the remote store (remote_tokens:
        L2's hit and the pages the store holds after it) hold; 0: no candidate. Counted
        under ``where``. Runs on the daemon's socket thread for every lookup and acquire that may restore:
        plain arithmetic, no allocation beyond the reply's."""
        policy = policy or self.policy
        assert policy in RESTORE_POLICIES, policy
        engine = self.engine(engine_id)
        # (source, the leading tokens it holds, seconds to restore those beyond the engine's hit);
        # listed fastest first, so that the longest hit goes to the fastest source holding it.
        candidates: list[tuple[str, int, float]] = []
        if peer_tokens > local_tokens:
            candidates.append(("peer", peer_tokens, engine.d2d.predict((peer_tokens - local_tokens) * bytes_per_token)))
        if l2_tokens > local_tokens:
            candidates.append(("l2", l2_tokens, engine.h2d.predict((l2_tokens - local_tokens) * bytes_per_token)))
        if l3_tokens > local_tokens and l3_tokens > l2_tokens:     # the pages L2 lacks are read first, then all moved
            candidates.append(("l3", l3_tokens, engine.h2d.predict((l3_tokens - local_tokens) * bytes_per_token)
                               + self.storage["s2h"].predict((l3_tokens - l2_tokens) * bytes_per_token)))
        if remote_tokens > local_tokens and remote_tokens > max(l2_tokens, l3_tokens):  # got into L2, then moved
            candidates.append(("remote", remote_tokens, engine.h2d.predict((remote_tokens - local_tokens) * bytes_per_token)
                               + self.storage["r2h"].predict((remote_tokens - l2_tokens) * bytes_per_token)))
        if not candidates:
            decision, longest = Decision("engine", local_tokens, {}), ""
        else:
            longest, end, _ = max(candidates, key=lambda c: c[1])
            per_token = engine.prefill.slope_s
            margin = self.priors.margin
            predicted = {"recompute": (end - local_tokens) * per_token}
            choice, restore_tokens, best_benefit = "recompute", local_tokens, 0.0
            for source, tokens, restore_s in candidates:
                predicted[source] = restore_s + (end - tokens) * per_token
                benefit = (tokens - local_tokens) * per_token - margin * restore_s
                if benefit > best_benefit:
                    choice, restore_tokens, best_benefit = source, tokens, benefit
            if policy == "always":
                choice, restore_tokens = longest, end
            elif policy == "never":
                choice, restore_tokens = "recompute", local_tokens
            else:
                self._count_declines(engine, [source for source, _, _ in candidates if source != choice])
            decision = Decision(choice, restore_tokens, predicted)
        engine.decisions[where][decision.choice] += 1
        if longest and decision.choice != longest:         # the source holding the most was not taken
            engine.policy_skips[where][longest] += 1
        return decision

    def _count_declines(self, engine: EngineModel, declined_sources: list[str]) -> None:
        """The lines the declined sources are priced by (a line twice over counts once); those that
        go stale drop their samples (see the module note)."""
        directions = {d for source in declined_sources for d in SOURCE_DIRECTIONS[source]}
        for direction in sorted(directions):
            line = self.storage[direction] if direction in STORAGE_DIRECTIONS else engine.directions[direction]
            if line.declined():
                self.counters.add(counters.STALE_LINE_RESETS)

    def l3_min_tokens(self, engine_id: int, bytes_per_token: int) -> int | None:
        """A bound below which no L3 restore can win for this engine: for fewer tokens beyond its
        own hit than this, ``decide`` (policy cost) declines every L3 hit of a prefix L2 holds
        none of (the read then covers at least those tokens). None: it wins at no length."""
        engine = self.engine(engine_id)
        reader, mover = self.storage["s2h"], engine.h2d
        margin = self.priors.margin
        # benefit(n) <= n * per_token - margin * (fixed + n * slope): below 0 at n = 0, linear in n
        gain_per_token = engine.prefill.slope_s - margin * (reader.slope_s + mover.slope_s) * bytes_per_token
        bound = margin * (reader.fixed_s + mover.fixed_s) / gain_per_token if gain_per_token > 0 else math.inf
        return int(bound) if bound < MAX_COST_SAMPLE_SIZE else None         # one short of the least winner

    def later_restore_wins(self, engine_id: int, bytes_per_token: int, num_tokens: int) -> bool:
        """Whether a later request holding none of these tokens would restore them from L2 rather
        than recompute them (what a background promotion to L2 is for)."""
        engine = self.engine(engine_id)
        return num_tokens * engine.prefill.slope_s > self.priors.margin * engine.h2d.predict(num_tokens * bytes_per_token)

    # ---- status -----------------------------------------------------------------------------

    def status(self, engine_names: dict[int, str]) -> dict[str, Any]:
        """The model per engine and direction, and the decisions taken, for the status snapshot."""
        units = {"h2d": "byte", "d2h": "byte", "d2d": "byte", "prefill": "token"}
        return {
            "policy": self.policy,
            "margin": self.priors.margin,
            "priors": dataclasses.asdict(self.priors),
            "storage": {direction: model.status("byte") for direction, model in self.storage.items()},
            "engines": [
                {"namespace_id": engine_id, "model_id": engine_names.get(engine_id, ""),
                 "directions": {d: m.status(units[d]) for d, m in engine.directions.items()},
                 "decisions_total": {where: dict(sorted(c.items())) for where, c in sorted(engine.decisions.items())},
                 "policy_skips_total": {where: dict(sorted(c.items()))
                                        for where, c in sorted(engine.policy_skips.items())}}
                for engine_id, engine in sorted(self.engines.items())
            ],
            **{name: value for name, value in sorted(self.counters.items())},
        }
