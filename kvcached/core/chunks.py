"""One tier's space (the L2 segment, the L3 file) as fixed-size chunks, each owned by at most one
namespace. Pure arithmetic and ownership, no I/O.

Page ids are absolute: page p of a geometry of ``bytes_per_page`` b lies at bytes [p*b, (p+1)*b)
of the space, whichever namespace holds it. So an engine addresses its pages with one base (0)
and one stride, as it always did, and consecutive ids are one contiguous byte range (one DMA, one
pwrite). A namespace may use page p only while it owns every chunk that p overlaps: one chunk, or
two for a page across a chunk boundary (a page is never larger than a chunk, so never three). Its
pages are carved from its chunks; a page across the boundary between two owners is nobody's.
Invariant: the bytes of every page a namespace may use lie in chunks it owns, so pages of
different namespaces never share a byte, whatever their sizes.
"""

from __future__ import annotations

# A space is cut into about TARGET_NUM_CHUNKS chunks, a multiple of CHUNK_ALIGN_BYTES each: space
# moves between namespaces in steps of a few per cent of the pool (rarely, and each move walks
# the giving namespace's tree once), and a chunk of a pool of a few GiB holds many pages of any
# geometry (what straddles the boundary between two owners is lost). A page larger than a chunk
# is refused (the daemon says which --l2-size would serve it).
TARGET_NUM_CHUNKS = 64
CHUNK_ALIGN_BYTES = 2 << 20


def chunk_bytes_for(space_bytes: int) -> int:
    """The chunk size of a space: 1/64 of it, rounded up to a multiple of 2 MiB."""
    per_chunk = -(-space_bytes // TARGET_NUM_CHUNKS)
    return max(1, -(-per_chunk // CHUNK_ALIGN_BYTES)) * CHUNK_ALIGN_BYTES


class ChunkMap:
    """Which namespace owns each chunk of one space. The last chunk may be shorter than the rest."""

    def __init__(self, space_bytes: int, chunk_bytes: int | None = None):
        if space_bytes < 1:
            raise ValueError(f"space_bytes must be positive, got {space_bytes}")
        self.space_bytes = space_bytes
        self.chunk_bytes = chunk_bytes if chunk_bytes is not None else chunk_bytes_for(space_bytes)
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        self.num_chunks = -(-space_bytes // self.chunk_bytes)
        self.owner: list[int | None] = [None] * self.num_chunks

    def owned_by(self, owner: int) -> list[int]:
        return [chunk for chunk, holder in enumerate(self.owner) if holder == owner]

    def free_chunks(self) -> list[int]:
        if None not in self.owner:      # the usual case once the pool is handed out: a C-level scan
            return []
        return [chunk for chunk, holder in enumerate(self.owner) if holder is None]

    def chunks_of_page(self, page: int, bytes_per_page: int) -> range:
        """The chunks page ``page`` overlaps (one or two)."""
        first = page * bytes_per_page // self.chunk_bytes
        last = ((page + 1) * bytes_per_page - 1) // self.chunk_bytes
        return range(first, last + 1)

    def usable_pages(self, chunk: int, owner: int, bytes_per_page: int, num_pages: int) -> range:
        """The pages (ids below ``num_pages``) that ``owner`` may use in ``chunk`` once it owns it:
        those overlapping the chunk whose other chunk, if any, ``owner`` owns too. A contiguous
        range: only its first and last page can reach into a neighbour."""
        assert 0 < bytes_per_page <= self.chunk_bytes, (bytes_per_page, self.chunk_bytes)
        start = chunk * self.chunk_bytes
        end = min(start + self.chunk_bytes, self.space_bytes)
        first = start // bytes_per_page
        stop = min(num_pages, -(-end // bytes_per_page))
        if first * bytes_per_page < start and self.owner[chunk - 1] != owner:
            first += 1
        if stop > first and stop * bytes_per_page > end and self.owner[chunk + 1] != owner:
            stop -= 1
        return range(first, max(first, stop))

    def page_ids_of(self, owner: int, bytes_per_page: int, num_pages: int) -> set[int]:
        """Every page ``owner`` may use now (for integrity checks)."""
        page_ids: set[int] = set()
        for chunk in self.owned_by(owner):
            page_ids.update(self.usable_pages(chunk, owner, bytes_per_page, num_pages))
        return page_ids
