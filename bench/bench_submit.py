"""Host time of each step of a transfer's submission, against the DMA it feeds.

A 1,000-token Qwen3-8B prefix moves in ~2.7 ms at the PCIe limit; every microsecond the host
spends before the copy engine starts adds to that. This times, one call at a time with the device
idle (synchronized before each call, outside the timing), the public calls an engine makes for a
pipelined backup and restore (KVCacheClient.match_async, TransferEngine.start_backup / send_to,
start_restore / receive_from, wait) and the primitives they are made of (one Triton launch, one
torch index kernel, an event record, an asynchronous copy, a replay of a captured CUDA graph of
the same gather, ...). Each row is the median over --iterations calls, in microseconds, and as a
share of the raw pinned DMA of the prefix's bytes measured in the same run.

    python -m bench.bench_submit [--tokens 1000] [--iterations 300]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.bench_transfer import ARENA_ALIGN_BYTES, GEOMETRY, RawDma
from bench.common import percentile, print_table, write_result
from engine_client import cuda_runtime, kernels
from engine_client.client import connect
from engine_client.l1_pool import L1Pool
from engine_client.shared_pool import SharedHostPool
from engine_client.transfer import TransferEngine, _page_id_array
from tests.integration.daemon_proc import DaemonProcess

COLUMNS = ["group", "step", "median_us", "p90_us", "share_of_dma"]


def time_calls(call: Callable[[], object], iterations: int, device: torch.device,
               before: Callable[[], object] | None = None, after: Callable[[object], None] | None = None,
               ) -> list[float]:
    """Seconds of each call, the device idle before each; before() and after(result) are untimed."""
    samples = []
    for _ in range(iterations):
        if before is not None:
            before()
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        result = call()
        samples.append(time.perf_counter() - started)
        if after is not None:
            after(result)
    torch.cuda.synchronize(device)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--client-spin-us", type=float, default=3000.0)
    parser.add_argument("--daemon-spin-us", type=int, default=30000)
    parser.add_argument("--name", default="submit")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_submit times CUDA submissions: it needs a GPU")
    device = torch.device("cuda")
    num_pages = args.tokens // GEOMETRY.page_size
    num_bytes = num_pages * GEOMETRY.bytes_per_page
    n = args.iterations

    pool_pages = 4 * num_pages + 1
    l2_bytes = math.ceil(pool_pages * GEOMETRY.bytes_per_page / ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES + ARENA_ALIGN_BYTES
    daemon = DaemonProcess(l2_size=str(l2_bytes), extra_args=(
        "--max-namespaces", "1", "--l3-size", "0", "--log-level", "WARNING",
        "--spin-us", str(args.daemon_spin_us))).start(timeout_s=60)
    samples: dict[tuple[str, str], list[float]] = {}
    notes: dict[str, str] = {}
    try:
        client = connect(daemon.socket_path, timeout_s=30.0, client_name="bench-submit",
                         spin_s=args.client_spin_us / 1e6)
        info = client.attach(GEOMETRY)
        host_pool = SharedHostPool.open(info.shm_path, info.arena_offset_bytes, info.num_pages, GEOMETRY,
                                        pin=True, device=device)
        l1_pool = L1Pool(GEOMETRY, 2 * num_pages + 8, device)
        transfer = TransferEngine(l1_pool, host_pool, backend="auto")
        kv_bits = l1_pool.kv.view(torch.int16)
        kv_bits.copy_(torch.randint(-2**15, 2**15, kv_bits.shape, dtype=torch.int16, device=device))
        source_pages = list(range(num_pages))
        destination_pages = list(range(num_pages, 2 * num_pages))
        rng = np.random.default_rng(0)
        tokens = rng.integers(1, 2**31 - 1, size=num_pages * GEOMETRY.page_size, dtype=np.int32)
        reservation = client.match(tokens, reserve_backup=True)
        host_pages = list(reservation.backup_page_ids)
        transfer.backup(source_pages, host_pages).wait()
        client.commit_backup(reservation.lease_id, host_pages)
        assert client.flush(timeout_s=30) == []

        # ---- the wire: a cached prefix, matched (lease) and released ----
        def send_match():
            return client.match_async(tokens)

        def finish_match(pending):
            client.release(pending.result().lease_id)

        samples["rpc", "match_async send"] = time_calls(send_match, n, device, after=finish_match)
        pendings: list = []

        def send_and_settle():
            pendings.append(client.match_async(tokens))
            time.sleep(0.002)     # the reply is in by now

        samples["rpc", "result(), reply already in"] = time_calls(
            lambda: pendings[-1].result(), n, device, before=send_and_settle,
            after=lambda reply: client.release(reply.lease_id))
        samples["rpc", "match round trip"] = time_calls(
            lambda: client.match(tokens), n, device, after=lambda reply: client.release(reply.lease_id))
        leases: list[int] = []

        def take_lease():
            leases.append(client.match(tokens).lease_id)

        samples["rpc", "release send"] = time_calls(lambda: client.release(leases.pop()), n, device,
                                                    before=take_lease)
        assert client.flush(timeout_s=30) == []

        # ---- the transfer engine's calls ----
        hit = client.match(tokens)
        assert list(hit.host_page_ids) == host_pages
        started_backups: list = []
        started_restores: list = []
        samples["engine", "start_backup"] = time_calls(
            lambda: transfer.start_backup(source_pages), n, device, after=lambda p: p.cancel().wait())
        samples["engine", "send_to"] = time_calls(
            lambda: started_backups.pop().send_to(host_pages), n, device,
            before=lambda: started_backups.append(transfer.start_backup(source_pages)),
            after=lambda t: t.wait())
        done_transfers: list = []

        def finished_backup():
            t = transfer.start_backup(source_pages).send_to(host_pages)
            torch.cuda.synchronize(device)
            done_transfers.append(t)

        samples["engine", "wait(), device done"] = time_calls(
            lambda: done_transfers.pop().wait(), n, device, before=finished_backup)
        samples["engine", "start_restore"] = time_calls(
            lambda: transfer.start_restore(destination_pages), n, device, after=lambda p: p.cancel().wait())
        samples["engine", "receive_from"] = time_calls(
            lambda: started_restores.pop().receive_from(host_pages), n, device,
            before=lambda: started_restores.append(transfer.start_restore(destination_pages)),
            after=lambda t: t.wait())
        samples["engine", "backup() (serial)"] = time_calls(
            lambda: transfer.backup(source_pages, host_pages), n, device, after=lambda t: t.wait())
        samples["engine", "restore() (serial)"] = time_calls(
            lambda: transfer.restore(host_pages, destination_pages), n, device, after=lambda t: t.wait())
        same = torch.equal(kv_bits[:, :, source_pages], kv_bits[:, :, destination_pages])
        client.release(hit.lease_id)

        # ---- primitives ----
        l1_bits = l1_pool.kv.view(torch.int16)
        packed = torch.empty((num_pages, *GEOMETRY.page_shape), dtype=torch.int16, device=device)
        ids_host = torch.tensor(source_pages, dtype=torch.int64).pin_memory()
        ids = ids_host.to(device)
        stream = torch.cuda.Stream(device=device)
        event = torch.cuda.Event()
        pool_kernels = kernels.PoolKernels(l1_bits)
        plan = pool_kernels._plan
        grid = (num_pages * plan.num_slabs_per_page, plan.num_blocks_per_slab)
        kernel_args = (l1_bits, packed, ids, ids.stride(0), plan.num_slabs_per_page, plan.num_pages,
                       plan.page_elements)
        pool_bytes = host_pool.byte_view()

        samples["primitive", "PoolKernels.gather (engine's Triton call)"] = time_calls(
            lambda: pool_kernels.gather(ids, packed, check_bounds=False), n, device)
        compiled = kernels._copy_pages_kernel[grid](*kernel_args, GATHER=True, BLOCK_SIZE=plan.block_size,
                                                     EVEN_BLOCKS=True)
        samples["primitive", "_copy_pages_kernel[grid](...)"] = time_calls(
            lambda: kernels._copy_pages_kernel[grid](*kernel_args, GATHER=True, BLOCK_SIZE=plan.block_size,
                                                     EVEN_BLOCKS=True), n, device)
        try:
            bound = (*kernel_args, True, plan.block_size, True)

            def direct():
                compiled.run(grid[0], grid[1], 1, torch.cuda.current_stream(device).cuda_stream, compiled.function,
                             compiled.packed_metadata, None, None, None, *bound)

            direct()
            torch.cuda.synchronize(device)
            samples["primitive", "compiled kernel .run (no binder)"] = time_calls(direct, n, device)
        except Exception as error:    # the compiled kernel's launcher differs between Triton versions
            notes["compiled kernel .run"] = f"{type(error).__name__}: {error}"
        samples["primitive", "torch index_select gather"] = time_calls(
            lambda: torch.index_select(l1_bits, 2, ids, out=packed.permute(1, 2, 0, 3, 4, 5)), n, device)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                pool_kernels.gather(ids, packed, check_bounds=False)
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                ids.copy_(ids_host, non_blocking=True)
                pool_kernels.gather(ids, packed, check_bounds=False)
            samples["primitive", "CUDA graph replay (ids upload + gather)"] = time_calls(graph.replay, n, device)
        except Exception as error:
            notes["CUDA graph"] = f"{type(error).__name__}: {error}"
        samples["primitive", "ids upload copy_ (pinned, non_blocking)"] = time_calls(
            lambda: ids.copy_(ids_host, non_blocking=True), n, device)
        samples["primitive", "DMA call: pool slice copy_ (D2H)"] = time_calls(
            lambda: pool_bytes[host_pages[0] * GEOMETRY.bytes_per_page:][:num_bytes].copy_(
                packed.view(torch.uint8).view(-1), non_blocking=True), n, device)
        if transfer._runtime is not None:
            runtime, pool_address = transfer._runtime, host_pool.pages.data_ptr()
            samples["primitive", "DMA call: cudaMemcpyAsync by address (D2H)"] = time_calls(
                lambda: runtime.memcpy_async(pool_address + host_pages[0] * GEOMETRY.bytes_per_page,
                                             packed.data_ptr(), num_bytes, cuda_runtime.DEVICE_TO_HOST,
                                             stream.cuda_stream), n, device)
        else:
            notes["cudaMemcpyAsync by address"] = "no CUDA runtime library to call: the engine copies through torch"
        samples["primitive", "Event.record"] = time_calls(lambda: event.record(stream), n, device)
        samples["primitive", "Stream.wait_event"] = time_calls(lambda: stream.wait_event(event), n, device)
        samples["primitive", "torch.cuda.current_stream"] = time_calls(
            lambda: torch.cuda.current_stream(device.index), n, device)
        samples["primitive", "torch.cuda.set_stream"] = time_calls(
            lambda: torch.cuda.set_stream(torch.cuda.default_stream(device)), n, device)
        samples["primitive", "host_pool.byte_view"] = time_calls(host_pool.byte_view, n, device)
        samples["primitive", "_page_id_array (list)"] = time_calls(
            lambda: _page_id_array("ids", host_pages, host_pool.num_pages), n, device)
        samples["primitive", "Event.synchronize, done"] = time_calls(event.synchronize, n, device)

        raw = RawDma(num_bytes, device)
        dma_seconds = statistics.median(raw.seconds("D2H", num_bytes) for _ in range(20))
        assert client.flush(timeout_s=30) == []
        status = client.status(check_integrity=True)
        assert status["integrity"] == "ok", status["integrity"]
        pool_bytes = None   # the pool closes only once no view of it is left
        backends = transfer.backend_report()
        transfer.close()
        host_pool.close()
        client.close()
    finally:
        daemon.stop()
        daemon.cleanup()

    rows = [{"group": group, "step": step, "median_us": statistics.median(values) * 1e6,
             "p90_us": percentile(values, 90) * 1e6,
             "share_of_dma": statistics.median(values) / dma_seconds}
            for (group, step), values in samples.items()]
    print_table(rows, COLUMNS)
    print(f"raw DMA of {num_bytes} bytes: {dma_seconds * 1e3:.3f} ms; restore bit-exact: {same}; notes: {notes}")
    path = write_result(args.name, {
        "tokens": args.tokens, "pages": num_pages, "bytes": num_bytes, "iterations": n,
        "client_spin_us": args.client_spin_us, "daemon_spin_us": args.daemon_spin_us,
        "timing": "perf_counter around one call, device synchronized before each (untimed)",
        "raw_dma_ms": dma_seconds * 1e3, "bit_exact": same, "notes": notes,
        "backends": backends, "rows": rows,
        "raw_samples_us": {f"{group}/{step}": [s * 1e6 for s in values] for (group, step), values in samples.items()},
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
