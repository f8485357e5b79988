"""ChunkMap: chunk sizes, and which pages an owner may use, for pages of any size up to a chunk."""

from __future__ import annotations

import random

import pytest

from kvcached.core.chunks import CHUNK_ALIGN_BYTES, ChunkMap, chunk_bytes_for


@pytest.fixture
def rng(seed) -> random.Random:
    return random.Random(seed)


def test_a_space_is_cut_into_at_most_64_chunks_of_whole_2_mib():
    """Chunks are a multiple of 2 MiB, about 1/64 of the space: never more than 64 of them."""
    for space_bytes in (2 << 20, 3 << 20, 64 << 20, 1 << 30, (64 << 30) + 4096, 1 << 40):
        chunks = ChunkMap(space_bytes)
        assert chunks.chunk_bytes % CHUNK_ALIGN_BYTES == 0 and chunks.chunk_bytes == chunk_bytes_for(space_bytes)
        assert 1 <= chunks.num_chunks <= 64
        assert (chunks.num_chunks - 1) * chunks.chunk_bytes < space_bytes <= chunks.num_chunks * chunks.chunk_bytes
    assert ChunkMap(64 << 30).chunk_bytes == 1 << 30


def test_usable_pages_are_exactly_those_whose_every_byte_lies_in_the_owners_chunks(rng):
    """With random owners over the chunks and random page sizes up to a chunk, the pages an owner
    may use (the union of usable_pages over its chunks) are exactly the pages, below num_pages,
    whose every chunk it owns: so pages of different owners never share a byte."""
    for _ in range(200):
        chunk_bytes = rng.choice((4096, 10_000, 65_536))
        space_bytes = rng.randrange(chunk_bytes, 12 * chunk_bytes)
        chunks = ChunkMap(space_bytes, chunk_bytes)
        chunks.owner = [rng.choice((None, 1, 2)) for _ in range(chunks.num_chunks)]
        intervals = []
        for owner in (1, 2):
            bytes_per_page = rng.randrange(1, chunk_bytes + 1)
            num_pages = min(space_bytes // bytes_per_page, rng.randrange(1, 2 * space_bytes // bytes_per_page + 2))
            expected = {page for page in range(num_pages)
                        if all(chunks.owner[c] == owner for c in chunks.chunks_of_page(page, bytes_per_page))}
            got = chunks.page_ids_of(owner, bytes_per_page, num_pages)
            assert got == expected, (chunk_bytes, space_bytes, bytes_per_page, chunks.owner, owner)
            intervals += [(page * bytes_per_page, (page + 1) * bytes_per_page) for page in got]
            for chunk in chunks.owned_by(owner):       # each chunk's pages: one contiguous range
                pages = chunks.usable_pages(chunk, owner, bytes_per_page, num_pages)
                assert set(pages) <= expected
        intervals.sort()
        assert all(end <= next_start for (_, end), (next_start, _) in zip(intervals, intervals[1:]))


def test_one_owner_of_every_chunk_uses_every_page_of_the_space():
    """An owner of all chunks may use all space_bytes // bytes_per_page pages, those across chunk
    boundaries included."""
    chunks = ChunkMap(10 * 65_536, 65_536)
    chunks.owner = [7] * chunks.num_chunks
    for bytes_per_page in (4096, 24_576, 65_536, 50_000):
        assert chunks.page_ids_of(7, bytes_per_page, 10 * 65_536 // bytes_per_page) == set(
            range(10 * 65_536 // bytes_per_page))
