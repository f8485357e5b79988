"""KVTransfer's loads, layer by layer (CPU: the strided copies through torch views, Triton
interpreted): bit for bit into other blocks on every layout, in chunks and across pinned-chunk
cuts, and each layer written before that layer's event is recorded."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine_client.block_copy import triton_available
from engine_client import kv_transfer
from engine_client.kv_transfer import LAYERWISE_MAX_RUNS, KVTransfer, page_runs
from engine_client.layout import describe_layout
from engine_client.shared_pool import SharedHostPool, whole_page_chunk_bytes
from proto.messages import KVGeometry

L, N, P, H, D = 3, 12, 4, 2, 8
NUM_HOST_PAGES = 16
BACKEND_NAMES = ["torch"] + (["triton"] if triton_available() else [])


def random_bits(shape, generator) -> torch.Tensor:
    """Random bf16 bit patterns (NaNs included), never zeros."""
    return torch.randint(-2**15, 2**15, shape, generator=generator, dtype=torch.int16).view(torch.bfloat16)


class Case:
    """An engine's KV tensors of one layout kind, an L2 pool of random pages in a file, and how to
    read one layer of a block and one layer of an L2 page as bytes."""

    def __init__(self, kind: str, seed: int, tmp_path):
        generator = torch.Generator().manual_seed(seed)
        self.kind = kind
        if kind == "pool":
            self.tensors = random_bits((2, L, N, P, H, D), generator)
        elif kind == "layer":
            self.tensors = [random_bits((2, N, P, H, D), generator) for _ in range(L)]
        else:
            self.tensors = [random_bits((N, 2, H, P, D), generator) for _ in range(L)]
        self.layout = describe_layout(kind, self.tensors)
        geometry = self.layout.geometry("transfer-test", page_size=P, num_kv_heads=H, head_dim=D)
        path = os.path.join(tmp_path, f"l2-{kind}")
        with open(path, "wb") as f:
            f.write(torch.randint(0, 256, (NUM_HOST_PAGES * geometry.bytes_per_page,), generator=generator,
                                  dtype=torch.uint8).numpy().tobytes())
        self.pool = SharedHostPool.open(path, 0, NUM_HOST_PAGES, geometry, pin=False)

    def block_layer(self, block: int, layer: int) -> torch.Tensor:
        if self.kind == "pool":
            part = self.tensors[:, layer, block]
        elif self.kind == "layer":
            part = self.tensors[layer][:, block]
        else:
            part = self.tensors[layer][block]
        return part.contiguous().view(torch.uint8).reshape(-1).clone()

    def page_layer(self, page: int, layer: int) -> torch.Tensor:
        """Layer `layer` of L2 page `page` in the page's own order: [K, V] of it, or its block."""
        segment_bytes = self.layout.segment_bytes
        page_bytes = self.pool.byte_view()[page * self.layout.page_bytes: (page + 1) * self.layout.page_bytes]
        return torch.cat([page_bytes[s * segment_bytes: (s + 1) * segment_bytes]
                          for s in self.layout.layer_segments(layer)]).clone()

    def close(self) -> None:
        try:
            self.pool.close()
        except RuntimeError:    # a failed test's traceback still holds a view: unmapped with it
            pass


@pytest.fixture
def case(request, tmp_path, seed):
    made = Case(request.param, seed, tmp_path)
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
    others = {b: [case.block_layer(b, layer) for layer in range(L)] for b in range(N) if b not in block_ids}
    done = transfer.load(host_page_ids, block_ids)
    assert done.done() and len(done.layer_events) == L
    for page, block in zip(host_page_ids.tolist(), block_ids.tolist()):
        for layer in range(L):
            assert torch.equal(case.block_layer(block, layer), case.page_layer(page, layer)), \
                f"seed {seed}: block {block} layer {layer} (page {page}, {shape}, {backend})"
    for block, layers in others.items():
        for layer in range(L):
            assert torch.equal(case.block_layer(block, layer), layers[layer]), f"seed {seed}: block {block} touched"


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
    others = {b: [case.block_layer(b, layer) for layer in range(L)] for b in range(N) if b not in block_ids}
    done = KVTransfer(case.layout, case.pool, backend=backend).load(host_page_ids, block_ids)
    assert done.done() and done.layer_events is None
    for page, block in zip(host_page_ids.tolist(), block_ids.tolist()):
        for layer in range(L):
            assert torch.equal(case.block_layer(block, layer), case.page_layer(page, layer)), \
                f"seed {seed}: block {block} layer {layer} (page {page}, {backend})"
    for block, layers in others.items():
        for layer in range(L):
            assert torch.equal(case.block_layer(block, layer), layers[layer]), f"seed {seed}: block {block} touched"


@pytest.mark.parametrize("load_groups", [12, 2])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("case", ["pool", "layer", "blocks"], indirect=True)
def test_each_group_event_is_recorded_once_its_layers_are_written_and_before_the_next(case, backend, load_groups,
                                                                                      rng, seed, monkeypatch):
    """The load lane records a start event (the cost model's timing starts there) before any layer
    is written, then one event per group of layers (LOAD_GROUPS 12: one per layer of the 3; 2:
    layers 0-1, then 2), in layer order; when the event of a group is recorded, the layers of it
    and of the groups before it hold their pages' bytes in every named block and the later layers
    do not yet (what the engine's stream may read after waiting on a layer's event is all written,
    and the load goes group by group, not all at once with the events after); each layer's event
    is its group's."""
    monkeypatch.setattr(kv_transfer, "LOAD_GROUPS", load_groups)
    host_page_ids, block_ids = pages_and_blocks(rng)
    transfer = KVTransfer(case.layout, case.pool, backend=backend)
    groups = [(0,), (1,), (2,)] if load_groups == 12 else [(0, 1), (2,)]
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
    others = {b: [case.block_layer(b, layer) for layer in range(L)] for b in range(N) if b not in block_ids}
    done = transfer.load(host_page_ids, block_ids, layered=False)
    assert done.done() and done.layer_events is None and not copies
    for page, block in zip(host_page_ids.tolist(), block_ids.tolist()):
        for layer in range(L):
            assert torch.equal(case.block_layer(block, layer), case.page_layer(page, layer)), \
                f"seed {seed}: block {block} layer {layer} (page {page})"
    for block, layers in others.items():
        for layer in range(L):
            assert torch.equal(case.block_layer(block, layer), layers[layer]), f"seed {seed}: block {block} touched"


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
