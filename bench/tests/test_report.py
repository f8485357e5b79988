"""docs/benchmarks.md is current with bench/results, and bench/results holds only result files."""

from __future__ import annotations

import os
import subprocess
import sys

from kvcached.testing.daemon_proc import child_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_benchmarks_md_is_generated_from_the_committed_results():
    """docs/benchmarks.md is what `python -m bench.report` makes of bench/results now: regenerating
    it gives the same text (the script is run as a user runs it)."""
    result = subprocess.run([sys.executable, "-m", "bench.report", "--check"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60, env=child_env())
    assert result.returncode == 0, f"{result.stderr}\n{result.stdout[-6000:]}"


def test_results_hold_one_json_file_per_benchmark_and_card():
    """bench/results/<card>/ holds only result files (JSON), no traces, run directories or other
    artifacts: one file per benchmark and card, its latest run, which docs/benchmarks.md shows."""
    results = os.path.join(REPO_ROOT, "bench", "results")
    strays = [os.path.join(card, name) for card in sorted(os.listdir(results))
              for name in sorted(os.listdir(os.path.join(results, card)))
              if not (name.endswith(".json") and os.path.isfile(os.path.join(results, card, name)))]
    assert not strays, f"not result files: {strays}"
