"""Page transfers between an L1 pool and a mapped shared L2 segment: exact bits, layout, validation,
workspace reuse. Runs on CPU here; the "cuda" cases run the same checks on a GPU."""

from __future__ import annotations

import mmap
import os
import threading
import uuid
from typing import NamedTuple

import numpy as np
import pytest
import torch

from engine_client import kernels, transfer as transfer_module
from engine_client.l1_pool import L1Pool
from engine_client.shared_pool import SharedHostPool
from engine_client.transfer import (TorchBackend, TransferEngine, TritonBackend, WorkspaceInfo,
                                    available_backends, register_backend)
from proto.messages import KVGeometry
from tests.engine_client.test_shared_pool import CHUNK_BYTES, FakeCuda, shm_segment

ALL_DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

L1_SOURCE_PAGES = [7, 2, 9, 4]
L1_DESTINATION_PAGES = [0, 11, 5, 3]          # disjoint from the sources
HOST_PAGES = {"contiguous": [3, 4, 5, 6], "fragmented": [8, 1, 5, 2]}
needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton), "auto"]


def make_geometry(dtype: str) -> KVGeometry:
    return KVGeometry(model_id="test-model", num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype, page_size=4)


def fill_random_(tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Random, non-zero-heavy data; float8 gets random bit patterns (NaNs included: we compare bits)."""
    if tensor.element_size() == 1:
        bits = torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=generator)
        tensor.view(torch.uint8).copy_(bits.to(tensor.device))
    else:
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype).to(tensor.device))


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().view(_BITS[tensor.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(as_bits(a), as_bits(b))


class Setup(NamedTuple):
    l1_pool: L1Pool
    host_pool: SharedHostPool
    engine: TransferEngine

    def check_integrity(self) -> None:
        self.l1_pool.check_integrity()
        self.engine.check_integrity()


@pytest.fixture
def make_setup():
    """Builds an L1 pool and a host pool over a real /dev/shm segment, both filled with random data.

    The host pool is pinned on CUDA; pin options (pin_chunk_bytes, pin_in_background, ...) pin it on
    CPU too, which needs the CUDA calls stood in for (see FakeCuda)."""
    cleanups = []

    def build(dtype: str = "bfloat16", device: str = "cpu", num_l1_pages: int = 12, num_host_pages: int = 10,
              backend: str = "torch", seed: int = 0, host_copy_threads: int | None = None,
              fragmented_copy: str = "staging", max_dma_bytes: int | None = None,
              max_slices: int = transfer_module.DEFAULT_MAX_SLICES, **pin_options) -> Setup:
        geometry = make_geometry(dtype)
        offset = mmap.ALLOCATIONGRANULARITY        # a region after another namespace's, as in the daemon
        segment = shm_segment(offset + num_host_pages * geometry.bytes_per_page + mmap.ALLOCATIONGRANULARITY)
        path = segment.__enter__()
        cleanups.append(lambda: segment.__exit__(None, None, None))
        if pin_options and device == "cpu":
            pin_options.setdefault("device", 0)
        host_pool = SharedHostPool.open(path, offset, num_host_pages, geometry,
                                        pin=device == "cuda" or bool(pin_options), **pin_options)
        cleanups.append(host_pool.close)
        l1_pool = L1Pool(geometry, num_l1_pages, device)
        generator = torch.Generator().manual_seed(seed)
        fill_random_(l1_pool.kv, generator)
        fill_random_(host_pool.pages, generator)
        engine = TransferEngine(l1_pool, host_pool, backend=backend, host_copy_threads=host_copy_threads,
                                fragmented_copy=fragmented_copy, max_dma_bytes=max_dma_bytes, max_slices=max_slices)
        cleanups.append(engine.close)
        return Setup(l1_pool, host_pool, engine)

    yield build
    for cleanup in reversed(cleanups):
        cleanup()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("host_layout", sorted(HOST_PAGES))
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_backup_writes_each_l1_page_into_its_host_page_and_nothing_else(make_setup, dtype, host_layout, device):
    """After backup, host page h_i holds L1 page l_i bit for bit in page-major layout; other host pages and
    all of L1 are unchanged."""
    setup = make_setup(dtype, device)
    host_page_ids = HOST_PAGES[host_layout]
    l1_before = setup.l1_pool.kv.clone()
    host_before = setup.host_pool.pages.clone()
    assert not same_bits(host_before[host_page_ids[0]], l1_before[:, :, L1_SOURCE_PAGES[0]])

    transfer = setup.engine.backup(L1_SOURCE_PAGES, host_page_ids)
    setup.check_integrity()
    transfer.wait()
    setup.check_integrity()

    assert transfer.done()
    assert transfer.num_bytes == len(L1_SOURCE_PAGES) * setup.l1_pool.geometry.bytes_per_page
    assert transfer.seconds >= 0
    for l1_page_id, host_page_id in zip(L1_SOURCE_PAGES, host_page_ids):
        assert same_bits(setup.host_pool.pages[host_page_id], l1_before[:, :, l1_page_id])
    untouched = [page_id for page_id in range(setup.host_pool.num_pages) if page_id not in host_page_ids]
    assert same_bits(setup.host_pool.pages[untouched], host_before[untouched])
    assert same_bits(setup.l1_pool.kv, l1_before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("host_layout", sorted(HOST_PAGES))
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_restore_writes_each_host_page_into_its_l1_page_and_nothing_else(make_setup, dtype, host_layout, device):
    """After restore, L1 page l_i holds host page h_i bit for bit; other L1 pages and all host pages are
    unchanged."""
    setup = make_setup(dtype, device)
    host_page_ids = HOST_PAGES[host_layout]
    l1_before = setup.l1_pool.kv.clone()
    host_before = setup.host_pool.pages.clone()
    assert not same_bits(l1_before[:, :, L1_DESTINATION_PAGES[0]], host_before[host_page_ids[0]])

    transfer = setup.engine.restore(host_page_ids, L1_DESTINATION_PAGES)
    transfer.wait()
    setup.check_integrity()

    for host_page_id, l1_page_id in zip(host_page_ids, L1_DESTINATION_PAGES):
        assert same_bits(setup.l1_pool.kv[:, :, l1_page_id], host_before[host_page_id])
    untouched = [page_id for page_id in range(setup.l1_pool.num_pages) if page_id not in L1_DESTINATION_PAGES]
    assert same_bits(setup.l1_pool.kv[:, :, untouched], l1_before[:, :, untouched])
    assert same_bits(setup.host_pool.pages, host_before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("host_layout", sorted(HOST_PAGES))
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_backup_then_restore_into_different_pages_round_trips(make_setup, dtype, host_layout, device, backend):
    """Backing up L1 pages and restoring them into different L1 pages reproduces the originals bit for bit,
    with every backend."""
    setup = make_setup(dtype, device, seed=7, backend=backend)
    host_page_ids = HOST_PAGES[host_layout]
    originals = setup.l1_pool.kv[:, :, L1_SOURCE_PAGES].clone()

    setup.engine.backup(L1_SOURCE_PAGES, host_page_ids).wait()
    setup.check_integrity()
    setup.engine.restore(host_page_ids, L1_DESTINATION_PAGES).wait()
    setup.check_integrity()

    assert same_bits(setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES], originals)
    assert same_bits(setup.l1_pool.kv[:, :, L1_SOURCE_PAGES], originals)


def transfer_after_late_caller_write(setup: Setup, device: str, direction: str, host_layout: str,
                                     seed: int = 99) -> bool:
    """Queue, on the caller's stream and behind ~0.1 s of GPU sleep, a write to the L1 pages a transfer
    uses, then run the transfer at once. True if the transfer was ordered after that write: a backup
    copied the freshly written pages; a restore's pages were not overwritten by the late write.
    Repeated calls on one setup need a new seed each: the write must differ from what is there."""
    host_page_ids = HOST_PAGES[host_layout]
    l1_page_ids = L1_SOURCE_PAGES if direction == "D2H" else L1_DESTINATION_PAGES
    late = torch.empty_like(setup.l1_pool.kv[:, :, l1_page_ids])
    fill_random_(late, torch.Generator().manual_seed(seed))
    assert not same_bits(late, setup.l1_pool.kv[:, :, l1_page_ids]), "the late write would change nothing"
    page_index = torch.tensor(l1_page_ids, device=device)
    # Warm up (first allocations and lazy kernel loading synchronize the device) without changing L1.
    setup.l1_pool.kv.index_copy_(2, page_index, setup.l1_pool.kv[:, :, l1_page_ids].clone())
    setup.engine.backup(l1_page_ids, host_page_ids).wait()
    host_before = setup.host_pool.pages.clone()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)    # keeps the caller's stream busy, so the write below lands late
    setup.l1_pool.kv.index_copy_(2, page_index, late)       # queued, no host synchronization
    if direction == "D2H":
        setup.engine.backup(l1_page_ids, host_page_ids).wait()
        setup.check_integrity()
        return same_bits(setup.host_pool.pages[host_page_ids], late.permute(2, 0, 1, 3, 4, 5))
    setup.engine.restore(host_page_ids, l1_page_ids).wait()
    setup.check_integrity()
    if device == "cuda":
        torch.cuda.synchronize()
    restored = setup.l1_pool.kv[:, :, l1_page_ids].permute(2, 0, 1, 3, 4, 5)
    return same_bits(restored, host_before[host_page_ids])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("host_layout", sorted(HOST_PAGES))
@pytest.mark.parametrize("direction", ["D2H", "H2D"])
def test_transfers_are_ordered_after_work_already_queued_on_the_callers_stream(make_setup, device, direction,
                                                                               host_layout):
    """A backup copies L1 pages written on the caller's stream just before it; a restore lands after a
    write to its destination pages queued on the caller's stream just before it."""
    setup = make_setup("bfloat16", device, backend="triton" if kernels.triton_available() else "torch")
    assert transfer_after_late_caller_write(setup, device, direction, host_layout)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("direction", ["D2H", "H2D"])
def test_without_the_wait_on_the_callers_stream_the_ordering_test_fails(make_setup, monkeypatch, direction):
    """Control for the test above: with the transfer stream's wait on the caller's stream removed, the
    late caller write and the transfer race and the check fails, so that test can catch a missing wait."""
    setup = make_setup("bfloat16", "cuda")
    monkeypatch.setattr(TransferEngine, "_wait_for_callers", staticmethod(lambda stream, callers_stream, workspace: None))
    monkeypatch.setattr(TransferEngine, "_wait_for_callers_by_handle", lambda self, workspace: None)
    assert not transfer_after_late_caller_write(setup, "cuda", direction, "fragmented")


def count_graph_launches(engine: TransferEngine) -> list[int]:
    """Every cudaGraphLaunch the engine makes from now on appends 1 to the returned list."""
    launches = []
    launch = engine._runtime.graph_launch
    engine._runtime.graph_launch = lambda *args: (launches.append(1), launch(*args))
    return launches


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("direction", ["D2H", "H2D"])
def test_recurring_transfers_run_as_cuda_graphs_exact_and_after_the_callers_stream(monkeypatch, make_setup,
                                                                                 direction, sliced):
    """A gather or scatter wanted again is captured and then launched as a CUDA graph: each repetition
    is still bit-exact and still ordered after a late write queued on the caller's stream."""
    if sliced:
        monkeypatch.setattr(transfer_module, "_MIN_SLICE_BYTES", 1)
    setup = make_setup("bfloat16", "cuda", backend="triton")
    assert setup.engine.backend_report()["cuda_graphs"] == {"D2H": True, "H2D": True}
    launches = count_graph_launches(setup.engine)
    for repetition in range(4):
        assert transfer_after_late_caller_write(setup, "cuda", direction, "contiguous", seed=repetition), repetition
    assert setup.engine.num_graphs_captured >= (4 if sliced else 1)
    assert len(launches) >= 2 * (4 if sliced else 1)


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("direction", ["D2H", "H2D"])
def test_without_the_wait_on_the_callers_stream_graph_launches_race(monkeypatch, make_setup, direction):
    """Control for the test above: with the wait by handle removed, once the graphs run, the late
    caller write and the transfer race and the check fails."""
    setup = make_setup("bfloat16", "cuda", backend="triton")
    for repetition in range(3):       # the gathers and scatters of this size are graphs after this
        assert transfer_after_late_caller_write(setup, "cuda", direction, "contiguous", seed=repetition)
    launches = count_graph_launches(setup.engine)
    monkeypatch.setattr(TransferEngine, "_wait_for_callers_by_handle", lambda self, workspace: None)
    assert not transfer_after_late_caller_write(setup, "cuda", direction, "contiguous", seed=3)
    assert launches


def started_transfer_after_late_caller_write(setup: Setup, direction: str, seed: int) -> bool:
    """transfer_after_late_caller_write for start_backup + send_to and start_restore + receive_from."""
    kv, host_pages = setup.l1_pool.kv, HOST_PAGES["contiguous"]
    l1_page_ids = L1_SOURCE_PAGES if direction == "D2H" else L1_DESTINATION_PAGES
    late = torch.empty_like(kv[:, :, l1_page_ids])
    fill_random_(late, torch.Generator().manual_seed(seed))
    page_index = torch.tensor(l1_page_ids, device="cuda")
    host_before = setup.host_pool.pages.clone()
    assert not same_bits(late.permute(2, 0, 1, 3, 4, 5), host_before[host_pages])
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    kv.index_copy_(2, page_index, late)
    if direction == "D2H":
        setup.engine.start_backup(l1_page_ids).send_to(host_pages).wait()
        return same_bits(setup.host_pool.pages[host_pages], late.permute(2, 0, 1, 3, 4, 5))
    setup.engine.start_restore(l1_page_ids).receive_from(host_pages).wait()
    torch.cuda.synchronize()
    return same_bits(kv[:, :, l1_page_ids].permute(2, 0, 1, 3, 4, 5), host_before[host_pages])


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("direction", ["D2H", "H2D"])
def test_started_transfers_through_graphs_wait_for_the_callers_stream(monkeypatch, make_setup, direction):
    """Started backups and restores, repeated until their gathers and scatters are graphs, still
    order after a late write on the caller's stream; with the wait by handle removed they do not."""
    setup = make_setup("bfloat16", "cuda", backend="triton")
    launches = count_graph_launches(setup.engine)
    for repetition in range(4):
        assert started_transfer_after_late_caller_write(setup, direction, seed=10 + repetition), repetition
    assert launches
    monkeypatch.setattr(TransferEngine, "_wait_for_callers_by_handle", lambda self, workspace: None)
    assert not started_transfer_after_late_caller_write(setup, direction, seed=99)


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("fragmented_copy", ["staging", "dma_per_run"])
def test_fragmented_transfers_through_graphs_are_exact(make_setup, fragmented_copy):
    """Fragmented host pages (staged, or one DMA per run) through graph launches: every repetition
    moves the same bits as the first."""
    setup = make_setup("bfloat16", "cuda", backend="triton", fragmented_copy=fragmented_copy)
    engine, host_pages = setup.engine, HOST_PAGES["fragmented"]
    launches = count_graph_launches(engine)
    expected = setup.l1_pool.kv[:, :, L1_SOURCE_PAGES].permute(2, 0, 1, 3, 4, 5).clone()
    generator = torch.Generator().manual_seed(12)
    for repetition in range(3):
        fill_random_(setup.host_pool.pages, generator)
        engine.backup(L1_SOURCE_PAGES, host_pages).wait()
        assert same_bits(setup.host_pool.pages[host_pages], expected), repetition
        noise = torch.empty_like(setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES])
        fill_random_(noise, generator)                    # the restore must write them again
        setup.l1_pool.kv.index_copy_(2, torch.tensor(L1_DESTINATION_PAGES, device="cuda"), noise)
        engine.restore(host_pages, L1_DESTINATION_PAGES).wait()
        assert same_bits(setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES].permute(2, 0, 1, 3, 4, 5), expected)
        setup.check_integrity()
    assert launches and engine.num_graphs_captured == 2


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_a_failed_capture_turns_graphs_off_and_transfers_go_on(monkeypatch, make_setup):
    """A gather that cannot be captured: the engine says so in its report, launches directly from
    then on, and every transfer is still exact."""
    setup = make_setup("bfloat16", "cuda", backend="triton")
    engine = setup.engine
    gather = engine.gather_backend.gather

    def uncapturable(*args):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("cannot be captured (on purpose)")
        return gather(*args)

    monkeypatch.setattr(engine.gather_backend, "gather", uncapturable)
    launches = count_graph_launches(engine)
    expected = setup.l1_pool.kv[:, :, L1_SOURCE_PAGES].permute(2, 0, 1, 3, 4, 5).clone()
    generator = torch.Generator().manual_seed(13)
    for repetition in range(3):
        fill_random_(setup.host_pool.pages, generator)
        engine.backup(L1_SOURCE_PAGES, HOST_PAGES["contiguous"]).wait()
        assert same_bits(setup.host_pool.pages[HOST_PAGES["contiguous"]], expected), repetition
    assert engine.backend_report()["cuda_graphs"] == {"D2H": False, "H2D": False}
    assert launches == [] and engine.num_graphs_captured == 0
    setup.check_integrity()


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_started_transfers_through_graphs_are_exact_and_graphs_can_be_turned_off(make_setup):
    """Started backups and restores repeated (graphs from the second on) move the same bits as the
    first; an engine built with cuda_graphs=False never launches one."""
    setup = make_setup("bfloat16", "cuda", backend="triton")
    engine = setup.engine
    launches = count_graph_launches(engine)
    expected = setup.l1_pool.kv[:, :, L1_SOURCE_PAGES].permute(2, 0, 1, 3, 4, 5).clone()
    generator = torch.Generator().manual_seed(11)
    for repetition in range(3):
        fill_random_(setup.host_pool.pages, generator)
        engine.start_backup(L1_SOURCE_PAGES).send_to(HOST_PAGES["contiguous"]).wait()
        assert same_bits(setup.host_pool.pages[HOST_PAGES["contiguous"]], expected), repetition
        setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES] = 0
        engine.start_restore(L1_DESTINATION_PAGES).receive_from(HOST_PAGES["contiguous"]).wait()
        restored = setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES].permute(2, 0, 1, 3, 4, 5)
        assert same_bits(restored, expected), repetition
        setup.check_integrity()
    assert launches and engine.num_graphs_captured == 2

    plain = TransferEngine(setup.l1_pool, setup.host_pool, backend="triton", cuda_graphs=False)
    try:
        assert plain.backend_report()["cuda_graphs"] == {"D2H": False, "H2D": False}
        plain_launches = count_graph_launches(plain)
        for _ in range(3):
            plain.backup(L1_SOURCE_PAGES, HOST_PAGES["contiguous"]).wait()
            plain.restore(HOST_PAGES["contiguous"], L1_DESTINATION_PAGES).wait()
        assert plain_launches == [] and plain.num_graphs_captured == 0
    finally:
        plain.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("host_layout", sorted(HOST_PAGES))
