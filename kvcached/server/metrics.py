"""Prometheus metrics, built from one status snapshot at scrape time.

``StatusCollector`` is a prometheus_client custom collector: each scrape takes one snapshot (the
dict ``kvcached status --json`` prints, taken under the daemon's state lock by the caller's
``snapshot`` function) and turns it into metric families. Nothing is counted twice: the daemon's
counters live in ``kvcached.core.metrics.Metrics``, the engines' in their connector reports
(ENGINE_REPORT, shown per session in status), and this module only names them.

Names follow Prometheus conventions: ``kvcached_*_total`` counters, ``*_bytes``, ``*_seconds``
histograms, labels ``tier`` (l2, l3), ``direction`` (h2d, d2h: engine DMA; d2d: a copy out of
another engine's GPU memory; h2s, s2h: L3 file I/O), ``model``, ``engine``/``session``, ``reason``.
The daemon's counters and histograms are exported as declared (kvcached/core/counters.py), every
declared one, and nothing else: nothing is counted that no declaration names. An engine's are
declared in proto/counters.py (ENGINE); a key of its report that none declares (an engine of
another version) is shown in status, not exported. docs/metrics.md lists them all (its table of
counters is ``python -m kvcached.server.metrics --write-docs``).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvcached.core import counters
from proto.counters import ENGINE, ENGINE_LOADED_PAGES, ENGINE_SAVED_PAGES, REQUESTS_OPEN, Counter


ENGINE_LABELS = ("engine", "session", "model")


def _version() -> str:
    try:
        return importlib.metadata.version("kvcached-sidecar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _Families:
    """Metric families made on first use, so that each has one name, type, help and label set."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[Metric, tuple[str, ...]]] = {}

    def add(self, kind: type, name: str, help: str, labels: dict[str, str], value: Any = None,
            **kwargs: Any) -> None:
        """One sample; ``value`` for counters, gauges and infos, ``buckets``/``sum_value`` for histograms."""
        if name not in self._families:
            self._families[name] = (kind(name, help or name, labels=list(labels)), tuple(labels))
        family, label_names = self._families[name]
        assert set(labels) == set(label_names), f"{name}: labels {sorted(labels)} != {sorted(label_names)}"
        if value is not None:
            kwargs["value"] = value
        family.add_metric([labels[k] for k in label_names], **kwargs)

    def __iter__(self) -> Iterator[Metric]:
        return (family for family, _ in self._families.values())


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Each declared counter family's help (one of its declarations carries it, the others have "").
_HELP = {counter.metric: counter.help for counter in (*counters.DAEMON, *counters.REMOTE, *counters.COST_MODEL,
                                                    *ENGINE) if counter.help}


def _declared_counters(families: _Families, declared: Iterable[Counter], counts: dict[str, Any],
                       by_model: dict[str, dict[str, Any]] | None = None, labels: dict[str, str] | None = None,
                       present_only: bool = False) -> None:
    """Every declared counter of ``declared``, its value in ``counts`` (a status dict of them; 0 where
    absent, unless ``present_only``), with ``labels`` besides its own. A ``per_model`` one (with
    ``by_model``) has a series per model that counted it, and one with model "" for what was
    counted without a model (also 0 where none was). Declarations that give a family the same
    labels are summed."""
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for counter in declared:
        if counter.metric is None:
            continue
        for label, key in counter.keys.items():
            if present_only and not _number(counts.get(key)):
                continue
            own_labels = {**(labels or {}), **counter.labels_of(label)}
            total = counts.get(key, 0)
            samples = []
            if counter.per_model and by_model is not None:
                samples = [({"model": model, **own_labels}, values[key]) for model, values in by_model.items()
                           if key in values]
                unattributed = total - sum(value for _, value in samples)
                if unattributed > 0 or not samples:
                    samples.append(({"model": "", **own_labels}, unattributed))
            else:
                samples = [(own_labels, total)]
            for sample_labels, value in samples:
                sample_key = (counter.metric, tuple(sorted(sample_labels.items())))
                sums[sample_key] = sums.get(sample_key, 0) + value
    for (metric, labels), value in sums.items():
        families.add(CounterMetricFamily, metric, _HELP[metric], dict(labels), value)


