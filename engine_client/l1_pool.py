"""The engine's L1 KV pool: the attention-layout tensor and an allocator for its pages.

Layout: `kv[kv_index, layer, page, token_in_page, kv_head, head_dim]` with kv_index 0 = K, 1 = V.
This is the attention kernel's layout and is never changed; transfers to and from the page-major
L2 pool repack pages on the way (engine_client/kv_transfer.py, through the connector's "pool" layout).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch

from engine_client.dtypes import torch_dtype
from proto.messages import KVGeometry


class L1Pool:
    """An L1 KV tensor of `num_pages` pages plus a free-page allocator.

    The allocator hands out page ids; it knows nothing about what the pages hold (that is the L1
    prefix index's job). Pages come back in ascending id order from a fresh pool, which keeps
    early allocations dense and makes tests easy to read; nothing relies on it.
    """

    def __init__(self, geometry: KVGeometry, num_pages: int, device: str | torch.device = "cpu"):
        if type(num_pages) is not int or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.geometry = geometry
        self.num_pages = num_pages
        self.dtype = torch_dtype(geometry.dtype)
        # torch.empty: the engine writes every page before attention reads it, and restores
        # overwrite whole pages, so initialising gigabytes of HBM would be wasted time.
        self.kv = torch.empty(
            (2, geometry.num_layers, num_pages, geometry.page_size, geometry.num_kv_heads, geometry.head_dim),
            dtype=self.dtype,
            device=device,
        )
        # A stack whose top is the lowest id, so a fresh pool allocates 0, 1, 2, ...
        self._free_page_ids: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free: list[bool] = [True] * num_pages

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def bytes_per_page(self) -> int:
        return self.geometry.bytes_per_page

    @property
    def num_free(self) -> int:
        return len(self._free_page_ids)

    def can_allocate(self, num_pages: int) -> bool:
        _check_count(num_pages)
        return num_pages <= len(self._free_page_ids)

    def allocate(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` free pages, or return None (and take nothing) if there are not enough."""
        if not self.can_allocate(num_pages):
            return None
        page_ids = [self._free_page_ids.pop() for _ in range(num_pages)]
        for page_id in page_ids:
            self._is_free[page_id] = False
        return page_ids

    def free(self, page_ids: Iterable[int]) -> None:
        """Return pages to the pool; raises ValueError and frees nothing if any id is bad."""
        page_ids = [operator.index(page_id) for page_id in page_ids]
        seen: set[int] = set()
        for page_id in page_ids:
            if not 0 <= page_id < self.num_pages:
                raise ValueError(f"L1 page id {page_id!r} is out of range 0..{self.num_pages - 1}")
            if self._is_free[page_id] or page_id in seen:
                raise ValueError(f"L1 page {page_id} is already free (double free)")
            seen.add(page_id)
        for page_id in page_ids:
            self._is_free[page_id] = True
            self._free_page_ids.append(page_id)

    def is_free(self, page_id: int) -> bool:
        page_id = operator.index(page_id)
        if not 0 <= page_id < self.num_pages:
            raise ValueError(f"L1 page id {page_id!r} is out of range 0..{self.num_pages - 1}")
        return self._is_free[page_id]

    def check_integrity(self) -> None:
        """The free stack and the free flags describe the same set, with no id twice."""
        expected_shape = (2, self.geometry.num_layers, self.num_pages, self.geometry.page_size,
                          self.geometry.num_kv_heads, self.geometry.head_dim)
        assert tuple(self.kv.shape) == expected_shape, (tuple(self.kv.shape), expected_shape)
        assert self.kv.dtype == self.dtype
        free_set = set(self._free_page_ids)
        assert len(free_set) == len(self._free_page_ids), "a page id is on the free stack twice"
        assert all(0 <= page_id < self.num_pages for page_id in free_set), "free page id out of range"
        flagged = {page_id for page_id, is_free in enumerate(self._is_free) if is_free}
        assert flagged == free_set, "free flags disagree with the free stack"


def _check_count(num_pages: int) -> None:
    if type(num_pages) is not int or num_pages < 0:
        raise ValueError(f"page count must be a non-negative integer, got {num_pages!r}")
