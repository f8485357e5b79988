"""Token ids as the wire, the tree and every page key hold them: little-endian int32.

A prompt's token ids travel as the bytes of a little-endian int32 array (``token_ids`` of requests
and peer runs, the L3 index's rows, KV events' paths), the daemon's tree keys pages by those bytes,
and a page key digests them (``proto/page_keys.py``). Only whole pages are cached, so a prefix is
cut down to a page boundary (``page_aligned``) before it is looked up, saved or restored.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
TOKEN_BYTES = TOKEN_DTYPE.itemsize
_INT32 = np.iinfo(np.int32)


def token_array(token_ids: bytes | Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a one-dimensional little-endian int32 array (bytes are read in place, an int32
    array is returned as it is); ValueError for anything that is not integers that fit in int32."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        if len(token_ids) % TOKEN_BYTES:
            raise ValueError(f"{len(token_ids)} bytes of token ids, not a multiple of {TOKEN_BYTES}")
        return np.frombuffer(token_ids, dtype=TOKEN_DTYPE)
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {array.shape}")
    if array.dtype == TOKEN_DTYPE:            # the engine's usual case: no checks, no copy
        return array
    if array.size == 0:                       # np.asarray([]) is float64: an empty prefix all the same
        return np.empty(0, dtype=TOKEN_DTYPE)
    if array.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {array.dtype}")
    if array.min() < _INT32.min or array.max() > _INT32.max:
        raise ValueError("token ids must fit in int32")
    return array.astype(TOKEN_DTYPE)


def token_bytes(token_ids: bytes | Sequence[int] | np.ndarray) -> bytes:
    """Token ids in their wire form (checked as ``token_array`` checks them)."""
    if isinstance(token_ids, bytes):
        token_array(token_ids)                # checks its length
        return token_ids
    return token_array(token_ids).tobytes()


def page_aligned(num_tokens: int, page_size: int) -> int:
    """The most tokens of ``num_tokens`` that fill whole pages."""
    return num_tokens // page_size * page_size