def test_cuda_transfers_return_before_the_device_work_completes(make_setup, host_layout):
    """On CUDA, backup() and restore() queue their work and return: while the caller's stream is still busy
    they report not done, and wait() then delivers the pages."""
    setup = make_setup("bfloat16", "cuda")
    host_page_ids = HOST_PAGES[host_layout]
    setup.engine.restore(host_page_ids, L1_DESTINATION_PAGES).wait()     # warm up (see above)
    host_before = setup.host_pool.pages.clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    restore = setup.engine.restore(host_page_ids, L1_DESTINATION_PAGES)
    backup = setup.engine.backup(L1_SOURCE_PAGES[:2], [9, 0])      # host pages the restore does not read
    assert not restore.done() and not backup.done()
    setup.check_integrity()
    restore.wait()
    backup.wait()
    setup.check_integrity()
    assert same_bits(setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES], host_before[host_page_ids].permute(1, 2, 0, 3, 4, 5))
    backed_up = setup.l1_pool.kv[:, :, L1_SOURCE_PAGES[:2]].permute(2, 0, 1, 3, 4, 5)
    assert same_bits(setup.host_pool.pages[[9, 0]], backed_up)


def test_page_ids_may_be_tensors_and_sources_may_repeat(make_setup):
    """Integer tensors are accepted as page ids, and one source page may be backed up to two host pages."""
    setup = make_setup()
    setup.engine.backup(torch.tensor([3, 3]), torch.tensor([0, 9])).wait()
    setup.check_integrity()
    assert same_bits(setup.host_pool.pages[0], setup.l1_pool.kv[:, :, 3])
    assert same_bits(setup.host_pool.pages[9], setup.l1_pool.kv[:, :, 3])


