"""Counters are declared once (the daemon's in kvcached/core/counters.py, an engine's in
proto/counters.py) and counted only through a declaration: checked over the product's source, so a
typo on a path no test runs fails here too."""

from __future__ import annotations

import ast
import pathlib

from kvcached.core import counters
from proto import counters as engine_counters
from kvcached.server import metrics
from proto.counters import Counter

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("kvcached", "proto", "engine_client")
PRODUCT = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
# Calls that count or read a declared counter, and the position of their label argument.
COUNTING_CALLS = {"add": 2, "observe": 2, "count": 2, "value": 1, "key_of": 1}
COUNTED_ON = ("metrics", "counters", "remote", "self")     # receivers: state.metrics.add(...), self.count(...)


def _last_name(expr: ast.expr) -> str:
    return expr.attr if isinstance(expr, ast.Attribute) else expr.id if isinstance(expr, ast.Name) else ""


def _problems(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    problems = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Subscript) and \
                _last_name(node.target.value) in ("counters", "metrics"):
            problems.append(f"{where}: counts by key, not through a declaration")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in COUNTING_CALLS and node.args):
            continue
        first = node.args[0]
        if not (isinstance(first, ast.Attribute) and _last_name(first.value) == "counters"):
            if isinstance(first, (ast.Constant, ast.JoinedStr)) and _last_name(node.func.value) in COUNTED_ON:
                problems.append(f"{where}: counts {ast.unparse(first)}, not a declared counter")
            continue
        # ``counters`` is kvcached.core.counters in the daemon, proto.counters in engine_client and proto.
        declarations = counters if path.relative_to(root).parts[0] == "kvcached" else engine_counters
        counter = getattr(declarations, first.attr, None)
        if not isinstance(counter, Counter):
            problems.append(f"{where}: counters.{first.attr} is not declared")
            continue
        label_at = COUNTING_CALLS[node.func.attr]
        if len(node.args) > label_at and isinstance(node.args[label_at], ast.Constant) \
                and node.args[label_at].value not in counter.keys:
            problems.append(f"{where}: {node.args[label_at].value!r} is not a declared value of counters.{first.attr}")
    return problems


def test_the_product_counts_only_through_declared_counters_and_values():
    """Every call that counts (``metrics.add``, ``observe``, the remote client's ``count``, a
    cost model's or a connector's ``counters.add``) names a declared counter, with a label value
    it lists where the value is written out; none passes a name as a string or an f-string, and
    none increments a counters dict by key."""
    problems = [problem for path in PRODUCT for problem in _problems(path)]
    assert problems == []
    assert len([path for path in PRODUCT if "counters." in path.read_text()]) >= 5, "the scan found no counting"


def test_the_scan_catches_a_typo_a_string_and_an_undeclared_value(tmp_path):
    """The scan above flags what it must: an undeclared counter name, a counter named by an
    f-string, a label value the declaration does not list, and an increment by key, in the
    daemon and in an engine's connector."""
    (tmp_path / "kvcached").mkdir()
    (tmp_path / "engine_client").mkdir()
    daemon, engine = tmp_path / "kvcached" / "bad.py", tmp_path / "engine_client" / "bad.py"
    daemon.write_text('self.metrics.add(counters.HIT_TOKEN, 1, "l2")\n'
                      'self.metrics.add(f"hit_tokens_{tier}")\n'
                      'self.metrics.add(counters.HIT_TOKENS, 1, "l4")\n'
                      'self.metrics.add(counters.HIT_TOKENS, 1, "l3")\n'
                      'self.cost.counters["stale_line_resets_total"] += 1\n')
    engine.write_text('self.counters.add(counters.HIT_TOKENS, 1, "l2")\n'
                      'self.counters.add(counters.ENGINE_SAVE_SKIPPED_PAGES, 3, "no_room")\n'
                      'self.counters.add(counters.ENGINE_LOADS)\n'
                      'self.counters["loads"] += 1\n')
    assert sorted(int(line.split(":")[1]) for line in _problems(daemon, tmp_path)) == [1, 2, 3, 5]
    assert sorted(int(line.split(":")[1]) for line in _problems(engine, tmp_path)) == [1, 2, 4]


def test_declarations_are_consistent():
    """Within each group every status key is made by one declaration only; the declarations of a
    family share its label names and kind, and exactly one of them carries its help."""
    for group in (counters.DAEMON, counters.HISTOGRAMS, counters.REMOTE, counters.COST_MODEL, engine_counters.ENGINE):
        keys = [key for counter in group for key in counter.keys.values()]
        assert len(keys) == len(set(keys))
    families: dict[str, list[Counter]] = {}
    every = counters.DAEMON + counters.HISTOGRAMS + counters.REMOTE + counters.COST_MODEL + engine_counters.ENGINE
    for counter in every:
        if counter.metric is not None:
            families.setdefault(counter.metric, []).append(counter)
    for metric, declared in families.items():
        assert len({(c.label_names, c.histogram, c.per_model) for c in declared}) == 1, metric
        assert len([c for c in declared if c.help]) == 1, metric
        assert metric.startswith("kvcached_") and not metric.endswith("_total"), metric


def test_docs_list_every_declared_counter():
    """docs/metrics.md's table of declared counters is the one the declarations make now."""
    text = (ROOT / metrics.DOCS_PATH).read_text()
    begin, end = text.index(metrics.DOCS_BEGIN), text.index(metrics.DOCS_END) + len(metrics.DOCS_END)
    assert text[begin:end] == metrics.docs_table(), "run: python -m kvcached.server.metrics --write-docs"
