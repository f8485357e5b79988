"""Torch dtypes for the dtype names a KV geometry carries on the wire."""

from __future__ import annotations

import logging

import torch

from proto.messages import DTYPE_ITEMSIZE

logger = logging.getLogger(__name__)


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