def _daemon_counters(families: _Families, snapshot: dict[str, Any]) -> None:
    by_model = snapshot.get("metrics_by_model", {})
    _declared_counters(families, counters.DAEMON, snapshot.get("metrics", {}), by_model)
    # Derived, per model: what acquires asked for and L2 did not have (after promotion). Both
    # counters grow together, by an acquire's tokens and by at most as many hits: it never decreases.
    match_tokens, hit_tokens_l2 = counters.ACQUIRE_TOKENS.keys[""], counters.HIT_TOKENS.keys["l2"]
    for model, values in by_model.items():
        if match_tokens in values:
            families.add(CounterMetricFamily, "kvcached_miss_tokens", "Tokens of acquired prompts L2 did not "
                         "hold after promotion: recomputed, unless the engine's own GPU cache held them",
                         {"model": model}, values[match_tokens] - values.get(hit_tokens_l2, 0))


def _histograms(families: _Families, snapshot: dict[str, Any]) -> None:
    observed = snapshot.get("histograms", {})
    for declared in counters.HISTOGRAMS:
        for label, key in declared.keys.items():
            histogram = observed.get(key)
            if histogram is None:
                continue
            buckets = [(repr(float(le)), count) for le, count in zip(histogram["le"], histogram["cumulative"])]
            buckets.append(("+Inf", histogram["count"]))
            families.add(HistogramMetricFamily, declared.metric, declared.help, declared.labels_of(label),
                         buckets=buckets, sum_value=histogram["sum"])


def _namespaces(families: _Families, snapshot: dict[str, Any]) -> dict[int, dict[str, Any]]:
    by_id = {}
    for namespace in snapshot.get("namespaces", []):
        by_id[namespace["namespace_id"]] = namespace
        bytes_per_page = namespace["bytes_per_page"]
        labels = {"model": namespace["geometry"]["model_id"], "namespace": str(namespace["namespace_id"])}
        families.add(GaugeMetricFamily, "kvcached_namespace_page_bytes", "Bytes of one page of the namespace",
                     labels, bytes_per_page)
        families.add(GaugeMetricFamily, "kvcached_namespace_page_tokens", "Tokens of one page of the namespace",
                     labels, namespace["geometry"]["page_size"])
        families.add(GaugeMetricFamily, "kvcached_namespace_sessions", "Engine sessions attached to the namespace",
                     labels, namespace["sessions"])
        families.add(GaugeMetricFamily, "kvcached_namespace_tree_nodes", "Nodes of the namespace's prefix tree",
                     labels, namespace["tree_nodes"])
        for tier, info in namespace["tiers"].items():
            tier_labels = {**labels, "tier": tier}
            families.add(GaugeMetricFamily, "kvcached_tier_capacity_bytes", "Bytes of the tier the namespace holds",
                         tier_labels, info["capacity_pages"] * bytes_per_page)
            for state in ("free", "owned", "private", "quarantined"):
                families.add(GaugeMetricFamily, "kvcached_tier_bytes", "Bytes of the namespace's tier by state: "
                             "owned (cached prefixes), private (being written), quarantined (a stalled engine "
                             "may write them), free; they add up to the capacity", {**tier_labels, "state": state},
                             info.get(f"{state}_pages", 0) * bytes_per_page)
            families.add(GaugeMetricFamily, "kvcached_tier_protected_bytes", "Owned bytes locked by leases or moves "
                         "(not evictable)", tier_labels, info["protected_pages"] * bytes_per_page)
            families.add(GaugeMetricFamily, "kvcached_tier_evictable_bytes", "Owned bytes that can be evicted now",
                         tier_labels, info["evictable_pages"] * bytes_per_page)
    return by_id


def _engines(families: _Families, snapshot: dict[str, Any], namespaces: dict[int, dict[str, Any]]) -> None:
    sessions = snapshot.get("sessions", [])
    families.add(GaugeMetricFamily, "kvcached_sessions", "Engine sessions attached", {}, len(sessions))
    for session in sessions:
        namespace = namespaces.get(session["namespace_id"], {})
        labels = {"engine": session["client_name"], "session": session["session"],
                  "model": namespace.get("geometry", {}).get("model_id", "")}
        families.add(GaugeMetricFamily, "kvcached_engine_info", "An attached engine session (value 1)",
                     {**labels, "pid": str(session["pid"]), "pid_watched": str(bool(session.get("pid_watched"))).lower(),
                      "namespace": str(session["namespace_id"])}, 1)
        families.add(GaugeMetricFamily, "kvcached_engine_leases", "Leases the session holds", labels, session["leases"])
        families.add(GaugeMetricFamily, "kvcached_engine_idle_seconds", "Seconds since the session's last request",
                     labels, session.get("idle_s", 0.0))
        report = session.get("report")
        report_counters = report.get("connector", {}).get("counters", {}) if isinstance(report, dict) else {}
        if not isinstance(report_counters, dict):
            continue
        if _number(report_counters.get(REQUESTS_OPEN)):
            families.add(GaugeMetricFamily, "kvcached_engine_requests_open", "Requests the engine's connector has "
                         "open (as last reported)", labels, report_counters[REQUESTS_OPEN])
        _declared_counters(families, ENGINE, report_counters, labels=labels, present_only=True)
        for counter in (ENGINE_LOADED_PAGES, ENGINE_SAVED_PAGES):
            if _number(report_counters.get(counter.key)) and "bytes_per_page" in namespace:
                families.add(CounterMetricFamily, "kvcached_engine_transfer_bytes", "Bytes an engine loaded (h2d) "
                             "or saved (d2h) through the L2 pool", {**labels, **counter.fixed},
                             report_counters[counter.key] * namespace["bytes_per_page"])


