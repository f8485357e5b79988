"""Moves whole KV pages between the engine's L1 pool and its mapping of the shared L2 pool.

Design note. L1 keeps the attention layout `[2, L, N, P, H, D]`; L2 is page-major `[n, 2, L, P, H, D]`.
Every transfer packs the selected pages page-major in a device buffer, so that the host side is a
single DMA:

    backup  (D2H): gather L1 pages -> packed device buffer -> one DMA -> L2 pages
    restore (H2D): L2 pages -> one DMA -> packed device buffer -> scatter into L1 pages

When the L2 pages are one ascending run, the DMA goes straight to or from their slice of the
shared mapping (cut only where the pool's pinned chunks meet: one copy must not span two
registrations). Otherwise it goes through a pinned staging buffer plus one host-side copy: for a
restore the host gathers into staging before the DMA; for a backup the host scatters out of
staging after the DMA has completed, which happens in the thread that polls the transfer
(`Transfer.done()` / `wait()`): a backup is complete only once that has run. The host-side copy
moves runs of consecutive L2 pages as whole blocks, split across `host_copy_threads` threads
(numpy copies release the GIL), because one thread's memcpy is slower than the DMA: on the H200
machine one thread copied ~6 GB/s, and a 3,500-token backup of pages that are all apart ran at
9 / 16 / 19 GB/s with 4 / 8 / 16 threads. `fragmented_copy="dma_per_run"` instead issues one DMA
per run straight between the packed buffer and the pool (no staging, no host copy): 35-37 GB/s for
the same worst case (bench/results/h200/transfer.json, layout "fragmented/dma").

CUDA ordering. Each engine has two private streams: a compute stream for the page-id uploads,
gathers and scatters, and a copy stream for every DMA. A backup's gather waits on the caller's
current stream (which produced the L1 pages); a restore's scatter waits on it too (it last used
the pages being restored into), while the restore's DMAs, which write only the workspace's packed
buffer, start at once. Page ids reach the device from pinned memory, asynchronously. Buffers a
pending transfer uses (its workspace with its events and index tensors, host views) are owned by
its `Transfer` until completion (the completion event is recorded on the stream that runs last,
after it has waited for the other), so nothing is reused early. With a pool pinned in the
background, a direct DMA first waits (on the host) until the chunks it touches are pinned.

Slices. A transfer of at least 32 MiB is cut into up to `max_slices` slices of whole pages (at
least 16 MiB each), chained by events: a backup gathers slice k+1 while the copy engine moves
slice k; a restore scatters slice k while slice k+1 is copied. Only the first gather (or the last
scatter) then adds to the DMA's time instead of the whole one (a 1,000-token Qwen3-8B gather
takes ~0.08 ms on the H200, next to a 2.7 ms DMA).

Host time. Submitting is on the critical path (the device idles until the first copy or kernel is
queued), so the submit path makes no per-call CUDA objects, queues its DMAs through the CUDA
runtime by address onto the copy stream (engine_client.cuda_runtime: no views, no stream switch;
through torch only where no runtime library can be called), switches streams for kernels with
plain set_stream calls, launches Triton through a launcher bound to the pool (kernels.PoolKernels:
the pool is checked once), and validates ids with a few vectorized passes (one reduction for the
range; ascending destinations need no sort to be known distinct). The L2 pages of a daemon's reply
for a contiguous reservation, a list of ints running up one by one, are recognized with list
operations alone. On the H200 machine this took `send_to` of a 1,000-token backup from 170 µs to
33 µs (bench/results/h200/submit_baseline.json and submit.json; two machines of the same kind, the
second slower at every primitive).

Graphs. A gather or scatter of one slice is captured as a CUDA graph the second time the same
workspace wants it (same first page and count: the graph holds the workspace's buffers and the
pool), up to 32 per workspace, and launched with cudaGraphLaunch on the compute stream; the
caller-stream wait, the event records and the waits between the streams go through the runtime
by handle as well, so such a transfer makes no stream switch and no Triton launch. A one-off size
launches directly. A capture that fails turns graphs off for the engine (`cuda_graphs=False`
does so from the start); `backend_report()` says whether they are on.

Started transfers. `start_backup` gathers, and `start_restore` checks and uploads its ids, while
the engine's match is in flight (KVCacheClient.match_async); `send_to` / `receive_from` then queue
only the DMAs (and the scatters) once the reply names the L2 pages. A started backup's gather is
cut into fewer slices (at least 256 MiB each): it has the round trip to run in, and every launch
adds host time that must fit there too.

Backends. `torch` (index_select / index_copy_) and `triton` (engine_client.kernels) pack and unpack
pages; `auto` times both on this engine's geometry when the engine is built and keeps the faster
per direction (the gather for backups, the scatter for restores); `backend_report()` says what was
chosen and why. An explicitly named backend that cannot run raises; only `auto` falls back.

Bits, not numbers. Pages are moved through same-width integer views of the tensors, which makes
every copy bit-exact and keeps dtypes such as float8 (that some torch ops lack) off the copy path.

Workspaces (a packed device buffer, plus pinned staging once a fragmented transfer needed it) are
reused best-fit by page count; at most one idle workspace is kept: the largest, preferring one with
staging on ties. Not thread-safe: one engine thread drives a TransferEngine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from engine_client import cuda_runtime, kernels
from engine_client.l1_pool import L1Pool
from engine_client.shared_pool import SharedHostPool

logger = logging.getLogger(__name__)

# Same-width integer dtypes for moving pages as raw bits.
_BITS_DTYPE_BY_ITEMSIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_MAX_IDLE_WORKSPACES = 1
_MAX_GRAPHS_PER_WORKSPACE = 32

AUTO = "auto"
DIRECTIONS = ("D2H", "H2D")
FRAGMENTED_COPIES = ("staging", "dma_per_run")
# `auto` times each backend on this many scattered L1 pages (a few hundred MiB for an 8B model):
# enough for the kernels to reach their steady bandwidth, small enough to take milliseconds.
AUTO_TIMING_PAGES = 64
_AUTO_WARMUP_CALLS = 2          # the first call compiles the Triton kernel
_AUTO_TIMED_CALLS = 5

# Slices of a transfer (see the module note): at most DEFAULT_MAX_SLICES, each at least this big,
# so a slice's DMA (~0.3 ms at 55 GB/s) dwarfs the few microseconds each slice adds on the host.
_MIN_SLICE_BYTES = 16 << 20
DEFAULT_MAX_SLICES = 4
# A started backup (start_backup) gathers while the reservation's round trip is in flight, which
# the gather of a 1,000-token Qwen3-8B prefix (~0.05 ms) easily fits in: cutting it would only add
# kernel launches to the host work that also has to fit there. Its slices are at least this big.
_MIN_STARTED_SLICE_BYTES = 256 << 20

# A host-side copy gives each thread at least this much; below it, handing work over costs more
# than it saves.
_MIN_BYTES_PER_COPY_THREAD = 4 << 20


def default_host_copy_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


# ---- backends ----------------------------------------------------------------------------------


class TransferBackend(Protocol):
    """How pages are packed and unpacked on the device. All tensors share one integer bits dtype.

    gather:  out[i] = l1_kv[:, :, page_ids[i]]            out: [n, 2, L, P, H, D]
    scatter: l1_kv[:, :, page_ids[i]] = packed[i]          packed: [n, 2, L, P, H, D]
    page_ids is an int64 tensor on l1_kv's device, already checked on the host to be in range;
    scatter's page ids are distinct.
    """

    name: str

    def gather(self, l1_kv: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor) -> None: ...

    def scatter(self, packed: torch.Tensor, page_ids: torch.Tensor, l1_kv: torch.Tensor) -> None: ...


class TorchBackend:
    """Plain torch: one index kernel per direction, writing through a permuted view (no temporary)."""

    name = "torch"

    def gather(self, l1_kv: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor) -> None:
        # out.permute(...) is out seen as [2, L, n, P, H, D]; index_select fills it in place.
        torch.index_select(l1_kv, 2, page_ids, out=out.permute(1, 2, 0, 3, 4, 5))

    def scatter(self, packed: torch.Tensor, page_ids: torch.Tensor, l1_kv: torch.Tensor) -> None:
        l1_kv.index_copy_(2, page_ids, packed.permute(1, 2, 0, 3, 4, 5))


class TritonBackend:
    """The Triton kernels of engine_client.kernels (interpreted on CPU tensors, for tests).

    The transfer engine has checked the ids on the host, so the kernels' bounds check, which costs
    a device synchronization, is skipped. The engine passes one pool tensor on every call, so the
    launches go through a kernels.PoolKernels bound to it: the pool is checked once, and each call
    checks only the packed buffer and the ids (the full per-call checks cost more host time than
    the launch itself).
    """

    name = "triton"

    def __init__(self) -> None:
        if not kernels.triton_available():
            raise RuntimeError("the triton transfer backend needs the triton package, which is not installed")
        self._pool_kernels: kernels.PoolKernels | None = None

    def gather(self, l1_kv: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor) -> None:
        self._bound_to(l1_kv).gather(page_ids, out, check_bounds=False)

    def scatter(self, packed: torch.Tensor, page_ids: torch.Tensor, l1_kv: torch.Tensor) -> None:
        self._bound_to(l1_kv).scatter(packed, page_ids, check_bounds=False)

    def _bound_to(self, l1_kv: torch.Tensor) -> kernels.PoolKernels:
        if self._pool_kernels is None or self._pool_kernels.l1_kv is not l1_kv:
            self._pool_kernels = kernels.PoolKernels(l1_kv)
        return self._pool_kernels


_BACKEND_FACTORIES: dict[str, Callable[[], TransferBackend]] = {"torch": TorchBackend, "triton": TritonBackend}


def register_backend(name: str, factory: Callable[[], TransferBackend]) -> None:
    """Make a backend selectable by name."""
    if name in _BACKEND_FACTORIES or name == AUTO:
        raise ValueError(f"transfer backend {name!r} is already registered")
    _BACKEND_FACTORIES[name] = factory


def available_backends() -> list[str]:
    return sorted([*_BACKEND_FACTORIES, AUTO])


# ---- transfers ---------------------------------------------------------------------------------


class _Workspace:
    """A packed page-major device buffer, its page-index buffers, its CUDA events and, once needed,
    host staging.

    The page ids go host -> device through `ids_host` (pinned, so the copy is asynchronous) into
    `ids_device`. On CUDA, `start_event` and `end_event` time the transfer and `slice_events` order
    each slice's DMA after its gather (or its scatter after its DMA). All of it is reused with the
    workspace, which no other transfer touches until this one has completed; views of the buffers
    are taken once here, not per transfer.
    """

    __slots__ = ("num_pages", "packed", "packed_bytes", "packed_address", "ids_host", "ids_host_array",
                 "ids_host_address", "ids_device", "ids_device_address", "staging", "staging_bytes",
                 "staging_address", "start_event", "end_event", "slice_events", "caller_event", "event_handles",
                 "graphs", "graph_uses")

    def __init__(self, num_pages: int, packed: torch.Tensor, ids_host: torch.Tensor, ids_device: torch.Tensor,
                 num_slice_events: int | None):
        """``num_slice_events`` is None off CUDA (no events there)."""
        self.num_pages = num_pages
        self.packed = packed
        self.packed_bytes = packed.view(torch.uint8).view(-1)
        self.packed_address = packed.data_ptr()
        self.ids_host = ids_host
        self.ids_host_array = ids_host.numpy()
        self.ids_host_address = ids_host.data_ptr()
        self.ids_device = ids_device
        self.ids_device_address = ids_device.data_ptr()
        self.staging: torch.Tensor | None = None
        self.staging_bytes: torch.Tensor | None = None
        self.staging_address = 0
        self.start_event: torch.cuda.Event | None = None
        self.end_event: torch.cuda.Event | None = None
        self.slice_events: list[torch.cuda.Event] = []
        self.caller_event: torch.cuda.Event | None = None
        if num_slice_events is not None:
            self.caller_event = torch.cuda.Event()
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)
            self.slice_events = [torch.cuda.Event() for _ in range(num_slice_events)]
        # For the CUDA runtime's calls (see TransferEngine._graph_launches): each event's handle,
        # set by bind_events; the gathers and scatters captured as graphs, by (kind, first, count),
        # and how often each was wanted before.
        self.event_handles: _EventHandles | None = None
        self.graphs: dict[tuple[str, int, int], tuple[torch.cuda.CUDAGraph, int]] = {}
        self.graph_uses: dict[tuple[str, int, int], int] = {}

    def bind_events(self, stream: torch.cuda.Stream) -> None:
        """Create the events now (torch creates them at their first record) and keep their handles."""
        events = [self.caller_event, self.start_event, self.end_event, *self.slice_events]
        for event in events:
            event.record(stream)
        handles = [event._as_parameter_.value for event in events]
        self.event_handles = _EventHandles(handles[0], handles[1], handles[2], handles[3:])

    def add_staging(self, staging: torch.Tensor) -> None:
        self.staging = staging
        self.staging_bytes = staging.view(torch.uint8).view(-1)
        self.staging_address = staging.data_ptr()


class _EventHandles(NamedTuple):
    caller: int
    start: int
    end: int
    slices: list[int]


class _HostBuffer(NamedTuple):
    """The host side of a transfer's DMAs: the tensor that holds the memory (the pool's pages, or a
    workspace's staging) and its address."""

    tensor: torch.Tensor
    address: int


