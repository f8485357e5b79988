"""Move KV pages between an engine's L1 pool and a packed page-major buffer.

Layouts (both contiguous):
  L1 pool ``l1_kv``:  [2 (K/V), num_layers, num_pages, page_size, num_kv_heads, head_dim]
  packed buffer:      [n, 2 (K/V), num_layers, page_size, num_kv_heads, head_dim]

In both layouts one (page, K/V, layer) "slab" of ``page_elements = page_size * num_kv_heads *
head_dim`` elements is contiguous, so a transfer is n * 2 * num_layers slab copies. In the pool
slab (kv_layer, page) starts at ``(kv_layer * num_pages + page) * page_elements``; in the packed
buffer slab (i, kv_layer) starts at ``(i * 2 * num_layers + kv_layer) * page_elements``.

Kernels copy raw bits: every tensor is viewed as the signed integer type of its itemsize, so
any 1/2/4/8-byte dtype (float8 included) moves bit for bit, NaN payloads too.

Two implementations with identical semantics and checks:
  * ``gather_pages`` / ``scatter_pages``: Triton kernels, one program per (slab, block of
    ``block_size`` elements); on CPU tensors they run under the Triton interpreter (for tests).
  * ``gather_pages_torch`` / ``scatter_pages_torch``: plain torch (reference and fallback).
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend still works without triton
    triton = None
    tl = None

logger = logging.getLogger(__name__)

# 1024-element blocks reached 4.0 TB/s on an H200 for the Qwen3-8B geometry; 256 only 1.6 TB/s.
DEFAULT_BLOCK_SIZE = 1024

# CUDA limits a grid's y dimension to 65535 blocks; x may reach 2**31 - 1.
_MAX_GRID_X = 2**31 - 1
_MAX_GRID_Y = 65535
# Triton's largest block (TRITON_MAX_TENSOR_NUMEL).
_MAX_BLOCK_SIZE = 2**20

_INDEX_DTYPES = (torch.int32, torch.int64)
_RAW_BITS_DTYPE_BY_ITEMSIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def triton_available() -> bool:
    """Whether the Triton backend can be used at all in this process."""
    return triton is not None


def packed_shape(l1_kv: torch.Tensor, num_pages_selected: int) -> tuple[int, ...]:
    """The packed buffer shape that holds ``num_pages_selected`` pages of ``l1_kv``."""
    _, num_layers, _, page_size, num_kv_heads, head_dim = l1_kv.shape
    return (num_pages_selected, 2, num_layers, page_size, num_kv_heads, head_dim)


# ----------------------------------------------------------------------------- checks


def _check_pool(l1_kv: torch.Tensor) -> None:
    """Raise TypeError/ValueError unless ``l1_kv`` is a pool the kernels can address."""
    if not isinstance(l1_kv, torch.Tensor):
        raise TypeError(f"l1_kv must be a torch.Tensor, got {type(l1_kv).__name__}")
    if l1_kv.dim() != 6 or l1_kv.shape[0] != 2:
        raise ValueError(
            "l1_kv must have shape [2, num_layers, num_pages, page_size, num_kv_heads, head_dim], "
            f"got {tuple(l1_kv.shape)}"
        )
    if l1_kv.element_size() not in _RAW_BITS_DTYPE_BY_ITEMSIZE:
        raise TypeError(f"unsupported dtype {l1_kv.dtype}: itemsize {l1_kv.element_size()}")
    # Kernels compute addresses from the shapes alone, so strides must be the contiguous ones.
    if not l1_kv.is_contiguous():
        raise ValueError(f"l1_kv must be contiguous, got strides {l1_kv.stride()}")


def _check_args(
    l1_kv: torch.Tensor,
    page_ids: torch.Tensor,
    packed: torch.Tensor,
    packed_name: str,
    check_bounds: bool,
) -> None:
    """Raise TypeError/ValueError unless the three tensors describe a valid page transfer."""
    _check_pool(l1_kv)
    for name, value in (("page_ids", page_ids), (packed_name, packed)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if packed.dim() != 6:
        raise ValueError(
            f"{packed_name} must have shape [n, 2, num_layers, page_size, num_kv_heads, head_dim], "
            f"got {tuple(packed.shape)}"
        )
    num_layers, _, page_size, num_kv_heads, head_dim = l1_kv.shape[1:]
    expected_page_shape = (2, num_layers, page_size, num_kv_heads, head_dim)
    if tuple(packed.shape[1:]) != expected_page_shape:
        raise ValueError(
            f"{packed_name} pages have shape {tuple(packed.shape[1:])}, but l1_kv pages have "
            f"shape {expected_page_shape}"
        )
    if page_ids.dim() != 1:
        raise ValueError(f"page_ids must be 1-D, got shape {tuple(page_ids.shape)}")
    if page_ids.dtype not in _INDEX_DTYPES:
        raise TypeError(f"page_ids must be int32 or int64, got {page_ids.dtype}")
    if page_ids.shape[0] != packed.shape[0]:
        raise ValueError(
            f"page_ids selects {page_ids.shape[0]} pages but {packed_name} holds {packed.shape[0]}"
        )
    if packed.dtype != l1_kv.dtype:
        raise TypeError(f"{packed_name} dtype {packed.dtype} differs from l1_kv dtype {l1_kv.dtype}")
    if not (l1_kv.device == page_ids.device == packed.device):
        raise ValueError(
            f"l1_kv ({l1_kv.device}), page_ids ({page_ids.device}) and {packed_name} "
            f"({packed.device}) must be on one device"
        )
    if not packed.is_contiguous():
        raise ValueError(f"{packed_name} must be contiguous, got strides {packed.stride()}")
    if check_bounds and page_ids.numel() > 0:
        num_pages = l1_kv.shape[2]
        # One device-to-host sync on GPU; callers that validated ids on the host pass False.
        low, high = (int(v) for v in torch.aminmax(page_ids))
        if low < 0 or high >= num_pages:
            raise ValueError(f"page_ids span [{low}, {high}], outside [0, {num_pages})")


def _raw_bits(tensor: torch.Tensor) -> torch.Tensor:
    """View ``tensor`` as the integer type of its itemsize, so copies are bit-exact."""
    bits_dtype = _RAW_BITS_DTYPE_BY_ITEMSIZE[tensor.element_size()]
    return tensor if tensor.dtype == bits_dtype else tensor.view(bits_dtype)


def _slab_geometry(l1_kv: torch.Tensor) -> tuple[int, int, int]:
    """(slabs per page = 2 * num_layers, num_pages, page_elements) of a checked pool."""
    _, num_layers, num_pages, page_size, num_kv_heads, head_dim = l1_kv.shape
    return 2 * num_layers, num_pages, page_size * num_kv_heads * head_dim


# ----------------------------------------------------------------------------- torch


def gather_pages_torch(
    l1_kv: torch.Tensor,
    page_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    check_bounds: bool = True,
) -> torch.Tensor:
    """out[i, kv, layer] = l1_kv[kv, layer, page_ids[i]] for all i, in plain torch; returns out."""
    _check_args(l1_kv, page_ids, out, "out", check_bounds)
    num_slabs_per_page, num_pages, page_elements = _slab_geometry(l1_kv)
    n = page_ids.shape[0]
    if n == 0:
        return out
    pool_slabs = _raw_bits(l1_kv).view(num_slabs_per_page, num_pages, page_elements)
    out_slabs = _raw_bits(out).view(n, num_slabs_per_page, page_elements)
    # index_select writes straight into the transposed view: one pass, no temporary.
    torch.index_select(pool_slabs, 1, page_ids, out=out_slabs.transpose(0, 1))
    return out


def scatter_pages_torch(
    packed: torch.Tensor,
    page_ids: torch.Tensor,
    l1_kv: torch.Tensor,
    *,
    check_bounds: bool = True,
) -> torch.Tensor:
    """l1_kv[kv, layer, page_ids[i]] = packed[i, kv, layer] for all i, in plain torch; returns l1_kv.

    With duplicate page ids, which packed page lands is unspecified.
    """
    _check_args(l1_kv, page_ids, packed, "packed", check_bounds)
    num_slabs_per_page, num_pages, page_elements = _slab_geometry(l1_kv)
    n = page_ids.shape[0]
    if n == 0:
        return l1_kv
    pool_slabs = _raw_bits(l1_kv).view(num_slabs_per_page, num_pages, page_elements)
    packed_slabs = _raw_bits(packed).view(n, num_slabs_per_page, page_elements)
    # index_copy_ takes only int64 indices; converting n ids is negligible next to the copy.
    pool_slabs.index_copy_(1, page_ids.to(torch.int64), packed_slabs.transpose(0, 1))
    return l1_kv


# ----------------------------------------------------------------------------- triton

if triton is not None:

    @triton.jit
    def _copy_pages_kernel(
        src_ptr,
        dst_ptr,
        page_ids_ptr,
        page_ids_stride,
        num_slabs_per_page,
        num_pages,
        page_elements,
        GATHER: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        EVEN_BLOCKS: tl.constexpr,
    ):
        # GATHER: pool slabs -> packed slabs (src is the pool); else packed -> pool (a scatter).
        # Axis 0 walks packed slabs in order (i * 2L + kv_layer); axis 1 is the block within
        # the slab, so no per-element division is needed.
        packed_slab = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        i = packed_slab // num_slabs_per_page
        kv_layer = packed_slab - i * num_slabs_per_page
        page_id = tl.load(page_ids_ptr + i * page_ids_stride).to(tl.int64)
        # Offsets in int64: pools exceed 2**31 elements.
        in_slab = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        in_pool = (kv_layer * num_pages + page_id) * page_elements + in_slab
        in_packed = packed_slab * page_elements + in_slab
        if GATHER:
            src = in_pool
            dst = in_packed
        else:
            src = in_packed
            dst = in_pool
        if EVEN_BLOCKS:
            tl.store(dst_ptr + dst, tl.load(src_ptr + src))
        else:
            mask = in_slab < page_elements
            tl.store(dst_ptr + dst, tl.load(src_ptr + src, mask=mask), mask=mask)


_interpreted_kernels: dict = {}


def _interpreted(kernel) -> Callable:
    """The Triton-interpreter version of ``kernel``, for CPU tensors.

    Built from the kernel's Python source, so it works whether or not TRITON_INTERPRET was set
    when this module was imported.
    """
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):  # TRITON_INTERPRET=1 at import time
        return kernel
    if kernel not in _interpreted_kernels:
        _interpreted_kernels[kernel] = InterpretedFunction(kernel.fn)
    return _interpreted_kernels[kernel]


class _LaunchPlan(NamedTuple):
    """What a launch needs from a checked pool: its slab geometry, the block size and the blocks per slab."""

    num_slabs_per_page: int
    num_pages: int
    page_elements: int
    block_size: int
    num_blocks_per_slab: int


def _plan_launches(l1_kv: torch.Tensor, block_size: int) -> _LaunchPlan:
    """Check the block size and work out the launch geometry of a (checked) pool."""
    if not isinstance(block_size, int) or not 0 < block_size <= _MAX_BLOCK_SIZE \
            or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two in [1, {_MAX_BLOCK_SIZE}], got {block_size!r}"
        )
    num_slabs_per_page, num_pages, page_elements = _slab_geometry(l1_kv)
    num_blocks_per_slab = triton.cdiv(page_elements, block_size)
    return _LaunchPlan(num_slabs_per_page, num_pages, page_elements, block_size, num_blocks_per_slab)


def _check_plan(plan: _LaunchPlan, device: torch.device) -> None:
    """Check what does not depend on the selection: the grid's y limit, in-slab offsets, the device."""
    if plan.num_blocks_per_slab > _MAX_GRID_Y:
        raise ValueError(
            f"a page slab of {plan.page_elements} elements needs {plan.num_blocks_per_slab} blocks of "
            f"{plan.block_size}, over the grid limit {_MAX_GRID_Y}; use a larger block_size"
        )
    if plan.num_blocks_per_slab * plan.block_size > 2**31 - 1:
        # Offsets within a slab are int32 in the kernels.
        raise ValueError(f"a page slab of {plan.page_elements} elements overflows int32 offsets")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"the Triton backend runs on cuda (or cpu, interpreted), not {device}")