def _daemon(families: _Families, snapshot: dict[str, Any]) -> None:
    daemon = snapshot.get("daemon", {})
    families.add(InfoMetricFamily, "kvcached_build", "kvcached version and wire protocol", {},
                 {"version": _version(), "protocol_version": str(daemon.get("protocol_version", ""))})
    if "uptime_s" in daemon and "time" in snapshot:
        families.add(GaugeMetricFamily, "kvcached_start_time_seconds", "When the daemon started (Unix time)", {},
                     snapshot["time"] - daemon["uptime_s"])
    for tier, key in (("l2", "l2_bytes"), ("l3", "l3_bytes")):
        families.add(GaugeMetricFamily, "kvcached_pool_bytes", "Size of the L2 segment and the L3 file",
                     {"tier": tier}, daemon.get(key, 0))
    families.add(GaugeMetricFamily, "kvcached_leases", "Active leases", {}, snapshot.get("leases", 0))
    families.add(GaugeMetricFamily, "kvcached_quarantines_active", "Ended sessions whose pages are quarantined",
                 {}, len(snapshot.get("quarantines", [])))
    for direction, count in snapshot.get("pending", {}).items():
        families.add(GaugeMetricFamily, "kvcached_pending_moves", "L3 moves pending", {"direction": direction}, count)
    io = snapshot.get("io", {})
    if "in_flight" in io:
        families.add(GaugeMetricFamily, "kvcached_io_in_flight", "File I/Os running or queued on the I/O threads",
                     {}, io["in_flight"])
    index = daemon.get("l3_index")
    if index:
        families.add(GaugeMetricFamily, "kvcached_l3_index_pending_changes", "L3 index changes not yet written",
                     {}, index.get("pending_changes", 0))
        families.add(GaugeMetricFamily, "kvcached_l3_index_failed", "1 when writing the L3 index failed", {},
                     1 if index.get("failed") else 0)


def _remote(families: _Families, snapshot: dict[str, Any]) -> None:
    remote = snapshot.get("daemon", {}).get("remote")
    if not remote:
        return
    families.add(GaugeMetricFamily, "kvcached_remote_up", "1 while the remote store is connected and its breaker "
                 "closed (requests ask it)", {}, 1 if remote["connected"] and remote["state"] == "closed" else 0)
    _declared_counters(families, counters.REMOTE, remote.get("counters", {}))


COST_MODEL_MODES = ("prior", "ewma", "fit")


