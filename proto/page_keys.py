"""The page key: the name of a page's contents in every tier and on every wire.

Page i of a token sequence is named by a chained digest of its whole prefix,
``key(i) = blake2b-128(key(i-1) || page i's token bytes)`` (``proto/tokens.py``), with ``ROOT_KEY``
before page 0. Equal keys mean equal prefixes (a 128-bit collision is negligible), so a flat map of
keys is a radix tree with page-sized edges. The L3 index's rows, the remote store's object names,
KV events' block hashes and the engine's L1 index all name pages by it, so it is defined once, here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from proto.tokens import TOKEN_BYTES, token_bytes

KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)


def page_key(parent_key: bytes, page_token_bytes: bytes) -> bytes:
    """The key of the page whose tokens are ``page_token_bytes``, below the page keyed ``parent_key``."""
    return hashlib.blake2b(parent_key + page_token_bytes, digest_size=KEY_BYTES).digest()


def iter_page_keys(token_ids: bytes | Sequence[int] | np.ndarray, page_size: int,
                   parent_key: bytes = ROOT_KEY) -> Iterator[bytes]:
    """The keys of the whole pages of ``token_ids`` in order, each computed when asked for (a caller
    that stops at its first miss digests no further). ``parent_key``: the key of the page before the
    first of them."""
    data = token_bytes(token_ids)
    page_bytes = page_size * TOKEN_BYTES
    for start in range(0, len(data) - page_bytes + 1, page_bytes):   # slices of one bytes object
        parent_key = page_key(parent_key, data[start:start + page_bytes])
        yield parent_key


def chain_page_keys(token_ids: bytes | Sequence[int] | np.ndarray, page_size: int, num_pages: int) -> list[bytes]:
    """The keys of pages 0..num_pages-1 of a path; ValueError if it holds fewer whole pages."""
    data = token_bytes(token_ids)
    page_bytes = page_size * TOKEN_BYTES
    if len(data) < num_pages * page_bytes:
        raise ValueError(f"{len(data) // page_bytes} whole pages of tokens, {num_pages} keys asked for")
    return list(iter_page_keys(data[:num_pages * page_bytes], page_size))
