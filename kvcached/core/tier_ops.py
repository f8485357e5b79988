"""Pending moves between the daemon's tiers, as explicit state machines.

    write-through (H2S):  L2 -> H2S_PENDING -> L2+L3
    promotion     (S2H):  L3 -> S2H_PENDING -> L2+L3
    remote restore (R2H): the remote store -> R2H_PENDING -> L2 (``remote``: no source pages)

A pending op locks its source (the tree node whose pages it reads, in the source tier) and the
resident prefix it will be inserted below, and owns private destination pages/slots. It ends
exactly once: PUBLISHED (destination pages now belong to the tree) or FAILED (private pages go
back to the allocator). The legal transitions are listed here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from kvcached.core.tiers import Tier
from kvcached.core.tree import TreeNode


class OpState(enum.Enum):
    PENDING = "pending"
    PUBLISHED = "published"
    FAILED = "failed"


_LEGAL_TRANSITIONS = {
    OpState.PENDING: frozenset({OpState.PUBLISHED, OpState.FAILED}),
    OpState.PUBLISHED: frozenset(),
    OpState.FAILED: frozenset(),
}


class IllegalOpTransition(Exception):
    pass


@dataclasses.dataclass(eq=False)
class TierMove:
    """Copy pages [start_page, start_page + n) of a path from ``source`` to ``destination`` tier."""

    op_id: int
    namespace_id: int
    source: Tier
    destination: Tier
    token_ids: Any                       # np.ndarray[int32]: the path, up to start_page + n pages
    start_page: int
    source_page_ids: list[int]           # in the source tier, locked through source_node
    private_page_ids: list[int]          # reserved in the destination tier
    locks: list[tuple[TreeNode, Tier]]   # released when the op ends
    state: OpState = OpState.PENDING
    # With a persistent L3 index, set by the I/O layer before the move is finished: the crc32 of
    # each page as written (h2s) or as read (s2h), and (h2s) the chained keys of pages
    # 0..start_page + n - 1 of the path.
    page_checksums: list[int] = dataclasses.field(default_factory=list)
    page_keys: list[bytes] = dataclasses.field(default_factory=list)
    num_published_pages: int = 0         # s2h: the leading pages whose checksums matched (all without an index)
    decision: Any = None                 # s2h for an acquire: the cost model's decision that asked for it
    source_generations: list[int] = dataclasses.field(default_factory=list)   # h2s: the L2 pages' published ones
    remote: bool = False                 # r2h: the pages come from the remote store (no source pages)
    # r2h, set by the I/O layer before the move is finished: the leading pages whose values held
    # their header and checksum, and why the next one did not ("": they all did, or none was read)
    num_verified_pages: int = 0
    mismatch: str = ""

    @property
    def direction(self) -> str:
        return "r2h" if self.remote else "h2s" if self.destination is Tier.L3 else "s2h"

    def transition(self, new_state: OpState) -> None:
        if new_state not in _LEGAL_TRANSITIONS[self.state]:
            raise IllegalOpTransition(f"op {self.op_id}: {self.state.value} -> {new_state.value}")
        self.state = new_state