@pytest.mark.parametrize("call, args, message", [
    ("backup", ([1, 2], [3]), "has 2 pages but host_page_ids has 1"),
    ("restore", ([3], [1, 2]), "has 2 pages but host_page_ids has 1"),
    ("backup", ([1, 12], [0, 1]), "l1_page_ids holds page 12, out of range 0..11"),
    ("backup", ([1, -1], [0, 1]), "l1_page_ids holds page -1"),
    ("backup", ([1, 2], [0, 10]), "host_page_ids holds page 10, out of range 0..9"),
    ("restore", ([10, 0], [1, 2]), "host_page_ids holds page 10"),
    ("restore", ([0, 1], [1, 12]), "l1_page_ids holds page 12"),
    ("backup", ([1, 2, 3], [4, 5, 4]), "destination host_page_ids lists page 4 more than once"),
    ("restore", ([4, 5, 6], [1, 2, 1]), "destination l1_page_ids lists page 1 more than once"),
    ("backup", ([1, 2, 3, 4], [7, 3, 7, 3]), "destination host_page_ids lists page 3 more than once"),
    ("restore", ([0, 1, 2], [5, 6, 6]), "destination l1_page_ids lists page 6 more than once"),
    ("backup", ([1, 2], np.array([3, 2**64 - 1], dtype=np.uint64)), "host_page_ids holds page -1"),
])
def test_invalid_page_ids_raise_and_change_nothing(make_setup, call, args, message):
    """Mismatched lengths, out-of-range ids and repeated destinations raise ValueError before any page or
    workspace is touched."""
    setup = make_setup()
    l1_before = setup.l1_pool.kv.clone()
    host_before = setup.host_pool.pages.clone()
    with pytest.raises(ValueError, match=message):
        getattr(setup.engine, call)(*args)
    setup.check_integrity()
    assert setup.engine.num_in_flight == 0 and setup.engine.num_workspaces_created == 0
    assert same_bits(setup.l1_pool.kv, l1_before) and same_bits(setup.host_pool.pages, host_before)


def test_non_integer_page_ids_raise_type_error(make_setup):
    """A float page id is refused with TypeError."""
    setup = make_setup()
    with pytest.raises(TypeError):
        setup.engine.backup([1.0], [2])
    with pytest.raises(ValueError, match="integer tensor"):
        setup.engine.backup(torch.tensor([1.0]), [2])


def test_empty_transfer_is_complete_at_once(make_setup):
    """A transfer of no pages is done immediately, moves 0 bytes and takes no workspace."""
    setup = make_setup()
    transfer = setup.engine.restore([], [])
    assert transfer.done() and transfer.num_bytes == 0 and transfer.seconds == 0
    assert setup.engine.num_workspaces_created == 0 and setup.engine.num_in_flight == 0


def test_seconds_is_only_available_after_completion(make_setup):
    """Reading .seconds of a transfer not yet polled raises RuntimeError; after wait() it is a duration."""
    setup = make_setup()
    transfer = setup.engine.backup([1, 2], [7, 0])
    with pytest.raises(RuntimeError, match="not completed"):
        _ = transfer.seconds
    transfer.wait()
    assert transfer.seconds >= 0


def test_mismatched_geometry_and_unknown_backend_are_refused(make_setup):
    """An L1 pool whose geometry differs from the host pool's, or an unknown backend name, raises ValueError."""
    setup = make_setup("bfloat16")
    other_l1 = L1Pool(make_geometry("float16"), 4)
    with pytest.raises(ValueError, match="differs from host pool"):
        TransferEngine(other_l1, setup.host_pool)
    with pytest.raises(ValueError, match="unknown transfer backend 'no-such-backend'"):
        TransferEngine(setup.l1_pool, setup.host_pool, backend="no-such-backend")


def test_registered_backend_is_selected_by_name(make_setup):
    """A backend registered under a name is the one whose gather and scatter an engine of that name calls."""
    calls: list[str] = []

    class CountingBackend(TorchBackend):
        name = "counting"

        def gather(self, l1_kv, page_ids, out):
            calls.append("gather")
            super().gather(l1_kv, page_ids, out)

        def scatter(self, packed, page_ids, l1_kv):
            calls.append("scatter")
            super().scatter(packed, page_ids, l1_kv)

    name = f"counting-{uuid.uuid4().hex}"
    register_backend(name, CountingBackend)
    assert name in available_backends()
    with pytest.raises(ValueError, match="already registered"):
        register_backend(name, CountingBackend)
    setup = make_setup(backend=name)
    originals = setup.l1_pool.kv[:, :, [1, 2]].clone()
    setup.engine.backup([1, 2], [5, 3]).wait()
    setup.engine.restore([5, 3], [8, 9]).wait()
    assert calls == ["gather", "scatter"]
    assert same_bits(setup.l1_pool.kv[:, :, [8, 9]], originals)