class WorkspaceInfo(NamedTuple):
    num_pages: int
    has_staging: bool


class Transfer:
    """One submitted page transfer. Poll `done()` or block in `wait()`; both finish it."""

    def __init__(self, direction: str, num_pages: int, num_bytes: int,
                 on_complete: Callable[["Transfer"], None] | None):
        self.direction = direction          # "D2H" (backup) or "H2D" (restore)
        self.num_pages = num_pages
        self.num_bytes = num_bytes
        self._on_complete = on_complete
        self._start_event: torch.cuda.Event | None = None
        self._end_event: torch.cuda.Event | None = None
        self._host_seconds = 0.0            # wall-clock work done on the host (CPU path, staging copies)
        self._finish: Callable[[], None] | None = None   # host work that must follow the device work
        self._refs: list[object] = []        # buffers the pending device work still reads or writes
        self._seconds: float | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the transfer has completed; never blocks on the device."""
        return self._complete(block=False)

    def wait(self) -> None:
        """Block until the transfer has completed."""
        self._complete(block=True)

    @property
    def seconds(self) -> float:
        """Device time (CUDA events) plus host-side copy time; wall clock on CPU. After completion.
        A started backup's runs from its gather to its last DMA, so it includes any wait for send_to;
        a started restore's runs from its first DMA."""
        if self._seconds is None:
            raise RuntimeError("the transfer has not completed; call wait() or poll done() first")
        return self._seconds

    @property
    def device_events(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """The CUDA events recorded where the device work starts and ends (None off CUDA), e.g. to
        place the transfer on a timeline against the caller's own events. They belong to the transfer's
        workspace: read them before the engine's next transfer, which may record them again."""
        if self._start_event is None or self._end_event is None:
            return None
        return self._start_event, self._end_event

    def _complete(self, block: bool) -> bool:
        if self._error is not None:
            raise self._error
        if self._seconds is not None:
            return True
        if self._end_event is not None:
            if block:
                self._end_event.synchronize()
            elif not self._end_event.query():
                return False
        try:
            if self._finish is not None:
                started = time.perf_counter()
                self._finish()
                self._host_seconds += time.perf_counter() - started
        except BaseException as error:
            self._error = error
            raise
        finally:
            device_seconds = 0.0
            if self._start_event is not None and self._end_event is not None:
                device_seconds = self._start_event.elapsed_time(self._end_event) / 1000.0
            self._seconds = device_seconds + self._host_seconds
            self._finish = None
            self._refs.clear()
            on_complete, self._on_complete = self._on_complete, None
            if on_complete is not None:
                on_complete(self)
        return True


class _PendingTransfer:
    """What a started backup and a started restore share: the Transfer they hand out, and one end,
    either by the call that names their L2 pages or by ``cancel``. ``drain()`` of the engine waits
    for the device work queued so far and ends them too."""

    _ended_message: str
    _drained_message: str
    _prepared_word: str

    def __init__(self, engine: "TransferEngine", transfer: Transfer):
        self._engine = engine
        self._transfer = transfer        # handed out at the end only (polling it early would end it)
        self.num_pages = transfer.num_pages
        self._ended = False

    def _checked_host_runs(self, host_page_ids: Sequence[int], first: int,
                           distinct: bool) -> tuple[int, list[tuple[int, int, int]]]:
        """(how many host pages, their runs as (position among the prepared pages, first host page,
        pages)), checked: in range, fitting the prepared pages from ``first``, and with ``distinct``
        listed once each. A daemon's reply for a contiguous reservation (a list of ints running up
        one by one) is recognized without building an array."""
        if self._ended:
            raise RuntimeError(self._ended_message)
        if self._transfer._seconds is not None and self.num_pages:
            raise RuntimeError(self._drained_message)
        count, host_runs = _host_page_runs(host_page_ids, self._engine.host_pool.num_pages, distinct)
        if type(first) is not int or not 0 <= first <= self.num_pages - count:
            raise ValueError(f"first={first!r} with {count} host pages does not fit the "
                             f"{self.num_pages} {self._prepared_word} pages")
        if first:
            host_runs = [(position + first, start, length) for position, start, length in host_runs]
        return count, host_runs

    def _end(self, count: int, host_runs: list[tuple[int, int, int]], first: int,
             enqueue: Callable[[Any, int, list[tuple[int, int, int]], int], None]) -> Transfer:
        """Queue the second half for the host pages (none: end like cancel); hand the Transfer out."""
        if count:
            self._ended = True
            enqueue(self, count, host_runs, first)
            return self._transfer
        return self.cancel()

    def cancel(self) -> Transfer:
        """Give it up: nothing is written. Its workspace is free once the device work queued so far
        (the gathers, or the id upload) is done: now if it is, else when the returned Transfer is
        polled or the engine drains."""
        self._ended = True
        self._transfer.num_pages, self._transfer.num_bytes = 0, 0
        self._transfer.done()
        return self._transfer


class PendingBackup(_PendingTransfer):
    """L1 pages gathered by ``TransferEngine.start_backup``, waiting to be told their L2 pages.

    Ends by ``send_to`` (the backup's DMAs are queued; returns the backup's Transfer) or by
    ``cancel`` (no DMA; returns a Transfer that completes with the gathers).
    """

    _ended_message = "this backup has already been sent or cancelled"
    _drained_message = "this backup was drained before it was sent: gather again"
    _prepared_word = "gathered"

    def __init__(self, engine: "TransferEngine", transfer: Transfer, slices: list[tuple[int, int]]):
        super().__init__(engine, transfer)
        self.slices = slices

    def send_to(self, host_page_ids: Sequence[int], first: int = 0) -> Transfer:
        """Queue the DMAs: host_page_ids[i] receives the gathered page first + i (a backup that
        skips pages the daemon already holds sends only the tail, with first > 0)."""
        count, host_runs = self._checked_host_runs(host_page_ids, first, distinct=True)
        return self._end(count, host_runs, first, self._engine._send_backup)


class PendingRestore(_PendingTransfer):
    """L1 pages made ready by ``TransferEngine.start_restore``, waiting to be told their L2 pages.

    Ends by ``receive_from`` (queues the DMAs and scatters; returns the restore's Transfer) or by
    ``cancel`` (L1 is not written).
    """

    _ended_message = "this restore has already been received or cancelled"
    _drained_message = "this restore was drained before it was received: start it again"
    _prepared_word = "prepared"

    def receive_from(self, host_page_ids: Sequence[int], first: int = 0) -> Transfer:
        """Queue the restore: the prepared L1 page first + i receives host_page_ids[i] (a hit shorter
        than the pages prepared restores only that many; sources may repeat)."""
        count, host_runs = self._checked_host_runs(host_page_ids, first, distinct=False)
        return self._end(count, host_runs, first, self._engine._receive_restore)


class TransferEngine:
    """Backs up L1 pages into shared L2 pages and restores them, page by page, bit for bit.

    The host pool's page views are taken per transfer and released at completion, so once every
    transfer has completed (`drain()`), the host pool can be closed.
    """

    def __init__(self, l1_pool: L1Pool, host_pool: SharedHostPool, backend: str = "torch",
                 host_copy_threads: int | None = None, fragmented_copy: str = "staging",
                 max_dma_bytes: int | None = None, max_slices: int = DEFAULT_MAX_SLICES,
                 cuda_graphs: bool = True):
        """``fragmented_copy`` says how L2 pages that are not one run move: "staging" (one DMA to
        pinned staging plus the host-side copy, the default) or "dma_per_run" (one DMA per run of
        consecutive L2 pages, straight between the packed buffer and the pool; no host copy).
        ``max_dma_bytes`` cuts direct DMAs into pieces of at most that many bytes (None: cut only
        at pinned-chunk boundaries), so the copy engine starts on the first piece while the later
        ones are still being submitted. ``max_slices`` is how many slices a transfer is cut into at
        most (each at least 16 MiB) so that packing one slice overlaps the DMA of another
        (see the module note); 1 packs the whole transfer before its DMA. ``cuda_graphs``: launch
        Triton gathers and scatters that recur as captured CUDA graphs (see the module note)."""
        if fragmented_copy not in FRAGMENTED_COPIES:
            raise ValueError(f"fragmented_copy must be one of {FRAGMENTED_COPIES}, got {fragmented_copy!r}")
        if max_dma_bytes is not None and (type(max_dma_bytes) is not int or max_dma_bytes < 1):
            raise ValueError(f"max_dma_bytes must be a positive integer or None, got {max_dma_bytes!r}")
        if type(max_slices) is not int or max_slices < 1:
            raise ValueError(f"max_slices must be a positive integer, got {max_slices!r}")
        if l1_pool.geometry != host_pool.geometry:
            raise ValueError(f"L1 pool geometry {l1_pool.geometry} differs from host pool "
                             f"geometry {host_pool.geometry}")
        if backend != AUTO and backend not in _BACKEND_FACTORIES:
            raise ValueError(f"unknown transfer backend {backend!r}; available: {available_backends()}")
        if host_copy_threads is None:
            host_copy_threads = default_host_copy_threads()
        if type(host_copy_threads) is not int or host_copy_threads < 1:
            raise ValueError(f"host_copy_threads must be a positive integer, got {host_copy_threads!r}")
        self.l1_pool = l1_pool
        self.host_pool = host_pool
        self.device = l1_pool.kv.device
        self.bytes_per_page = l1_pool.geometry.bytes_per_page
        self.host_copy_threads = host_copy_threads
        self.fragmented_copy = fragmented_copy
        self.max_dma_bytes = max_dma_bytes
        self.max_slices = max_slices
        self._page_shape = l1_pool.geometry.page_shape
        self._bits_dtype = _BITS_DTYPE_BY_ITEMSIZE[l1_pool.kv.element_size()]
        self._l1_bits = l1_pool.kv.view(self._bits_dtype)
        self._is_cuda = self.device.type == "cuda"
        self._device_index = self.device.index
        # Gathers, scatters and the page-id uploads run on `_stream`, every DMA on `_copy_stream`:
        # the copy engine moves one slice while the SMs pack or unpack the next.
        self._stream = torch.cuda.Stream(device=self.device) if self._is_cuda else None
        self._copy_stream = torch.cuda.Stream(device=self.device) if self._is_cuda else None
        # DMAs are queued through the CUDA runtime directly where it can be (see cuda_runtime),
        # onto the copy stream by its handle, between addresses known up front.
        self._runtime = cuda_runtime.load() if self._is_cuda else None
        self._copy_stream_handle = self._copy_stream.cuda_stream if self._copy_stream is not None else 0
        self._stream_handle = self._stream.cuda_stream if self._stream is not None else 0
        self._pool_address = host_pool.pages.data_ptr()
        self._copy_pool: concurrent.futures.ThreadPoolExecutor | None = None
        # The copy threads start lazily, from whatever thread submits the first staged transfer; an
        # engine may have pinned that thread to one CPU (see client.connect's cpu), which they
        # would inherit. They run on the CPUs of the thread that built the engine instead.
        self._copy_cpus = os.sched_getaffinity(0)
        self._idle_workspaces: list[_Workspace] = []
        self._transfer_to_workspace: dict[Transfer, _Workspace] = {}
        self.num_workspaces_created = 0
        self.num_stagings_created = 0
        if self._is_cuda and not host_pool.pin_requested:
            logger.warning("the shared host pool is not pinned: copies to and from it will be slow and synchronous")
        self.gather_backend: TransferBackend
        self.scatter_backend: TransferBackend
        if backend == AUTO:
            self.gather_backend, self.scatter_backend, self._backend_report = self._choose_fastest_backends()
        else:
            # An explicitly named backend is used as is: if it cannot run, construction or the
            # transfer raises; nothing falls back behind the caller's back.
            self.gather_backend = self.scatter_backend = _BACKEND_FACTORIES[backend]()
            self._backend_report = {"requested": backend, "chosen": {"D2H": backend, "H2D": backend}}
        # Gathers and scatters that recur are captured as CUDA graphs and launched by handle, with
        # their event records and waits, through the runtime: no stream switch, no Triton launch.
        self._capture_stream: torch.cuda.Stream | None = None
        graphs = (cuda_graphs and self._runtime is not None and hasattr(torch._C, "_cuda_getCurrentRawStream"))
        self._graph_gathers = graphs and isinstance(self.gather_backend, TritonBackend)
        self._graph_scatters = graphs and isinstance(self.scatter_backend, TritonBackend)
        self._backend_report["cuda_graphs"] = {"D2H": self._graph_gathers, "H2D": self._graph_scatters}
        self.num_graphs_captured = 0
        logger.info("transfer backends: %s", self._backend_report)

    # ---- public API ----------------------------------------------------------------------------

    def backup(self, l1_page_ids: Sequence[int], host_page_ids: Sequence[int]) -> Transfer:
        """Copy L1 pages into host pages (D2H); host_page_ids[i] receives l1_page_ids[i]."""
        l1_ids, host_runs = self._checked_ids(l1_page_ids, host_page_ids, destination="host")
        return self._submit("D2H", l1_ids, host_runs)

    def start_backup(self, l1_page_ids: Sequence[int]) -> PendingBackup:
        """Gather L1 pages into a packed device buffer now; their L2 pages are named later, by
        ``PendingBackup.send_to`` (which queues the DMAs). Made to overlap the reservation round
        trip: send the match (KVCacheClient.match_async), start the backup, then collect the reply."""
        l1_ids = _page_id_array("l1_page_ids", l1_page_ids, self.l1_pool.num_pages)
        num_pages = len(l1_ids)
        transfer = Transfer("D2H", num_pages, num_pages * self.bytes_per_page, self._release)
        slices = self._slices(num_pages, max(_MIN_SLICE_BYTES, _MIN_STARTED_SLICE_BYTES)) if num_pages else []
        pending = PendingBackup(self, transfer, slices)
        if num_pages == 0:
            transfer._complete(block=False)
            return pending
        workspace = self._acquire_workspace(num_pages, needs_staging=False)
        self._transfer_to_workspace[transfer] = workspace
        with self._completed_on_error(transfer):
            workspace.ids_host_array[:num_pages] = l1_ids
            if self._stream is None:
                started = time.perf_counter()
                self._gather_slices(workspace, pending.slices)
                transfer._host_seconds += time.perf_counter() - started
            else:
                # Until DMAs are queued, the transfer ends with its gathers (cancel() and drain()).
                if self._gathers_by_graph(workspace, num_pages, pending.slices):
                    self._runtime.event_record(workspace.event_handles.end, self._stream_handle)
                else:
                    with self._on_stream(self._stream) as callers_stream:
                        self._enqueue_gathers(workspace, num_pages, pending.slices, callers_stream)
                        workspace.end_event.record(self._stream)
                transfer._start_event, transfer._end_event = workspace.start_event, workspace.end_event
        return pending

    def start_restore(self, l1_page_ids: Sequence[int]) -> PendingRestore:
        """Get a restore into these L1 pages ready (ids checked and uploaded, workspace taken) before
        its L2 pages are known; ``PendingRestore.receive_from`` then queues only the DMAs and the
        scatters. Made to overlap the match's round trip (KVCacheClient.match_async)."""
        l1_ids = _page_id_array("l1_page_ids", l1_page_ids, self.l1_pool.num_pages)
        repeated = _first_repeated_id(l1_ids)
        if repeated is not None:
            raise ValueError(f"destination l1_page_ids lists page {repeated} more than once")
        num_pages = len(l1_ids)
        transfer = Transfer("H2D", num_pages, num_pages * self.bytes_per_page, self._release)
        pending = PendingRestore(self, transfer)
        if num_pages == 0:
            transfer._complete(block=False)
            return pending
        workspace = self._acquire_workspace(num_pages, needs_staging=False)
        self._transfer_to_workspace[transfer] = workspace
        with self._completed_on_error(transfer):
            workspace.ids_host_array[:num_pages] = l1_ids
            if self._stream is not None:
                assert workspace.start_event is not None and workspace.end_event is not None
                # Until receive_from, the transfer ends with the upload (cancel() and drain()).
                if self._runtime_usable():
                    handles, stream = workspace.event_handles, self._stream_handle
                    self._runtime.event_record(handles.start, stream)
                    self._upload_ids(workspace, num_pages)
                    self._runtime.event_record(handles.end, stream)
                else:
                    with self._on_stream(self._stream):
                        workspace.start_event.record(self._stream)
                        self._upload_ids(workspace, num_pages)
                        workspace.end_event.record(self._stream)
                transfer._start_event, transfer._end_event = workspace.start_event, workspace.end_event
        return pending

    def _receive_restore(self, pending: PendingRestore, num_pages: int, host_runs: list[tuple[int, int, int]],
                         first: int) -> None:
        """The second half of a started restore: the host pages (runs) into the prepared L1 pages
        first, first + 1, ..."""
        transfer = pending._transfer
        workspace = self._transfer_to_workspace[transfer]
        staged = len(host_runs) > 1 and self.fragmented_copy == "staging"
        slices = [(first + offset, count) for offset, count in self._slices(num_pages)]
        with self._completed_on_error(transfer):
            if staged:
                self._add_staging(workspace)
            transfer.num_pages, transfer.num_bytes = num_pages, num_pages * self.bytes_per_page
            host, slice_segments = self._host_side(transfer, workspace, host_runs, staged, slices)
            if self._stream is None:
                self._run_on_host(transfer, workspace, num_pages, host, slices, slice_segments)
            else:
                self._enqueue_restore(workspace, host, slices, slice_segments, upload_ids=0)

    def restore(self, host_page_ids: Sequence[int], l1_page_ids: Sequence[int]) -> Transfer:
        """Copy host pages into L1 pages (H2D); l1_page_ids[i] receives host_page_ids[i]."""
        l1_ids, host_runs = self._checked_ids(l1_page_ids, host_page_ids, destination="l1")
        return self._submit("H2D", l1_ids, host_runs)

    def use_host_pool(self, host_pool: SharedHostPool) -> None:
        """Move every later transfer to and from ``host_pool`` (a new session's L2 pool, after a
        re-attach), keeping the backends chosen and the workspaces. Only with nothing in flight:
        transfers queued against the old pool hold views of it."""
        if self._transfer_to_workspace:
            raise RuntimeError(f"{len(self._transfer_to_workspace)} transfers are in flight; drain() first")
        if host_pool.geometry != self.l1_pool.geometry:
            raise ValueError(f"host pool geometry {host_pool.geometry} differs from L1 pool "
                             f"geometry {self.l1_pool.geometry}")
        self.host_pool = host_pool
        self._pool_address = host_pool.pages.data_ptr()

    def backend_report(self) -> dict[str, Any]:
        """The requested backend, the one chosen per direction (D2H gathers, H2D scatters) and, for
        `auto`, the timings (ms per call, median) it chose by. Plain types, for ENGINE_REPORT."""
        return {key: (dict(value) if isinstance(value, dict) else value)
                for key, value in self._backend_report.items()}

    def set_host_copy_threads(self, num_threads: int) -> None:
        """How many threads share each host-side copy from the next transfer on (benchmarks sweep it)."""
        if type(num_threads) is not int or num_threads < 1:
            raise ValueError(f"host_copy_threads must be a positive integer, got {num_threads!r}")
        self.drain()
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
            self._copy_pool = None
        self.host_copy_threads = num_threads

    @property
    def num_in_flight(self) -> int:
        return len(self._transfer_to_workspace)

    @property
    def idle_workspaces(self) -> list[WorkspaceInfo]:
        return [WorkspaceInfo(ws.num_pages, ws.staging is not None) for ws in self._idle_workspaces]

    def drain(self) -> None:
        """Wait for every submitted transfer (used before shutdown and before closing the host pool)."""
        for transfer in list(self._transfer_to_workspace):
            transfer.wait()

    def close(self) -> None:
        """Drain, then drop the idle workspaces and stop the host-copy threads."""
        self.drain()
        self._idle_workspaces.clear()
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
            self._copy_pool = None

    def check_integrity(self) -> None:
        """Idle and busy workspaces are distinct, shapes agree, at most one is idle."""
        assert len(self._idle_workspaces) <= _MAX_IDLE_WORKSPACES
        busy = list(self._transfer_to_workspace.values())
        all_workspaces = busy + self._idle_workspaces
        assert len({id(ws) for ws in all_workspaces}) == len(all_workspaces), "a workspace is used twice"
        for ws in all_workspaces:
            assert tuple(ws.packed.shape) == (ws.num_pages, *self._page_shape)
            assert ws.packed.device == self.device and ws.packed.dtype == self._bits_dtype
            assert ws.packed_bytes.data_ptr() == ws.packed.data_ptr() and ws.packed_bytes.numel() == ws.packed.nbytes
            assert tuple(ws.ids_host.shape) == tuple(ws.ids_device.shape) == (ws.num_pages,)
            assert ws.ids_host.device.type == "cpu" and ws.ids_device.device == self.device
            assert ws.ids_host_array.ctypes.data == ws.ids_host.data_ptr() and len(ws.ids_host_array) == ws.num_pages
            assert (ws.start_event is not None) == (ws.end_event is not None) == self._is_cuda
            assert len(ws.slice_events) == (self.max_slices if self._is_cuda else 0)
            assert (ws.caller_event is not None) == self._is_cuda
            if ws.staging is not None:
                assert tuple(ws.staging.shape) == tuple(ws.packed.shape)
                assert ws.staging.device.type == "cpu" and ws.staging.dtype == self._bits_dtype
                assert ws.staging_bytes is not None and ws.staging_bytes.data_ptr() == ws.staging.data_ptr()
            else:
                assert ws.staging_bytes is None
        for transfer in self._transfer_to_workspace:
            assert transfer._seconds is None, "a completed transfer still holds its workspace"

    # ---- backend choice ------------------------------------------------------------------------

    def _choose_fastest_backends(self) -> tuple[TransferBackend, TransferBackend, dict[str, Any]]:
        torch_backend = TorchBackend()
        report: dict[str, Any] = {"requested": AUTO, "chosen": {"D2H": "torch", "H2D": "torch"}}
        if not self._is_cuda:
            # Off the GPU the Triton kernels only run in Triton's interpreter, orders of magnitude
            # slower than torch: nothing to time.
            report["reason"] = "cpu: the Triton kernels only run interpreted off the GPU"
            return torch_backend, torch_backend, report
        candidates: dict[str, TransferBackend] = {"torch": torch_backend}
        errors: dict[str, str] = {}
        if kernels.triton_available():
            candidates["triton"] = TritonBackend()
        else:
            errors["triton"] = "the triton package is not installed"
        timings_ms, timing_errors = self._time_backends(candidates)
        errors.update(timing_errors)
        if not timings_ms["D2H"] or not timings_ms["H2D"]:
            raise RuntimeError(f"no transfer backend could run on {self.device}: {errors}")
        chosen = {direction: min(timings_ms[direction], key=timings_ms[direction].get)
                  for direction in DIRECTIONS}
        report.update(chosen=chosen, timed_pages=min(AUTO_TIMING_PAGES, self.l1_pool.num_pages),
                      timings_ms={d: {name: round(ms, 4) for name, ms in timings_ms[d].items()}
                                  for d in DIRECTIONS})
        if errors:
            report["errors"] = errors
            logger.warning("transfer backends left out of the auto choice: %s", errors)
        return candidates[chosen["D2H"]], candidates[chosen["H2D"]], report

    def _time_backends(self, candidates: dict[str, TransferBackend]
                       ) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
        """Median ms per call of each backend's gather (D2H) and scatter (H2D) on scattered L1 pages.

        The scatter writes back the very bits the gather just read from the same pages, so the L1
        pool's contents are unchanged (ordered after the caller's stream, like any transfer).
        """
        assert self._stream is not None
        num_pages = min(AUTO_TIMING_PAGES, self.l1_pool.num_pages)
        shuffled = torch.randperm(self.l1_pool.num_pages, generator=torch.Generator().manual_seed(0))
        timings_ms: dict[str, dict[str, float]] = {direction: {} for direction in DIRECTIONS}
        errors: dict[str, str] = {}
        packed = self._new_device_buffer(num_pages)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            page_ids = shuffled[:num_pages].to(self.device)
            for name, backend in candidates.items():
                try:
                    timings_ms["D2H"][name] = self._median_ms(
                        lambda backend=backend: backend.gather(self._l1_bits, page_ids, packed))
                    timings_ms["H2D"][name] = self._median_ms(
                        lambda backend=backend: backend.scatter(packed, page_ids, self._l1_bits))
                except Exception as error:   # auto only: a backend that cannot run is left out
                    self._stream.synchronize()
                    for direction in DIRECTIONS:
                        timings_ms[direction].pop(name, None)
                    errors[name] = f"{type(error).__name__}: {error}"
        # The caller's later work on these L1 pages follows the timing runs.
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return timings_ms, errors

    def _median_ms(self, launch: Callable[[], None]) -> float:
        assert self._stream is not None
        events = []
        for call in range(_AUTO_WARMUP_CALLS + _AUTO_TIMED_CALLS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self._stream)
            launch()
            end.record(self._stream)
            if call >= _AUTO_WARMUP_CALLS:
                events.append((start, end))
        self._stream.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)

    # ---- submission ----------------------------------------------------------------------------

    def _submit(self, direction: str, l1_ids: np.ndarray, host_runs: list[tuple[int, int, int]]) -> Transfer:
        num_pages = len(l1_ids)
        transfer = Transfer(direction, num_pages, num_pages * self.bytes_per_page, self._release)
        if num_pages == 0:
            transfer._complete(block=False)
            return transfer
        staged = len(host_runs) > 1 and self.fragmented_copy == "staging"
        workspace = self._acquire_workspace(num_pages, staged)
        self._transfer_to_workspace[transfer] = workspace
        with self._completed_on_error(transfer):
            self._enqueue(transfer, workspace, l1_ids, host_runs, staged)
        return transfer

    def _send_backup(self, pending: PendingBackup, num_pages: int, host_runs: list[tuple[int, int, int]],
                     first: int) -> None:
        """The second half of a started backup: its DMAs, from the gathered slices to the host pages
        (runs, positioned among the gathered pages: from page ``first`` on)."""
        transfer = pending._transfer
        workspace = self._transfer_to_workspace[transfer]
        staged = len(host_runs) > 1 and self.fragmented_copy == "staging"
        with self._completed_on_error(transfer):
            if staged:
                self._add_staging(workspace)
            transfer.num_pages, transfer.num_bytes = num_pages, num_pages * self.bytes_per_page
            host, slice_segments = self._host_side(transfer, workspace, host_runs, staged, pending.slices)
            if self._stream is None:
                started = time.perf_counter()
                for segments in slice_segments:
                    _dma_segments(_flat_bytes(host.tensor), workspace.packed_bytes, segments, "D2H")
                transfer._host_seconds += time.perf_counter() - started
                return
            assert workspace.end_event is not None
            # No stream switch: the DMAs name the copy stream themselves (see _queue_dmas).
            for index, segments in enumerate(slice_segments):
                self._enqueue_dma_out(workspace, host, index, segments)
            # The copy stream waited for every slice's gather, so its end is the transfer's end.
            workspace.end_event.record(self._copy_stream)

    @contextlib.contextmanager
    def _completed_on_error(self, transfer: Transfer):
        """If queueing fails, nothing was published: let whatever reached the streams finish before
        the workspace can be reused, then complete the transfer so that nothing stays pending."""
        try:
            yield
        except BaseException:
            if self._stream is not None:
                self._stream.synchronize()
                self._copy_stream.synchronize()
            transfer._start_event = transfer._end_event = None
            transfer._finish = None
            transfer._complete(block=False)
            raise

    @contextlib.contextmanager
    def _on_stream(self, stream: torch.cuda.Stream):
        """Make `stream` current with plain set_stream calls (the stream context manager costs more
        host time than the work queued under it); the caller's stream and device come back after."""
        caller_device = torch.cuda.current_device()
        callers_stream = torch.cuda.current_stream(self._device_index)
        torch.cuda.set_stream(stream)
        try:
            yield callers_stream
        finally:
            torch.cuda.set_stream(callers_stream)
            if caller_device != self._device_index:
                torch.cuda.set_device(caller_device)

    def _enqueue(self, transfer: Transfer, workspace: _Workspace, l1_ids: np.ndarray,
                 host_runs: list[tuple[int, int, int]], staged: bool) -> None:
        num_pages = len(l1_ids)
        workspace.ids_host_array[:num_pages] = l1_ids
        slices = self._slices(num_pages)
        host, slice_segments = self._host_side(transfer, workspace, host_runs, staged, slices)
        if self._stream is None:
            self._run_on_host(transfer, workspace, num_pages, host, slices, slice_segments)
        else:
            self._enqueue_on_device(transfer, workspace, num_pages, host, slices, slice_segments)

    def _host_side(self, transfer: Transfer, workspace: _Workspace, host_runs: list[tuple[int, int, int]],
                   staged: bool, slices: list[tuple[int, int]]) -> tuple[_HostBuffer, list[list[tuple[int, int, int]]]]:
        """The host buffer of the DMAs, and the DMAs of each slice as (packed offset, host offset,
        bytes) in packed order. The host side is the pool itself, or staging (at the packed
        offsets) when the pages go through it. host_runs: (packed position, first host page, pages)."""
        bytes_per_page = self.bytes_per_page
        if staged:
            assert workspace.staging is not None and workspace.staging_bytes is not None
            host = _HostBuffer(workspace.staging, workspace.staging_address)
            first_position = host_runs[0][0]
            num_bytes = sum(length for _, _, length in host_runs) * bytes_per_page
            segments = [(first_position * bytes_per_page, first_position * bytes_per_page, num_bytes)]
            self._stage(transfer, workspace.staging_bytes, host_runs)
        else:
            host = _HostBuffer(self.host_pool.pages, self._pool_address)
            transfer._refs.append(host.tensor)   # the pool's mapping stays open until the DMAs are done
            segments = self._direct_segments(host_runs)
        if len(slices) == 1:
            return host, [segments]
        return host, _segments_by_slice(segments, [(first + count) * bytes_per_page for first, count in slices])

    def _direct_segments(self, host_runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """(packed offset, pool offset, bytes) of the DMAs straight between the packed buffer and the
        pool: one per run of host pages, cut where one pinned chunk of the pool ends and the next
        begins (one copy must not span two registrations) and at max_dma_bytes."""
        bytes_per_page = self.bytes_per_page
        segments = []
        for position, host_start, length in host_runs:
            start = host_start * bytes_per_page
            end = start + length * bytes_per_page
            to_packed = position * bytes_per_page - start
            # With background pinning, the chunks may not be registered yet: no DMA before they are.
            self.host_pool.wait_pinned(start, end)
            for chunk_start, chunk_end in self.host_pool.chunk_pieces(start, end):
                for piece_start, piece_end in _cut(chunk_start, chunk_end, self.max_dma_bytes):
                    segments.append((piece_start + to_packed, piece_start, piece_end - piece_start))
        return segments

    def _stage(self, transfer: Transfer, staging_bytes: torch.Tensor, host_runs: list[tuple[int, int, int]]) -> None:
        """The host side of a staged transfer: for a restore, gather the host pages into staging now
        (the workspace is not in use by any other transfer, so its staging is free); for a backup,
        scatter staging into the host pages once the DMA has completed (in `Transfer._complete`)."""
        bytes_per_page = self.bytes_per_page
        # (host offset, staging offset, bytes) for each run of consecutive host pages.
        segments = [(host_start * bytes_per_page, position * bytes_per_page, length * bytes_per_page)
                    for position, host_start, length in host_runs]
        host_array = self.host_pool.byte_view().numpy()
        staging_array = staging_bytes.numpy()
        transfer._refs.extend((host_array, staging_array))
        if transfer.direction == "H2D":
            started = time.perf_counter()
            self._copy_segments(staging_array, host_array, [(s, h, n) for h, s, n in segments])
            transfer._host_seconds += time.perf_counter() - started
        else:
            def scatter_staging_into_host_pages() -> None:
                self._copy_segments(host_array, staging_array, segments)
            transfer._finish = scatter_staging_into_host_pages

    def _slices(self, num_pages: int, min_slice_bytes: int | None = None) -> list[tuple[int, int]]:
        """(first page, page count) of each slice of the packed buffer, in order, sizes within one page."""
        min_slice_bytes = _MIN_SLICE_BYTES if min_slice_bytes is None else min_slice_bytes
        num_slices = min(self.max_slices, num_pages, max(1, num_pages * self.bytes_per_page // min_slice_bytes))
        if num_slices == 1:
            return [(0, num_pages)]
        base, extra = divmod(num_pages, num_slices)
        slices = []
        first = 0
        for index in range(num_slices):
            count = base + (index < extra)
            slices.append((first, count))
            first += count
        return slices

    def _run_on_host(self, transfer: Transfer, workspace: _Workspace, num_pages: int, host: _HostBuffer,
                     slices: list[tuple[int, int]], slice_segments: list[list[tuple[int, int, int]]]) -> None:
        """Off CUDA: the same slices and copies, synchronously, timed by the wall clock."""
        started = time.perf_counter()
        host_bytes = _flat_bytes(host.tensor)
        if transfer.direction == "D2H":
            self._gather_slices(workspace, slices)
            for segments in slice_segments:
                _dma_segments(host_bytes, workspace.packed_bytes, segments, "D2H")
        else:
            ids = workspace.ids_device
            for (first, count), segments in zip(slices, slice_segments):
                _dma_segments(host_bytes, workspace.packed_bytes, segments, "H2D")
                self.scatter_backend.scatter(_rows(workspace.packed, first, count), _rows(ids, first, count),
                                             self._l1_bits)
        transfer._host_seconds += time.perf_counter() - started

    def _gather_slices(self, workspace: _Workspace, slices: list[tuple[int, int]]) -> None:
        for first, count in slices:
            self.gather_backend.gather(self._l1_bits, _rows(workspace.ids_device, first, count),
                                       _rows(workspace.packed, first, count))

    def _enqueue_gathers(self, workspace: _Workspace, num_pages: int, slices: list[tuple[int, int]],
                         callers_stream: torch.cuda.Stream,
                         after_each: Callable[[int], None] | None = None) -> None:
        """On the compute stream (current): after the caller's stream (which produced the L1 pages),
        upload the ids and gather each slice, recording its slice event; `after_each(k)` runs once
        slice k's gather is queued (the DMA of that slice, interleaved)."""
        compute_stream = self._stream
        assert compute_stream is not None and workspace.start_event is not None
        self._wait_for_callers(compute_stream, callers_stream, workspace)
        workspace.start_event.record(compute_stream)
        self._upload_ids(workspace, num_pages)
        for index, (first, count) in enumerate(slices):
            self.gather_backend.gather(self._l1_bits, _rows(workspace.ids_device, first, count),
                                       _rows(workspace.packed, first, count))
            workspace.slice_events[index].record(compute_stream)
            if after_each is not None:
                after_each(index)

    @staticmethod
    def _wait_for_callers(stream: torch.cuda.Stream, callers_stream: torch.cuda.Stream, workspace: _Workspace) -> None:
        """`stream` waits for the work queued so far on the caller's stream. (Stream.wait_stream would
        make a new event per call; the workspace's own is reused: a wait holds the event's state at
        the time it is queued, so recording it again later does not move an earlier wait.)"""
        assert workspace.caller_event is not None
        workspace.caller_event.record(callers_stream)
        stream.wait_event(workspace.caller_event)

    def _upload_ids(self, workspace: _Workspace, count: int) -> None:
        """On the compute stream (current): the first `count` page ids, pinned host -> device. One
        runtime call by address when the engine's device is current, else torch's copy."""
        if self._runtime_usable():
            self._runtime.memcpy_async(workspace.ids_device_address, workspace.ids_host_address,
                                 count * workspace.ids_host.element_size(), cuda_runtime.HOST_TO_DEVICE,
                                 self._stream_handle)
        else:
            _leading(workspace.ids_device, count).copy_(_leading(workspace.ids_host, count), non_blocking=True)

    def _runtime_usable(self) -> bool:
        """Whether this engine's queueing can go through the runtime by handle: there is one, and
        the engine's device is current (its streams and events belong to it)."""
        return self._runtime is not None and torch.cuda.current_device() == self._device_index

    def _gathers_by_graph(self, workspace: _Workspace, num_pages: int, slices: list[tuple[int, int]],
                          after_each: Callable[[int], None] | None = None) -> bool:
        """What _enqueue_gathers does, through the runtime with each slice's gather a captured graph,
        when every slice has one (False, and nothing queued, otherwise)."""
        launches = self._graph_launches(workspace, "gather", slices)
        if launches is None:
            return False
        runtime, compute, handles = self._runtime, self._stream_handle, workspace.event_handles
        self._wait_for_callers_by_handle(workspace)       # which produced the L1 pages
        runtime.event_record(handles.start, compute)
        self._upload_ids(workspace, num_pages)
        for index, graph_exec in enumerate(launches):
            runtime.graph_launch(graph_exec, compute)
            runtime.event_record(handles.slices[index], compute)
            if after_each is not None:
                after_each(index)
        return True

    def _scatters_by_graph(self, workspace: _Workspace, slices: list[tuple[int, int]], upload_ids: int) -> bool:
        """The compute-stream half of _enqueue_restore through the runtime, each slice's scatter a
        captured graph, when every slice has one (False, and nothing queued, otherwise)."""
        launches = self._graph_launches(workspace, "scatter", slices)
        if launches is None:
            return False
        runtime, compute, handles = self._runtime, self._stream_handle, workspace.event_handles
        self._wait_for_callers_by_handle(workspace)       # which last used the L1 pages restored into
        if upload_ids:
            self._upload_ids(workspace, upload_ids)
        for graph_exec, copied in zip(launches, handles.slices):
            runtime.stream_wait_event(compute, copied)
            runtime.graph_launch(graph_exec, compute)
        runtime.event_record(handles.end, compute)
        return True

    def _wait_for_callers_by_handle(self, workspace: _Workspace) -> None:
        """_wait_for_callers through the runtime: the compute stream waits for the work queued so far
        on the caller's current stream."""
        caller = workspace.event_handles.caller
        self._runtime.event_record(caller, torch._C._cuda_getCurrentRawStream(self._device_index))
        self._runtime.stream_wait_event(self._stream_handle, caller)

    def _graph_launches(self, workspace: _Workspace, kind: str, slices: list[tuple[int, int]]) -> list[int] | None:
        """The graph of each slice's gather or scatter (kind) in this workspace, or None while the
        slices have none (or graphs are off for that kind, or the runtime cannot be called). They
        are captured the second time they are wanted (a one-off size is not worth a capture), at
        most _MAX_GRAPHS_PER_WORKSPACE per workspace."""
        if not (self._graph_gathers if kind == "gather" else self._graph_scatters) or not self._runtime_usable():
            return None
        graphs = workspace.graphs
        keys = [(kind, first, count) for first, count in slices]
        missing = [key for key in keys if key not in graphs]
        if missing:
            uses = workspace.graph_uses
            for key in missing:
                uses[key] = uses.get(key, 0) + 1
            if min(uses[key] for key in missing) < 2 or len(graphs) + len(missing) > _MAX_GRAPHS_PER_WORKSPACE:
                return None
            for key in missing:
                entry = self._capture(workspace, *key)
                if entry is None:
                    return None
                graphs[key] = entry
        return [graphs[key][1] for key in keys]

    def _capture(self, workspace: _Workspace, kind: str, first: int,
                 count: int) -> tuple[torch.cuda.CUDAGraph, int] | None:
        """One slice's gather or scatter captured as a graph over this workspace's buffers (which
        it keeps: graphs go with their workspace). A capture that fails turns graphs off for this
        engine (launches stay direct) and returns None."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(device=self.device)
        ids, packed = _rows(workspace.ids_device, first, count), _rows(workspace.packed, first, count)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._capture_stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    if kind == "gather":
                        self.gather_backend.gather(self._l1_bits, ids, packed)
                    else:
                        self.scatter_backend.scatter(packed, ids, self._l1_bits)
                finally:
                    graph.capture_end()
            graph_exec = graph.raw_cuda_graph_exec()
        except Exception as exc:
            # The message only: the exception's frames hold views of the pool, which must close.
            logger.warning("capturing a %s as a CUDA graph failed (%s): launching directly from now on",
                           kind, str(exc))
            self._graph_gathers = self._graph_scatters = False
            self._backend_report["cuda_graphs"] = {"D2H": False, "H2D": False}
            return None
        self.num_graphs_captured += 1
        return graph, graph_exec

    def _enqueue_dma_out(self, workspace: _Workspace, host: _HostBuffer, index: int,
                         segments: list[tuple[int, int, int]]) -> None:
        """On the copy stream, after slice `index`'s gather: its DMAs into the host side."""
        assert self._copy_stream is not None
        if self._runtime_usable():
            self._runtime.stream_wait_event(self._copy_stream_handle, workspace.event_handles.slices[index])
        else:
            self._copy_stream.wait_event(workspace.slice_events[index])
        if segments:
            self._queue_dmas(workspace, host, segments, "D2H")

    def _queue_dmas(self, workspace: _Workspace, host: _HostBuffer, segments: list[tuple[int, int, int]],
                    direction: str) -> None:
        """On the copy stream, one asynchronous copy per (packed offset, host offset, bytes) segment
        between the workspace's packed buffer and the host side. Through the CUDA runtime by address
        when the engine's device is current (no views, no stream switch); else through torch, on
        the copy stream made current for it."""
        runtime = self._runtime
        if self._runtime_usable():
            stream, packed_address, host_address = self._copy_stream_handle, workspace.packed_address, host.address
            if direction == "D2H":
                for packed_start, host_start, num_bytes in segments:
                    runtime.memcpy_async(host_address + host_start, packed_address + packed_start, num_bytes,
                                         cuda_runtime.DEVICE_TO_HOST, stream)
            else:
                for packed_start, host_start, num_bytes in segments:
                    runtime.memcpy_async(packed_address + packed_start, host_address + host_start, num_bytes,
                                         cuda_runtime.HOST_TO_DEVICE, stream)
            return
        assert self._copy_stream is not None
        with self._on_stream(self._copy_stream):
            _dma_segments(_flat_bytes(host.tensor), workspace.packed_bytes, segments, direction)

    def _enqueue_on_device(self, transfer: Transfer, workspace: _Workspace, num_pages: int,
                           host: _HostBuffer, slices: list[tuple[int, int]],
                           slice_segments: list[list[tuple[int, int, int]]]) -> None:
        """Queue the transfer on the two streams (see the module note) and return at once."""
        compute_stream, copy_stream = self._stream, self._copy_stream
        assert compute_stream is not None and copy_stream is not None
        assert workspace.start_event is not None and workspace.end_event is not None
        if transfer.direction == "D2H":
            def dma_out(index: int) -> None:
                self._enqueue_dma_out(workspace, host, index, slice_segments[index])

            # The copy stream waits for the last gather, so its end is the transfer's end.
            if self._gathers_by_graph(workspace, num_pages, slices, after_each=dma_out):
                self._runtime.event_record(workspace.event_handles.end, self._copy_stream_handle)
            else:
                with self._on_stream(compute_stream) as callers_stream:
                    self._enqueue_gathers(workspace, num_pages, slices, callers_stream, after_each=dma_out)
                    workspace.end_event.record(copy_stream)
        else:
            self._enqueue_restore(workspace, host, slices, slice_segments, upload_ids=num_pages)
        transfer._start_event = workspace.start_event
        transfer._end_event = workspace.end_event

    def _enqueue_restore(self, workspace: _Workspace, host: _HostBuffer, slices: list[tuple[int, int]],
                         slice_segments: list[list[tuple[int, int, int]]], upload_ids: int) -> None:
        """A restore's device work: each slice's DMAs into the packed buffer on the copy stream, and
        its scatter into L1 on the compute stream once they are done; first the upload of
        `upload_ids` page ids (0: start_restore uploaded them already)."""
        compute_stream, copy_stream = self._stream, self._copy_stream
        assert compute_stream is not None and copy_stream is not None
        assert workspace.start_event is not None and workspace.end_event is not None
        events = workspace.slice_events
        # The DMAs write only this workspace's packed buffer: they need not wait for the caller, and
        # go first, so that the copy engine starts while the scatters are being queued.
        workspace.start_event.record(copy_stream)
        for segments, copied_event in zip(slice_segments, events):
            self._queue_dmas(workspace, host, segments, "H2D")
            copied_event.record(copy_stream)
        if self._scatters_by_graph(workspace, slices, upload_ids):
            return
        with self._on_stream(compute_stream) as callers_stream:
            # The caller's stream last used the L1 pages being restored into; scatter after it.
            self._wait_for_callers(compute_stream, callers_stream, workspace)
            if upload_ids:
                self._upload_ids(workspace, upload_ids)
            for (first, count), copied_event in zip(slices, events):
                compute_stream.wait_event(copied_event)
                self.scatter_backend.scatter(_rows(workspace.packed, first, count),
                                             _rows(workspace.ids_device, first, count), self._l1_bits)
            # The compute stream waited for the last DMA, so its end is the transfer's end.
            workspace.end_event.record(compute_stream)

    # ---- host-side copies ----------------------------------------------------------------------

    def _copy_segments(self, destination: np.ndarray, source: np.ndarray,
                       segments: list[tuple[int, int, int]]) -> None:
        """destination[d:d+n] = source[s:s+n] for each (d, s, n), split across the copy threads."""
        total_bytes = sum(num_bytes for _, _, num_bytes in segments)
        num_tasks = min(self.host_copy_threads, max(1, total_bytes // _MIN_BYTES_PER_COPY_THREAD))
        tasks = _split_segments(segments, -(-total_bytes // num_tasks))
        if len(tasks) == 1:
            _copy_byte_segments(destination, source, tasks[0])
            return
        if self._copy_pool is None:
            self._copy_pool = concurrent.futures.ThreadPoolExecutor(
                self.host_copy_threads - 1, thread_name_prefix="kvcached-copy",
                initializer=_run_on_cpus, initargs=(self._copy_cpus,))
        futures = [self._copy_pool.submit(_copy_byte_segments, destination, source, task) for task in tasks[1:]]
        try:
            _copy_byte_segments(destination, source, tasks[0])     # the calling thread takes a share too
        finally:
            # Every share must be finished before the buffers can be reused, error or not.
            concurrent.futures.wait(futures)
        for future in futures:
            future.result()

    # ---- workspaces ----------------------------------------------------------------------------

    def _acquire_workspace(self, num_pages: int, needs_staging: bool) -> _Workspace:
        fitting = [ws for ws in self._idle_workspaces if ws.num_pages >= num_pages]
        if fitting:
            # Best fit: the smallest that holds the transfer; among equals, one with staging if needed.
            workspace = min(fitting, key=lambda ws: (ws.num_pages, needs_staging and ws.staging is None))
            self._idle_workspaces.remove(workspace)
        else:
            ids_host = torch.empty(num_pages, dtype=torch.int64, pin_memory=self._is_cuda)
            ids_device = torch.empty(num_pages, dtype=torch.int64, device=self.device) if self._is_cuda else ids_host
            workspace = _Workspace(num_pages, self._new_device_buffer(num_pages), ids_host, ids_device,
                                   self.max_slices if self._is_cuda else None)
            if self._stream is not None:
                workspace.bind_events(self._stream)
            self.num_workspaces_created += 1
        if needs_staging:
            self._add_staging(workspace)
        return workspace

    def _add_staging(self, workspace: _Workspace) -> None:
        if workspace.staging is None:
            # Pinned so the DMA is asynchronous; sized like the workspace so it is never too small.
            workspace.add_staging(torch.empty((workspace.num_pages, *self._page_shape), dtype=self._bits_dtype,
                                              pin_memory=self._is_cuda))
            self.num_stagings_created += 1

    def _new_device_buffer(self, num_pages: int) -> torch.Tensor:
        # Allocated on the compute stream. The copy stream uses it too, but a workspace is dropped
        # only once its transfer has completed, when no work on either stream still touches it.
        stream_context = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with stream_context:
            return torch.empty((num_pages, *self._page_shape), dtype=self._bits_dtype, device=self.device)

    def _release(self, transfer: Transfer) -> None:
        """Called once per transfer at completion: its workspace becomes idle (or is dropped)."""
        workspace = self._transfer_to_workspace.pop(transfer, None)
        if workspace is None:
            return   # an empty transfer never had one
        candidates = self._idle_workspaces + [workspace]
        keep = max(candidates, key=lambda ws: (ws.num_pages, ws.staging is not None))
        self._idle_workspaces = [keep]

    # ---- validation ----------------------------------------------------------------------------

    def _checked_ids(self, l1_page_ids: Sequence[int], host_page_ids: Sequence[int],
                     destination: str) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """The L1 ids as an array and the host pages as runs (position, first host page, pages),
        checked. Host pages that are a list of ints running up one by one (a reservation) are one
        run, known distinct, with no array built."""
        l1_ids = _page_id_array("l1_page_ids", l1_page_ids, self.l1_pool.num_pages)
        # Two sources written into one destination page would race; sources may repeat.
        num_host_pages, host_runs = _host_page_runs(host_page_ids, self.host_pool.num_pages,
                                                    distinct=destination == "host")
        if len(l1_ids) != num_host_pages:
            raise ValueError(f"l1_page_ids has {len(l1_ids)} pages but host_page_ids has {num_host_pages}")
        if destination == "l1":
            repeated = _first_repeated_id(l1_ids)
            if repeated is not None:
                raise ValueError(f"destination l1_page_ids lists page {repeated} more than once")
        return l1_ids, host_runs


def _host_page_runs(host_page_ids: Sequence[int] | np.ndarray | torch.Tensor, num_host_pages: int,
                    distinct: bool) -> tuple[int, list[tuple[int, int, int]]]:
    """(how many host pages, their runs as (position, first host page, pages)), checked: in range
    and, with ``distinct``, listed once each. A list of ints running up one by one (a daemon's
    reply for a contiguous reservation) is one run, recognized without building an array."""
    start = _one_run(host_page_ids, num_host_pages)
    if start is not None:
        return len(host_page_ids), [(0, start, len(host_page_ids))]
    host_ids = _page_id_array("host_page_ids", host_page_ids, num_host_pages)
    host_runs = _runs_of_consecutive_ids(host_ids) if len(host_ids) else []
    if distinct and len(host_runs) > 1:       # one run of consecutive ids is distinct already
        repeated = _first_repeated_id(host_ids)
        if repeated is not None:
            raise ValueError(f"destination host_page_ids lists page {repeated} more than once")
    return len(host_ids), host_runs


def _page_id_array(name: str, page_ids: Sequence[int] | np.ndarray | torch.Tensor, num_pages: int) -> np.ndarray:
    """The ids as an int64 array, checked in one vectorized pass (a prefix has hundreds of pages)."""
    if isinstance(page_ids, torch.Tensor):
        if page_ids.dim() != 1 or page_ids.is_floating_point() or page_ids.is_complex() \
                or page_ids.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor")
        ids = page_ids.detach().cpu().numpy()
    else:
        ids = np.asarray(page_ids)
    if ids.size == 0:
        return np.empty(0, dtype=np.int64)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise TypeError(f"{name} must be a 1-D sequence of integers, got {ids.dtype} with shape {ids.shape}")
    ids = ids.astype(np.int64, copy=False)
    # Seen as unsigned, a negative id exceeds any page count, so one reduction finds every bad id.
    if int(ids.view(np.uint64).max()) >= num_pages:
        out_of_range = (ids < 0) | (ids >= num_pages)
        raise ValueError(f"{name} holds page {int(ids[out_of_range][0])}, out of range 0..{num_pages - 1}")
    return ids


def _run_on_cpus(cpus: set[int]) -> None:
    """Copy-thread initializer: run on these CPUs if the process still may (else where it is)."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("host-copy thread keeps its CPUs (could not move to %s: %s)", sorted(cpus), exc)


def _first_repeated_id(ids: np.ndarray) -> int | None:
    """The smallest id listed more than once, or None. Ascending ids (the usual destination: a run
    of fresh pages) are cleared by one comparison, without sorting."""
    if len(ids) < 2 or bool((ids[1:] > ids[:-1]).all()):
        return None
    ordered = np.sort(ids)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    return int(repeated[0]) if len(repeated) else None


def _runs_of_consecutive_ids(page_ids: Sequence[int] | np.ndarray) -> list[tuple[int, int, int]]:
    """(position, first id, length) for each maximal run where page_ids[i + 1] == page_ids[i] + 1."""
    ids = np.asarray(page_ids, dtype=np.int64)
    breaks = np.flatnonzero(ids[1:] != ids[:-1] + 1) + 1
    if len(breaks) == 0:
        return [(0, int(ids[0]), len(ids))]
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(starts, append=len(ids))
    return list(zip(starts.tolist(), ids[starts].tolist(), lengths.tolist()))


def _segments_by_slice(segments: list[tuple[int, int, int]],
                       slice_ends: list[int]) -> list[list[tuple[int, int, int]]]:
    """(packed offset, host offset, bytes) segments, in packed order, cut where a slice of the packed
    buffer ends (slice_ends: each slice's end offset, ascending) and grouped by slice."""
    groups: list[list[tuple[int, int, int]]] = [[] for _ in slice_ends]
    index = 0
    covered_to = 0
    for packed_start, host_start, num_bytes in segments:
        # A slice's DMAs must only read what its own gather wrote: segments come in packed order.
        assert packed_start >= covered_to, "segments out of packed order"
        covered_to = packed_start + num_bytes
        while num_bytes > 0:
            while packed_start >= slice_ends[index]:
                index += 1
            take = min(num_bytes, slice_ends[index] - packed_start)
            groups[index].append((packed_start, host_start, take))
            packed_start, host_start, num_bytes = packed_start + take, host_start + take, num_bytes - take
    return groups


def _one_run(page_ids: Sequence[int] | np.ndarray | torch.Tensor, num_pages: int) -> int | None:
    """The first id when page_ids is a list of ints running up one by one inside [0, num_pages):
    what a daemon's reply holds for a contiguous reservation, recognized with list operations
    alone. None for anything else, which the full checks take."""
    if type(page_ids) is not list or not page_ids:
        return None
    start = page_ids[0]
    if type(start) is not int or start < 0 or start + len(page_ids) > num_pages:
        return None
    if page_ids != list(range(start, start + len(page_ids))) or set(map(type, page_ids)) != {int}:
        return None
    return start


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as one flat uint8 view."""
    return tensor.view(torch.uint8).view(-1)


def _rows(tensor: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """tensor[first:first + count] along dim 0; the tensor itself when that is all of it (no view to make)."""
    if first == 0 and count == tensor.shape[0]:
        return tensor
    return tensor[first:first + count]


def _leading(tensor: torch.Tensor, count: int) -> torch.Tensor:
    return _rows(tensor, 0, count)


def _dma_segments(host_bytes: torch.Tensor, packed_bytes: torch.Tensor, segments: list[tuple[int, int, int]],
                  direction: str) -> None:
    """One asynchronous copy per (packed offset, host offset, bytes) segment, on the current stream.
    (Basic slicing, not narrow(): it costs less host time per view.)"""
    if direction == "D2H":
        for packed_start, host_start, num_bytes in segments:
            host_bytes[host_start:host_start + num_bytes].copy_(
                packed_bytes[packed_start:packed_start + num_bytes], non_blocking=True)
    else:
        for packed_start, host_start, num_bytes in segments:
            packed_bytes[packed_start:packed_start + num_bytes].copy_(
                host_bytes[host_start:host_start + num_bytes], non_blocking=True)


def _cut(start: int, end: int, max_bytes: int | None) -> list[tuple[int, int]]:
    """[start, end) as consecutive pieces of at most max_bytes (one piece when max_bytes is None)."""
    if max_bytes is None:
        return [(start, end)]
    return [(piece_start, min(piece_start + max_bytes, end)) for piece_start in range(start, end, max_bytes)]


def _split_segments(segments: list[tuple[int, int, int]],
                    bytes_per_task: int) -> list[list[tuple[int, int, int]]]:
    """Cut (destination, source, bytes) segments into tasks of about bytes_per_task bytes each."""
    assert bytes_per_task > 0
    tasks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = bytes_per_task
    for destination, source, num_bytes in segments:
        while num_bytes > 0:
            take = min(num_bytes, room)
            current.append((destination, source, take))
            destination, source, num_bytes, room = destination + take, source + take, num_bytes - take, room - take
            if room == 0:
                tasks.append(current)
                current, room = [], bytes_per_task
    if current or not tasks:
        tasks.append(current)
    return tasks


def _copy_byte_segments(destination: np.ndarray, source: np.ndarray,
                        segments: list[tuple[int, int, int]]) -> None:
    for destination_start, source_start, num_bytes in segments:
        # numpy copies of plain bytes run without the GIL, so several threads copy at once.
        np.copyto(destination[destination_start:destination_start + num_bytes],
                  source[source_start:source_start + num_bytes])
