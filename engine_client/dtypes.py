"""Dtype names, both ways: the name a KV geometry carries on the wire (one of
``proto.messages.DTYPE_ITEMSIZE``, which sizes pages), and the name of any tensor dtype a peer
registration carries (its tensors' element type, which may be a plain word type: vLLM keeps fp8
KV in uint8 tensors). Names are torch's, without the ``torch.`` prefix."""

from __future__ import annotations

from typing import Any

import torch

from proto.messages import DTYPE_ITEMSIZE

_TENSOR_ITEMSIZES = (1, 2, 4, 8)        # what a block copy moves words of


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of a dtype, e.g. "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a KV dtype; ValueError for one the daemon cannot size pages for."""
    name = dtype_name(dtype)
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"KV tensors of dtype {dtype} cannot be named on the wire; pass dtype= one of "
                         f"{sorted(DTYPE_ITEMSIZE)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire dtype name such as "bfloat16".

    Only the names in `proto.messages.DTYPE_ITEMSIZE` are accepted, so an engine can never hold KV in
    a dtype the daemon cannot size pages for.
    """
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {sorted(DTYPE_ITEMSIZE)}")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"KV dtype {name!r} is not available in torch {torch.__version__}")
    # The wire itemsize sizes the shared pages; a disagreement would corrupt every page boundary.
    assert dtype.itemsize == DTYPE_ITEMSIZE[name], (name, dtype.itemsize)
    return dtype


def tensor_dtype(name: Any) -> torch.dtype:
    """The torch dtype a peer registration names for its tensors (another engine's word: checked);
    ValueError for anything but a torch dtype of 1, 2, 4 or 8 bytes."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype.itemsize not in _TENSOR_ITEMSIZES:
        raise ValueError(f"not a KV tensor dtype: {name!r}")
    return dtype
