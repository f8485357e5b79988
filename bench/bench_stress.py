"""Throughput on the reference engine: prefixes in rotation, recompute against restores from L2.

8 prefixes of 350 tokens; 160 requests, request j = prefix j % 8 + a unique 16-token suffix, 1
output token; each case (tier, policy, batch size) has its own 160 suffixes, so no case restores
what an earlier one saved beyond a prefix. A batch of b keeps
b requests in the engine (closed loop: one finishes, the next enters). The engine's block pool
holds b + 1 requests (one to spare: the next request need not wait for the blocks of the last one
to be read by its save), so at batch 1 its own GPU cache never still holds a prefix when it comes
round again. At batch > 1 requests may finish out of order (one whose load took longer finishes after
requests admitted after it): its blocks, released late, are the last the next admissions evict,
and the request of the same prefix 8 later may find the prefix's first blocks still there. It
takes them from its own cache and loads the rest (``engine_cache_hit_tokens``): a whole prefix
without a recompute, counted as restored.
Tiers:

  none     no connector: every request prefills its prefix
  l2       the prefixes in L2 (saved by another engine first); each request loads its prefix
  l3-cold  the prefixes in L3 alone, cold (O_DIRECT, page cache dropped), in a daemon of their own
           whose L2 holds fewer requests than the rotation: a prefix saved to L2 is gone from it
           when it comes round again, and its new pages are written through to L3. Under "cost",
           once L2 lacks free pages for a save, the daemon reserves none for a path whose L3 hit
           it declined and that was last used before the page L2 would evict next (its copy would be evicted
           before its next use): those requests write nothing, and the prefixes L2 holds stay
           there, restored from it when they come round (``restored_requests``)

Each tier with a connector runs under each restore policy of ``--policies``: "always" (every hit
restored: the tier forced) and "cost" (the daemon's cost model decides; its L3-cold rows are the
write-up's case: with a cold L3, its req/s must stay >= 0.97 x recompute's).

Per batch, every case runs ``--repeats`` times (default 3), in turn: one run of each, then the
next round; a row's speed-up is over tier none's row of the same round. The summary's target holds
only if it holds in every round (runs of one case vary by a few % from one to the next). A row
runs 160 requests (about 2 s at batch 1): at 80 (about 1 s) a burst of slow steps on the host,
seen in rows without kvcached too, moved a row's req/s by up to 10%.

Per tier and batch: req/s (the requests over the time from the first request in to the last first token),
TTFT p50/p95/p99 (add_request -> first token), and:
  mismatches      requests whose token differs from the reference for the same prompt, run alone
                  at batch 1 the way the tier computes it: a full prefill for none; for l2 the
                  prefix from the engine's own cache, holding the very KV that L2 holds
  mismatch_margins  per mismatch: the margin by which the reference's token beat the one chosen,
                  against that prompt's noise floor (its two references' largest logit difference);
                  ``mismatches_beyond_noise`` counts those beyond it (must be 0: a near tie of random
                  weights' flat logits that bf16 rounding moves is not a wrong result, one beyond is)
  kv_mismatches   (l2) prefixes whose restored KV, after the timed run, is not bit for bit what the
                  engine's prefill wrote when it saved them
  recompute_mismatches  (l2) tokens that differ from a full prefill's (bf16 rounding moves a
                  near-tied argmax of random weights; reported, not a failure)
the engine's own cache hits (0), the tokens loaded, and the daemon's integrity check.

With ``--engines N``, also up to N engine processes on the GPU sharing prefixes through one daemon,
against the same engines without kvcached (``bench/stress_engines.py``; rows with engines = those
that ran): as many as the GPU's free memory holds (``engines_sizing`` in the result file says the
count asked, the count run and the memory each engine was counted at).

    python -m bench.bench_stress                     # bench/results/<card>/stress.json
    python -m bench.bench_stress --batches '' --engines 8 --name stress_engines    # up to 8 Qwen3-4B engines
    python -m bench.bench_stress --quick             # CPU smoke run, tiny shape, no result file
    python -m bench.bench_stress --tiers none,l3-cold --policies cost --pin --name stress_pinned

``--pin`` runs the cases on the low-latency wiring of deploy/README.md: the daemon's socket thread
and its ZeroMQ I/O thread on one CPU, busy-polling 20 ms after each request (``--socket-cpu``,
``--spin-us``); the engine's thread and its client's ZeroMQ I/O thread on another (``connect``'s
``cpu``), busy-polling up to 2 ms for a reply. A round trip then needs no sleeping thread woken:
after an idle gap, a wake-up is most of a lookup's wait. Each row's ``admission_wait_p50_ms``
(arrival to admission: the lookup's wait, where there is one) shows it, ``daemon_match_mean_ms``
the daemon's part of it (its handling of the timed requests' acquires, from its status: the rest
of the wait is the engine's and the transport's), and ``admission_to_token_p50_ms`` the rest of
the TTFT (the prefill, and whatever slows it).

``--saves-off`` adds, in each round, the l3-cold case under cost with the connector's saves off
(``saves`` False: no L2 reservation, no save's copy, no commit, no write-through to L3): what the
lookup alone costs. Its req/s against the row with saves shows what the backups cost the engine
(the issue: write-through must never sit on an engine's critical path). Not in the summary.

``--predict-off`` adds, in each round, the l3-cold case under cost with the connector's
``predict`` False: every begun lookup waits for the daemon's reply before the request is admitted,
where by default the admission hints (``proto.hints``) let a predicted decline start its prefill
at once. Its req/s against the default row is what the prediction gains. Not in the summary.
Each row's ``predicted_requests`` counts the timed requests admitted on a prediction, and
``prefill_span_p50_ms`` is the GPU's part of ``admission_to_token_p50_ms`` (a prefill step's first
launch to its tokens' copy, CUDA events; None on CPU): the rest of it is host time. Beside it, the
host's part of a prefill step: ``prefill_launch_p50_ms`` (its forward's and tokens' launches: close
to the span where the forward is bound by its launches), ``prefill_save_call_p50_ms`` (the saves
queued after them) and ``prefill_token_wait_p50_ms`` (polling until the tokens are in); before
it, the gap from the last step's tokens to its first launch on the host (``prefill_gap_p50_ms``;
of it ``prefill_schedule_p50_ms``, the connector's news first, ``prefill_schedule_poll_p50_ms``,
and ``add_request_mean_ms`` per request) and on the GPU (``prefill_gpu_gap_p50_ms``: longer where
the next forward waited on the GPU, say behind a save's copies). ``prefill_mean_ms`` has the
means of all these (a batch-1 cycle is their sum), ``prefill_steps`` how many prefill steps the
requests took, and ``prefill_step_log`` each step in order: its chunks (those on top of cached or
loaded tokens, those waiting for a load layer by layer), new tokens, gaps, scheduling, launch and
span (how the batch was grouped, and what each kind of step cost).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import itertools
import os
import time
import traceback

import numpy as np
import torch

from bench.common import exit_on_sigterm, gc_paused, percentile, print_table, profiled, write_result
from bench.engine import PRESETS, Engine, EngineConfig, load_model
from bench.engine.engine import PrefillTiming
from bench.stress_engines import Spec, run_engines, size_engines
from bench.tiers import KVDaemon, attach_kvcached, detach_kvcached, prefix_kv, run_request, settle
from kvcached.testing.tiers import TierControl
from engine_client.connector import ConnectorConfig

BLOCK_SIZE = 16
STRESS_TIERS = ("none", "l2", "l3-cold")
POLICIES = ("always", "cost")
PIN_DAEMON_SPIN_US = 20_000      # --pin: the daemon busy-polls this long after each request
PIN_CLIENT_SPIN_S = 2e-3         # --pin: the engine's client busy-polls this long for a reply
COLD_L3_TARGET = 0.97            # policy cost with a cold L3: req/s at least this times recompute's
# The daemon's counters a row reports (their change over the timed run): its ACQUIRE handling, its
# promotions and their reads (published, cut for want of room, failed, checksum mismatches), and
# the room its L2 had (reservations cut or failed, evictions).
DAEMON_COUNTS = ("acquire_", "match_", "s2h_", "h2s_", "promotions", "restore_fallbacks", "l3_checksum", "l3_pages_dropped",
                 "reservations_capped", "backup_reserve_failures", "backup_pages_", "backup_policy_skips",
                 "evicted_pages")
COLUMNS = ["model", "tier", "policy", "saves", "predict", "engines", "batch", "repeat", "req_per_s", "speedup",
           "ttft_p50_ms", "admission_wait_p50_ms", "daemon_match_mean_ms", "admission_to_token_p50_ms",
           "prefill_span_p50_ms", "prefill_gap_p50_ms", "prefill_gpu_gap_p50_ms", "prefill_schedule_p50_ms",
           "prefill_schedule_poll_p50_ms", "prefill_launch_p50_ms", "prefill_save_call_p50_ms",
           "prefill_token_wait_p50_ms", "prefill_after_p50_ms",
           "ttft_p95_ms", "ttft_p99_ms", "restored_requests", "predicted_requests",
           "mismatches", "mismatches_beyond_noise", "kv_mismatches", "engine_cache_hit_tokens"]


class Workload:
    """The prefixes, and per case its own prompts (unique suffixes: no run finds pages that an
    earlier run saved beyond a prefix)."""

    def __init__(self, args, vocab_size: int):
        self.rng = np.random.default_rng(args.seed)
        self.vocab_size = vocab_size
        self.suffix_tokens = args.suffix_tokens
        self.num_requests = args.requests
        self.prefixes = [self._tokens(args.prefix_tokens) for _ in range(args.prefixes)]
        self.restorable_tokens = args.prefix_tokens // BLOCK_SIZE * BLOCK_SIZE     # every whole page of a prefix
        self.blocks_per_request = -(-(args.prefix_tokens + args.suffix_tokens + 1) // BLOCK_SIZE)

    def _tokens(self, count: int) -> list[int]:
        return self.rng.integers(0, self.vocab_size, size=count).tolist()

    def fresh(self, prefix: list[int]) -> list[int]:
        """The prefix with a suffix of its own (warm-ups, seeds, checks)."""
        return prefix + self._tokens(self.suffix_tokens)

    def prompts(self) -> list[list[int]]:
        """Request j: prefix j % 8 and a new suffix."""
        return [self.fresh(self.prefixes[j % len(self.prefixes)]) for j in range(self.num_requests)]


class Wiring:
    """Where the timed engine's thread and the daemons' socket threads run: as the OS places them,
    or (``--pin``) the low-latency wiring: the daemon's socket thread on one CPU, the engine's
    thread and its client's ZeroMQ I/O thread on another, both busy-polling (module docstring)."""

    def __init__(self, pin: bool):
        self.cpus = sorted(os.sched_getaffinity(0))
        if pin and len(self.cpus) < 3:
            raise SystemExit(f"--pin needs 3 CPUs or more, this process may use {self.cpus}")
        self.pin = pin
        self.daemon_cpu, self.engine_cpu = (self.cpus[-1], self.cpus[-2]) if pin else (None, None)

    def daemon_args(self) -> tuple[str, ...]:
        if not self.pin:
            return ()
        return ("--socket-cpu", str(self.daemon_cpu), "--spin-us", str(PIN_DAEMON_SPIN_US))

    def connect_args(self) -> dict:
        return {"cpu": self.engine_cpu, "spin_s": PIN_CLIENT_SPIN_S} if self.pin else {}

    @contextlib.contextmanager
    def engine_thread(self):
        """The calling (engine) thread on its CPU meanwhile (daemons are started outside: a child
        inherits its parent thread's CPUs)."""
        if not self.pin:
            yield
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {self.engine_cpu})
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)

    def describe(self) -> dict:
        return {"pinned": self.pin, "daemon_socket_cpu": self.daemon_cpu, "engine_cpu": self.engine_cpu,
                "daemon_spin_us": PIN_DAEMON_SPIN_US if self.pin else None,
                "client_spin_s": PIN_CLIENT_SPIN_S if self.pin else None}


