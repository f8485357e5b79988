"""The TTFT and stress benchmarks' --quick runs (tiny shape, CPU), as the H200 run starts them: each
exits 0 and writes rows whose checks hold."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcached.testing.daemon_proc import REPO_ROOT, child_env
from kvcached.testing.remote.cluster import missing as remote_missing

RUN_TIMEOUT_S = 300
# pytest-timeout's limit for these tests: the run's own, and the checks after it
pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60)


def run_quick(module: str, result_dir, *args: str) -> dict:
    command = [sys.executable, "-m", module, "--quick", "--name", "quick", "--machine", str(result_dir), *args]
    done = subprocess.run(command, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, \
        f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    with open(result_dir / "quick.json") as f:
        return json.load(f)


def test_bench_ttft_quick_measures_every_tier_with_its_checks_passing(tmp_path):
    """One point (40 tokens), every tier: a row each, every request's tier forced (no engine cache
    hit, every whole page loaded, from L3 promoted, for the peer tier every page out of engine A's
    memory), the restored KV bit for bit the saved KV (peer: A's), the check request's tokens a
    recompute's and (but for the peer tier, whose KV A computed) its logits bit for bit the own
    cache hit's, the daemon's integrity ok."""
    result = run_quick("bench.bench_ttft", tmp_path, "--points", "tiny=40", "--no-hf", "--samples", "2",
                       "--warmup", "1")
    rows = {row["tier"]: row for row in result["rows"]}
    assert sorted(rows) == sorted(["none", "l2", "l3", "l3-cold", "peer"]) and not result["failures"], result
    peer = rows.pop("peer")
    assert peer["tier_forced"] and peer["kv_equal"] and peer["integrity"] == "ok" and peer["outputs_equal"], peer
    assert peer["peer_tokens"] == peer["loaded_tokens"] == [32] * 4 and peer["promoted_tokens"] == [0] * 4, peer
    assert rows["none"]["tier_forced"] and rows["none"]["outputs_equal"], rows["none"]
    for tier in ("l2", "l3", "l3-cold"):
        row = rows[tier]
        assert row["tier_forced"] and row["kv_equal"] and row["integrity"] == "ok", row
        assert row["logits_equal_own_cache"] and row["outputs_equal"] and len(row["samples_ms"]) == 2, row
        assert row["loaded_tokens"] == [32] * 4 and row["promoted_tokens"] == [32 if tier != "l2" else 0] * 4, row


def test_bench_ttft_quick_policy_cost_writes_a_policy_row_per_tier(tmp_path):
    """--policy cost: per tier a row with the TTFT under the cost model, under always (every whole
    page restored, bit for bit) and never (none restored) from the same daemon, the choice the
    daemon made for the timed requests, and the cost model it ended with (the engine's prefill
    samples and transfer samples in, its lookups' decisions counted); the daemon's integrity ok."""
    result = run_quick("bench.bench_ttft", tmp_path, "--points", "tiny=40", "--no-hf", "--samples", "2",
                       "--warmup", "1", "--policy", "cost")
    rows = {row["tier"]: row for row in result["rows"]}
    assert sorted(rows) == ["l2", "l3", "l3-cold"] and not result["failures"] and result["policy"] == "cost", result
    for tier, row in rows.items():
        assert row["cost_ms"] > 0 and row["restore_ms"] > 0 and row["recompute_ms"] > 0, row
        assert row["choice"] in ("l2", "l3", "recompute") and len(row["choices"]) == 2, row
        assert row["tier_forced"] and row["kv_equal"] and row["integrity_ok"] and row["outputs_equal"], row
        assert row["within_5pct"] == (row["cost_ms"] <= 1.05 * min(row["restore_ms"], row["recompute_ms"])), row
        (engine,) = row["cost_model"]["engines"]
        assert engine["directions"]["prefill"]["samples_total"] > 0 and engine["directions"]["d2h"]["samples_total"] > 0
        assert sum(engine["decisions_total"]["lookup"].values()) >= 4, engine
    assert len(result["summary"]) >= 3, result["summary"]


def test_bench_stress_quick_measures_every_tier_and_policy_with_no_mismatch(tmp_path):
    """8 requests at batch 1 and 2, two rounds of every case: tier none, and l2 and l3-cold under
    policies always and cost, a row each with its req/s and TTFT percentiles, no engine cache hit,
    no token mismatch (each request against the reference of the path it took), the daemons'
    integrity ok, a daemon handling time per match where there is a daemon; under always every
    request loads its whole prefix (l2: its KV bit for bit; l3-cold: every one promoted from L3,
    none found in L2); the summary's cold-L3 target per batch is the least of its rounds'
    speed-ups, each over its own round's tier none (not counting the l3-cold rows with the
    connector's saves off, which save and commit nothing). Two engine
    processes sharing 4 prefixes: with kvcached, one loads prefixes the other prefilled
    (cross-engine hits), with the same tokens as without."""
    result = run_quick("bench.bench_stress", tmp_path, "--requests", "8", "--batches", "1,2", "--engines", "2",
                       "--repeats", "2", "--saves-off")
    engines = {row["tier"]: row for row in result["rows"] if row["engines"] == 2}
    assert engines["none"]["cross_engine_hit_tokens"] == 0 and engines["l2"]["cross_engine_hit_tokens"] > 0, engines
    assert engines["l2"]["mismatches"] == 0 and engines["l2"]["integrity"] == "ok", engines
    assert engines["l2"]["requests"] == engines["none"]["requests"] == 2 * 4 * 2, engines
    saves_off = [row for row in result["rows"] if row["engines"] == 1 and row["saves"] is False]
    assert sorted((row["tier"], row["policy"], row["batch"], row["repeat"]) for row in saves_off) == sorted(
        ("l3-cold", "cost", b, r) for b in (1, 2) for r in (0, 1)), result
    for row in saves_off:       # no reservation, so nothing saved or committed: every page skipped as such
        assert row["mismatches"] == 0 and row["integrity"] == "ok", row
        assert "committed_pages" not in row["connector"], row
        assert row["connector"]["save_skipped_pages"] == row["connector"]["save_skipped_pages_saving_off"] > 0, row
    rows = {(row["tier"], row["policy"], row["batch"], row["repeat"]): row
            for row in result["rows"] if row["engines"] == 1 and row["saves"] is not False}
    assert sorted(rows) == sorted([("none", None, b, r) for b in (1, 2) for r in (0, 1)] + [
        (tier, policy, b, r) for tier in ("l2", "l3-cold") for policy in ("always", "cost") for b in (1, 2)
        for r in (0, 1)]), result
    assert all(rows["l3-cold", "cost", b, r]["connector"]["committed_pages"] > 0 for b in (1, 2) for r in (0, 1))
    assert not result["errors"] and result["checks_failed"] == [], result
    # The target per batch, over both rounds: each round's speed-up over that round's own tier none.
    assert [entry["target"].split(":")[0] for entry in result["summary"]] == ["batch 1", "batch 2"], result
    for entry, batch in zip(result["summary"], (1, 2)):
        speedups = [round(rows["l3-cold", "cost", batch, r]["req_per_s"] / rows["none", None, batch, r]["req_per_s"], 3)
                    for r in (0, 1)]
        assert entry["speedups"] == speedups and entry["value"] == min(speedups), (entry, speedups)
        assert entry["met"] == (min(speedups) >= 0.97), entry
    for (tier, policy, _, _), row in rows.items():
        assert row["requests"] == 8 and row["req_per_s"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0, row
        assert row["mismatches"] == 0 and row["engine_cache_hit_tokens"] == 0, row
        # Each prefill step in order: every request's prompt prefilled in one of them (1 output
        # token: no decode step; on CPU a load is done before its prefill, none is dropped), the
        # restored ones (and any partly loaded) on top of their loaded tokens.
        log = row["prefill_step_log"]
        steps = [dict(zip(log["fields"], step)) for step in log["steps"]]
        assert len(steps) == row["prefill_steps"] and sum(s["chunks"] for s in steps) == 8, row
        assert sum(s["cached_chunks"] for s in steps) >= row["restored_requests"], row
        assert all(0 < s["tokens"] and s["loading_chunks"] <= s["cached_chunks"] <= s["chunks"] <= row["batch"]
                   for s in steps), row
        if tier != "none":
            assert row["integrity"] == "ok", row
        # The daemon's handling of the timed matches: a time per match, only where there is a daemon.
        assert (row["daemon_match_mean_ms"] is None) == (tier == "none"), row
        assert tier == "none" or 0 < row["daemon_match_mean_ms"] < row["ttft_p99_ms"], row
        if policy == "always":
            assert row["loads_complete"] and row["loaded_tokens"] == 8 * 48, row
        if (tier, policy) == ("l2", "always"):
            assert row["kv_mismatches"] == 0, row
        if (tier, policy) == ("l3-cold", "always"):
            assert row["connector"]["promoted_tokens"] == 8 * 48, row
            # The daemon's count of the promotions' pages agrees with what the engine was told.
            assert row["daemon_counts"]["s2h_pages_published"] == 8 * 48 // 16, row      # pages of 16 tokens
        if tier != "none":
            assert row["daemon_counts"]["acquire_count"] >= 8, row
        if policy == "cost":
            assert sum(row["cost_model"]["engines"][0]["decisions_total"]["lookup"].values()) >= 8, row


def test_bench_overlap_quick_measures_every_case_with_its_checks_passing(tmp_path):
    """Every case and tier of bench_overlap: a row each with exactly the issue's keys; every restored
    request loaded its whole prefix (or the run fails) and gave the recompute's tokens, layer-wise
    the tokens of whole-load-then-prefill; under "blocking" nothing of a restore is hidden, under
    "async" part of it is; each TTFT row has its load, suffix prefill and layer figures; the daemon's
    integrity ok after each case."""
    result = run_quick("bench.bench_overlap", tmp_path)
    assert not result["failures"], result["failures"]
    keys = ["case", "tier", "hidden_fraction", "decode_step_inflation", "ttft_ms", "serial_ttft_ms", "load_ms",
            "suffix_prefill_ms", "layer_prefill_ms", "outputs_equal"]
    rows = {(row["case"], row["tier"]): row for row in result["rows"]}
    assert sorted(rows) == sorted([("under_decode", "l2"), ("under_decode", "l3"), ("under_decode_blocking", "l2"),
                                   ("under_decode_blocking", "l3"), ("ttft_100+30", "l2"), ("ttft_200+50", "l2")])
    for key, row in rows.items():
        assert list(row) == keys and row["outputs_equal"] is True, row
        assert result["details"][f"{key[0]}/{key[1]}"]["integrity"] == "ok", key
    for tier in ("l2", "l3"):
        assert rows[("under_decode_blocking", tier)]["hidden_fraction"] == 0.0, rows
        assert 0.0 < rows[("under_decode", tier)]["hidden_fraction"] <= 1.0, rows
    for case in ("ttft_100+30", "ttft_200+50"):
        row = rows[(case, "l2")]
        assert all(row[k] > 0 for k in ("ttft_ms", "serial_ttft_ms", "load_ms", "suffix_prefill_ms")), row
        assert abs(row["layer_prefill_ms"] - row["suffix_prefill_ms"] / 2) < 1e-3, row     # 2 layers


@pytest.mark.skipif(bool(remote_missing()), reason=remote_missing() or "runs")
def test_bench_ttft_quick_remote_tier_restores_from_the_store_bit_for_bit(tmp_path):
    """Tier remote (a real mooncake_master, another daemon lending the store its memory, the
    engine's daemon without L3 and lending none, in a network namespace): every timed request's L2
    was emptied, so each loads every whole page of its prefix from the store into L2 first
    (promoted), its KV bit for bit the saved KV, the check request's logits bit for bit the own
    cache hit's; recompute and L2 timed in the same run beside it."""
    result = run_quick("bench.bench_ttft", tmp_path, "--points", "tiny=40", "--no-hf", "--samples", "2",
                       "--warmup", "1", "--tiers", "none,l2,remote")
    rows = {row["tier"]: row for row in result["rows"]}
    assert sorted(rows) == ["l2", "none", "remote"] and not result["failures"], result
    remote = rows["remote"]
    assert remote["tier_forced"] and remote["kv_equal"] and remote["integrity"] == "ok", remote
    assert remote["logits_equal_own_cache"] and remote["outputs_equal"] and len(remote["samples_ms"]) == 2, remote
    assert remote["loaded_tokens"] == remote["promoted_tokens"] == [32] * 4, remote
    assert remote["choices"] == ["remote"] * 2, remote
