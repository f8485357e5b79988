"""Acquire round trip, measured from another process, against plain ZeroMQ + msgpack.

The daemon holds 10,000 prefixes in its tree; the client acquires a 64-token and an 8,192-token
prefix (both cached, so each acquire also creates a lease that is released without waiting, as an
engine does). The baseline, in the same run: a plain synchronous ZeroMQ ROUTER server in another
process that decodes the same msgpack request and answers with a reply of the same shape.

Rows are the defaults (daemon and client busy-poll briefly before sleeping). Variants: both
sides sleeping at once (spin 0), and an idle gap before each request, as between an engine's
GPU waits, where a sleeping process must be woken (the baseline gets the same gap).

    python -m bench.bench_rpc [--iterations 5000] [--prefixes 10000]
    python -m bench.bench_rpc --gap-ms 12 --name rpc_gap12     # the gap of a batch-1 request in bench_stress
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time

import msgpack
import numpy as np
import zmq

from bench.common import percentile, print_table, write_result
from engine_client.client import DEFAULT_SPIN_S, connect
from kvcached.config import DaemonConfig
from proto.messages import KVGeometry, MsgKind
from proto.tokens import token_bytes
from kvcached.testing.daemon_proc import DaemonProcess

# Tiny pages so that 10,000 prefixes fit in a modest pool; the wire cost does not depend on them.
GEOMETRY = KVGeometry("rpc-bench", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", page_size=16)
LOAD_PREFIX_TOKENS = 128
DEFAULT_DAEMON_SPIN_US = DaemonConfig.__dataclass_fields__["socket_spin_us"].default


def plain_server(socket_path: str, ready) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.bind(f"ipc://{socket_path}")
    ready.set()
    while True:
        identity, payload = socket.recv_multipart()
        kind, request_id, body = msgpack.unpackb(payload, raw=False)
        if kind == 0:
            break
        num_pages = len(body["token_ids"]) // 64
        reply = {"hit_tokens": {"l2": num_pages * 16, "l3": num_pages * 16}, "lease_id": 1,
                 "host_page_ids": list(range(num_pages)), "reserved_start_token": 0, "reserved_page_ids": [],
                 "promoted_tokens": 0}
        socket.send_multipart([identity, msgpack.packb([int(MsgKind.REPLY), request_id, reply], use_bin_type=True)])
    socket.close(0)
    context.term()


def time_plain(token_bytes: bytes, iterations: int, warmup: int, gap_s: float) -> list[float]:
    path = os.path.join(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"), "plain.sock")
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=plain_server, args=(path, ready), daemon=True)
    server.start()
    ready.wait(10)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(f"ipc://{path}")
    samples = []
    for i in range(warmup + iterations):
        if gap_s:
            time.sleep(gap_s)
        started = time.perf_counter()
        socket.send(msgpack.packb([int(MsgKind.ACQUIRE), i + 1, {"session_id": 1, "token_ids": token_bytes,
                                                                 "save": False}], use_bin_type=True))
        msgpack.unpackb(socket.recv(), raw=False)
        if i >= warmup:
            samples.append((time.perf_counter() - started) * 1e6)
    socket.send(msgpack.packb([0, 0, {}]))
    server.join(10)
    socket.close(0)
    context.term()
    return samples


def time_kvcached(client, tokens: np.ndarray, iterations: int, warmup: int, gap_s: float) -> list[float]:
    samples = []
    for i in range(warmup + iterations):
        if gap_s:
            time.sleep(gap_s)
        started = time.perf_counter()
        reply = client.acquire(tokens)
        elapsed = time.perf_counter() - started
        assert reply.hit_tokens["l2"] == len(tokens), reply.hit_tokens
        client.release(reply.lease_id)      # off the critical path, as in an engine
        if i >= warmup:
            samples.append(elapsed * 1e6)
    assert client.flush() == []
    return samples


def loaded_daemon(num_prefixes: int, daemon_spin_us: int, client_spin_s: float):
    daemon = DaemonProcess(l2_size="256MiB", extra_args=(
        "--max-namespaces", "1", "--log-level", "WARNING", "--spin-us", str(daemon_spin_us))).start()
    client = connect(daemon.socket_path, timeout_s=10.0, client_name="bench-rpc", spin_s=client_spin_s)
    client.attach(GEOMETRY)
    rng = np.random.default_rng(0)
    for _ in range(num_prefixes):
        tokens = rng.integers(0, 150_000, size=LOAD_PREFIX_TOKENS, dtype=np.int32)
        reply = client.acquire(tokens, save=True)
        client.commit(reply.lease_id, reply.reserved_page_ids)
    targets = {n: rng.integers(0, 150_000, size=n, dtype=np.int32) for n in (64, 8192)}
    for tokens in targets.values():
        reply = client.acquire(tokens, save=True)
        client.commit(reply.lease_id, reply.reserved_page_ids)
    assert client.flush(timeout_s=60) == []
    while client.status()["pending"]["h2s"]:
        time.sleep(0.05)
    status = client.status(check_integrity=True)
    assert status["integrity"] == "ok", status["integrity"]
    return daemon, client, targets, status["namespaces"][0]["tree_nodes"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--gap-iterations", type=int, default=1000)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument("--prefixes", type=int, default=10_000)
    parser.add_argument("--machine", default=None)
    parser.add_argument("--name", default="rpc", help="result file (bench/results/<machine>/<name>.json)")
    args = parser.parse_args()

    configs = [("default", DEFAULT_DAEMON_SPIN_US, DEFAULT_SPIN_S), ("no_spin", 0, 0.0)]
    rows, variants, raw = [], [], {}
    nodes = heartbeat_p50 = None
    baseline_cache: dict[tuple[int, float], list[float]] = {}
    for name, daemon_spin_us, client_spin_s in configs:
        daemon, client, targets, nodes = loaded_daemon(args.prefixes, daemon_spin_us, client_spin_s)
        try:
            for gap_ms in (0.0, args.gap_ms):
                iterations = args.iterations if gap_ms == 0 else args.gap_iterations
                warmup = args.warmup if gap_ms == 0 else 20
                for num_tokens, tokens in targets.items():
                    ours = time_kvcached(client, tokens, iterations, warmup, gap_ms / 1e3)
                    key = (num_tokens, gap_ms)
                    if key not in baseline_cache:
                        baseline_cache[key] = time_plain(token_bytes(tokens), iterations, warmup,
                                                         gap_ms / 1e3)
                    plain = baseline_cache[key]
                    row = {"tokens": num_tokens, "p50_us": percentile(ours, 50), "p99_us": percentile(ours, 99),
                           "baseline_p50_us": percentile(plain, 50), "baseline_p99_us": percentile(plain, 99)}
                    row["ratio_p50"] = row["p50_us"] / row["baseline_p50_us"]
                    variant = {"config": name, "daemon_spin_us": daemon_spin_us,
                               "client_spin_us": client_spin_s * 1e6, "gap_ms": gap_ms, **row}
                    variants.append(variant)
                    if name == "default" and gap_ms == 0:
                        rows.append(row)
                    raw[f"{name}/gap{gap_ms}/{num_tokens}"] = {"kvcached_us": ours, "baseline_us": plain}
            if name == "default":
                session = {"session_id": client.info.session_id}
                heartbeat = []
                for i in range(args.warmup + args.iterations):
                    started = time.perf_counter()
                    client.request_raw(MsgKind.HEARTBEAT, session)
                    if i >= args.warmup:
                        heartbeat.append((time.perf_counter() - started) * 1e6)
                heartbeat_p50 = percentile(heartbeat, 50)
            assert client.status(check_integrity=True)["integrity"] == "ok"
            client.close()
        finally:
            daemon.stop()
            daemon.cleanup()

    print(f"{args.prefixes} prefixes in the tree ({nodes} nodes)")
    print_table(variants, ["config", "gap_ms", "tokens", "p50_us", "p99_us", "baseline_p50_us", "baseline_p99_us",
                           "ratio_p50"])
    print(f"heartbeat round trip p50 {heartbeat_p50:.1f} us (default config)")
    path = write_result(args.name, {
        "target": "p50_us <= 1.5 * baseline_p50_us (rows: default config, no idle gap)",
        "prefixes_in_tree": args.prefixes, "tree_nodes": nodes, "iterations": args.iterations,
        "rows": rows, "variants": variants, "heartbeat_p50_us": heartbeat_p50, "raw_samples_us": raw,
    }, machine=args.machine)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