def make_engine(model, blocks: int, max_num_seqs: int, keep_logits: bool = False) -> Engine:
    return Engine(model, EngineConfig(num_blocks=blocks, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
                                      keep_logits=keep_logits))


def closed_loop(engine: Engine, prompts: list[list[int]], batch: int, timeout_s: float = 600.0):
    """Every prompt through the engine, batch of them in it at a time. Returns the requests in
    prompt order and the time from the first request in to the last one's first token."""
    pending = collections.deque(prompts)
    requests, in_flight = [], set()
    deadline = time.monotonic() + timeout_s
    with gc_paused():
        started = time.perf_counter()
        while pending or in_flight:
            while pending and len(in_flight) < batch:
                requests.append(engine.add_request(pending.popleft(), 1))
                in_flight.add(requests[-1])
            in_flight.difference_update(engine.step())
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending) + len(in_flight)} requests left after {timeout_s} s")
        wall_s = max(r.first_token_s for r in requests) - started
    return requests, wall_s


class Reference:
    """What each prompt gives alone at batch 1: a full prefill (``recompute``); and, once one
    engine has saved the prefixes to L2 (the KV its prefill wrote for each: ``saved_kv``), the
    prefix from that engine's own cache, the very KV that L2 holds (``own_cache``)."""

    def __init__(self, model, workload: Workload, daemon: KVDaemon | None, args):
        # Both references keep their first token's logits (for mismatch_margins), as they ran.
        self.recompute_engine = make_engine(model, workload.blocks_per_request, 1, keep_logits=True)
        self.logits: dict[str, list[torch.Tensor]] = {"recompute": [], "own_cache": []}    # of the last prompts
        self.workload = workload
        self.cache_engine = self.saved_kv = None
        if daemon is None:
            return
        # Room for every prefix and the blocks of one case's prompts beyond them. Older prompts'
        # blocks are evicted first (least recently released): a prefix's blocks were released by
        # the last of the 8 prompts in rotation that used it, so they stay; own_cache checks it.
        self.cache_engine = make_engine(model, len(workload.prefixes) * workload.blocks_per_request
                                        + 4 * workload.num_requests + 64, 1, keep_logits=True)
        connector = attach_kvcached(self.cache_engine, daemon.socket_path, model_id=args.model,
                                    model_revision=f"random-seed-{args.seed}", client_name="stress-reference")
        control = TierControl(daemon, connector.geometry)
        self.saved_kv = []
        try:
            for prefix in workload.prefixes:
                request = run_request(self.cache_engine, workload.fresh(prefix), 1)
                if request.num_loaded_tokens or request.num_cached_tokens:
                    raise RuntimeError("a fresh prefix was found cached")
                self.saved_kv.append(prefix_kv(self.cache_engine, prefix))
            settle(self.cache_engine, control)
            hits = [control.hits(prefix)["l2"] for prefix in workload.prefixes]
            if min(hits) < workload.restorable_tokens:
                raise RuntimeError(f"the prefixes were not all saved to L2 (hits {hits}): {connector.stats()}")
        finally:
            control.close()
            detach_kvcached(self.cache_engine)     # nothing more is saved from here on

    def recompute(self, prompts) -> list[int]:
        tokens, self.logits["recompute"], self.logits["own_cache"] = [], [], []     # a case's prompts
        for prompt in prompts:
            self.recompute_engine.reset_prefix_cache()
            request = run_request(self.recompute_engine, prompt, 1)
            tokens.append(request.output_token_ids[0])
            self.logits["recompute"].append(request.logits[0].float())
        return tokens

    def mismatch_margins(self, prompts, tokens: list[int], restored: list[bool], references: list[int]) -> list[dict]:
        """For each prompt whose token differs from its reference's, from both references' logits as
        they ran (``recompute``, ``own_cache``, for these prompts): ``margin``, how far the
        reference's token's logit is above that of the token the timed run chose; ``noise_floor``,
        the largest logit difference between the prompt's two references (the prefix from the
        engine's own cache, and a full prefill: both exact computations, apart by bf16 rounding
        alone). A margin within the noise floor is a near tie that rounding moves (a batch of other
        rows in the GEMMs, another chunking); one beyond it is a wrong result. This judges the token
        chosen, not the timed run's logits (not kept: a copy per request would be in the timing): a
        wrong computation that still lands on a near-tied token passes. Without the own-cache
        reference (tier none alone) there is no floor, and where the logits' argmax is not the
        reference's token they are not its logits: margin None (counted beyond the noise)."""
        full_logits, own_logits = self.logits["recompute"], self.logits["own_cache"]
        have_floor = len(full_logits) == len(own_logits) == len(prompts)
        margins = []
        for i, (token, reference) in enumerate(zip(tokens, references, strict=True)):
            if token == reference:
                continue
            entry = {"request": i, "restored": restored[i], "reference_token": reference, "token": token,
                     "margin": None, "noise_floor": None}
            if have_floor:
                full, own = full_logits[i], own_logits[i]
                chosen = own if restored[i] else full
                if int(chosen.argmax()) == reference:       # else these logits are not the reference's
                    entry["margin"] = round(float(chosen[reference] - chosen[token]), 6)
                entry["noise_floor"] = round(float((own - full).abs().max()), 6)
            margins.append(entry)
        return margins

    def own_cache(self, prompts) -> list[int]:
        tokens, self.logits["own_cache"] = [], []
        for prompt in prompts:
            request = run_request(self.cache_engine, prompt, 1)
            if request.num_cached_tokens < self.workload.restorable_tokens:
                raise RuntimeError(f"the own-cache reference hit only {request.num_cached_tokens} tokens")
            tokens.append(request.output_token_ids[0])
            self.logits["own_cache"].append(request.logits[0].float())
        return tokens


