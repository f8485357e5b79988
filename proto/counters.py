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

    def value(self, counter: Counter, label: str = "") -> int | float:
        return self[self.key_of(counter, label)]

    def key_of(self, counter: Counter, label: str = "") -> str:
        if counter not in self.declared:
            raise KeyError(f"{counter!r} is not one of these counts' declarations")
        key = counter.keys.get(label)
        if key is None:
            raise KeyError(f"counter {counter.key!r}: {label!r} is not a declared value of {counter.label!r}")
        return key
