"""The remote tier on a real Mooncake Store: a real mooncake_master, real daemons (each its own
"host") and real engine processes, in a network namespace of loopback only
(``kvcached/testing/remote/cluster.py``, ``kvcached/testing/remote/scenarios.py``). Restores are compared bit for bit
with the KV the saving engine wrote, on fresh random data, into other pages than the source."""

from __future__ import annotations

import pytest

from kvcached.testing.remote.cluster import missing, run_isolated

pytestmark = pytest.mark.skipif(bool(missing()), reason=missing() or "runs")

# A prepare that misses the store costs at most its deadline plus this (a loaded 2-core box);
# the store's own timeouts block 4-5 s.
MARGIN_S = 1.5


def all_prepares(report: dict) -> list[float]:
    return [report["other_prepare_seconds"]] + [r["prepare_seconds"] for r in report["results"]]


def test_a_prefix_saved_on_one_host_restores_on_another_bit_for_bit():
    """Engine X on host A saves three prefixes; engine Y on host B, whose daemon never saw them,
    restores every whole page of each from the store, bit for bit; B's remote line has learned from
    its own reads, no value failed its check, and B's status table and /metrics show the tier."""
    report = run_isolated("restore_across_hosts")
    assert report["b_lookups_before"] == 0
    restored = report["restored"]
    assert restored["bit_exact"], restored
    for result in restored["results"]:
        assert result["restored_tokens"] == result["tokens"] // 16 * 16 and not result["same_pages_as_source"]
    assert report["b_remote_hit_pages"] == report["saved"]["pages"]
    assert report["b_remote_bytes_read"] == report["saved"]["pages"] * 8192
    assert report["b_checksum_mismatches"] == 0
    assert report["b_r2h_line"]["samples_total"] >= 1
    assert report["b_remote"]["state"] == "closed"
    # Operated like every tier: `kvcached status` and /metrics show it.
    assert f"hit pages {report['saved']['pages']}" in report["b_table"] and "mooncake://" in report["b_table"]
    assert report["b_metrics"]["kvcached_remote_up"] == [[{}, 1]]
    assert report["b_metrics"]["kvcached_remote_hit_pages"] == [[{}, report["saved"]["pages"]]]


def test_the_master_gone_costs_a_miss_within_the_deadline_and_the_daemons_reconnect():
    """The master hung (calls block): host C's requests miss within its deadline, then skip the
    store (breaker); killed: host B's requests miss; no wrong byte either way. Restarted, both
    daemons reconnect by themselves and a new prefix restores across hosts bit for bit."""
    report = run_isolated("master_killed")
    for phase, deadline_s in (("hung", report["deadline_s"]), ("killed", 2.0)):
        run = report[phase]
        assert all(r["restored_tokens"] == 0 and r["restored_part_bit_exact"] for r in run["results"]), run
        assert max(all_prepares(run)) < deadline_s + MARGIN_S, (phase, all_prepares(run))
    hung = report["hung_remote"]["counters"]
    assert hung.get("remote_deadline_misses_exist", 0) >= 1 and hung.get("remote_skips_exist", 0) >= 1
    assert report["after"]["bit_exact"], report["after"]


def test_the_host_lending_the_memory_killed_serves_no_wrong_byte_and_recovers():
    """Host A lent the store all its memory and is SIGKILLed: B's requests for what A held miss
    (no wrong byte, none served from a dead host) within the deadline; a new daemon on A's host
    lends memory again, and a new prefix restores across hosts bit for bit."""
    report = run_isolated("contributor_killed")
    during = report["during"]
    assert all(r["restored_tokens"] == 0 and r["restored_part_bit_exact"] for r in during["results"]), during
    assert max(all_prepares(during)) < 5.0 + MARGIN_S
    assert report["b_checksum_mismatches"] == 0
    assert report["after"]["bit_exact"], report["after"]


def test_the_remote_decision_declines_where_recompute_wins():
    """Under policy cost a daemon whose remote line prices the store far slower than recompute
    declines every remote hit (recompute, the skip counted, no get); one pricing it fast takes it."""
    report = run_isolated("decision")
    declined, taken = report["declined"]["decisions"], report["taken"]["decisions"]
    assert all(d["hit_tokens"]["remote"] > 0 and d["choice"] == "recompute" and d["restore_tokens"] == 0
               and d["predicted_s"]["remote"] > d["predicted_s"]["recompute"] for d in declined), declined
    assert all(d["choice"] == "remote" and d["restore_tokens"] == d["hit_tokens"]["remote"] for d in taken), taken
    assert report["slow_get_calls"] == 0
    assert report["slow_skips"]["lookup"]["remote"] == len(declined)


def test_a_router_lookup_counts_the_pages_the_store_holds():
    """POST /lookup on host B, which holds none of host A's saved prefixes in L2 or L3, answers for
    each the whole pages the store holds after B's (empty) L2 hit as its remote hit, and changes no
    counter of B's (but the pauses of a loaded machine, counted as they happen): no lookup, match,
    get or promotion."""
    report = run_isolated("router_lookup")
    for answer in report["answers"]:
        assert answer["hit_tokens"] == {"l2": 0, "l3": 0, "remote": answer["tokens"] // 16 * 16}, report["answers"]
    own = lambda metrics: {k: v for k, v in metrics.items() if not k.startswith("daemon_pause")}  # noqa: E731
    assert own(report["b_metrics_after"]) == own(report["b_metrics_before"])     # the box's pauses aside