def cost_model_metrics(families: _Families, snapshot: dict[str, Any]) -> None:
    """The one place where the cost model's status (``kvcached/core/cost_model.py``) becomes metrics:
    per engine (``model``, ``namespace``) and direction its line's fixed term, slope, sample count
    and mode; the storage lines (the daemon's one L3 file: ``s2h`` reads, ``h2s`` writes) with
    empty ``model`` and ``namespace``; the decisions per choice and the hits not restored per
    source, each by ``where`` (``lookup``, ``match`` (an acquire), ``predicted``); the policy; the background
    promotions."""
    cost = snapshot.get("cost_model")
    if not cost:
        return
    families.add(InfoMetricFamily, "kvcached_cost_model", "The restore policy (cost, always, never) and margin",
                 {}, {"policy": str(cost.get("policy", "")), "margin": str(cost.get("margin", ""))})
    lines = [("", "", direction, line) for direction, line in cost.get("storage", {}).items()]
    for engine in cost.get("engines", []):
        model, namespace = str(engine.get("model_id", "")), str(engine.get("namespace_id", ""))
        lines += [(model, namespace, direction, line) for direction, line in engine.get("directions", {}).items()]
        engine_labels = {"model": model, "namespace": namespace}
        for where, counts in engine.get("decisions_total", {}).items():
            for choice, count in counts.items():
                families.add(CounterMetricFamily, "kvcached_cost_model_decisions", "Restore decisions of lookups "
                             "and acquires, by choice (engine, l2, l3, peer, recompute)",
                             {**engine_labels, "where": where, "choice": choice}, count)
        for where, counts in engine.get("policy_skips_total", {}).items():
            for source, count in counts.items():
                families.add(CounterMetricFamily, "kvcached_cost_model_policy_skips", "Hits not restored from the "
                             "source holding the most (recomputed or restored from another), by that source",
                             {**engine_labels, "where": where, "source": source}, count)
    for model, namespace, direction, line in lines:
        labels = {"model": model, "namespace": namespace, "direction": direction}
        families.add(GaugeMetricFamily, "kvcached_cost_model_fixed_seconds", "The fixed term of a direction's "
                     "line (fixed + size x slope)", labels, line["fixed_s"])
        if "slope_s_per_token" in line:
            families.add(GaugeMetricFamily, "kvcached_cost_model_slope_seconds_per_token", "The slope of an "
                         "engine's prefill line (recompute)", labels, line["slope_s_per_token"])
        else:
            families.add(GaugeMetricFamily, "kvcached_cost_model_slope_seconds_per_byte", "The slope of a "
                         "transfer's line (h2d, d2h, d2d; s2h, h2s)", labels, line["slope_s_per_byte"])
        families.add(CounterMetricFamily, "kvcached_cost_model_samples", "Samples a line took in", labels,
                     line["samples_total"])
        for mode in COST_MODEL_MODES:
            families.add(GaugeMetricFamily, "kvcached_cost_model_mode", "1 for a line's mode: prior (no sample "
                         "yet), ewma (sizes barely vary: the fixed term learned), fit (both terms fitted)",
                         {**labels, "mode": mode}, 1 if line["mode"] == mode else 0)
    _declared_counters(families, counters.COST_MODEL, cost)


def metric_families(snapshot: dict[str, Any]) -> list[Metric]:
    """Every kvcached metric family of one status snapshot."""
    families = _Families()
    _daemon(families, snapshot)
    _remote(families, snapshot)
    _daemon_counters(families, snapshot)
    _histograms(families, snapshot)
    _engines(families, snapshot, _namespaces(families, snapshot))
    cost_model_metrics(families, snapshot)
    return list(families)


class StatusCollector(Collector):
    """Takes one status snapshot per scrape (``snapshot()`` may raise: the scrape fails, 503)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        return metric_families(self._snapshot())


def make_registry(snapshot: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    """kvcached's metrics and the process's own (memory, CPU, open files; process_*)."""
    from prometheus_client import PlatformCollector, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


# ---- docs/metrics.md's table of declared counters ------------------------------------------------

DOCS_PATH = "docs/metrics.md"
DOCS_BEGIN = "<!-- declared counters: generated by `python -m kvcached.server.metrics --write-docs` -->"
DOCS_END = "<!-- end of declared counters -->"
_DOCS_GROUPS = (("metrics", counters.DAEMON), ("histograms", counters.HISTOGRAMS),
                ("remote", counters.REMOTE), ("cost_model", counters.COST_MODEL), ("report", ENGINE))


def docs_table() -> str:
    """The table of every declared counter: its metric, labels, status key and help."""
    rows = [DOCS_BEGIN, "", "| metric | type | labels | status key | what |", "|---|---|---|---|---|"]
    for where, declared in _DOCS_GROUPS:
        for counter in declared:
            kind = "histogram" if counter.histogram else "counter" if counter.metric else "status only"
            metric = "" if counter.metric is None else counter.metric if counter.histogram else f"{counter.metric}_total"
            labels = [*(["engine, session, model"] if declared is ENGINE else ["model"] if counter.per_model else []),
                      *(f"{k}={v}" for k, v in counter.fixed.items()),
                      *([f"{counter.label} ({', '.join(counter.values)})"] if counter.label else [])]
            key = counter.key.replace("{}", "{" + counter.label + "}")
            rows.append(f"| {f'`{metric}`' if metric else ''} | {kind} | {', '.join(labels)} | `{where}.{key}` | "
                        f"{counter.help} |")
    return "\n".join([*rows, "", DOCS_END])


def write_docs(path: str = DOCS_PATH) -> None:
    with open(path) as file:
        text = file.read()
    begin, end = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
    with open(path, "w") as file:
        file.write(text[:begin] + docs_table() + text[end:])


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write-docs"]:
        write_docs()
    else:
        print(docs_table())
