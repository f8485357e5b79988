"""Restores hidden under other requests' decode, and layer by layer under the request's own prefill.

The reference engine on kvcached, Qwen3-8B shape (random bf16 weights, seeded). Each load mode
(``EngineConfig.load_mode``) is an engine of its own on the one model, with a connector that loads
but does not save (so L2 holds exactly the prefixes a fourth engine saved, and every request of a
case restores the same pages); that fourth engine also gives the recompute references (connector
taken out). Every case runs its modes in the same run.

  under_decode   8 requests decode (128-token prompts); a request of a 3,500-token prefix + 32
                 tokens (16 output tokens) arrives, its prefix in L2, or in L3 alone (L2 emptied
                 by TierControl; warm page cache). Its restore lasts from its load() to the step
                 that sees the load DONE (``PendingLoad.started_s`` to ``done_s``: ``load_ms``).
                   hidden_fraction        the part of that time in which the engine's model ran
                                          decode batches of the 8 (forward start to the step's
                                          end, after the host waited for its tokens)
                   decode_step_inflation  the 8's time per decode token while the restore runs,
                                          over their median decode step before it, minus 1: the
                                          mean wall time (step start to its tokens on the host:
                                          the lookup, the load's queueing and any stall included)
                                          of the decode steps that overlap the restore; none
                                          overlapping (blocking: the host waited it out inside
                                          one step): from the 8's last token before the restore
                                          to their first after it, less the restored request's
                                          prefill forward, per decode step in between
                   outputs_equal          every trial's restored KV equals, bit for bit, what the
                                          saving engine's prefill wrote for the prefix, and its
                                          16 tokens equal those of the first restore (blocking,
                                          so after the same prefill over the same KV); against
                                          recompute (the same prompt beside 8 decoding requests,
                                          no connector: the prefix prefilled in one piece, whose
                                          bf16 rounding differs, see bench_ttft's noise floor)
                                          each sample says it in "outputs_equal_recompute"
                 case "under_decode": load_mode "async"; "under_decode_blocking": "blocking" (the
                 switch off). Target (async): hidden >= 0.95, inflation <= 5% (the design write-up:
                 57.15 of 58.51 ms hidden).
  ttft_P+S       one request of a P-token L2 prefix + S new tokens (3,500 + 1,000, 8,000 + 2,000),
                 1 output token, the engine otherwise idle: ttft_ms "layerwise", serial_ttft_ms
                 "async" (whole load, then prefill); load_ms the async run's restore; suffix_prefill_ms
                 the TTFT of the same shape with the prefix in the engine's own GPU cache (no load);
                 layer_prefill_ms that over the layers; outputs_equal: 16 greedy tokens of one prompt,
                 layerwise against async. Target: ttft <= 1.1 x max(load, suffix prefill) + one
                 layer's prefill.

Medians over the samples; each row's samples are in the file's "details". Rows have exactly the
keys of ``ROW_KEYS`` (None where a key does not apply).

    python -m bench.bench_overlap --l3-dir /var/tmp        # bench/results/<card>/overlap.json
    python -m bench.bench_overlap --quick                  # CPU smoke run, tiny shape, no file
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
import traceback

import numpy as np
import torch

from bench.common import exit_on_sigterm, gc_paused, median, print_table, profiled, write_result
from bench.engine import Engine, EngineConfig, Request, load_model
from bench.engine.load import LoadState
from bench.tiers import KVDaemon, attach_kvcached, detach_kvcached, prefix_kv, run_request, run_to_idle, settle
from kvcached.testing.tiers import TierControl
from engine_client.connector import ConnectorConfig


ROW_KEYS = ("case", "tier", "hidden_fraction", "decode_step_inflation", "ttft_ms", "serial_ttft_ms", "load_ms",
            "suffix_prefill_ms", "layer_prefill_ms", "outputs_equal")
COLUMNS = list(ROW_KEYS)
BLOCK_SIZE = 16
CHECK_TOKENS = 16
TARGETS = {"hidden_fraction": 0.95, "decode_step_inflation": 0.05, "ttft_over_bound": 1.0}


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    decoders: int
    decoder_prompt_tokens: int
    prefix_tokens: int               # under_decode
    suffix_tokens: int
    trials: int
    baseline_steps: int
    ttft_points: tuple[tuple[int, int], ...]
    ttft_samples: int
    warmup: int
    decode_budget: int               # tokens a decoding request may generate in a trial


FULL = Plan("qwen3-8b", decoders=8, decoder_prompt_tokens=128, prefix_tokens=3500, suffix_tokens=32, trials=5,
            baseline_steps=8, ttft_points=((3500, 1000), (8000, 2000)), ttft_samples=5, warmup=1, decode_budget=512)
QUICK = Plan("tiny", decoders=8, decoder_prompt_tokens=24, prefix_tokens=100, suffix_tokens=8, trials=2,
             baseline_steps=4, ttft_points=((100, 30), (200, 50)), ttft_samples=2, warmup=1, decode_budget=128)


class StepLog:
    """One engine.step(): when it started, when its model forward started, when it ended (the
    host had the step's tokens), and what the forward ran."""

    __slots__ = ("started_s", "forward_s", "ended_s", "kind", "batch")

    def __init__(self, started_s: float, forward_s: float | None, ended_s: float, kind: str | None, batch: int):
        self.started_s, self.forward_s, self.ended_s, self.kind, self.batch = started_s, forward_s, ended_s, kind, batch


class TimedEngine(Engine):
    """The engine with each step's timing kept (``steps``)."""

    def __init__(self, model, config: EngineConfig):
        super().__init__(model, config)
        self.steps: list[StepLog] = []
        self._forward: tuple[float, str, int] | None = None

    def step(self) -> list[Request]:
        started, self._forward = time.perf_counter(), None
        finished = super().step()
        forward_s, kind, batch = self._forward or (None, None, 0)
        self.steps.append(StepLog(started, forward_s, time.perf_counter(), kind, batch))
        return finished

    def _run_prefill(self, chunks):
        self._forward = (time.perf_counter(), "prefill", len(chunks))
        return super()._run_prefill(chunks)

    def _run_decode(self, requests):
        self._forward = (time.perf_counter(), "decode", len(requests))
        return super()._run_decode(requests)


def row(case: str, tier: str, **values) -> dict:
    """A result row: exactly ROW_KEYS, None for what the case does not measure."""
    assert set(values) <= set(ROW_KEYS[2:]), values
    return {"case": case, "tier": tier, **{key: values.get(key) for key in ROW_KEYS[2:]}}


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# ---- the run's engines and daemon ------------------------------------------------------------------


class Bench:
    def __init__(self, args, plan: Plan, device: torch.device, dtype: torch.dtype):
        self.args, self.plan, self.device, self.dtype = args, plan, device, dtype
        self.rng = np.random.default_rng(args.seed)
        self.model = load_model(plan.model, dtype=dtype, device=device, seed=args.seed)
        self.vocab_size = self.model.config.vocab_size
        self.num_layers = self.model.config.num_layers
        longest = max([plan.prefix_tokens + plan.suffix_tokens + CHECK_TOKENS]
                      + [p + s + CHECK_TOKENS for p, s in plan.ttft_points])
        decoder_tokens = plan.decoder_prompt_tokens + self.decode_budget()
        num_blocks = -(-longest // BLOCK_SIZE) + plan.decoders * -(-decoder_tokens // BLOCK_SIZE) + 16
        self.engine_config = EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=plan.decoders + 2,
                                          max_prefill_tokens=max(8192, longest))
        self.prefixes = {"under_decode": self.tokens(plan.prefix_tokens)}
        for prefix_tokens, _ in plan.ttft_points:
            self.prefixes.setdefault(prefix_tokens, self.tokens(prefix_tokens))
        bytes_per_token = self.model.config.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
        prefix_bytes = sum(len(p) + 64 for p in self.prefixes.values()) * bytes_per_token
        self.l2_bytes = max(2 * prefix_bytes, 64 << 20)
        self.rows: list[dict] = []
        self.details: dict[str, dict] = {}
        self.failures: list[str] = []
        self.started = time.monotonic()
        self.path = None
        self.reference_kv: torch.Tensor | None = None

    def decode_budget(self) -> int:
        """Tokens a decoding request may generate in one under_decode trial (it is aborted after):
        room for a restore of a few hundred decode steps (an L3 promotion)."""
        return self.plan.decode_budget

    def tokens(self, count: int) -> list[int]:
        return self.rng.integers(0, self.vocab_size, size=count).tolist()

    def engine(self, load_mode: str) -> TimedEngine:
        return TimedEngine(self.model, dataclasses.replace(self.engine_config, load_mode=load_mode))

    def add(self, result: dict, details: dict) -> None:
        self.rows.append(result)
        self.details[f"{result['case']}/{result['tier']}"] = details
        print_table([result], COLUMNS)
        self.write()

    def fail(self, what: str, exc: Exception) -> None:
        traceback.print_exc()
        self.failures.append(f"{what}: {type(exc).__name__}: {exc}"[:1000])
        self.write()

    def summary(self) -> list[dict]:
        summary = []
        for r in self.rows:
            if r["case"] == "under_decode":
                summary.append({"target": f"{r['tier']}: hidden >= 0.95", "value": r["hidden_fraction"],
                                "met": r["hidden_fraction"] is not None and r["hidden_fraction"] >= 0.95})
                summary.append({"target": f"{r['tier']}: decode step inflation <= 5%", "value": r["decode_step_inflation"],
                                "met": r["decode_step_inflation"] is not None and r["decode_step_inflation"] <= 0.05})
            if r["case"].startswith("ttft_") and r["ttft_ms"] is not None:
                bound = 1.1 * max(r["load_ms"], r["suffix_prefill_ms"]) + r["layer_prefill_ms"]
                summary.append({"target": f"{r['case']}: ttft <= 1.1 x max(load, suffix prefill) + a layer "
                                          f"({bound:.2f} ms)", "value": r["ttft_ms"], "met": r["ttft_ms"] <= bound})
            if r["outputs_equal"] is False:
                summary.append({"target": f"{r['case']} {r['tier']}: outputs equal", "value": False, "met": False})
        return summary

    def write(self) -> None:
        if not self.args.name:
            return
        self.path = write_result(self.args.name, {
            "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""), "seed": self.args.seed,
            "plan": dataclasses.asdict(self.plan), "targets": TARGETS,
            "method": {"block_size": BLOCK_SIZE, "check_tokens": CHECK_TOKENS, "statistic": "median of the samples",
                       "connectors": "one per load mode, save=False; the prefixes saved by another engine",
                       "definitions": "bench/bench_overlap.py, module note"},
            "summary": self.summary(), "failures": self.failures, "elapsed_s": round(time.monotonic() - self.started, 1),
            "rows": self.rows, "details": self.details,
        }, machine=self.args.machine)


# ---- under decode ------------------------------------------------------------------------------------


def restore_window(request: Request) -> tuple[float, float]:
    load = request.load
    if load is None or load.state is not LoadState.DONE:
        raise RuntimeError(f"request {request.request_id} has no finished load: {load}")
    return load.started_s, load.done_s


def hidden_and_inflation(steps: list[StepLog], window: tuple[float, float], baseline_s: float,
                         decoders: int) -> tuple[float, float]:
    """hidden_fraction and decode_step_inflation of one restore (see the module note)."""
    start, end = window
    hidden = sum(max(0.0, min(s.ended_s, end) - max(s.forward_s, start)) for s in steps
                 if s.kind == "decode" and s.batch >= decoders)
    during = [s.ended_s - s.started_s for s in steps
              if s.kind == "decode" and s.batch >= decoders and s.started_s < end and s.ended_s > start]
    if during:
        return hidden / (end - start), sum(during) / len(during) / baseline_s - 1.0
    # None ran (blocking): from the decoders' last token before the restore to their first after
    # it, less the restored request's prefill forward, per decode step in between.
    before = [i for i, s in enumerate(steps) if s.kind == "decode" and s.ended_s <= start]
    after = [i for i, s in enumerate(steps) if s.kind == "decode" and s.forward_s >= end]
    if not before or not after:
        raise RuntimeError("no decode step before or after the restore")
    first, last = before[-1], after[0]
    span = steps[last].ended_s - steps[first].ended_s
    prefill = sum(s.ended_s - s.forward_s for s in steps[first + 1: last + 1] if s.kind == "prefill")
    decode_steps = sum(1 for s in steps[first + 1: last + 1] if s.kind == "decode")
    return hidden / (end - start), (span - prefill) / decode_steps / baseline_s - 1.0


def start_decoders(bench: Bench, engine: Engine) -> list[Request]:
    plan = bench.plan
    decoders = [engine.add_request(bench.tokens(plan.decoder_prompt_tokens), bench.decode_budget())
                for _ in range(plan.decoders)]
    deadline = time.monotonic() + 120
    while any(len(r.output_token_ids) < 2 for r in decoders):
        engine.step()
        if time.monotonic() > deadline:
            raise TimeoutError("the decoding requests did not start")
    return decoders


def under_decode_trial(bench: Bench, engine: TimedEngine, control: TierControl | None, tier: str,
                       prompt: list[int]) -> tuple[Request, list[StepLog], float]:
    """8 decoding; the request of prompt arrives (its prefix forced to tier, unless control is
    None: no connector, recompute); runs until it has its CHECK_TOKENS tokens and 2 more decode steps
    ran. Returns it, the steps from the baseline on, and the median baseline decode step."""
    plan = bench.plan
    engine.reset_prefix_cache()
    decoders = start_decoders(bench, engine)
    if control is not None:
        control.force(tier, bench.prefixes["under_decode"], plan.prefix_tokens // BLOCK_SIZE * BLOCK_SIZE)
    for _ in range(2):
        engine.step()                    # the decoders' saves (none: save=False) and lookups settle
    first_step = len(engine.steps)
    with gc_paused():
        for _ in range(plan.baseline_steps):
            engine.step()
        baseline_s = median([s.ended_s - s.started_s for s in engine.steps[first_step:]])
        with profiled(f"overlap_{engine.config.load_mode}_{tier}"):
            request = run_request(engine, prompt, CHECK_TOKENS, timeout_s=120)
        for _ in range(2):
            engine.step()
    steps = engine.steps[first_step:]
    for decoder in decoders:
        engine.abort(decoder.request_id)
    run_to_idle(engine)
    return request, steps, baseline_s


def under_decode_recompute(bench: Bench, saver: TimedEngine) -> tuple[list[int], Request]:
    """The under_decode prompt, and its request on the saver with its connector taken out."""
    prompt = bench.prefixes["under_decode"] + bench.tokens(bench.plan.suffix_tokens)
    connector, saver.scheduler.connector = saver.scheduler.connector, None
    try:
        recompute, _, _ = under_decode_trial(bench, saver, None, "none", prompt)
    finally:
        saver.scheduler.connector = connector
    return prompt, recompute


def run_under_decode(bench: Bench, engines: dict[str, TimedEngine], control: TierControl, tier: str,
                     prompt: list[int], recompute: Request) -> None:
    plan = bench.plan
    reference: list[int] | None = None       # the tokens of the first (blocking) restore
    for case, mode in (("under_decode_blocking", "blocking"), ("under_decode", "async")):
        what = f"{case} {tier}"
        try:
            engine = engines[mode]
            samples = []
            for trial in range(plan.warmup + plan.trials):
                request, steps, baseline_s = under_decode_trial(bench, engine, control, tier, prompt)
                # The restored prefix, as the engine's prefix cache now holds it, against what the
                # saving engine's own prefill wrote.
                kv_equal = torch.equal(prefix_kv(engine, bench.prefixes["under_decode"]), bench.reference_kv)
                settle(engine, control)
                expected = plan.prefix_tokens // BLOCK_SIZE * BLOCK_SIZE
                if request.num_loaded_tokens != expected or request.num_cached_tokens:
                    raise RuntimeError(f"the restored request loaded {request.num_loaded_tokens} tokens "
                                       f"(engine cache hit {request.num_cached_tokens}), not {expected}")
                if reference is None:
                    reference = list(request.output_token_ids)
                window = restore_window(request)
                hidden, inflation = hidden_and_inflation(steps, window, baseline_s, plan.decoders)
                if trial >= plan.warmup:
                    samples.append({"hidden_fraction": hidden, "decode_step_inflation": inflation,
                                    "load_ms": (window[1] - window[0]) * 1e3, "ttft_ms": request.ttft_s * 1e3,
                                    "baseline_step_ms": baseline_s * 1e3, "kv_equal": kv_equal,
                                    "outputs_equal": request.output_token_ids == reference,
                                    "outputs_equal_recompute": request.output_token_ids == recompute.output_token_ids})
            bench.add(row(case, tier, **{key: rounded(median([s[key] for s in samples]), 4) for key in
                                         ("hidden_fraction", "decode_step_inflation", "load_ms", "ttft_ms")},
                          outputs_equal=all(s["outputs_equal"] and s["kv_equal"] for s in samples)),
                      {"load_mode": mode, "samples": [{k: rounded(v, 4) if isinstance(v, float) else v
                                                       for k, v in s.items()} for s in samples],
                       "integrity": control.integrity()})
        except Exception as exc:
            bench.fail(what, exc)


# ---- TTFT: layer by layer against whole load, then prefill --------------------------------------------


def timed_request(engine: Engine, prompt: list[int], max_new_tokens: int) -> Request:
    with gc_paused():
        return run_request(engine, prompt, max_new_tokens, timeout_s=120)


def run_ttft(bench: Bench, engines: dict[str, TimedEngine], control: TierControl) -> None:
    plan = bench.plan
    for prefix_tokens, suffix_tokens in plan.ttft_points:
        case = f"ttft_{prefix_tokens}+{suffix_tokens}"
        try:
            prefix = bench.prefixes[prefix_tokens]
            expected = prefix_tokens // BLOCK_SIZE * BLOCK_SIZE
            samples: dict[str, list[float]] = {"layerwise": [], "async": [], "load": [], "suffix_prefill": []}
            for i in range(plan.warmup + plan.ttft_samples):
                for mode in ("layerwise", "async"):
                    engine = engines[mode]
                    settle(engine, control)
                    engine.reset_prefix_cache()
                    control.force("l2", prefix, expected)
                    request = timed_request(engine, prefix + bench.tokens(suffix_tokens), 1)
                    if request.num_loaded_tokens != expected or request.num_cached_tokens:
                        raise RuntimeError(f"{mode}: loaded {request.num_loaded_tokens} tokens, not {expected}")
                    if i >= plan.warmup:
                        samples[mode].append(request.ttft_s * 1e3)
                        if mode == "async":
                            start, end = restore_window(request)
                            samples["load"].append((end - start) * 1e3)
                # The same shape with the prefix in the async engine's own cache (the last request's).
                engine = engines["async"]
                settle(engine, control)
                request = timed_request(engine, prefix + bench.tokens(suffix_tokens), 1)
                if request.num_cached_tokens != expected or request.num_loaded_tokens:
                    raise RuntimeError(f"suffix prefill alone: {request.num_cached_tokens} tokens cached, "
                                       f"{request.num_loaded_tokens} loaded")
                if i >= plan.warmup:
                    samples["suffix_prefill"].append(request.ttft_s * 1e3)
            check = prefix + bench.tokens(suffix_tokens)
            outputs = []
            for mode in ("layerwise", "async"):
                engine = engines[mode]
                settle(engine, control)
                engine.reset_prefix_cache()
                control.force("l2", prefix, expected)
                outputs.append(timed_request(engine, check, CHECK_TOKENS).output_token_ids)
            suffix_prefill_ms = median(samples["suffix_prefill"])
            bench.add(row(case, "l2", ttft_ms=rounded(median(samples["layerwise"])),
                          serial_ttft_ms=rounded(median(samples["async"])), load_ms=rounded(median(samples["load"])),
                          suffix_prefill_ms=rounded(suffix_prefill_ms),
                          layer_prefill_ms=rounded(suffix_prefill_ms / bench.num_layers, 4),
                          outputs_equal=outputs[0] == outputs[1]),
                      {"samples_ms": {k: [round(v, 3) for v in vs] for k, vs in samples.items()},
                       "integrity": control.integrity()})
        except Exception as exc:
            bench.fail(case, exc)


# ---- main ------------------------------------------------------------------------------------------------


def run(bench: Bench) -> None:
    with KVDaemon(bench.l2_bytes, 2 * bench.l2_bytes, l3_dir=bench.args.l3_dir) as daemon:
        saver = bench.engine("async")
        model_id = f"{bench.plan.model}-overlap"
        revision = f"random-seed-{bench.args.seed}"
        attach_kvcached(saver, daemon.socket_path, model_id=model_id, model_revision=revision, client_name="saver")
        engines: dict[str, TimedEngine] = {}
        control = None
        try:
            control = TierControl(daemon, saver.connector.geometry)
            for prefix in bench.prefixes.values():      # saved to L2, written through to L3
                saver.generate([prefix + bench.tokens(1)], 1)
                settle(saver, control)
                if prefix is bench.prefixes["under_decode"]:
                    bench.reference_kv = prefix_kv(saver, prefix)     # what every restore of it must hold
            for mode in ("layerwise", "async", "blocking"):
                engines[mode] = bench.engine(mode)
                # Policy always: every restore is taken (what is measured is how much of it is hidden).
                attach_kvcached(engines[mode], daemon.socket_path, model_id=model_id, model_revision=revision,
                                client_name=mode, config=ConnectorConfig(save=False, policy="always"))
            prompt, recompute = under_decode_recompute(bench, saver)
            run_under_decode(bench, engines, control, "l2", prompt, recompute)
            run_ttft(bench, engines, control)
            # Last: forcing L3 empties L2 (of the TTFT prefixes too).
            run_under_decode(bench, engines, control, "l3", prompt, recompute)
        finally:
            for engine in [saver, *engines.values()]:
                try:
                    detach_kvcached(engine)
                except Exception as exc:            # noqa: BLE001 (recorded; the others are detached)
                    bench.fail("detach", exc)
            if control is not None:
                control.close()


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shape, short prefixes; no file")
    parser.add_argument("--l3-dir", default=None, help="where the daemon's L3 file goes (a disk, not tmpfs)")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--name", default=None, help="result file (bench/results/<machine>/<name>.json); "
                                                     "default overlap, none with --quick")
    parser.add_argument("--machine", default=None)
    args = parser.parse_args()
    if not args.quick:
        args.name = args.name or "overlap"
    logging.basicConfig(level=logging.WARNING)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bench = Bench(args, QUICK if args.quick else FULL, device, dtype)
    try:
        run(bench)
    except Exception as exc:
        bench.fail("run", exc)
    finally:
        bench.write()
        if bench.rows:
            print()
            print_table(bench.rows, COLUMNS)
        summary = bench.summary()
        if summary:
            print_table(summary, ["target", "value", "met"])
        if bench.path:
            print(f"wrote {bench.path}")
    if bench.failures:
        raise SystemExit(f"failed: {bench.failures}")


if __name__ == "__main__":
    main()
