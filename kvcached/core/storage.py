"""L3 slot arithmetic: where a slot lives in the file, and which page copies merge into one I/O.

Pure logic, no I/O. The L3 file holds, per namespace, a region of fixed slots of
`bytes_per_page` bytes each; slot allocation belongs to the page allocator, this module only
turns slot ids into byte offsets and (source, destination) page maps into extents.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import NamedTuple, Sequence


class Extent(NamedTuple):
    """`num_pages` pages copied from `src_start + i` to `dst_start + i`, for i in range(num_pages)."""

    src_start: int
    dst_start: int
    num_pages: int


def coalesce_extents(src_page_ids: Sequence[int], dst_page_ids: Sequence[int]) -> list[Extent]:
    """Merge the page map `src_page_ids[i] -> dst_page_ids[i]` into runs.

    A run grows only while BOTH ids step by exactly +1, so every extent is one contiguous
    byte range on each side and can be moved with one system call. The order of the map is
    kept: extents come out in the order of their first pair. Ids may be any integer type
    (Python int, numpy integer); a float raises TypeError.
    """
    if len(src_page_ids) != len(dst_page_ids):
        raise ValueError(
            f"page maps differ in length: {len(src_page_ids)} source ids, "
            f"{len(dst_page_ids)} destination ids"
        )
    extents: list[Extent] = []
    run_src = run_dst = run_len = 0
    for index, (src_id, dst_id) in enumerate(zip(src_page_ids, dst_page_ids)):
        src_id = operator.index(src_id)
        dst_id = operator.index(dst_id)
        if src_id < 0 or dst_id < 0:
            raise ValueError(f"negative page id at position {index}: source {src_id}, destination {dst_id}")
        if run_len and src_id == run_src + run_len and dst_id == run_dst + run_len:
            run_len += 1
            continue
        if run_len:
            extents.append(Extent(run_src, run_dst, run_len))
        run_src, run_dst, run_len = src_id, dst_id, 1
    if run_len:
        extents.append(Extent(run_src, run_dst, run_len))
    return extents


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """One namespace's view of the L3 file: `num_slots` slots of `bytes_per_page` bytes each, slot s
    at byte s * bytes_per_page (slot ids are absolute: a namespace's chunks span the whole file)."""

    bytes_per_page: int
    num_slots: int

    def __post_init__(self) -> None:
        for name in ("bytes_per_page", "num_slots"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"SlotLayout.{name} must be an int, got {type(value).__name__}")
        if self.bytes_per_page <= 0:
            raise ValueError(f"bytes_per_page must be > 0, got {self.bytes_per_page}")
        if self.num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {self.num_slots}")

    @property
    def size_bytes(self) -> int:
        return self.num_slots * self.bytes_per_page

    def offset(self, slot: int) -> int:
        """Byte offset of `slot` in the file."""
        slot = operator.index(slot)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")
        return slot * self.bytes_per_page
