"""The engine's mapping of one namespace's region of the daemon's shared L2 segment.

Ownership. A `SharedHostPool` owns its mmap. `.pages` is a torch view of the mapping made through
a memoryview, and torch keeps that memoryview alive for as long as any tensor derived from
`.pages` (slices, `.view(...)`) lives. While one does, the mmap cannot be closed (Python raises
BufferError on an mmap with exported buffers), and `close()` refuses with RuntimeError and changes
nothing. So: drop every view of the pool (and drain transfers that use it) before closing it. This
is deliberate: the alternative, unmapping under a live tensor, turns a later access into a crash.

Pinning. With `pin=True` the mapped range is registered with CUDA (`cudaHostRegister`) so copies
to and from it run as DMA at PCIe speed. MAP_POPULATE pre-faults the range first, because pinning
unpopulated shared memory was measured 15-20x slower per GiB than pinning populated memory.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
import weakref

import torch

from engine_client.dtypes import torch_dtype
from proto.messages import KVGeometry

logger = logging.getLogger(__name__)

# MAP_POPULATE is Linux-only; elsewhere the pages fault in on first touch.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class SharedHostPool:
    """L2 pages `[num_pages, 2, layers, page_size, kv_heads, head_dim]` mapped from a shared segment."""

    def __init__(self, mapping: mmap.mmap, num_pages: int, geometry: KVGeometry, pin: bool):
        """Use `SharedHostPool.open`; this takes ownership of `mapping` and closes it on failure."""
        self.geometry = geometry
        self.num_pages = num_pages
        self.nbytes = num_pages * geometry.bytes_per_page
        self.pin_seconds = 0.0
        self._mmap: mmap.mmap | None = mapping
        self._pinned_address: int | None = None
        try:
            self._pages: torch.Tensor | None
            self._pages, self._buffer_ref = _pages_view(mapping, num_pages, geometry)
            if pin:
                self._pin()
        except BaseException:
            self._pages = None
            try:
                mapping.close()
            except BufferError:
                # A view still lives in the failing frame; the mapping goes away with it.
                pass
            self._mmap = None
            raise

    @classmethod
    def open(cls, path: str, offset_bytes: int, num_pages: int, geometry: KVGeometry,
             pin: bool) -> "SharedHostPool":
        """Map `num_pages` pages of `path` starting at `offset_bytes` (read-write, shared)."""
        if type(offset_bytes) is not int or offset_bytes < 0 or offset_bytes % mmap.ALLOCATIONGRANULARITY:
            raise ValueError(
                f"offset_bytes must be a non-negative multiple of {mmap.ALLOCATIONGRANULARITY}, "
                f"got {offset_bytes!r}")
        if type(num_pages) is not int or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        geometry.validate()
        nbytes = num_pages * geometry.bytes_per_page
        fd = os.open(path, os.O_RDWR)
        try:
            file_size = os.fstat(fd).st_size
            if file_size < offset_bytes + nbytes:
                raise ValueError(
                    f"{path} has {file_size} bytes; the region needs {offset_bytes + nbytes} "
                    f"({num_pages} pages of {geometry.bytes_per_page} bytes at offset {offset_bytes})")
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset_bytes)
        finally:
            # The mmap holds its own duplicate of the descriptor; ours is not needed past here.
            os.close(fd)
        return cls(mapping, num_pages, geometry, pin)

    @property
    def pages(self) -> torch.Tensor:
        if self._pages is None:
            raise RuntimeError("the shared host pool is closed")
        return self._pages

    @property
    def is_pinned(self) -> bool:
        return self._pinned_address is not None

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Unpin and unmap. Idempotent. RuntimeError (and no change) while views of `.pages` live."""
        if self._mmap is None:
            return
        pages, self._pages = self._pages, None
        del pages
        buffer = self._buffer_ref()
        if buffer is not None:
            # Someone still holds a view; rebuild ours over the same buffer so the pool stays usable.
            self._pages = _typed_pages(buffer, self.num_pages, self.geometry)
            del buffer
            raise RuntimeError(
                "cannot close the shared host pool: tensor views of its pages are still alive "
                "(drop them and wait for transfers that use the pool first)")
        if self._pinned_address is not None:
            self._unpin()
        self._mmap.close()
        self._mmap = None

    def __enter__(self) -> "SharedHostPool":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- CUDA registration ---------------------------------------------------------------------

    def _pin(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("pin=True needs CUDA, which is not available in this process")
        cudart = torch.cuda.cudart()
        started = time.perf_counter()
        error = cudart.cudaHostRegister(self.pages.data_ptr(), self.nbytes, 0)
        self.pin_seconds = time.perf_counter() - started
        if error != cudart.cudaError.success:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed: "
                               f"{cudart.cudaGetErrorString(error)} (cudaError {int(error)})")
        self._pinned_address = self.pages.data_ptr()
        logger.info("pinned %d bytes of shared host memory in %.3f s", self.nbytes, self.pin_seconds)

    def _unpin(self) -> None:
        assert self._pinned_address is not None
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostUnregister(self._pinned_address)
        self._pinned_address = None
        if error != cudart.cudaError.success:
            # The mapping is about to go away regardless; a failed unregister only leaks a CUDA
            # bookkeeping entry, so report it rather than refuse to close.
            logger.error("cudaHostUnregister failed: %s (cudaError %d)",
                         cudart.cudaGetErrorString(error), int(error))


def _pages_view(mapping: mmap.mmap, num_pages: int,
                geometry: KVGeometry) -> tuple[torch.Tensor, weakref.ref]:
    """The typed page view of `mapping`, and a weak reference to the memoryview it holds.

    Going through a memoryview is what makes live tensor views block mm.close() (see the module
    note): torch keeps the object it was given alive, and the memoryview holds an export of the
    mmap, whereas torch.frombuffer on the mmap itself holds no export.
    """
    buffer = memoryview(mapping)
    return _typed_pages(buffer, num_pages, geometry), weakref.ref(buffer)


def _typed_pages(buffer: memoryview, num_pages: int, geometry: KVGeometry) -> torch.Tensor:
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=num_pages * geometry.bytes_per_page)
    return flat.view(torch_dtype(geometry.dtype)).view(num_pages, *geometry.page_shape)