def test_workspaces_are_reused_best_fit_and_only_the_largest_is_kept(make_setup):
    """A transfer reuses an idle workspace that is large enough, allocates a new one otherwise, and after
    completion only the largest idle workspace is kept; staging appears only for fragmented host pages."""
    setup = make_setup(num_l1_pages=12, num_host_pages=10)
    engine = setup.engine

    engine.backup([0, 1, 2, 3], [0, 1, 2, 3]).wait()
    assert (engine.num_workspaces_created, engine.num_stagings_created) == (1, 0)
    assert engine.idle_workspaces == [WorkspaceInfo(4, False)]

    engine.restore([4, 5], [6, 7]).wait()
    assert engine.num_workspaces_created == 1
    assert engine.idle_workspaces == [WorkspaceInfo(4, False)]

    engine.backup(list(range(6)), list(range(6))).wait()
    assert engine.num_workspaces_created == 2
    assert engine.idle_workspaces == [WorkspaceInfo(6, False)]

    engine.backup([0, 1, 2], [9, 0, 5]).wait()
    assert (engine.num_workspaces_created, engine.num_stagings_created) == (2, 1)
    assert engine.idle_workspaces == [WorkspaceInfo(6, True)]

    engine.restore([9, 0, 5, 2], [8, 9, 10, 11]).wait()
    assert (engine.num_workspaces_created, engine.num_stagings_created) == (2, 1)
    setup.check_integrity()


@pytest.mark.parametrize("completion_order", ["staged_first", "direct_first"])
def test_in_flight_transfers_never_share_a_workspace_and_staging_wins_ties(make_setup, completion_order):
    """Two transfers in flight at once get two workspaces; of two equal idle ones, the one with staging is
    kept, whichever completes first."""
    setup = make_setup()
    engine = setup.engine
    direct = engine.backup([0, 1, 2, 3], [0, 1, 2, 3])
    staged = engine.backup([4, 5, 6, 7], [9, 7, 5, 4])
    setup.check_integrity()
    assert engine.num_in_flight == 2 and engine.num_workspaces_created == 2
    first, second = (staged, direct) if completion_order == "staged_first" else (direct, staged)
    first.wait()
    setup.check_integrity()
    second.wait()
    setup.check_integrity()
    assert engine.num_in_flight == 0
    assert engine.idle_workspaces == [WorkspaceInfo(4, True)]


def test_staged_backup_lands_once_polled_and_drain_finishes_all(make_setup):
    """Several fragmented backups left unpolled are all written to their host pages by drain()."""
    setup = make_setup()
    pairs = [([0, 1], [9, 2]), ([2, 3], [6, 0]), ([4, 5], [1, 8])]
    transfers = [setup.engine.backup(l1_ids, host_ids) for l1_ids, host_ids in pairs]
    assert setup.engine.num_in_flight == 3
    setup.engine.drain()
    setup.check_integrity()
    assert setup.engine.num_in_flight == 0 and all(transfer.done() for transfer in transfers)
    for l1_ids, host_ids in pairs:
        assert same_bits(setup.host_pool.pages[host_ids], setup.l1_pool.kv[:, :, l1_ids].permute(2, 0, 1, 3, 4, 5))


def test_host_pool_closes_only_after_transfers_complete(make_setup):
    """A pending transfer keeps views of the host pool, so close() refuses; once drained, close() succeeds."""
    setup = make_setup()
    transfer = setup.engine.restore([3, 4], [0, 1])
    with pytest.raises(RuntimeError, match="still alive"):
        setup.host_pool.close()
    transfer.wait()
    setup.host_pool.close()
    assert setup.host_pool.closed


# ---- backends ------------------------------------------------------------------------------------


def test_auto_on_cpu_chooses_torch_without_timing(make_setup):
    """On CPU, auto uses torch in both directions and says why in its report, with no timings."""
    setup = make_setup(backend="auto")
    report = setup.engine.backend_report()
    assert report["requested"] == "auto" and report["chosen"] == {"D2H": "torch", "H2D": "torch"}
    assert "timings_ms" not in report and "cpu" in report["reason"]
    assert setup.engine.gather_backend.name == setup.engine.scatter_backend.name == "torch"


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_an_explicit_backend_is_used_in_both_directions_and_reported(make_setup, backend):
    """An explicitly named backend does both the gather and the scatter, and the report names it for both."""
    setup = make_setup(backend=backend)
    assert setup.engine.gather_backend.name == setup.engine.scatter_backend.name == backend
    assert setup.engine.backend_report() == {"requested": backend, "chosen": {"D2H": backend, "H2D": backend},
                                             "cuda_graphs": {"D2H": False, "H2D": False}}     # on CPU: none


def test_triton_requested_without_triton_raises(make_setup, monkeypatch):
    """Asking for the triton backend where triton is missing raises RuntimeError instead of using torch."""
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        make_setup(backend="triton")


def test_a_failing_explicit_backend_raises_and_leaves_nothing_in_flight(make_setup):
    """When the chosen backend's kernel fails, backup() raises that error (no silent fallback), the
    transfer is not left pending and host pages are unchanged."""

    class BrokenBackend(TorchBackend):
        name = "broken"

        def gather(self, l1_kv, page_ids, out):
            raise RuntimeError("gather kernel failed (on purpose)")

    name = f"broken-{uuid.uuid4().hex}"
    register_backend(name, BrokenBackend)
    setup = make_setup(backend=name)
    host_before = setup.host_pool.pages.clone()
    with pytest.raises(RuntimeError, match="on purpose"):
        setup.engine.backup([1, 2], [3, 4])
    setup.check_integrity()
    assert setup.engine.num_in_flight == 0
    assert same_bits(setup.host_pool.pages, host_before)


def test_auto_cannot_be_registered_and_is_listed():
    """'auto' is always among the available backends and cannot be taken by a registration."""
    assert {"auto", "torch", "triton"} <= set(available_backends())
    with pytest.raises(ValueError, match="already registered"):
        register_backend("auto", TorchBackend)


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_auto_times_both_backends_keeps_the_faster_per_direction_and_leaves_l1_unchanged(make_setup):
    """On a GPU, auto times torch and triton for the gather (D2H) and the scatter (H2D), chooses the one
    with the smaller median per direction, and leaves the L1 pool bit for bit as it was."""
    geometry = make_geometry("bfloat16")
    l1_pool = L1Pool(geometry, 80, "cuda")
    fill_random_(l1_pool.kv, torch.Generator().manual_seed(5))
    l1_before = l1_pool.kv.clone()
    setup = make_setup("bfloat16", "cuda")
    engine = TransferEngine(l1_pool, setup.host_pool, backend="auto")
    try:
        report = engine.backend_report()
        torch.cuda.synchronize()
        assert same_bits(l1_pool.kv, l1_before)
        assert report["timed_pages"] == transfer_module.AUTO_TIMING_PAGES
        for direction, backend in (("D2H", engine.gather_backend), ("H2D", engine.scatter_backend)):
            timings = report["timings_ms"][direction]
            assert set(timings) == {"torch", "triton"} and all(ms > 0 for ms in timings.values())
            assert report["chosen"][direction] == min(timings, key=timings.get) == backend.name
    finally:
        engine.close()


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_auto_leaves_out_a_backend_that_fails(make_setup, monkeypatch):
    """If a candidate fails while being timed, auto picks among the others and reports the failure."""
    def broken_gather(self, l1_kv, page_ids, out):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(TritonBackend, "gather", broken_gather)
    setup = make_setup("bfloat16", "cuda", backend="auto")
    report = setup.engine.backend_report()
    assert report["chosen"] == {"D2H": "torch", "H2D": "torch"}
    assert "no kernel today" in report["errors"]["triton"]
    setup.engine.backup([1, 2], [8, 3]).wait()
    assert same_bits(setup.host_pool.pages[[8, 3]], setup.l1_pool.kv[:, :, [1, 2]].permute(2, 0, 1, 3, 4, 5))


# ---- host-side copies and pinned chunks ------------------------------------------------------------


def test_runs_of_consecutive_ids():
    """Runs are maximal ascending-by-one stretches, as (position, first id, length), in order."""
    assert transfer_module._runs_of_consecutive_ids([8, 9, 10, 1, 5, 6, 2]) == [
        (0, 8, 3), (3, 1, 1), (4, 5, 2), (6, 2, 1)]
    assert transfer_module._runs_of_consecutive_ids([4]) == [(0, 4, 1)]