def run_case(model, workload: Workload, prompts, tier: str, policy: str, saves: bool, predict: bool, batch: int,
             daemon: KVDaemon | None, reference: Reference, expected: dict[str, list[int]], args) -> dict:
    if tier == "l3-cold":
        with cold_l3_daemon(model, workload, reference, batch, args) as cold:
            return timed_case(model, workload, prompts, tier, policy, saves, predict, batch, cold, expected, args,
                              reference)
    return timed_case(model, workload, prompts, tier, policy, saves, predict, batch,
                      daemon if tier == "l2" else None, expected, args, reference)


@contextlib.contextmanager
def cold_l3_daemon(model, workload: Workload, reference: Reference, batch: int, args):
    """A daemon of its own for the L3-cold tier: an O_DIRECT L3 holding every prefix (written by
    the reference's cache engine, so its KV is the own-cache reference's) and an L2 holding about
    1.5 x batch requests, 3 at least (the promotions and write-throughs of a batch in flight need
    room: with 2 at batch 1 a promotion under "always" was now and then cut short by pages still
    on their way to L3), fewer than the rotation's 8 prefixes (for batch <= 5). Its one engine may
    reserve all of L2 (the default half would cut a batch's promotions short)."""
    bytes_per_page = model.config.kv_bytes_per_token(torch.finfo(model.dtype).bits // 8) * BLOCK_SIZE
    per_request = workload.blocks_per_request
    l2_pages = max(3 * per_request, int(1.5 * batch * per_request)) + 8
    l3_pages = 2 * (len(workload.prefixes) * per_request + 2 * (args.requests + 32)) + 64
    with KVDaemon(l2_pages * bytes_per_page, l3_pages * bytes_per_page, o_direct=True, l3_dir=args.l3_dir,
                  extra_args=("--session-share", "1") + args.wiring.daemon_args()) as daemon:
        seeder = reference.cache_engine
        connector = attach_kvcached(seeder, daemon.socket_path, model_id=args.model,
                                    model_revision=f"random-seed-{args.seed}", client_name="stress-seed-l3")
        control = TierControl(daemon, connector.geometry)
        try:
            for prefix in workload.prefixes:
                run_request(seeder, workload.fresh(prefix), 1)
                settle(seeder, control)
            hits = [control.hits(prefix)["l3"] for prefix in workload.prefixes]
            if min(hits) < workload.restorable_tokens:
                raise RuntimeError(f"the prefixes were not all written to L3 (hits {hits}): {connector.stats()}")
        finally:
            control.close()
            detach_kvcached(seeder)
        yield daemon


def timed_case(model, workload: Workload, prompts, tier: str, policy: str, saves: bool, predict: bool, batch: int,
               daemon: KVDaemon | None, expected: dict[str, list[int]], args,
               reference: Reference | None = None) -> dict:
    # Blocks for the batch in flight and one request more. Not fewer: a finished request's blocks
    # are free only once its save has read them (the gather right after its first token), and with
    # none to spare the next request would wait for that gather to be admitted, where an engine with
    # blocks to spare (any real one) admits it at once. Not more: fewer than the 8 prefixes of the
    # rotation (batch <= 6), so that a prefix is gone from the engine's own cache when it comes round.
    engine = make_engine(model, (batch + 1) * workload.blocks_per_request, batch)
    control = None
    if daemon is not None:
        connector = attach_kvcached(engine, daemon.socket_path, model_id=args.model,
                                    model_revision=f"random-seed-{args.seed}",
                                    client_name=f"stress-{tier}-{policy}-b{batch}",
                                    config=ConnectorConfig(policy=policy, save=saves, predict=predict),
                                    **args.wiring.connect_args())
        control = TierControl(daemon, connector.geometry)
    try:
        if tier == "l2":
            for prefix in workload.prefixes:
                control.force("l2", prefix, workload.restorable_tokens)
        with args.wiring.engine_thread():
            closed_loop(engine, [workload.fresh(p) for p in workload.prefixes], batch)     # warm-up, untimed
        settle(engine, control)
        engine.reset_prefix_cache()              # the warm-up's last prefixes
        if tier == "l3-cold":                    # what the warm-up brought into L2 and the page cache goes
            control.evict_l2()
            control.drop_l3_page_cache()
        counts_before = control.counts() if control is not None else None
        predicted_before = predicted_requests(engine)
        engine.clear_prefill_timings()           # nor the gap since the warm-up's last step
        with args.wiring.engine_thread(), \
                profiled(f"stress_b{batch}_{tier}_{policy}{'' if predict else '_predict_off'}"):
            done, wall_s = closed_loop(engine, prompts, batch)
        settle(engine, control)
        # What the timed run cost the daemon: its MATCH handling (the wait it is part of), and its
        # counts of what a load or a save depends on (promotions, their reads, room in L2).
        daemon_counts = None if control is None else \
            {name: value - counts_before.get(name, 0) for name, value in control.counts().items()
             if name.startswith(DAEMON_COUNTS) and value != counts_before.get(name, 0)}
        tokens = [r.output_token_ids[0] for r in done]
        ttft_ms = [r.ttft_s * 1e3 for r in done]
        # Each request is checked against the reference of the path it took: restored (own cache) or not.
        # A whole prefix without a recompute: loaded, or (batch > 1, module docstring) the first of it
        # from the engine's own cache, which holds what an earlier request loaded of it, and the rest loaded.
        restored = [r.num_cached_tokens + r.num_loaded_tokens == workload.restorable_tokens for r in done]
        references = [expected["own_cache"][i] if was_restored else expected["recompute"][i]
                      for i, was_restored in enumerate(restored)]
        row = {"model": args.model, "tier": tier, "policy": policy if daemon is not None else None,
               "saves": saves if daemon is not None else None,
               "predict": predict if daemon is not None else None, "engines": 1,
               "batch": batch, "requests": len(done),
               "req_per_s": round(len(done) / wall_s, 3), "speedup": None, "wall_s": round(wall_s, 4),
               "ttft_p50_ms": round(percentile(ttft_ms, 50), 3), "ttft_p95_ms": round(percentile(ttft_ms, 95), 3),
               "ttft_p99_ms": round(percentile(ttft_ms, 99), 3),
               "admission_wait_p50_ms": round(percentile([(r.admitted_s - r.arrival_s) * 1e3 for r in done], 50), 3),
               "admission_to_token_p50_ms": round(percentile([(r.first_token_s - r.admitted_s) * 1e3 for r in done],
                                                             50), 3),
               # Where it goes, per prefill step (PrefillTiming): the GPU's span from the first launch to the
               # tokens' copy (CUDA events), and the host's scheduling, launch, saves' calls, wait for the
               # tokens and work after them (medians; their means, which a batch-1 cycle adds up, apart).
               **prefill_timings_ms(engine, "p50"),
               "prefill_mean_ms": prefill_timings_ms(engine, "mean"),
               "prefill_steps": len(engine.prefill_timings),
               "prefill_step_log": prefill_step_log(engine),
               # A request's add_request: its validation and, with a connector, its lookup's send (or prediction).
               "add_request_mean_ms": round(float(np.mean([(r.added_s - r.arrival_s) * 1e3 for r in done])), 3),
               # The daemon's share of the admission wait: its handling of the timed requests' matches.
               "daemon_match_mean_ms": None if not (daemon_counts or {}).get("acquire_count") else
               round(daemon_counts["acquire_seconds"] / daemon_counts["acquire_count"] * 1e3, 3),
               "daemon_counts": daemon_counts,
               "restored_requests": sum(restored),
               # Admitted on a predicted decline (proto.hints), with no wait for the lookup's reply.
               "predicted_requests": None if control is None else predicted_requests(engine) - predicted_before,
               "mismatches": sum(a != b for a, b in zip(tokens, references, strict=True)),
               "reference": "a restored request: alone, the prefix from the engine's own cache (the KV the "
                            "daemon holds); any other: a full prefill alone",
               "kv_mismatches": None, "cross_engine_hit_tokens": None,
               "engine_cache_hit_tokens": sum(r.num_cached_tokens for r in done),
               "loaded_tokens": sum(r.num_loaded_tokens for r in done),
               "ttft_samples_ms": [round(t, 4) for t in ttft_ms]}
        row["mismatches_beyond_noise"] = row["mismatches"]     # none of them shown to be a near tie
        if row["mismatches"] and reference is not None:
            row["mismatch_margins"] = reference.mismatch_margins(prompts, tokens, restored, references)
            row["mismatches_beyond_noise"] = sum(m["margin"] is None or m["margin"] > m["noise_floor"]
                                                 for m in row["mismatch_margins"])
        if control is not None:
            row["recompute_mismatches"] = sum(a != b for a, b in zip(tokens, expected["recompute"], strict=True))
            if policy == "always":
                row["loads_complete"] = all(restored)
            if tier == "l2" and policy == "always":
                row["kv_mismatches"] = sum(not torch.equal(restored_kv(engine, control, workload, prefix), kv)
                                           for prefix, kv in zip(workload.prefixes, reference.saved_kv))
            row["integrity"] = control.integrity()
            row["connector"] = {k: v for k, v in engine.connector.stats().items()
                                if k.startswith(("load", "save_skipped", "committed", "lookup_choice", "promoted",
                                                 "lookups_predicted", "prediction"))}
            if policy == "cost":
                engine.connector.flush_report()          # its last timings, handled before the status
                engine.connector.flush()
                row["cost_model"] = control.cost_model()
        return row
    finally:
        if control is not None:
            control.close()
        detach_kvcached(engine)


def prefill_timings_ms(engine: Engine, statistic: str) -> dict[str, float | None]:
    """The medians ("p50") or means ("mean") of the engine's prefill steps' timings since they were
    cleared, in ms, by field (``prefill_<field>_p50_ms``, or the field's name for means)."""
    values = {}
    for field in TIMED_FIELDS:
        samples = [getattr(t, field) for t in engine.prefill_timings if getattr(t, field) is not None]
        value = (percentile(samples, 50) if statistic == "p50" else float(np.mean(samples))) if samples else None
        name = field.removesuffix("_s")
        values[f"prefill_{name}_p50_ms" if statistic == "p50" else name] = \
            None if value is None else round(value * 1e3, 3)
    return values


TIMED_FIELDS = [field for field in PrefillTiming._fields if field.endswith("_s") and field != "load_device_s"]
STEP_FIELDS = ["chunks", "cached_chunks", "loading_chunks", "tokens", "gap_ms", "gpu_gap_ms", "schedule_ms",
               "launch_ms", "span_ms", "load_device_ms"]


def prefill_step_log(engine: Engine) -> dict:
    """Each prefill step since the timings were cleared, in order: what it ran (chunks, those on
    top of cached or loaded tokens, those waiting for a load layer by layer, new tokens) and its
    gaps, scheduling, launch, span and its loads' device time in ms (None where not timed): how
    the requests fell into steps, and what each kind of step cost."""
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1e3, 3)

    return {"fields": STEP_FIELDS,
            "steps": [[t.chunks, t.cached_chunks, t.loading_chunks, t.tokens, ms(t.gap_s), ms(t.gpu_gap_s),
                       ms(t.schedule_s), ms(t.launch_s), ms(t.span_s), ms(t.load_device_s)]
                      for t in engine.prefill_timings]}


