"""Write docs/benchmarks.md from the result files under bench/results/<card>/: one section per file
(each file is the latest run of its benchmark on that card), a table of its key figures, and the
commit, date and command it came from.

    python -m bench.report            # rewrite docs/benchmarks.md
    python -m bench.report --check    # exit 1, with a diff, where docs/benchmarks.md is not current

The output depends on the result files only (no clock, no git call), so regenerating it from the
committed files gives the committed text. A benchmark without a table of its own here gets its
``summary`` (targets, or key/value pairs) rendered generically.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from collections import defaultdict
from typing import Any, Callable, Iterable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "bench", "results")
OUTPUT = os.path.join(REPO_ROOT, "docs", "benchmarks.md")

Table = tuple[list[str], list[list[Any]]]


def fmt(value: Any) -> str:
    """A cell: floats to 4 significant digits, lists joined, None as a dash, pipes escaped."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {fmt(v)}" for k, v in value.items())
    return str(value).replace("|", "\\|").replace("\n", " ")


def span(values: Iterable[float]) -> str:
    """min-max of a group's values (one value: itself)."""
    values = sorted(values)
    return fmt(values[0]) if values[0] == values[-1] else f"{fmt(values[0])}-{fmt(values[-1])}"


def markdown(table: Table) -> list[str]:
    header, rows = table
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]
    return lines


def targets(result: dict) -> Table | None:
    """The ``summary`` as targets (a list of {target, value, met}) or as key/value pairs."""
    summary = result.get("summary")
    if isinstance(summary, list) and summary and all(isinstance(s, dict) and "target" in s for s in summary):
        return ["target", "value", "met"], [[s["target"], s.get("value"), s.get("met")] for s in summary]
    if isinstance(summary, dict) and summary:
        return ["figure", "value"], [[key, value] for key, value in summary.items()]
    return None


def ttft(result: dict) -> list[Table]:
    rows = [[r["model"], r["tokens"], r["tier"], r.get("ttft_ms"), r.get("recompute_ms"), r.get("speedup")]
            for r in result["rows"] if r.get("tier") != "none"]
    return [(["model", "tokens", "source", "TTFT ms", "recompute ms", "speed-up"], rows)]


def policy(result: dict) -> list[Table]:
    rows = [[r["model"], r["tokens"], r["tier"], r.get("cost_ms"), r.get("restore_ms"), r.get("recompute_ms"),
             r.get("choice"), r.get("within_5pct")] for r in result["rows"]]
    return [(["model", "tokens", "source", "cost ms", "restore ms", "recompute ms", "choice", "within 5%"], rows)]


def connector(result: dict) -> list[Table]:
    tables = [(["geometry", "L2", "direction", "median / raw DMA", "worst / raw DMA", "target met"],
               [[s["geometry"], s["layout"], s["direction"], s["median_ratio"], s["worst_ratio"], s["meets_target"]]
                for s in result.get("summary", [])])]
    seen = [s for s in result.get("summary", []) if "seen_after_ms_median" in s]
    if seen:
        tables.append((["geometry", "L2", "load seen after its copies' end: median ms", "p90 ms"],
                       [[s["geometry"], s["layout"], s["seen_after_ms_median"], s["seen_after_ms_p90"]] for s in seen]))
    if result.get("peer_summary"):
        tables.append((["geometry", "peer ms at 3,500 tokens", "of it GPU transfer ms", "median speed-up over L2",
                        "worst speed-up over L2"],
                       [[s["geometry"], s["peer_ms_at_3500"], s["peer_transfer_ms_at_3500"],
                         s["median_speedup_vs_l2"], s["worst_speedup_vs_l2"]] for s in result["peer_summary"]]))
    return tables


