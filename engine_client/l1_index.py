"""The engine's own L1 prefix index: which page-aligned token prefixes its L1 pages hold.

Design note. Page i of a token sequence is keyed by its page key (`proto/page_keys.py`), a chained
digest of its whole prefix. Equal keys mean equal prefixes, so a flat dict is a radix tree with
page-sized edges whose parent links are `key(i) -> key(i-1)`. Each entry keeps
its parent key and a child count, so "is a leaf" is O(1).

LRU order is one OrderedDict, oldest first. Every touch moves a whole root path to the end,
leaf first, so a parent is always more recently used than each of its children. Scanning from the
oldest end therefore meets children before their parents, and one pass evicts a chain bottom-up.

Locks are reference counts by L1 page id. A locked page is never evicted, and neither are its
ancestors, because they have a cached child.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from proto.page_keys import KEY_BYTES, chain_page_keys, iter_page_keys
from proto.tokens import token_array


class L1Match(NamedTuple):
    num_tokens: int          # a multiple of page_size
    page_ids: list[int]      # L1 page ids of pages 0 .. num_tokens // page_size - 1


@dataclasses.dataclass(slots=True)
class _Entry:
    page_id: int
    parent_key: bytes | None     # None for page 0 of a sequence
    num_children: int = 0
    ref_count: int = 0


class L1PrefixIndex:
    """Maps page-aligned token prefixes to the L1 pages that hold them."""

    def __init__(self, page_size: int):
        if type(page_size) is not int or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        self.page_size = page_size
        self._key_to_entry: OrderedDict[bytes, _Entry] = OrderedDict()   # LRU order, oldest first
        self._page_id_to_key: dict[int, bytes] = {}

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        return len(self._key_to_entry)

    def contains_page(self, page_id: int) -> bool:
        return operator.index(page_id) in self._page_id_to_key

    def ref_count(self, page_id: int) -> int:
        return self._entry_for_page_id(operator.index(page_id)).ref_count

    def num_evictable_pages(self) -> int:
        """How many pages `evict` could free now: those with no locked page at or below them."""
        protected: set[bytes] = set()
        for key, entry in self._key_to_entry.items():
            if entry.ref_count == 0:
                continue
            # Walk up until we meet a path already marked; everything above it is marked too.
            current: bytes | None = key
            while current is not None and current not in protected:
                protected.add(current)
                current = self._key_to_entry[current].parent_key
        return len(self._key_to_entry) - len(protected)

    def match(self, token_ids: Sequence[int] | np.ndarray) -> L1Match:
        """The longest cached page-aligned prefix of `token_ids`; marks it most recently used."""
        keys: list[bytes] = []
        for key in iter_page_keys(token_ids, self.page_size):
            if key not in self._key_to_entry:
                break
            keys.append(key)
        self._touch_path(keys)
        page_ids = [self._key_to_entry[key].page_id for key in keys]
        return L1Match(len(keys) * self.page_size, page_ids)

    # ---- updates -------------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int] | np.ndarray, page_ids: Sequence[int],
               start_page: int = 0) -> list[int]:
        """Cache `page_ids` as pages start_page, start_page+1, ... of `token_ids`.

        Pages 0 .. start_page-1 must already be cached (ValueError otherwise). A page that is
        already cached keeps its existing L1 page; the caller's id for it is returned so that the
        caller can free it. Raises ValueError and changes nothing on bad input.
        """
        start_page = operator.index(start_page)
        if start_page < 0:
            raise ValueError(f"start_page must be >= 0, got {start_page}")
        page_ids = [operator.index(page_id) for page_id in page_ids]
        tokens = token_array(token_ids)
        end_page = start_page + len(page_ids)
        if end_page * self.page_size > len(tokens):
            raise ValueError(
                f"pages {start_page}..{end_page - 1} need {end_page * self.page_size} tokens, "
                f"got {len(tokens)}")
        if len(set(page_ids)) != len(page_ids):
            raise ValueError(f"page_ids contains duplicates: {page_ids}")
        for page_id in page_ids:
            if page_id < 0:
                raise ValueError(f"L1 page id must be >= 0, got {page_id}")

        keys = chain_page_keys(tokens, self.page_size, end_page)
        for page_index in range(start_page):
            if keys[page_index] not in self._key_to_entry:
                raise ValueError(
                    f"prefix page {page_index} is not cached; insert from start_page={page_index} or earlier")
        for page_index, page_id in enumerate(page_ids, start=start_page):
            owner_key = self._page_id_to_key.get(page_id)
            if owner_key is not None and owner_key != keys[page_index]:
                raise ValueError(f"L1 page {page_id} is already cached for a different prefix")

        duplicate_page_ids: list[int] = []
        for page_index, page_id in enumerate(page_ids, start=start_page):
            key = keys[page_index]
            existing = self._key_to_entry.get(key)
            if existing is not None:
                if existing.page_id != page_id:
                    duplicate_page_ids.append(page_id)
                continue
            parent_key = keys[page_index - 1] if page_index > 0 else None
            if parent_key is not None:
                self._key_to_entry[parent_key].num_children += 1
            self._key_to_entry[key] = _Entry(page_id=page_id, parent_key=parent_key)
            self._page_id_to_key[page_id] = key
        # New entries were appended root-first; re-touching the path restores "parents are newer".
        self._touch_path(keys)
        return duplicate_page_ids

    def lock(self, page_ids: Iterable[int]) -> None:
        """Add one reference to each page (an id listed twice gets two); locked pages are never evicted."""
        entries = [self._entry_for_page_id(operator.index(page_id)) for page_id in page_ids]
        for entry in entries:
            entry.ref_count += 1

    def unlock(self, page_ids: Iterable[int]) -> None:
        """Drop one reference per listed id; ValueError and no change if any would go below zero."""
        counts = Counter(operator.index(page_id) for page_id in page_ids)
        for page_id, count in counts.items():
            entry = self._entry_for_page_id(page_id)
            if entry.ref_count < count:
                raise ValueError(
                    f"L1 page {page_id} has {entry.ref_count} lock(s), cannot unlock {count}")
        for page_id, count in counts.items():
            self._entry_for_page_id(page_id).ref_count -= count

    def evict(self, num_pages: int) -> list[int]:
        """Drop up to `num_pages` least recently used unlocked leaf pages; returns their L1 ids.

        Evicting a leaf can make its parent a leaf, which is then evicted in the same call if it is
        still needed. Cost: one scan from the oldest entry to the last victim.
        """
        num_pages = operator.index(num_pages)
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        victim_keys: list[bytes] = []
        for key, entry in self._key_to_entry.items():
            if len(victim_keys) >= num_pages:
                break
            if entry.num_children == 0 and entry.ref_count == 0:
                victim_keys.append(key)
                # Only counts change while iterating; the dict itself changes after the loop.
                if entry.parent_key is not None:
                    self._key_to_entry[entry.parent_key].num_children -= 1
        evicted_page_ids: list[int] = []
        for key in victim_keys:
            entry = self._key_to_entry.pop(key)
            del self._page_id_to_key[entry.page_id]
            evicted_page_ids.append(entry.page_id)
        return evicted_page_ids

    # ---- integrity -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """No holes, one key per page id, refcounts >= 0, child counts and LRU order consistent."""
        assert len(self._page_id_to_key) == len(self._key_to_entry), "page id map and entries differ in size"
        position = {key: index for index, key in enumerate(self._key_to_entry)}
        num_children: Counter[bytes] = Counter()
        for key, entry in self._key_to_entry.items():
            assert len(key) == KEY_BYTES
            assert entry.page_id >= 0, f"negative page id {entry.page_id}"
            assert self._page_id_to_key.get(entry.page_id) == key, f"L1 page {entry.page_id} mapped twice"
            assert entry.ref_count >= 0, f"L1 page {entry.page_id} has ref_count {entry.ref_count}"
            if entry.parent_key is not None:
                assert entry.parent_key in self._key_to_entry, f"L1 page {entry.page_id} has no cached parent"
                assert position[entry.parent_key] > position[key], "a parent is older than its child in LRU order"
                num_children[entry.parent_key] += 1
        for key, entry in self._key_to_entry.items():
            assert entry.num_children == num_children[key], (
                f"L1 page {entry.page_id} counts {entry.num_children} children, has {num_children[key]}")

    # ---- helpers -------------------------------------------------------------------------------

    def _touch_path(self, root_path_keys: list[bytes]) -> None:
        for key in reversed(root_path_keys):
            self._key_to_entry.move_to_end(key)

    def _entry_for_page_id(self, page_id: int) -> _Entry:
        key = self._page_id_to_key.get(page_id)
        if key is None:
            raise ValueError(f"L1 page {page_id} is not in the prefix index")
        return self._key_to_entry[key]

