"""Move whole pages between an engine's KV tensors and the shared L2 pool: one path per direction.

    save  gather the blocks (all layers, through the segment table) into a packed device buffer,
          then one DMA per run of consecutive L2 pages straight into the shared pool mapping
    load  layered (for an engine whose prefill reads a load in flight): group by group of
          consecutive layers (``LOAD_GROUPS`` groups, the last one layer by layer), per run of
          L2 pages one strided DMA of the group's K rows and one of its V rows into the packed
          buffer, then a scatter of the group into the blocks; an event after each group, so the
          engine's stream can wait for layer i's group alone (``Transfer.wait_layer_on``) while
          the next group's DMA runs. Whole (otherwise): one DMA per run of L2 pages, one
          scatter: the fewest host calls.
          Queueing a load takes the host a few calls per group, not per layer: queued layer by
          layer, the host's calls, not the DMA, bound a short load, and stalled the engine's
          other requests meanwhile.
          (A peer restore instead copies another engine's blocks, mapped into this process,
          straight into this engine's: one block-to-block launch, ``copy_from``.)

Each direction is a lane: a private copy stream, a packed workspace and a ring of block ids, all
allocated (and the kernels compiled) at construction, so that nothing on a request's path depends
on its size. A lane's work runs in its stream's order, so the workspace is reused by each transfer
(and by each group of a load) without any host-side tracking; a transfer larger than the workspace
goes in chunks that reuse it, one after the other. Saves and loads have a lane each, so a save's
D2H runs beside a load's H2D. A transfer's first operation waits on an event of the caller's stream
(``after``): the gather reads blocks only once the engine's prefill wrote them, and the scatter
writes blocks only once the work the engine queued before the load is done with them.

L2 pages are page-major (a page holds every layer), so one group of layers of a run of pages is rows
of its K (and of its V) spans, a page apart: a strided copy, ``cudaMemcpy2DAsync`` (``engine_client.cudart``), which runs
near the speed of a flat DMA of the same bytes (``connector`` in docs/benchmarks.md); on CPU the same rows are copied
by torch through strided views. The pinned pool's chunks hold whole pages
(``shared_pool.whole_page_chunk_bytes``), so a run cut where a chunk ends is cut between pages.

Nothing here waits on the host: ``save`` and ``load`` queue and return a ``Transfer`` whose
``done()`` queries events. On CPU the copies run at once and every transfer is done on return.
The save's DMAs are torch ``copy_(non_blocking=True)`` from device memory into the pinned mapping,
cut where one pinned chunk of the mapping ends (``SharedHostPool.chunk_pieces``).
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from engine_client import cudart
from engine_client.block_copy import BACKENDS, SegmentTable, check_same_pages, choose_backends, triton_available
from engine_client.layout import KVLayout
from engine_client.shared_pool import SharedHostPool
from proto import counters
from proto.counters import Counts

DEFAULT_WORKSPACE_BYTES = 256 << 20      # per lane
TRANSFER_BACKENDS = ("auto", "triton", "torch")
_ID_ALIGN = 4                            # 16-byte aligned id slices: one Triton specialisation
# A load whose L2 pages lie in more runs than this goes whole (one DMA per run), not layer by
# layer (a strided copy per run, layer and K/V): a fragmented L2 would take thousands of copies.
LAYERWISE_MAX_RUNS = 8
# A layered load's groups of layers: each costs the host a few calls (its strided copies, events,
# a scatter launch), so that queueing the load takes far less than its DMA; the engine's attention
# of a layer waits for that layer's group.
LOAD_GROUPS = 12
_LOAD_SLOTS = 2          # a load's packed layer slots: the DMA of one while the other is scattered


class Transfer:
    """A queued transfer. ``blocks_free()``: the engine's blocks are no longer touched (a save's
    gathers are done; for a load, the same as ``done()``); ``done()``: every copy is complete. A
    load has an event per layer (``layer_events``), recorded once that layer's blocks are written.
    ``seconds()``: how long its copies took, once done (for the cost model)."""

    __slots__ = ("num_pages", "blocks_event", "done_event", "layer_events", "start_event", "host_seconds",
                 "claimed", "_waited")

    def __init__(self, num_pages: int, blocks_event: torch.cuda.Event | None,
                 done_event: torch.cuda.Event | None, layer_events: list[torch.cuda.Event | None] | None = None,
                 start_event: torch.cuda.Event | None = None, host_seconds: float = 0.0,
                 claimed: np.ndarray | None = None):
        self.num_pages = num_pages
        self.claimed = claimed                  # a save with a generation: which of its pages it writes
        self.blocks_event = blocks_event
        self.done_event = done_event
        self.layer_events = layer_events
        self.start_event = start_event          # on the lane's stream, once the caller's work is done
        self.host_seconds = host_seconds        # on CPU, where the copies ran before the return
        self._waited: tuple[int, torch.cuda.Event] | None = None    # the last (stream, event) waited on

    def blocks_free(self) -> bool:
        return self.blocks_event is None or self.blocks_event.query()

    def done(self) -> bool:
        return self.done_event is None or self.done_event.query()

    def seconds(self) -> float:
        """The copies' time, from the lane's start of this transfer (not its wait for the caller's
        stream) to its end: CUDA events' elapsed time, read only once done (no host wait)."""
        if self.done_event is None or self.start_event is None:
            return self.host_seconds
        assert self.done(), "a transfer is timed once done"
        return self.start_event.elapsed_time(self.done_event) / 1e3

    def wait_layer_on(self, layer: int, stream: torch.cuda.Stream | None) -> None:
        """Make ``stream`` wait until this load has written ``layer`` of its blocks (no host wait).
        Layers of one group (or of a whole load) share an event: a stream that waited on it last
        time already waits, and is not told again (a host call per layer and load saved)."""
        event = self.layer_events[layer] if self.layer_events is not None else self.done_event
        if event is None or stream is None:
            return
        waited = (stream.cuda_stream, event)       # (an event compares by identity)
        if waited == self._waited:
            return
        stream.wait_event(event)
        self._waited = waited


