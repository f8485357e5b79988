"""Counters declared once: the key status shows, the Prometheus family, its labels and help.

A ``Counter`` names one quantity; with a ``label`` it is one status key per declared value of
that label (the values an enum or a fixed tuple gives, never free text). Code counts only
through a declaration (``Counts.add``), so every key a snapshot holds is one the exporter
(``kvcached/server/metrics.py``) names: there is no catch-all for a counter nobody declared,
and a value no declaration lists raises where it is counted.

The daemon's declarations are in ``kvcached/core/counters.py``; this module holds the type and,
being the contract both sides share, the counters an engine reports with ENGINE_REPORT.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Mapping

from proto.messages import RESTORE_CHOICES, MsgKind


@dataclasses.dataclass(frozen=True, eq=False)
class Counter:
    """One declared counter (or, ``histogram``, time histogram).

    ``key`` is its status key; with a ``label``, a format string whose ``{}`` is the label's
    value, one key per value of ``values``. ``metric`` is the Prometheus family (a counter is
    exported as ``<metric>_total``); None: status only, ``help`` says where Prometheus gets the
    quantity instead. ``fixed`` labels are constant. Declarations may share a family: one of them
    carries its help (the others ""), all have the same label names, and where two give the same
    labels the family shows their sum. ``per_model``: counted per model too (``Metrics``)."""

    key: str
    metric: str | None
    help: str
    label: str = ""
    values: tuple[str, ...] = ()
    fixed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    per_model: bool = False
    histogram: bool = False
    keys: Mapping[str, str] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if bool(self.label) != bool(self.values) or (self.label and self.key.count("{}") != 1):
            raise ValueError(f"{self.key}: a label needs its values and one {{}} in the key")
        keys = {value: self.key.format(value) for value in self.values} if self.label else {"": self.key}
        object.__setattr__(self, "keys", keys)

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(sorted([*self.fixed, *([self.label] if self.label else [])]))

    def labels_of(self, value: str) -> dict[str, str]:
        return {**self.fixed, self.label: value} if self.label else dict(self.fixed)


class Counts(collections.Counter):
    """Counts by status key, of the counters in ``declared`` only: ``add`` raises KeyError for
    another counter or a label value its declaration does not list. Read it as a dict."""

    def __init__(self, declared: Iterable[Counter]):
        super().__init__()
        self.declared = frozenset(declared)

    def add(self, counter: Counter, value: int | float = 1, label: str = "") -> None:
        self[self.key_of(counter, label)] += value

    def copy(self) -> collections.Counter:
        """A snapshot of the counts as a plain Counter (nothing is counted through it)."""
        return collections.Counter(self)

    def value(self, counter: Counter, label: str = "") -> int | float:
        return self[self.key_of(counter, label)]

    def key_of(self, counter: Counter, label: str = "") -> str:
        if counter not in self.declared:
            raise KeyError(f"{counter!r} is not one of these counts' declarations")
        key = counter.keys.get(label)
        if key is None:
            raise KeyError(f"counter {counter.key!r}: {label!r} is not a declared value of {counter.label!r}")
        return key


# ---- an engine's connector (ENGINE_REPORT's report.connector.counters) ----------------------------
# Exported per session (labels engine, session, model) from the engine's last report. A key a
# report holds that no declaration here makes (an engine of another version) is shown in status,
# not exported.

# Why a request's acquire failed; a request that failed so fails its loads and skips its saves.
ACQUIRE_FAILURE_CAUSES = ("daemon_down", "daemon_unavailable", "match_refused", "no_reply", "send_failed")
REQUEST_FAILURES = (*ACQUIRE_FAILURE_CAUSES, "given_up", "closing")
LOAD_FAILURE_REASONS = (*REQUEST_FAILURES, "not_cached", "session_lost", "stale_generation", "transfer_failed",
                        "peer_changed", "request_finished", "unknown")
# Why a save's pages were not written; also an acquire reply's save_skipped (the daemon's choice;
# "unknown": one this side does not know).
SAVE_SKIP_REASONS = (*REQUEST_FAILURES, "saving_off", "beyond_lease", "no_space", "evicted_before_reuse",
                     "session_lost", "transfer_failed", "stale_generation", "gap", "commit_failed", "unknown")
LOOKUP_FAILURE_CAUSES = ("daemon_down", "unavailable", "refused", "no_reply")
REFUSED_KINDS = (*(kind.name.lower() for kind in MsgKind), "request")
LOAD_PATHS = ("whole", "whole_many_runs", "layered")
REQUESTS_OPEN = "requests_open"         # a gauge the report carries beside the counters

ENGINE_LOADED_PAGES = Counter("loaded_pages", "kvcached_engine_transfer_pages", "Pages an engine loaded (h2d) or "
                              "saved (d2h)", fixed={"direction": "h2d"})
ENGINE_SAVED_PAGES = Counter("saved_pages", "kvcached_engine_transfer_pages", "", fixed={"direction": "d2h"})
ENGINE_LOADS = Counter("loads", "kvcached_engine_loads", "Loads an engine asked for")
ENGINE_SAVES = Counter("saves", "kvcached_engine_saves", "Saves an engine asked for")
ENGINE_ACQUIRES = Counter("matches", "kvcached_engine_matches", "Acquires an engine's requests got a reply to")
ENGINE_LOOKUPS = Counter("lookups", "kvcached_engine_lookups", "Lookups an engine sent")
ENGINE_LOOKUPS_PREDICTED = Counter("lookups_predicted_recompute", "kvcached_engine_lookups_predicted", "Lookups an "
                                   "engine answered itself, from the published hints (recompute), sending an acquire "
                                   "without waiting for it")
ENGINE_LOOKUP_HIT_TOKENS = Counter("lookup_hit_tokens", "kvcached_engine_lookup_hit_tokens", "Tokens an engine's "
                                   "lookups found cached")
ENGINE_LOOKUP_CHOICES = Counter("lookup_choice_{}", "kvcached_engine_lookup_choices", "Decisions an engine's lookups "
                                "got, by choice", "choice", RESTORE_CHOICES)
ENGINE_PREDICTION_MISSES = Counter("prediction_misses", "kvcached_engine_prediction_misses", "Requests an engine "
                                   "admitted on a predicted recompute whose acquire chose a restore")
ENGINE_PROMOTED_TOKENS = Counter("promoted_tokens", "kvcached_engine_promoted_tokens", "Tokens promoted from L3 for "
                                 "an engine's acquires")
ENGINE_RESERVATION_SHORT_PAGES = Counter("reservation_short_pages", "kvcached_engine_reservation_short_pages", "Pages "
                                         "an engine's acquires wanted for saves and were not reserved")
ENGINE_COMMITTED_PAGES = Counter("committed_pages", "kvcached_engine_committed_pages", "Saved pages an engine "
                                 "committed")
ENGINE_SAVE_CACHED_PAGES = Counter("save_pages_cached", "kvcached_engine_save_cached_pages", "Pages a save found in "
                                   "L2 already (not written)")
ENGINE_SAVE_PAGES_AGAIN = Counter("save_pages_again", "kvcached_engine_save_again_pages", "Pages a save had queued "
                                  "already (not queued twice)")
ENGINE_QUEUED_PAGES = Counter("{}_pages_queued", "kvcached_engine_queued_pages", "Pages an engine queued to load or "
                              "save", "op", ("load", "save"))
ENGINE_LOAD_FAILED_PAGES = Counter("load_failed_pages_{}", "kvcached_engine_load_failed_pages", "Pages a load could "
                                   "not fill (the engine recomputes them), by reason", "reason", LOAD_FAILURE_REASONS)
ENGINE_SAVE_SKIPPED_PAGES = Counter("save_skipped_pages_{}", "kvcached_engine_save_skipped_pages", "Pages a save did "
                                    "not write, by reason", "reason", SAVE_SKIP_REASONS)
# Status only: the sums of the two above over their reasons.
ENGINE_LOAD_FAILED_PAGES_SUM = Counter("load_failed_pages", None, "kvcached_engine_load_failed_pages_total summed")
ENGINE_SAVE_SKIPPED_PAGES_SUM = Counter("save_skipped_pages", None, "kvcached_engine_save_skipped_pages_total summed")
ENGINE_ACQUIRE_FAILURES = Counter("match_failures_{}", "kvcached_engine_match_failures", "Acquires that failed, by "
                                  "reason", "reason", ACQUIRE_FAILURE_CAUSES)
ENGINE_LOOKUP_FAILURES = Counter("lookup_failures_{}", "kvcached_engine_lookup_failures", "Lookups that failed, by "
                                 "reason", "reason", LOOKUP_FAILURE_CAUSES)
ENGINE_REFUSALS = Counter("daemon_refusals_{}", "kvcached_engine_refusals", "Requests of an engine the daemon "
                          "refused, by the request's kind", "kind", REFUSED_KINDS)
ENGINE_LOAD_PATHS = Counter("load_path_{}", "kvcached_engine_load_paths", "Loads by how their copies ran: whole "
                            "(one launch), whole_many_runs (one launch, scattered pages), layered (by layer groups)",
                            "path", LOAD_PATHS)
ENGINE_PEER_PLANS = Counter("peer_plans", "kvcached_engine_peer_plans", "Loads an engine planned from another "
                            "engine's GPU cache")
ENGINE_PEER_QUEUED_PAGES = Counter("peer_load_pages_queued", "kvcached_engine_peer_queued_pages", "Pages queued to "
                                   "load from another engine's GPU cache")
ENGINE_PEER_LOADED_PAGES = Counter("peer_loaded_pages", "kvcached_engine_peer_loaded_pages", "Pages loaded from "
                                   "another engine's GPU cache (d2d)")
ENGINE_PEER_PUBLICATIONS = Counter("peer_publications", "kvcached_engine_peer_publications", "Lists of its GPU "
                                   "blocks an engine published to the daemon")
ENGINE_PEER_BLOCKS_PUBLISHED = Counter("peer_blocks_published", "kvcached_engine_peer_blocks_published", "GPU blocks "
                                       "those lists named")
ENGINE_PEER_CANDIDATES_SKIPPED = Counter("peer_candidates_{}", "kvcached_engine_peer_candidates_skipped", "Peer "
                                         "copies offered and not taken, by reason", "reason", ("not_open", "malformed"))
ENGINE_PEER_COPIES = Counter("peer_copies", "kvcached_engine_peer_copies", "Copies out of another engine's GPU cache")
ENGINE_PEER_PAGES = Counter("peer_pages_{}", "kvcached_engine_peer_pages", "Pages of those copies, by whether the "
                            "owner's block still held them after the copy", "outcome", ("verified", "changed"))
ENGINE_PEER_LISTS_TAKEN = Counter("peer_lists_taken", "kvcached_engine_peer_lists_taken", "Lists of other engines' "
                                  "registrations taken from the daemon")
ENGINE_PEERS_OPENED = Counter("peers_{}", "kvcached_engine_peers", "Other engines' GPU caches opened and closed for "
                              "copies", "how", ("opened", "closed"))

ENGINE: tuple[Counter, ...] = tuple(value for name, value in list(globals().items())
                                    if name.startswith("ENGINE_") and isinstance(value, Counter))
