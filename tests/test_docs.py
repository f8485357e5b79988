"""The docs a newcomer reads hold what they promise: the README's engine example runs as printed
against a real daemon and restores the prompt bit for bit, the README and docs/architecture.md stay
within the lengths that keep them readable. That docs/benchmarks.md is current with bench/results:
bench/tests/test_report.py."""

from __future__ import annotations

import os
import subprocess
import sys

from kvcached.testing.daemon_proc import DaemonProcess, child_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO_ROOT, "README.md")
ARCHITECTURE = os.path.join(REPO_ROOT, "docs", "architecture.md")
MAX_README_LINES = 150
MAX_ARCHITECTURE_LINES = 300


def readme_engine_example() -> str:
    """The first ```python block of the README's "An engine on kvcached" section."""
    with open(README) as f:
        readme = f.read()
    section = readme[readme.index("## An engine on kvcached"):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```", start)]


def test_readme_engine_example_restores_the_prompt_bit_for_bit():
    """The README's engine example, run unchanged against a real `kvcached serve` (its own
    asserts: the load fills every block and the restored blocks equal the saved ones), takes the
    restore path: the daemon's decision for the saved prompt is to restore all of it."""
    example = readme_engine_example()
    daemon = DaemonProcess().start()
    try:
        check = example + "\nassert n == len(prompt), f'the daemon decided to restore {n} of {len(prompt)} tokens'\n"
        result = subprocess.run([sys.executable, "-c", check], cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=90, env={**child_env(), "KVCACHED_SOCKET": daemon.socket_path})
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\ndaemon log:\n{daemon.log()}"
    finally:
        daemon.cleanup()


def test_readme_and_architecture_within_their_lengths():
    """The README fits in 150 lines and docs/architecture.md in 300."""
    with open(README) as f:
        readme_lines = len(f.read().splitlines())
    with open(ARCHITECTURE) as f:
        architecture_lines = len(f.read().splitlines())
    assert readme_lines <= MAX_README_LINES, f"README.md has {readme_lines} lines"
    assert architecture_lines <= MAX_ARCHITECTURE_LINES, f"docs/architecture.md has {architecture_lines} lines"
