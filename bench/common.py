"""Shared by the benchmarks: percentiles, a result table, and JSON results with provenance."""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
from typing import Any, Iterator, Sequence

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def machine_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            for short in ("H200", "H100"):
                if short in name:
                    return short.lower()
            return name.lower().replace(" ", "-")
    except ImportError:
        pass
    return "cpu-" + platform.node().split(".")[0]


def versions() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for module in ("torch", "triton", "zmq", "msgpack", "uvloop", "numpy"):
        try:
            imported = __import__(module)
            info[module] = getattr(imported, "__version__", "?")
        except ImportError:
            info[module] = None
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    info["cpu_count"] = os.cpu_count()
    return info


def print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).rjust(widths[c]) for c in columns))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def git_commit() -> str | None:
    """The commit the code ran at, "+dirty" when the work tree (but for bench/results) differs from it. Outside a git
    checkout, or in a copy of the tree on another machine, $KVCACHED_BENCH_COMMIT names it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.environ.get("KVCACHED_BENCH_COMMIT"):
        return os.environ["KVCACHED_BENCH_COMMIT"]
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        # Result files written by earlier runs of the same tree are not a change of the code.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)bench/results"], cwd=root,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def write_result(name: str, payload: dict[str, Any], machine: str | None = None) -> str:
    machine = machine or machine_name()
    directory = os.path.join(RESULTS_DIR, machine)
    os.makedirs(directory, exist_ok=True)
    document = {
        "benchmark": name,
        "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "versions": versions(),
        **payload,
    }
    path = os.path.join(directory, f"{name}.json")
    with open(path, "w") as f:
        json.dump(document, f, indent=1, sort_keys=False)
        f.write("\n")
    return path


def exit_on_sigterm() -> None:
    """SIGTERM (a time limit's ``timeout``) raises SystemExit in the main thread, so that the
    benchmark's ``finally`` blocks stop the daemons it started and remove their files."""
    import signal

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside a timed region (a full collection of a large heap takes ms);
    what it would have collected is collected after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def profile_dir() -> str | None:
    """Where ``profiled`` writes its traces ($KVCACHED_BENCH_PROFILE_DIR), or None: it does not."""
    return os.environ.get("KVCACHED_BENCH_PROFILE_DIR") or None


@contextlib.contextmanager
def profiled(name: str) -> Iterator[None]:
    """With $KVCACHED_BENCH_PROFILE_DIR set: run the block under torch.profiler (host and CUDA) and
    write its Chrome trace to that directory as NAME.json (a later run of the same name replaces
    it). Otherwise nothing. For finding where time goes, not for timing: the profiler slows the host."""
    directory = profile_dir()
    if directory is None:
        yield
        return
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(directory, exist_ok=True)
    with torch.profiler.profile(activities=activities, with_stack=False) as profile:
        yield
    profile.export_chrome_trace(os.path.join(directory, f"{name}.json"))
