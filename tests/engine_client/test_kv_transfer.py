"""KVTransfer's loads, layer by layer (CPU: the strided copies through torch views, Triton
interpreted): bit for bit into other blocks on every layout, in chunks and across pinned-chunk
cuts, and each layer written before that layer's event is recorded; its copies out of another
engine's blocks (a peer restore), one block copy, bit for bit (on CUDA too where there is a GPU)."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch

from engine_client import kv_transfer
from engine_client.block_copy import SegmentTable, triton_available
from engine_client.kv_transfer import LAYERWISE_MAX_RUNS, KVTransfer, page_runs
from engine_client.layout import describe_layout
from engine_client.shared_pool import SharedHostPool, whole_page_chunk_bytes
from proto.messages import KVGeometry
from kvcached.testing.blocks import distinct_block_pairs, random_bits

L, N, P, H, D = 3, 12, 4, 2, 8
NUM_HOST_PAGES = 16
BACKEND_NAMES = ["torch"] + (["triton"] if triton_available() else [])


def pool_dir(device: str) -> str:
    """A new directory for a test's L2 file: on CUDA under /dev/shm, where the daemon's segment
    lives, since cudaHostRegister refuses a shared mapping of a file on a disk's file system
    (invalid argument); removed by the caller."""
    return tempfile.mkdtemp(prefix="kvcached-test-l2-", dir="/dev/shm" if device == "cuda" else None)


def engine_tensors(kind: str, generator, device: str = "cpu"):
    """Random KV tensors of one layout kind on ``device``."""
    if kind == "pool":
        return random_bits((2, L, N, P, H, D), generator).to(device)
    if kind == "layer":
        return [random_bits((2, N, P, H, D), generator).to(device) for _ in range(L)]
    return [random_bits((N, 2, H, P, D), generator).to(device) for _ in range(L)]


def block_layer(kind: str, tensors, block: int, layer: int) -> torch.Tensor:
    """One layer of a block of the tensors, as bytes (a copy, on the host)."""
    if kind == "pool":
        part = tensors[:, layer, block]
    elif kind == "layer":
        part = tensors[layer][:, block]
    else:
        part = tensors[layer][block]
    return part.contiguous().view(torch.uint8).reshape(-1).cpu().clone()


class Case:
    """An engine's KV tensors of one layout kind (on ``device``), an L2 pool of random pages in a file
    (pinned on CUDA), and how to read one layer of a block and one layer of an L2 page as bytes."""

    def __init__(self, kind: str, seed: int, device: str = "cpu"):
        generator = torch.Generator().manual_seed(seed)
        self.kind, self.device, self.seed = kind, device, seed
        self.tensors = engine_tensors(kind, generator, device)
        self.layout = describe_layout(kind, self.tensors)
        geometry = self.layout.geometry("transfer-test", page_size=P, num_kv_heads=H, head_dim=D)
        self.dir = pool_dir(device)
        path = os.path.join(self.dir, f"l2-{kind}")
        with open(path, "wb") as f:
            f.write(torch.randint(0, 256, (NUM_HOST_PAGES * geometry.bytes_per_page,), generator=generator,
                                  dtype=torch.uint8).numpy().tobytes())
        self.pool = SharedHostPool.open(path, NUM_HOST_PAGES, geometry, pin=device == "cuda")

    def block_layer(self, block: int, layer: int) -> torch.Tensor:
        return block_layer(self.kind, self.tensors, block, layer)

    def page_layer(self, page: int, layer: int) -> torch.Tensor:
        """Layer `layer` of L2 page `page` in the page's own order: [K, V] of it, or its block."""
        segment_bytes = self.layout.segment_bytes
        page_bytes = self.pool.byte_view()[page * self.layout.page_bytes: (page + 1) * self.layout.page_bytes]
        return torch.cat([page_bytes[s * segment_bytes: (s + 1) * segment_bytes]
                          for s in self.layout.layer_segments(layer)]).clone()

    def other_blocks(self, block_ids) -> dict[int, list[torch.Tensor]]:
        """Every layer, as bytes, of each block not in block_ids: what a load must leave as it was."""
        return {b: [self.block_layer(b, layer) for layer in range(L)] for b in range(N) if b not in block_ids}

    def check_loaded(self, host_page_ids, block_ids, what: str, others=None) -> None:
        """Every layer of block block_ids[i] holds that layer of L2 page host_page_ids[i]; each block
        of ``others`` (``other_blocks`` before the load) holds what it held."""
        for page, block in zip(host_page_ids.tolist(), block_ids.tolist()):
            for layer in range(L):
                assert torch.equal(self.block_layer(block, layer), self.page_layer(page, layer)), \
                    f"seed {self.seed}: block {block} layer {layer} (page {page}{what})"
        for block, layers in (others or {}).items():
            for layer in range(L):
                assert torch.equal(self.block_layer(block, layer), layers[layer]), \
                    f"seed {self.seed}: block {block} touched"

    def close(self) -> None:
        if self.device == "cuda":   # views of the pool in cycles (a transfer's) go first: a pinned
            gc.collect()            # pool unmapped later stays registered, and the next one fails
        try:
            self.pool.close()
        except RuntimeError:    # a failed test's traceback still holds a view: unmapped with it
            if self.device == "cuda":
                raise           # still registered once unmapped: every later pinned pool would fail
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def case(request, seed):
    made = Case(request.param, seed)
    yield made
    made.close()


