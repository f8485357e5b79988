"""Backup (D2H) and restore (H2D) of a prefix through the whole kvcached path, against raw pinned DMA.

Qwen3-8B geometry (36 layers, 8 KV heads, head dim 128, bf16), 16-token pages, prefixes of 350 to
8,000 tokens (whole pages: a 350-token prefix backs up 21 pages). For every prefix size and L2
layout a real daemon is started, and an engine (client + L1 pool + pinned L2 mapping + transfer
engine, backend auto) attaches to it. Timed from the engine's side, wall clock:

    D2H  match(reserve_backup) sent -> gather queued (start_backup) -> reply -> DMAs queued
         (send_to) -> wait -> commit
    H2D  match sent -> restore made ready (start_restore: ids, workspace) -> reply (lease on the
         hit) -> DMAs and scatters queued (receive_from) -> wait -> release

(--mode serial: match, then backup() or restore(), which does all of it after the reply.)

--mode reserved (the default) needs no round trip before either transfer's device work:

    D2H  pages taken from the engine's standing reservation (ReservedPages) -> gathers and DMAs
         queued (backup(): slice by slice, interleaved) -> top-up of the reservation asked for
         while the DMA runs, when pages run low (RESERVE_PAGES, reply taken in later) -> wait
         -> commit of the pages as the prefix's (COMMIT_PAGES, one way)
    H2D  restore queued from the L2 hint of the engine's own backup (L2Hints; restore(): the DMAs
         first, then the scatters) -> match sent -> reply: confirms the hint (same pages, same
         epochs) or the restore is redone from the pages it names (confirm_restore) -> wait ->
         release

Every case reports how many speculative restores the reply confirmed.

On CUDA each row also says where the time goes on one timeline: lead_ms, from the path's start to
the transfer's first device work (the RPC and whatever host submission the device waited for), the
device time (transfer_ms), and tail_ms, what follows the device work (completion, commit/release).
--client-spin-us, --daemon-spin-us, --engine-cpu and --daemon-cpu set how the client and the daemon
wait for messages (see engine_client.client.connect and `kvcached serve --help`).

Layouts (L2 pages of a prefix):
  contiguous          the daemon's pool has room for every prefix of the run, so each backup's
                      reservation is one fresh run and the DMA goes straight into it;
  contiguous+evict    the pool holds 2n+1 pages, so each reservation first evicts the oldest
                      prefix (a whole run) inside the match: the daemon's eviction is timed too;
  fragmented          every L2 page is first taken by a one-page lease and every other one
                      released, so each backup gets n single pages, none adjacent (the worst
                      case: every page its own run), moved through pinned staging plus the
                      threaded host-side copy (the default);
  fragmented/dma      the same pages moved by one DMA per run (TransferEngine fragmented_copy=
                      "dma_per_run"), no staging.

The limit, in the same run and the same loop: a raw copy of the same byte count between a device
buffer and a cudaHostAlloc'd pinned buffer (torch copy_, non_blocking, then synchronize). The ratio
is the path's GB/s over the limit's (medians). Every case checks that the restored pages equal the
backed-up ones bit for bit, and the daemon's integrity at the end.

    python -m bench.bench_transfer [--tokens 350,1000,2000,3500,8000] [--iterations 10]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import statistics
import time

import numpy as np
import torch

from bench.common import RESULTS_DIR, machine_name, percentile, print_table, write_result
from engine_client.client import DEFAULT_SPIN_S, connect
from engine_client.l1_pool import L1Pool
from engine_client.reserved import L2Hints, ReservedPages, confirm_restore
from engine_client.shared_pool import SharedHostPool
from engine_client.transfer import TransferEngine
from kvcached.config import DaemonConfig
from proto.messages import KVGeometry
from tests.integration.daemon_proc import DaemonProcess

GEOMETRY = KVGeometry("Qwen/Qwen3-8B", num_layers=36, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
ARENA_ALIGN_BYTES = 2 << 20
DEFAULT_DAEMON_SPIN_US = DaemonConfig.__dataclass_fields__["socket_spin_us"].default
TARGET = "ratio >= 0.85 at >= 1000 tokens, both directions, contiguous layout"
COLUMNS = ["tokens", "direction", "layout", "gbps", "limit_gbps", "ratio", "median_ms", "limit_ms", "transfer_ms",
           "match_ms", "prep_ms", "submit_ms", "wait_ms", "end_ms", "lead_ms", "tail_ms"]


class RawDma:
    """The limit: plain copies between a device buffer and a cudaHostAlloc'd pinned buffer."""

    def __init__(self, max_bytes: int, device: torch.device):
        self.device = device
        self.device_buffer = torch.empty(max_bytes, dtype=torch.uint8, device=device)
        self.host_buffer = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def seconds(self, direction: str, num_bytes: int) -> float:
        device_part, host_part = self.device_buffer[:num_bytes], self.host_buffer[:num_bytes]
        synchronize(self.device)
        started = time.perf_counter()
        if direction == "H2D":
            device_part.copy_(host_part, non_blocking=True)
        else:
            host_part.copy_(device_part, non_blocking=True)
        synchronize(self.device)
        return time.perf_counter() - started


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mark(timeline: dict[str, torch.cuda.Event] | None, direction: str) -> None:
    """Record the direction's start marker on the timeline's idle stream: it executes at once."""
    if timeline is not None:
        timeline[direction].record(timeline["stream"])