def _launch_planned(gather: bool, plan: _LaunchPlan, page_ids: torch.Tensor, src: torch.Tensor,
                    dst: torch.Tensor) -> None:
    """Launch the page copy (a gather, or a scatter) from src to dst with one program per
    (packed slab, block) pair."""
    num_slabs = page_ids.shape[0] * plan.num_slabs_per_page
    if num_slabs > _MAX_GRID_X:
        raise ValueError(f"{num_slabs} page slabs exceed the grid limit {_MAX_GRID_X}")
    if num_slabs == 0:
        return
    grid = (num_slabs, plan.num_blocks_per_slab)
    args = (_raw_bits(src), _raw_bits(dst), page_ids, page_ids.stride(0),
            plan.num_slabs_per_page, plan.num_pages, plan.page_elements)
    even_blocks = plan.page_elements % plan.block_size == 0
    device = src.device
    if device.type == "cpu":
        _interpreted(_copy_pages_kernel)[grid](*args, GATHER=gather, BLOCK_SIZE=plan.block_size,
                                               EVEN_BLOCKS=even_blocks)
        return
    # Triton launches on the current device; make that the tensors' device (a switch only when it
    # is not already: the transfer engine launches with its device current).
    if torch.cuda.current_device() == device.index:
        _copy_pages_kernel[grid](*args, GATHER=gather, BLOCK_SIZE=plan.block_size, EVEN_BLOCKS=even_blocks)
        return
    with torch.cuda.device(device):
        _copy_pages_kernel[grid](*args, GATHER=gather, BLOCK_SIZE=plan.block_size, EVEN_BLOCKS=even_blocks)


