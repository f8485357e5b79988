"""The Prometheus collector over a real DaemonState's status, in-process: per-model counters,
histograms, every declared counter under its own family (and nothing undeclared counted), the
cost model."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from kvcached.core import counters
from kvcached.core.daemon import DaemonState
from kvcached.core.metrics import SECONDS_BUCKETS, Metrics
from kvcached.server.metrics import StatusCollector
from proto.counters import ENGINE, Counter, Counts
from proto.messages import KVGeometry
from proto.schema import Acquire, Commit, Lookup, Release

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
        reply = state.acquire(Acquire(sessions[which], tokens, save=True))
        if reply.lease_id:
            state.commit(Commit(sessions[which], reply.lease_id, reply.reserved_page_ids))
        again = state.acquire(Acquire(sessions[which], tokens))
        if again.lease_id:
            state.release(Release(sessions[which], again.lease_id))
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
        metrics.observe(counters.IO_SERVICE_SECONDS, float(seconds), "h2s")
    snapshot = {"histograms": metrics.histogram_snapshot()}
    samples = exported(snapshot)
    for bound in SECONDS_BUCKETS:
        assert value(samples, "kvcached_io_service_seconds_bucket", direction="h2s", le=repr(float(bound))) \
            == np.count_nonzero(values <= bound), bound
    assert value(samples, "kvcached_io_service_seconds_bucket", direction="h2s", le="+Inf") == len(values)
    assert value(samples, "kvcached_io_service_seconds_count", direction="h2s") == len(values)
    assert value(samples, "kvcached_io_service_seconds_sum", direction="h2s") == pytest.approx(values.sum(), rel=1e-6)


def test_counting_what_no_declaration_names_raises_and_counts_nothing(rng):
    """A counter that is not declared (a string, or a Counter made outside kvcached/core/counters.py),
    a label value its declaration does not list, and a declared counter of another group (the
    remote client's, counted as the daemon's) each raise where they are counted, and count nothing."""
    metrics = Metrics()
    amount = int(rng.integers(1, 1000))
    tomorrow = Counter("a_counter_of_tomorrow", "kvcached_tomorrow", "not declared")
    for counter, label in (("matches", ""), (tomorrow, ""), (counters.HIT_TOKENS, "l4"), (counters.HIT_TOKENS, ""),
                           (counters.ACQUIRES, "l2"), (counters.REMOTE_CONNECTS, ""), (counters.REQUEST_SECONDS, "acquire")):
        with pytest.raises(KeyError):
            metrics.add(counter, amount, label, model="model-a")
    for histogram, label in ((counters.REQUEST_SECONDS, "no_such_kind"), (counters.ACQUIRES, "")):
        with pytest.raises(KeyError):
            metrics.observe(histogram, 0.001, label)
    assert metrics.snapshot() == {} and metrics.model_snapshot() == {} and metrics.histogram_snapshot() == {}


def test_every_declared_counter_is_exported_under_its_own_family(rng):
    """Each declared counter of each group (the daemon's, per model or not; the remote client's;
    the cost model's; an engine connector's, in its report), counted by a random amount through its
    declaration, is exported under its declared family and labels, by that amount (the sum, where
    declarations share labels); per-model ones split by model, an engine's with its session's
    labels; a report's key no declaration makes is not exported; no family is a catch-all of
    names (kvcached_*_events)."""
    state = DaemonState(4 << 20, max_namespaces=2, session_timeout_s=1.5)
    session, _ = state.attach(GEOMETRIES[0], pid=7, client_name="eng")
    metrics = state.metrics
    remote, engine = Counts(counters.REMOTE), Counts(ENGINE)
    expected: dict[tuple[str, tuple], float] = {}

    def expect(counter, label, amount, model=None, **labels):
        labels |= counter.labels_of(label) | ({"model": model} if model is not None else {})
        key = (counter.metric + "_total", tuple(sorted(labels.items())))
        expected[key] = expected.get(key, 0) + amount

    expect(counters.ATTACHES, "", 1)       # the engine's session
    for counter in ENGINE:
        for label in counter.keys:
            amount = int(rng.integers(1, 1 << 20))
            engine.add(counter, amount, label)
            if counter.metric is not None:
                expect(counter, label, amount, GEOMETRIES[0].model_id, engine="eng")
    state.engine_report(session.session_id, {"connector": {"counters": {**engine, "a_counter_of_tomorrow": 5}}})

    for counter in counters.DAEMON + counters.COST_MODEL + counters.REMOTE:
        for label in counter.keys:
            amount = int(rng.integers(1, 1 << 20))
            if counter in counters.REMOTE:
                remote.add(counter, amount, label)
            elif counter in counters.COST_MODEL:
                state.cost.counters.add(counter, amount, label)
            elif counter.per_model:
                split = int(rng.integers(0, amount))
                metrics.add(counter, split, label, model="model-a")
                metrics.add(counter, amount - split, label)
            else:
                metrics.add(counter, amount, label)
            if counter.metric is None:
                continue
            if counter.per_model:
                expect(counter, label, split, "model-a")
                expect(counter, label, amount - split, "")
            else:
                expect(counter, label, amount)
    snapshot = state.status()
    snapshot.setdefault("daemon", {})["remote"] = {"connected": True, "state": "closed", "counters": dict(remote)}
    samples = exported(snapshot)
    for (name, labels), amount in expected.items():
        if ("engine", "eng") in labels:
            found = [v for (n, ls), v in samples.items() if n == name and set(labels) <= set(ls)]
            assert found == [amount], (name, labels)
        else:
            assert samples.get((name, labels)) == amount, (name, labels)
    assert not [name for name, _ in samples if name.endswith("_events_total")]
    exported_names = {name for name, _ in samples}
    assert all(counter.metric + "_total" in exported_names
               for counter in counters.DAEMON + counters.COST_MODEL + counters.REMOTE + ENGINE if counter.metric)
    assert not [labels for _, labels in samples if "a_counter_of_tomorrow" in str(labels)]


def test_the_cost_model_is_exported_under_names_of_its_own(rng):
    """Each engine direction's line (fixed seconds, slope per byte or per token, samples, a 1 for
    its mode) and the L3 file's lines (no model) are exported with the values status shows; the
    decisions per where and choice, the hits not restored per source, the policy and the
    background-promotion counters (0 before any) too."""
    state = DaemonState(4 << 20, max_namespaces=2, session_timeout_s=1.5)
    session, namespace = state.attach(GEOMETRIES[0], pid=7, client_name="eng")
    page_bytes = GEOMETRIES[0].bytes_per_page
    sizes = rng.integers(1, 64, size=6).tolist()
    state.engine_report(session.session_id, {}, [("h2d", n * page_bytes, 1e-3 + n * 1e-6) for n in sizes]
                        + [("prefill", 256, 0.01)] * 3 + [("prefill", 4, 1.0)])
    state.cost.add_storage_sample("s2h", 10 * page_bytes, 0.5)
    prefix = rng.integers(0, 1 << 30, 6 * 8, dtype=np.int32).tobytes()
    reply = state.acquire(Acquire(session.session_id, prefix, save=True))
    state.commit(Commit(session.session_id, reply.lease_id, reply.reserved_page_ids))
    for _ in range(int(rng.integers(1, 5))):
        state.lookup(Lookup(session.session_id, prefix, prefetch=True))
    state.lookup(Lookup(session.session_id, prefix, policy="never", prefetch=True))
    snapshot = state.status()
    cost = snapshot["cost_model"]
    (engine,) = cost["engines"]
    samples = exported(snapshot)
    ns = {"model": "model-a", "namespace": str(namespace.namespace_id)}
    for direction, line in engine["directions"].items():
        labels = {**ns, "direction": direction}
        assert value(samples, "kvcached_cost_model_fixed_seconds", **labels) == line["fixed_s"], direction
        unit = "token" if direction == "prefill" else "byte"
        assert value(samples, f"kvcached_cost_model_slope_seconds_per_{unit}", **labels) == line[f"slope_s_per_{unit}"]
        assert value(samples, "kvcached_cost_model_samples_total", **labels) == line["samples_total"]
        assert [value(samples, "kvcached_cost_model_mode", **labels, mode=m) for m in ("prior", "ewma", "fit")] \
            == [float(line["mode"] == m) for m in ("prior", "ewma", "fit")], direction
    assert [engine["directions"][d]["mode"] for d in ("h2d", "prefill", "d2h")] == ["fit", "ewma", "prior"]
    assert value(samples, "kvcached_cost_model_samples_total", **ns, direction="h2d") == len(sizes)
    for direction, line in cost["storage"].items():
        labels = {"model": "", "namespace": "", "direction": direction}
        assert value(samples, "kvcached_cost_model_fixed_seconds", **labels) == line["fixed_s"]
        assert value(samples, "kvcached_cost_model_samples_total", **labels) == line["samples_total"]
    assert value(samples, "kvcached_cost_model_samples_total", model="", namespace="", direction="s2h") == 1
    for where, counts in engine["decisions_total"].items():
        for choice, count in counts.items():
            assert value(samples, "kvcached_cost_model_decisions_total", **ns, where=where, choice=choice) == count
    assert engine["decisions_total"]["lookup"]["recompute"] == 1 and engine["decisions_total"]["lookup"]["l2"] >= 1
    assert value(samples, "kvcached_cost_model_policy_skips_total", **ns, where="lookup", source="l2") == 1
    assert value(samples, "kvcached_cost_model_samples_ignored_total") == 1          # the 4-token prefill
    assert value(samples, "kvcached_background_promotions_total") == 0
    assert value(samples, "kvcached_cost_model_info", policy="cost") == 1
