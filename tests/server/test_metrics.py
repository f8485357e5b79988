"""The Prometheus collector over a real DaemonState's status, in-process: per-model counters,
histograms, counters no rule names, the cost model's hook."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from kvcached.core.daemon import DaemonState
from kvcached.core.metrics import SECONDS_BUCKETS, Metrics
from kvcached.server.metrics import StatusCollector
from proto.messages import KVGeometry

GEOMETRIES = [KVGeometry(model, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", page_size=8)
              for model in ("model-a", "model-b")]


def exported(snapshot: dict) -> dict[tuple[str, tuple], float]:
    """What /metrics would show for this snapshot, parsed back: (name, sorted labels) -> value."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: snapshot))
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_hits_misses_and_evictions_are_counted_per_model(rng):
    """Two models' engines back up and match random prefixes (one model past the pool, so pages
    are evicted): each model's hit, match, miss and evicted-page counters are what its own matches
    hit and its own pages evicted, and they add up to the daemon's totals."""
    state = DaemonState(4 << 20, max_namespaces=2, session_timeout_s=1.5)
    sessions = [state.attach(geometry, pid=100 + i)[0].session_id for i, geometry in enumerate(GEOMETRIES)]
    expected = {g.model_id: {"hit": 0, "matched": 0, "matches": 0} for g in GEOMETRIES}
    for _ in range(60):
        which = int(rng.integers(2))
        model, page_size = GEOMETRIES[which].model_id, GEOMETRIES[which].page_size
        num_pages = int(rng.integers(1, 40 if which == 0 else 4))
        tokens = rng.integers(0, 1 << 30, size=num_pages * page_size, dtype=np.int32).tobytes()
        reply = state.match(sessions[which], tokens, reserve_backup=True)
        if reply.lease_id:
            state.commit_backup(sessions[which], reply.lease_id, reply.backup_page_ids)
        again = state.match(sessions[which], tokens)
        if again.lease_id:
            state.release(sessions[which], again.lease_id)
        expected[model]["matched"] += 2 * num_pages * page_size
        expected[model]["matches"] += 2
        expected[model]["hit"] += reply.hit_tokens["l2"] + again.hit_tokens["l2"]
        state.check_integrity()
    samples = exported(state.status())
    totals = state.metrics.counters
    assert totals["evicted_pages_l2"] > 0, "model-a was meant to evict"
    for model, counts in expected.items():
        assert value(samples, "kvcached_hit_tokens_total", model=model, tier="l2") == counts["hit"]
        assert value(samples, "kvcached_match_tokens_total", model=model) == counts["matched"]
        assert value(samples, "kvcached_miss_tokens_total", model=model) == counts["matched"] - counts["hit"]
    assert sum(value(samples, "kvcached_hit_tokens_total", model=g.model_id, tier="l2") for g in GEOMETRIES) \
        == totals["hit_tokens_l2"]
    evicted = {g.model_id: sum(v for (n, ls), v in samples.items() if n == "kvcached_evicted_pages_total"
                               and {("model", g.model_id), ("tier", "l2")} <= set(ls)) for g in GEOMETRIES}
    assert evicted["model-a"] > 0 and sum(evicted.values()) == totals["evicted_pages_l2"], evicted
    for model, counts in expected.items():
        assert value(samples, "kvcached_matches_total", model=model) == counts["matches"]


def test_time_histograms_bucket_every_observation(rng):
    """Observed times (random, and every bucket bound itself) appear in the histogram's
    cumulative buckets: each `le` counts exactly the observations <= it; sum and count match."""
    metrics = Metrics()
    values = np.concatenate([rng.exponential(0.01, size=500), np.asarray(SECONDS_BUCKETS), [20.0]])
    for seconds in values:
        metrics.observe("h2s_service_seconds", float(seconds))
    snapshot = {"histograms": metrics.histogram_snapshot()}
    samples = exported(snapshot)
    for bound in SECONDS_BUCKETS:
        assert value(samples, "kvcached_io_service_seconds_bucket", direction="h2s", le=repr(float(bound))) \
            == np.count_nonzero(values <= bound), bound
    assert value(samples, "kvcached_io_service_seconds_bucket", direction="h2s", le="+Inf") == len(values)
    assert value(samples, "kvcached_io_service_seconds_count", direction="h2s") == len(values)
    assert value(samples, "kvcached_io_service_seconds_sum", direction="h2s") == pytest.approx(values.sum(), rel=1e-6)


def test_counters_no_rule_names_are_still_exported(rng):
    """A daemon counter and an engine counter that no table names reach /metrics under their own
    name (kvcached_daemon_events_total, kvcached_engine_events_total), by the amount counted."""
    state = DaemonState(4 << 20, max_namespaces=2, session_timeout_s=1.5)
    session, _ = state.attach(GEOMETRIES[0], pid=7, client_name="eng")
    amount = int(rng.integers(1, 1000))
    state.metrics.add("a_counter_of_tomorrow", amount)
    state.engine_report(session.session_id, {"connector": {"counters": {"new_engine_counter": amount + 1,
                                                                        "loaded_pages": 3}}})
    samples = exported(state.status())
    assert value(samples, "kvcached_daemon_events_total", event="a_counter_of_tomorrow") == amount
    assert value(samples, "kvcached_engine_events_total", event="new_engine_counter", engine="eng") == amount + 1
    assert value(samples, "kvcached_engine_transfer_bytes_total", direction="h2d", engine="eng") \
        == 3 * GEOMETRIES[0].bytes_per_page


def test_cost_model_status_is_exported_through_its_hook(rng):
    """Whatever numbers the status carries under "cost_model" are exported by their path, and a
    "decisions" map as counts per choice (until they get names of their own)."""
    fixed_s, decided = float(rng.random()), {"l2": int(rng.integers(100)), "recompute": int(rng.integers(100))}
    state = DaemonState(4 << 20, max_namespaces=2, session_timeout_s=1.5)
    snapshot = state.status()
    snapshot["cost_model"] = {"engines": {"vllm-0": {"h2d": {"fixed_s": fixed_s, "mode": "ewma"},
                                                     "decisions": decided}}}
    samples = exported(snapshot)
    assert value(samples, "kvcached_cost_model_value", path="engines.vllm-0.h2d.fixed_s") == fixed_s
    for choice, count in decided.items():
        assert value(samples, "kvcached_policy_decisions_total", path="engines.vllm-0", choice=choice) == count
