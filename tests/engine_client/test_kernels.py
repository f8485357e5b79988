"""Page gather/scatter between the L1 pool and the packed page-major buffer.

The Triton kernels run under the Triton interpreter on CPU tensors (engine_client.kernels builds
the interpreted kernel itself, so this works whether or not TRITON_INTERPRET was set when the
module was first imported); the compiled kernels are checked by the tests marked ``gpu``.
Data is fresh random bits every run (NaN payloads included); comparisons are bit for bit.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine_client import kernels
from engine_client.kernels import (
    PoolKernels,
    gather_pages,
    gather_pages_torch,
    packed_shape,
    scatter_pages,
    scatter_pages_torch,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")



def gather_pool_kernels(l1_kv, page_ids, out, *, block_size=kernels.DEFAULT_BLOCK_SIZE, **options):
    """gather_pages through a PoolKernels bound to l1_kv (one per call here; the transfer engine keeps one)."""
    return PoolKernels(l1_kv, block_size=block_size).gather(page_ids, out, **options)


def scatter_pool_kernels(packed, page_ids, l1_kv, *, block_size=kernels.DEFAULT_BLOCK_SIZE, **options):
    """scatter_pages through a PoolKernels bound to l1_kv."""
    return PoolKernels(l1_kv, block_size=block_size).scatter(packed, page_ids, **options)


GATHERS = [
    pytest.param(gather_pages, id="triton", marks=needs_triton),
    pytest.param(gather_pool_kernels, id="triton-pool", marks=needs_triton),
    pytest.param(gather_pages_torch, id="torch"),
]
SCATTERS = [
    pytest.param(scatter_pages, id="triton", marks=needs_triton),
    pytest.param(scatter_pool_kernels, id="triton-pool", marks=needs_triton),
    pytest.param(scatter_pages_torch, id="torch"),
]
DTYPES = [
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float8_e4m3fn, id="fp8e4m3"),
]
ID_DTYPES = [pytest.param(torch.int32, id="ids32"), pytest.param(torch.int64, id="ids64")]

# (num_layers, num_pages, page_size, num_kv_heads, head_dim); page_elements in the id.
GEOMETRIES = [
    pytest.param((1, 5, 16, 8, 128), id="E16384"),  # whole 1024-element blocks
    pytest.param((2, 6, 1, 1, 64), id="E64"),  # one partial block
    pytest.param((1, 5, 3, 8, 64), id="E1536"),  # one and a half blocks
    pytest.param((2, 7, 1, 8, 128), id="E1024"),  # exactly one block
]

_BITS_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture
def gen() -> torch.Generator:
    """A generator with a fresh seed per test; failures print it for reproduction."""
    generator = torch.Generator()
    generator.manual_seed(random.SystemRandom().randrange(2**62))
    return generator


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``tensor``, so that == compares NaN payloads too."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.view(_BITS_DTYPE[tensor.element_size()])


def random_tensor(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Uniformly random bit patterns viewed as ``dtype`` (NaNs and infinities included)."""
    bits_dtype = _BITS_DTYPE[torch.empty((), dtype=dtype).element_size()]
    info = torch.iinfo(bits_dtype)
    raw = torch.randint(info.min, info.max, tuple(shape), dtype=bits_dtype, generator=gen)
    return raw.view(dtype)


