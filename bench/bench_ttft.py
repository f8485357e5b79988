"""Time to first token on the reference engine: a prefix restored from each tier against recompute.

For each model shape (random bf16 weights, seeded) and prefix length, two different prefixes
alternate; the engine's block pool holds one request, so each request evicts the other prefix
from the engine's own GPU cache (what little it leaves is dropped before each timed request). A
request is a prefix plus a unique 32-token suffix, 1 output token. TTFT is what the user sees:
from ``add_request`` (the request entering the scheduler) to its first token. Two alternations warm up, then the median of 8 requests. The tier the prefix
comes from is forced (``bench/tiers.py``):

  none     no connector: the engine prefills all of it (recompute)
  l2       the prefix in L2 (the daemon's shared pinned memory): lookup, match, DMA + scatter
  l3       L2 emptied before each request, the prefix in L3 with a warm page cache: + preadv L3 -> L2
  l3-cold  the same from a daemon started with --l3-o-direct, the L3 file's page cache dropped too
  peer     engine A, a process of its own on the same GPU with the same weights (bench.peer_owner),
           has prefilled the prefixes and holds them in its own GPU cache; this engine (B, its
           connector now with peer restores on) copies them out of A's GPU memory (L2 holds them
           too: under "always" the peer is taken because it covers as much and is listed first, the
           faster source). Its KV is checked against A's.
  remote   the remote tier (issue 43): another host's daemon lends a Mooncake Store its memory (a
           real mooncake_master, ``bench.tiers.RemoteHost``); this engine's daemon has the remote
           tier on, no L3, and lends nothing; it wrote both prefixes through to the store, and its L2
           is emptied before each request: the store is asked (lookup and match), the pages are got
           over TCP into L2, checked, then DMA + scatter. Runs in a network namespace of loopback
           only, entered first (``unshare --net``; where that is refused, in place, noted).

Checked at every point: each request's own GPU-cache hit is 0 and it loads every whole page of
its prefix (from L3: promoted); the restored KV equals bit for bit what the engine's own prefill
wrote for that prefix when it was saved; a check request (the first prefix alone, 16 greedy
tokens, from the tier, engine cache cold) gives the tokens of a recompute (``outputs_equal``), its
logit difference from that recompute is set against the noise floor measured in the same run
(the engine's own cache hit on the same KV against the same recompute), and its logits are
compared bit for bit with that own cache hit's; the daemon's integrity check passes.

In the same run, Hugging Face transformers' SDPA prefill of the same weights and tokens (bf16,
``logits_to_keep=1``, then the argmax, as the engine's first token) is timed: ``engine_over_hf``
is the engine's recompute TTFT over it (target <= 1.3).

Each restore row also says where its samples' TTFT went (``phases_ms``, per timed request, from
the request's ``PendingLoad``): ``to_load`` (arrival to its load: admission and the lookup's round
trip), ``to_copies`` (load to its copies queued: the acquire's round trip), ``copies`` (queued to
the load seen done), ``to_token`` (done to the first token: the prefill not under the load), and
``device_copies`` (the device time of the load's copies, from their start on the load lane).

    python -m bench.bench_ttft                                    # bench/results/<card>/ttft.json
    python -m bench.bench_ttft --points 'qwen3-8b=3500,8000' --tiers none,l2
    python -m bench.bench_ttft --quick                            # CPU smoke run, tiny shape, no file
    python -m bench.bench_ttft --tiers none,l2,remote --name remote_ttft   # needs the store's wheel

``--policy`` is the restore policy of the engine's connector: "always" (the default: every request
restores its prefix from the forced tier, the rows above), "never" (the same requests recompute
with the connector plugged in), or "cost", the cost model's own choice. With "cost" each point gets
a fresh daemon (the model starts from its default priors; L2 and warm L3 share one daemon, in that
order, as a long-running one would; l3-cold a daemon of its own), each tier is timed under "cost",
"always" (``restore_ms``) and "never" (``recompute_ms``) on the same daemon and connector, whose
policy is switched before each request: each turn of a prefix runs one request per policy, in an
order that rotates from turn to turn, so that a drift of the host during the run weighs on all
three alike (the first request of all is under "cost"; the daemon's cost model, one per engine,
learns from the transfers and prefills of all three, as it would from a mix of requests), and the
rows go to policy.json: {"model", "tier", "tokens", "cost_ms", "restore_ms", "recompute_ms",
"choice"} (choice: what the daemon chose for most timed requests), target cost_ms <= 1.05 x the
faster of the two.

    python -m bench.bench_ttft --policy cost                      # bench/results/<card>/policy.json
    python -m bench.bench_ttft --policy cost --quick              # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import logging
import os
import subprocess
import sys
import time
import traceback

import numpy as np
import torch

from bench.common import exit_on_sigterm, gc_paused, median, print_table, write_result
from bench.engine import PRESETS, Engine, EngineConfig, Request, load_model
from bench.peer_owner import PeerOwner
from bench.tiers import (TIERS, KVDaemon, RemoteHost, attach_kvcached, detach_kvcached, prefix_kv, run_request,
                         settle)
from kvcached.testing.tiers import TierControl
from engine_client.connector import ConnectorConfig


DEFAULT_POINTS = "qwen3-8b=350,1000,2000,3500,8000;qwen3-4b=1000,3500;qwen3-32b=1000,3500"
QUICK_POINTS = "tiny=40,100"
BLOCK_SIZE = 16
SUFFIX_TOKENS = 32
CHECK_TOKENS = 16
TARGETS = {"l2_speedup_qwen3-8b_3500": 10.0, "l2_ttft_ms_qwen3-8b_8000": 25.0, "engine_over_hf": 1.3}
COLUMNS = ["model", "tier", "tokens", "ttft_ms", "recompute_ms", "speedup", "outputs_equal", "kv_equal",
           "logit_diff", "noise_floor", "hf_prefill_ms", "engine_over_hf"]
POLICY_COLUMNS = ["model", "tier", "tokens", "cost_ms", "restore_ms", "recompute_ms", "choice", "within_5pct"]
POLICY_TARGET = 1.05             # cost_ms at most this times the faster of restore_ms and recompute_ms


def parse_points(text: str) -> list[tuple[str, list[int]]]:
    """'qwen3-8b=350,1000;qwen3-4b=3500' -> [("qwen3-8b", [350, 1000]), ("qwen3-4b", [3500])]."""
    plan = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, tokens = part.partition("=")
        if name not in PRESETS or not tokens:
            raise SystemExit(f"--points: {part!r} is not SHAPE=TOKENS,... with SHAPE one of {sorted(PRESETS)}")
        plan.append((name, [int(t) for t in tokens.split(",")]))
    return plan


# ---- the model in transformers, on the engine's own weights ------------------------------------------


def hf_twin(model) -> tuple[object | None, str | None]:
    """transformers' Qwen3ForCausalLM (SDPA) holding the engine model's tensors (views, no copy);
    (None, why) when transformers is not importable."""
    try:
        from transformers import Qwen3Config, Qwen3ForCausalLM
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    except ImportError as exc:
        return None, f"transformers not importable ({exc}): no HF prefill timed"
    c = model.config
    if not c.qk_norm:
        return None, "a Llama-architecture model: no HF prefill timed"
    options = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                   num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                   head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
                   max_position_embeddings=c.max_position_embeddings, attn_implementation="sdpa")
    if "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters:
        options["rope_parameters"] = {"rope_type": "default", "rope_theta": c.rope_theta}
    else:
        options["rope_theta"] = c.rope_theta
    config = Qwen3Config(**options)
    with torch.device("meta"):
        hf = Qwen3ForCausalLM(config)
    missing, unexpected = hf.load_state_dict(model._hf_targets(), strict=False, assign=True)
    if c.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"transformers' Qwen3 does not take the engine's weights: missing {missing}, "
                           f"unexpected {unexpected}")
    hf.model.rotary_emb = Qwen3RotaryEmbedding(config).to(model.device)
    left_on_meta = [name for name, t in [*hf.named_parameters(), *hf.named_buffers()] if t.device.type == "meta"]
    if left_on_meta:
        raise RuntimeError(f"transformers' Qwen3: tensors not filled: {left_on_meta[:4]}")
    return hf.eval(), None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_hf_prefill(hf, prompt: list[int], device: torch.device, warmup: int, repeats: int):
    """Median ms of transformers' prefill of prompt (logits of the last token only) and its argmax;
    and those logits."""
    input_ids = torch.tensor([prompt], device=device)
    samples, logits = [], None
    with torch.inference_mode(), gc_paused():
        for i in range(warmup + repeats):
            synchronize(device)
            started = time.perf_counter()
            logits = hf(input_ids, logits_to_keep=1).logits[0, -1]
            logits.argmax().item()
            if i >= warmup:
                samples.append((time.perf_counter() - started) * 1e3)
    return median(samples), samples, logits.float().cpu()


# ---- one point: a shape, a prefix length, its engine --------------------------------------------------


@dataclasses.dataclass(eq=False)
class Point:
    model_name: str
    num_tokens: int                 # prefix length
    engine: Engine
    prefixes: list[list[int]]       # two, alternating
    rng: np.random.Generator        # unique suffixes
    recompute: Request | None = None        # the check prompt, cold, no connector
    recompute_again: Request | None = None  # the same, once more (determinism)
    recompute_ms: float | None = None

    @property
    def timed_loaded_tokens(self) -> int:
        """A timed request (prefix + suffix) restores every whole page of the prefix."""
        return self.num_tokens // BLOCK_SIZE * BLOCK_SIZE

    @property
    def check_loaded_tokens(self) -> int:
        """The check request (the prefix alone) computes at least its last token."""
        return (self.num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE

    @property
    def check_prompt(self) -> list[int]:
        return self.prefixes[0]

    def suffix(self) -> list[int]:
        vocab_size = self.engine.model.config.vocab_size
        return self.rng.integers(0, vocab_size, size=SUFFIX_TOKENS).tolist()


def make_point(model, model_name: str, num_tokens: int, seed: int) -> Point:
    # One request's blocks, no more: the next request (the other prefix) evicts every block of this one.
    num_blocks = -(-(num_tokens + SUFFIX_TOKENS + 1) // BLOCK_SIZE)
    engine = Engine(model, EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=4,
                                        max_prefill_tokens=num_blocks * BLOCK_SIZE, keep_logits=True))
    rng = np.random.default_rng([seed, num_tokens])
    vocab_size = model.config.vocab_size
    prefixes = [rng.integers(0, vocab_size, size=num_tokens).tolist() for _ in range(2)]
    return Point(model_name, num_tokens, engine, prefixes, rng)


def logit_difference(a: Request, b: Request) -> float:
    """Largest logit difference over the steps both sampled from the same tokens (up to and with
    the first step whose greedy token differs)."""
    steps = len(a.logits)
    for i, (x, y) in enumerate(zip(a.output_token_ids, b.output_token_ids)):
        if x != y:
            steps = i + 1
            break
    return (torch.stack(a.logits[:steps]) - torch.stack(b.logits[:steps])).abs().max().item()


def same_logits(a: Request, b: Request) -> bool:
    return len(a.logits) == len(b.logits) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


class Run:
    """The run's rows, written to the result file after each one."""

    def __init__(self, args, device: torch.device, dtype: torch.dtype, plan):
        self.args = args
        self.device = device
        self.dtype = dtype
        self.plan = plan
        self.started = time.monotonic()
        self.rows: list[dict] = []
        self.skipped: list[str] = []
        self.notes: list[str] = []
        self.failures: list[str] = []

    def over_budget(self, what: str) -> bool:
        if self.args.budget_s is not None and time.monotonic() - self.started > self.args.budget_s:
            self.skipped.append(what)
            print(f"skipped (over the {self.args.budget_s} s budget): {what}", flush=True)
            return True
        return False

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print_table([row], POLICY_COLUMNS if self.args.policy == "cost" else COLUMNS)
        for check in ("kv_equal", "tier_forced", "integrity_ok"):
            if row.get(check) is False:
                self.failures.append(f"{row['model']} {row['tier']} {row['tokens']}: {check}")
        self.write()

    def fail(self, what: str, exc: Exception) -> None:
        traceback.print_exc()
        self.failures.append(f"{what}: {type(exc).__name__}: {exc}"[:1000])
        self.write()

    def summary(self) -> list[dict]:
        if self.args.policy == "cost":
            return policy_summary(self.rows)
        summary = []
        for row in self.rows:
            key = (row["model"], row["tier"], row["tokens"])
            if key == ("qwen3-8b", "l2", 3500):
                summary.append({"target": "qwen3-8b, 3,500 tokens, L2: speed-up >= 10", "value": row["speedup"],
                                "met": row["speedup"] is not None and row["speedup"] >= 10})
            if key == ("qwen3-8b", "l2", 8000):
                summary.append({"target": "qwen3-8b, 8,000 tokens, L2: TTFT <= 25 ms", "value": row["ttft_ms"],
                                "met": row["ttft_ms"] <= 25})
            if row["tier"] == "none" and row.get("engine_over_hf") is not None:
                summary.append({"target": f"{row['model']}, {row['tokens']} tokens: engine / HF prefill <= 1.3",
                                "value": row["engine_over_hf"], "met": row["engine_over_hf"] <= 1.3})
            if row["tier"] == "remote" and row["speedup"] is not None:
                l2 = next((r for r in self.rows if (r["model"], r["tier"], r["tokens"]) == (row["model"], "l2", row["tokens"])),
                          None)
                summary.append({"target": f"{row['model']}, {row['tokens']} tokens: the remote tier's TTFT below "
                                          f"recompute's (L2's speed-up {l2 and l2['speedup']})",
                                "value": row["speedup"], "met": row["speedup"] > 1})
            if row["tier"] == "peer" and row["speedup"] is not None:
                l2 = next((r for r in self.rows if (r["model"], r["tier"], r["tokens"]) == (row["model"], "l2", row["tokens"])),
                          None)
                if l2 is not None and l2["speedup"] is not None:
                    summary.append({"target": f"{row['model']}, {row['tokens']} tokens: peer speed-up above L2's "
                                              f"({l2['speedup']})", "value": row["speedup"],
                                    "met": row["speedup"] > l2["speedup"]})
        return summary

    def write(self) -> None:
        if not self.args.name:
            return
        args = self.args
        self.path = write_result(args.name, {
            "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""), "seed": args.seed,
            "points": {name: tokens for name, tokens in self.plan}, "tiers": args.tiers.split(","),
            "policy": args.policy,
            "method": {"block_size": BLOCK_SIZE, "suffix_tokens": SUFFIX_TOKENS, "output_tokens": 1,
                       "warmup_alternations": args.warmup, "samples": args.samples, "check_tokens": CHECK_TOKENS,
                       "hf": {"warmup": args.hf_warmup, "repeats": args.hf_repeats, "logits_to_keep": 1},
                       "ttft": "add_request -> first token (Request.ttft_s), median of the samples",
                       **({"policies": "cost, always and never on one connector, one request each per "
                                       "turn of a prefix, in a rotating order"} if args.policy == "cost" else {})},
            "targets": TARGETS, "summary": self.summary(), "failures": self.failures, "skipped": self.skipped,
            "notes": self.notes, "elapsed_s": round(time.monotonic() - self.started, 1), "rows": self.rows,
        }, machine=args.machine)


