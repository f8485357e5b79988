"""Where a restored request's time-to-first-token goes: a step-by-step timeline and a profile.

One model shape, one prefix length, the L2 tier (as ``bench_ttft`` forces it): the request is run
with every engine step, connector call and daemon round trip timestamped (the GPU synchronised at
each step's end, so a step's time is its own), then once more under cProfile. Prints both; writes
nothing.

    python -m bench.trace_restore --model qwen3-8b --tokens 350,3500
    python -m bench.trace_restore --quick
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import time

import torch

from bench.bench_ttft import BLOCK_SIZE, daemon_sizes, make_point, save_prefixes
from bench.common import gc_paused, profile_dir, profiled
from bench.engine import load_model
from bench.tiers import KVDaemon, attach_kvcached, detach_kvcached, run_request, settle
from kvcached.testing.tiers import TierControl


class Timeline:
    def __init__(self, device: torch.device):
        self.device = device
        self.events: list[tuple[float, str]] = []
        self.wrapped: list[tuple[object, str]] = []

    def mark(self, what: str) -> None:
        self.events.append((time.perf_counter(), what))

    def wrap(self, obj, name: str, label: str, sync: bool = False) -> None:
        inner = getattr(obj, name)

        def wrapped(*args, **kwargs):
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            if sync and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.events.append((started, f"{label} ({(time.perf_counter() - started) * 1e3:.3f} ms)"))
            return result

        setattr(obj, name, wrapped)
        self.wrapped.append((obj, name))

    def unwrap(self) -> None:
        for obj, name in self.wrapped:
            delattr(obj, name)          # the class's method again
        self.wrapped.clear()

    def print(self, since: float) -> None:
        for t, what in sorted(self.events):
            if t >= since:
                print(f"  {(t - since) * 1e3:9.3f} ms  {what}")


def trace(engine, point, control, timeline: Timeline, profile: bool, chrome: bool = False) -> None:
    prefix = point.prefixes[0]
    prompt = prefix + point.suffix()
    settle(engine, control)
    engine.reset_prefix_cache()
    control.force("l2", prefix, point.timed_loaded_tokens)
    timeline.events.clear()
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    with gc_paused(), profiled(f"restore_{point.model_name}_{point.num_tokens}") if chrome else contextlib.nullcontext():
        if profiler:
            profiler.enable()
        request = run_request(engine, prompt, 1)
        if profiler:
            profiler.disable()
    print(f"-- {point.model_name} {point.num_tokens} tokens: ttft {request.ttft_s * 1e3:.2f} ms, "
          f"loaded {request.num_loaded_tokens}, engine hit {request.num_cached_tokens}"
          f"{' (profiled)' if profile else ''}")
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(45)
        print(out.getvalue())
    else:
        timeline.print(started)
    settle(engine, control)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--tokens", default="350,3500")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--policy", default="always", choices=("always", "cost"),
                        help="the connector's restore policy (the L2 tier is forced either way)")
    parser.add_argument("--quick", action="store_true", help="the tiny shape on CPU")
    args = parser.parse_args()
    if args.quick:
        args.model, args.tokens = "tiny", "40,100"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(args.model, dtype=dtype, device=device, seed=args.seed)
    counts = [int(t) for t in args.tokens.split(",")]
    l2_bytes, l3_bytes = daemon_sizes(model, counts)
    with KVDaemon(l2_bytes, l3_bytes) as daemon:
        for num_tokens in counts:
            point = make_point(model, args.model, num_tokens, args.seed)
            engine = point.engine
            connector = attach_kvcached(engine, daemon.socket_path, model_id=args.model,
                                        model_revision=f"random-seed-{args.seed}", client_name="trace",
                                        policy=args.policy)
            control = TierControl(daemon, connector.geometry)
            try:
                save_prefixes(point, control)
                timeline = Timeline(device)
                timeline.wrap(engine, "step", "engine.step", sync=True)
                timeline.wrap(engine, "_run_prefill", "prefill", sync=True)
                for name in ("lookup", "lookup_async", "load", "poll", "finished", "save", "request_finished"):
                    timeline.wrap(connector, name, f"connector.{name}")
                timeline.wrap(connector.client, "acquire_async", "client.acquire_async")
                timeline.wrap(connector.transfer, "load", "transfer.load (queue)")
                timeline.wrap(connector.transfer, "_load_whole", "transfer.load, whole")
                timeline.wrap(engine.scheduler, "_allocate_for", "scheduler.admit (hashes, lookup, load)")
                for i in range(args.repeats):
                    trace(engine, point, control, timeline, profile=False)
                trace(engine, point, control, timeline, profile=True)
                if profile_dir() is not None:
                    trace(engine, point, control, timeline, profile=False, chrome=True)
                timeline.unwrap()
            finally:
                control.close()
                detach_kvcached(engine)
    print(f"block size {BLOCK_SIZE}")


if __name__ == "__main__":
    main()