def device_span_seconds(timeline: dict | None, direction: str, events) -> tuple[float, float] | None:
    """Seconds from the path's start (its marker) to the start and to the end of the transfer's
    device work (None off CUDA): the first is the RPC and the host-side work the device waited for
    (a staged restore's host-side copy included). Call after completion."""
    if timeline is None or events is None:
        return None
    events[1].synchronize()
    return timeline[direction].elapsed_time(events[0]) / 1e3, timeline[direction].elapsed_time(events[1]) / 1e3


def new_sample_lists() -> dict[str, list[float]]:
    parts = ("", "match_", "submit_", "wait_", "end_", "raw_", "device_", "lead_", "devend_", "prep_")
    return {part + direction: [] for part in parts for direction in ("D2H", "H2D")}


def num_runs(page_ids: list[int]) -> int:
    return 1 + sum(1 for a, b in zip(page_ids, page_ids[1:]) if b != a + 1)


def fragment_the_pool(client, num_pages: int, rng: np.random.Generator) -> list[int]:
    """Take every L2 page with a one-page lease, then give back every other one; returns the leases kept."""
    page_size = GEOMETRY.page_size
    page_to_lease = {}
    for _ in range(num_pages):
        reply = client.match(rng.integers(1, 2**31 - 1, size=page_size, dtype=np.int32), reserve_backup=True)
        assert len(reply.backup_page_ids) == 1, reply
        page_to_lease[reply.backup_page_ids[0]] = reply.lease_id
    assert sorted(page_to_lease) == list(range(num_pages)), "the pool was not empty"
    for page_id in range(0, num_pages, 2):
        client.release(page_to_lease.pop(page_id))
    assert client.flush(timeout_s=30) == []
    return list(page_to_lease.values())


def profile_submits(client, transfer: TransferEngine, source_pages: list[int], destination_pages: list[int],
                    rng: np.random.Generator, mode: str, num_transfers: int = 100) -> dict[str, str]:
    """cProfile of backup and of restore submissions (and their waits) through L2 pages leased for
    it, as the mode submits them: where the host time of a transfer goes, by function."""
    tokens = rng.integers(1, 2**31 - 1, size=len(source_pages) * GEOMETRY.page_size, dtype=np.int32)
    reply = client.match(tokens, reserve_backup=True)
    profiles = {}
    if mode in ("pipelined", "reserved"):
        runs = (("D2H", lambda: transfer.start_backup(source_pages).send_to(reply.backup_page_ids).wait()),
                ("H2D", lambda: transfer.start_restore(destination_pages).receive_from(reply.backup_page_ids).wait()))
    else:
        runs = (("D2H", lambda: transfer.backup(source_pages, reply.backup_page_ids).wait()),
                ("H2D", lambda: transfer.restore(reply.backup_page_ids, destination_pages).wait()))
    try:
        for direction, run_one in runs:
            run_one()
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(num_transfers):
                run_one()
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
            profiles[direction] = text.getvalue()
    finally:
        client.release(reply.lease_id)
    return profiles