# ---- recompute --------------------------------------------------------------------------------------


def run_recompute(run: Run, point: Point, hf) -> None:
    """The check prompt's recompute (twice), and with "none" among the tiers the timed recompute
    and transformers' prefill of a timed prompt."""
    engine, args = point.engine, run.args
    assert engine.connector is None
    engine.reset_prefix_cache()
    point.recompute = run_request(engine, point.check_prompt, CHECK_TOKENS)
    engine.reset_prefix_cache()
    point.recompute_again = run_request(engine, point.check_prompt, CHECK_TOKENS)
    engine.reset_prefix_cache()
    if "none" not in args.tiers.split(",") or args.policy == "cost":      # policy rows time "never" instead
        return
    warmup_ms, samples_ms, cache_hits, last = [], [], 0, None
    for i in range(2 * args.warmup + args.samples):
        prompt = point.prefixes[i % 2] + point.suffix()
        # The other prefix's request evicts nearly all of this one's blocks, not always every one
        # (the pool holds a request and a few blocks more): what is left goes explicitly.
        engine.reset_prefix_cache()
        with gc_paused():
            request = run_request(engine, prompt, 1)
        cache_hits += request.num_cached_tokens
        (warmup_ms if i < 2 * args.warmup else samples_ms).append(request.ttft_s * 1e3)
        last = (prompt, request)
    point.recompute_ms = median(samples_ms)
    row = {"model": point.model_name, "tier": "none", "tokens": point.num_tokens,
           "ttft_ms": round(point.recompute_ms, 3), "recompute_ms": round(point.recompute_ms, 3), "speedup": 1.0,
           "outputs_equal": point.recompute.output_token_ids == point.recompute_again.output_token_ids,
           "logits_equal_recompute": same_logits(point.recompute, point.recompute_again),
           "tier_forced": cache_hits == 0, "engine_cache_hit_tokens": cache_hits,
           "prompt_tokens": point.num_tokens + SUFFIX_TOKENS, "samples_ms": rounded(samples_ms),
           "warmup_ms": rounded(warmup_ms)}
    if hf is not None:
        prompt, request = last
        hf_ms, hf_samples, hf_logits = time_hf_prefill(hf, prompt, run.device, args.hf_warmup, args.hf_repeats)
        row.update({"hf_prefill_ms": round(hf_ms, 3), "engine_over_hf": round(point.recompute_ms / hf_ms, 4),
                    "hf_samples_ms": rounded(hf_samples),
                    "hf_logit_diff": round((hf_logits - request.logits[0]).abs().max().item(), 6),
                    "hf_token_equal": int(hf_logits.argmax()) == request.output_token_ids[0]})
    run.add(row)


