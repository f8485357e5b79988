"""Page transfers between an L1 pool and a mapped shared L2 segment: exact bits, layout, validation,
workspace reuse. Runs on CPU here; the "cuda" cases run the same checks on a GPU."""

from __future__ import annotations

import mmap
import uuid
from typing import NamedTuple

import pytest
import torch

from engine_client.l1_pool import L1Pool
from engine_client.shared_pool import SharedHostPool
from engine_client.transfer import (TorchBackend, TransferEngine, WorkspaceInfo, available_backends,
                                    register_backend)
from proto.messages import KVGeometry
from tests.engine_client.test_shared_pool import shm_segment

ALL_DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

L1_SOURCE_PAGES = [7, 2, 9, 4]
L1_DESTINATION_PAGES = [0, 11, 5, 3]          # disjoint from the sources
HOST_PAGES = {"contiguous": [3, 4, 5, 6], "fragmented": [8, 1, 5, 2]}


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
    """Builds an L1 pool and a host pool over a real /dev/shm segment, both filled with random data."""
    cleanups = []

    def build(dtype: str = "bfloat16", device: str = "cpu", num_l1_pages: int = 12, num_host_pages: int = 10,
              backend: str = "torch", seed: int = 0) -> Setup:
        geometry = make_geometry(dtype)
        offset = mmap.ALLOCATIONGRANULARITY        # a region after another namespace's, as in the daemon
        segment = shm_segment(offset + num_host_pages * geometry.bytes_per_page + mmap.ALLOCATIONGRANULARITY)
        path = segment.__enter__()
        cleanups.append(lambda: segment.__exit__(None, None, None))
        host_pool = SharedHostPool.open(path, offset, num_host_pages, geometry, pin=device == "cuda")
        cleanups.append(host_pool.close)
        l1_pool = L1Pool(geometry, num_l1_pages, device)
        generator = torch.Generator().manual_seed(seed)
        fill_random_(l1_pool.kv, generator)
        fill_random_(host_pool.pages, generator)
        engine = TransferEngine(l1_pool, host_pool, backend=backend)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("host_layout", sorted(HOST_PAGES))
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_backup_then_restore_into_different_pages_round_trips(make_setup, dtype, host_layout, device):
    """Backing up L1 pages and restoring them into different L1 pages reproduces the originals bit for bit."""
    setup = make_setup(dtype, device, seed=7)
    host_page_ids = HOST_PAGES[host_layout]
    originals = setup.l1_pool.kv[:, :, L1_SOURCE_PAGES].clone()

    setup.engine.backup(L1_SOURCE_PAGES, host_page_ids).wait()
    setup.check_integrity()
    setup.engine.restore(host_page_ids, L1_DESTINATION_PAGES).wait()
    setup.check_integrity()

    assert same_bits(setup.l1_pool.kv[:, :, L1_DESTINATION_PAGES], originals)
    assert same_bits(setup.l1_pool.kv[:, :, L1_SOURCE_PAGES], originals)


@pytest.mark.parametrize("device", DEVICES)
def test_backup_waits_for_work_already_queued_on_the_callers_stream(make_setup, device):
    """Pages written on the caller's stream just before a backup are what the backup copies."""
    setup = make_setup("bfloat16", device)
    fresh = torch.empty_like(setup.l1_pool.kv[:, :, L1_SOURCE_PAGES])
    fill_random_(fresh, torch.Generator().manual_seed(99))
    source_page_ids = torch.tensor(L1_SOURCE_PAGES, device=device)
    # Warm up (first allocations and lazy kernel loading synchronize the device) without changing L1.
    setup.l1_pool.kv.index_copy_(2, source_page_ids, setup.l1_pool.kv[:, :, L1_SOURCE_PAGES].clone())
    setup.engine.backup(L1_SOURCE_PAGES, HOST_PAGES["fragmented"]).wait()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)    # keeps the caller's stream busy, so the write below lands late
    setup.l1_pool.kv.index_copy_(2, source_page_ids, fresh)     # queued, no host synchronization
    setup.engine.backup(L1_SOURCE_PAGES, HOST_PAGES["fragmented"]).wait()
    setup.check_integrity()
    assert same_bits(setup.host_pool.pages[HOST_PAGES["fragmented"]], fresh.permute(2, 0, 1, 3, 4, 5))


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
