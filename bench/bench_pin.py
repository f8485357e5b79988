"""How long an engine's attach takes to map and pin a large L2 pool, and how to make it short.

The segment is made by the daemon's own code (kvcached.server.shm.SharedSegment: a /dev/shm file,
posix_fallocate, then every page touched); its creation is timed apart, since the daemon pays it
once at start, not the engine. Then, for each
pool size, the engine-side ways to map and pin it, each on a fresh mapping of the same segment:

    populate+register   mmap(MAP_POPULATE), then one cudaHostRegister of everything (the old way)
    register            mmap without populating, one cudaHostRegister (it faults the pages itself)
    chunks-T            SharedHostPool.open: PIN_CHUNK_BYTES chunks, each pre-faulted
                        (MADV_POPULATE_WRITE) and registered, on T threads; open returns when all
                        are pinned
    chunks-T-<N>MiB     the same with the other chunk size (1 GiB, or 256 MiB)
    chunks-T-nofault    the same without the pre-fault
    background-T        SharedHostPool.open(pin_in_background=True): open returns once mapped;
                        reported: the return, the first chunk pinned, all chunks pinned

The first attach after the segment is created is reported apart: tmpfs zeroes fallocated pages at
first touch, which the daemon now does at creation so that this attach does not pay for it; the
warm methods run after it, in rounds.

Also measured once: DMA bandwidth through a pinned pool within one chunk and across a chunk
boundary, against a cudaHostAlloc'd buffer, to show cutting copies at chunk edges costs nothing.

    python -m bench.bench_pin [--sizes-gib 16,64] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import time
import uuid

import torch

from bench.common import print_table, write_result
from engine_client import shared_pool
from engine_client.shared_pool import PIN_CHUNK_BYTES, SharedHostPool
from kvcached.server.shm import SharedSegment
from proto.messages import KVGeometry

# Qwen3-8B pages; the pool size is what matters here, the geometry only sizes the pages.
GEOMETRY = KVGeometry("Qwen/Qwen3-8B", num_layers=36, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
GIB = 1 << 30


def create_segment(directory: str, num_bytes: int) -> tuple[SharedSegment, float]:
    """The daemon's own code path: create, fallocate, map, and touch every page."""
    started = time.perf_counter()
    segment = SharedSegment.create(directory, f"kvcached-pinbench-{os.getpid()}-{uuid.uuid4().hex[:8]}", num_bytes)
    return segment, time.perf_counter() - started


def time_single_register(path: str, num_bytes: int, populate: bool) -> dict:
    """One mapping, one cudaHostRegister of all of it (as SharedHostPool did before chunking)."""
    fd = os.open(path, os.O_RDWR)
    started = time.perf_counter()
    try:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        mapping = mmap.mmap(fd, num_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    mapped = time.perf_counter()
    view = torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes)
    address = view.data_ptr()
    shared_pool._register(address, num_bytes, torch.cuda.current_device())
    registered = time.perf_counter()
    shared_pool._unregister(address)
    unregistered = time.perf_counter()
    del view
    mapping.close()
    return {"attach_s": registered - started, "map_s": mapped - started, "register_s": registered - mapped,
            "unpin_s": unregistered - registered}


def time_pool(path: str, num_pages: int, threads: int | None, prefault: bool, background: bool,
              chunk_bytes: int = PIN_CHUNK_BYTES) -> dict:
    started = time.perf_counter()
    pool = SharedHostPool.open(path, num_pages, GEOMETRY, pin=True, pin_threads=threads, prefault=prefault,
                               pin_in_background=background, pin_chunk_bytes=chunk_bytes)
    returned = time.perf_counter()
    result = {"attach_s": returned - started}
    if background:
        pool.wait_pinned(0, 1)
        result["first_chunk_s"] = time.perf_counter() - started
        pool.wait_until_pinned()
        result["all_pinned_s"] = time.perf_counter() - started
    result["pin_s"] = pool.pin_seconds
    pool.check_integrity()
    assert pool.is_pinned
    pool.close()
    result["unpin_s"] = pool.unpin_seconds
    return result


def measure_dma(path: str, num_pages: int, copy_bytes: int, repeats: int) -> list[dict]:
    """GB/s of copies within one pinned chunk, across a chunk boundary (cut into two copies, as the
    transfer engine does, and as one copy), and to a cudaHostAlloc'd buffer."""
    pool = SharedHostPool.open(path, num_pages, GEOMETRY, pin=True)
    device_buffer = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    flat = pool.byte_view()
    boundary = PIN_CHUNK_BYTES
    half = copy_bytes // 2
    cases = {
        "pinned buffer (cudaHostAlloc)": [torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)],
        "pool, within one chunk": [flat[:copy_bytes]],
        "pool, across a chunk boundary, cut in two": [flat[boundary - half:boundary], flat[boundary:boundary + half]],
        "pool, across a chunk boundary, one copy": [flat[boundary - half:boundary + half]],
    }
    del flat
    rows = []
    for name in list(cases):
        for direction in ("H2D", "D2H"):
            row = {"case": name, "direction": direction, "bytes": copy_bytes}
            try:
                seconds, queue_seconds = _time_copies(device_buffer, cases[name], direction, repeats)
                row.update(gbps=copy_bytes / seconds / 1e9, queue_ms=queue_seconds * 1e3,
                           asynchronous=queue_seconds < 0.5 * seconds)
            except RuntimeError as error:
                row["error"] = str(error)
            rows.append(row)
    cases.clear()
    pool.close()
    return rows