def rounded(samples: list[float]) -> list[float]:
    return [round(s, 4) for s in samples]


# ---- restore ------------------------------------------------------------------------------------------


def daemon_sizes(model, token_counts: list[int]) -> tuple[int, int]:
    """L2 holding both prefixes of the longest point 2.5 times over (the rest is evicted as the run
    goes on), L3 three times that."""
    bytes_per_page = model.config.kv_bytes_per_token(torch.finfo(model.dtype).bits // 8) * BLOCK_SIZE
    pages = -(-int(2.5 * (max(token_counts) + SUFFIX_TOKENS)) // BLOCK_SIZE) + 64
    l2_bytes = max(pages * bytes_per_page, 8 << 20)
    return l2_bytes, 3 * l2_bytes


def start_peer_owner(run: Run, points: list[Point], socket_path: str) -> tuple[PeerOwner | None, dict]:
    """Engine A: the same model in a process of its own, which prefills every point's prefixes and
    keeps them in its GPU cache. Returns it and, per point, the KV A holds for each prefix (None, {}
    when the GPU has no room for a second copy of the weights: noted)."""
    model = points[0].engine.model
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    num_blocks = sum(2 * -(-(p.num_tokens + 1) // BLOCK_SIZE) for p in points) + 16
    kv_bytes = num_blocks * BLOCK_SIZE * model.config.kv_bytes_per_token(torch.finfo(model.dtype).bits // 8)
    if run.device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(run.device)
        if free_bytes < 1.2 * (weight_bytes + kv_bytes):
            note = (f"{points[0].model_name}: tier peer skipped: a second copy of the weights and A's cache "
                    f"({(weight_bytes + kv_bytes) / 2**30:.1f} GiB) does not fit in {free_bytes / 2**30:.1f} GiB free")
            run.notes.append(note)
            print(note, flush=True)
            return None, {}
    owner = PeerOwner("engine", socket_path, model=points[0].model_name, seed=run.args.seed, blocks=num_blocks,
                      page_size=BLOCK_SIZE)
    try:
        kv = {id(point): [torch.load(owner.fill(prefix), map_location=run.device) for prefix in point.prefixes]
              for point in points}
    except BaseException:
        owner.close()
        raise
    return owner, kv


def remote_lend_bytes(model, token_counts: list[int]) -> int:
    """The store's memory for tier remote: every prompt the run saves (both prefixes of each point,
    their suffixes' pages too) twice over, so that the store evicts none of them."""
    bytes_per_token = model.config.kv_bytes_per_token(torch.finfo(model.dtype).bits // 8)
    return max(2 * sum(2 * (n + 4 * SUFFIX_TOKENS) for n in token_counts) * bytes_per_token, 64 << 20)


def run_restores(run: Run, points: list[Point], tiers: list[str], o_direct: bool) -> None:
    """One daemon for these tiers; each point's engine gets a connector, saves both prefixes, then
    each tier is timed from them (peer last, on a connector with peer restores on). Tier remote
    alone: a daemon with the remote tier on and no L3, beside the other host (``RemoteHost``)."""
    if run.over_budget(f"{points[0].model_name}, tiers {','.join(tiers)}"):
        return
    model = points[0].engine.model
    l2_bytes, l3_bytes = daemon_sizes(model, [p.num_tokens for p in points])
    if tiers == ["remote"]:
        try:
            with RemoteHost(remote_lend_bytes(model, [p.num_tokens for p in points])) as host:
                from kvcached.testing.remote.cluster import STORE_ENV

                with KVDaemon(l2_bytes, 0, extra_args=host.daemon_args(), env=STORE_ENV) as daemon:
                    restore_points(run, points, tiers, daemon)
        except Exception as exc:        # recorded; the other tiers go on
            run.fail(f"{points[0].model_name}: the remote store", exc)
        return
    with KVDaemon(l2_bytes, l3_bytes, o_direct=o_direct, l3_dir=run.args.l3_dir) as daemon:
        restore_points(run, points, tiers, daemon)


def restore_points(run: Run, points: list[Point], tiers: list[str], daemon: KVDaemon) -> None:
    """``run_restores`` on its daemon."""
    control = owner = None
    try:
        owner_kv: dict = {}
        if "peer" in tiers:
            try:
                owner, owner_kv = start_peer_owner(run, points, daemon.socket_path)
            except Exception as exc:        # the other tiers go on
                run.fail(f"{points[0].model_name}: engine A for tier peer", exc)
        for point in points:
            what = f"{point.model_name} {point.num_tokens} tokens, tiers {','.join(tiers)}"
            if run.over_budget(what):
                continue
            try:
                attach = dict(model_id=point.model_name, model_revision=f"random-seed-{run.args.seed}",
                              client_name=f"ttft-{point.model_name}-{point.num_tokens}")
                connector = attach_kvcached(point.engine, daemon.socket_path, policy=run.args.policy, **attach)
                try:
                    if control is None:
                        control = TierControl(daemon, connector.geometry)
                    saved_kv, own_cache = save_prefixes(point, control)
                    for tier in tiers:
                        if tier != "peer":
                            run.add(time_tier(run, point, tier, control, saved_kv, own_cache, run.args.policy))
                    if id(point) in owner_kv:
                        detach_kvcached(point.engine)
                        config = ConnectorConfig(peer=True, promote_l3=False, policy=run.args.policy)
                        connector = attach_kvcached(point.engine, daemon.socket_path, config=config, **attach)
                        wait_for(lambda: connector.poll() or connector.stats().get("peers_opened", 0),
                                 "engine A to be opened")
                        run.add(time_tier(run, point, "peer", control, owner_kv[id(point)], own_cache,
                                          run.args.policy))
                finally:
                    detach_kvcached(point.engine)
            except Exception as exc:        # recorded; the other points go on
                run.fail(what, exc)
    finally:
        if control is not None:
            control.close()
        if owner is not None:
            owner.close()


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.001)


def save_prefixes(point: Point, control: TierControl) -> tuple[list[torch.Tensor], Request]:
    """Each prefix's first request: prefilled (nothing to load) and saved. Returns the KV its
    prefill wrote for each prefix, and the check prompt from the engine's own cache (its hit is
    that same KV: the numbers a restore must give)."""
    engine = point.engine
    engine.reset_prefix_cache()
    saved_kv, own_cache = [], None
    for k, prefix in enumerate(point.prefixes):
        request = run_request(engine, prefix + point.suffix(), 1)
        settle(engine, control)
        if request.num_loaded_tokens or request.num_cached_tokens:
            raise RuntimeError(f"a fresh prefix was found cached: {request.num_cached_tokens} tokens in the "
                               f"engine, {request.num_loaded_tokens} loaded")
        saved_kv.append(prefix_kv(engine, prefix))
        if k == 0:
            own_cache = run_request(engine, point.check_prompt, CHECK_TOKENS)
            settle(engine, control)
            if own_cache.num_cached_tokens != point.check_loaded_tokens:
                raise RuntimeError(f"the own-cache run hit {own_cache.num_cached_tokens} tokens, not "
                                   f"{point.check_loaded_tokens}")
    hits = [control.hits(prefix) for prefix in point.prefixes]
    if any(h["l2"] < point.timed_loaded_tokens for h in hits):
        raise RuntimeError(f"the prefixes were not all saved to L2: {hits}; {engine.connector.stats()}")
    return saved_kv, own_cache


def time_tier(run: Run, point: Point, tier: str, control: TierControl, saved_kv: list[torch.Tensor],
              own_cache: Request, policy: str = "always") -> dict:
    """The point's requests with the prefix forced into ``tier``, the connector's restore policy
    ``policy`` (``time_policies``)."""
    return time_policies(run, point, tier, control, saved_kv, own_cache, [policy])[policy]


@dataclasses.dataclass
class PolicySamples:
    """What one policy's requests of a tier gave (``time_policies``)."""
    warmup_ms: list[float] = dataclasses.field(default_factory=list)
    samples_ms: list[float] = dataclasses.field(default_factory=list)
    loaded: list[int] = dataclasses.field(default_factory=list)
    promoted: list[int] = dataclasses.field(default_factory=list)
    from_peer: list[int] = dataclasses.field(default_factory=list)
    choices: list[str] = dataclasses.field(default_factory=list)
    load_paths: list[str] = dataclasses.field(default_factory=list)
    phases: dict[str, list[float]] = dataclasses.field(default_factory=lambda: {
        "to_load": [], "to_copies": [], "copies": [], "to_token": [], "device_copies": []})
    cache_hits: int = 0
    kv_equal: bool = True


def time_policies(run: Run, point: Point, tier: str, control: TierControl, saved_kv: list[torch.Tensor],
                  own_cache: Request, policies: list[str]) -> dict[str, dict]:
    """The point's requests with the prefix forced into ``tier``, under each restore policy of
    ``policies`` (the connector's, switched before each request), their requests interleaved: each
    turn of a prefix (the two alternate) runs one request per policy, in an order that rotates from
    one turn to the next, so that whatever drifts during the run (the host, the page cache)
    weighs on every policy alike. "always" must restore every whole page of the prefix (from L3:
    promoted), "never" none; under "cost" the daemon chooses, and each timed request's choice (its
    lookup's) is recorded. A restored prefix's KV must be bit for bit the saved KV. A row per policy."""
    engine, args = point.engine, run.args
    connector = engine.connector
    runs = {policy: PolicySamples() for policy in policies}

    def force(token_ids, num_tokens: int) -> None:
        if tier != "peer":
            control.force(tier, token_ids, num_tokens)
            return
        offered = connector.lookup_async(token_ids).hit_tokens().get("peer", 0)     # (L2 holds it too)
        if offered < num_tokens:
            raise RuntimeError(f"engine A offers {offered} tokens, not {num_tokens}: {connector.stats()}")

    settle(engine, control)
    engine.reset_prefix_cache()          # the last check request's prefix
    for i in range(2 * args.warmup + args.samples):
        k = i % 2
        prefix = point.prefixes[k]
        for policy in policies[i % len(policies):] + policies[: i % len(policies)]:
            samples = runs[policy]
            connector.set_policy(policy)
            prompt = prefix + point.suffix()
            settle(engine, control)
            engine.reset_prefix_cache()       # as in the recompute: nothing of the prefix left on the GPU
            force(prefix, point.timed_loaded_tokens)
            before = connector.stats()
            with gc_paused():
                request = run_request(engine, prompt, 1)
            settle(engine, control)
            (samples.warmup_ms if i < 2 * args.warmup else samples.samples_ms).append(request.ttft_s * 1e3)
            samples.cache_hits += request.num_cached_tokens
            samples.loaded.append(request.num_loaded_tokens)
            after = connector.stats()
            samples.promoted.append(after.get("promoted_tokens", 0) - before.get("promoted_tokens", 0))
            samples.from_peer.append((after.get("peer_loaded_pages", 0) - before.get("peer_loaded_pages", 0))
                                     * BLOCK_SIZE)
            if i >= 2 * args.warmup:
                samples.choices.append(lookup_choice(before, after))
                samples.load_paths.append(counted("load_path_", before, after))
                for phase, ms in ttft_phases(request).items():
                    samples.phases[phase].append(ms)
            if request.num_loaded_tokens:
                samples.kv_equal &= torch.equal(prefix_kv(engine, prefix), saved_kv[k])

    checks = {}
    for policy in policies:
        # The check request: the first prefix alone from the tier, 16 greedy tokens.
        connector.set_policy(policy)
        settle(engine, control)
        engine.reset_prefix_cache()
        force(point.check_prompt, point.check_loaded_tokens)
        check = checks[policy] = run_request(engine, point.check_prompt, CHECK_TOKENS)
        settle(engine, control)
        if check.num_loaded_tokens:
            # Only the pages it loaded: where the prefix is a whole number of pages, the check request
            # computes its last page itself (one token at least is computed), in a chunk of another size.
            num_loaded_pages = point.check_loaded_tokens // BLOCK_SIZE
            runs[policy].kv_equal &= torch.equal(prefix_kv(engine, point.prefixes[0][: point.check_loaded_tokens]),
                                                 saved_kv[0][:, :, :num_loaded_pages])
    integrity = control.integrity()
    return {policy: policy_tier_row(point, tier, policy, runs[policy], checks[policy], own_cache, integrity)
            for policy in policies}


def policy_tier_row(point: Point, tier: str, policy: str, samples: PolicySamples, check: Request,
                    own_cache: Request, integrity: str) -> dict:
    """One tier and policy's row (``time_policies``): the median TTFT and the checks."""
    engine = point.engine
    restores = policy != "never"
    expected_loaded = point.timed_loaded_tokens if restores else 0
    expected_promoted = expected_loaded if tier.startswith("l3") or tier == "remote" else 0    # into L2 first
    expected_from_peer = expected_loaded if tier == "peer" else 0
    forced = policy == "cost" or (all(n == expected_loaded for n in samples.loaded)
                                  and all(n == expected_promoted for n in samples.promoted)
                                  and all(n == expected_from_peer for n in samples.from_peer)
                                  and check.num_loaded_tokens == (point.check_loaded_tokens if restores else 0))
    ttft_ms = median(samples.samples_ms)
    recompute = point.recompute
    row = {"model": point.model_name, "tier": tier, "tokens": point.num_tokens, "policy": policy,
           "ttft_ms": round(ttft_ms, 3),
           "recompute_ms": None if point.recompute_ms is None else round(point.recompute_ms, 3),
           "speedup": None if point.recompute_ms is None else round(point.recompute_ms / ttft_ms, 3),
           "outputs_equal": check.output_token_ids == recompute.output_token_ids,
           "kv_equal": bool(samples.kv_equal),
           "logit_diff": round(logit_difference(check, recompute), 6),
           "noise_floor": round(logit_difference(own_cache, recompute), 6),
           "logits_equal_own_cache": same_logits(check, own_cache),
           "tier_forced": samples.cache_hits == 0 and forced,
           "integrity_ok": integrity == "ok", "integrity": integrity,
           "loaded_tokens": samples.loaded, "promoted_tokens": samples.promoted, "peer_tokens": samples.from_peer,
           "choices": samples.choices, "load_paths": samples.load_paths,
           "engine_cache_hit_tokens": samples.cache_hits,
           "kv_bytes": point.timed_loaded_tokens * engine.model.config.kv_bytes_per_token(
               torch.finfo(engine.model.dtype).bits // 8),
           "prompt_tokens": point.num_tokens + SUFFIX_TOKENS, "samples_ms": rounded(samples.samples_ms),
           "warmup_ms": rounded(samples.warmup_ms),
           "phases_ms": {phase: rounded(values) for phase, values in samples.phases.items() if values}}
    row["within_noise"] = row["logit_diff"] <= row["noise_floor"]
    return row


def ttft_phases(request) -> dict[str, float]:
    """Where a restored request's TTFT went (ms), from its PendingLoad's times: to_load (arrival to
    load(): admission, the lookup's round trip), to_copies (load() to its copies queued: the acquire's
    round trip and the step that took the reply in), copies (queued to the load seen done), to_token
    (done to the first token: the prefill's part not under the load); and device_copies, the
    device time of the load's copies (the connector's LoadResult.transfer_s: from the copies'
    start on the load lane to their end), beside the host's view. Empty without a load."""
    load = request.load
    if load is None or load.queued_s is None or load.done_s is None or request.first_token_s is None:
        return {}
    return {"to_load": (load.started_s - request.arrival_s) * 1e3, "to_copies": (load.queued_s - load.started_s) * 1e3,
            "copies": (load.done_s - load.queued_s) * 1e3, "to_token": (request.first_token_s - load.done_s) * 1e3,
            "device_copies": load.transfer_s * 1e3}


def lookup_choice(before: dict[str, int], after: dict[str, int]) -> str:
    """What the connector's lookups chose between two snapshots of its counters (one request)."""
    return counted("lookup_choice_", before, after)


def counted(prefix: str, before: dict[str, int], after: dict[str, int]) -> str:
    """The counters named prefix + X that grew between two snapshots of the connector's: the Xs."""
    grew = [name.removeprefix(prefix) for name in after
            if name.startswith(prefix) and after[name] > before.get(name, 0)]
    return "+".join(sorted(grew)) or "none"


# ---- policy cost ---------------------------------------------------------------------------------------


def run_policy(run: Run, point: Point, tiers: list[str], o_direct: bool) -> None:
    """One fresh daemon (the cost model at its default priors) for these tiers of one point, in
    order; each tier timed under "cost", "always" and "never", their requests interleaved
    (``time_policies``: the first request of all is under "cost"); a policy row per tier, with the
    cost model as it stands after the tier."""
    what = f"{point.model_name} {point.num_tokens} tokens, policy cost, tiers {','.join(tiers)}"
    if run.over_budget(what):
        return
    model = point.engine.model
    l2_bytes, l3_bytes = daemon_sizes(model, [point.num_tokens])
    try:
        with KVDaemon(l2_bytes, l3_bytes, o_direct=o_direct, l3_dir=run.args.l3_dir) as daemon:
            control = None
            rows: dict[str, dict[str, dict]] = {}
            models = {}
            connector = attach_kvcached(point.engine, daemon.socket_path, model_id=point.model_name,
                                        model_revision=f"random-seed-{run.args.seed}", policy="cost",
                                        client_name=f"policy-{point.model_name}-{point.num_tokens}")
            try:
                control = TierControl(daemon, connector.geometry)
                saved_kv, own_cache = save_prefixes(point, control)
                for tier in tiers:
                    rows[tier] = time_policies(run, point, tier, control, saved_kv, own_cache,
                                               ["cost", "always", "never"])
                    connector.flush_report()       # its last timings, then
                    connector.flush()              # handled by the daemon
                    models[tier] = control.cost_model()
            finally:
                detach_kvcached(point.engine)
                if control is not None:
                    control.close()
        for tier in tiers:
            run.add(policy_row(rows[tier]["cost"], rows[tier]["always"], rows[tier]["never"], models[tier]))
    except Exception as exc:        # recorded; the other points go on
        run.fail(what, exc)


def policy_row(cost: dict, restore: dict, recompute: dict, cost_model: dict) -> dict:
    """One point and tier under the three policies. The restore and recompute runs' checks are the
    row's: every page restored bit for bit (always), none (never); the daemon's integrity. ``checks``
    keeps each policy's check request apart: its tokens against the recompute's, its logit
    difference against the noise floor (the engine's own cache hit on the same KV), and whether its
    logits equal that own cache hit's bit for bit."""
    choices = cost["choices"]
    choice = max(set(choices), key=choices.count) if choices else None
    faster_ms = min(restore["ttft_ms"], recompute["ttft_ms"])
    return {"model": cost["model"], "tier": cost["tier"], "tokens": cost["tokens"],
            "cost_ms": cost["ttft_ms"], "restore_ms": restore["ttft_ms"], "recompute_ms": recompute["ttft_ms"],
            "choice": choice, "within_5pct": cost["ttft_ms"] <= POLICY_TARGET * faster_ms,
            "faster": "restore" if restore["ttft_ms"] <= recompute["ttft_ms"] else "recompute",
            "choices": choices, "cost_loaded_tokens": cost["loaded_tokens"],
            "load_paths": {"cost": cost["load_paths"], "always": restore["load_paths"]},
            "cost_samples_ms": cost["samples_ms"], "restore_samples_ms": restore["samples_ms"],
            "recompute_samples_ms": recompute["samples_ms"],
            "kv_equal": cost["kv_equal"] and restore["kv_equal"],
            "tier_forced": restore["tier_forced"] and recompute["tier_forced"] and cost["tier_forced"],
            "integrity_ok": cost["integrity_ok"] and restore["integrity_ok"] and recompute["integrity_ok"],
            "outputs_equal": cost["outputs_equal"] and restore["outputs_equal"] and recompute["outputs_equal"],
            "checks": {name: {key: row[key] for key in ("outputs_equal", "logit_diff", "noise_floor", "within_noise",
                                                       "logits_equal_own_cache")}
                       for name, row in (("cost", cost), ("always", restore), ("never", recompute))},
            "cost_model": cost_model}


def policy_summary(rows: list[dict]) -> list[dict]:
    summary = [{"target": f"{r['model']} {r['tier']} {r['tokens']}: cost <= {POLICY_TARGET} x the faster "
                          f"({r['faster']})", "value": r["cost_ms"], "met": r["within_5pct"]} for r in rows]
    for row in rows:
        if (row["model"], row["tier"], row["tokens"]) == ("qwen3-8b", "l3-cold", 3500):
            summary.append({"target": "qwen3-8b, 3,500 tokens, cold L3: declined", "value": row["choice"],
                            "met": row["choice"] == "recompute"})
    warm_long = [r for r in rows if r["tier"] == "l3" and r["tokens"] >= 3500]
    if warm_long:
        summary.append({"target": "a warm-page-cache L3 restore of a long prefix is taken",
                        "value": [f"{r['model']} {r['tokens']}: {r['choice']}" for r in warm_long],
                        "met": any(r["choice"] == "l3" for r in warm_long)})
    return summary


# ---- main ---------------------------------------------------------------------------------------------


def run_model(run: Run, model_name: str, token_counts: list[int]) -> None:
    args = run.args
    tiers = args.tiers.split(",")
    model = load_model(model_name, dtype=run.dtype, device=run.device, seed=args.seed)
    hf, why = (None, "--no-hf") if args.no_hf else hf_twin(model)
    if why and why not in run.notes:
        run.notes.append(why)
        print(why, flush=True)
    points = []
    for num_tokens in token_counts:
        what = f"{model_name} {num_tokens} tokens"
        if run.over_budget(what):
            continue
        try:
            point = make_point(model, model_name, num_tokens, args.seed)
            run_recompute(run, point, hf)
            points.append(point)
        except Exception as exc:                # recorded; the other points go on
            run.fail(what, exc)
    if args.policy == "cost":
        warm = [t for t in tiers if t in ("l2", "l3")]
        for tier in ("peer", "remote"):
            note = f"tier {tier}: no policy rows (the policy matrix is l2, l3, l3-cold)"
            if tier in tiers and note not in run.notes:
                run.notes.append(note)
        for point in points:
            if warm:
                run_policy(run, point, warm, o_direct=False)
            if "l3-cold" in tiers:
                run_policy(run, point, ["l3-cold"], o_direct=True)
        return
    warm = [t for t in tiers if t in ("l2", "l3", "peer")]
    if points and warm:
        run_restores(run, points, warm, o_direct=False)
    if points and "l3-cold" in tiers:
        run_restores(run, points, ["l3-cold"], o_direct=True)
    if points and "remote" in tiers:
        run_restores(run, points, ["remote"], o_direct=False)


ISOLATED_ENV = "KVCACHED_BENCH_ISOLATED"


def isolate_for_the_store(argv: list[str]) -> int | None:
    """Tier remote: rerun this benchmark in a network namespace of loopback only (the store's
    processes listen on 0.0.0.0 too); its exit status, or None to go on here: already inside, or
    no namespace to be had (no unshare, or refused; the result's notes say so)."""
    if os.environ.get(ISOLATED_ENV):
        return None
    from kvcached.testing.remote.cluster import STORE_ENV, _isolating, missing

    why = missing()
    if why.startswith(("unshare", "cannot enter a network namespace")):       # (a machine with no network)
        os.environ.update({**STORE_ENV, ISOLATED_ENV: f"refused: {why}"})
        print(f"tier remote runs in place: {why}", flush=True)
        return None
    if why:
        raise SystemExit(f"tier remote cannot run: {why}")
    env = {**os.environ, **STORE_ENV, ISOLATED_ENV: "1"}
    return subprocess.run(_isolating([sys.executable, "-m", "bench.bench_ttft", *argv]), env=env).returncode


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", default=DEFAULT_POINTS,
                        help=f"SHAPE=TOKENS,...;... in run order (default {DEFAULT_POINTS!r})")
    parser.add_argument("--tiers", default=",".join(t for t in TIERS if t != "remote"),
                        help=f"of {','.join(TIERS)} (default: all but remote, which needs the store's wheel)")
    parser.add_argument("--samples", type=int, default=8, help="timed requests per point and tier (median)")
    parser.add_argument("--warmup", type=int, default=2, help="alternations of the two prefixes, untimed")
    parser.add_argument("--hf-warmup", type=int, default=2)
    parser.add_argument("--hf-repeats", type=int, default=5)
    parser.add_argument("--no-hf", action="store_true", help="do not time transformers' prefill")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new point after this many seconds (the rest is listed as skipped)")
    parser.add_argument("--l3-dir", default=None, help="where the daemons' L3 files go (a disk, not tmpfs)")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--policy", default="always", choices=("always", "never", "cost"),
                        help="the connector's restore policy; cost: policy rows (policy.json), see above")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {QUICK_POINTS}, 3 samples after 1 alternation; no result file")
    parser.add_argument("--name", default=None, help="result file (bench/results/<machine>/<name>.json); "
                                                     "default ttft, none with --quick")
    parser.add_argument("--machine", default=None)
    args = parser.parse_args()
    unknown = set(args.tiers.split(",")) - set(TIERS)
    if unknown:
        raise SystemExit(f"--tiers: unknown {sorted(unknown)}, not of {TIERS}")
    if "remote" in args.tiers.split(",") and args.policy != "cost":
        status = isolate_for_the_store(sys.argv[1:])
        if status is not None:
            raise SystemExit(status)
    if args.quick:
        if args.points == DEFAULT_POINTS:
            args.points = QUICK_POINTS
        args.samples, args.warmup = min(args.samples, 3), min(args.warmup, 1)
        args.hf_warmup, args.hf_repeats = min(args.hf_warmup, 1), min(args.hf_repeats, 2)
    else:
        args.name = args.name or ("policy" if args.policy == "cost" else "ttft")
    logging.basicConfig(level=logging.WARNING)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    plan = parse_points(args.points)
    run = Run(args, device, dtype, plan)
    if os.environ.get(ISOLATED_ENV, "1") != "1":
        run.notes.append(f"tier remote: not in a network namespace of its own ({os.environ[ISOLATED_ENV]})")
    try:
        for model_name, token_counts in plan:
            if not run.over_budget(f"{model_name} (all of it)"):
                try:
                    run_model(run, model_name, token_counts)
                except Exception as exc:        # e.g. out of memory: the next shape goes on
                    run.fail(model_name, exc)
                gc.collect()             # the model, its engines and KV before the next shape's
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        run.write()
        if run.rows:
            print()
            print_table(run.rows, POLICY_COLUMNS if args.policy == "cost" else COLUMNS)
        summary = run.summary()
        if summary:
            print_table(summary, ["target", "value", "met"])
        if getattr(run, "path", None):
            print(f"wrote {run.path}")
    if run.failures:
        raise SystemExit(f"checks failed: {run.failures}")


if __name__ == "__main__":
    main()