def test_split_segments_keeps_every_byte_once_in_order_and_bounds_each_task():
    """Splitting segments into tasks keeps their bytes in order, cuts segments where needed, and gives no
    task more than the share."""
    segments = [(100, 0, 7), (0, 7, 2), (50, 9, 12)]
    tasks = transfer_module._split_segments(segments, 5)
    assert all(sum(n for *_, n in task) <= 5 for task in tasks) and len(tasks) == 5
    flat = [(d + i, s + i) for task in tasks for d, s, n in task for i in range(n)]
    expected = [(d + i, s + i) for d, s, n in segments for i in range(n)]
    assert flat == expected


@pytest.mark.parametrize("direction", ["D2H", "H2D"])
def test_fragmented_host_copies_split_across_threads_are_bit_exact(make_setup, monkeypatch, direction):
    """With the host-side copy split across threads (pieces smaller than a page), a fragmented backup or
    restore still moves every page bit for bit and touches nothing else."""
    monkeypatch.setattr(transfer_module, "_MIN_BYTES_PER_COPY_THREAD", 100)
    setup = make_setup(host_copy_threads=3, num_host_pages=10)
    host_page_ids = [8, 9, 1, 5, 6, 2, 0]
    l1_page_ids = [7, 2, 9, 4, 10, 0, 11]
    l1_before = setup.l1_pool.kv.clone()
    host_before = setup.host_pool.pages.clone()
    if direction == "D2H":
        setup.engine.backup(l1_page_ids, host_page_ids).wait()
    else:
        setup.engine.restore(host_page_ids, l1_page_ids).wait()
    setup.check_integrity()
    assert setup.engine._copy_pool is not None        # the copy really went through the threads
    if direction == "D2H":
        expected_host = host_before.clone()
        expected_host[host_page_ids] = l1_before[:, :, l1_page_ids].permute(2, 0, 1, 3, 4, 5)
        assert same_bits(setup.host_pool.pages, expected_host)
        assert same_bits(setup.l1_pool.kv, l1_before)
    else:
        expected_l1 = l1_before.clone()
        expected_l1[:, :, l1_page_ids] = host_before[host_page_ids].permute(1, 2, 0, 3, 4, 5)
        assert same_bits(setup.l1_pool.kv, expected_l1)
        assert same_bits(setup.host_pool.pages, host_before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_copy_threads_run_on_the_cpus_the_engine_was_built_with(make_setup, monkeypatch):
    """An engine thread pinned to one CPU after the engine was built (as with connect(cpu=...)) does
    not pass that pin on to the host-copy threads it starts: they keep the build-time CPUs."""
    monkeypatch.setattr(transfer_module, "_MIN_BYTES_PER_COPY_THREAD", 100)
    setup = make_setup(host_copy_threads=3)
    built_with = os.sched_getaffinity(0)
    result = {}

    def pinned_engine_thread() -> None:
        os.sched_setaffinity(0, {min(built_with)})
        setup.engine.backup([7, 2, 9, 4], [8, 1, 5, 2]).wait()        # fragmented: the copy threads start
        assert setup.engine._copy_pool is not None
        result["engine"] = os.sched_getaffinity(0)
        result["copy"] = setup.engine._copy_pool.submit(os.sched_getaffinity, 0).result()

    thread = threading.Thread(target=pinned_engine_thread)
    thread.start()
    thread.join()
    assert result["engine"] == {min(built_with)}
    assert result["copy"] == built_with
    setup.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_direct_transfers_cut_at_pinned_chunk_boundaries_are_bit_exact(monkeypatch, make_setup, device):
    """With the host pool pinned in chunks smaller than a page, a contiguous backup and restore whose bytes
    cross several chunk boundaries (mid-page) still move every page bit for bit."""
    if device == "cpu":
        FakeCuda().install(monkeypatch)
    setup = make_setup(device=device, num_host_pages=10, pin_chunk_bytes=CHUNK_BYTES)
    host_page_ids = list(range(1, 9))
    assert len(setup.host_pool.chunk_pieces(1 * setup.engine.bytes_per_page, 9 * setup.engine.bytes_per_page)) > 2
    originals = setup.l1_pool.kv[:, :, [11, 2, 9, 4, 0, 7, 5, 1]].clone()
    setup.engine.backup([11, 2, 9, 4, 0, 7, 5, 1], host_page_ids).wait()
    setup.check_integrity()
    assert same_bits(setup.host_pool.pages[host_page_ids], originals.permute(2, 0, 1, 3, 4, 5))
    setup.engine.restore(host_page_ids, [3, 6, 8, 10, 0, 2, 4, 5]).wait()
    setup.check_integrity()
    assert same_bits(setup.l1_pool.kv[:, :, [3, 6, 8, 10, 0, 2, 4, 5]], originals)


def test_a_direct_transfer_waits_until_its_chunks_are_pinned_and_a_staged_one_does_not(monkeypatch, make_setup):
    # (monkeypatch first: its stand-ins must outlive the pool, which make_setup closes at teardown)
    """While the pool is pinned in the background, a backup straight into host pages blocks until their
    chunks are pinned; a fragmented backup (host-side copy, no DMA into the pool) does not wait."""
    fake = FakeCuda(hold=True).install(monkeypatch)
    setup = make_setup(num_host_pages=10, pin_chunk_bytes=CHUNK_BYTES, pin_in_background=True, pin_threads=1)
    try:
        setup.engine.backup([0, 1], [9, 2]).wait()          # fragmented: done with nothing pinned
        assert same_bits(setup.host_pool.pages[[9, 2]], setup.l1_pool.kv[:, :, [0, 1]].permute(2, 0, 1, 3, 4, 5))
        done = threading.Event()

        def back_up_directly() -> None:
            setup.engine.backup([3, 4, 5], [5, 6, 7]).wait()
            done.set()

        worker = threading.Thread(target=back_up_directly)
        worker.start()
        assert not done.wait(0.3)                             # its chunks are not pinned yet
        for chunk in range(len(setup.host_pool.chunk_pieces(0, setup.host_pool.nbytes))):
            fake.release(chunk)
        worker.join(10)
        assert done.is_set()
        setup.check_integrity()
        assert same_bits(setup.host_pool.pages[[5, 6, 7]], setup.l1_pool.kv[:, :, [3, 4, 5]].permute(2, 0, 1, 3, 4, 5))
    finally:
        for chunk in range(64):
            fake.release(chunk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunked", [False, True])
def test_fragmented_pages_by_one_dma_per_run_round_trip_without_staging(monkeypatch, make_setup, device, chunked):
    """With fragmented_copy="dma_per_run", a fragmented backup and restore (runs of several lengths, the
    pool optionally pinned in chunks smaller than a page) move every page bit for bit, touch no other
    host page and never allocate staging."""
    pin_options = {}
    if chunked:
        if device == "cpu":
            FakeCuda().install(monkeypatch)
        pin_options = {"pin_chunk_bytes": CHUNK_BYTES}
    setup = make_setup(device=device, fragmented_copy="dma_per_run", **pin_options)
    host_page_ids = [8, 9, 1, 5, 6, 7, 2]
    originals = setup.l1_pool.kv[:, :, [7, 2, 9, 4, 10, 0, 11]].clone()
    host_before = setup.host_pool.pages.clone()
    setup.engine.backup([7, 2, 9, 4, 10, 0, 11], host_page_ids).wait()
    setup.check_integrity()
    untouched = [page for page in range(setup.host_pool.num_pages) if page not in host_page_ids]
    assert same_bits(setup.host_pool.pages[untouched], host_before[untouched])
    assert same_bits(setup.host_pool.pages[host_page_ids], originals.permute(2, 0, 1, 3, 4, 5))
    setup.engine.restore(host_page_ids, [1, 3, 5, 6, 8, 11, 4]).wait()
    setup.check_integrity()
    assert same_bits(setup.l1_pool.kv[:, :, [1, 3, 5, 6, 8, 11, 4]], originals)
    assert setup.engine.num_stagings_created == 0


def test_unknown_fragmented_copy_is_refused(make_setup):
    """A fragmented_copy other than "staging" or "dma_per_run" raises ValueError."""
    setup = make_setup()
    with pytest.raises(ValueError, match="fragmented_copy"):
        TransferEngine(setup.l1_pool, setup.host_pool, fragmented_copy="carrier-pigeon")


def test_page_ids_may_be_numpy_arrays_but_not_booleans(make_setup):
    """Integer numpy arrays are accepted as page ids; boolean tensors and float arrays are refused."""
    setup = make_setup()
    setup.engine.backup(np.array([3, 4], dtype=np.int32), np.array([7, 0], dtype=np.uint16)).wait()
    assert same_bits(setup.host_pool.pages[[7, 0]], setup.l1_pool.kv[:, :, [3, 4]].permute(2, 0, 1, 3, 4, 5))
    with pytest.raises(ValueError, match="integer tensor"):
        setup.engine.backup(torch.tensor([True]), [2])
    with pytest.raises(TypeError, match="integers"):
        setup.engine.backup(np.array([1.0]), [2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_dma_bytes", [1000, 1536, 5000])
def test_direct_dmas_cut_into_pieces_are_bit_exact(monkeypatch, make_setup, device, max_dma_bytes):
    """With max_dma_bytes smaller than a page, one page, or a few pages (and the pool pinned in chunks),
    a contiguous backup and restore still move every page bit for bit and touch nothing else."""
    if device == "cpu":
        FakeCuda().install(monkeypatch)
    setup = make_setup(device=device, max_dma_bytes=max_dma_bytes, pin_chunk_bytes=CHUNK_BYTES)
    host_page_ids = [2, 3, 4, 5, 6, 7]
    originals = setup.l1_pool.kv[:, :, [9, 1, 4, 0, 11, 6]].clone()
    host_before = setup.host_pool.pages.clone()
    setup.engine.backup([9, 1, 4, 0, 11, 6], host_page_ids).wait()
    setup.check_integrity()
    assert same_bits(setup.host_pool.pages[host_page_ids], originals.permute(2, 0, 1, 3, 4, 5))
    assert same_bits(setup.host_pool.pages[[0, 1, 8, 9]], host_before[[0, 1, 8, 9]])
    setup.engine.restore(host_page_ids, [3, 5, 7, 8, 10, 2]).wait()
    setup.check_integrity()
    assert same_bits(setup.l1_pool.kv[:, :, [3, 5, 7, 8, 10, 2]], originals)


def test_cut_splits_a_range_into_bounded_pieces(make_setup):
    """_cut covers [start, end) with consecutive pieces no longer than max_bytes; None keeps it whole; a
    non-positive max_dma_bytes is refused."""
    assert transfer_module._cut(10, 35, 10) == [(10, 20), (20, 30), (30, 35)]
    assert transfer_module._cut(10, 35, None) == [(10, 35)]
    setup = make_setup()
    with pytest.raises(ValueError, match="max_dma_bytes"):
        TransferEngine(setup.l1_pool, setup.host_pool, max_dma_bytes=0)


# ---- slices ----------------------------------------------------------------------------------------


def test_segments_are_cut_at_slice_ends_and_grouped_by_slice():
    """Segments in packed order are cut exactly where a slice ends, keep their host offsets in step, and land
    in the slice that holds their packed bytes, every byte once."""
    segments = [(0, 100, 10), (10, 50, 3), (13, 7, 7)]
    groups = transfer_module._segments_by_slice(segments, [5, 15, 20])
    assert groups == [[(0, 100, 5)], [(5, 105, 5), (10, 50, 3), (13, 7, 2)], [(15, 9, 5)]]


@pytest.mark.parametrize("num_pages, max_slices, expected", [
    (7, 4, [(0, 2), (2, 2), (4, 2), (6, 1)]),
    (3, 4, [(0, 1), (1, 1), (2, 1)]),
    (9, 2, [(0, 5), (5, 4)]),
    (9, 1, [(0, 9)]),
])
def test_slices_tile_the_pages_in_order_with_sizes_within_one_page(monkeypatch, make_setup, num_pages, max_slices,
                                                                 expected):
    """A transfer is cut into min(max_slices, pages) slices that tile its pages in order, sizes within one."""
    monkeypatch.setattr(transfer_module, "_MIN_SLICE_BYTES", 1)
    setup = make_setup(max_slices=max_slices)
    assert setup.engine._slices(num_pages) == expected


def test_slices_are_at_least_the_minimum_size(make_setup):
    """With the default minimum slice size (16 MiB), a small transfer stays one slice."""
    setup = make_setup()
    assert setup.engine._slices(8) == [(0, 8)]


def test_max_slices_must_be_a_positive_integer(make_setup):
    """max_slices of 0 or a float is refused with ValueError."""
    setup = make_setup()
    for max_slices in (0, 2.0):
        with pytest.raises(ValueError, match="max_slices"):
            TransferEngine(setup.l1_pool, setup.host_pool, max_slices=max_slices)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("layout", ["contiguous", "contiguous/chunked", "fragmented", "fragmented/dma_per_run"])
def test_transfers_cut_into_slices_are_bit_exact(monkeypatch, make_setup, device, backend, layout):
    """With 7-page transfers cut into 4 slices (slice ends inside runs, between runs and, when pinned in
    chunks smaller than a page, inside chunk pieces), a backup and a restore move every page bit for bit
    and touch no other page."""
    monkeypatch.setattr(transfer_module, "_MIN_SLICE_BYTES", 1)
    options = {"fragmented_copy": "dma_per_run"} if layout.endswith("dma_per_run") else {}
    if layout.endswith("chunked"):
        if device == "cpu":
            FakeCuda().install(monkeypatch)
        options["pin_chunk_bytes"] = CHUNK_BYTES
    setup = make_setup("bfloat16", device, backend=backend, **options)
    host_page_ids = [1, 2, 3, 4, 5, 6, 7] if layout.startswith("contiguous") else [8, 9, 1, 5, 6, 7, 2]
    assert setup.engine._slices(7) == [(0, 2), (2, 2), (4, 2), (6, 1)]
    sources, destinations = [7, 2, 9, 4, 10, 0, 11], [1, 3, 5, 6, 8, 2, 4]
    originals = setup.l1_pool.kv[:, :, sources].clone()
    host_before = setup.host_pool.pages.clone()
    setup.engine.backup(sources, host_page_ids).wait()
    setup.check_integrity()
    untouched_host = [page for page in range(setup.host_pool.num_pages) if page not in host_page_ids]
    assert same_bits(setup.host_pool.pages[host_page_ids], originals.permute(2, 0, 1, 3, 4, 5))
    assert same_bits(setup.host_pool.pages[untouched_host], host_before[untouched_host])
    l1_before = setup.l1_pool.kv.clone()
    setup.engine.restore(host_page_ids, destinations).wait()
    setup.check_integrity()
    assert same_bits(setup.l1_pool.kv[:, :, destinations], originals)
    untouched_l1 = [page for page in range(setup.l1_pool.num_pages) if page not in destinations]
    assert same_bits(setup.l1_pool.kv[:, :, untouched_l1], l1_before[:, :, untouched_l1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direction", ["D2H", "H2D"])
def test_sliced_transfers_are_ordered_after_work_already_queued_on_the_callers_stream(monkeypatch, make_setup,
                                                                                    device, direction):
    """Cut into slices, a backup still copies L1 pages written on the caller's stream just before it, and a
    restore still lands after a write to its destination pages queued there just before it."""
    monkeypatch.setattr(transfer_module, "_MIN_SLICE_BYTES", 1)
    setup = make_setup("bfloat16", device, backend="triton" if kernels.triton_available() else "torch")
    assert len(setup.engine._slices(len(L1_SOURCE_PAGES))) > 1
    assert transfer_after_late_caller_write(setup, device, direction, "contiguous")


@pytest.mark.gpu
@needs_cuda
def test_transfers_leave_the_callers_stream_and_device_current(make_setup):
    """backup() and restore() queue work on their own streams but hand back the caller's current stream
    (here one of the caller's own), also when the transfer fails, and order after that stream."""
    setup = make_setup("bfloat16", "cuda")
    callers_stream = torch.cuda.Stream()
    originals = setup.l1_pool.kv[:, :, L1_SOURCE_PAGES].clone()
    callers_stream.wait_stream(torch.cuda.current_stream())      # the pages were written on the default stream
    with torch.cuda.stream(callers_stream):
        setup.engine.backup(L1_SOURCE_PAGES, HOST_PAGES["contiguous"]).wait()
        assert torch.cuda.current_stream() == callers_stream
        setup.engine.restore(HOST_PAGES["contiguous"], L1_DESTINATION_PAGES).wait()
        assert torch.cuda.current_stream() == callers_stream

        class BrokenBackend(TorchBackend):
            name = "broken"

            def gather(self, l1_kv, page_ids, out):
                raise RuntimeError("gather kernel failed (on purpose)")

        setup.engine.gather_backend = BrokenBackend()
        with pytest.raises(RuntimeError, match="on purpose"):
            setup.engine.backup(L1_SOURCE_PAGES, HOST_PAGES["fragmented"])
        assert torch.cuda.current_stream() == callers_stream and setup.engine.num_in_flight == 0
    torch.cuda.synchronize()
    setup.check_integrity()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert same_bits(setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES], originals)


# ---- started backups (start_backup, then send_to) -------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "fragmented", "fragmented/dma_per_run"])
@pytest.mark.parametrize("first", [0, 3])
def test_started_backup_sends_the_gathered_pages_from_first_on(monkeypatch, make_setup, device, sliced, layout,
                                                               first):
    """start_backup gathers 7 L1 pages; send_to(host pages, first) writes gathered page first + i into
    host page i, bit for bit, and no other host page; L1 is unchanged. With slices, the sent tail starts
    inside a slice (first=3 of slices 2/2/2/1), so whole leading slices send nothing."""
    if sliced:
        monkeypatch.setattr(transfer_module, "_MIN_SLICE_BYTES", 1)
        monkeypatch.setattr(transfer_module, "_MIN_STARTED_SLICE_BYTES", 1)
    options = {"fragmented_copy": "dma_per_run"} if layout.endswith("dma_per_run") else {}
    setup = make_setup("bfloat16", device, **options)
    sources = [7, 2, 9, 4, 10, 0, 11]
    host_page_ids = ([1, 2, 3, 4, 5, 6, 7] if layout == "contiguous" else [8, 9, 1, 5, 6, 7, 2])[first:]
    l1_before = setup.l1_pool.kv.clone()
    host_before = setup.host_pool.pages.clone()

    pending = setup.engine.start_backup(sources)
    assert len(pending.slices) == (4 if sliced else 1)
    setup.check_integrity()
    transfer = pending.send_to(host_page_ids, first=first)
    transfer.wait()
    setup.check_integrity()

    assert transfer.num_pages == len(host_page_ids)
    assert transfer.num_bytes == len(host_page_ids) * setup.l1_pool.geometry.bytes_per_page
    sent = l1_before[:, :, sources[first:]].permute(2, 0, 1, 3, 4, 5)
    assert same_bits(setup.host_pool.pages[host_page_ids], sent)
    untouched = [page for page in range(setup.host_pool.num_pages) if page not in host_page_ids]
    assert same_bits(setup.host_pool.pages[untouched], host_before[untouched])
    assert same_bits(setup.l1_pool.kv, l1_before)
    assert setup.engine.num_in_flight == 0


@pytest.mark.parametrize("device", DEVICES)
def test_started_backup_is_ordered_after_work_already_queued_on_the_callers_stream(make_setup, device):
    """The gather of start_backup, like backup()'s, reads L1 pages written on the caller's stream just
    before it (on CUDA: behind ~0.1 s of GPU sleep)."""
    setup = make_setup("bfloat16", device, backend="triton" if kernels.triton_available() else "torch")
    late = torch.empty_like(setup.l1_pool.kv[:, :, L1_SOURCE_PAGES])
    fill_random_(late, torch.Generator().manual_seed(7))
    page_index = torch.tensor(L1_SOURCE_PAGES, device=device)
    setup.engine.start_backup(L1_SOURCE_PAGES).cancel().wait()          # warm up
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
    setup.l1_pool.kv.index_copy_(2, page_index, late)
    pending = setup.engine.start_backup(L1_SOURCE_PAGES)
    pending.send_to(HOST_PAGES["fragmented"]).wait()
    setup.check_integrity()
    assert same_bits(setup.host_pool.pages[HOST_PAGES["fragmented"]], late.permute(2, 0, 1, 3, 4, 5))


@pytest.mark.parametrize("device", DEVICES)
def test_cancelled_or_drained_backup_writes_nothing_and_frees_its_workspace(make_setup, device):
    setup = make_setup("bfloat16", device)
    host_before = setup.host_pool.pages.clone()
    cancelled = setup.engine.start_backup(L1_SOURCE_PAGES)
    transfer = cancelled.cancel()
    transfer.wait()
    assert transfer.num_bytes == 0
    with pytest.raises(RuntimeError, match="already been sent or cancelled"):
        cancelled.send_to(HOST_PAGES["contiguous"])
    drained = setup.engine.start_backup(L1_SOURCE_PAGES)
    assert setup.engine.num_in_flight == 1
    setup.engine.drain()
    assert setup.engine.num_in_flight == 0
    setup.check_integrity()
    with pytest.raises(RuntimeError, match="drained"):
        drained.send_to(HOST_PAGES["contiguous"])
    assert same_bits(setup.host_pool.pages, host_before)
    assert setup.engine.idle_workspaces == [WorkspaceInfo(len(L1_SOURCE_PAGES), False)]


@pytest.mark.parametrize("host_page_ids, first, message", [
    ([1, 2, 3, 4, 5], 0, "does not fit"),
    ([1, 2], 3, "does not fit"),
    ([1, 2], -1, "does not fit"),
    ([1, 1], 0, "more than once"),
    ([1, 99], 0, "out of range"),
    ([8, 9, 10], 0, "out of range"),        # one run, running past the pool's last page
    ([-1, 0], 0, "out of range"),           # one run, starting below the first page
])
def test_send_to_refuses_bad_pages_and_the_backup_can_still_be_sent(make_setup, host_page_ids, first, message):
    setup = make_setup()
    pending = setup.engine.start_backup(L1_SOURCE_PAGES)
    with pytest.raises(ValueError, match=message):
        pending.send_to(host_page_ids, first=first)
    pending.send_to(HOST_PAGES["contiguous"]).wait()
    assert same_bits(setup.host_pool.pages[HOST_PAGES["contiguous"]],
                     setup.l1_pool.kv[:, :, L1_SOURCE_PAGES].permute(2, 0, 1, 3, 4, 5))
    setup.check_integrity()


@pytest.mark.parametrize("host_page_ids", [[3, 4.0], [3.0, 4.0], [False, True], [np.int64(3), np.float64(4.0)]])
@pytest.mark.parametrize("call", ["send_to", "receive_from"])
def test_host_pages_that_are_not_integers_are_refused_even_when_they_run_up(make_setup, call, host_page_ids):
    """A list that equals a run of ints but holds floats or bools is refused like any non-integer
    ids (the quick check for a run must not let them through), and nothing is written."""
    setup = make_setup()
    host_before = setup.host_pool.pages.clone()
    l1_before = setup.l1_pool.kv.clone()
    pending = (setup.engine.start_backup(L1_SOURCE_PAGES) if call == "send_to"
               else setup.engine.start_restore(L1_DESTINATION_PAGES))
    with pytest.raises(TypeError, match="integers"):
        getattr(pending, call)(host_page_ids)
    pending.cancel().wait()
    assert same_bits(setup.host_pool.pages, host_before) and same_bits(setup.l1_pool.kv, l1_before)
    setup.check_integrity()


@pytest.mark.parametrize("page_ids, expected", [
    ([3, 4, 5], 3), ([0], 0), ([9], 9), ([7, 8, 9], 7),
    ([3, 5], None), ([5, 4], None), ([3, 3], None), ([], None), ([8, 9, 10], None), ([-1, 0], None),
    ([3, 4.0], None), ([True, 2], None), ((3, 4), None), (np.array([3, 4]), None), ([np.int64(3), 4], None),
])
def test_one_run_recognizes_only_lists_of_ints_running_up_inside_the_pool(page_ids, expected):
    assert transfer_module._one_run(page_ids, 10) == expected


def test_empty_started_backup_is_complete_at_once(make_setup):
    setup = make_setup()
    pending = setup.engine.start_backup([])
    assert pending.send_to([]).done()
    assert setup.engine.num_in_flight == 0


# ---- started restores (start_restore, then receive_from) ----------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "fragmented", "fragmented/dma_per_run"])
@pytest.mark.parametrize("first, count", [(0, 7), (0, 4), (2, 5)])
def test_started_restore_receives_host_pages_into_the_prepared_pages_from_first_on(
        monkeypatch, make_setup, device, sliced, layout, first, count):
    """start_restore prepares 7 L1 pages; receive_from(host pages, first) writes host page i into the
    prepared page first + i, bit for bit; no other L1 page (prepared ones past the hit included)
    changes, and L2 is unchanged."""
    if sliced:
        monkeypatch.setattr(transfer_module, "_MIN_SLICE_BYTES", 1)
    options = {"fragmented_copy": "dma_per_run"} if layout.endswith("dma_per_run") else {}
    setup = make_setup("bfloat16", device, **options)
    destinations = [1, 3, 5, 6, 8, 2, 4]
    host_page_ids = ([1, 2, 3, 4, 5, 6, 7] if layout == "contiguous" else [8, 9, 1, 5, 6, 7, 2])[:count]
    l1_before = setup.l1_pool.kv.clone()
    host_before = setup.host_pool.pages.clone()

    pending = setup.engine.start_restore(destinations)
    setup.check_integrity()
    transfer = pending.receive_from(host_page_ids, first=first)
    transfer.wait()
    setup.check_integrity()

    assert transfer.num_bytes == count * setup.l1_pool.geometry.bytes_per_page
    written = destinations[first:first + count]
    assert same_bits(setup.l1_pool.kv[:, :, written], host_before[host_page_ids].permute(1, 2, 0, 3, 4, 5))
    untouched = [page for page in range(setup.l1_pool.num_pages) if page not in written]
    assert same_bits(setup.l1_pool.kv[:, :, untouched], l1_before[:, :, untouched])
    assert same_bits(setup.host_pool.pages, host_before)
    assert setup.engine.num_in_flight == 0


@pytest.mark.parametrize("device", DEVICES)
def test_started_restore_lands_after_work_already_queued_on_the_callers_stream(make_setup, device):
    """Like restore(): a write to the destination pages queued on the caller's stream (behind ~0.1 s
    of GPU sleep on CUDA) between start_restore and receive_from lands before the restore."""
    setup = make_setup("bfloat16", device, backend="triton" if kernels.triton_available() else "torch")
    host_page_ids = HOST_PAGES["fragmented"]
    late = torch.empty_like(setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES])
    fill_random_(late, torch.Generator().manual_seed(5))
    page_index = torch.tensor(L1_DESTINATION_PAGES, device=device)
    setup.engine.start_restore(L1_DESTINATION_PAGES).cancel().wait()          # warm up
    host_before = setup.host_pool.pages.clone()
    pending = setup.engine.start_restore(L1_DESTINATION_PAGES)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
    setup.l1_pool.kv.index_copy_(2, page_index, late)
    pending.receive_from(host_page_ids).wait()
    if device == "cuda":
        torch.cuda.synchronize()
    setup.check_integrity()
    restored = setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES].permute(2, 0, 1, 3, 4, 5)
    assert same_bits(restored, host_before[host_page_ids])


@pytest.mark.parametrize("device", DEVICES)
def test_cancelled_or_drained_restore_writes_nothing_and_frees_its_workspace(make_setup, device):
    setup = make_setup("bfloat16", device)
    l1_before = setup.l1_pool.kv.clone()
    cancelled = setup.engine.start_restore(L1_DESTINATION_PAGES)
    cancelled.cancel().wait()
    with pytest.raises(RuntimeError, match="already been received or cancelled"):
        cancelled.receive_from(HOST_PAGES["contiguous"])
    drained = setup.engine.start_restore(L1_DESTINATION_PAGES)
    assert setup.engine.num_in_flight == 1
    setup.engine.drain()
    assert setup.engine.num_in_flight == 0
    setup.check_integrity()
    with pytest.raises(RuntimeError, match="drained"):
        drained.receive_from(HOST_PAGES["contiguous"])
    assert same_bits(setup.l1_pool.kv, l1_before)
    assert setup.engine.idle_workspaces == [WorkspaceInfo(len(L1_DESTINATION_PAGES), False)]


def test_start_restore_refuses_repeated_or_bad_pages_and_receive_from_bad_hosts(make_setup):
    setup = make_setup()
    with pytest.raises(ValueError, match="more than once"):
        setup.engine.start_restore([1, 2, 1])
    with pytest.raises(ValueError, match="out of range"):
        setup.engine.start_restore([1, 99])
    assert setup.engine.num_in_flight == 0
    pending = setup.engine.start_restore(L1_DESTINATION_PAGES)
    for host_page_ids, first in (([1, 2, 3, 4, 5], 0), ([1, 2], 3), ([1, 99], 0)):
        with pytest.raises(ValueError):
            pending.receive_from(host_page_ids, first=first)
    host_before = setup.host_pool.pages.clone()
    pending.receive_from(HOST_PAGES["contiguous"]).wait()
    assert same_bits(setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES],
                     host_before[HOST_PAGES["contiguous"]].permute(1, 2, 0, 3, 4, 5))
    setup.check_integrity()


def test_empty_started_restore_and_empty_receive_are_complete_at_once(make_setup):
    setup = make_setup()
    assert setup.engine.start_restore([]).receive_from([]).done()
    pending = setup.engine.start_restore(L1_DESTINATION_PAGES)
    transfer = pending.receive_from([])
    transfer.wait()
    assert transfer.num_bytes == 0
    assert setup.engine.num_in_flight == 0


def test_started_backups_are_cut_by_their_own_larger_minimum(monkeypatch, make_setup):
    """A started backup gathers under the match's round trip, so its slices have a larger minimum
    size: with minimums of one page (backups) and three pages (started backups), seven pages make
    four slices for backup() and two for start_backup(), which still sends them bit for bit."""
    setup = make_setup()
    bytes_per_page = setup.l1_pool.geometry.bytes_per_page
    monkeypatch.setattr(transfer_module, "_MIN_SLICE_BYTES", bytes_per_page)
    monkeypatch.setattr(transfer_module, "_MIN_STARTED_SLICE_BYTES", 3 * bytes_per_page)
    sources, host_page_ids = [7, 2, 9, 4, 10, 0, 11], [1, 2, 3, 4, 5, 6, 7]
    assert len(setup.engine._slices(len(sources))) == 4
    pending = setup.engine.start_backup(sources)
    assert pending.slices == [(0, 4), (4, 3)]
    pending.send_to(host_page_ids).wait()
    setup.check_integrity()
    assert same_bits(setup.host_pool.pages[host_page_ids], setup.l1_pool.kv[:, :, sources].permute(2, 0, 1, 3, 4, 5))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dma_path", ["runtime", "torch"])
@pytest.mark.parametrize("layout", ["contiguous", "fragmented", "fragmented/dma_per_run"])
def test_dmas_through_the_cuda_runtime_or_through_torch_move_the_same_bits(monkeypatch, make_setup, dma_path,
                                                                         layout):
    """On CUDA the engine queues its DMAs through the CUDA runtime by address; without one (a torch
    linked statically against it) it queues them through torch. Either way started and plain
    backups and restores are bit-exact, and each of them goes the one way it should."""
    setup = make_setup("bfloat16", "cuda", fragmented_copy="dma_per_run" if layout.endswith("dma_per_run") else "staging")
    engine = setup.engine
    assert engine._runtime is not None, "torch's CUDA runtime was not found in the process"
    runtime_calls, torch_calls = [], []
    if dma_path == "torch":
        engine._runtime = None
    else:
        memcpy_async = engine._runtime.memcpy_async
        engine._runtime.memcpy_async = lambda *args: (runtime_calls.append(args[2]), memcpy_async(*args))
    dma_segments = transfer_module._dma_segments
    # Counted, not kept: the arguments are views of the pool, which must close at the end.
    monkeypatch.setattr(transfer_module, "_dma_segments",
                        lambda *args: (torch_calls.append(len(args[2])), dma_segments(*args)))
    generator = torch.Generator().manual_seed(5)
    host_pages = HOST_PAGES[layout.split("/")[0]]
    expected = setup.l1_pool.kv[:, :, L1_SOURCE_PAGES].permute(2, 0, 1, 3, 4, 5).clone()

    def scramble(tensor, dim, page_ids, generator):
        noise = torch.empty_like(tensor.index_select(dim, torch.tensor(page_ids, device=tensor.device)))
        fill_random_(noise, generator)
        tensor.index_copy_(dim, torch.tensor(page_ids, device=tensor.device), noise)

    def check(run, written, name):
        runtime_calls.clear()
        torch_calls.clear()
        run().wait()
        assert same_bits(written(), expected), name
        took = (len(runtime_calls) > 0, len(torch_calls) > 0)
        assert took == ((True, False) if dma_path == "runtime" else (False, True)), (name, took)

    check(lambda: engine.start_backup(L1_SOURCE_PAGES).send_to(host_pages),
          lambda: setup.host_pool.pages[host_pages], "started backup")
    check(lambda: engine.start_restore(L1_DESTINATION_PAGES).receive_from(host_pages),
          lambda: setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES].permute(2, 0, 1, 3, 4, 5), "started restore")
    scramble(setup.l1_pool.kv, 2, L1_DESTINATION_PAGES, generator)     # the restore must write them again
    check(lambda: engine.restore(host_pages, L1_DESTINATION_PAGES),
          lambda: setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES].permute(2, 0, 1, 3, 4, 5), "restore")
    scramble(setup.host_pool.pages, 0, host_pages, generator)           # the backup must write them again
    check(lambda: engine.backup(L1_DESTINATION_PAGES, host_pages),
          lambda: setup.host_pool.pages[host_pages], "backup")
    setup.check_integrity()
