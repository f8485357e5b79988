"""L3 -> L2 promotion and L3 -> L1 restore with a cold page cache, against raw reads of the same file.

For each prefix length: an engine (L1 on the GPU) prefills random KV and backs it up; the daemon
writes it through to L3; a filler evicts it from L2 and the engine drops it from L1; the L3
file's page cache is dropped (fsync + POSIX_FADV_DONTNEED); then the engine's next request
promotes it L3 -> L2 (daemon, preadv) and restores it L2 -> L1 (one DMA), checked bit for bit.
In the same run, for the same bytes of the same file (cache dropped the same way), the raw read
bandwidth with dd-style large sequential O_DIRECT reads.

    python -m bench.bench_l3 [--tokens 350,1000,2000,3500,8000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time

import numpy as np
import torch

from bench.common import median, print_table, write_result
from engine_client.cache_manager import CacheManager
from engine_client.client import connect
from proto.messages import KVGeometry
from kvcached.testing.daemon_proc import DaemonProcess

QWEN3_8B = KVGeometry("qwen3-8b", num_layers=36, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
SMALL = KVGeometry("small", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", page_size=16)
RAW_READ_CHUNK_BYTES = 64 << 20


def drop_file_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_read_gbps(path: str, offset: int, num_bytes: int) -> float:
    """dd-style: sequential O_DIRECT reads of RAW_READ_CHUNK_BYTES into an aligned buffer."""
    drop_file_cache(path)
    buffer = mmap.mmap(-1, RAW_READ_CHUNK_BYTES)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        start = offset // 4096 * 4096
        end = start + num_bytes
        started = time.perf_counter()
        position = start
        while position < end:
            count = os.preadv(fd, [buffer], position)
            if count <= 0:
                raise OSError(f"raw read hit end of file at {position}")
            position += count
        return (position - start) / (time.perf_counter() - started) / 1e9
    finally:
        os.close(fd)
        buffer.close()


def wait_idle(client, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.status()
        if status["pending"]["h2s"] == 0 and status["pending"]["s2h"] == 0:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"daemon I/O still pending: {status['pending']}")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="350,1000,2000,3500,8000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a tiny geometry (CPU smoke run)")
    parser.add_argument("--l3-dir", default=None, help="directory of the L3 file (default: the temp dir)")
    parser.add_argument("--o-direct", action="store_true", help="daemon reads L3 with O_DIRECT")
    parser.add_argument("--machine", default=None)
    args = parser.parse_args()
    geometry = SMALL if args.small else QWEN3_8B
    device = "cuda" if torch.cuda.is_available() else "cpu"
    token_counts = [int(t) for t in args.tokens.split(",")]
    max_pages = max(token_counts) // geometry.page_size
    l2_bytes = (max_pages + 8) * geometry.bytes_per_page + (4 << 20)
    l3_bytes = ((max_pages * 4 + 64) * geometry.bytes_per_page + (2 << 20)) // (2 << 20) * (2 << 20) + (2 << 20)
    l3_dir = args.l3_dir or tempfile.mkdtemp(prefix="kvl3-")
    l3_path = os.path.join(l3_dir, "l3.bin")
    extra = ["--max-namespaces", "1", "--l3-path", l3_path, "--l3-size", str(l3_bytes), "--log-level", "WARNING"]
    if args.o_direct:
        extra.append("--l3-o-direct")
    daemon = DaemonProcess(l2_size=str(l2_bytes), extra_args=tuple(extra)).start(timeout_s=120)
    rows, raw = [], {}
    try:
        engine = CacheManager.attach(connect(daemon.socket_path, timeout_s=60.0, client_name="bench-l3"), geometry,
                                     num_l1_pages=max_pages + 8, device=device)
        filler = connect(daemon.socket_path, timeout_s=60.0, client_name="filler")
        filler.attach(geometry)
        capacity = engine.client.info.num_pages
        rng = np.random.default_rng(0)
        for num_tokens in token_counts:
            samples = {"promotion_gbps": [], "l3_to_l1_gbps": [], "raw_gbps": [], "extents": [],
                       "promotion_s": [], "l3_to_l1_s": [], "h2d_s": []}
            for _ in range(args.repeats):
                tokens = rng.integers(0, 150_000, size=num_tokens, dtype=np.int32)
                plan = engine.prepare(tokens)
                assert plan.num_cached_tokens == 0
                full_pages = num_tokens // geometry.page_size
                pages = plan.new_l1_page_ids[:full_pages]
                index = torch.tensor(pages, device=engine.l1_pool.kv.device)
                random = torch.randn((2, geometry.num_layers, len(pages), geometry.page_size, geometry.num_kv_heads,
                                      geometry.head_dim), device=engine.l1_pool.kv.device).to(engine.l1_pool.kv.dtype)
                engine.l1_pool.kv.index_copy_(2, index, random)
                original = engine.read_tokens_kv(pages)
                engine.finish(plan)
                wait_idle(engine.client)
                # Out of L1 (engine) and out of L2 (filler), still in L3; then a cold page cache.
                evicted = engine.l1_index.evict(engine.l1_index.num_cached_pages)
                engine.l1_pool.free(evicted)
                filler_tokens = rng.integers(0, 150_000, size=capacity * geometry.page_size, dtype=np.int32)
                reply = filler.acquire(filler_tokens, save=True, promote="none")
                filler.commit(reply.lease_id, reply.reserved_page_ids)
                assert filler.flush() == []
                before = wait_idle(engine.client)
                drop_file_cache(l3_path)

                started = time.perf_counter()
                plan = engine.prepare(tokens, save=False)
                l3_to_l1_s = time.perf_counter() - started
                after = engine.client.status()
                assert plan.restored_tokens == full_pages * geometry.page_size, (plan.restored_tokens, full_pages)
                restored = engine.read_tokens_kv(plan.l1_page_ids)
                assert torch.equal(restored.view(torch.int16), original.view(torch.int16)), "restore is not bit-exact"
                engine.finish(plan)
                num_bytes = after["io"]["s2h"]["bytes"] - before["io"]["s2h"]["bytes"]
                assert num_bytes == full_pages * geometry.bytes_per_page
                promotion_s = after["io"]["s2h"]["seconds"] - before["io"]["s2h"]["seconds"]
                samples["promotion_s"].append(promotion_s)
                samples["promotion_gbps"].append(num_bytes / promotion_s / 1e9)
                samples["l3_to_l1_s"].append(l3_to_l1_s)
                samples["l3_to_l1_gbps"].append(num_bytes / l3_to_l1_s / 1e9)
                samples["h2d_s"].append(plan.restore_seconds)
                samples["extents"].append(after["io"]["s2h"]["extents"] - before["io"]["s2h"]["extents"])
                samples["raw_gbps"].append(raw_read_gbps(l3_path, 0, num_bytes))
                assert engine.client.status(check_integrity=True)["integrity"] == "ok"
            limit = median(samples["raw_gbps"])
            for kind in ("promotion", "l3_to_l1"):
                gbps = median(samples[f"{kind}_gbps"])
                rows.append({"tokens": num_tokens, "path": kind, "gbps": gbps, "limit_gbps": limit,
                             "ratio": gbps / limit, "extents": int(median(samples["extents"]))})
            raw[str(num_tokens)] = samples
        filler.close()
        engine.close()
    finally:
        daemon.stop()
        daemon.cleanup()
        if os.path.exists(l3_path):
            os.unlink(l3_path)
    print_table(rows, ["tokens", "path", "gbps", "limit_gbps", "ratio", "extents"])
    path = write_result("l3_o_direct" if args.o_direct else "l3", {
        "geometry": geometry.to_wire(), "device": device, "o_direct": args.o_direct,
        "target": "promotion ratio >= 0.9 at >= 1000 tokens (raw = dd-style 64 MiB O_DIRECT reads, cold cache)",
        "rows": rows, "raw_samples": raw,
    }, machine=args.machine)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
