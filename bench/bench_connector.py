"""Load and save through the engine connector, against a raw pinned DMA of the same bytes, in one loop.

A seeded stream of requests (default 50) whose prefix lengths are drawn between 200 and 8,000
tokens, no length twice. For each geometry (Qwen3-8B, Qwen3-32B, an 80-layer 2-KV-head one with
16-token pages, and one of few bytes per token: 28 layers, 4 KV heads, 32-token pages; bf16) and
each L2 layout a daemon is started and one engine registers per-layer KV tensors
``[2, N, page, H, 128]`` (vLLM's GPU layout) with a ``KVConnector``. Each request takes
the reference engine's path: ``begin`` when it is admitted (its lookup, which is its match: the
decision, the lease on the hit, the reservation for its saves, in one round trip), then, once the
engine has its blocks, the load or the save. Per request, wall clock on the engine's thread:

    lookup_ms  begin(tokens) -> its reply taken (one round trip; an engine sends it anyway, to
               know what is cached; nothing more is sent for the load or the save)
    save       save(fresh tokens, source blocks) + request_finished -> poll() until its lease
               ended (gather, DMAs, completion seen, commit sent)
    load       load(same tokens, other blocks) -> finished() until its LoadResult (DMAs, scatter,
               completion seen); then request_finished
    seen_after_ms  (loads, on CUDA) the load's LoadResult taken minus the end of its copies (the
               load's last event), on the host's clock: an event recorded on the idle stream at the
               load's start maps the GPU's event times onto the host's (its own start, later than
               that host time by a launch, counts against the path: the figure errs high)

``ms_with_lookup`` is the two together. ``--via load`` times the other way an engine may take (a
lookup without a lease, then a load or save that sends the match itself): there ``ms`` includes
the acquire's round trip and ``lookup_ms`` is 0.

and right after each, in the same loop, a raw copy of the same byte count between a device buffer
and a cudaHostAlloc'd buffer (torch copy_ non_blocking, then synchronize): ``raw_dma_ms``.
``ratio`` = raw_dma_ms / ms (the path's bandwidth over the DMA's). Every load is checked bit for
bit against its source blocks (outside the timing). ``first_of_size``: the first request of its
page count in the run (nothing is built per size, so it should cost what the others do).

L2 layouts: ``contiguous`` (the daemon's L2 holds four of the largest prefixes; older ones are
evicted as the stream goes on: ``l2_runs`` says how many runs each request's pages made), and
``fragmented`` (every L2 page was first taken by a one-page lease and every other one given back,
so each page is a run of its own).

Targets (issue 11), at >= 1,000 tokens: median ratio >= 0.85 and worst >= 0.7 for every geometry
(contiguous); fragmented median >= 0.7.

Tier ``peer`` (``--tiers peer``, issue 16): engine A, a process of its own on the same GPU
(``bench.peer_owner``), holds KV tensors made from the same seed as this engine's (B's). Per request
(the stream, plus 3,500 and 8,000 tokens): B saves the prefix to L2 and loads it back from L2 into
other blocks (row tier ``l2``); then A caches the prefix in its blocks and publishes it, and B loads
it again, now copied out of A's GPU memory (row tier ``peer``: match, one block copy out of A's
tensors into B's, the epochs checked). Both are checked bit for bit. Per row, after the request's
lookup (``begin``, whose reply decided the tier: ``lookup_ms``), ``ms`` is the load through the
connector (queueing, the copies, their completion seen by a later poll) and ``transfer_ms`` the device time of the load's copies alone (CUDA events on the
load lane: ``LoadResult.transfer_s``); ``raw_copy_ms`` is one device-to-device copy of the same
bytes inside B, ``raw_dma_ms`` the pinned DMA. Target: the peer transfer (``transfer_ms``) of 3,500
Qwen3-8B tokens in <= 1 ms, and the peer load (``ms``) faster than the L2 load at every size.

    python -m bench.bench_connector                      # bench/results/<card>/connector.json
    python -m bench.bench_connector --tiers peer --name connector_peer     # the peer tier alone
    python -m bench.bench_connector --quick              # CPU smoke run: tiny geometries, no result file
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch

from bench.common import percentile, print_table, write_result
from bench.peer_owner import PeerOwner
from engine_client.client import connect
from engine_client.connector import ConnectorConfig, KVConnector
from kvcached.testing.daemon_proc import DaemonProcess

PAGE_SIZE = 16
HEAD_DIM = 128
GEOMETRIES = {                    # name -> (layers, KV heads per rank, tokens per page)
    "qwen3-8b": (36, 8, PAGE_SIZE),
    "qwen3-32b": (64, 8, PAGE_SIZE),
    "80-layer-2-kv-heads": (80, 2, PAGE_SIZE),
    "28-layer-4-kv-heads-page-32": (28, 4, 32),
}
QUICK_GEOMETRIES = {"quick-4-layers": (4, 2, PAGE_SIZE), "quick-12-layers-1-kv-head-page-32": (12, 1, 32)}
TARGETS = {"contiguous": {"median": 0.85, "worst": 0.7}, "fragmented": {"median": 0.7}}
ARENA_ALIGN_BYTES = 2 << 20
COLUMNS = ["geometry", "tier", "layout", "direction", "tokens", "lookup_ms", "ms", "raw_dma_ms", "ratio", "seen_after_ms",
           "first_of_size", "l2_runs"]
PEER_COLUMNS = ["geometry", "tier", "tokens", "lookup_ms", "ms", "transfer_ms", "raw_copy_ms", "raw_dma_ms", "speedup_vs_l2",
                "first_of_size"]
PEER_TARGET_TOKENS, PEER_TARGET_MS = 3500, 1.0
SEEN_AFTER_TARGET_MS = 0.3        # a load's completion seen within this of its copies' end (p90; issue 42)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RawDma:
    """The limit: one copy between a device buffer and a cudaHostAlloc'd pinned buffer."""

    def __init__(self, max_bytes: int, device: torch.device):
        self.device = device
        self.device_buffer = torch.empty(max_bytes, dtype=torch.uint8, device=device)
        self.host_buffer = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def ms(self, direction: str, num_bytes: int) -> float:
        device_part, host_part = self.device_buffer[:num_bytes], self.host_buffer[:num_bytes]
        synchronize(self.device)
        started = time.perf_counter()
        if direction == "load":
            device_part.copy_(host_part, non_blocking=True)
        else:
            host_part.copy_(device_part, non_blocking=True)
        synchronize(self.device)
        return (time.perf_counter() - started) * 1e3

    def device_copy_ms(self, num_bytes: int, destination: torch.Tensor) -> float:
        """One copy of num_bytes from device memory to device memory (the ceiling of a peer load)."""
        synchronize(self.device)
        started = time.perf_counter()
        destination[:num_bytes].copy_(self.device_buffer[:num_bytes], non_blocking=True)
        synchronize(self.device)
        return (time.perf_counter() - started) * 1e3


