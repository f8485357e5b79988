"""Several engine processes on one GPU sharing prefixes through one daemon (``bench_stress --engines N``).

Each engine process (spawned) holds the same model (same seed: the same weights, one namespace),
16 shared prefixes of 2,000 tokens, and its own requests: every prefix twice in a seeded random
order of its own, each with a unique suffix, 1 output token, one request at a time. Its block
pool holds 4 requests, so its own GPU cache cannot keep the 16 prefixes. Two phases over the same
requests, all engines starting together: ``none`` (each engine alone, its own GPU cache only),
then ``l2`` (each engine with its connector to the one daemon: a prefix one engine prefilled and
saved is loaded by the others). Per phase: aggregate req/s (every engine's requests over the time
from the first start to the last first token), TTFT percentiles, and for l2 the
``cross_engine_hit_tokens``: tokens loaded for a prefix the loading engine had not prefilled
itself in that phase (so saved by another engine).

How many engines run (``size_engines``): as many as asked, but no more than the GPU's free memory
at the start holds (``MEMORY_HEADROOM`` of it), each engine counted as its model's weights and
buffers, its KV block pool, the connector's two transfer workspaces and ``ENGINE_OVERHEAD_BYTES``
(its CUDA context, activations, the allocator's slack); the result file says what was asked, what
ran and why.

Each phase's first tokens are checked in the engine process afterwards, untimed and without the
connector, against the engine itself alone computing the same prompt the way the request did: a
request that reused its whole prefix (from its own cache or loaded) against the prompt on top of
that prefix in the engine's own cache (put there by a full prefill of the prefix and another
suffix: a prefill of a prompt of that length writes the prefix's KV the same bits, whichever its
suffix), any other against a full prefill. ``mismatches`` counts first tokens whose logits differ
in any bit. The reused tokens may be part of a prefix (``partial_requests``: the engine's own
cache kept only some of its blocks); the reference then holds that part. What it assumes: every
reused block was written by a prefill of a prompt of this length from token 0. A block written
on top of a partial hit (the rest of a prefix prefilled after its leading blocks were reused),
then reused whole, holds other bits than that, and its requests would count as mismatches
although nothing was mixed up (none did in the committed run).
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import queue as queue_module
import time
import traceback

import numpy as np
import torch

from bench.common import gc_paused, percentile
from bench.engine import Engine, EngineConfig, load_model
from bench.tiers import KVDaemon, attach_kvcached, detach_kvcached, run_request, settle
from engine_client.client import connect
from engine_client.kv_transfer import DEFAULT_WORKSPACE_BYTES

BLOCK_SIZE = 16
PHASES = ("none", "l2")
WAIT_TIMEOUT_S = 300.0
MEMORY_HEADROOM = 0.9                 # of the GPU's free memory at the start, what the engines may take
ENGINE_OVERHEAD_BYTES = 2 << 30       # an engine process beyond its weights, KV pool and workspaces


@dataclasses.dataclass(frozen=True)
class Spec:
    model: str
    seed: int
    num_prefixes: int = 16
    prefix_tokens: int = 2000
    suffix_tokens: int = 16
    repeats: int = 2                  # each prefix this many times per engine
    pool_requests: int = 4            # the engine's block pool, in requests

    @property
    def blocks_per_request(self) -> int:
        return -(-(self.prefix_tokens + self.suffix_tokens + 1) // BLOCK_SIZE)


def engine_process(index: int, spec: Spec, socket_path: str, barrier, results) -> None:
    """One engine: ready, then each phase on the barrier; results (or the error) on the queue."""
    try:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = load_model(spec.model, dtype=dtype, device=device, seed=spec.seed)
        vocab_size = model.config.vocab_size
        shared = np.random.default_rng(spec.seed)
        prefixes = [shared.integers(0, vocab_size, size=spec.prefix_tokens).tolist() for _ in range(spec.num_prefixes)]
        own = np.random.default_rng([spec.seed, index])
        order = own.permutation(np.repeat(np.arange(spec.num_prefixes), spec.repeats)).tolist()
        prompts = [prefixes[k] + own.integers(0, vocab_size, size=spec.suffix_tokens).tolist() for k in order]
        engine = Engine(model, EngineConfig(num_blocks=spec.pool_requests * spec.blocks_per_request,
                                            block_size=BLOCK_SIZE, max_num_seqs=1, keep_logits=True))
        reusable = spec.prefix_tokens - spec.prefix_tokens % BLOCK_SIZE
        phase_requests = {}
        barrier.wait(WAIT_TIMEOUT_S)                  # every engine loaded
        for phase in PHASES:
            if phase == "l2":
                attach_kvcached(engine, socket_path, model_id=spec.model, model_revision=f"random-seed-{spec.seed}",
                                client_name=f"engine-{index}")
            engine.reset_prefix_cache()
            barrier.wait(WAIT_TIMEOUT_S)              # all start together
            requests = []
            with gc_paused():
                started = time.perf_counter()
                for prompt in prompts:
                    request = engine.add_request(prompt, 1)
                    while request.finish_s is None:
                        engine.step()
                    requests.append(request)
            settle(engine)
            prefilled_by_me, cross_engine = set(), 0
            for k, request in zip(order, requests):
                if request.num_loaded_tokens and k not in prefilled_by_me:
                    cross_engine += request.num_loaded_tokens
                if request.num_prefilled_tokens > reusable:
                    prefilled_by_me.add(k)
            phase_requests[phase] = requests
            results.put({"engine": index, "phase": phase, "started": started,
                         "ended": max(r.first_token_s for r in requests),
                         "ttft_ms": [r.ttft_s * 1e3 for r in requests],
                         "tokens": [r.output_token_ids[0] for r in requests],
                         "engine_cache_hit_tokens": sum(r.num_cached_tokens for r in requests),
                         "loaded_tokens": sum(r.num_loaded_tokens for r in requests),
                         "cross_engine_hit_tokens": cross_engine,
                         "connector": engine.connector.stats() if engine.connector is not None else None})
            barrier.wait(WAIT_TIMEOUT_S)              # the phase is over for all
        detach_kvcached(engine)
        filler = np.random.default_rng([spec.seed, index, 1])
        for phase in PHASES:
            results.put({"engine": index, "phase": phase, "check": check(engine, prompts, phase_requests[phase],
                                                                         reusable, filler)})
    except BaseException:
        results.put({"engine": index, "error": traceback.format_exc()})
        barrier.abort()


def check(engine: Engine, prompts, requests, reusable: int, rng) -> dict[str, int]:
    """The phase's first tokens against the engine alone computing each prompt the way its request
    did: on top of the tokens it reused (cached or loaded), put in its own cache by a prefill of
    those tokens and a filler to the prompt's length (see the module's docstring)."""
    mismatches = partial = 0
    for prompt, request in zip(prompts, requests, strict=True):
        reused = request.num_cached_tokens + request.num_loaded_tokens
        partial += 0 < reused < reusable
        engine.reset_prefix_cache()
        if reused:
            filler = rng.integers(0, engine.model.config.vocab_size, size=len(prompt) - reused).tolist()
            run_request(engine, prompt[:reused] + filler, 1)
        reference = run_request(engine, prompt, 1)
        if reference.num_cached_tokens != reused:
            raise RuntimeError(f"the reference reused {reference.num_cached_tokens} tokens, the request {reused}")
        mismatches += not torch.equal(reference.logits[0], request.logits[0])
    return {"mismatches": mismatches, "partial_requests": partial}


def run_engines(num_engines: int, spec: Spec, l3_dir: str | None) -> list[dict]:
    """Both phases with num_engines engine processes; a row per phase."""
    bytes_per_page = _bytes_per_page(spec)
    # Every prefix, and two pages for each request's suffix.
    pages = spec.num_prefixes * spec.blocks_per_request + 2 * num_engines * spec.num_prefixes * spec.repeats + 64
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(num_engines + 1)
    results = context.Queue()
    rows: list[dict] = []
    with KVDaemon(max(pages * bytes_per_page, 8 << 20), 2 * max(pages * bytes_per_page, 8 << 20),
                  l3_dir=l3_dir) as daemon:
        processes = [context.Process(target=engine_process, args=(i, spec, daemon.socket_path, barrier, results),
                                     name=f"stress-engine-{i}") for i in range(num_engines)]
        for process in processes:
            process.start()
        try:
            barrier.wait(WAIT_TIMEOUT_S)
            # Items come from several processes' queue feeders: told apart by their keys, never by
            # their order (a check put after a barrier may overtake a result put before it).
            by_phase: dict[str, list[dict]] = collections.defaultdict(list)
            checks: dict[str, list[dict]] = collections.defaultdict(list)

            def take() -> None:
                item = results.get(timeout=WAIT_TIMEOUT_S)
                if "error" in item:
                    raise RuntimeError(f"engine {item['engine']}: {item['error']}")
                if "check" in item:
                    checks[item["phase"]].append(item["check"])
                else:
                    by_phase[item["phase"]].append(item)

            for phase in PHASES:
                barrier.wait(WAIT_TIMEOUT_S)
                barrier.wait(WAIT_TIMEOUT_S)
            while sum(map(len, by_phase.values())) + sum(map(len, checks.values())) < 2 * len(PHASES) * len(processes):
                take()
            per_phase = {phase: sorted(by_phase[phase], key=lambda r: r["engine"]) for phase in PHASES}
            for process in processes:
                process.join(WAIT_TIMEOUT_S)
        except BaseException as exc:
            errors = _drain_errors(results)
            raise RuntimeError(f"an engine process failed: {errors or exc}") from exc
        finally:
            for process in processes:
                if process.is_alive():
                    process.terminate()
                    process.join(10)
        with connect(daemon.socket_path) as client:
            integrity = client.status(check_integrity=True)["integrity"]
    for phase in PHASES:
        engines = per_phase[phase]
        ttft_ms = [t for e in engines for t in e["ttft_ms"]]
        wall_s = max(e["ended"] for e in engines) - min(e["started"] for e in engines)
        row = {"model": spec.model, "tier": phase, "engines": num_engines, "batch": 1, "requests": len(ttft_ms),
               "req_per_s": round(len(ttft_ms) / wall_s, 3), "speedup": None, "wall_s": round(wall_s, 4),
               "ttft_p50_ms": round(percentile(ttft_ms, 50), 3), "ttft_p95_ms": round(percentile(ttft_ms, 95), 3),
               "ttft_p99_ms": round(percentile(ttft_ms, 99), 3),
               "engine_cache_hit_tokens": sum(e["engine_cache_hit_tokens"] for e in engines),
               "loaded_tokens": sum(e["loaded_tokens"] for e in engines),
               "cross_engine_hit_tokens": sum(e["cross_engine_hit_tokens"] for e in engines),
               "mismatches": sum(c["mismatches"] for c in checks[phase]),
               "partial_requests": sum(c["partial_requests"] for c in checks[phase]),
               "reference": "each engine alone, untimed, computing the prompt the way the request did: on top of "
                            "the whole prefix in its own cache, or a full prefill; first-token logits bit for bit",
               "kv_mismatches": None}
        if phase == "l2":
            without = [t for e in per_phase["none"] for t in e["tokens"]]
            restored = [t for e in engines for t in e["tokens"]]
            row["tokens_unlike_none_phase"] = sum(a != b for a, b in zip(restored, without, strict=True))
            row["integrity"] = integrity
            row["connector_failed_or_skipped_pages"] = sum(
                e["connector"].get("load_failed_pages", 0) + e["connector"].get("save_skipped_pages", 0)
                for e in engines)
        rows.append(row)
    rows[1]["speedup"] = round(rows[1]["req_per_s"] / rows[0]["req_per_s"], 3)
    rows[0]["speedup"] = 1.0
    return rows


def engine_bytes(spec: Spec) -> dict[str, int]:
    """The GPU memory one engine process takes, by part (bf16; the weights counted on the meta device)."""
    from bench.engine import PRESETS
    from bench.engine.model import Qwen3Model

    model = Qwen3Model(PRESETS[spec.model], torch.bfloat16, "meta")
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    kv_pool = spec.pool_requests * spec.blocks_per_request * BLOCK_SIZE * PRESETS[spec.model].kv_bytes_per_token(2)
    return {"weights": weights, "kv_pool": kv_pool, "transfer_workspaces": 2 * DEFAULT_WORKSPACE_BYTES,
            "overhead": ENGINE_OVERHEAD_BYTES}


def size_engines(asked: int, spec: Spec) -> dict:
    """How many of ``asked`` engines run: on CUDA, at most as many as MEMORY_HEADROOM of the free
    memory holds (``engine_bytes`` each), at least one; on CPU, all of them."""
    if not torch.cuda.is_available():
        return {"asked": asked, "engines": asked, "rule": "on CPU: as many as asked"}
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    parts = engine_bytes(spec)
    per_engine = sum(parts.values())
    fit = int(free_bytes * MEMORY_HEADROOM // per_engine)
    return {"asked": asked, "engines": max(1, min(asked, fit)), "fit": fit, "free_bytes": free_bytes,
            "total_bytes": total_bytes, "per_engine_bytes": per_engine, "per_engine_parts": parts,
            "headroom": MEMORY_HEADROOM,
            "rule": f"min(asked, {MEMORY_HEADROOM} of the free GPU memory // the bytes of one engine), at least 1"}


def _bytes_per_page(spec: Spec) -> int:
    from bench.engine import PRESETS

    itemsize = 2 if torch.cuda.is_available() else 4
    return PRESETS[spec.model].kv_bytes_per_token(itemsize) * BLOCK_SIZE


def _drain_errors(results) -> list[str]:
    errors = []
    while True:
        try:
            item = results.get(timeout=1.0)
        except queue_module.Empty:
            return errors
        if "error" in item:
            errors.append(f"engine {item['engine']}: {item['error']}")