def _launch(gather: bool, l1_kv: torch.Tensor, page_ids: torch.Tensor, src: torch.Tensor,
            dst: torch.Tensor, block_size: int) -> None:
    """Check the launch limits, then launch the page copy from src to dst."""
    plan = _plan_launches(l1_kv, block_size)
    num_slabs = page_ids.shape[0] * plan.num_slabs_per_page
    if num_slabs > _MAX_GRID_X:
        raise ValueError(f"{num_slabs} page slabs exceed the grid limit {_MAX_GRID_X}")
    _check_plan(plan, l1_kv.device)
    _launch_planned(gather, plan, page_ids, src, dst)


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("the Triton backend needs the triton package, which is not installed")


def gather_pages(
    l1_kv: torch.Tensor,
    page_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    check_bounds: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """out[i, kv, layer] = l1_kv[kv, layer, page_ids[i]] for all i, with Triton; returns out.

    Runs on the current CUDA stream. ``check_bounds`` costs one device sync on GPU.
    """
    _require_triton()
    _check_args(l1_kv, page_ids, out, "out", check_bounds)
    _launch(True, l1_kv, page_ids, l1_kv, out, block_size)
    return out


def scatter_pages(
    packed: torch.Tensor,
    page_ids: torch.Tensor,
    l1_kv: torch.Tensor,
    *,
    check_bounds: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """l1_kv[kv, layer, page_ids[i]] = packed[i, kv, layer] for all i, with Triton; returns l1_kv.

    Runs on the current CUDA stream. ``check_bounds`` costs one device sync on GPU. With
    duplicate page ids, which packed page lands is unspecified.
    """
    _require_triton()
    _check_args(l1_kv, page_ids, packed, "packed", check_bounds)
    _launch(False, l1_kv, page_ids, packed, l1_kv, block_size)
    return l1_kv


class PoolKernels:
    """The Triton gather and scatter bound to one L1 pool, for a caller that launches many of them.

    ``gather_pages`` and ``scatter_pages`` check every argument on every call; here what belongs
    to the pool (shape, contiguity, dtype, device, block size, per-slab limits) is checked once,
    at construction, and each call checks only what varies: the packed buffer (shape, dtype,
    contiguity, device) and the page-id tensor (shape, dtype, device), through one cheap test
    that falls back to the full checks, and their messages, when it fails. Same semantics and
    errors as the functions; the pool must keep its shape and strides (it is a fixed allocation).
    """

    def __init__(self, l1_kv: torch.Tensor, *, block_size: int = DEFAULT_BLOCK_SIZE):
        _require_triton()
        _check_pool(l1_kv)
        self.l1_kv = l1_kv
        self._plan = _plan_launches(l1_kv, block_size)
        _check_plan(self._plan, l1_kv.device)
        self._page_shape = l1_kv.shape[:2] + l1_kv.shape[3:]
        self._dtype = l1_kv.dtype
        self._device = l1_kv.device

    def gather(self, page_ids: torch.Tensor, out: torch.Tensor, *, check_bounds: bool = True) -> torch.Tensor:
        """out[i, kv, layer] = l1_kv[kv, layer, page_ids[i]] for all i; returns out (see gather_pages)."""
        self._check(page_ids, out, "out", check_bounds)
        _launch_planned(True, self._plan, page_ids, self.l1_kv, out)
        return out

    def scatter(self, packed: torch.Tensor, page_ids: torch.Tensor, *, check_bounds: bool = True) -> torch.Tensor:
        """l1_kv[kv, layer, page_ids[i]] = packed[i, kv, layer] for all i; returns l1_kv (see scatter_pages)."""
        self._check(page_ids, packed, "packed", check_bounds)
        _launch_planned(False, self._plan, page_ids, packed, self.l1_kv)
        return self.l1_kv

    def _check(self, page_ids: torch.Tensor, packed: torch.Tensor, packed_name: str, check_bounds: bool) -> None:
        valid = (isinstance(packed, torch.Tensor) and isinstance(page_ids, torch.Tensor)
                 and packed.shape[1:] == self._page_shape and packed.dtype == self._dtype
                 and page_ids.dim() == 1 and page_ids.shape[0] == packed.shape[0]
                 and page_ids.dtype in _INDEX_DTYPES
                 and packed.device == self._device and page_ids.device == self._device
                 and packed.is_contiguous())
        if not valid or check_bounds:
            # The full checks raise with the precise message (and check bounds when asked).
            _check_args(self.l1_kv, page_ids, packed, packed_name, check_bounds)
            assert valid, "the quick check refused arguments that the full checks accept"


# Backend name -> (gather, scatter), for the transfer engine's backend choice.
BACKENDS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "torch": (gather_pages_torch, scatter_pages_torch),
}
if triton is not None:
    BACKENDS["triton"] = (gather_pages, scatter_pages)