def pages_and_blocks(rng) -> tuple[np.ndarray, np.ndarray]:
    """9 L2 pages: a run of 4, a run of 3 and two single pages, in random order of runs; 9 distinct
    random blocks."""
    starts = rng.permutation(np.arange(0, NUM_HOST_PAGES, 4))[:4]
    runs = [np.arange(starts[0], starts[0] + 4), np.arange(starts[1], starts[1] + 3), [starts[2]], [starts[3] + 3]]
    host_page_ids = np.concatenate([runs[i] for i in rng.permutation(4)]).astype(np.int64)
    return host_page_ids, rng.permutation(N)[: len(host_page_ids)]


def cut_every(num_pages: int, page_bytes: int):
    """A pool's chunk_pieces as if it were pinned in chunks of num_pages pages."""
    def pieces(start: int, end: int):
        chunk = num_pages * page_bytes
        cuts = list(range((start // chunk + 1) * chunk, end, chunk))
        return list(zip([start, *cuts], [*cuts, end]))
    return pieces


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("shape", ["one chunk", "chunks of 3 pages", "pool pinned in 2-page chunks", "groups of 2 layers"])
@pytest.mark.parametrize("case", ["pool", "layer", "blocks"], indirect=True)
def test_a_load_writes_every_layer_of_the_named_blocks_bit_for_bit(case, shape, backend, rng, seed, monkeypatch):
    """A load of random L2 pages (runs and single pages, random order) into other random blocks
    gives every layer of each named block the bytes of that layer of its page, and leaves every other
    block as it was: in one pass, in chunks smaller than the load (a workspace of one page holds
    one page of one layer in each of its two slots), with the runs cut where pinned chunks of 2
    pages end, and in groups of 2 layers (one strided copy of the group's K rows, one of its V)."""
    host_page_ids, block_ids = pages_and_blocks(rng)
    if shape == "groups of 2 layers":
        monkeypatch.setattr(kv_transfer, "LOAD_GROUPS", 2)
    workspace_bytes = case.layout.page_bytes if shape == "chunks of 3 pages" else 64 * case.layout.page_bytes
    transfer = KVTransfer(case.layout, case.pool, backend=backend, workspace_bytes=workspace_bytes)
    if shape == "pool pinned in 2-page chunks":
        case.pool.chunk_pieces = cut_every(2, case.layout.page_bytes)
    chunk_pages = transfer.lanes["load"].chunk_pages
    assert chunk_pages == L // 2 if shape == "chunks of 3 pages" else chunk_pages >= len(block_ids), chunk_pages
    others = case.other_blocks(block_ids)
    done = transfer.load(host_page_ids, block_ids)
    assert done.done() and len(done.layer_events) == L
    case.check_loaded(host_page_ids, block_ids, f", {shape}, {backend}", others)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("case", ["pool", "layer", "blocks"], indirect=True)
def test_a_load_of_pages_in_many_runs_goes_whole_bit_for_bit(case, backend, rng, seed):
    """A load of L2 pages in more runs than LAYERWISE_MAX_RUNS (single pages, random order) goes
    whole, one DMA per run (no layer events: a wait for any layer waits for the whole load), and
    gives every layer of each named block the bytes of its page, every other block untouched."""
    # Random pages in descending order: each page a run of its own.
    host_page_ids = np.sort(rng.choice(NUM_HOST_PAGES, LAYERWISE_MAX_RUNS + 2, replace=False))[::-1].astype(np.int64)
    block_ids = rng.permutation(N)[: len(host_page_ids)]
    assert len(page_runs(host_page_ids).starts) > LAYERWISE_MAX_RUNS
    others = case.other_blocks(block_ids)
    done = KVTransfer(case.layout, case.pool, backend=backend).load(host_page_ids, block_ids)
    assert done.done() and done.layer_events is None
    case.check_loaded(host_page_ids, block_ids, f", {backend}", others)


@pytest.mark.parametrize("load_groups", [12, 2, 1])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("case", ["pool", "layer", "blocks"], indirect=True)
def test_each_group_event_is_recorded_once_its_layers_are_written_and_before_the_next(case, backend, load_groups,
                                                                                      rng, seed, monkeypatch):
    """The load lane records a start event (the cost model's timing starts there) before any layer
    is written, then one event per group of layers (LOAD_GROUPS 12: one per layer of the 3; 2:
    layers 0-1, then 2; 1: one group of the 3, and the last group's layers go one by one), in
    layer order; when the event of a group is recorded, the layers of it
    and of the groups before it hold their pages' bytes in every named block and the later layers
    do not yet (what the engine's stream may read after waiting on a layer's event is all written,
    and the load goes group by group, not all at once with the events after); each layer's event
    is its group's."""
    monkeypatch.setattr(kv_transfer, "LOAD_GROUPS", load_groups)
    host_page_ids, block_ids = pages_and_blocks(rng)
    transfer = KVTransfer(case.layout, case.pool, backend=backend)
    groups = [(0, 1), (2,)] if load_groups == 2 else [(0,), (1,), (2,)]
    assert transfer.layer_groups == groups
    pairs = list(zip(host_page_ids.tolist(), block_ids.tolist()))
    # Random bits: before the load no layer of a block holds its page's bytes.
    assert not any(torch.equal(case.block_layer(b, i), case.page_layer(p, i)) for p, b in pairs for i in range(L))
    seen: list[list[list[bool]]] = []        # per record: per block, per layer: holds its page's bytes

    def record(lane, stream=None, timing=False):
        seen.append([[torch.equal(case.block_layer(b, i), case.page_layer(p, i)) for i in range(L)] for p, b in pairs])
        return len(seen) - 1                 # the event: which record it was

    monkeypatch.setattr(KVTransfer, "_record", staticmethod(record))
    done = transfer.load(host_page_ids, block_ids)
    assert len(seen) == 1 + len(groups), f"seed {seed}: {len(seen)} events for a start and {len(groups)} groups"
    start, seen = seen[0], seen[1:]
    assert not any(any(block_state) for block_state in start), f"seed {seed}: at the start event: {start}"
    for index, state in enumerate(seen):
        written = {layer for group in groups[: index + 1] for layer in group}
        assert all(block_state == [i in written for i in range(L)] for block_state in state), \
            f"seed {seed}: at event {index}: {state}"
    assert done.layer_events == [1 + index for index, group in enumerate(groups) for _ in group], done.layer_events


@pytest.mark.parametrize("case", ["pool", "layer", "blocks"], indirect=True)
def test_a_load_not_layered_goes_whole_bit_for_bit(case, rng, seed, monkeypatch):
    """load(..., layered=False) of pages in few runs goes whole: one copy per run and one scatter
    of all layers (no layer events), every layer of each named block its page's bytes, every
    other block untouched."""
    host_page_ids, block_ids = pages_and_blocks(rng)
    transfer = KVTransfer(case.layout, case.pool, backend="torch")
    copies = []
    monkeypatch.setattr(transfer, "_copy_rows", lambda *a: copies.append(a))   # the layered path's strided copies
    others = case.other_blocks(block_ids)
    done = transfer.load(host_page_ids, block_ids, layered=False)
    assert done.done() and done.layer_events is None and not copies
    case.check_loaded(host_page_ids, block_ids, "", others)


@pytest.mark.parametrize("case", ["pool", "layer", "blocks"], indirect=True)
def test_a_load_of_no_pages_writes_nothing_and_is_done(case, seed):
    """A load of no pages (layered, as asked by default) is accepted, done at once, lets a wait for
    any layer through, and leaves every block as it was."""
    before = {b: [case.block_layer(b, layer) for layer in range(L)] for b in range(N)}
    done = KVTransfer(case.layout, case.pool, backend="torch").load(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert done.done() and done.num_pages == 0
    for layer in range(L):
        done.wait_layer_on(layer, None)
    for block, layers in before.items():
        for layer in range(L):
            assert torch.equal(case.block_layer(block, layer), layers[layer]), f"seed {seed}: block {block} touched"


def test_a_layered_load_of_a_one_layer_engine_with_a_workspace_of_one_page_is_bit_for_bit(tmp_path, rng, seed):
    """One layer, a workspace of one page: each of the load's two slots still holds its group (the
    whole page), so a layered load of 5 pages (one run, chunks of one page through both slots)
    gives each named block its page's bytes and leaves every other block as it was."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [random_bits((2, N, P, H, D), generator)]
    layout = describe_layout("layer", tensors)
    geometry = layout.geometry("transfer-test", page_size=P, num_kv_heads=H, head_dim=D)
    path = os.path.join(tmp_path, "l2-one-layer")
    with open(path, "wb") as f:
        f.write(torch.randint(0, 256, (NUM_HOST_PAGES * geometry.bytes_per_page,), generator=generator,
                              dtype=torch.uint8).numpy().tobytes())
    pool = SharedHostPool.open(path, NUM_HOST_PAGES, geometry, pin=False)
    try:
        transfer = KVTransfer(layout, pool, backend="torch", workspace_bytes=layout.page_bytes)
        first = int(rng.integers(0, NUM_HOST_PAGES - 5))
        host_page_ids, block_ids = np.arange(first, first + 5), rng.permutation(N)[:5]
        before = {b: block_layer("layer", tensors, b, 0) for b in range(N)}
        done = transfer.load(host_page_ids, block_ids)
        assert done.done() and len(done.layer_events) == 1
        page_bytes = pool.byte_view()
        for page, block in zip(host_page_ids.tolist(), block_ids.tolist()):
            expected = page_bytes[page * layout.page_bytes: (page + 1) * layout.page_bytes]
            assert torch.equal(block_layer("layer", tensors, block, 0), expected), f"seed {seed}: block {block}"
        for block in set(range(N)) - set(block_ids.tolist()):
            assert torch.equal(block_layer("layer", tensors, block, 0), before[block]), f"seed {seed}: block {block}"
        del transfer, page_bytes, expected
    finally:
        try:
            pool.close()
        except RuntimeError:    # a failed test's traceback still holds a view: unmapped with it
            pass


def test_a_pinned_pool_is_cut_into_chunks_of_whole_pages():
    """The pinning chunk of a pool is a multiple of its L2 page and of the OS page size, at most
    256 MiB (one page when a page is larger): no page spans two registrations. Qwen3-8B's 2.25 MiB
    pages are pinned 113 to a chunk."""
    qwen3_8b = KVGeometry("m", num_layers=36, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    assert qwen3_8b.bytes_per_page == 2_359_296
    assert whole_page_chunk_bytes(qwen3_8b.bytes_per_page) == 113 * qwen3_8b.bytes_per_page
    for bytes_per_page in (4096, 6144, 2_359_296, 300 << 20, 1000):
        chunk = whole_page_chunk_bytes(bytes_per_page)
        assert chunk % bytes_per_page == 0 and chunk % 4096 == 0, bytes_per_page
        assert chunk <= max(256 << 20, np.lcm(bytes_per_page, 4096)), bytes_per_page


def count_kernel_calls(transfer: KVTransfer, monkeypatch) -> dict[str, int]:
    """From now on, how many times the transfer calls its backend's gather, scatter and block copy."""
    calls = {"gather": 0, "scatter": 0, "copy_blocks": 0}
    for name in calls:
        def counted(*args, _name=name, _original=getattr(transfer, f"_{name}")):
            calls[_name] += 1
            return _original(*args)
        monkeypatch.setattr(transfer, f"_{name}", counted)
    return calls


def all_layers(kind: str, tensors) -> dict[int, list[torch.Tensor]]:
    """Every layer of every block, as bytes."""
    return {block: [block_layer(kind, tensors, block, layer) for layer in range(L)] for block in range(N)}


def check_copied(own_after, source_layers, own_before, source_ids, block_ids, what: str) -> None:
    """Every layer of block block_ids[i] (in ``own_after``, as ``all_layers`` gives) holds that of
    source block source_ids[i] (in ``source_layers``); every other block what it held before."""
    source_of = dict(zip(block_ids.tolist(), source_ids.tolist()))
    for block in range(N):
        expected = source_layers[source_of[block]] if block in source_of else own_before[block]
        for layer in range(L):
            assert torch.equal(own_after[block][layer], expected[layer]), f"{what}: block {block} layer {layer}"


def same_bytes(layers: dict[int, list[torch.Tensor]], other: dict[int, list[torch.Tensor]]) -> bool:
    return layers.keys() == other.keys() and all(torch.equal(a, b) for block in layers
                                                 for a, b in zip(layers[block], other[block]))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("shape", ["one launch", "ids in chunks of 3 pages"])
@pytest.mark.parametrize("case", ["pool", "layer", "blocks"], indirect=True)
def test_a_copy_from_a_peer_is_one_block_copy_bit_for_bit(case, shape, backend, rng, seed, monkeypatch):
    """copy_from another engine's tensors (the same kind, other random bytes) gives every layer of
    each named block the bytes of that layer of its source block (random blocks, each into another
    block number), leaves every other block and all the peer's blocks as they were, and is block
    copies alone (no gather, no scatter): one launch, or one per chunk where the ids are more than
    one upload of the id ring holds (9 pages, 3 to an upload: 3 launches)."""
    peer_tensors = engine_tensors(case.kind, torch.Generator().manual_seed(seed + 1))
    peer = SegmentTable(describe_layout(case.kind, peer_tensors))
    source_ids, block_ids = distinct_block_pairs(rng, 9, N)
    transfer = KVTransfer(case.layout, case.pool, backend=backend)
    if shape != "one launch":
        monkeypatch.setattr(transfer.lanes["load"], "copy_pages", 3)
    calls = count_kernel_calls(transfer, monkeypatch)
    peer_before, own_before = all_layers(case.kind, peer_tensors), all_layers(case.kind, case.tensors)
    done = transfer.copy_from(peer, source_ids, block_ids)
    assert done.done() and calls == {"gather": 0, "scatter": 0, "copy_blocks": 1 if shape == "one launch" else 3}, \
        (calls, seed)
    own_after, peer_after = all_layers(case.kind, case.tensors), all_layers(case.kind, peer_tensors)
    check_copied(own_after, peer_before, own_before, source_ids, block_ids, f"seed {seed} ({shape}, {backend})")
    for block in range(N):
        for layer in range(L):
            assert torch.equal(peer_after[block][layer], peer_before[block][layer]), f"seed {seed}: peer block {block}"


@pytest.mark.parametrize("bad", ["other pages", "source block out of range", "block out of range", "two lengths"])
@pytest.mark.parametrize("case", ["layer"], indirect=True)
def test_a_copy_from_that_cannot_be_made_is_refused_before_anything_is_queued(case, bad, rng, seed, monkeypatch):
    """A peer table of other pages (one layer's segments of the peer's), a source or a target block
    outside its tensors, ids of two lengths: ValueError, no kernel called, no byte of either changed."""
    peer_tensors = engine_tensors(case.kind, torch.Generator().manual_seed(seed + 1))
    peer_layout = describe_layout(case.kind, peer_tensors)
    peer = SegmentTable(peer_layout)
    source_ids, block_ids = distinct_block_pairs(rng, 4, N)
    if bad == "other pages":
        peer = SegmentTable(peer_layout, peer_layout.layer_segments(0))
    elif bad == "source block out of range":
        source_ids[2] = N
    elif bad == "block out of range":
        block_ids[1] = N
    else:
        block_ids = block_ids[:3]
    transfer = KVTransfer(case.layout, case.pool)
    calls = count_kernel_calls(transfer, monkeypatch)
    peer_before, own_before = all_layers(case.kind, peer_tensors), all_layers(case.kind, case.tensors)
    with pytest.raises(ValueError):
        transfer.copy_from(peer, source_ids, block_ids)
    assert calls == {"gather": 0, "scatter": 0, "copy_blocks": 0}, calls
    assert same_bytes(all_layers(case.kind, peer_tensors), peer_before), f"seed {seed}: a peer block changed"
    assert same_bytes(all_layers(case.kind, case.tensors), own_before), f"seed {seed}: a block changed"


SLEEP_CYCLES = 200_000_000      # ~0.1 s of a GPU: far longer than any copy here


def compiled_binaries(kernel) -> int:
    """How many binaries of a Triton kernel this process compiled, over every device."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this triton keeps no device_caches: compilations cannot be counted")
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("kind", ["pool", "layer", "blocks"])
def test_on_cuda_a_copy_from_a_peer_is_bit_for_bit_after_the_callers_work_and_compiles_nothing(
        kind, backend, rng, seed, monkeypatch):
    """On a GPU: copies out of another engine's CUDA tensors of 1, 5 and 9 pages (the last in chunks
    of 2 pages through the device id ring), each queued after an event of the caller's stream that
    follows a rewrite of the source blocks (behind a ~0.1 s sleep), give every named block the
    rewritten bytes of its source block, bit for bit, every other block unchanged; each is done once
    the device is synchronized and has a device time; and no size compiles the copy kernel (the
    construction warmed it)."""
    from engine_client import block_copy

    case = Case(kind, seed, device="cuda")
    try:
        peer_tensors = engine_tensors(kind, torch.Generator().manual_seed(seed + 1), "cuda")
        peer = SegmentTable(describe_layout(kind, peer_tensors))
        transfer = KVTransfer(case.layout, case.pool, backend=backend)
        kernel = block_copy._copy_between_kernel if transfer.backend_by_direction["load"] == "triton" else None
        compiled = compiled_binaries(kernel) if kernel is not None else 0
        flat_peer = [peer_tensors] if isinstance(peer_tensors, torch.Tensor) else peer_tensors
        for count in (1, 5, 9):
            if count == 9:
                transfer.lanes["load"].copy_pages = 2      # this transfer's alone: dropped with it
            source_ids, block_ids = distinct_block_pairs(rng, count, N)
            own_before = all_layers(kind, case.tensors)
            torch.cuda._sleep(SLEEP_CYCLES)
            for tensor in flat_peer:         # the caller's stream rewrites the source, late
                tensor.view(torch.int16).random_(-2**15, 2**15)
            after = torch.cuda.Event()
            after.record()
            done = transfer.copy_from(peer, source_ids, block_ids, after)
            torch.cuda.synchronize()
            assert done.done() and done.seconds() > 0, (count, seed)
            peer_now, own_after = all_layers(kind, peer_tensors), all_layers(kind, case.tensors)
            check_copied(own_after, peer_now, own_before, source_ids, block_ids,
                         f"seed {seed}: {count} pages ({backend})")
        if kernel is not None:
            assert compiled_binaries(kernel) == compiled, f"{compiled_binaries(kernel) - compiled} compilations"
    finally:
        transfer = done = None      # its views of the pool, or the pool stays registered once unmapped
        case.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["layered, groups of 2 layers", "layered, a group per layer", "whole"])
@pytest.mark.parametrize("kind", ["pool", "layer", "blocks"])
def test_on_cuda_a_load_is_bit_for_bit_with_an_event_per_group(kind, mode, rng, seed, monkeypatch):
    """On a GPU, a load of random L2 pages (runs and single pages) into other random blocks gives
    every layer of each named block its page's bytes and leaves every other block as it was, layered
    (its strided copies on the copy stream, its scatters on the scatter stream) or whole; layered,
    the layers of a group share one event, groups have distinct ones, the last is the load's end."""
    if mode == "layered, groups of 2 layers":
        monkeypatch.setattr(kv_transfer, "LOAD_GROUPS", 2)
    case = Case(kind, seed, device="cuda")
    try:
        host_page_ids, block_ids = pages_and_blocks(rng)
        transfer = KVTransfer(case.layout, case.pool, backend="auto")
        others = case.other_blocks(block_ids)
        done = transfer.load(host_page_ids, block_ids, layered=mode != "whole")
        torch.cuda.synchronize()
        assert done.done() and done.seconds() > 0
        if mode == "whole":
            assert done.layer_events is None
        else:
            groups = [(0, 1), (2,)] if mode == "layered, groups of 2 layers" else [(0,), (1,), (2,)]
            assert transfer.layer_groups == groups
            events = done.layer_events
            assert len(events) == L and len({id(e) for e in events}) == len(groups) and events[-1] is done.done_event
            assert all(events[layer] is events[group[0]] for group in groups for layer in group)
        case.check_loaded(host_page_ids, block_ids, f", {mode}", others)
    finally:
        transfer = done = None      # its views of the pool, or the pool stays registered once unmapped
        case.close()


def many_chunk_load(device: str, seed: int, rng) -> tuple[str, int]:
    """A layered load of 3,100 of 3,200 blocks from L2 pages in 2 runs, with a workspace of one
    page (chunks of one page: 3,100 chunks, each chunk's ids one upload of the id ring): checks it
    bit for bit. Returns what failed ("" when nothing) and the load's chunk count."""
    layers, num_blocks, num_pages = 3, 3200, 3100
    generator = torch.Generator().manual_seed(seed)
    tensors = random_bits((2, layers, num_blocks, P, H, D), generator).to(device)
    layout = describe_layout("pool", tensors)
    geometry = layout.geometry("transfer-test", page_size=P, num_kv_heads=H, head_dim=D)
    tmp = pool_dir(device)
    try:
        path = os.path.join(tmp, "l2-many-chunks")
        with open(path, "wb") as f:
            f.write(torch.randint(0, 256, (num_pages * geometry.bytes_per_page,), generator=generator,
                                  dtype=torch.uint8).numpy().tobytes())
        pool = SharedHostPool.open(path, num_pages, geometry, pin=device == "cuda")
        try:
            transfer = KVTransfer(layout, pool, backend="auto", workspace_bytes=layout.page_bytes)
            chunk_pages = transfer.lanes["load"].chunk_pages
            host_page_ids = np.roll(np.arange(num_pages), int(rng.integers(1, num_pages)))
            block_ids = rng.permutation(num_blocks)[:num_pages]
            before = tensors.view(torch.int16).cpu().clone()
            done = transfer.load(host_page_ids, block_ids)
            if device == "cuda":
                torch.cuda.synchronize()
            after = tensors.view(torch.int16).cpu()
            pages = pool.byte_view().view(torch.int16).view(num_pages, 2, layers, P, H, D)
            expected = before.clone()
            expected[:, :, torch.from_numpy(block_ids)] = pages[torch.from_numpy(host_page_ids)].permute(1, 2, 0, 3, 4, 5)
            del pages
            failed = "" if done.done() and done.layer_events is not None and torch.equal(after, expected) else \
                f"seed {seed}: {int((after != expected).any(-1).any(-1).any(-1).any(0).any(0).sum())} blocks wrong"
            del transfer, done
        finally:
            try:
                pool.close()
            except RuntimeError:    # a failed test's traceback still holds a view: unmapped with it
                pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return failed, -(-num_pages // chunk_pages)


@pytest.mark.gpu
def test_on_cuda_a_layered_load_of_more_chunks_than_a_4096_id_ring_holds_is_bit_for_bit(rng, seed):
    """On a GPU, a layered load in more chunks than 4,096 ring slots hold at once (3,100 chunks of
    one page, each upload 4 slots: all of them are uploaded before the first scatter, and every
    group's scatters read them) gives each of the 3,100 named blocks its page's bytes, bit for bit,
    and leaves the other 100 blocks as they were."""
    failed, chunks = many_chunk_load("cuda", seed, rng)
    assert chunks * 4 > 4096, chunks
    assert not failed, failed


@pytest.mark.gpu
def test_on_cuda_a_layered_load_whose_last_group_is_one_segment_compiles_nothing(rng, seed, monkeypatch):
    """On a GPU with the Triton backend, a "blocks" layout in groups of 2 layers of its 3 (the last
    group one layer: one segment, a count Triton compiles a kernel of its own for) loads bit for
    bit without compiling the gather/scatter kernel: the construction warmed every group's."""
    if not triton_available():
        pytest.skip("no triton")
    from engine_client import block_copy

    monkeypatch.setattr(kv_transfer, "LOAD_GROUPS", 2)
    case = Case("blocks", seed, device="cuda")
    try:
        transfer = KVTransfer(case.layout, case.pool, backend="triton")
        assert transfer.layer_groups == [(0, 1), (2,)] and transfer.group_tables[-1].num_segments == 1
        compiled = compiled_binaries(block_copy._copy_blocks_kernel)
        host_page_ids, block_ids = pages_and_blocks(rng)
        done = transfer.load(host_page_ids, block_ids)
        torch.cuda.synchronize()
        assert done.done() and len(done.layer_events) == L
        case.check_loaded(host_page_ids, block_ids, "")
        assert compiled_binaries(block_copy._copy_blocks_kernel) == compiled, \
            f"{compiled_binaries(block_copy._copy_blocks_kernel) - compiled} compilations"
    finally:
        transfer = done = None      # its views of the pool, or the pool stays registered once unmapped
        case.close()