def _time_copies(device_buffer: torch.Tensor, host_pieces: list[torch.Tensor], direction: str,
                 repeats: int) -> tuple[float, float]:
    """Median (seconds to completion, seconds for the copy calls to return) over `repeats` runs."""
    samples = []
    for repeat in range(repeats + 2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        offset = 0
        for piece in host_pieces:
            device_piece = device_buffer[offset:offset + piece.numel()]
            if direction == "H2D":
                device_piece.copy_(piece, non_blocking=True)
            else:
                piece.copy_(device_piece, non_blocking=True)
            offset += piece.numel()
        queued = time.perf_counter()
        torch.cuda.synchronize()
        if repeat >= 2:                         # the first two warm up
            samples.append((time.perf_counter() - started, queued - started))
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-gib", default="16,64")
    parser.add_argument("--dir", default="/dev/shm", help="tmpfs directory for the segment")
    parser.add_argument("--threads", default="2,4,8", help="thread counts for chunks-T (first size only)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the warm methods (first size only)")
    parser.add_argument("--dma-mib", type=int, default=256)
    parser.add_argument("--machine", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pin needs a CUDA GPU")
    torch.cuda.init()
    torch.empty(1, device="cuda")
    usage = shutil.disk_usage(args.dir)
    environment = {"dir": args.dir, "dir_total_bytes": usage.total, "dir_free_bytes": usage.free,
                   "cpu_count": os.cpu_count(), "chunk_bytes": PIN_CHUNK_BYTES,
                   "default_pin_threads": shared_pool.default_pin_threads()}
    print(environment)

    rows, dma_rows = [], []
    sizes = [int(size) for size in args.sizes_gib.split(",")]
    for size_index, size_gib in enumerate(sizes):
        num_pages = size_gib * GIB // GEOMETRY.bytes_per_page
        num_bytes = num_pages * GEOMETRY.bytes_per_page
        if shutil.disk_usage(args.dir).free < num_bytes + GIB:
            print(f"skipping {size_gib} GiB: {args.dir} has {shutil.disk_usage(args.dir).free} bytes free")
            rows.append({"size_gib": size_gib, "method": "skipped", "note": f"{args.dir} too small"})
            continue
        segment, create_s = create_segment(args.dir, num_bytes)
        path = segment.path
        print(f"{size_gib} GiB segment created by the daemon's code (fallocate + touch) in {create_s:.2f} s")
        rows.append({"size_gib": size_gib, "method": "daemon: create segment (fallocate + touch)", "attach_s": create_s})
        try:
            # First the engine attach that meets the freshly created segment (tmpfs zeroes
            # fallocated pages at first touch; the daemon now touches them when it creates it).
            default_threads = shared_pool.default_pin_threads()
            row = {"size_gib": size_gib, "method": f"first attach after create: chunks-{default_threads}",
                   **time_pool(path, num_pages, None, True, False)}
            print(row, flush=True)
            rows.append(row)
            # Then warm attaches: the full comparison on the first size; on the larger ones, the
            # old way and ours only.
            first = size_index == 0
            methods: list[tuple[str, object]] = [
                ("populate+register", lambda: time_single_register(path, num_bytes, populate=True))]
            if first:
                methods.append(("register", lambda: time_single_register(path, num_bytes, populate=False)))
            for threads in [int(t) for t in args.threads.split(",")] if first else [default_threads]:
                methods.append((f"chunks-{threads}", lambda t=threads: time_pool(path, num_pages, t, True, False)))
            if first:
                other_chunk_bytes = GIB if PIN_CHUNK_BYTES != GIB else 256 << 20
                methods.append((f"chunks-{default_threads}-{other_chunk_bytes >> 20}MiB",
                                lambda: time_pool(path, num_pages, None, True, False, chunk_bytes=other_chunk_bytes)))
                methods.append((f"chunks-{default_threads}-nofault",
                                lambda: time_pool(path, num_pages, None, False, False)))
            methods.append((f"background-{default_threads}", lambda: time_pool(path, num_pages, None, True, True)))
            for repeat in range(args.repeats if first else 1):
                for name, run in methods:
                    row = {"size_gib": size_gib, "method": name, "repeat": repeat, **run()}
                    print(row, flush=True)
                    rows.append(row)
            if size_index == 0:
                dma_rows = measure_dma(path, num_pages, args.dma_mib << 20, repeats=5)
        finally:
            segment.close()        # unmaps and unlinks

    print_table(rows, ["size_gib", "method", "repeat", "attach_s", "first_chunk_s", "all_pinned_s", "pin_s", "unpin_s",
                       "map_s", "register_s"])
    if dma_rows:
        print_table(dma_rows, ["case", "direction", "gbps", "queue_ms", "asynchronous", "error"])
    path = write_result("pin", {"environment": environment, "rows": rows, "dma": dma_rows}, machine=args.machine)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