def stress(result: dict) -> list[Table]:
    """Rows of one configuration in several rounds: the range over the rounds."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in result["rows"]:
        groups[(row.get("model"), row.get("engines"), row.get("batch"), row.get("tier"), row.get("policy"),
                row.get("predict"))].append(row)
    rows = []
    for (model, engines, batch, tier, policy_name, predict), members in groups.items():
        rows.append([model, engines, batch, tier, policy_name, predict, len(members),
                     span(m["req_per_s"] for m in members), span(m["speedup"] for m in members),
                     span(m["ttft_p50_ms"] for m in members),
                     sum(m.get("mismatches_beyond_noise", m.get("mismatches")) or 0 for m in members)])
    return [(["model", "engines", "batch", "source", "policy", "hints", "rounds", "req/s", "speed-up",
              "TTFT p50 ms", "mismatches"], rows)]


def overlap(result: dict) -> list[Table]:
    rows = [[r["case"], r["tier"], r.get("hidden_fraction"), r.get("decode_step_inflation"), r.get("ttft_ms"),
             r.get("load_ms")] for r in result["rows"]]
    return [(["case", "source", "hidden under decode", "decode step inflation", "TTFT ms", "load ms"], rows)]


def rpc(result: dict) -> list[Table]:
    rows = [[v["config"], v["gap_ms"], v["tokens"], v["p50_us"], v["p99_us"], v["baseline_p50_us"], v["ratio_p50"]]
            for v in result.get("variants") or result["rows"]]
    return [(["config", "gap ms", "tokens", "p50 us", "p99 us", "plain ZeroMQ p50 us", "p50 / plain"], rows)]


def pin(result: dict) -> list[Table]:
    rows = [[r["size_gib"], r["method"], r.get("attach_s"), r.get("pin_s"), r.get("unpin_s")] for r in result["rows"]]
    return [(["GiB", "method", "attach s", "pin s", "unpin s"], rows)]


def drills(result: dict) -> list[Table]:
    """Each row keeps the commit it was measured at (``drills.py --merge`` re-runs some)."""
    rows = [[r["drill"], r["pass"], r.get("measured"), (r.get("git_commit") or "")[:7]] for r in result["rows"]]
    return [(["drill", "passed", "measured", "commit"], rows)]


def vllm(result: dict) -> list[Table]:
    skip = {"benchmark", "command", "date", "git_commit", "versions", "steps", "summary"}
    rows = [[key, value] for key, value in result.items() if key not in skip and not isinstance(value, (dict, list))]
    tables = [(["figure", "value"], rows)]
    real = result.get("real_weights")
    if real:
        tables.append((["prompt tokens", "cached in", "decisions", "TTFT kvcached (s)", "TTFT plain vLLM (s)",
                        "kvcached / faster", "restore overhead per round (s)"],
                       [[p["size"], p["tier"], p["decisions"], p["cost_ttft_s_median"], p["recompute_ttft_s_median"],
                         p["cost_over_faster"], p["restore_overhead_s"]] for p in real["points"]]))
    shared = result.get("shared_prompts")
    if shared:
        tables.append((["two instances sharing system prompts", "wall per run (s)", "TTFT median (s)"],
                       [[mode, shared[f"{mode}_wall_s"], shared[f"{mode}_ttft_s_median"]]
                        for mode in ("kvcached", "plain")] + [["wall speed-up", shared["wall_speedup"], None]]))
    return tables


# Tables per benchmark (the result file's "benchmark" field); each also gets its targets, if any.
TABLES: dict[str, Callable[[dict], list[Table]]] = {
    "ttft": ttft, "remote_ttft": ttft, "policy": policy, "connector": connector, "stress": stress, "stress_engines": stress,
    "overlap": overlap, "rpc": rpc, "rpc_gap12": rpc, "pin": pin, "drills": drills, "vllm": vllm,
}


def section(card: str, name: str, result: dict) -> list[str]:
    commit = result.get("git_commit")
    commit = f"`{commit.split('+')[0][:7]}`" + (" (uncommitted changes)" if "+dirty" in commit else "") \
        if commit else "not recorded"
    device = (result.get("versions") or {}).get("gpu") or card
    lines = [f"### {name} ({card})", "",
             f"`bench/results/{card}/{name}.json`: {device}, commit {commit}, {result.get('date', 'date not recorded')}; "
             f"`{result.get('command', '')}`.", ""]
    benchmark = result.get("benchmark", name)
    tables = TABLES[benchmark](result) if benchmark in TABLES else []
    goal = targets(result)
    if goal is not None and benchmark not in ("vllm",):
        tables.append(goal)
    if not tables:
        lines += ["(no summary in this file)", ""]
    for table in tables:
        lines += markdown(table) + [""]
    return lines


def render(results_dir: str = RESULTS_DIR) -> str:
    lines = ["# Benchmarks", "",
             "Generated by `python -m bench.report` from the result files under `bench/results/<card>/`, one per",
             "benchmark and card (its latest run); do not edit by hand. Each file holds the run's command, date,",
             "commit, versions and raw samples; `bench/README.md` says how to run them. Compare figures within",
             "one file: runs on different machines, even of one kind, differ.", ""]
    for card in sorted(os.listdir(results_dir)):
        card_dir = os.path.join(results_dir, card)
        if not os.path.isdir(card_dir):
            continue
        lines += [f"## {card}", ""]
        for file_name in sorted(os.listdir(card_dir)):
            if file_name.endswith(".json"):
                with open(os.path.join(card_dir, file_name)) as f:
                    lines += section(card, file_name[:-len(".json")], json.load(f))
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/benchmarks.md instead of writing it")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = open(OUTPUT).read() if os.path.exists(OUTPUT) else ""
        if current == text:
            return 0
        sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                   "docs/benchmarks.md", "python -m bench.report"))
        print("docs/benchmarks.md is not current: run python -m bench.report", file=sys.stderr)
        return 1
    with open(OUTPUT, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
