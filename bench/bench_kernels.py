"""Time the Triton and torch page gather/scatter against a device-to-device copy of the same bytes.

Geometry: Qwen3-8B (36 layers, 8 KV heads, head dim 128, bf16), 16-token pages, an L1 pool of
~6,000 pages; selections of 350..8,000 tokens of random distinct pages. Bandwidth counts bytes
read plus bytes written; the ratio is against a contiguous device-to-device copy of the same
number of bytes measured in the same run. Every selection is checked bit for bit first.

    python bench/bench_kernels.py                      # writes bench/results/h200/kernels.json
    python bench/bench_kernels.py --block-sizes 512,1024,2048 --out /tmp/kernels.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run as a script from anywhere, without installing

import torch  # noqa: E402

from engine_client import kernels  # noqa: E402

logger = logging.getLogger(__name__)

NUM_LAYERS = 36
NUM_KV_HEADS = 8
HEAD_DIM = 128
PAGE_SIZE = 16
DTYPE = torch.bfloat16


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="350,1000,2000,3500,8000",
                        help="comma-separated selection sizes in tokens")
    parser.add_argument("--pool-pages", type=int, default=6000, help="pages in the L1 pool")
    parser.add_argument("--block-sizes", default=str(kernels.DEFAULT_BLOCK_SIZE),
                        help="comma-separated Triton block sizes (elements) to time")
    parser.add_argument("--page-id-dtype", choices=["int32", "int64"], default="int32")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=200, help="timed milliseconds per measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench/results/h200/kernels.json")
    return parser.parse_args(argv)


def time_ms(fn, warmup_ms: int, rep_ms: int) -> list[float]:
    """Per-call times in ms from CUDA events, with the L2 cache flushed before each call."""
    from triton.testing import do_bench

    return list(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"))


def check_selection(l1_kv, src_page_ids, dst_page_ids, block_sizes) -> None:
    """Triton and torch agree bit for bit on gather, and a Triton scatter lands where it should."""
    num_pages = src_page_ids.shape[0]
    shape = kernels.packed_shape(l1_kv, num_pages)
    expected = torch.empty(shape, dtype=l1_kv.dtype, device=l1_kv.device)
    kernels.gather_pages_torch(l1_kv, src_page_ids, expected)
    for block_size in block_sizes:
        out = torch.empty_like(expected)
        kernels.gather_pages(l1_kv, src_page_ids, out, block_size=block_size)
        if not torch.equal(out.view(torch.int16), expected.view(torch.int16)):
            raise SystemExit(f"triton gather (block {block_size}) differs from torch on {num_pages} pages")
    kernels.scatter_pages(expected, dst_page_ids, l1_kv)
    back = torch.empty_like(expected)
    kernels.gather_pages_torch(l1_kv, dst_page_ids, back)
    if not torch.equal(back.view(torch.int16), expected.view(torch.int16)):
        raise SystemExit(f"triton scatter did not land on {num_pages} pages")


def summarize(samples_ms: list[float], bytes_moved: int, reference_tb_per_s: float | None) -> dict:
    median_ms = statistics.median(samples_ms)
    tb_per_s = bytes_moved / (median_ms * 1e-3) / 1e12
    return {
        "median_ms": median_ms,
        "min_ms": min(samples_ms),
        "tb_per_s": tb_per_s,
        "ratio_to_d2d": None if reference_tb_per_s is None else tb_per_s / reference_tb_per_s,
        "samples_ms": samples_ms,
    }


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU and none is visible; nothing measured.", file=sys.stderr)
        return 2
    if not kernels.triton_available():
        print("bench_kernels.py needs triton, which is not installed.", file=sys.stderr)
        return 2
    import triton

    token_counts = [int(t) for t in args.tokens.split(",")]
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    page_id_dtype = getattr(torch, args.page_id_dtype)
    device = torch.device("cuda")
    generator = torch.Generator(device=device)
    generator.manual_seed(args.seed)

    pool_shape = (2, NUM_LAYERS, args.pool_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    l1_kv = torch.randint(-2**15, 2**15 - 1, pool_shape, dtype=torch.int16, device=device,
                          generator=generator).view(DTYPE)
    bytes_per_page = 2 * NUM_LAYERS * PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM * l1_kv.element_size()
    logger.info("pool: %d pages, %.1f GiB; %s", args.pool_pages, l1_kv.numel() * 2 / 2**30,
                torch.cuda.get_device_name(device))

    results = []
    for num_tokens in token_counts:
        num_pages = math.ceil(num_tokens / PAGE_SIZE)
        if 2 * num_pages > args.pool_pages:
            raise SystemExit(f"{num_tokens} tokens need {2 * num_pages} distinct pages; pool has {args.pool_pages}")
        shuffled = torch.randperm(args.pool_pages, device=device, generator=generator)
        src_page_ids = shuffled[:num_pages].to(page_id_dtype)
        dst_page_ids = shuffled[num_pages:2 * num_pages].to(page_id_dtype)
        check_selection(l1_kv, src_page_ids, dst_page_ids, block_sizes)

        packed = torch.empty(kernels.packed_shape(l1_kv, num_pages), dtype=DTYPE, device=device)
        payload_bytes = num_pages * bytes_per_page
        bytes_moved = 2 * payload_bytes  # each byte is read once and written once
        copy_src = torch.empty(payload_bytes, dtype=torch.uint8, device=device)
        copy_dst = torch.empty_like(copy_src)

        # Timed calls skip the bounds check: it syncs, and the ids were checked above.
        candidates = [("d2d_copy", None, lambda: copy_dst.copy_(copy_src))]
        for block_size in block_sizes:
            candidates.append(("triton_gather", block_size, lambda b=block_size: kernels.gather_pages(
                l1_kv, src_page_ids, packed, check_bounds=False, block_size=b)))
        candidates.append(("torch_gather", None, lambda: kernels.gather_pages_torch(
            l1_kv, src_page_ids, packed, check_bounds=False)))
        for block_size in block_sizes:
            candidates.append(("triton_scatter", block_size, lambda b=block_size: kernels.scatter_pages(
                packed, dst_page_ids, l1_kv, check_bounds=False, block_size=b)))
        candidates.append(("torch_scatter", None, lambda: kernels.scatter_pages_torch(
            packed, dst_page_ids, l1_kv, check_bounds=False)))

        reference_tb_per_s = None
        for method, block_size, fn in candidates:
            summary = summarize(time_ms(fn, args.warmup_ms, args.rep_ms), bytes_moved, reference_tb_per_s)
            if method == "d2d_copy":
                reference_tb_per_s = summary["tb_per_s"]
                summary["ratio_to_d2d"] = 1.0
            results.append({"tokens": num_tokens, "pages": num_pages, "payload_bytes": payload_bytes,
                            "bytes_moved": bytes_moved, "method": method, "block_size": block_size,
                            **summary})

    print_table(results)
    record = {
        "benchmark": "page gather/scatter, L1 pool <-> packed page-major buffer",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(device),
        "geometry": {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                     "dtype": str(DTYPE).removeprefix("torch."), "page_size": PAGE_SIZE,
                     "bytes_per_page": bytes_per_page, "pool_pages": args.pool_pages},
        "page_id_dtype": args.page_id_dtype,
        "timing": {"tool": "triton.testing.do_bench (CUDA events, L2 flushed per call)",
                   "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
                   "tb_per_s": "(bytes read + bytes written) / median time / 1e12"},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    logger.info("wrote %s", args.out)
    return 0


def print_table(results: list[dict]) -> None:
    header = f"{'tokens':>6} {'pages':>5} {'MiB':>7}  {'method':<16} {'block':>5} {'median ms':>9} {'TB/s':>6} {'x d2d':>6}"
    print(header)
    print("-" * len(header))
    for row in results:
        block = "" if row["block_size"] is None else str(row["block_size"])
        print(f"{row['tokens']:>6} {row['pages']:>5} {row['payload_bytes'] / 2**20:>7.1f}  {row['method']:<16} "
              f"{block:>5} {row['median_ms']:>9.4f} {row['tb_per_s']:>6.2f} {row['ratio_to_d2d']:>6.2f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