class _IdRing:
    """Block ids on their way to the device: written into pinned host memory, copied on the lane's
    stream into a device ring. A host slot is rewritten only once the copy that read it is done
    (an event per upload; the ring holds several workspaces' worth, so that wait is rare)."""

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = capacity
        self.device = device
        self.host = torch.empty(capacity, dtype=torch.int32, pin_memory=True)
        self.host_array = self.host.numpy()
        self.ring = torch.empty(capacity, dtype=torch.int32, device=device)
        self.position = 0
        self.in_flight: collections.deque[tuple[int, int, torch.cuda.Event]] = collections.deque()
        self.host_waits = 0

    def upload(self, block_ids: np.ndarray, stream: torch.cuda.Stream) -> torch.Tensor:
        count = len(block_ids)
        assert count <= self.capacity // 2, (count, self.capacity)
        start = -(-self.position // _ID_ALIGN) * _ID_ALIGN
        if start + count > self.capacity:
            start = 0
        end = start + count
        while self.in_flight and self.in_flight[0][2].query():      # the oldest uploads are done
            self.in_flight.popleft()
        for first, last, event in self.in_flight:                   # still read: wait (rare)
            if first < end and start < last:
                self.host_waits += 1
                event.synchronize()
        self.host_array[start:end] = block_ids
        view = self.ring[start:end]
        view.copy_(self.host[start:end], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        self.in_flight.append((start, end, event))
        self.position = end
        return view


class _Lane:
    """chunk_pages: the most pages one pass of the lane handles (all layers of them for a save, one
    layer of them for a load): what its workspace holds. copy_pages: the most pages one block copy
    (``copy_from``) handles: both its id arrays in one upload of the id ring."""

    def __init__(self, name: str, table: SegmentTable, workspace_pages: int, chunk_pages: int):
        self.name = name
        device = table.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.workspace = torch.empty(table.packed_shape(workspace_pages), dtype=table.word_dtype, device=device)
        self.workspace_words = self.workspace.view(-1)
        self.workspace_bytes = self.workspace.view(torch.uint8).view(-1)
        self.workspace_pages = workspace_pages
        self.chunk_pages = chunk_pages
        # A layered load uploads every chunk's ids before its first scatter, and every group's
        # scatters read them: half the ring holds the ids of a load of every block, so that no
        # upload of a load overwrites (the ring wrapping) ids that the load still reads.
        self.max_load_ids = table.num_blocks + _ID_ALIGN * -(-table.num_blocks // chunk_pages)
        id_capacity = max(4096, 4 * chunk_pages + 2 * _ID_ALIGN, 2 * self.max_load_ids)
        self.ids = _IdRing(id_capacity, device) if self.stream else None
        self.copy_pages = (id_capacity // 2 - _ID_ALIGN) // 2
        self.scatter_stream = torch.cuda.Stream(device) if self.stream is not None else None   # loads
        self.last_scatter: torch.cuda.Event | None = None     # the last load's last scatter

    def upload(self, block_ids: np.ndarray) -> torch.Tensor:
        if self.ids is None:
            return torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int32))
        return self.ids.upload(block_ids, self.stream)

    def upload_pair(self, first_ids: np.ndarray, second_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Two id arrays of one length in one upload, the second at an aligned offset (so that its
        slice, like the first, is one Triton specialisation)."""
        count = len(first_ids)
        assert len(second_ids) == count <= self.copy_pages, (len(first_ids), len(second_ids), self.copy_pages)
        offset = -(-count // _ID_ALIGN) * _ID_ALIGN
        both = np.zeros(offset + count, dtype=np.int32)
        both[:count] = first_ids
        both[offset:] = second_ids
        uploaded = self.upload(both)
        return uploaded[:count], uploaded[offset:]


def _spans(segments: list[int]) -> list[tuple[int, int, int]]:
    """Sorted segment indices as spans of consecutive ones: (first segment, its index in the list, count)."""
    spans: list[tuple[int, int, int]] = []
    for index, segment in enumerate(segments):
        if spans and spans[-1][0] + spans[-1][2] == segment:
            spans[-1] = (spans[-1][0], spans[-1][1], spans[-1][2] + 1)
        else:
            spans.append((segment, index, 1))
    return spans


class Runs(NamedTuple):
    starts: np.ndarray      # index into the transfer's pages of each run's first page
    ends: np.ndarray


def page_runs(host_page_ids: np.ndarray) -> Runs:
    """Maximal runs of consecutive L2 page ids, as [start, end) index ranges."""
    breaks = np.flatnonzero(np.diff(host_page_ids) != 1) + 1
    return Runs(np.concatenate(([0], breaks)), np.concatenate((breaks, [len(host_page_ids)])))


class KVTransfer:
    """Saves and loads of whole pages between one engine's KV tensors and one mapped L2 pool."""

    def __init__(self, layout: KVLayout, host_pool: SharedHostPool, *, backend: str = "auto",
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES):
        if backend not in TRANSFER_BACKENDS:
            raise ValueError(f"backend must be one of {TRANSFER_BACKENDS}, got {backend!r}")
        if backend == "triton" and not triton_available():
            raise RuntimeError("backend 'triton' was asked for, but triton is not installed")
        self.layout = layout
        self.device = layout.device
        self.table = SegmentTable(layout)
        # Loads by the path they took: layered, whole (asked so, or too many ids), or whole because
        # the L2 pages lay in more than LAYERWISE_MAX_RUNS runs (a layered load asked for).
        self.load_paths = Counts((counters.ENGINE_LOAD_PATHS,))
        # A layered load goes in LOAD_GROUPS groups of consecutive layers (or one per layer, for
        # fewer layers), the last group's layers one by one (what a prefill still computes after the
        # load's last DMA is then one layer, not a group): each group's segments in page order (its
        # layers' K, then their V: each a contiguous span of a page, one strided copy per run of
        # pages), and their table; a group of a packed page is [segments of the group, words].
        group_size = -(-layout.num_layers // min(layout.num_layers, LOAD_GROUPS))
        groups = [tuple(range(first, min(first + group_size, layout.num_layers)))
                  for first in range(0, layout.num_layers, group_size)]
        self.layer_groups = groups[:-1] + [(layer,) for layer in groups[-1]]
        group_size = max(len(layers) for layers in self.layer_groups)
        group_segments = [sorted(s for layer in layers for s in layout.layer_segments(layer))
                          for layers in self.layer_groups]
        self.group_tables = [SegmentTable(layout, segments) for segments in group_segments]
        self.group_spans = [_spans(segments) for segments in group_segments]
        self.page_bytes = layout.page_bytes
        self.segment_bytes = layout.segment_bytes
        self.use_host_pool(host_pool)
        workspace_pages = max(1, min(workspace_bytes // self.page_bytes, layout.num_blocks))
        # A load holds one group of layers of its pages in each of its slots: one page of the
        # largest group at least (a workspace of one page of one layer is made two).
        load_pages = max(workspace_pages, -(-_LOAD_SLOTS * group_size // layout.num_layers))
        layer_chunk_pages = load_pages * layout.num_layers // (_LOAD_SLOTS * group_size)
        self.lanes = {"save": _Lane("save", self.table, workspace_pages, workspace_pages),
                      "load": _Lane("load", self.table, load_pages, layer_chunk_pages)}
        self.workspace_pages = workspace_pages
        self.backend_by_direction = choose_backends(backend, self.table, self.group_tables,
                                                    self.lanes["save"].workspace)
        self._gather = BACKENDS[self.backend_by_direction["save"]].gather
        self._scatter = BACKENDS[self.backend_by_direction["load"]].scatter
        self._copy_blocks = BACKENDS[self.backend_by_direction["load"]].copy_blocks
        self._warm()

    def use_host_pool(self, host_pool: SharedHostPool) -> None:
        """Move every later transfer to and from ``host_pool`` (a new session's, after a re-attach;
        the caller makes sure none of the old one is in flight). Drops the view of the old pool,
        which can then be closed."""
        if host_pool.geometry.bytes_per_page != self.page_bytes:
            raise ValueError(f"L2 pages of {host_pool.geometry.bytes_per_page} bytes cannot hold this layout's "
                             f"pages of {self.page_bytes}")
        if host_pool.pin_requested and host_pool.pin_chunk_bytes % self.page_bytes:
            raise ValueError(f"the pool is pinned in chunks of {host_pool.pin_chunk_bytes} bytes, not whole pages "
                             f"of {self.page_bytes}: a layer's rows would span two registrations")
        self.host_pool = host_pool
        self.host_bytes = host_pool.byte_view()
        self.num_host_pages = host_pool.num_pages

    # ---- the two paths ------------------------------------------------------------------------

    def save(self, block_ids: np.ndarray, host_page_ids: np.ndarray,
             after: torch.cuda.Event | None = None, generation: int | None = None) -> Transfer:
        """Queue: blocks -> packed -> L2 pages (block_ids[i] into host_page_ids[i]). With a
        ``generation`` (the lease's), only the pages the pool's generations let this writer claim,
        at the call, before any copy is queued (``Transfer.claimed`` says which); the caller
        stamps them once the transfer is done."""
        block_ids, host_page_ids = self._check(block_ids, host_page_ids)
        claimed = None
        if generation is not None:
            claimed = self.host_pool.generations.claim(host_page_ids, generation)
            block_ids, host_page_ids = block_ids[claimed], host_page_ids[claimed]
            if not len(block_ids):
                return Transfer(0, None, None, claimed=claimed)
        lane = self.lanes["save"]
        blocks_event = None
        started = time.perf_counter()
        with self._on(lane, after):
            start_event = self._record(lane, timing=True)
            for first in range(0, len(block_ids), lane.workspace_pages):
                last = min(first + lane.workspace_pages, len(block_ids))
                self._gather(self.table, lane.upload(block_ids[first:last]), lane.workspace[: last - first])
                if last == len(block_ids):
                    blocks_event = self._record(lane)      # the last gather: the blocks are read
                self._copy_runs(lane, host_page_ids[first:last])
            return Transfer(len(block_ids), blocks_event, self._record(lane, timing=True), start_event=start_event,
                            host_seconds=time.perf_counter() - started, claimed=claimed)

    def load(self, host_page_ids: np.ndarray, block_ids: np.ndarray,
             after: torch.cuda.Event | None = None, layered: bool = True) -> Transfer:
        """Queue: L2 pages -> blocks (host_page_ids[i] into block_ids[i]). ``layered`` (where the
        L2 pages lie in few runs): group by group of layers (``layer_groups``), each group's rows
        into one of two packed slots on the copy stream, its scatter on the lane's scatter stream,
        an event after it for each of its layers (``Transfer.layer_events``), so the DMA of the
        next group runs while one is scattered and the engine's attention of layer i waits for
        layer i's group alone. Otherwise (or pages in many runs, which would take a strided copy
        per run, group and K/V) the load goes whole: one DMA per run and one scatter, every
        layer's event the last one; the fewest host calls, for loads nobody waits on per layer."""
        block_ids, host_page_ids = self._check(block_ids, host_page_ids)
        lane = self.lanes["load"]
        # No pages: nothing to go group by group (and no group's event to give). More ids than
        # the ring keeps for one load (blocks named twice): whole.
        chunks = [(first, min(first + lane.chunk_pages, len(block_ids)))
                  for first in range(0, len(block_ids), lane.chunk_pages)]
        if layered and chunks and len(page_runs(host_page_ids).starts) > LAYERWISE_MAX_RUNS:
            self.load_paths.add(counters.ENGINE_LOAD_PATHS, 1, "whole_many_runs")
            return self._load_whole(lane, host_page_ids, block_ids, after)
        if not layered or not chunks or len(block_ids) + _ID_ALIGN * len(chunks) > lane.max_load_ids:
            self.load_paths.add(counters.ENGINE_LOAD_PATHS, 1, "whole")
            return self._load_whole(lane, host_page_ids, block_ids, after)
        self.load_paths.add(counters.ENGINE_LOAD_PATHS, 1, "layered")
        layer_events: list[torch.cuda.Event | None] = []
        slot_free: list[torch.cuda.Event | None] = [None] * _LOAD_SLOTS  # a slot's last scatter
        started = time.perf_counter()
        with self._on(lane, after):
            start_event = self._begin_load(lane)
            # A load of more pages than one group's slot holds goes in chunks of them, group by
            # group: a group's event comes after its last chunk (the last one timed: the load's end).
            ids = [lane.upload(block_ids[first:last]) for first, last in chunks]    # on the copy stream
            pieces = [self._pieces(host_page_ids[first:last]) for first, last in chunks]
            step = 0
            with self._on_scatter_stream(lane):
                for group, (layers, table) in enumerate(zip(self.layer_groups, self.group_tables)):
                    for chunk, (first, last) in enumerate(chunks):
                        slot = step % _LOAD_SLOTS
                        step += 1
                        if lane.stream is not None and slot_free[slot] is not None:
                            lane.stream.wait_event(slot_free[slot])
                        packed = self._group_packed(lane, table, last - first, slot)
                        self._copy_group(lane, group, pieces[chunk], packed)
                        final = group == len(self.layer_groups) - 1 and chunk == len(chunks) - 1
                        slot_free[slot] = event = self._scatter_after_copy(lane, table, packed, ids[chunk], timing=final)
                    layer_events.extend([event] * len(layers))
        return self._end_load(lane, len(block_ids), layer_events[-1], start_event, started, layer_events)

    def _begin_load(self, lane: _Lane) -> torch.cuda.Event | None:
        """On the load lane's stream, before a load (layered, whole or from a peer): wait for the
        last load's scatters (they read their ids and slots after the copy stream moved on: the id
        ring and the slots are reused once they are done); returns the load's timed start event."""
        if lane.last_scatter is not None:
            lane.stream.wait_event(lane.last_scatter)
        return self._record(lane, timing=True)

    @staticmethod
    def _end_load(lane: _Lane, num_pages: int, done_event: torch.cuda.Event | None,
                  start_event: torch.cuda.Event | None, started: float,
                  layer_events: list[torch.cuda.Event | None] | None = None) -> Transfer:
        """The queued load's Transfer; its last event is what the next load waits for."""
        lane.last_scatter = done_event
        return Transfer(num_pages, done_event, done_event, layer_events, start_event, time.perf_counter() - started)

    def _scatter_after_copy(self, lane: _Lane, table: SegmentTable, packed: torch.Tensor,
                            ids: torch.Tensor, timing: bool = False) -> torch.cuda.Event | None:
        """The scatter of packed into the blocks, on the scatter stream (the current stream:
        ``_on_scatter_stream``) once the copies queued so far on the copy stream are done; the
        event after it."""
        if lane.scatter_stream is None:
            self._scatter(table, packed, ids)
            return self._record(lane, timing=timing)
        copied = torch.cuda.Event()
        copied.record(lane.stream)
        lane.scatter_stream.wait_event(copied)
        self._scatter(table, packed, ids)
        return self._record(lane, lane.scatter_stream, timing=timing)

    @staticmethod
    @contextlib.contextmanager
    def _on_scatter_stream(lane: _Lane) -> Iterator[None]:
        """Launch on the lane's scatter stream (the copies name their stream themselves)."""
        if lane.scatter_stream is None:
            yield
            return
        with torch.cuda.stream(lane.scatter_stream):
            yield

    def _load_whole(self, lane: _Lane, host_page_ids: np.ndarray, block_ids: np.ndarray,
                    after: torch.cuda.Event | None) -> Transfer:
        started = time.perf_counter()
        with self._on(lane, after):
            start_event = self._begin_load(lane)
            for first in range(0, len(block_ids), lane.workspace_pages):
                last = min(first + lane.workspace_pages, len(block_ids))
                self._copy_runs(lane, host_page_ids[first:last], to_host=False)
                self._scatter(self.table, lane.workspace[: last - first], lane.upload(block_ids[first:last]))
            done_event = self._record(lane, timing=True)
        return self._end_load(lane, len(block_ids), done_event, start_event, started)

    def copy_from(self, source: SegmentTable, source_block_ids: np.ndarray, block_ids: np.ndarray,
                  after: torch.cuda.Event | None = None) -> Transfer:
        """Queue on the load lane: another engine's blocks (``source``: its tensors mapped into this
        process, pages of this layout's format, in words of its size) -> this engine's blocks
        (source_block_ids[i] into block_ids[i]). One block-to-block launch, device to device, nothing
        packed between (more only for more blocks than one upload of the id ring holds)."""
        source_block_ids = np.asarray(source_block_ids, dtype=np.int64)
        block_ids = np.asarray(block_ids, dtype=np.int64)
        if block_ids.ndim != 1 or source_block_ids.shape != block_ids.shape:
            raise ValueError(f"source_block_ids {source_block_ids.shape} and block_ids {block_ids.shape} must be "
                             "1-D and of one length")
        check_same_pages(source, self.table)
        self.layout.check_block_ids(block_ids)
        source.layout.check_block_ids(source_block_ids)
        lane = self.lanes["load"]
        started = time.perf_counter()
        with self._on(lane, after):
            start_event = self._begin_load(lane)
            for first in range(0, len(block_ids), lane.copy_pages):
                last = min(first + lane.copy_pages, len(block_ids))
                source_ids, ids = lane.upload_pair(source_block_ids[first:last], block_ids[first:last])
                self._copy_blocks(source, source_ids, self.table, ids)
            done_event = self._record(lane, timing=True)
        return self._end_load(lane, len(block_ids), done_event, start_event, started)

    @staticmethod
    def _group_packed(lane: _Lane, table: SegmentTable, num_pages: int, slot: int) -> torch.Tensor:
        """Slot ``slot`` of the lane's workspace as one group of num_pages packed pages [n, segments, words]."""
        shape = table.packed_shape(num_pages)
        size = shape[0] * shape[1] * shape[2]
        start = slot * (lane.workspace_words.numel() // _LOAD_SLOTS)
        return lane.workspace_words[start: start + size].view(shape)

    def _pieces(self, host_page_ids: np.ndarray) -> list[tuple[int, int, int]]:
        """The L2 pages as pieces (L2 byte offset, index of its first page, pages): runs of
        consecutive pages, cut where a pinned chunk ends (between pages)."""
        page_bytes = self.page_bytes
        pieces = []
        runs = page_runs(host_page_ids)
        for start, end in zip(runs.starts.tolist(), runs.ends.tolist()):
            host_start = int(host_page_ids[start]) * page_bytes
            for piece_start, piece_end in self.host_pool.chunk_pieces(host_start, host_start + (end - start) * page_bytes):
                assert (piece_start - host_start) % page_bytes == 0 and (piece_end - piece_start) % page_bytes == 0
                pieces.append((piece_start, start + (piece_start - host_start) // page_bytes,
                               (piece_end - piece_start) // page_bytes))
        return pieces

    def _copy_group(self, lane: _Lane, group: int, pieces: list[tuple[int, int, int]], packed: torch.Tensor) -> None:
        """One group of layers of the pages into packed [n, segments of the group, words]: per
        piece and per span of the group's segments (its K, its V), one strided copy of a row per
        page (a page apart in L2, the group's segments apart in packed)."""
        segment_bytes = self.segment_bytes
        width = self.group_tables[group].num_segments
        packed_pitch = width * segment_bytes
        packed_bytes = packed.view(torch.uint8).view(-1)
        for host_start, first, height in pieces:
            for segment, index, count in self.group_spans[group]:
                self._copy_rows(lane, packed_bytes, (first * width + index) * segment_bytes, packed_pitch,
                                host_start + segment * segment_bytes, self.page_bytes, count * segment_bytes, height)

    def _copy_rows(self, lane: _Lane, packed_bytes: torch.Tensor, packed_offset: int, packed_pitch: int,
                   host_offset: int, host_pitch: int, width: int, height: int) -> None:
        """height rows of width bytes: L2 bytes host_offset + i * host_pitch -> packed_offset + i * packed_pitch."""
        if lane.stream is not None:
            cudart.copy_2d_to_device(packed_bytes.data_ptr() + packed_offset, packed_pitch,
                                     self.host_bytes.data_ptr() + host_offset, host_pitch, width, height,
                                     lane.stream.cuda_stream)
            return
        packed_rows = packed_bytes.as_strided((height, width), (packed_pitch, 1),
                                              packed_bytes.storage_offset() + packed_offset)
        packed_rows.copy_(self.host_bytes.as_strided((height, width), (host_pitch, 1),
                                                     self.host_bytes.storage_offset() + host_offset))

    def _copy_runs(self, lane: _Lane, host_page_ids: np.ndarray, to_host: bool = True) -> None:
        """Packed pages <-> L2: one DMA per run of consecutive L2 pages (cut at pinned-chunk boundaries)."""
        page_bytes = self.page_bytes
        for host_start, first, num_pages in self._pieces(host_page_ids):
            host = self.host_bytes[host_start: host_start + num_pages * page_bytes]
            packed = lane.workspace_bytes[first * page_bytes: (first + num_pages) * page_bytes]
            if to_host:
                host.copy_(packed, non_blocking=True)
            else:
                packed.copy_(host, non_blocking=True)

    def _check(self, block_ids, host_page_ids) -> tuple[np.ndarray, np.ndarray]:
        block_ids = np.asarray(block_ids, dtype=np.int64)
        host_page_ids = np.asarray(host_page_ids, dtype=np.int64)
        if block_ids.ndim != 1 or block_ids.shape != host_page_ids.shape:
            raise ValueError(f"block_ids {block_ids.shape} and host_page_ids {host_page_ids.shape} must be "
                             "1-D and of one length")
        self.layout.check_block_ids(block_ids)
        if host_page_ids.size and (int(host_page_ids.min()) < 0 or int(host_page_ids.max()) >= self.num_host_pages):
            raise ValueError(f"L2 page ids outside [0, {self.num_host_pages})")
        return block_ids, host_page_ids

    @staticmethod
    @contextlib.contextmanager
    def _on(lane: _Lane, after: torch.cuda.Event | None) -> Iterator[None]:
        """Queue on the lane's stream, after ``after`` (an event of the caller's stream)."""
        if lane.stream is None:
            yield
            return
        # The device too: the runtime's strided copies take the calling thread's current device.
        with torch.cuda.device(lane.stream.device), torch.cuda.stream(lane.stream):
            if after is not None:
                lane.stream.wait_event(after)
            yield

    @staticmethod
    def _record(lane: _Lane, stream: torch.cuda.Stream | None = None, timing: bool = False) -> torch.cuda.Event | None:
        """An event of the lane's stream (or of ``stream``); None on CPU, where copies are done on return."""
        if lane.stream is None:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream or lane.stream)
        return event

    # ---- set-up -------------------------------------------------------------------------------

    def _warm(self) -> None:
        """Run each lane's path once on one page, so that the first real transfer compiles, finds
        and allocates nothing: L2 page 0 is read into the workspace (never written: it is not this
        engine's; for the load lane, each group of layers of it by the strided copies), then block
        0 is gathered and scattered back unchanged (for the load lane, group by group), and on the
        load lane copied onto itself (a peer restore's block copy)."""
        block = np.zeros(1, dtype=np.int64)
        save, load = self.lanes["save"], self.lanes["load"]
        with self._on(save, None):
            packed = save.workspace[:1]
            save.workspace_bytes[: self.page_bytes].copy_(self.host_bytes[: self.page_bytes], non_blocking=True)
            self._gather(self.table, save.upload(block), packed)
            self._scatter(self.table, packed, save.upload(block))
        with self._on(load, None):
            # Every group: one of another size (the last, say) may be a kernel of its own to
            # Triton (a group of one segment is).
            for group, table in enumerate(self.group_tables):
                packed = self._group_packed(load, table, 1, 0)
                self._copy_group(load, group, self._pieces(block), packed)
                self._gather(table, load.upload(block), packed)
                self._scatter(table, packed, load.upload(block))
            source_ids, ids = load.upload_pair(block, block)
            self._copy_blocks(self.table, source_ids, self.table, ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def report(self) -> dict[str, Any]:
        return {"backends": dict(self.backend_by_direction), "workspace_pages": self.workspace_pages,
                "word_bytes": self.table.word_bytes, "segments": self.table.num_segments,
                "id_host_waits": sum(l.ids.host_waits for l in self.lanes.values() if l.ids is not None),
                "load_paths": {path: self.load_paths.value(counters.ENGINE_LOAD_PATHS, path)
                               for path in sorted(counters.LOAD_PATHS)
                               if self.load_paths.value(counters.ENGINE_LOAD_PATHS, path)}}
