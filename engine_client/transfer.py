"""Moves whole KV pages between the engine's L1 pool and its mapping of the shared L2 pool.

Design note. L1 keeps the attention layout `[2, L, N, P, H, D]`; L2 is page-major `[n, 2, L, P, H, D]`.
Every transfer packs the selected pages page-major in a device buffer, so that the host side is a
single copy:

    backup  (D2H): gather L1 pages -> packed device buffer -> one copy -> L2 pages
    restore (H2D): L2 pages -> one copy -> packed device buffer -> scatter into L1 pages

When the L2 pages are one ascending run, that copy goes straight to or from their slice of the
shared mapping. Otherwise it goes through a pinned staging buffer plus one host-side index copy:
for a restore the host gathers into staging before the DMA; for a backup the host scatters out of
staging after the DMA has completed, which happens in the thread that polls the transfer
(`Transfer.done()` / `wait()`): a backup is complete only once that has run.

CUDA ordering. Each engine has a private transfer stream. It first waits on the caller's current
stream (which produced the L1 pages being backed up, or last used the pages being restored into),
then copies the page-index tensors to the device from pinned memory, runs the gather or scatter and
the DMA, and records a completion event. Buffers a pending transfer uses (workspace, index
tensors, host views) are owned by its `Transfer` until completion, so nothing is reused early.

Bits, not numbers. Pages are moved through same-width integer views of the tensors, which makes
every copy bit-exact and keeps dtypes such as float8 (that some torch ops lack) off the copy path.

Workspaces (a packed device buffer, plus pinned staging once a fragmented transfer needed it) are
reused best-fit by page count; at most one idle workspace is kept: the largest, preferring one with
staging on ties. Not thread-safe: one engine thread drives a TransferEngine.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from engine_client.l1_pool import L1Pool
from engine_client.shared_pool import SharedHostPool

logger = logging.getLogger(__name__)

# Same-width integer dtypes for moving pages as raw bits.
_BITS_DTYPE_BY_ITEMSIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_MAX_IDLE_WORKSPACES = 1


# ---- backends ----------------------------------------------------------------------------------


class TransferBackend(Protocol):
    """How pages are packed and unpacked on the device. All tensors share one integer bits dtype.

    gather:  out[i] = l1_kv[:, :, page_ids[i]]            out: [n, 2, L, P, H, D]
    scatter: l1_kv[:, :, page_ids[i]] = packed[i]          packed: [n, 2, L, P, H, D]
    page_ids is an int64 tensor on l1_kv's device; scatter's page ids are distinct.
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


_BACKEND_FACTORIES: dict[str, Callable[[], TransferBackend]] = {"torch": TorchBackend}


def register_backend(name: str, factory: Callable[[], TransferBackend]) -> None:
    """Make a backend selectable by name (the Triton kernels register themselves this way)."""
    if name in _BACKEND_FACTORIES:
        raise ValueError(f"transfer backend {name!r} is already registered")
    _BACKEND_FACTORIES[name] = factory


def available_backends() -> list[str]:
    return sorted(_BACKEND_FACTORIES)


# ---- transfers ---------------------------------------------------------------------------------


class _Workspace:
    """A packed page-major device buffer and, once needed, host staging of the same shape."""

    __slots__ = ("num_pages", "packed", "staging")

    def __init__(self, num_pages: int, packed: torch.Tensor):
        self.num_pages = num_pages
        self.packed = packed
        self.staging: torch.Tensor | None = None


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
        """Device time (CUDA events) plus host-side copy time; wall clock on CPU. After completion."""
        if self._seconds is None:
            raise RuntimeError("the transfer has not completed; call wait() or poll done() first")
        return self._seconds

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


