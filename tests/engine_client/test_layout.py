"""KV layouts: how engine tensors are described, and which namespaces (geometries) they make."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_client.layout import dense_byte_shape, describe_layout
from proto.errors import ProtocolError
from proto.messages import KVGeometry

L, N, P, H, D = 3, 6, 4, 2, 8


def random_bits(shape, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-2**15, 2**15, shape, generator=generator, dtype=torch.int16).view(dtype)


def geometry_of(kind, tensors, **extra) -> KVGeometry:
    return describe_layout(kind, tensors).geometry("m", page_size=P, num_kv_heads=H, head_dim=D, **extra)


def test_one_pool_and_one_tensor_per_layer_make_one_namespace():
    """[2, L, N, P, H, D] and per-layer [2, N, P, H, D] tensors pack into the same L2 page format, so
    their geometries are equal (engines of either kind share pages) and equal the default key."""
    pool = random_bits((2, L, N, P, H, D), seed=1)
    layers = [random_bits((2, N, P, H, D), seed=2 + layer) for layer in range(L)]
    a, b = geometry_of("pool", pool), geometry_of("layer", layers)
    assert a == b and hash(a) == hash(b)
    assert a == KVGeometry("m", L, H, D, "bfloat16", P)
    assert a.bytes_per_page == 2 * L * P * H * D * 2 == describe_layout("pool", pool).page_bytes


def test_the_block_byte_shape_follows_memory_order():
    """A per-layer tensor viewed [2, N, P, H, D] but laid out [2, N, H, P, D] in memory (HND) has
    blocks of byte shape (H, P, D*2): a different page format, hence a different namespace."""
    physical = [random_bits((2, N, H, P, D), seed=layer) for layer in range(L)]
    logical = [t.transpose(2, 3) for t in physical]
    layout = describe_layout("layer", logical)
    assert layout.block_shape == (H, P, D * 2)
    assert geometry_of("layer", logical) != geometry_of("layer", [t.contiguous() for t in logical])


def test_opaque_blocks_are_keyed_by_their_byte_shape():
    """"blocks" layouts (a tensor per layer, block-major, K and V packed inside) get their own
    namespace, one per block byte shape, never the K/V one even with the same bytes per page."""
    packed_kv = [random_bits((N, 2, H, P, D), seed=layer) for layer in range(L)]
    flat = [t.reshape(N, -1) for t in packed_kv]
    a, b = geometry_of("blocks", packed_kv), geometry_of("blocks", flat)
    kv = geometry_of("layer", [random_bits((2, N, P, H, D), seed=9) for _ in range(L)])
    assert a.layout == "blocks" and a.block_shape == (2, H, P, D * 2) and b.block_shape == (2 * H * P * D * 2,)
    assert a.bytes_per_page == b.bytes_per_page == kv.bytes_per_page
    assert len({a, b, kv}) == 3


def test_revision_and_salt_separate_namespaces():
    """The same tensors with another model revision or cache salt (a LoRA adapter, a tenant) make
    another geometry; the wire form keeps every field."""
    layers = [random_bits((2, N, P, H, D), seed=layer) for layer in range(L)]
    keys = {geometry_of("layer", layers), geometry_of("layer", layers, model_revision="r2"),
            geometry_of("layer", layers, cache_salt="lora-7"),
            geometry_of("layer", layers, cache_salt="lora-7", model_revision="r2")}
    assert len(keys) == 4
    for key in keys:
        assert KVGeometry.from_wire(key.to_wire()) == key


@pytest.mark.parametrize("make, message", [
    (lambda: [random_bits((2, N, P, H, 2 * D), seed=0)[..., ::2] for _ in range(L)], "contiguous"),
    (lambda: [random_bits((2, N, P, H, D), seed=0), random_bits((2, N + 1, P, H, D), seed=1)], "blocks"),
    (lambda: [random_bits((3, N, P, H, D), seed=0)], "shape"),
    (lambda: [torch.as_strided(random_bits((N * P * H * D,), seed=0), (2, N, P * H * D), (1, P * H * D // 2, 1))],
     "overlap"),
])
def test_tensors_that_cannot_be_moved_as_blocks_are_refused(make, message):
    """Blocks with holes, layers with different block counts, a K/V dim that is not 2, and blocks
    that overlap are refused with a ValueError that says so."""
    with pytest.raises(ValueError, match=message):
        describe_layout("layer", make())


def test_a_kv_block_must_hold_one_page_of_the_geometry():
    """A K/V layout whose block is not page_size x heads x head_dim of the dtype does not fit the
    geometry; a "blocks" geometry must name its block shape; a peer's bad shape is refused."""
    layers = [random_bits((2, N, P, H, D), seed=layer) for layer in range(L)]
    with pytest.raises(ValueError):
        describe_layout("layer", layers).geometry("m", page_size=P, num_kv_heads=H, head_dim=2 * D)
    with pytest.raises(ProtocolError):
        KVGeometry("m", L, H, D, "bfloat16", P, layout="blocks").validate()
    for bad_shape in ([0, 4], "16", [1.5], list(range(1, 20))):
        with pytest.raises(ProtocolError):
            KVGeometry.from_wire(dict(KVGeometry("m", L, H, D, "bfloat16", P).to_wire(), layout="blocks",
                                      block_shape=bad_shape))


def test_dense_byte_shape_orders_dims_by_stride():
    """The byte shape is the dims in memory order, size-1 dims dropped, the last in bytes; holes raise."""
    assert dense_byte_shape((4, 2, 8), (16, 8, 1), 2) == (4, 2, 16)
    assert dense_byte_shape((4, 2, 8), (8, 32, 1), 2) == (2, 4, 16)
    assert dense_byte_shape((1, 4, 1), (99, 1, 7), 4) == (16,)
    with pytest.raises(ValueError):
        dense_byte_shape((4, 8), (16, 1), 2)
    assert dataclasses.replace(KVGeometry("m", L, H, D, "bfloat16", P), block_shape=(P, H, 2 * D)).block_shape == ()
