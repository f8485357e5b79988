"""What publishing KV events costs a lookup: two daemons, one with --kv-events (a subscriber
reading every message) and one without, under the same load, in alternating rounds.

The daemons take turns iteration by iteration. Each iteration commits a new random prefix (its pages stored in L2, older ones evicted once L2 is
full: events of both kinds), then times one lookup of a cached prefix from another process's point
of view (the client's round trip), and the daemon's CPU time per iteration. With events on, the
daemon's socket thread hashes and sends the commit's and evictions' events a slice at a time
between requests.

    python -m bench.bench_kv_events [--rounds 6] [--iterations 300]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import multiprocessing
import time

import numpy as np
import zmq

from bench.common import exit_on_sigterm, median, percentile, print_table, write_result
from engine_client.client import connect
from kvcached.testing.daemon_proc import DaemonProcess, commit_written
from proto.messages import KVGeometry

GEOMETRY = KVGeometry("events-bench", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", page_size=16)
LOOKUP_PAGES = 128           # a 2,048-token prompt
COMMIT_PAGES = 64            # each iteration's new prefix: 64 pages stored, as many evicted once L2 is full
L2_SIZE = "8MiB"             # 1,024 pages of 8 KiB


def subscribe(endpoint: str, received, stop) -> None:
    """A router of its own (another process, as routers are): reads every message the daemon
    publishes until ``stop`` is set; ``received`` counts them."""
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.connect(endpoint)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    while not stop.is_set():
        if socket.poll(100):
            socket.recv_multipart()
            with received.get_lock():
                received.value += 1
    socket.close(0)


def cpu_seconds(pid: int) -> float:
    """The process's user and system CPU time so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_iteration(client, rng, lookup_tokens: np.ndarray) -> float:
    """Commit a new prefix (not waited for), then time a lookup of the cached one."""
    tokens = rng.integers(0, 150_000, size=COMMIT_PAGES * GEOMETRY.page_size, dtype=np.int32)
    commit_written(client, client.acquire(tokens, save=True))
    started = time.perf_counter()
    reply = client.lookup_async(lookup_tokens).result()
    elapsed = time.perf_counter() - started
    assert reply.hit_tokens["l2"] == len(lookup_tokens), reply.hit_tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    exit_on_sigterm()
    rng = np.random.default_rng(args.seed)
    directory = tempfile.mkdtemp(prefix="kvb-ev-", dir="/tmp")
    endpoint = f"ipc://{directory}/events"
    daemons = {"off": DaemonProcess(l2_size=L2_SIZE, extra_args=("--l3-size", "0")),
               "on": DaemonProcess(l2_size=L2_SIZE, extra_args=("--l3-size", "0", "--kv-events", endpoint))}
    subscriber = None
    clients = {}
    try:
        for daemon in daemons.values():
            daemon.start()
        received, stop = multiprocessing.Value("q", 0), multiprocessing.Event()
        subscriber = multiprocessing.Process(target=subscribe, args=(endpoint, received, stop), daemon=True)
        subscriber.start()
        lookup_tokens = rng.integers(0, 150_000, size=LOOKUP_PAGES * GEOMETRY.page_size, dtype=np.int32)
        for name, daemon in daemons.items():
            client = clients[name] = connect(daemon.socket_path, timeout_s=10.0)
            client.attach(GEOMETRY)
            commit_written(client, client.acquire(lookup_tokens, save=True))
            # A match that hits it makes it reused: eviction takes the never-reused new prefixes first.
            client.release(client.acquire(lookup_tokens).lease_id)
            assert client.flush() == []
        samples: dict[str, list[float]] = {name: [] for name in daemons}
        daemon_cpu_s = dict.fromkeys(daemons, 0.0)
        load_before = os.getloadavg()[0]
        for round_index in range(args.rounds):
            cpu_before = {name: cpu_seconds(daemon.proc.pid) for name, daemon in daemons.items()}
            for iteration in range(args.iterations):
                # The two daemons alternate iteration by iteration (and which goes first): a change
                # of the machine's load hits both alike.
                order = ("off", "on") if (round_index + iteration) % 2 == 0 else ("on", "off")
                for name in order:
                    samples[name].append(one_iteration(clients[name], rng, lookup_tokens))
            for client in clients.values():
                assert client.flush() == []
            time.sleep(0.2)         # the events of the round's last iterations are sent
            for name, daemon in daemons.items():
                daemon_cpu_s[name] += cpu_seconds(daemon.proc.pid) - cpu_before[name]
        load_after = os.getloadavg()[0]
        time.sleep(0.5)
        status = clients["on"].status()["daemon"]["kv_events"]
        rows = [{"events": name, "lookups": len(s), "median_us": median(s) * 1e6,
                 "p90_us": percentile(s, 90) * 1e6, "p99_us": percentile(s, 99) * 1e6} for name, s in samples.items()]
        print_table(rows, ["events", "lookups", "median_us", "p90_us", "p99_us"])
        off, on = (samples[name] for name in ("off", "on"))
        summary = {
            "lookup_us_median_off": median(off) * 1e6, "lookup_us_median_on": median(on) * 1e6,
            "median_ratio_on_to_off": median(on) / median(off),
            "lookup_us_p99_off": percentile(off, 99) * 1e6, "lookup_us_p99_on": percentile(on, 99) * 1e6,
            "p99_ratio_on_to_off": percentile(on, 99) / percentile(off, 99),
            "daemon_cpu_us_per_iteration_off": daemon_cpu_s["off"] / len(off) * 1e6,
            "daemon_cpu_us_per_iteration_on": daemon_cpu_s["on"] / len(on) * 1e6,
            "messages_published": status["messages"], "events_published": status["events"],
            "events_lost": status["lost_events"], "messages_received": received.value,
            "load_average_1m_before_after": [load_before, load_after],
        }
        print(summary)
        path = write_result("kv_events", {
            "config": {"rounds": args.rounds, "iterations": args.iterations, "lookup_pages": LOOKUP_PAGES,
                       "commit_pages": COMMIT_PAGES, "l2_size": L2_SIZE, "page_size": GEOMETRY.page_size,
                       "seed": args.seed},
            "summary": summary, "rows": rows}, machine="cpu")
        print(f"wrote {path}")
    finally:
        for client in clients.values():
            client.close()
        if subscriber is not None:
            stop.set()
            subscriber.join(5)
        for daemon in daemons.values():
            daemon.cleanup()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