def run_case(num_tokens: int, layout: str, args, raw: RawDma, device: torch.device) -> dict:
    page_size = GEOMETRY.page_size
    bytes_per_page = GEOMETRY.bytes_per_page
    num_pages = num_tokens // page_size
    num_bytes = num_pages * bytes_per_page
    # Room for every prefix of the run, or for two prefixes plus one page (see the module note).
    roomy = layout == "contiguous"
    pool_pages = (args.warmup + args.iterations) * num_pages + 1 if roomy else 2 * num_pages + 1
    reserved_mode = args.mode == "reserved"
    if reserved_mode:
        # Room for the standing reservation too: a chunk of 2n pages, and the next one asked for
        # once fewer than n are left (fragmented: twice that, as only every other page is free).
        pool_pages += 4 * num_pages * (2 if layout.startswith("fragmented") else 1)
    l2_bytes = math.ceil(pool_pages * bytes_per_page / ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES + ARENA_ALIGN_BYTES
    spin_args = ("--spin-us", str(args.daemon_spin_us)) if args.daemon_spin_us is not None else ()
    if args.daemon_cpu is not None:
        spin_args += ("--socket-cpu", str(args.daemon_cpu))
    daemon = DaemonProcess(l2_size=str(l2_bytes), extra_args=(
        "--max-namespaces", "1", "--l3-size", "0", "--log-level", "WARNING", *spin_args)).start(timeout_s=60)
    rng = np.random.default_rng(num_tokens)
    is_cuda = device.type == "cuda"
    all_cpus = os.sched_getaffinity(0)
    try:
        client = connect(daemon.socket_path, timeout_s=30.0, client_name="bench-transfer",
                         spin_s=args.client_spin_us / 1e6,
                         cpu=args.engine_cpu if args.io_cpu is None else args.io_cpu)
        started = time.perf_counter()
        info = client.attach(GEOMETRY)
        attached = time.perf_counter()
        host_pool = SharedHostPool.open(info.shm_path, info.arena_offset_bytes, info.num_pages, GEOMETRY,
                                        pin=is_cuda, device=device if is_cuda else None)
        mapped = time.perf_counter()
        l1_pool = L1Pool(GEOMETRY, 2 * num_pages + 8, device)
        transfer = TransferEngine(l1_pool, host_pool, backend=args.backend,
                                  fragmented_copy="dma_per_run" if layout == "fragmented/dma" else "staging")
        built = time.perf_counter()
        client.report({"transfer": transfer.backend_report(), "pin_seconds": host_pool.pin_seconds,
                       "pin": host_pool.pin_report()})
        attach = {"attach_rpc_s": attached - started, "map_and_pin_s": mapped - attached,
                  "pin_s": host_pool.pin_seconds, "transfer_engine_s": built - mapped,
                  "l2_pool_pages": info.num_pages, "l2_pool_bytes": host_pool.nbytes}

        if args.engine_cpu is not None:
            # This thread only, once the daemon, the pool's pinning threads and the transfer engine
            # (whose host-copy threads keep the CPUs it was built with) have started.
            os.sched_setaffinity(0, {args.engine_cpu})
        kv_bits = l1_pool.kv.view(torch.int16)
        kv_bits.copy_(torch.randint(-2**15, 2**15, kv_bits.shape, dtype=torch.int16, device=device))
        source_pages = list(range(num_pages))
        destination_pages = list(range(num_pages, 2 * num_pages))
        fragmented = layout.startswith("fragmented")
        held_leases = fragment_the_pool(client, info.num_pages, rng) if fragmented else []

        reserved = hints = None
        if reserved_mode:
            reserved = ReservedPages(client, chunk_pages=2 * num_pages, low_water_pages=num_pages)
            reserved.fill()
            hints = L2Hints(page_size)
        speculation = {"confirmed": 0, "redone": 0, "no_hint": 0}

        samples = new_sample_lists()
        timeline = None
        if is_cuda:
            timeline = {"stream": torch.cuda.Stream(device=device), "D2H": torch.cuda.Event(enable_timing=True),
                        "H2D": torch.cuda.Event(enable_timing=True)}
        runs_seen = set()
        bit_exact = True

        def backup_and_restore(sink: dict[str, list[float]] | None, check: bool) -> None:
            """One D2H and one H2D of a fresh prefix; their times go to `sink` (None: a warm-up)."""
            nonlocal bit_exact
            tokens = rng.integers(1, 2**31 - 1, size=num_pages * page_size, dtype=np.int32)
            synchronize(device)
            started = time.perf_counter()
            d2h_prep = h2d_prep = None
            mark(timeline, "D2H")
            reply = None
            if reserved_mode:
                # No round trip: the DMA goes into pages this engine reserved ahead.
                taken = reserved.take(num_pages)
                assert taken is not None, "the standing reservation ran dry"
                matched = time.perf_counter()
                d2h_prep = matched - started
                # One call: its slices' gathers and DMAs interleave, so the copy engine starts
                # after the first slice while the rest are still being queued.
                backup = transfer.backup(source_pages, taken.page_ids)
                backup_page_ids = taken.page_ids
            elif args.mode == "pipelined":
                # The reservation's round trip overlaps the gather: send the match, gather, then
                # collect the reply and queue the DMAs into the reserved pages.
                pending = client.match_async(tokens, reserve_backup=True)
                gathered = transfer.start_backup(source_pages)
                d2h_prep = time.perf_counter() - started
                reply = pending.result()
                matched = time.perf_counter()
                backup = gathered.send_to(reply.backup_page_ids)
            else:
                reply = client.match(tokens, reserve_backup=True)
                matched = time.perf_counter()
                backup = transfer.backup(source_pages, reply.backup_page_ids)
            if reply is not None:
                backup_page_ids = reply.backup_page_ids
            submitted = time.perf_counter()
            if reserved_mode:
                reserved.top_up()        # while the DMA runs: the next chunk, if pages run low
            events = backup.device_events
            backup.wait()
            waited = time.perf_counter()
            if reserved_mode:
                reserved.commit(taken, tokens)
                hints.record(tokens, taken.page_ids, taken.page_epochs)
            else:
                client.commit_backup(reply.lease_id, reply.backup_page_ids)
            ended = time.perf_counter()
            d2h = (ended - started, matched - started, submitted - matched, waited - submitted, ended - waited)
            d2h_span = device_span_seconds(timeline, "D2H", events)
            assert len(backup_page_ids) == num_pages, backup_page_ids
            runs_seen.add(num_runs(backup_page_ids))

            started = time.perf_counter()
            mark(timeline, "H2D")
            if reserved_mode:
                # The restore is queued from the hint first, then the match is sent; its reply
                # confirms the restore or has it redone.
                hint = hints.get(tokens)
                speculative = transfer.restore(hint.page_ids, destination_pages) if hint is not None else None
                pending = client.match_async(tokens)
                h2d_prep = time.perf_counter() - started
                reply = pending.result()
                matched = time.perf_counter()
                if speculative is None:
                    speculation["no_hint"] += 1
                    restore = transfer.restore(reply.host_page_ids, destination_pages)
                else:
                    restore, held = confirm_restore(transfer, speculative, hint, reply, destination_pages)
                    speculation["confirmed" if held else "redone"] += 1
            elif args.mode == "pipelined":
                # The round trip overlaps getting the restore ready (ids, workspace).
                pending = client.match_async(tokens)
                prepared = transfer.start_restore(destination_pages)
                h2d_prep = time.perf_counter() - started
                reply = pending.result()
                matched = time.perf_counter()
                restore = prepared.receive_from(reply.host_page_ids)
            else:
                reply = client.match(tokens)
                matched = time.perf_counter()
                restore = transfer.restore(reply.host_page_ids, destination_pages)
            submitted = time.perf_counter()
            events = restore.device_events
            restore.wait()
            waited = time.perf_counter()
            client.release(reply.lease_id)
            ended = time.perf_counter()
            h2d_span = device_span_seconds(timeline, "H2D", events)
            h2d = (ended - started, matched - started, submitted - matched, waited - submitted, ended - waited)
            assert reply.hit_tokens["l2"] == num_pages * page_size, reply.hit_tokens

            if check:
                same = torch.equal(kv_bits[:, :, source_pages], kv_bits[:, :, destination_pages])
                bit_exact = bit_exact and same
                kv_bits[:, :, destination_pages] = 0       # the next check must see a fresh restore
            if sink is not None:
                for direction, parts in (("D2H", d2h), ("H2D", h2d)):
                    for name, seconds in zip(("", "match_", "submit_", "wait_", "end_"), parts):
                        sink[name + direction].append(seconds)
                sink["device_D2H"].append(backup.seconds)
                sink["device_H2D"].append(restore.seconds)
                if d2h_span is not None and h2d_span is not None:
                    for direction, (lead, device_end) in (("D2H", d2h_span), ("H2D", h2d_span)):
                        sink[f"lead_{direction}"].append(lead)
                        sink[f"devend_{direction}"].append(device_end)
                if d2h_prep is not None:
                    sink["prep_D2H"].append(d2h_prep)
                    sink["prep_H2D"].append(h2d_prep)
                for direction in ("D2H", "H2D"):
                    sink[f"raw_{direction}"].append(raw.seconds(direction, num_bytes))

        last = args.warmup + args.iterations - 1
        for iteration in range(args.warmup + args.iterations):
            backup_and_restore(samples if iteration >= args.warmup else None, check=iteration in (0, last))

        sweep = []
        if layout == "fragmented" and num_tokens == args.sweep_tokens and args.sweep_threads:
            default_threads = transfer.host_copy_threads
            for threads in [int(t) for t in args.sweep_threads.split(",")]:
                transfer.set_host_copy_threads(threads)
                sweep_samples = new_sample_lists()
                backup_and_restore(None, check=False)
                for _ in range(args.sweep_iterations):
                    backup_and_restore(sweep_samples, check=False)
                sweep.append({"threads": threads, **{
                    f"{direction}_gbps": num_bytes / statistics.median(sweep_samples[direction]) / 1e9
                    for direction in ("D2H", "H2D")}})
            transfer.set_host_copy_threads(default_threads)

        submit_profile = None
        if args.profile_submit and layout == "contiguous" and num_tokens == args.profile_tokens:
            submit_profile = profile_submits(client, transfer, source_pages, destination_pages, rng, args.mode)
            for direction, text in submit_profile.items():
                print(direction, text, flush=True)

        if reserved is not None:
            reserved.close()
        for lease_id in held_leases:
            client.release(lease_id)
        assert client.flush(timeout_s=30) == []
        status = client.status(check_integrity=True)
        assert status["integrity"] == "ok", status["integrity"]
        backends = transfer.backend_report()
        transfer.close()
        host_pool.close()
        client.close()
    finally:
        os.sched_setaffinity(0, all_cpus)
        daemon.stop()
        daemon.cleanup()

    rows = []
    for direction in ("D2H", "H2D"):
        seconds = statistics.median(samples[direction])
        raw_seconds = statistics.median(samples[f"raw_{direction}"])
        rows.append({
            "tokens": num_tokens, "direction": direction, "layout": layout,
            "gbps": num_bytes / seconds / 1e9, "limit_gbps": num_bytes / raw_seconds / 1e9,
            "ratio": raw_seconds / seconds,
            "pages": num_pages, "bytes": num_bytes, "median_ms": seconds * 1e3,
            "p90_ms": percentile(samples[direction], 90) * 1e3,
            "transfer_ms": statistics.median(samples[f"device_{direction}"]) * 1e3,
            "limit_ms": raw_seconds * 1e3,
            # Where the wall time goes: the opening RPC, submitting the transfer, waiting for it
            # (device work, plus the host-side copy of a staged backup), the closing commit/release.
            **{f"{part}_ms": statistics.median(samples[f"{part}_{direction}"]) * 1e3
               for part in ("match", "submit", "wait", "end")},
            # Pipelined: the host work done while the match is in flight (match_ms above it means
            # the reply came later than that work was done).
            **({"prep_ms": statistics.median(samples[f"prep_{direction}"]) * 1e3}
               if samples[f"prep_{direction}"] else {}),
            # On CUDA: from the path's start to the transfer's first device work (RPC + submission
            # the device waited for), and what is left after the device work (completion + end).
            **({"lead_ms": statistics.median(samples[f"lead_{direction}"]) * 1e3,
                "tail_ms": statistics.median(
                    [total - device_end for total, device_end in zip(
                        samples[direction], samples[f"devend_{direction}"])]) * 1e3}
               if samples[f"lead_{direction}"] else {}),
        })
    return {"rows": rows, "attach": attach, "backends": backends, "bit_exact": bit_exact,
            "speculative_restores": speculation if reserved_mode else None,
            "submit_profile": submit_profile,
            "l2_runs_per_backup": sorted(runs_seen), "host_copy_thread_sweep": sweep,
            "samples_s": samples}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="350,1000,2000,3500,8000")
    parser.add_argument("--layouts", default="contiguous,contiguous+evict,fragmented,fragmented/dma")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--sweep-tokens", type=int, default=3500, help="fragmented prefix for the thread sweep")
    parser.add_argument("--sweep-threads", default="4,8,16", help="host-copy thread counts ('' to skip)")
    parser.add_argument("--sweep-iterations", type=int, default=5)
    parser.add_argument("--profile-submit", action="store_true",
                        help="cProfile 100 backups of the --profile-tokens contiguous case (host time by function)")
    parser.add_argument("--profile-tokens", type=int, default=1000)
    parser.add_argument("--pin-results", default=None, help="bench_pin JSON to embed (default: <machine>/pin.json)")
    parser.add_argument("--mode", choices=("reserved", "pipelined", "serial"), default="reserved",
                        help="reserved: backups into pages reserved ahead, restores started from the engine's L2 "
                             "hints before the match reply; pipelined: the match's round trip overlaps the "
                             "gather of a backup and getting a restore ready (match_async + start_backup / "
                             "start_restore); serial: match, then backup() / restore()")
    parser.add_argument("--client-spin-us", type=float, default=DEFAULT_SPIN_S * 1e6,
                        help="how long the client busy-waits for a reply before sleeping")
    parser.add_argument("--daemon-spin-us", type=int, default=None,
                        help="the daemon's --spin-us (default: the daemon's default)")
    parser.add_argument("--engine-cpu", type=int, default=None,
                        help="pin this (the engine's) thread and, unless --io-cpu, its client's ZeroMQ I/O thread "
                             "to this CPU")
    parser.add_argument("--io-cpu", type=int, default=None,
                        help="run the client's ZeroMQ I/O thread on this CPU instead (default: --engine-cpu)")
    parser.add_argument("--daemon-cpu", type=int, default=None, help="the daemon's --socket-cpu")
    parser.add_argument("--name", default="transfer", help="result file name (bench/results/<machine>/<name>.json)")
    parser.add_argument("--machine", default=None)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    token_counts = [int(t) for t in args.tokens.split(",")]
    layouts = args.layouts.split(",")
    raw = RawDma(max(token_counts) // GEOMETRY.page_size * GEOMETRY.bytes_per_page, device)

    cases = []
    for layout in layouts:
        for num_tokens in token_counts:
            case = run_case(num_tokens, layout, args, raw, device)
            print(json.dumps({k: v for k, v in case.items() if k not in ("samples_s", "rows")}), flush=True)
            print_table(case["rows"], COLUMNS)
            cases.append({"tokens": num_tokens, "layout": layout, **case})

    rows = [row for case in cases for row in case["rows"]]
    print()
    print_table(rows, COLUMNS)
    target_rows = [r for r in rows if r["layout"] == "contiguous" and r["tokens"] >= 1000]
    target_met = bool(target_rows) and all(r["ratio"] >= 0.85 for r in target_rows)
    pin_path = args.pin_results or os.path.join(RESULTS_DIR, args.machine or machine_name(), "pin.json")
    pin = None
    if os.path.exists(pin_path):
        with open(pin_path) as f:
            pin_document = json.load(f)
        pin = {"source": os.path.relpath(pin_path), "date": pin_document.get("date"),
               "rows": pin_document.get("rows"), "dma": pin_document.get("dma")}
    print(f"target ({TARGET}): {'met' if target_met else 'NOT met'}")
    path = write_result(args.name, {
        "target": TARGET, "mode": args.mode, "client_spin_us": args.client_spin_us,
        "daemon_spin_us": args.daemon_spin_us if args.daemon_spin_us is not None else DEFAULT_DAEMON_SPIN_US,
        "engine_cpu": args.engine_cpu, "io_cpu": args.io_cpu if args.io_cpu is not None else args.engine_cpu,
        "daemon_cpu": args.daemon_cpu, "target_met": target_met, "device": str(device),
        "geometry": {"model_id": GEOMETRY.model_id, "num_layers": GEOMETRY.num_layers,
                     "num_kv_heads": GEOMETRY.num_kv_heads, "head_dim": GEOMETRY.head_dim,
                     "dtype": GEOMETRY.dtype, "page_size": GEOMETRY.page_size,
                     "bytes_per_page": GEOMETRY.bytes_per_page},
        "timing": "wall clock from the engine process; path = RPCs + transfer + wait; limit = raw pinned "
                  "copy of the same bytes in the same loop; gbps = bytes / median / 1e9",
        "iterations": args.iterations, "warmup": args.warmup,
        "rows": rows,
        "cases": [{k: v for k, v in case.items() if k not in ("rows", "samples_s")} for case in cases],
        "pinning": pin,
        "raw_samples_s": {f"{case['layout']}/{case['tokens']}": case["samples_s"] for case in cases},
    }, machine=args.machine)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
