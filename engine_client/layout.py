"""KV layouts: how an engine's own KV tensors hold its blocks, and the L2 page they pack into.

The engine registers its tensors as they are; nothing here copies or reshapes them. Three kinds:

  "pool"    one tensor ``[2, L, N, *block]``          K/V, layer, block (the reference engine's pool)
  "layer"   one tensor per layer ``[2, N, *block]``   vLLM's GPU FlashAttention layout
  "blocks"  one tensor per layer ``[N, *block]``      opaque blocks: the engine packs K and V inside
                                                      a block (vLLM's CPU build), any shape whose
                                                      leading dim is the block

Every kind is described the same way, by a table: a page (block b of every layer) is S segments
of ``segment_bytes`` each (2L for the K/V kinds, K of every layer then V; L for "blocks"), and
segment s of block b starts at ``segment_addresses[s] + b * block_stride_bytes[s]``. The gather
and scatter kernels take that table of per-layer base addresses, not a pool tensor, so each kind,
with any block stride, moves through one kernel.

The L2 page is the S segments in order, packed: ``[2, L, *block]`` for the K/V kinds (the same
bytes whether the engine holds one tensor or one per layer, so such engines share pages) and
``[L, *block]`` for "blocks". The block's byte shape is its dims in memory order (whatever the
tensor's dim order), the last in bytes; with the page format ("kv" or "blocks") it goes into the
namespace key (``KVGeometry.layout``, ``block_shape``), so engines whose pages differ in format
never share one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np
import torch

from engine_client.dtypes import dtype_name, kv_dtype_name
from proto.messages import DTYPE_ITEMSIZE, KVGeometry

LAYOUT_KINDS = ("pool", "layer", "blocks")
WORD_DTYPE_BY_BYTES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def dense_byte_shape(sizes: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """The byte shape of a block whose elements fill one contiguous range of memory: its dims in
    memory order (largest stride first, size-1 dims left out), the last in bytes. ValueError when
    the block has holes or overlaps (then it is not one range)."""
    dims = sorted(((size, stride) for size, stride in zip(sizes, strides) if size != 1),
                  key=lambda dim: -dim[1])
    if any(size == 0 for size, _ in dims):
        raise ValueError("a block has no elements")
    if not dims:
        return (itemsize,)
    expected_stride = 1
    for size, stride in reversed(dims):
        if stride != expected_stride:
            raise ValueError(f"a block (sizes {tuple(sizes)}, strides {tuple(strides)}) is not one contiguous "
                             "range of memory")
        expected_stride *= size
    shape = tuple(size for size, _ in dims)
    return shape[:-1] + (shape[-1] * itemsize,)


@dataclasses.dataclass(frozen=True, eq=False)
class KVLayout:
    """An engine's KV tensors as a table of segments (see the module note)."""

    kind: str
    tensors: tuple[torch.Tensor, ...]     # kept alive: the table holds their addresses
    num_layers: int
    num_blocks: int
    dtype: torch.dtype
    device: torch.device
    block_shape: tuple[int, ...]          # one segment's byte shape, memory order
    segment_addresses: tuple[int, ...]
    block_stride_bytes: tuple[int, ...]
    segment_tensor_index: tuple[int, ...]  # which of `tensors` holds each segment

    @property
    def page_layout(self) -> str:
        """The L2 page format: "kv" (K and V apart) or "blocks" (opaque)."""
        return "blocks" if self.kind == "blocks" else "kv"

    @property
    def num_segments(self) -> int:
        return len(self.segment_addresses)

    def layer_segments(self, layer: int) -> tuple[int, ...]:
        """The segments of one layer, in page order: its K and its V ("kv"), or its block ("blocks")."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return (layer,) if self.page_layout == "blocks" else (layer, self.num_layers + layer)

    @property
    def segment_bytes(self) -> int:
        return math.prod(self.block_shape)

    @property
    def page_bytes(self) -> int:
        return self.num_segments * self.segment_bytes

    @property
    def word_bytes(self) -> int:
        """The widest integer word that every segment's start, stride and length are multiples of:
        the kernels move these words (bit for bit, whatever the KV dtype)."""
        for word in (8, 4, 2, 1):
            if self.segment_bytes % word == 0 and all(a % word == 0 for a in self.segment_addresses) \
                    and all(s % word == 0 for s in self.block_stride_bytes):
                return word
        raise AssertionError("unreachable: 1 divides everything")

    def geometry(self, model_id: str, *, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: str | None = None, tp_rank: int = 0, tp_size: int = 1, model_revision: str = "",
                 cache_salt: str = "") -> KVGeometry:
        """The namespace key of these tensors: the model's geometry, this layout's page format and
        block byte shape, the revision and the salt. ValueError if the tensors do not fit it.
        ``dtype`` names the KV dtype of tensors whose own dtype cannot name it (say, fp8 KV held
        in uint8); one that contradicts a namable tensor dtype is refused: engines of that dtype
        would read these bytes as theirs."""
        own_dtype = dtype_name(self.dtype)
        if dtype is not None and own_dtype in DTYPE_ITEMSIZE and dtype != own_dtype:
            raise ValueError(f"dtype={dtype!r} contradicts the KV tensors, which are {own_dtype}: pass "
                             f"dtype={own_dtype!r} or leave it out")
        block_shape = self.block_shape
        if self.page_layout == "kv" and block_shape == dense_byte_shape(
                (page_size, num_kv_heads, head_dim), (num_kv_heads * head_dim, head_dim, 1), self.tensors[0].element_size()):
            # The usual token-major block: its byte shape lacks the size-1 dims that one KV head or
            # one-token pages make, but its bytes are the default key's.
            block_shape = ()
        geometry = KVGeometry(model_id, num_layers=self.num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              dtype=dtype or kv_dtype_name(self.dtype), page_size=page_size, tp_rank=tp_rank,
                              tp_size=tp_size, layout=self.page_layout, block_shape=block_shape,
                              model_revision=model_revision, cache_salt=cache_salt)
        try:
            geometry.validate()
        except Exception as exc:   # ProtocolError: here it is the engine's own misuse
            raise ValueError(f"the KV tensors do not fit this geometry: {exc}") from None
        assert geometry.bytes_per_page == self.page_bytes, (geometry, self.page_bytes)
        return geometry

    def segment_views(self) -> list[torch.Tensor]:
        """Per segment, a ``[num_blocks, segment_words]`` view in words of ``word_bytes`` over the
        engine's tensor (for the torch backend, which cannot take addresses)."""
        word = self.word_bytes
        word_dtype = WORD_DTYPE_BY_BYTES[word]
        flats: dict[int, tuple[torch.Tensor, int]] = {}
        views = []
        for address, stride, index in zip(self.segment_addresses, self.block_stride_bytes,
                                          self.segment_tensor_index):
            if index not in flats:
                storage = self.tensors[index].untyped_storage()
                flat = torch.empty(0, dtype=word_dtype, device=self.device)
                flat.set_(storage, 0, (storage.nbytes() // word,), (1,))
                flats[index] = (flat, storage.data_ptr())
            flat, storage_address = flats[index]
            views.append(flat.as_strided((self.num_blocks, self.segment_bytes // word), (stride // word, 1),
                                         (address - storage_address) // word))
        return views

    def check_block_ids(self, block_ids: np.ndarray) -> None:
        if block_ids.size and (int(block_ids.min()) < 0 or int(block_ids.max()) >= self.num_blocks):
            raise ValueError(f"block ids span [{int(block_ids.min())}, {int(block_ids.max())}], outside "
                             f"[0, {self.num_blocks})")


def describe_layout(kind: str, kv_caches: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
                    ) -> KVLayout:
    """The layout of an engine's KV tensors: one tensor ("pool"), or one per layer in layer order
    (a sequence, or a mapping such as vLLM's ``{layer_name: tensor}`` in its insertion order)."""
    if kind not in LAYOUT_KINDS:
        raise ValueError(f"layout kind must be one of {LAYOUT_KINDS}, got {kind!r}")
    if kind == "pool":
        if not isinstance(kv_caches, torch.Tensor):
            raise TypeError("a \"pool\" layout is one tensor [2, L, N, *block]")
        tensors: tuple[torch.Tensor, ...] = (kv_caches,)
    else:
        values = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
        if not values or not all(isinstance(t, torch.Tensor) for t in values):
            raise TypeError(f"a {kind!r} layout is one tensor per layer, in layer order")
        tensors = tuple(values)
    first = tensors[0]
    for tensor in tensors:
        if tensor.dtype != first.dtype or tensor.device != first.device:
            raise ValueError("every KV tensor must have one dtype and one device")
        if tensor.element_size() not in WORD_DTYPE_BY_BYTES:
            raise TypeError(f"unsupported dtype {tensor.dtype}")
    itemsize = first.element_size()

    addresses: list[int] = []
    block_strides: list[int] = []
    tensor_index: list[int] = []
    block_shape = None
    if kind == "pool":
        if first.dim() < 4 or first.shape[0] != 2:
            raise ValueError(f"a \"pool\" tensor has shape [2, L, N, *block], got {tuple(first.shape)}")
        num_layers, num_blocks = first.shape[1], first.shape[2]
        block_shape = dense_byte_shape(first.shape[3:], first.stride()[3:], itemsize)
        for kv in range(2):
            for layer in range(num_layers):
                addresses.append(first.data_ptr() + (kv * first.stride(0) + layer * first.stride(1)) * itemsize)
                block_strides.append(first.stride(2) * itemsize)
                tensor_index.append(0)
    else:
        lead = 2 if kind == "layer" else 1
        num_layers = len(tensors)
        num_blocks = first.shape[lead - 1] if first.dim() >= lead else 0
        for index, tensor in enumerate(tensors):
            if tensor.dim() < lead + 1 or (kind == "layer" and tensor.shape[0] != 2):
                expected = "[2, N, *block]" if kind == "layer" else "[N, *block]"
                raise ValueError(f"layer {index}: a {kind!r} tensor has shape {expected}, got {tuple(tensor.shape)}")
            if tensor.shape[lead - 1] != num_blocks:
                raise ValueError(f"layer {index} has {tensor.shape[lead - 1]} blocks, layer 0 has {num_blocks}")
            shape = dense_byte_shape(tensor.shape[lead:], tensor.stride()[lead:], itemsize)
            if block_shape is not None and shape != block_shape:
                raise ValueError(f"layer {index}'s blocks are {shape} bytes, layer 0's {block_shape}")
            block_shape = shape
        for kv in range(lead):            # "layer": K of every layer, then V; "blocks": one pass
            for index, tensor in enumerate(tensors):
                addresses.append(tensor.data_ptr() + kv * tensor.stride(0) * itemsize)
                block_strides.append(tensor.stride(lead - 1) * itemsize)
                tensor_index.append(index)
    assert block_shape is not None
    if num_blocks < 1:
        raise ValueError("the KV tensors hold no block")
    segment_bytes = math.prod(block_shape)
    if any(stride < segment_bytes for stride in block_strides):
        raise ValueError(f"blocks overlap: a block stride of {min(block_strides)} bytes is less than a block "
                         f"({segment_bytes} bytes)")
    if len(set(addresses)) != len(addresses):
        raise ValueError("two layers share one tensor's memory")
    return KVLayout(kind, tensors, num_layers, num_blocks, first.dtype, first.device, block_shape,
                    tuple(addresses), tuple(block_strides), tuple(tensor_index))
