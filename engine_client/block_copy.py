"""Gather an engine's KV blocks into packed L2 pages, scatter them back, and copy blocks from one
engine's tensors into another's, through segment tables.

A packed buffer holds n pages ``[n, S, segment_words]``: page i is block ``block_ids[i]`` of every
segment (see ``engine_client.layout``), segment s at ``segment_addresses[s] + block * stride[s]``.
Everything moves as integer words of the layout's ``word_bytes`` (bit for bit, NaN payloads and
float8 included). A block copy (``copy_blocks``) moves block ``source_block_ids[i]`` of every
segment of one table into block ``block_ids[i]`` of the same segment of another (a peer restore:
the source is another engine's tensors mapped into this process), with nothing packed between.

Two backends with the same semantics and the same checks:
  * Triton: one program per (page, segment, block of ``BLOCK`` words); each loads its segment's
    base address and block stride from the table (from both tables, for a block copy), so any
    layout (one tensor, one per layer, opaque blocks, any block stride) is one kernel. On CPU
    tensors it runs under the Triton interpreter (tests). The page count is not specialised on,
    so a new size compiles nothing (warm once per layout).
  * torch: one ``index_select`` / ``index_copy_`` per segment on views of the engine's tensors.

``choose_backends``: which one a transfer engine uses per direction ("auto": on CUDA, the faster
of the two on the engine's layout, timed once at its construction).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple, Sequence

import torch

from engine_client.layout import WORD_DTYPE_BY_BYTES, KVLayout

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend works without triton
    triton = None
    tl = None


logger = logging.getLogger(__name__)

MAX_BLOCK_WORDS = 1024          # elements a program moves: larger blocks gather faster on a GPU than 256
_MAX_GRID_X = 2**31 - 1
_MAX_GRID_Y = 65535
_INDEX_DTYPES = (torch.int32, torch.int64)
_AUTO_TIMING_PAGES = 64
_AUTO_TIMING_REPEATS = 3


def triton_available() -> bool:
    return triton is not None


class SegmentTable:
    """A layout's segment table on its device (addresses in bytes, strides in words), and the
    torch backend's views of the same segments. ``segments``: only these of the layout's segments,
    in this order (one layer's, for a layer-by-layer load); a packed page then holds just them."""

    def __init__(self, layout: KVLayout, segments: Sequence[int] | None = None):
        segments = tuple(range(layout.num_segments)) if segments is None else tuple(segments)
        if not segments or any(not 0 <= s < layout.num_segments for s in segments):
            raise ValueError(f"segments must be a non-empty choice of [0, {layout.num_segments}), got {segments}")
        self.layout = layout
        self.segments = segments
        self.device = layout.device
        self.word_bytes = layout.word_bytes
        self.word_dtype = WORD_DTYPE_BY_BYTES[self.word_bytes]
        self.num_segments = len(segments)
        self.num_blocks = layout.num_blocks
        self.segment_words = layout.segment_bytes // self.word_bytes
        self.addresses = torch.tensor([layout.segment_addresses[s] for s in segments], dtype=torch.int64,
                                      device=self.device)
        self.block_strides = torch.tensor([layout.block_stride_bytes[s] // self.word_bytes for s in segments],
                                          dtype=torch.int64, device=self.device)
        views = layout.segment_views()
        self.views = [views[s] for s in segments]
        self.block_words = min(MAX_BLOCK_WORDS, triton.next_power_of_2(self.segment_words)) if triton else 0
        if triton is not None and triton.cdiv(self.segment_words, self.block_words) > _MAX_GRID_Y:
            raise ValueError(f"a segment of {layout.segment_bytes} bytes is too large for one launch")

    def packed_shape(self, num_pages: int) -> tuple[int, int, int]:
        return (num_pages, self.num_segments, self.segment_words)


def _check_ids(name: str, block_ids: torch.Tensor) -> None:
    if not isinstance(block_ids, torch.Tensor):
        raise TypeError(f"{name} must be a tensor")
    if block_ids.dim() != 1 or block_ids.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be a 1-D int32 or int64 tensor, got {block_ids.dtype} "
                        f"of shape {tuple(block_ids.shape)}")
    if block_ids.stride(0) != 1 and block_ids.shape[0] > 1:
        raise ValueError(f"{name} must be contiguous")


def check_args(table: SegmentTable, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Raise TypeError/ValueError unless block_ids and packed describe a copy of whole pages."""
    _check_ids("block_ids", block_ids)
    if not isinstance(packed, torch.Tensor):
        raise TypeError("packed must be a tensor")
    if packed.dtype != table.word_dtype:
        raise TypeError(f"packed must hold {table.word_dtype} words, got {packed.dtype}")
    expected = table.packed_shape(block_ids.shape[0])
    if tuple(packed.shape) != expected:
        raise ValueError(f"packed has shape {tuple(packed.shape)}, {block_ids.shape[0]} pages need {expected}")
    if not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous, got strides {packed.stride()}")
    if not (packed.device == block_ids.device == table.device):
        raise ValueError(f"packed ({packed.device}), block_ids ({block_ids.device}) and the KV tensors "
                         f"({table.device}) must be on one device")


def check_copy_args(source: SegmentTable, source_block_ids: torch.Tensor, target: SegmentTable,
                    block_ids: torch.Tensor) -> None:
    """Raise TypeError/ValueError unless the two tables hold pages of one format (as many segments,
    of as many words of one size) on one device, and the ids name as many blocks of each."""
    _check_ids("source_block_ids", source_block_ids)
    _check_ids("block_ids", block_ids)
    check_same_pages(source, target)
    if source_block_ids.shape != block_ids.shape:
        raise ValueError(f"{source_block_ids.shape[0]} source blocks for {block_ids.shape[0]} blocks")
    if not (source_block_ids.device == block_ids.device == target.device):
        raise ValueError(f"the ids ({source_block_ids.device}, {block_ids.device}) must be on the tables' device "
                         f"({target.device})")


def check_same_pages(source: SegmentTable, target: SegmentTable) -> None:
    """ValueError unless a block copy can go from ``source`` to ``target``: as many segments, of as
    many words of one size, on one device."""
    if (source.num_segments, source.segment_words, source.word_bytes) != \
            (target.num_segments, target.segment_words, target.word_bytes):
        raise ValueError(f"the source's pages ({source.num_segments} segments of {source.segment_words} words of "
                         f"{source.word_bytes} bytes) are not the target's ({target.num_segments} of "
                         f"{target.segment_words} of {target.word_bytes})")
    if source.device != target.device:
        raise ValueError(f"the source is on {source.device}, the target on {target.device}")


# ---- torch ---------------------------------------------------------------------------------


def gather_torch(table: SegmentTable, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """packed[i, s] = segment s of block block_ids[i], for every i and s."""
    check_args(table, block_ids, packed)
    if block_ids.shape[0] == 0:
        return
    for segment, view in enumerate(table.views):
        torch.index_select(view, 0, block_ids, out=packed[:, segment])


def scatter_torch(table: SegmentTable, packed: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Segment s of block block_ids[i] = packed[i, s]. With a block named twice, which lands is unspecified."""
    check_args(table, block_ids, packed)
    if block_ids.shape[0] == 0:
        return
    indices = block_ids.to(torch.int64)
    for segment, view in enumerate(table.views):
        view.index_copy_(0, indices, packed[:, segment])


def copy_blocks_torch(source: SegmentTable, source_block_ids: torch.Tensor, target: SegmentTable,
                      block_ids: torch.Tensor) -> None:
    """Segment s of target block block_ids[i] = segment s of source block source_block_ids[i]. A
    block both read and written by one copy (the tables over one tensor): unspecified, unless it
    is copied onto itself."""
    check_copy_args(source, source_block_ids, target, block_ids)
    if block_ids.shape[0] == 0:
        return
    indices = block_ids.to(torch.int64)
    for source_view, target_view in zip(source.views, target.views):
        target_view.index_copy_(0, indices, source_view.index_select(0, source_block_ids))


# ---- triton --------------------------------------------------------------------------------

if triton is not None:

    @triton.jit(do_not_specialize=["num_rows"])
    def _copy_blocks_kernel(addresses_ptr, block_strides_ptr, block_ids_ptr, packed_ptr, num_rows,
                            num_segments, segment_words, GATHER: tl.constexpr, BLOCK: tl.constexpr,
                            EVEN: tl.constexpr):
        # Axis 0 walks packed rows (page i, segment s) in order; axis 1 the block within the row.
        row = tl.program_id(0).to(tl.int64)
        page = row // num_segments
        segment = row - page * num_segments
        word = packed_ptr.dtype.element_ty
        base = tl.load(addresses_ptr + segment).to(tl.pointer_type(word))
        block_stride = tl.load(block_strides_ptr + segment)
        block_id = tl.load(block_ids_ptr + page).to(tl.int64)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        offsets = tl.max_contiguous(tl.multiple_of(offsets, BLOCK), BLOCK)
        in_engine = base + block_id * block_stride + offsets
        in_packed = packed_ptr + row * segment_words + offsets
        if GATHER:
            src = in_engine
            dst = in_packed
        else:
            src = in_packed
            dst = in_engine
        if EVEN:
            tl.store(dst, tl.load(src))
        else:
            mask = offsets < segment_words
            tl.store(dst, tl.load(src, mask=mask), mask=mask)

    @triton.jit(do_not_specialize=["num_rows"])
    def _copy_between_kernel(source_addresses_ptr, source_strides_ptr, source_ids_ptr, target_addresses_ptr,
                             target_strides_ptr, target_ids_ptr, num_rows, num_segments, segment_words,
                             WORD_BYTES: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
        # Axis 0 walks (page i, segment s) in order; axis 1 the block of words within the segment.
        # Both tables' segments are words of WORD_BYTES (checked by the wrapper).
        if WORD_BYTES == 8:
            word = tl.int64
        elif WORD_BYTES == 4:
            word = tl.int32
        elif WORD_BYTES == 2:
            word = tl.int16
        else:
            word = tl.int8
        row = tl.program_id(0).to(tl.int64)
        page = row // num_segments
        segment = row - page * num_segments
        source_base = tl.load(source_addresses_ptr + segment).to(tl.pointer_type(word))
        target_base = tl.load(target_addresses_ptr + segment).to(tl.pointer_type(word))
        source_block = tl.load(source_ids_ptr + page).to(tl.int64)
        target_block = tl.load(target_ids_ptr + page).to(tl.int64)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        offsets = tl.max_contiguous(tl.multiple_of(offsets, BLOCK), BLOCK)
        src = source_base + source_block * tl.load(source_strides_ptr + segment) + offsets
        dst = target_base + target_block * tl.load(target_strides_ptr + segment) + offsets
        if EVEN:
            tl.store(dst, tl.load(src))
        else:
            mask = offsets < segment_words
            tl.store(dst, tl.load(src, mask=mask), mask=mask)

_interpreted: dict = {}


def _kernel_for(kernel, device: torch.device):
    if device.type != "cpu":
        return kernel
    # On CPU tensors: the interpreter, built from the kernel's source whether or not
    # TRITON_INTERPRET was set at import.
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    if kernel not in _interpreted:
        _interpreted[kernel] = InterpretedFunction(kernel.fn)
    return _interpreted[kernel]


def _run(kernel, table: SegmentTable, num_pages: int, args: tuple, **constants) -> None:
    """Launch one program per (page, segment, block of words) of ``table``'s pages."""
    num_rows = num_pages * table.num_segments
    if num_rows == 0:
        return
    if num_rows > _MAX_GRID_X:
        raise ValueError(f"{num_rows} rows exceed the grid limit {_MAX_GRID_X}")
    grid = (num_rows, triton.cdiv(table.segment_words, table.block_words))
    kernel = _kernel_for(kernel, table.device)
    args = (*args, num_rows, table.num_segments, table.segment_words)
    constants.update(BLOCK=table.block_words, EVEN=table.segment_words % table.block_words == 0)
    if table.device.type == "cuda" and torch.cuda.current_device() != table.device.index:
        with torch.cuda.device(table.device):
            kernel[grid](*args, **constants)
        return
    kernel[grid](*args, **constants)


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("the Triton backend needs the triton package, which is not installed")


def _launch(gather: bool, table: SegmentTable, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    _need_triton()
    check_args(table, block_ids, packed)
    _run(_copy_blocks_kernel, table, block_ids.shape[0], (table.addresses, table.block_strides, block_ids, packed),
         GATHER=gather)


def gather_triton(table: SegmentTable, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """As ``gather_torch``, with one Triton launch on the current stream."""
    _launch(True, table, block_ids, packed)


def scatter_triton(table: SegmentTable, packed: torch.Tensor, block_ids: torch.Tensor) -> None:
    """As ``scatter_torch``, with one Triton launch on the current stream."""
    _launch(False, table, block_ids, packed)


def copy_blocks_triton(source: SegmentTable, source_block_ids: torch.Tensor, target: SegmentTable,
                       block_ids: torch.Tensor) -> None:
    """As ``copy_blocks_torch``, with one Triton launch on the current stream."""
    _need_triton()
    check_copy_args(source, source_block_ids, target, block_ids)
    _run(_copy_between_kernel, target, block_ids.shape[0],
         (source.addresses, source.block_strides, source_block_ids, target.addresses, target.block_strides, block_ids),
         WORD_BYTES=target.word_bytes)


class Backend(NamedTuple):
    gather: Callable[[SegmentTable, torch.Tensor, torch.Tensor], None]
    scatter: Callable[[SegmentTable, torch.Tensor, torch.Tensor], None]
    copy_blocks: Callable[[SegmentTable, torch.Tensor, SegmentTable, torch.Tensor], None]


BACKENDS: dict[str, Backend] = {"torch": Backend(gather_torch, scatter_torch, copy_blocks_torch)}
if triton is not None:
    BACKENDS["triton"] = Backend(gather_triton, scatter_triton, copy_blocks_triton)


def choose_backends(backend: str, table: SegmentTable, group_tables: Sequence[SegmentTable],
                    workspace: torch.Tensor) -> dict[str, str]:
    """The backend of each direction: ``backend`` for both unless "auto"; "auto": torch on CPU or
    without triton (Triton runs interpreted there, for tests, far slower), else the faster of the
    two on this layout, timed (``time_backends``). ``workspace``: packed pages of ``table``, free
    to be overwritten."""
    if backend != "auto":
        return {"save": backend, "load": backend}
    if table.device.type != "cuda" or not triton_available():
        return {"save": "torch", "load": "torch"}
    return time_backends(table, group_tables, workspace)


def time_backends(table: SegmentTable, group_tables: Sequence[SegmentTable], workspace: torch.Tensor) -> dict[str, str]:
    """Time the gather (every segment of ``table`` at once, as a save) and the scatter (table by
    table of ``group_tables``, as a layered load) of both backends, the host's launches included;
    keep the faster per direction. The scatters write back the bytes just gathered from the same
    blocks (the engine's KV is left as it was)."""
    device = table.device
    num_pages = min(_AUTO_TIMING_PAGES, workspace.shape[0], table.num_blocks)
    ids = torch.arange(num_pages, dtype=torch.int32, device=device)
    packed = workspace[:num_pages]
    workspace_words = workspace.view(-1)
    # Each group's packed pages, side by side in the same num_pages pages of workspace.
    group_packed, offset = [], 0
    for group_table in group_tables:
        words = num_pages * group_table.num_segments * group_table.segment_words
        group_packed.append(workspace_words[offset: offset + words].view(group_table.packed_shape(num_pages)))
        offset += words
    seconds: dict[tuple[str, str], float] = {}

    def timed(run) -> float:
        run()                                   # compiles, and leaves nothing to the timing
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(_AUTO_TIMING_REPEATS):
            run()
        torch.cuda.synchronize(device)
        return time.perf_counter() - started

    def scatter_groups(scatter) -> None:
        for group_table, packed_group in zip(group_tables, group_packed):
            scatter(group_table, packed_group, ids)

    for name, (gather, scatter, _) in BACKENDS.items():
        seconds[(name, "save")] = timed(lambda: gather(table, ids, packed))
        for group_table, packed_group in zip(group_tables, group_packed):
            gather(group_table, ids, packed_group)
        # Each group's packed pages hold these blocks' own bytes: the scatters rewrite them unchanged.
        seconds[(name, "load")] = timed(lambda: scatter_groups(scatter))
    choice = {direction: min(BACKENDS, key=lambda name: seconds[(name, direction)]) for direction in ("save", "load")}
    logger.info("transfer backends: %s (gather/scatter of %d pages: %s)", choice, num_pages,
                {f"{n}/{d}": round(s / _AUTO_TIMING_REPEATS * 1e3, 4) for (n, d), s in seconds.items()})
    return choice
