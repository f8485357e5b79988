"""Token ids' wire form (proto.tokens) and the page key chained over it (proto.page_keys)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from proto.page_keys import KEY_BYTES, ROOT_KEY, chain_page_keys, iter_page_keys, page_key
from proto.tokens import TOKEN_DTYPE, page_aligned, token_array, token_bytes

PAGE = 4


def random_tokens(rng: np.random.Generator, num_tokens: int) -> np.ndarray:
    return rng.integers(-(2**31), 2**31, size=num_tokens, dtype=np.int64)


def test_token_bytes_are_little_endian_int32_whatever_the_callers_int_type(rng):
    """Lists, int64 and big-endian arrays of the same ids give the same bytes, and reading them
    back gives the ids."""
    ids = random_tokens(rng, 37)
    expected = b"".join(int(i).to_bytes(4, "little", signed=True) for i in ids)
    for form in (ids.tolist(), ids, ids.astype(">i8"), ids.astype(TOKEN_DTYPE), expected):
        assert token_bytes(form) == expected
    assert token_array(expected).tolist() == ids.tolist()
    assert token_bytes([]) == b"" and token_array([]).dtype == TOKEN_DTYPE


@pytest.mark.parametrize("bad, error", [
    (np.zeros((2, 3), dtype=np.int32), "1-D"),
    (np.array([1.5, 2.0]), "integers"),
    (np.array([2**31]), "int32"),
    (np.array([-(2**31) - 1]), "int32"),
    (b"\x01\x02\x03", "multiple of 4"),
])
def test_token_ids_that_are_not_int32_are_refused(bad, error):
    """Not 1-D, not integers, out of int32's range or bytes not whole ids: ValueError."""
    with pytest.raises(ValueError, match=error):
        token_bytes(bad)


def test_page_aligned_keeps_whole_pages_only(rng):
    """page_aligned(n) is the largest multiple of the page size at most n."""
    for num_tokens in rng.integers(0, 1000, size=50).tolist():
        aligned = page_aligned(num_tokens, PAGE)
        assert aligned % PAGE == 0 and aligned <= num_tokens < aligned + PAGE


def test_a_page_key_digests_its_parent_key_and_its_tokens(rng):
    """key(i) = blake2b-128(key(i-1) || page i's int32 little-endian tokens), from an all-zero
    root, computed here without proto's code."""
    ids = random_tokens(rng, 5 * PAGE + 3)
    expected, parent = [], bytes(16)
    for page in range(5):
        data = b"".join(int(i).to_bytes(4, "little", signed=True) for i in ids[page * PAGE:(page + 1) * PAGE])
        parent = hashlib.blake2b(parent + data, digest_size=16).digest()
        expected.append(parent)
    assert KEY_BYTES == 16 and ROOT_KEY == bytes(16)
    assert chain_page_keys(ids, PAGE, 5) == expected
    assert list(iter_page_keys(ids, PAGE)) == expected            # whole pages only: the 3 left over are not
    assert list(iter_page_keys(ids[2 * PAGE:], PAGE, expected[1])) == expected[2:]
    assert page_key(expected[0], token_bytes(ids[PAGE:2 * PAGE])) == expected[1]
    with pytest.raises(ValueError, match="5 whole pages of tokens, 6 keys asked for"):
        chain_page_keys(ids, PAGE, 6)


def test_equal_keys_mean_equal_prefixes(rng):
    """Two paths that differ in one token share the keys of the pages before it and no key from
    that page on."""
    ids = random_tokens(rng, 6 * PAGE)
    other = ids.copy()
    position = int(rng.integers(PAGE, 6 * PAGE))
    other[position] ^= 1
    first, second = chain_page_keys(ids, PAGE, 6), chain_page_keys(other, PAGE, 6)
    differing_page = position // PAGE
    assert first[:differing_page] == second[:differing_page]
    assert not set(first[differing_page:]) & set(second[differing_page:])