def random_pool(geometry, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    num_layers, num_pages, page_size, num_kv_heads, head_dim = geometry
    return random_tensor((2, num_layers, num_pages, page_size, num_kv_heads, head_dim), dtype, gen)


def distinct_page_ids(num_pages: int, n: int, id_dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(num_pages, generator=gen)[:n].to(id_dtype)


def reference_gather(l1_kv: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Page by page with plain indexing: independent of both implementations under test."""
    return torch.stack([bits(l1_kv)[:, :, int(page_id)] for page_id in page_ids])


def assert_other_pages_unchanged(before: torch.Tensor, after: torch.Tensor, written, seed: int) -> None:
    written = {int(page_id) for page_id in written}
    for page_id in range(before.shape[2]):
        if page_id not in written:
            assert torch.equal(bits(after)[:, :, page_id], bits(before)[:, :, page_id]), (
                f"page {page_id} changed although not selected (seed {seed})"
            )


@pytest.mark.parametrize("gather", GATHERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_gather_copies_selected_pages_bit_for_bit(gather, dtype, geometry, id_dtype, gen):
    """out[i] equals pool page page_ids[i] bit for bit, for every dtype, geometry and id dtype."""
    l1_kv = random_pool(geometry, dtype, gen)
    l1_before = l1_kv.clone()
    page_ids = distinct_page_ids(geometry[1], 3, id_dtype, gen)
    # Prefilled with random bits, so a kernel that writes nothing cannot pass.
    out = random_tensor(packed_shape(l1_kv, 3), dtype, gen)

    returned = gather(l1_kv, page_ids, out)

    assert returned is out
    assert torch.equal(bits(out), reference_gather(l1_kv, page_ids)), f"seed {gen.initial_seed()}"
    assert torch.equal(bits(l1_kv), bits(l1_before)), "gather modified the pool"


@pytest.mark.parametrize("scatter", SCATTERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES[:3])
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_scatter_writes_selected_pages_and_no_others(scatter, dtype, geometry, id_dtype, gen):
    """Pool page page_ids[i] becomes packed[i] bit for bit; every other page keeps its bits."""
    l1_kv = random_pool(geometry, dtype, gen)
    l1_before = l1_kv.clone()
    page_ids = distinct_page_ids(geometry[1], 2, id_dtype, gen)
    packed = random_tensor(packed_shape(l1_kv, 2), dtype, gen)

    returned = scatter(packed, page_ids, l1_kv)

    assert returned is l1_kv
    for i, page_id in enumerate(page_ids.tolist()):
        assert torch.equal(bits(l1_kv)[:, :, page_id], bits(packed)[i]), f"seed {gen.initial_seed()}"
    assert_other_pages_unchanged(l1_before, l1_kv, page_ids, gen.initial_seed())


@pytest.mark.parametrize(
    "gather, scatter, block_size",
    [
        pytest.param(gather_pages, scatter_pages, 1024, id="triton-1024", marks=needs_triton),
        # 192-element slabs in 128-element blocks: several blocks per slab with a masked tail.
        pytest.param(gather_pages, scatter_pages, 128, id="triton-128", marks=needs_triton),
        pytest.param(gather_pool_kernels, scatter_pool_kernels, 128, id="triton-pool-128", marks=needs_triton),
        pytest.param(gather_pages_torch, scatter_pages_torch, None, id="torch"),
    ],
)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_round_trip_into_other_pages_restores_the_original(gather, scatter, block_size, id_dtype, gen):
    """Gather pages, scatter them into different pages: those hold the originals, the rest is intact."""
    geometry = (3, 10, 3, 1, 64)  # page_elements 192
    l1_kv = random_pool(geometry, torch.bfloat16, gen)
    l1_before = l1_kv.clone()
    shuffled = torch.randperm(geometry[1], generator=gen)
    src_page_ids, dst_page_ids = shuffled[:4].to(id_dtype), shuffled[4:8].to(id_dtype)
    packed = random_tensor(packed_shape(l1_kv, 4), torch.bfloat16, gen)
    options = {} if block_size is None else {"block_size": block_size}

    gather(l1_kv, src_page_ids, packed, **options)
    scatter(packed, dst_page_ids, l1_kv, **options)

    for src, dst in zip(src_page_ids.tolist(), dst_page_ids.tolist()):
        assert torch.equal(bits(l1_kv)[:, :, dst], bits(l1_before)[:, :, src]), f"seed {gen.initial_seed()}"
    assert_other_pages_unchanged(l1_before, l1_kv, dst_page_ids, gen.initial_seed())


@pytest.mark.parametrize(
    "gather, scatter",
    [
        pytest.param(gather_pages, scatter_pages, id="triton", marks=needs_triton),
        pytest.param(gather_pool_kernels, scatter_pool_kernels, id="triton-pool", marks=needs_triton),
        pytest.param(gather_pages_torch, scatter_pages_torch, id="torch"),
    ],
)
def test_strided_page_ids_are_read_with_their_stride(gather, scatter, gen):
    """A non-contiguous page_ids view selects the pages it shows, not its neighbours in memory."""
    geometry = (1, 8, 1, 8, 64)
    l1_kv = random_pool(geometry, torch.float16, gen)
    l1_before = l1_kv.clone()
    page_ids = torch.randperm(8, generator=gen)[:6][::2]  # stride 2
    assert not page_ids.is_contiguous()
    out = random_tensor(packed_shape(l1_kv, 3), torch.float16, gen)

    gather(l1_kv, page_ids, out)
    assert torch.equal(bits(out), reference_gather(l1_before, page_ids)), f"seed {gen.initial_seed()}"

    packed = random_tensor(packed_shape(l1_kv, 3), torch.float16, gen)
    scatter(packed, page_ids, l1_kv)
    for i, page_id in enumerate(page_ids.tolist()):
        assert torch.equal(bits(l1_kv)[:, :, page_id], bits(packed)[i]), f"seed {gen.initial_seed()}"
    assert_other_pages_unchanged(l1_before, l1_kv, page_ids, gen.initial_seed())


@pytest.mark.parametrize(
    "gather, scatter",
    [
        pytest.param(gather_pages, scatter_pages, id="triton", marks=needs_triton),
        pytest.param(gather_pages_torch, scatter_pages_torch, id="torch"),
    ],
)
def test_empty_selection_changes_nothing(gather, scatter, gen):
    """Zero page ids: the pool keeps its bits and the call returns without error."""
    l1_kv = random_pool((1, 4, 2, 1, 64), torch.bfloat16, gen)
    l1_before = l1_kv.clone()
    page_ids = torch.empty(0, dtype=torch.int64)
    empty = torch.empty(packed_shape(l1_kv, 0), dtype=torch.bfloat16)

    gather(l1_kv, page_ids, empty)
    scatter(empty, page_ids, l1_kv)

    assert torch.equal(bits(l1_kv), bits(l1_before))


# ----------------------------------------------------------------------------- validation

def _valid_args(gen):
    """(l1_kv, page_ids, packed) that pass every check: 2 layers, 6 pages, page [2, 2, 64]."""
    l1_kv = random_pool((2, 6, 2, 2, 64), torch.bfloat16, gen)
    page_ids = torch.tensor([4, 1], dtype=torch.int32)
    packed = random_tensor(packed_shape(l1_kv, 2), torch.bfloat16, gen)
    return l1_kv, page_ids, packed


def _non_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """Same shape, dtype and values, but every other element of a wider buffer."""
    wide = torch.empty(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)
    view = wide[..., ::2]
    view.copy_(tensor)
    return view


# name -> (transform of (l1_kv, page_ids, packed), expected error, message fragment)
INVALID_ARGS = {
    "pool not a tensor": (lambda l, i, p: (l.tolist(), i, p), TypeError, "l1_kv must be a torch.Tensor"),
    "ids not a tensor": (lambda l, i, p: (l, [4, 1], p), TypeError, "page_ids must be a torch.Tensor"),
    "pool 5-D": (lambda l, i, p: (l[0], i, p), ValueError, "l1_kv must have shape"),
    "pool first dim not 2": (lambda l, i, p: (torch.cat([l, l[:1]]), i, p), ValueError, "l1_kv must have shape"),
    "packed 5-D": (lambda l, i, p: (l, i, p[0]), ValueError, "must have shape [n, 2"),
    "packed other layers": (lambda l, i, p: (l, i, p[:, :, :1].contiguous()), ValueError, "pages have shape"),
    "packed other head dim": (lambda l, i, p: (l, i, p[..., :32].contiguous()), ValueError, "pages have shape"),
    "ids 2-D": (lambda l, i, p: (l, i.view(2, 1), p), ValueError, "page_ids must be 1-D"),
    "ids float": (lambda l, i, p: (l, i.float(), p), TypeError, "page_ids must be int32 or int64"),
    "ids int16": (lambda l, i, p: (l, i.to(torch.int16), p), TypeError, "page_ids must be int32 or int64"),
    "ids count differs": (lambda l, i, p: (l, i[:1], p), ValueError, "selects 1 pages but"),
    "dtype differs": (lambda l, i, p: (l, i, p.view(torch.float16)), TypeError, "differs from l1_kv dtype"),
    "unsupported itemsize": (
        lambda l, i, p: (l.to(torch.complex128), i, p.to(torch.complex128)), TypeError, "unsupported dtype",
    ),
    "packed on another device": (lambda l, i, p: (l, i, p.to("meta")), ValueError, "must be on one device"),
    "ids on another device": (lambda l, i, p: (l, i.to("meta"), p), ValueError, "must be on one device"),
    "pool not contiguous": (lambda l, i, p: (_non_contiguous(l), i, p), ValueError, "l1_kv must be contiguous"),
    "packed not contiguous": (lambda l, i, p: (l, i, _non_contiguous(p)), ValueError, "must be contiguous"),
    "id past the end": (lambda l, i, p: (l, torch.tensor([1, 6], dtype=i.dtype), p), ValueError, "outside [0, 6)"),
    "negative id": (lambda l, i, p: (l, torch.tensor([-1, 2], dtype=i.dtype), p), ValueError, "outside [0, 6)"),
}


@pytest.mark.parametrize("case", list(INVALID_ARGS))
@pytest.mark.parametrize("gather", GATHERS)
def test_gather_rejects_invalid_arguments(gather, case, gen):
    """Each invalid argument raises its typed error with a message naming the problem; out is untouched."""
    transform, error, fragment = INVALID_ARGS[case]
    l1_kv, page_ids, packed = transform(*_valid_args(gen))
    out_before = packed.clone() if isinstance(packed, torch.Tensor) and packed.device.type == "cpu" else None

    with pytest.raises(error, match=re.escape(fragment)):
        gather(l1_kv, page_ids, packed)

    if out_before is not None:
        assert torch.equal(bits(packed), bits(out_before)), "out written although the call was rejected"


@pytest.mark.parametrize("case", list(INVALID_ARGS))
@pytest.mark.parametrize("scatter", SCATTERS)
def test_scatter_rejects_invalid_arguments(scatter, case, gen):
    """Each invalid argument raises its typed error with a message naming the problem; the pool is untouched."""
    transform, error, fragment = INVALID_ARGS[case]
    l1_kv, page_ids, packed = transform(*_valid_args(gen))
    pool_before = l1_kv.clone() if isinstance(l1_kv, torch.Tensor) else None

    with pytest.raises(error, match=re.escape(fragment)):
        scatter(packed, page_ids, l1_kv)

    if pool_before is not None:
        assert torch.equal(bits(l1_kv), bits(pool_before)), "pool written although the call was rejected"


@needs_triton
@pytest.mark.parametrize("block_size", [0, -1024, 1000, 2**21, 1024.0])
@pytest.mark.parametrize("kernel", [gather_pages, scatter_pages], ids=["gather", "scatter"])
def test_triton_rejects_bad_block_size(kernel, block_size, gen):
    """block_size must be a power-of-two int no larger than Triton's largest block."""
    l1_kv, page_ids, packed = _valid_args(gen)
    args = (l1_kv, page_ids, packed) if kernel is gather_pages else (packed, page_ids, l1_kv)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        kernel(*args, block_size=block_size)


def _meta_args(num_selected: int, num_layers: int, page_elements: int):
    """Shape-only tensors (no memory) for grid-limit checks; bounds checks need real ids."""
    l1_kv = torch.empty(2, num_layers, 4, 1, 1, page_elements, dtype=torch.int8, device="meta")
    page_ids = torch.empty(num_selected, dtype=torch.int64, device="meta")
    packed = torch.empty(num_selected, 2, num_layers, 1, 1, page_elements, dtype=torch.int8, device="meta")
    return l1_kv, page_ids, packed


@needs_triton
@pytest.mark.parametrize(
    "num_selected, num_layers, page_elements, block_size, fragment",
    [
        pytest.param(2**30, 1, 16, 1024, "exceed the grid limit", id="too many slabs"),
        pytest.param(1, 1, 65536, 1, "over the grid limit 65535", id="too many blocks per slab"),
        pytest.param(1, 1, 2**31, 2**20, "overflows int32 offsets", id="slab offsets overflow int32"),
    ],
)
@pytest.mark.parametrize("kernel", [gather_pages, scatter_pages], ids=["gather", "scatter"])
def test_triton_rejects_launches_beyond_grid_limits(kernel, num_selected, num_layers, page_elements,
                                                    block_size, fragment):
    """Selections whose grid or in-slab offsets would exceed hardware or int32 limits raise ValueError."""
    l1_kv, page_ids, packed = _meta_args(num_selected, num_layers, page_elements)
    args = (l1_kv, page_ids, packed) if kernel is gather_pages else (packed, page_ids, l1_kv)
    with pytest.raises(ValueError, match=fragment):
        kernel(*args, check_bounds=False, block_size=block_size)


@needs_triton
def test_triton_rejects_devices_it_cannot_launch_on():
    """A consistent selection on a device that is neither cuda nor cpu raises ValueError."""
    l1_kv, page_ids, packed = _meta_args(2, 1, 64)
    with pytest.raises(ValueError, match="runs on cuda"):
        gather_pages(l1_kv, page_ids, packed, check_bounds=False)


@needs_triton
def test_pool_kernels_check_the_pool_block_size_and_device_once_at_construction(gen):
    """PoolKernels refuses, when built, a bad block size, a slab beyond the grid limit and a device Triton
    cannot launch on, with the messages of gather_pages."""
    l1_kv, _, _ = _valid_args(gen)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        PoolKernels(l1_kv, block_size=1000)
    with pytest.raises(ValueError, match="over the grid limit 65535"):
        PoolKernels(_meta_args(1, 1, 65536)[0], block_size=1)
    with pytest.raises(ValueError, match="runs on cuda"):
        PoolKernels(_meta_args(2, 1, 64)[0])


@needs_triton
def test_pool_kernels_serve_many_selections_of_one_pool(gen):
    """One PoolKernels gathers and scatters selections of different sizes (and slices of one packed
    buffer) of its pool, bit for bit, without touching other pages."""
    l1_kv = random_pool((2, 9, 2, 1, 64), torch.bfloat16, gen)
    l1_before = l1_kv.clone()
    pool_kernels = PoolKernels(l1_kv)
    packed = random_tensor(packed_shape(l1_kv, 5), torch.bfloat16, gen)
    sources = torch.tensor([8, 1, 6, 3, 0])
    pool_kernels.gather(sources[:2], packed[:2], check_bounds=False)
    pool_kernels.gather(sources[2:], packed[2:], check_bounds=False)
    assert torch.equal(bits(packed), reference_gather(l1_before, sources)), f"seed {gen.initial_seed()}"
    destinations = torch.tensor([2, 4, 5, 7, 1], dtype=torch.int32)
    assert pool_kernels.scatter(packed[:3], destinations[:3]) is l1_kv
    pool_kernels.scatter(packed[3:], destinations[3:])
    for source, destination in zip(sources.tolist(), destinations.tolist()):
        assert torch.equal(bits(l1_kv)[:, :, destination], bits(l1_before)[:, :, source])
    assert_other_pages_unchanged(l1_before, l1_kv, destinations, gen.initial_seed())


@needs_triton
def test_kernels_also_work_when_imported_under_triton_interpret(tmp_path):
    """With TRITON_INTERPRET=1 set before import, the jit kernels themselves run on CPU, bit exact."""
    script = textwrap.dedent(
        """
        import torch
        from engine_client import kernels
        from triton.runtime.interpreter import InterpretedFunction
        assert isinstance(kernels._copy_pages_kernel, InterpretedFunction)
        l1_kv = torch.randint(-2**15, 2**15 - 1, (2, 2, 5, 3, 2, 64), dtype=torch.int16).view(torch.bfloat16)
        page_ids = torch.tensor([3, 0], dtype=torch.int32)
        out = torch.empty(kernels.packed_shape(l1_kv, 2), dtype=torch.bfloat16)
        kernels.gather_pages(l1_kv, page_ids, out)
        expected = l1_kv.view(torch.int16)[:, :, page_ids.long()].permute(2, 0, 1, 3, 4, 5)
        assert torch.equal(out.view(torch.int16), expected)
        kernels.scatter_pages(out, torch.tensor([1, 4]), l1_kv)
        assert torch.equal(l1_kv.view(torch.int16)[:, :, [1, 4]], expected.permute(1, 2, 0, 3, 4, 5))
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_compiled_kernels_match_torch_on_gpu(dtype, id_dtype, gen):
    """On a GPU the compiled gather equals torch bit for bit and a scatter round trip restores pages."""
    geometry = (36, 64, 16, 8, 128)  # Qwen3-8B per layer, 64 pages
    l1_kv = random_pool(geometry, dtype, gen).cuda()
    l1_before = l1_kv.clone()
    shuffled = torch.randperm(geometry[1], generator=gen)
    src_page_ids, dst_page_ids = shuffled[:20].to(id_dtype).cuda(), shuffled[20:40].to(id_dtype).cuda()
    out = random_tensor(packed_shape(l1_kv, 20), dtype, gen).cuda()
    expected = random_tensor(packed_shape(l1_kv, 20), dtype, gen).cuda()

    gather_pages(l1_kv, src_page_ids, out)
    gather_pages_torch(l1_kv, src_page_ids, expected)
    assert torch.equal(bits(out), bits(expected)), f"seed {gen.initial_seed()}"

    scatter_pages(out, dst_page_ids, l1_kv)
    torch.cuda.synchronize()
    assert torch.equal(bits(l1_kv)[:, :, dst_page_ids.long()], bits(l1_before)[:, :, src_page_ids.long()])
    untouched = torch.ones(geometry[1], dtype=torch.bool)
    untouched[dst_page_ids.long().cpu()] = False
    assert torch.equal(bits(l1_kv)[:, :, untouched.cuda()], bits(l1_before)[:, :, untouched.cuda()])


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_compiled_kernels_address_pools_beyond_2_pow_31_elements(gen):
    """Pages whose offsets exceed 2**31 elements are gathered and scattered at the right address."""
    page_elements = 16 * 8 * 128
    num_pages = 2**31 // (2 * page_elements) + 8  # the V half ends past 2**31 elements
    l1_kv = torch.empty(2, 1, num_pages, 16, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
    last_page_ids = torch.tensor([num_pages - 1, num_pages - 3], dtype=torch.int32, device="cuda")
    first_page_ids = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    for page_ids in (last_page_ids, first_page_ids):
        bits(l1_kv)[:, :, page_ids.long()] = bits(random_tensor((2, 1, 2, 16, 8, 128), l1_kv.dtype, gen).cuda())
    out = torch.empty(packed_shape(l1_kv, 2), dtype=l1_kv.dtype, device="cuda")

    gather_pages(l1_kv, last_page_ids, out)
    assert torch.equal(bits(out), bits(l1_kv)[:, :, last_page_ids.long()].permute(2, 0, 1, 3, 4, 5))

    scatter_pages(out, first_page_ids, l1_kv)
    assert torch.equal(bits(l1_kv)[:, :, first_page_ids.long()], bits(l1_kv)[:, :, last_page_ids.long()])