def fragment_l2(socket_path: str, geometry, rng: np.random.Generator, page_size: int):
    """Take every L2 page of the namespace with a one-page lease, give back every other one; the
    client returned holds the rest for the run."""
    client = connect(socket_path, timeout_s=60.0, client_name="fragmenter")
    client.attach(geometry)
    page_to_lease = {}
    while True:
        reply = client.acquire(rng.integers(1, 2**31 - 1, size=page_size, dtype=np.int32), save=True)
        if not reply.reserved_page_ids:
            break
        page_to_lease[reply.reserved_page_ids[0]] = reply.lease_id
    for page_id in sorted(page_to_lease)[::2]:
        client.release(page_to_lease[page_id])
    assert client.flush(timeout_s=60) == []
    return client


def num_runs(page_ids) -> int:
    page_ids = np.asarray(page_ids)
    return int(1 + np.count_nonzero(np.diff(page_ids) != 1)) if len(page_ids) else 0


def spin(done, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")


class CompletionClock:
    """When a load's copies ended, on the host's clock (``seen_after_ms`` in the module note): keeps
    the Transfer that the connector's ``transfer.load`` returns (the wrapper is the benchmark's,
    the connector calls it as it would the method), and an event on the idle stream at the start."""

    def __init__(self, connector: KVConnector, device: torch.device):
        self.device = device
        self.transfer = None
        self.reference = None
        queue = connector.transfer.load

        def load(*args, **kwargs):
            self.transfer = queue(*args, **kwargs)
            return self.transfer

        connector.transfer.load = load
        self._wrapped = connector.transfer

    def close(self) -> None:
        """Take the wrapper out (it holds the transfer, whose view of the pool must go before the pool closes)."""
        if self._wrapped is not None:
            del self._wrapped.load
            self._wrapped = self.transfer = None

    def start(self) -> float:
        """The host time of the load's start; the reference event recorded after it."""
        self.transfer = None
        self.reference = torch.cuda.Event(enable_timing=True) if self.device.type == "cuda" else None
        started = time.perf_counter()
        if self.reference is not None:
            self.reference.record()
        return started

    def times_ms(self, started: float, seen: float) -> dict[str, float]:
        """``seen_after_ms``: from the end of the load's copies (its last event) to ``seen``;
        ``copies_start_ms``: from ``started`` to the load lane's start; ``copies_ms``: from there
        to the copies' end ({} on CPU)."""
        transfer = self.transfer
        if self.reference is None or transfer is None or transfer.done_event is None:
            return {}
        done_ms = self.reference.elapsed_time(transfer.done_event)
        start_ms = self.reference.elapsed_time(transfer.start_event)
        return {"seen_after_ms": round((seen - started) * 1e3 - done_ms, 4), "copies_start_ms": round(start_ms, 4),
                "copies_ms": round(done_ms - start_ms, 4)}


def run_case(name: str, num_layers: int, num_kv_heads: int, page_size: int, layout: str, token_counts: list[int],
             args, device: torch.device) -> list[dict]:
    max_pages = max(token_counts) // page_size
    bytes_per_page = 2 * num_layers * page_size * num_kv_heads * HEAD_DIM * 2
    pool_pages = (8 if layout == "fragmented" else 4) * max_pages + 16
    l2_bytes = math.ceil(pool_pages * bytes_per_page / ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES + ARENA_ALIGN_BYTES
    daemon = DaemonProcess(l2_size=str(l2_bytes), extra_args=(
        "--max-namespaces", "1", "--l3-size", "0", "--log-level", "WARNING")).start(timeout_s=120)
    rows = []
    connector = holder = clock = None
    try:
        generator = torch.Generator(device=device).manual_seed(args.seed)
        num_blocks = 2 * max_pages + 8
        tensors = [torch.randint(-2**15, 2**15, (2, num_blocks, page_size, num_kv_heads, HEAD_DIM),
                                 generator=generator, dtype=torch.int16, device=device).view(torch.bfloat16)
                   for _ in range(num_layers)]
        config = ConnectorConfig(backend=args.backend, workspace_bytes=args.workspace_mib << 20, policy="always")
        connector = KVConnector.register(connect(daemon.socket_path, timeout_s=60.0, client_name="bench-connector"),
                                         tensors, "layer", model_id=name, page_size=page_size,
                                         num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, config=config)
        assert connector.layout.page_bytes == bytes_per_page
        rng = np.random.default_rng(args.seed)
        if layout == "fragmented":
            holder = fragment_l2(daemon.socket_path, connector.geometry, rng, page_size)
        raw = RawDma(max_pages * bytes_per_page, device)
        clock = CompletionClock(connector, device)
        seen_pages: set[int] = set()
        for index, num_tokens in enumerate(token_counts):
            num_pages = num_tokens // page_size
            first_of_size = num_pages not in seen_pages
            seen_pages.add(num_pages)
            tokens = rng.integers(1, 2**31 - 1, size=num_tokens, dtype=np.int32)
            source = np.arange(num_pages)
            destination = np.arange(max_pages, max_pages + num_pages)
            num_bytes = num_pages * bytes_per_page
            request = f"r{index}"

            synchronize(device)
            committed = connector.stats().get("committed_pages", 0)
            save_lookup_ms = begin(connector, f"s{index}", tokens, 0, args.via)
            started = time.perf_counter()
            connector.save(f"s{index}", tokens, source)
            connector.request_finished(f"s{index}")
            spin(lambda: connector.poll() or not connector.num_open_requests, "the save")
            save_ms = (time.perf_counter() - started) * 1e3
            raw_save_ms = raw.ms("save", num_bytes)
            if connector.stats().get("committed_pages", 0) - committed != num_pages:
                raise AssertionError(f"the save of {num_pages} pages was not all committed: {connector.stats()}")

            synchronize(device)
            loads = []
            load_lookup_ms = begin(connector, request, tokens, num_pages * page_size, args.via)
            started = clock.start()
            connector.load(request, tokens, destination, num_pages * page_size)
            spin(lambda: loads.extend(connector.finished().loads) or loads, "the load")
            seen = time.perf_counter()
            load_ms = (seen - started) * 1e3
            load_times = clock.times_ms(started, seen)
            l2_runs = num_runs(connector.leased_pages(request)[:num_pages])
            raw_load_ms = raw.ms("load", num_bytes)
            connector.request_finished(request)
            if not loads[0].ok:
                raise AssertionError(f"load failed: {loads[0].reason}")
            for tensor in tensors:
                if not torch.equal(tensor[:, destination].view(torch.int16), tensor[:, source].view(torch.int16)):
                    raise AssertionError(f"{name} {layout} {num_tokens} tokens: a loaded block differs (seed {args.seed})")
            for direction, ms, raw_ms, lookup_ms in (("save", save_ms, raw_save_ms, save_lookup_ms),
                                                     ("load", load_ms, raw_load_ms, load_lookup_ms)):
                rows.append({"geometry": name, "tier": "l2", "direction": direction, "layout": layout, "tokens": num_tokens,
                             "ms": round(ms, 4), "raw_dma_ms": round(raw_ms, 4), "ratio": round(raw_ms / ms, 4),
                             "lookup_ms": round(lookup_ms, 4), "ms_with_lookup": round(ms + lookup_ms, 4),
                             "first_of_size": first_of_size, "pages": num_pages, "l2_runs": l2_runs})
            rows[-1].update(load_times)
        spin(lambda: connector.poll() or not connector.num_open_requests, "the last lease to end")
        with connect(daemon.socket_path) as client:
            status = client.status(check_integrity=True)
        if status["integrity"] != "ok":
            raise AssertionError(f"daemon integrity: {status['integrity']}")
        stats = connector.stats()
        skipped = {k: v for k, v in stats.items() if k.startswith(("save_skipped", "load_failed"))}
        if skipped:
            raise AssertionError(f"pages skipped or failed: {skipped}")
        rows.append({"geometry": name, "layout": layout, "direction": "report",
                     "transfer": connector.transfer.report(), "counters": stats})
    finally:
        if clock is not None:
            clock.close()
        if connector is not None:
            connector.close()
        if holder is not None:
            holder.close()
        daemon.cleanup()
    return rows


def begin(connector: KVConnector, request, tokens, expect_tokens: int, via: str) -> float:
    """The request's lookup as the reference engine sends it (``begin``: its match), waited for:
    ms from the call to its reply taken. The daemon must decide to restore expect_tokens (policy
    always: all that L2 holds). 0 with via 'load' (the load or save sends the match)."""
    if via == "load":
        return 0.0
    started = time.perf_counter()
    lookup = connector.begin(request, tokens)
    spin(lookup.ready, "the lookup's reply")
    ms = (time.perf_counter() - started) * 1e3
    decision = lookup.decision(0)
    if decision.restore_tokens != expect_tokens:
        raise AssertionError(f"{request}: the lookup decided {decision} where L2 holds {expect_tokens} tokens")
    return ms


def save_and_wait(connector: KVConnector, request, tokens, blocks) -> None:
    connector.save(request, tokens, blocks)
    connector.request_finished(request)
    spin(lambda: connector.poll() or not connector.is_open(request), "the save")


def timed_load(connector: KVConnector, request, tokens, blocks, device: torch.device,
               via: str, page_size: int) -> tuple[float, float, object]:
    """The request's lookup (``begin``, as in ``run_case``), then ms from load() to its
    LoadResult (the request then ended, untimed): (lookup ms, load ms, the LoadResult)."""
    synchronize(device)
    lookup_ms = begin(connector, request, tokens, len(blocks) * page_size, via)
    loads = []
    started = time.perf_counter()
    connector.load(request, tokens, blocks, len(blocks) * page_size)
    spin(lambda: loads.extend(connector.finished().loads) or loads, "the load")
    ms = (time.perf_counter() - started) * 1e3
    connector.request_finished(request)
    spin(lambda: connector.poll() or not connector.is_open(request), "the load's request to end")
    return lookup_ms, ms, loads[0]


def run_peer_case(name: str, num_layers: int, num_kv_heads: int, page_size: int, token_counts: list[int], args,
                  device: torch.device) -> list[dict]:
    """Tier peer against L2 for each request, in one loop (see the module note)."""
    max_pages = max(token_counts) // page_size
    bytes_per_page = 2 * num_layers * page_size * num_kv_heads * HEAD_DIM * 2
    l2_bytes = math.ceil((4 * max_pages + 16) * bytes_per_page / ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES + ARENA_ALIGN_BYTES
    daemon = DaemonProcess(l2_size=str(l2_bytes), extra_args=(
        "--max-namespaces", "1", "--l3-size", "0", "--log-level", "WARNING")).start(timeout_s=120)
    rows = []
    owner = connector = None
    try:
        num_blocks = 2 * max_pages + 8
        # A first: B's registration then lists it, and opens it in the background.
        owner = PeerOwner("tensors", daemon.socket_path, model=name, seed=args.seed, blocks=num_blocks,
                          page_size=page_size, layers=num_layers, kv_heads=num_kv_heads, head_dim=HEAD_DIM)
        generator = torch.Generator(device=device).manual_seed(args.seed)       # the tensors A made
        tensors = [torch.randint(-2**15, 2**15, (2, num_blocks, page_size, num_kv_heads, HEAD_DIM),
                                 generator=generator, dtype=torch.int16, device=device).view(torch.bfloat16)
                   for _ in range(num_layers)]
        config = ConnectorConfig(backend=args.backend, workspace_bytes=args.workspace_mib << 20, peer=True,
                                 policy="always")
        connector = KVConnector.register(connect(daemon.socket_path, timeout_s=60.0, client_name="bench-peer"),
                                         tensors, "layer", model_id=name, page_size=page_size,
                                         num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, config=config)
        if connector.peer is None:
            raise RuntimeError("peer restores could not be registered (see the log)")
        spin(lambda: connector.poll() or connector.stats().get("peers_opened", 0), "engine A to be opened")
        rng = np.random.default_rng([args.seed, 16])
        raw = RawDma(max_pages * bytes_per_page, device)
        copy_target = torch.empty(max_pages * bytes_per_page, dtype=torch.uint8, device=device)
        seen_pages: set[int] = set()
        for index, num_tokens in enumerate(token_counts):
            num_pages = num_tokens // page_size
            first_of_size = num_pages not in seen_pages
            seen_pages.add(num_pages)
            tokens = rng.integers(1, 2**31 - 1, size=num_tokens, dtype=np.int32)
            source = np.arange(num_pages)
            destination = np.arange(max_pages, max_pages + num_pages)
            num_bytes = num_pages * bytes_per_page
            save_and_wait(connector, f"s{index}", tokens, source)
            timings = {}
            for tier in ("l2", "peer"):
                if tier == "peer":
                    owner.fill(tokens)
                before = connector.stats().get("peer_loaded_pages", 0)
                lookup_ms, ms, result = timed_load(connector, f"{tier}{index}", tokens, destination, device,
                                                   args.via, page_size)
                peer_pages = connector.stats().get("peer_loaded_pages", 0) - before
                if not result.ok or peer_pages != (num_pages if tier == "peer" else 0):
                    raise AssertionError(f"{name} {tier} {num_tokens} tokens: {result}, {peer_pages} pages from the "
                                         f"peer: {connector.stats()}")
                for tensor in tensors:
                    if not torch.equal(tensor[:, destination].view(torch.int16), tensor[:, source].view(torch.int16)):
                        raise AssertionError(f"{name} {tier} {num_tokens} tokens: a loaded block differs (seed {args.seed})")
                timings[tier] = ms
                rows.append({"geometry": name, "tier": tier, "layout": "contiguous", "direction": "load",
                             "tokens": num_tokens, "pages": num_pages, "lookup_ms": round(lookup_ms, 4),
                             "ms": round(ms, 4), "ms_with_lookup": round(ms + lookup_ms, 4),
                             "transfer_ms": round(result.transfer_s * 1e3, 4),
                             "raw_copy_ms": round(raw.device_copy_ms(num_bytes, copy_target), 4),
                             "raw_dma_ms": round(raw.ms("load", num_bytes), 4), "first_of_size": first_of_size})
            rows[-1]["speedup_vs_l2"] = round(timings["l2"] / timings["peer"], 3)
        stats = connector.stats()
        rows.append({"geometry": name, "tier": "peer", "direction": "report", "counters": stats,
                     "transfer": connector.transfer.report()})
    finally:
        if connector is not None:
            connector.close()
        if owner is not None:
            owner.close()
        daemon.cleanup()
    return rows


def summarize_peer(rows: list[dict]) -> list[dict]:
    summary = []
    for geometry in sorted({r["geometry"] for r in rows if r.get("tier") == "peer" and "ms" in r}):
        peer = [r for r in rows if r["geometry"] == geometry and r.get("tier") == "peer" and "ms" in r]
        at_target = [r for r in peer if r["tokens"] == PEER_TARGET_TOKENS]
        summary.append({"geometry": geometry, "requests": len(peer),
                        "peer_ms_at_3500": at_target[0]["ms"] if at_target else None,
                        "peer_transfer_ms_at_3500": at_target[0]["transfer_ms"] if at_target else None,
                        "median_speedup_vs_l2": round(statistics.median(r["speedup_vs_l2"] for r in peer), 3),
                        "worst_speedup_vs_l2": min(r["speedup_vs_l2"] for r in peer),
                        "meets_target": bool(at_target) and at_target[0]["transfer_ms"] <= PEER_TARGET_MS
                        and min(r["speedup_vs_l2"] for r in peer) > 1.0})
    return summary


def summarize(rows: list[dict], min_tokens: int) -> list[dict]:
    summary = []
    for key in sorted({(r["geometry"], r["layout"], r["direction"]) for r in rows if "ratio" in r}):
        ratios = [r["ratio"] for r in rows if "ratio" in r
                  and (r["geometry"], r["layout"], r["direction"]) == key and r["tokens"] >= min_tokens]
        if not ratios:
            continue
        target = TARGETS[key[1]]
        median, worst = statistics.median(ratios), min(ratios)
        summary.append({"geometry": key[0], "layout": key[1], "direction": key[2], "requests": len(ratios),
                        "median_ratio": round(median, 4), "worst_ratio": round(worst, 4),
                        "meets_target": median >= target["median"] and worst >= target.get("worst", 0.0)})
        seen_after = [r["seen_after_ms"] for r in rows if "seen_after_ms" in r
                      and (r["geometry"], r["layout"], r["direction"]) == key and r["tokens"] >= min_tokens]
        if seen_after:
            summary[-1].update(seen_after_ms_median=round(statistics.median(seen_after), 4),
                               seen_after_ms_p90=round(percentile(seen_after, 90), 4),
                               seen_after_meets_target=percentile(seen_after, 90) <= SEEN_AFTER_TARGET_MS)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--min-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8000)
    parser.add_argument("--geometries", default=",".join(GEOMETRIES))
    parser.add_argument("--layouts", default="contiguous,fragmented")
    parser.add_argument("--tiers", default="l2", help="of l2 (save and load through L2, per layout) and peer "
                        "(a load out of another engine's GPU memory against L2's, in one loop)")
    parser.add_argument("--via", choices=("begin", "load"), default="begin",
                        help="begin: the lookup is the match (the reference engine's path); load: the load or "
                             "save sends the match (an engine whose scheduler only looks up)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--workspace-mib", type=int, default=256, help="packed device buffer per direction")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run: two tiny geometries, 6 requests of 200-1000 tokens, no result file")
    parser.add_argument("--name", default=None, help="result file (bench/results/<machine>/<name>.json); "
                                                     "default connector, none with --quick")
    parser.add_argument("--machine", default=None)
    args = parser.parse_args()
    geometries = GEOMETRIES
    if args.quick:
        geometries = QUICK_GEOMETRIES
        args.requests, args.max_tokens = min(args.requests, 6), min(args.max_tokens, 1000)
        args.workspace_mib = min(args.workspace_mib, 1)
    else:
        geometries = {name: GEOMETRIES[name] for name in args.geometries.split(",")}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng = np.random.default_rng(args.seed)
    token_counts = rng.choice(np.arange(args.min_tokens, args.max_tokens + 1), size=args.requests,
                              replace=False).tolist()
    tiers = args.tiers.split(",")
    if set(tiers) - {"l2", "peer"}:
        raise SystemExit(f"--tiers: unknown {sorted(set(tiers) - {'l2', 'peer'})}")
    peer_token_counts = token_counts + [n for n in (PEER_TARGET_TOKENS, 8000) if n <= args.max_tokens
                                        and n not in token_counts]
    if args.quick:
        peer_token_counts = token_counts
    rows: list[dict] = []
    started = time.monotonic()
    name = args.name or (None if args.quick else "connector")
    summary_tokens = 1000 if not args.quick else args.min_tokens      # the targets hold at >= 1,000 tokens

    def write(complete: bool) -> str:
        """The result file with the rows so far (after every case: a run cut short keeps them)."""
        return write_result(name, {
            "device": str(device), "seed": args.seed, "token_counts": token_counts,
            "head_dim": HEAD_DIM, "dtype": "bfloat16", "kv_layout": "layer [2, N, page, H, 128] per layer", "via": args.via,
            "geometries": {n: {"layers": g[0], "kv_heads": g[1], "page_size": g[2]} for n, g in geometries.items()},
            "complete": complete, "targets": TARGETS, "seen_after_target_ms": SEEN_AFTER_TARGET_MS,
            "summary_min_tokens": summary_tokens,
            "summary": summarize(rows, summary_tokens), "tiers": tiers,
            "peer_target": {"tokens": PEER_TARGET_TOKENS, "transfer_ms": PEER_TARGET_MS, "faster_than_l2": True},
            "peer_summary": summarize_peer(rows), "rows": rows,
        }, machine=args.machine)

    for geometry, (num_layers, num_kv_heads, page_size) in geometries.items():
        if "l2" in tiers:
            for layout in args.layouts.split(","):
                rows += run_case(geometry, num_layers, num_kv_heads, page_size, layout, token_counts, args, device)
                print(f"{geometry} l2 {layout}: done, {time.monotonic() - started:.0f} s", flush=True)
                if name:
                    write(False)
        if "peer" in tiers:
            rows += run_peer_case(geometry, num_layers, num_kv_heads, page_size, peer_token_counts, args, device)
            print(f"{geometry} peer: done, {time.monotonic() - started:.0f} s", flush=True)
            if name:
                write(False)
    if "l2" in tiers:
        print_table([r for r in rows if "ratio" in r], COLUMNS)
    if "peer" in tiers:
        print_table([r for r in rows if "raw_copy_ms" in r], PEER_COLUMNS)
    summary = summarize(rows, summary_tokens)
    if summary:
        print_table(summary, ["geometry", "layout", "direction", "requests", "median_ratio", "worst_ratio",
                              "meets_target", "seen_after_ms_median", "seen_after_ms_p90"])
    peer_summary = summarize_peer(rows)
    if peer_summary:
        print_table(peer_summary, ["geometry", "requests", "peer_ms_at_3500", "peer_transfer_ms_at_3500",
                                   "median_speedup_vs_l2", "worst_speedup_vs_l2", "meets_target"])
    if name:
        print(f"wrote {write(True)}")

if __name__ == "__main__":
    main()