def predicted_requests(engine: Engine) -> int:
    """The engine's lookups answered on a predicted decline so far (0 without a connector)."""
    connector = getattr(engine, "connector", None)
    return 0 if connector is None else connector.stats().get("lookups_predicted_recompute", 0)


def restored_kv(engine: Engine, control: TierControl, workload: Workload, prefix: list[int]) -> torch.Tensor:
    """The prefix restored alone from L2 into a cold engine cache; the KV it holds then."""
    settle(engine, control)
    engine.reset_prefix_cache()
    control.force("l2", prefix, workload.restorable_tokens)
    request = run_request(engine, workload.fresh(prefix), 1)
    settle(engine, control)
    if request.num_loaded_tokens != workload.restorable_tokens:
        raise RuntimeError(f"the check request loaded {request.num_loaded_tokens} tokens")
    return prefix_kv(engine, prefix)


def run_single_engine(args, tiers: list[str], policies: list[str], batches: list[int], device, dtype, report,
                      fail) -> None:
    model = load_model(args.model, dtype=dtype, device=device, seed=args.seed)
    workload = Workload(args, model.config.vocab_size)
    daemon = None
    try:
        if set(tiers) - {"none"}:       # the L2 daemon, and the reference's cache engine (L3-cold seeds from it)
            # The prefixes twice over, and two pages for each request's suffix (evicted first: leaves).
            bytes_per_page = model.config.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * BLOCK_SIZE
            pages = 2 * len(workload.prefixes) * workload.blocks_per_request + 2 * (args.requests + 32) + 64
            l2_bytes = max(pages * bytes_per_page, 8 << 20)
            daemon = KVDaemon(l2_bytes, 2 * l2_bytes, l3_dir=args.l3_dir, extra_args=args.wiring.daemon_args())
        cases = [(tier, policy, True, True) for tier in tiers for policy in (policies if tier != "none" else ["-"])]
        if args.saves_off and "l3-cold" in tiers:
            cases.append(("l3-cold", "cost", False, True))
        if args.predict_off and "l3-cold" in tiers:
            cases.append(("l3-cold", "cost", True, False))
        # The baseline first, the cold-L3 target's cases (policy cost, and its twins) right after it:
        # the GPU's speed drifts by a percent or two over a round's minute, and a speed-up is over
        # the baseline measured closest to it.
        cases.sort(key=lambda case: (case[0] != "none", case[:2] != ("l3-cold", "cost")))
        reference = Reference(model, workload, daemon, args)
        # Per batch, the cases in turn, ``--repeats`` times over: each speed-up is over the baseline
        # of its own repetition, measured just before it (the runs of one case vary by a few %).
        for batch, repeat in itertools.product(batches, range(args.repeats)):
            baseline = None
            for tier, policy, saves, predict in cases:
                try:
                    # Prompts of the case's own: an earlier case's saves (a prompt's suffix pages) in
                    # the shared daemon would serve more than the prefix, which neither reference is.
                    prompts = workload.prompts()
                    expected = {"recompute": reference.recompute(prompts)}
                    if tier != "none":
                        expected["own_cache"] = reference.own_cache(prompts)
                    row = run_case(model, workload, prompts, tier, policy, saves, predict, batch, daemon, reference,
                                   expected, args)
                    row["repeat"] = repeat
                except Exception as exc:        # recorded; the other cases go on
                    fail(f"{tier} {policy}{'' if saves else ' saves off'}{'' if predict else ' predict off'} "
                         f"batch {batch}", exc)
                    continue
                baseline = baseline or (row if tier == "none" else None)
                if baseline is not None:
                    row["speedup"] = round(row["req_per_s"] / baseline["req_per_s"], 3)
                report(row)
    finally:
        if daemon is not None:
            daemon.stop()


