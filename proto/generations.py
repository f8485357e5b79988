"""The write generations of one namespace's L2 pages: the shared memory every engine of the
namespace maps beside the L2 segment, so that a reader can tell whether a page still holds the
bytes the daemon published for it (docs/architecture.md, "Fencing").

The daemon creates one file per namespace (``O_EXCL|O_NOFOLLOW``, mode 0600, in the shared-memory
directory, named after the segment) and names it in ``AttachInfo.generations_path``. Layout: one
little-endian u64 per L2 page id of the namespace, from byte 0. A word is

    g                 (0 < g < RESERVED) the page's bytes are complete, written under generation g
    RESERVED | g      reserved for a writer of generation g, not written yet (the daemon stores it
                      when it hands the page out); the writer claims the page only from this value
    0                 being written, or revoked: no reader may trust the page

Generations come from one counter of the daemon that only grows, never 0: a value, once replaced,
never comes back. Every access is an aligned 8-byte load or store (single-copy atomic on x86-64).
"""

from __future__ import annotations

RESERVED = 1 << 63
WORD_BYTES = 8


def reserved(generation: int) -> int:
    """The word of a page handed to a writer of ``generation`` that has not claimed it yet."""
    return RESERVED | generation


def file_bytes(num_pages: int) -> int:
    return WORD_BYTES * num_pages
