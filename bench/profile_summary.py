"""What the GPU did in Chrome traces written by ``bench.common.profiled``: per trace, each CUDA
stream's copies and kernels (count, busy time, first start and last end, from the trace's first
host event), the costliest kernels of the stream busiest with kernels, and for traces of decode batches the GPU
time of each step (36 paged-decode kernels of Qwen3-8B make one).

    KVCACHED_BENCH_PROFILE_DIR=/tmp/prof bash bench/gpu_run.sh trace,overlap
    python -m bench.profile_summary /tmp/prof/*.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def summarize(path: str, top: int, decode_layers: int) -> None:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    host = [e["ts"] for e in events if e.get("cat") in ("cpu_op", "cuda_runtime") and "ts" in e]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    if not gpu:
        print(f"== {os.path.basename(path)}: no GPU events")
        return
    t0 = min(host) if host else gpu[0]["ts"]
    streams = collections.defaultdict(list)
    for e in gpu:
        streams[e["args"].get("stream")].append(e)
    print(f"== {os.path.basename(path)} (ms from the first host event)")
    for stream, items in sorted(streams.items(), key=lambda kv: kv[1][0]["ts"]):
        for category in GPU_CATEGORIES:
            part = [e for e in items if e["cat"] == category]
            if part:
                print(f"  stream {stream:>3} {category:<10} {len(part):5d} x, busy {sum(e['dur'] for e in part) / 1e3:7.2f}"
                      f", {(part[0]['ts'] - t0) / 1e3:7.2f} .. {(part[-1]['ts'] + part[-1]['dur'] - t0) / 1e3:7.2f}")
    busiest = max(streams.values(), key=lambda items: sum(e["dur"] for e in items if e["cat"] == "kernel"))
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for e in busiest:
        if e["cat"] == "kernel":
            kernels[e["name"][:72]][0] += 1
            kernels[e["name"][:72]][1] += e["dur"]
    for name, (count, total) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {count:5d} x {total / count:8.1f} us = {total / 1e3:6.2f} ms  {name}")
    decode = [e for e in busiest if e["name"].startswith("_paged_decode")]
    if len(decode) >= 2 * decode_layers:
        steps = [decode[i:i + decode_layers] for i in range(0, len(decode) - decode_layers + 1, decode_layers)]
        for k, step in enumerate(steps):
            start, end = step[0]["ts"], step[-1]["ts"] + step[-1]["dur"]
            busy = sum(e["dur"] for e in busiest if start <= e["ts"] < end)
            attention = sum(e["dur"] for e in step)
            print(f"    decode step {k:2d} at {(start - t0) / 1e3:8.2f}: GPU busy {busy / 1e3:5.2f} ms "
                  f"(paged attention {attention / 1e3:5.2f}) over {(end - start) / 1e3:5.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--decode-layers", type=int, default=36)
    args = parser.parse_args()
    for path in args.traces:
        summarize(path, args.top, args.decode_layers)


if __name__ == "__main__":
    main()