class TransferEngine:
    """Backs up L1 pages into shared L2 pages and restores them, page by page, bit for bit.

    The host pool's page views are taken per transfer and released at completion, so once every
    transfer has completed (`drain()`), the host pool can be closed.
    """

    def __init__(self, l1_pool: L1Pool, host_pool: SharedHostPool, backend: str = "torch"):
        if l1_pool.geometry != host_pool.geometry:
            raise ValueError(f"L1 pool geometry {l1_pool.geometry} differs from host pool "
                             f"geometry {host_pool.geometry}")
        factory = _BACKEND_FACTORIES.get(backend)
        if factory is None:
            raise ValueError(f"unknown transfer backend {backend!r}; available: {available_backends()}")
        self.backend: TransferBackend = factory()
        self.l1_pool = l1_pool
        self.host_pool = host_pool
        self.device = l1_pool.kv.device
        self.bytes_per_page = l1_pool.geometry.bytes_per_page
        self._page_shape = l1_pool.geometry.page_shape
        self._bits_dtype = _BITS_DTYPE_BY_ITEMSIZE[l1_pool.kv.element_size()]
        self._l1_bits = l1_pool.kv.view(self._bits_dtype)
        self._is_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._is_cuda else None
        self._idle_workspaces: list[_Workspace] = []
        self._transfer_to_workspace: dict[Transfer, _Workspace] = {}
        self.num_workspaces_created = 0
        self.num_stagings_created = 0

    # ---- public API ----------------------------------------------------------------------------

    def backup(self, l1_page_ids: Sequence[int], host_page_ids: Sequence[int]) -> Transfer:
        """Copy L1 pages into host pages (D2H); host_page_ids[i] receives l1_page_ids[i]."""
        l1_ids, host_ids = self._checked_ids(l1_page_ids, host_page_ids, destination="host")
        return self._submit("D2H", l1_ids, host_ids)

    def restore(self, host_page_ids: Sequence[int], l1_page_ids: Sequence[int]) -> Transfer:
        """Copy host pages into L1 pages (H2D); l1_page_ids[i] receives host_page_ids[i]."""
        l1_ids, host_ids = self._checked_ids(l1_page_ids, host_page_ids, destination="l1")
        return self._submit("H2D", l1_ids, host_ids)

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
        """Drain, then drop the idle workspaces."""
        self.drain()
        self._idle_workspaces.clear()

    def check_integrity(self) -> None:
        """Idle and busy workspaces are distinct, shapes agree, at most one is idle."""
        assert len(self._idle_workspaces) <= _MAX_IDLE_WORKSPACES
        busy = list(self._transfer_to_workspace.values())
        all_workspaces = busy + self._idle_workspaces
        assert len({id(ws) for ws in all_workspaces}) == len(all_workspaces), "a workspace is used twice"
        for ws in all_workspaces:
            assert tuple(ws.packed.shape) == (ws.num_pages, *self._page_shape)
            assert ws.packed.device == self.device and ws.packed.dtype == self._bits_dtype
            if ws.staging is not None:
                assert tuple(ws.staging.shape) == tuple(ws.packed.shape)
                assert ws.staging.device.type == "cpu" and ws.staging.dtype == self._bits_dtype
        for transfer in self._transfer_to_workspace:
            assert transfer._seconds is None, "a completed transfer still holds its workspace"

    # ---- submission ----------------------------------------------------------------------------

    def _submit(self, direction: str, l1_ids: list[int], host_ids: list[int]) -> Transfer:
        num_pages = len(l1_ids)
        transfer = Transfer(direction, num_pages, num_pages * self.bytes_per_page, self._release)
        if num_pages == 0:
            transfer._complete(block=False)
            return transfer
        first_host_id = _first_of_ascending_run(host_ids)
        needs_staging = first_host_id is None
        workspace = self._acquire_workspace(num_pages, needs_staging)
        self._transfer_to_workspace[transfer] = workspace
        try:
            self._enqueue(transfer, workspace, l1_ids, host_ids, first_host_id)
        except BaseException:
            # Nothing was published. Let whatever reached the stream finish before the workspace
            # can be reused, then complete the transfer so that nothing stays pending.
            if self._stream is not None:
                self._stream.synchronize()
            transfer._end_event = None
            transfer._finish = None
            transfer._complete(block=False)
            raise
        return transfer

    def _enqueue(self, transfer: Transfer, workspace: _Workspace, l1_ids: list[int],
                 host_ids: list[int], first_host_id: int | None) -> None:
        num_pages = len(l1_ids)
        packed = workspace.packed[:num_pages]
        host_pages = self.host_pool.pages.view(self._bits_dtype)
        # Pinned, so the copy to the device below is asynchronous; kept alive by transfer._refs.
        l1_ids_host = torch.tensor(l1_ids, dtype=torch.int64, pin_memory=self._is_cuda)
        if first_host_id is not None:
            host_slice = host_pages[first_host_id:first_host_id + num_pages]
            transfer._refs.append(host_slice)
        else:
            assert workspace.staging is not None
            staging = workspace.staging[:num_pages]
            host_ids_cpu = torch.tensor(host_ids, dtype=torch.int64)
            transfer._refs.extend((staging, host_ids_cpu))
        transfer._refs.extend((packed, l1_ids_host))

        if transfer.direction == "H2D" and first_host_id is None:
            # The workspace is not in use by any other transfer, so its staging is free to fill now.
            started = time.perf_counter()
            torch.index_select(host_pages, 0, host_ids_cpu, out=staging)
            transfer._host_seconds += time.perf_counter() - started
        if transfer.direction == "D2H" and first_host_id is None:
            def scatter_staging_into_host_pages() -> None:
                host_pages.index_copy_(0, host_ids_cpu, staging)
            transfer._finish = scatter_staging_into_host_pages

        with self._on_transfer_stream(transfer):
            l1_ids_device = l1_ids_host.to(self.device, non_blocking=True)
            transfer._refs.append(l1_ids_device)
            if transfer.direction == "D2H":
                self.backend.gather(self._l1_bits, l1_ids_device, packed)
                destination = host_slice if first_host_id is not None else staging
                destination.copy_(packed, non_blocking=True)
            else:
                source = host_slice if first_host_id is not None else staging
                packed.copy_(source, non_blocking=True)
                self.backend.scatter(packed, l1_ids_device, self._l1_bits)

    @contextlib.contextmanager
    def _on_transfer_stream(self, transfer: Transfer):
        """Run the enclosed device work on the transfer stream, bracketed by timing events.

        On CPU the work runs synchronously and is timed by the wall clock.
        """
        if self._stream is None:
            started = time.perf_counter()
            yield
            transfer._host_seconds += time.perf_counter() - started
            return
        # The caller's stream produced (or last used) the L1 pages; order our work after it.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        start_event = torch.cuda.Event(enable_timing=True)
        end_event = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start_event.record(self._stream)
            yield
            end_event.record(self._stream)
        transfer._start_event = start_event
        transfer._end_event = end_event

    # ---- workspaces ----------------------------------------------------------------------------

    def _acquire_workspace(self, num_pages: int, needs_staging: bool) -> _Workspace:
        fitting = [ws for ws in self._idle_workspaces if ws.num_pages >= num_pages]
        if fitting:
            # Best fit: the smallest that holds the transfer; among equals, one with staging if needed.
            workspace = min(fitting, key=lambda ws: (ws.num_pages, needs_staging and ws.staging is None))
            self._idle_workspaces.remove(workspace)
        else:
            workspace = _Workspace(num_pages, self._new_device_buffer(num_pages))
            self.num_workspaces_created += 1
        if needs_staging and workspace.staging is None:
            # Pinned so the DMA is asynchronous; sized like the workspace so it is never too small.
            workspace.staging = torch.empty((workspace.num_pages, *self._page_shape), dtype=self._bits_dtype,
                                            pin_memory=self._is_cuda)
            self.num_stagings_created += 1
        return workspace

    def _new_device_buffer(self, num_pages: int) -> torch.Tensor:
        # Allocated on the transfer stream, the only stream that ever touches it.
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
                     destination: str) -> tuple[list[int], list[int]]:
        l1_ids = _page_id_list("l1_page_ids", l1_page_ids, self.l1_pool.num_pages)
        host_ids = _page_id_list("host_page_ids", host_page_ids, self.host_pool.num_pages)
        if len(l1_ids) != len(host_ids):
            raise ValueError(f"l1_page_ids has {len(l1_ids)} pages but host_page_ids has {len(host_ids)}")
        # Two sources written into one destination page would race; sources may repeat.
        destination_name, destination_ids = (
            ("host_page_ids", host_ids) if destination == "host" else ("l1_page_ids", l1_ids))
        seen: set[int] = set()
        for page_id in destination_ids:
            if page_id in seen:
                raise ValueError(f"destination {destination_name} lists page {page_id} more than once")
            seen.add(page_id)
        return l1_ids, host_ids


def _page_id_list(name: str, page_ids: Sequence[int] | torch.Tensor, num_pages: int) -> list[int]:
    if isinstance(page_ids, torch.Tensor):
        if page_ids.dim() != 1 or page_ids.is_floating_point() or page_ids.is_complex():
            raise ValueError(f"{name} must be a 1-D integer tensor")
        page_ids = page_ids.tolist()
    ids = [operator.index(page_id) for page_id in page_ids]
    for page_id in ids:
        if not 0 <= page_id < num_pages:
            raise ValueError(f"{name} holds page {page_id}, out of range 0..{num_pages - 1}")
    return ids


def _first_of_ascending_run(page_ids: list[int]) -> int | None:
    """The first id if the ids are consecutive and ascending, else None."""
    first = page_ids[0]
    for offset, page_id in enumerate(page_ids):
        if page_id != first + offset:
            return None
    return first
