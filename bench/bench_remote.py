"""The remote tier (issue 43) on one machine as several hosts: a real mooncake_master, daemon A
lending the store its memory (where every value lands), daemon B lending none (every restore
crosses TCP from A's segment), in a network namespace of loopback only.

Measured, for the same prefixes in the same run (throughputs: their bytes over the total time; the
ratios also as the median of each prefix's pair, taken back to back, which a shared machine's load
swings disturb least):
  - restore throughput: B's restore of a prefix it never saw (a match: the store's answer to
    "which pages", the gets into L2 pages, the checks; ``prepare`` less its L2 -> L1 copy), and
    the R2H move alone (the daemon's gets and checks, its r2h line's samples);
  - the store's own get throughput: a bare client of the store (``batch_get_into_multi_buffers``
    of the same values: header and page, into registered memory) in this process;
  - lookups' added latency: lookups of prompts nobody saved, on B (it asks the store) against a
    daemon without the remote tier.

    python -m bench.bench_remote [--prefixes 21] [--pages 64] [--lookups 200] [--no-write]

Writes bench/results/cpu/remote.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

ISOLATED_ENV = "KVCACHED_BENCH_ISOLATED"
DESTINATION_REGIONS = 8


def geometry():
    from proto.messages import KVGeometry

    # 512 KiB pages (16 tokens of an 8-layer, 8-KV-head, 128-dim bf16 model).
    return KVGeometry("remote-bench", num_layers=8, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)


def fill_random_(manager, page_ids, generator: torch.Generator) -> None:
    for page_id in page_ids:
        view = manager.l1_pool.kv[:, :, page_id]
        view.copy_((torch.randn(view.shape, generator=generator) + 0.5).to(view.dtype))


def store_get_seconds(store, keys: list[str], bytes_per_page: int, buffer: np.ndarray) -> float:
    from kvcached.core.remote import HEADER_BYTES

    base = buffer.ctypes.data
    headers = base + len(keys) * bytes_per_page
    pointers = [[headers + i * HEADER_BYTES, base + i * bytes_per_page] for i in range(len(keys))]
    sizes = [[HEADER_BYTES, bytes_per_page]] * len(keys)
    started = time.perf_counter()
    got = store.batch_get_into_multi_buffers(keys, pointers, sizes)
    seconds = time.perf_counter() - started
    assert all(size == HEADER_BYTES + bytes_per_page for size in got), got[:4]
    return seconds


def run(args) -> dict:
    from engine_client.cache_manager import CacheManager
    from engine_client.client import connect
    from engine_client.connector import PrefixLookup
    from kvcached.core.l3_index import namespace_key
    from kvcached.core.remote import HEADER_BYTES, remote_key
    from kvcached.server.remote_store import mooncake_store
    from proto.page_keys import chain_page_keys
    from kvcached.testing.daemon_proc import PATIENT_DAEMON, DaemonProcess
    from kvcached.testing.remote.cluster import MASTER_PORT, METADATA_PORT, PATIENT_REMOTE, Master, connected, remote_daemon, \
        status, wait_for, writes_done

    geo = geometry()
    page_tokens = geo.page_size
    num_tokens = args.pages * page_tokens
    master = Master(client_ttl_s=10).start()
    lender_bytes = max(256 << 20, 2 * args.prefixes * args.pages * (geo.bytes_per_page + HEADER_BYTES))
    a = remote_daemon(segment=str(lender_bytes), extra_args=("--restore-policy", "always", "--l2-size", "512MiB"))
    b = remote_daemon(segment="0", extra_args=("--restore-policy", "always", "--l2-size", "512MiB"),
                      deadlines=PATIENT_REMOTE)
    local = DaemonProcess(extra_args=("--http", "off", *PATIENT_DAEMON))
    daemons = [a, b, local]
    try:
        for daemon in daemons:
            daemon.start()
        for daemon in (a, b):
            wait_for(daemon, connected, "connected to the store")
        rng = np.random.default_rng(43)
        generator = torch.Generator().manual_seed(43)
        prompts = [rng.integers(0, 150_000, size=num_tokens, dtype=np.int32) for _ in range(args.prefixes)]
        with connect(a.socket_path, timeout_s=30.0, client_name="bench-remote-a") as client:
            saver = CacheManager.attach(client, geo, num_l1_pages=args.pages + 1)
            try:
                for tokens in prompts:
                    plan = saver.prepare(tokens)
                    fill_random_(saver, plan.new_l1_page_ids, generator)
                    saver.finish(plan)
                assert saver.client.flush() == []
            finally:
                saver.close()
        wait_for(a, lambda s: writes_done(s) and s["metrics"].get("remote_pages_written", 0)
                 >= args.prefixes * args.pages, "write-through", timeout_s=120.0)

        # The store's own gets, from a bare client in this process (lending nothing: every byte
        # crosses from A's segment, as B's do).
        store = mooncake_store()
        assert store.setup("127.0.0.1", f"http://127.0.0.1:{METADATA_PORT}/metadata", 0, 16 << 20, "tcp", "",
                           f"127.0.0.1:{MASTER_PORT}") == 0
        # A ring of destinations, as B's restores land in other L2 pages each time: no reader gets
        # into memory a cache still holds from its last get.
        region_bytes = args.pages * (geo.bytes_per_page + HEADER_BYTES)
        buffer = np.ones(DESTINATION_REGIONS * region_bytes, dtype=np.uint8)
        assert store.register_buffer(buffer.ctypes.data, buffer.nbytes) == 0
        prefix_bytes = args.pages * geo.bytes_per_page

        results = []
        with connect(b.socket_path, timeout_s=30.0, client_name="bench-remote-b") as client:
            reader = CacheManager.attach(client, geo, num_l1_pages=args.pages + 1)
            ns_key = namespace_key(reader.connector.geometry)
            try:
                for i, tokens in enumerate(prompts):
                    keys = [remote_key(ns_key, k) for k in chain_page_keys(tokens, page_tokens, args.pages)]
                    before = status(b)["metrics"]
                    store_first = i % 2 == 0          # alternate which goes first
                    store_s = store_get_seconds(store, keys, geo.bytes_per_page, buffer[(i % DESTINATION_REGIONS) * region_bytes:]) if store_first else None
                    started = time.perf_counter()
                    plan = reader.prepare(tokens, save=False)
                    prepare_s = time.perf_counter() - started
                    if not store_first:
                        store_s = store_get_seconds(store, keys, geo.bytes_per_page, buffer[(i % DESTINATION_REGIONS) * region_bytes:])
                    restored = plan.restored_tokens
                    reader.finish(plan)
                    after = status(b)
                    r2h_sum_s = after["histograms"].get("r2h_end_to_end_seconds", {}).get("sum", 0.0)
                    gets_s = r2h_sum_s - (results[-1]["r2h_sum_s"] if results else 0.0)
                    match_s = prepare_s - plan.restore_seconds
                    store_sum_s = after["daemon"]["remote"]["counters"].get("remote_get_store_seconds", 0.0)
                    results.append({"daemon_store_s": store_sum_s - (results[-1]["daemon_store_sum_s"] if results else 0.0),
                                    "daemon_store_sum_s": store_sum_s,"restored_tokens": restored, "bytes": prefix_bytes, "store_get_s": store_s,
                                    "match_s": match_s, "r2h_s": gets_s, "r2h_sum_s": r2h_sum_s,
                                    "l2_to_l1_s": plan.restore_seconds,
                                    "hit_pages": after["metrics"].get("remote_hit_pages", 0)
                                    - before.get("remote_hit_pages", 0)})
                lookups = PrefixLookup(reader.client, tp_group=False, policy="always")
                remote_lookup_s = []
                for _ in range(args.lookups):
                    tokens = rng.integers(0, 150_000, size=num_tokens, dtype=np.int32)
                    started = time.perf_counter()
                    lookups.lookup_async(tokens).decision(10.0)
                    remote_lookup_s.append(time.perf_counter() - started)
                b_status = status(b)
            finally:
                reader.close()
        with connect(local.socket_path, timeout_s=30.0, client_name="bench-local") as client:
            plain = CacheManager.attach(client, geo, num_l1_pages=2)
            try:
                lookups = PrefixLookup(plain.client, tp_group=False, policy="always")
                local_lookup_s = []
                for _ in range(args.lookups):
                    tokens = rng.integers(0, 150_000, size=num_tokens, dtype=np.int32)
                    started = time.perf_counter()
                    lookups.lookup_async(tokens).decision(10.0)
                    local_lookup_s.append(time.perf_counter() - started)
            finally:
                plain.close()
        store.close()
    finally:
        for daemon in daemons:
            daemon.cleanup()
        master.cleanup()

    # The first prefix warms both readers up (their first connections to A's transport): not counted.
    complete = [r for r in results[1:] if r["restored_tokens"] == num_tokens]
    gib = 2**30
    total_bytes = sum(r["bytes"] for r in complete)

    def gibps(key: str) -> float:       # the same bytes over the total time each way took
        return total_bytes / sum(r[key] for r in complete) / gib

    counters = b_status["daemon"]["remote"]["counters"]
    summary = {
        "prefixes": args.prefixes, "prefix_bytes": args.pages * geo.bytes_per_page, "page_bytes": geo.bytes_per_page,
        "restored_complete": len(complete),
        "store_get_gibps": gibps("store_get_s"),
        "restore_match_gibps": gibps("match_s"),
        "restore_r2h_gibps": gibps("r2h_s"),
        "ratio_match_to_store": gibps("match_s") / gibps("store_get_s"),
        "ratio_r2h_to_store": gibps("r2h_s") / gibps("store_get_s"),
        "ratio_match_to_store_median": statistics.median(r["store_get_s"] / r["match_s"] for r in complete),
        "ratio_r2h_to_store_median": statistics.median(r["store_get_s"] / r["r2h_s"] for r in complete),
        "lookup_remote_ms_median": 1e3 * statistics.median(remote_lookup_s),
        "lookup_local_ms_median": 1e3 * statistics.median(local_lookup_s),
        "lookup_added_ms_median": 1e3 * (statistics.median(remote_lookup_s) - statistics.median(local_lookup_s)),
        "lookup_remote_ms_p99": 1e3 * float(np.percentile(remote_lookup_s, 99)),
        "lookup_local_ms_p99": 1e3 * float(np.percentile(local_lookup_s, 99)),
        # Where the time goes (counted prefixes): the daemon's own store calls, its whole R2H moves,
        # the bare client's store calls.
        "daemon_store_call_s": sum(r["daemon_store_s"] for r in complete),
        "daemon_r2h_s": sum(r["r2h_s"] for r in complete),
        "bench_store_get_s": sum(r["store_get_s"] for r in complete),
        # The R2H move less its store calls (the checks, the hand-offs between threads), and the
        # match less its R2H move (the question "which pages", the round trip, the match itself).
        "daemon_r2h_outside_store_calls_s": sum(r["r2h_s"] - r["daemon_store_s"] for r in complete),
        "match_outside_r2h_s": sum(r["match_s"] - r["r2h_s"] for r in complete),
        "exist_call_ms_mean": 1e3 * counters.get("remote_exist_seconds", 0) / max(1, counters.get("remote_exist_calls", 1)),
        "goal_ratio": 0.8,
    }
    return {"summary": summary, "per_prefix": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", type=int, default=21, help="the first one warms up, not counted")
    parser.add_argument("--pages", type=int, default=64, help="pages per prefix (512 KiB each)")
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if os.environ.get(ISOLATED_ENV) != "1":
        # Into a network namespace of loopback only (some of the store's listeners bind 0.0.0.0).
        from kvcached.testing.remote.cluster import STORE_ENV, _isolating, missing

        why = missing()
        if why:
            print(f"cannot run: {why}", file=sys.stderr)
            return 1
        env = {**os.environ, **STORE_ENV, ISOLATED_ENV: "1"}
        return subprocess.run(_isolating([sys.executable, "-m", "bench.bench_remote", *sys.argv[1:]]),
                              env=env).returncode
    load_before = os.getloadavg()
    result = run(args)
    result["summary"]["load_average_1m_before_after"] = [load_before[0], os.getloadavg()[0]]
    print(json.dumps(result["summary"], indent=1))
    if not args.no_write:
        from bench.common import write_result

        print(write_result("remote", {"config": vars(args), "machine_note": "one machine, daemons as hosts over "
                                      "loopback TCP in a network namespace", **result}, machine="cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
