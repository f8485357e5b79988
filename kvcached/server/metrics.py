"""Prometheus metrics, built from one status snapshot at scrape time.

``StatusCollector`` is a prometheus_client custom collector: each scrape takes one snapshot (the
dict ``kvcached status --json`` prints, taken under the daemon's state lock by the caller's
``snapshot`` function) and turns it into metric families. Nothing is counted twice: the daemon's
counters live in ``kvcached.core.metrics.Metrics``, the engines' in their connector reports
(ENGINE_REPORT, shown per session in status), and this module only names them.

Names follow Prometheus conventions: ``kvcached_*_total`` counters, ``*_bytes``, ``*_seconds``
histograms, labels ``tier`` (l2, l3), ``direction`` (h2d, d2h: engine DMA; d2d: a copy out of
another engine's GPU memory; h2s, s2h: L3 file I/O), ``model``, ``engine``/``session``, ``reason``. docs/metrics.md lists them all. A counter
the tables below do not name still reaches Prometheus, as ``kvcached_daemon_events_total{event}``
or ``kvcached_engine_events_total{event}``, so a new counter is never lost, only unnamed.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any, Callable, Iterable, Iterator, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry


class Rule(NamedTuple):
    """A counter (or histogram) name of the daemon or an engine, mapped to a metric.

    ``pattern`` fully matches the name; its groups become the labels ``labels`` names; ``fixed``
    labels are constant. ``metric`` None: the counter is exported some other way (a histogram's
    count and sum, a sum of labelled counters), not again. ``per_model``: the daemon also counts it
    per model (``metrics_by_model``)."""

    pattern: re.Pattern[str]
    metric: str | None
    help: str
    labels: tuple[str, ...] = ()
    fixed: tuple[tuple[str, str], ...] = ()
    per_model: bool = False


def _rule(pattern: str, metric: str | None, help: str = "", labels: tuple[str, ...] = (),
          per_model: bool = False, **fixed: str) -> Rule:
    return Rule(re.compile(pattern), metric, help, labels, tuple(sorted(fixed.items())), per_model)


# The daemon's counters (status "metrics"), first matching rule wins.
DAEMON_COUNTERS = (
    _rule("matches", "kvcached_matches", "Matches handled (requests that may lease pages)", per_model=True),
    _rule("match_tokens", "kvcached_match_tokens", "Tokens (whole pages) of the prompts matched", per_model=True),
    _rule("hit_tokens_(l2|l3)", "kvcached_hit_tokens", "Leading tokens of matched prompts the tier held (l2: "
          "after any promotion from L3)", ("tier",), per_model=True),
    _rule("lookups", "kvcached_lookups", "Lookups handled (side-effect free matches)", per_model=True),
    _rule("lookup_tokens", "kvcached_lookup_tokens", "Tokens (whole pages) looked up", per_model=True),
    _rule("lookup_hit_tokens_(l2|remote)", "kvcached_lookup_hit_tokens", "Leading tokens of looked-up prompts the "
          "tier held (remote: L2 and the remote store together)", ("tier",), per_model=True),
    _rule("evicted_pages_(l2|l3)", "kvcached_evicted_pages", "Pages evicted (LRU) to make room", ("tier",),
          per_model=True),
    _rule("backup_pages_committed", "kvcached_committed_pages", "Pages engines saved that entered L2 (new to "
          "the tree)", per_model=True),
    _rule("backup_pages_duplicate", "kvcached_duplicate_pages", "Saved pages another engine had committed "
          "first (freed)"),
    _rule("backup_pages_reserved", "kvcached_reserved_pages", "L2 pages reserved for engines' saves"),
    _rule("backup_reserve_failures", "kvcached_reservation_failures", "Matches that wanted pages for saves and "
          "got none"),
    _rule("reservations_capped", "kvcached_reservations_capped", "Reservations cut to a session's share of a "
          "namespace"),
    _rule("promotions", "kvcached_promotions", "Matches served after an L3 -> L2 promotion"),
    _rule("restore_fallbacks", "kvcached_fallbacks", "Matches whose L3 promotion failed (the engine recomputes)",
          reason="promotion_failed"),
    _rule("(h2s|s2h|r2h)_pages_published", "kvcached_io_published_pages", "Pages an L3 write (h2s), promotion "
          "(s2h) or remote restore (r2h) added to its tier", ("direction",)),
    _rule("(h2s|s2h)_pages_cut_no_space", "kvcached_io_pages_cut", "Pages an L3 write (h2s) or promotion (s2h) "
          "left out for want of room in the tier it copies to (the pages before them were copied)",
          ("direction",)),
    _rule("(h2s|s2h)_bytes", "kvcached_io_bytes", "Bytes moved between L2 and the L3 file", ("direction",)),
    _rule("(h2s|s2h)_extents", "kvcached_io_extents", "File extents (coalesced I/Os) of L3 moves",
          ("direction",)),
    _rule("(h2s|s2h|r2h)_failures", "kvcached_io_failures", "L3 moves and remote restores that failed (their "
          "pages returned)", ("direction",)),
    _rule("(h2s|s2h|r2h)_no_space", "kvcached_policy_skips", "Copies to another tier not made, by reason",
          ("direction",), reason="no_space"),
    _rule("(h2s|s2h)_policy_skips", "kvcached_policy_skips", "", ("direction",), reason="backlog"),
    _rule("backup_policy_skips", "kvcached_policy_skips", "", direction="d2h", reason="evicted_before_reuse"),
    _rule("(h2s|s2h)_(count|seconds|queue_wait_seconds|end_to_end_seconds)", None),   # the histograms
    _rule("attaches", "kvcached_attaches", "Engine sessions attached"),
    _rule("sessions_(expired|grace_exceeded|ended_process_gone|replaced)", "kvcached_sessions_ended",
          "Sessions ended other than by detaching, by reason", ("reason",)),
    _rule("previous_session_refused", "kvcached_previous_session_refused", "Attaches naming a previous session "
          "of another process (ignored)"),
    _rule("leases_(released|reclaimed)", "kvcached_leases_ended", "Leases ended, by how", ("how",)),
    _rule("backup_commits", "kvcached_leases_ended", "", how="committed"),
    _rule("commits_refused_session_ended", "kvcached_commits_refused", "Commits refused: the session had ended",
          reason="session_ended"),
    _rule("quarantines", "kvcached_quarantines", "Sessions whose private pages were quarantined"),
    _rule("pages_quarantined", "kvcached_quarantined_pages", "Pages quarantined"),
    _rule("quarantines_ended_(.+)", "kvcached_quarantines_ended", "Quarantines ended, by cause", ("reason",)),
    _rule("namespaces_reclaimed", "kvcached_namespaces_reclaimed", "Idle namespaces whose space went to a new one"),
    _rule("daemon_pauses", "kvcached_daemon_pauses", "Times the daemon did not run for a while (stopped, starved)"),
    _rule("daemon_pause_seconds", "kvcached_daemon_paused_seconds", "Seconds the daemon did not run"),
    _rule("l3_checksum_mismatches", "kvcached_l3_checksum_mismatches", "L3 pages read back with a wrong checksum"),
    _rule("l3_pages_dropped_corrupt", "kvcached_l3_dropped_pages", "L3 pages dropped, by reason",
          reason="corrupt"),
    _rule("l3_index_rows_dropped", "kvcached_l3_dropped_pages", "", reason="index_unusable"),
    _rule("l3_pages_restored", "kvcached_l3_restored_pages", "L3 pages rebuilt from the index at start"),
    _rule("remote_hit_pages", "kvcached_remote_hit_pages", "Pages restored from the remote store into L2 (their "
          "header and checksum checked)"),
    _rule("remote_pages_written", "kvcached_remote_written_pages", "L2 pages written through to the remote store"),
    _rule("remote_bytes_(read|written)", "kvcached_remote_bytes", "Page bytes read from and written to the "
          "remote store", ("op",)),
    _rule("remote_checksum_mismatches", "kvcached_remote_checksum_mismatches", "Values the remote store gave that "
          "were not the page asked for (another page, torn, a wrong checksum): dropped, recomputed"),
    _rule("remote_restores", "kvcached_remote_restores", "Matches served after a restore from the remote store"),
    _rule("remote_restore_fallbacks", "kvcached_fallbacks", "", reason="remote_failed"),
    _rule("remote_get_calls", "kvcached_remote_get_calls", "Restores whose gets the remote store answered"),
    _rule("errors_internal", "kvcached_internal_errors", "Requests that hit a daemon bug (error reply)"),
    _rule("errors_(.+)", "kvcached_refused_requests", "Requests refused with an error reply, by code", ("code",)),
    _rule("replies_dropped", "kvcached_replies_dropped", "Replies not delivered (peer gone or not reading)"),
)

# The daemon's time histograms (status "histograms").
DAEMON_HISTOGRAMS = (
    _rule("(h2s|s2h)_service_seconds", "kvcached_io_service_seconds", "Time an L3 move spent in file I/O",
          ("direction",)),
    _rule("(h2s|s2h)_queue_wait_seconds", "kvcached_io_queue_wait_seconds", "Time an L3 move waited for an I/O "
          "thread (end to end less service)", ("direction",)),
    _rule("(h2s|s2h|r2h)_end_to_end_seconds", "kvcached_io_end_to_end_seconds", "Time from an L3 move's (or a "
          "remote restore's) enqueue to its completion", ("direction",)),
    _rule("request_seconds_(.+)", "kvcached_request_seconds", "Time the socket thread spent handling a request, "
          "by kind", ("kind",)),
    _rule("(.+)", "kvcached_daemon_seconds", "Other timings of the daemon", ("name",)),
)

# An engine connector's counters (status sessions[].report.connector.counters), per session.
ENGINE_COUNTERS = (
    _rule("loaded_pages", "kvcached_engine_transfer_pages", "Pages an engine loaded (h2d) or saved (d2h)",
          direction="h2d"),
    _rule("saved_pages", "kvcached_engine_transfer_pages", "", direction="d2h"),
    _rule("loads", "kvcached_engine_loads", "Loads an engine asked for"),
    _rule("saves", "kvcached_engine_saves", "Saves an engine asked for"),
    _rule("matches", "kvcached_engine_matches", "Matches an engine's requests got a reply to"),
    _rule("lookups", "kvcached_engine_lookups", "Lookups an engine sent"),
    _rule("lookup_hit_tokens", "kvcached_engine_lookup_hit_tokens", "Tokens an engine's lookups found cached"),
    _rule("promoted_tokens", "kvcached_engine_promoted_tokens", "Tokens promoted from L3 for an engine's matches"),
    _rule("committed_pages", "kvcached_engine_committed_pages", "Saved pages an engine committed"),
    _rule("save_pages_cached", "kvcached_engine_save_cached_pages", "Pages a save found in L2 already (not "
          "written)"),
    _rule("load_failed_pages_(.+)", "kvcached_engine_load_failed_pages", "Pages a load could not fill (the "
          "engine recomputes them), by reason", ("reason",)),
    _rule("save_skipped_pages_(.+)", "kvcached_engine_save_skipped_pages", "Pages a save did not write, by "
          "reason", ("reason",)),
    _rule("match_failures_(.+)", "kvcached_engine_match_failures", "Matches that failed, by reason", ("reason",)),
    _rule("lookup_failures_(.+)", "kvcached_engine_lookup_failures", "Lookups that failed, by reason",
          ("reason",)),
    _rule("daemon_refusals_(.+)", "kvcached_engine_refusals", "Requests of an engine the daemon refused, by code",
          ("code",)),
    _rule("(load_failed_pages|save_skipped_pages|requests_open)", None),   # sums of the above; a gauge
)

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


def _match(rules: Iterable[Rule], name: str) -> tuple[Rule, dict[str, str]] | None:
    for rule in rules:
        match = rule.pattern.fullmatch(name)
        if match:
            labels = dict(zip(rule.labels, match.groups()))
            labels.update(rule.fixed)
            return rule, labels
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _daemon_counters(families: _Families, snapshot: dict[str, Any]) -> None:
    by_model = snapshot.get("metrics_by_model", {})
    for name, value in snapshot.get("metrics", {}).items():
        if not _number(value):
            continue
        found = _match(DAEMON_COUNTERS, name)
        if found is None:
            families.add(CounterMetricFamily, "kvcached_daemon_events", "Daemon counters without a metric "
                         "of their own, by name", {"event": name}, value)
            continue
        rule, labels = found
        if rule.metric is None:
            continue
        if not rule.per_model:
            families.add(CounterMetricFamily, rule.metric, rule.help, labels, value)
            continue
        attributed = 0
        for model, counters in by_model.items():
            if name in counters:
                families.add(CounterMetricFamily, rule.metric, rule.help, {"model": model, **labels}, counters[name])
                attributed += counters[name]
        if value - attributed > 0:         # counted without a model (none is named): still counted
            families.add(CounterMetricFamily, rule.metric, rule.help, {"model": "", **labels}, value - attributed)
    # Derived, per model: what matches asked for and L2 did not have (after promotion). Both
    # counters grow together, by a match's tokens and by at most as many hits: it never decreases.
    for model, counters in by_model.items():
        if "match_tokens" in counters:
            families.add(CounterMetricFamily, "kvcached_miss_tokens", "Tokens of matched prompts L2 did not "
                         "hold after promotion: recomputed, unless the engine's own GPU cache held them",
                         {"model": model}, counters["match_tokens"] - counters.get("hit_tokens_l2", 0))


def _histograms(families: _Families, snapshot: dict[str, Any]) -> None:
    for name, histogram in snapshot.get("histograms", {}).items():
        found = _match(DAEMON_HISTOGRAMS, name)
        assert found is not None, "the last rule matches every name"
        rule, labels = found
        buckets = [(repr(float(le)), count) for le, count in zip(histogram["le"], histogram["cumulative"])]
        buckets.append(("+Inf", histogram["count"]))
        families.add(HistogramMetricFamily, rule.metric, rule.help, labels, buckets=buckets,
                     sum_value=histogram["sum"])


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
        counters = report.get("connector", {}).get("counters", {}) if isinstance(report, dict) else {}
        if not isinstance(counters, dict):
            continue
        if _number(counters.get("requests_open")):
            families.add(GaugeMetricFamily, "kvcached_engine_requests_open", "Requests the engine's connector has "
                         "open (as last reported)", labels, counters["requests_open"])
        for name, value in counters.items():
            if not _number(value):
                continue
            found = _match(ENGINE_COUNTERS, name)
            if found is None:
                families.add(CounterMetricFamily, "kvcached_engine_events", "Engine connector counters without a "
                             "metric of their own, by name", {**labels, "event": name}, value)
                continue
            rule, extra = found
            if rule.metric is None:
                continue
            families.add(CounterMetricFamily, rule.metric, rule.help, {**labels, **extra}, value)
            if rule.metric == "kvcached_engine_transfer_pages" and "bytes_per_page" in namespace:
                families.add(CounterMetricFamily, "kvcached_engine_transfer_bytes", "Bytes an engine loaded (h2d) "
                             "or saved (d2h) through the L2 pool", {**labels, **extra},
                             value * namespace["bytes_per_page"])


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


# The remote store client's counters (status daemon.remote.counters).
REMOTE_COUNTERS = (
    _rule("remote_errors_(exist|get|put)", "kvcached_remote_errors", "Remote store calls that failed or missed "
          "their deadline, by call", ("op",)),
    _rule("remote_deadline_misses_(exist|get|put)", "kvcached_remote_deadline_misses", "Remote store calls not "
          "answered within their deadline (the request went on with a local miss)", ("op",)),
    _rule("remote_skips_(exist|get|put)(?:_backlog)?", "kvcached_remote_skips", "Remote store calls not made: "
          "the store was unreachable (breaker open) or too many writes in flight", ("op",)),
    _rule("remote_exist_calls", "kvcached_remote_lookups", "Lookups and matches that asked the remote store "
          "which following pages it holds"),
    _rule("remote_exist_seconds", "kvcached_remote_lookup_seconds", "Seconds those questions took (the latency "
          "they add to a request)"),
    _rule("remote_exist_held_pages", "kvcached_remote_lookup_held_pages", "Pages the remote store said it held"),
    _rule("remote_connects", "kvcached_remote_connects", "Connections made to the remote store"),
    _rule("remote_probe_failures", "kvcached_remote_probe_failures", "Probes of an unreachable remote store that "
          "failed"),
)


def _remote(families: _Families, snapshot: dict[str, Any]) -> None:
    remote = snapshot.get("daemon", {}).get("remote")
    if not remote:
        return
    families.add(GaugeMetricFamily, "kvcached_remote_up", "1 while the remote store is connected and its breaker "
                 "closed (requests ask it)", {}, 1 if remote["connected"] and remote["state"] == "closed" else 0)
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Rule, float]] = {}
    for name, value in remote.get("counters", {}).items():
        found = _match(REMOTE_COUNTERS, name)
        if found is None or not _number(value):
            continue
        rule, labels = found
        key = (rule.metric, tuple(sorted(labels.items())))
        sums[key] = (rule, sums.get(key, (rule, 0))[1] + value)
    for (metric, labels), (rule, value) in sums.items():
        families.add(CounterMetricFamily, metric, rule.help, dict(labels), value)


# The cost model's counters (status "cost_model", top level) -> (metric, help, labels).
COST_MODEL_COUNTERS = {
    "background_promotions_total": ("kvcached_background_promotions", "L3 hits a lookup declined, promoted to L2 "
                                    "in the background (a later request restores them at DMA speed)", {}),
    "background_promoted_pages_total": ("kvcached_background_promoted_pages", "Pages background promotions "
                                        "added to L2", {}),
    "background_promotion_skips_busy_total": ("kvcached_background_promotion_skips", "Background promotions not "
                                              "started, by reason", {"reason": "busy"}),
    "background_promotion_skips_no_gain_total": ("kvcached_background_promotion_skips", "", {"reason": "no_gain"}),
    "stale_line_resets_total": ("kvcached_cost_model_stale_line_resets", "Lines that dropped their samples "
                                "(back to the prior) after 64 decisions declined their source with no sample "
                                "between", {}),
    "samples_ignored_total": ("kvcached_cost_model_samples_ignored", "Timings engines reported that are no sample "
                              "(a prefill under 16 tokens, a time out of range)", {}),
}
COST_MODEL_MODES = ("prior", "ewma", "fit")


def cost_model_metrics(families: _Families, snapshot: dict[str, Any]) -> None:
    """The one place where the cost model's status (``kvcached/core/cost_model.py``) becomes metrics:
    per engine (``model``, ``namespace``) and direction its line's fixed term, slope, sample count
    and mode; the storage lines (the daemon's one L3 file: ``s2h`` reads, ``h2s`` writes) with
    empty ``model`` and ``namespace``; the decisions per choice and the hits not restored per
    source, each by ``where`` (``lookup``, ``match``, ``predicted``); the policy; the background
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
                             "and matches, by choice (engine, l2, l3, peer, recompute)",
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
    for key, (metric, help, labels) in COST_MODEL_COUNTERS.items():
        families.add(CounterMetricFamily, metric, help, labels, cost.get(key, 0))
    for key, value in cost.items():         # a counter not named above still reaches Prometheus
        if key.endswith("_total") and key not in COST_MODEL_COUNTERS and _number(value):
            families.add(CounterMetricFamily, "kvcached_daemon_events", "Daemon counters without a metric of "
                         "their own, by name", {"event": f"cost_model_{key.removesuffix('_total')}"}, value)


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