def cold_batched(row: dict) -> bool:
    """An l3-cold row of batch > 1: its L2 (1.5 x batch requests, less than the rotation) keeps some
    prefixes while requests are in flight, and the engine's own cache may keep one: some requests
    restore from L2, hit the engine's cache, or find their L2 pages evicted since their lookup. Its
    row says how many (``connector``: the lookups' choices, the pages not loaded); not a failure."""
    return row["tier"] == "l3-cold" and row["batch"] > 1


def cold_l3_summary(rows: list[dict]) -> list[dict]:
    """The L3-cold target per batch: policy cost's req/s at least 0.97 x recompute's in every
    repetition (``value``: the least speed-up of them; ``speedups``: each, in run order)."""
    summary = []
    for batch in sorted({r["batch"] for r in rows}):
        speedups = [r["speedup"] for r in rows if r["tier"] == "l3-cold" and r.get("policy") == "cost"
                    and r.get("saves") and r.get("predict") and r["engines"] == 1 and r["batch"] == batch]
        if speedups:
            measured = [s for s in speedups if s is not None]
            summary.append({"target": f"batch {batch}: cold L3, policy cost, req/s >= {COLD_L3_TARGET} x "
                                      "recompute's in every repetition",
                            "value": min(measured) if measured else None,
                            "median": float(np.median(measured)) if measured else None, "speedups": speedups,
                            "met": bool(measured) and len(measured) == len(speedups)
                            and min(measured) >= COLD_L3_TARGET})
    return summary


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(PRESETS))
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=350)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--batches", default="1,4", help="of the single engine; empty: none")
    parser.add_argument("--tiers", default=",".join(STRESS_TIERS))
    parser.add_argument("--policies", default=",".join(POLICIES), help="restore policies of the tiers with a "
                        "connector, of always,cost")
    parser.add_argument("--engines", type=int, default=0,
                        help="also N engine processes on the GPU sharing 16 prefixes of 2,000 tokens (0: not run)")
    parser.add_argument("--engines-model", default="qwen3-4b", choices=sorted(PRESETS))
    parser.add_argument("--l3-dir", default=None, help="where the daemon's L3 file goes")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=None, help="runs of every case per batch, each against "
                        "a baseline of its own (the summary's target must hold in every one); default 3, "
                        "1 with --quick")
    parser.add_argument("--quick", action="store_true", help="smoke run: the tiny shape, 24 requests; no result file")
    parser.add_argument("--name", default=None, help="result file (bench/results/<machine>/<name>.json); "
                                                     "default stress, none with --quick")
    parser.add_argument("--machine", default=None)
    parser.add_argument("--pin", action="store_true", help="the low-latency wiring (module docstring)")
    parser.add_argument("--predict-off", action="store_true", help="also l3-cold under cost with the connector's "
                        "predictions off: every lookup waits for its reply (module docstring)")
    parser.add_argument("--saves-off", action="store_true", help="also l3-cold under cost with the connector's "
                        "saves off (module docstring)")
    args = parser.parse_args()
    args.wiring = Wiring(args.pin)
    requested = args.tiers.split(",")
    if set(requested) - set(STRESS_TIERS):
        raise SystemExit(f"--tiers: of {STRESS_TIERS}")
    tiers = [t for t in STRESS_TIERS if t in requested]      # none first: the others' speed-up is over it
    policies = [p for p in args.policies.split(",") if p]
    if not policies or set(policies) - set(POLICIES):
        raise SystemExit(f"--policies: of {POLICIES}")
    spec = Spec(args.engines_model, args.seed)
    if args.quick:
        args.model, args.prefix_tokens, args.requests = "tiny", min(args.prefix_tokens, 60), min(args.requests, 24)
        spec = Spec("tiny", args.seed, num_prefixes=4, prefix_tokens=64, pool_requests=2)
    else:
        args.name = args.name or "stress"
    batches = [int(b) for b in args.batches.split(",") if b]
    args.repeats = args.repeats if args.repeats is not None else 1 if args.quick else 3
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.monotonic()
    rows: list[dict] = []
    notes = ["a warm tier l3 is measured by bench_ttft (a throughput run cannot evict L2 per request); l3-cold "
             "here keeps a cold L3 by a small L2 (batch <= 5) and the page cache dropped before the timed run",
             "l3-cold under cost: a request whose L3 hit is declined saves nothing once L2 lacks free pages for it and "
             "its path was last used before the page L2 would evict next (daemon_counts backup_policy_skips); the "
             "prefixes L2 keeps are restored from it (restored_requests), at batch 1 too",
             "l3-cold at batch > 1: some requests restore from L2, hit the engine's own cache, or find their L2 "
             "pages evicted since their lookup (the row's connector counters say how many)"]
    if not args.engines:
        notes.append("several engine processes on one GPU: not run (--engines N)")
    engines_sizing = size_engines(args.engines, spec) if args.engines else None
    if engines_sizing and engines_sizing["engines"] < args.engines:
        print(f"{engines_sizing['engines']} of the {args.engines} engines asked for fit the GPU's free memory: "
              f"{engines_sizing}", flush=True)
    paths, errors = [], []

    def fail(what: str, exc: Exception) -> None:
        traceback.print_exc()
        errors.append(f"{what}: {type(exc).__name__}: {exc}"[:1000])

    def report(row: dict | None = None) -> None:
        if row is not None:
            rows.append(row)
            print_table([row], COLUMNS)
        if args.name:
            paths[:] = [write_result(args.name, {
                "device": str(device), "dtype": str(dtype).replace("torch.", ""), "seed": args.seed,
                "wiring": args.wiring.describe(),
                "workload": {"prefixes": args.prefixes, "prefix_tokens": args.prefix_tokens,
                             "suffix_tokens": args.suffix_tokens, "requests": args.requests, "output_tokens": 1,
                             "batches": batches, "tiers": tiers, "policies": policies,
                             "repeats": args.repeats},
                "engines_workload": dataclasses.asdict(spec) if args.engines else None,
                "engines_sizing": engines_sizing,
                "elapsed_s": round(time.monotonic() - started, 1), "notes": notes, "errors": errors,
                "checks_failed": checks_failed(rows),
                "summary": cold_l3_summary(rows), "rows": rows},
                machine=args.machine)]

    try:
        if batches:
            run_single_engine(args, tiers, policies, batches, device, dtype, report, fail)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if args.engines:
            try:
                for row in run_engines(engines_sizing["engines"], spec, args.l3_dir):
                    report(row)
            except Exception as exc:
                fail(f"{engines_sizing['engines']} engines", exc)
    finally:
        report()
    print()
    print_table(rows, COLUMNS + ["cross_engine_hit_tokens"])
    if paths:
        print(f"wrote {paths[0]}")
    summary = cold_l3_summary(rows)
    if summary:
        print_table(summary, ["target", "value", "median", "speedups", "met"])
    failures = checks_failed(rows) + errors
    if failures:
        raise SystemExit(f"checks failed: {failures}")


def checks_failed(rows: list[dict]) -> list[str]:
    """Each row's failed checks, named by its case and round."""
    return [f"{r['tier']} {r.get('policy')} engines {r['engines']} batch {r['batch']} round {r.get('repeat')}: {what}"
            for r in rows for what, bad in (
                ("kv_mismatches", bool(r["kv_mismatches"])), ("integrity", r.get("integrity", "ok") != "ok"),
                ("incomplete loads", r.get("loads_complete") is False and not cold_batched(r)),
                ("engine cache hits", r["engines"] == 1 and r["batch"] == 1 and r["engine_cache_hit_tokens"] != 0),
                ("mismatches", r["engines"] > 1 and r["mismatches"] != 0),
                ("mismatches beyond the noise floor", bool(r.get("mismatches_beyond_noise")))) if bad]


if __name__ == "__main__":
    main()
