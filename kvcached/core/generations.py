"""The write generation of each L2 page (``proto/generations.py``): the words engines share, and
the generation the daemon published for each page it holds in the tree.

The daemon hands a page to a writer with the writer's generation marked reserved, revokes it
(0) when the writer's lease ends unwritten, stamps its own writes (L3 -> L2), and tells readers
the generation each hit page was published with; a reader trusts a page only while its word
still holds that generation (docs/architecture.md, "Fencing"). No I/O here: the I/O layer gives
the shared words (a file engines map), tests a private array.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from proto import generations


class GenerationFiles(Protocol):
    def create(self, namespace_id: int, num_pages: int) -> tuple[str, np.ndarray]:
        """The shared words of a new namespace (u64 per page, zeroed) and the path engines map."""

    def close(self, namespace_id: int) -> None:
        """The namespace is gone: its words are no longer needed."""


class PrivateGenerations:
    """Words nobody else maps (a daemon state tested without a server)."""

    def create(self, namespace_id: int, num_pages: int) -> tuple[str, np.ndarray]:
        return "", np.zeros(num_pages, dtype=np.uint64)

    def close(self, namespace_id: int) -> None:
        pass


class PageGenerations:
    """One namespace's words (``shared``) and, per page the tree holds, its published generation."""

    def __init__(self, path: str, shared: np.ndarray):
        self.path = path
        self.shared = shared
        self.published = np.zeros(len(shared), dtype=np.uint64)

    def reserve(self, page_ids, generation: int) -> None:
        """Pages handed to a writer of ``generation``: before the reply that names them."""
        self.shared[np.asarray(page_ids, dtype=np.int64)] = generations.reserved(generation)

    def revoke(self, page_ids) -> None:
        """Pages whose bytes may change, or whose writer's lease ended: no reader trusts them, no
        writer of an ended lease claims them."""
        self.shared[np.asarray(page_ids, dtype=np.int64)] = 0

    def publish(self, page_ids, generation: int) -> None:
        """Pages the tree now holds, written under ``generation`` (stamped by their writer)."""
        self.published[np.asarray(page_ids, dtype=np.int64)] = generation

    def stamp(self, page_ids, generation: int) -> None:
        """The daemon's own writes are complete: stamped and published."""
        page_ids = np.asarray(page_ids, dtype=np.int64)
        self.shared[page_ids] = generation
        self.published[page_ids] = generation

    def published_of(self, page_ids) -> list[int]:
        return self.published[np.asarray(page_ids, dtype=np.int64)].tolist()

    def num_leading_intact(self, page_ids, expected: list[int] | None = None) -> int:
        """How many leading pages still hold the generation they were published with (or the
        given ``expected`` ones, read before a copy)."""
        page_ids = np.asarray(page_ids, dtype=np.int64)
        want = self.published[page_ids] if expected is None else np.asarray(expected, dtype=np.uint64)
        bad = np.flatnonzero((self.shared[page_ids] != want) | (want == 0))
        return int(bad[0]) if len(bad) else len(page_ids)

    def close_all(self) -> None:
        """The namespace is dropped: every page revoked before its words go."""
        self.shared[:] = 0
