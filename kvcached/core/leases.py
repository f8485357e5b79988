"""Sessions and leases: who holds which pages.

A lease is the only way an engine holds daemon pages: it locks the tree path of a match (so
those L2 pages are never evicted or reused while the engine reads them) and owns the private
pages reserved for a backup. A standing lease (``KVCacheClient.reserve_pages``) holds only
private pages, with no prefix: the engine writes backups into them before telling the daemon
which prefix they hold, and each commit takes the pages it names out of the lease. It ends exactly once, by release, by commit, or by reclaim when
its session dies; the legal transitions live in ``_LEGAL_TRANSITIONS`` and nowhere else.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from kvcached.core.tree import TreeNode


class LeaseState(enum.Enum):
    ACTIVE = "active"
    RELEASED = "released"
    COMMITTED = "committed"
    RECLAIMED = "reclaimed"


_LEGAL_TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    LeaseState.ACTIVE: frozenset({LeaseState.RELEASED, LeaseState.COMMITTED, LeaseState.RECLAIMED}),
    LeaseState.RELEASED: frozenset(),
    LeaseState.COMMITTED: frozenset(),
    LeaseState.RECLAIMED: frozenset(),
}


class IllegalTransition(Exception):
    pass


@dataclasses.dataclass(eq=False)
class Lease:
    lease_id: int
    session_id: int
    namespace_id: int
    token_ids: Any                    # np.ndarray[int32], page-aligned, up to the end of the reservation
    locked_node: TreeNode | None      # deepest L2 node of the matched prefix, locked while the lease lives
    hit_pages: int                    # pages of the matched L2 prefix
    private_page_ids: list[int]       # reserved for a backup of pages [hit_pages, hit_pages + len)
    state: LeaseState = LeaseState.ACTIVE
    standing: bool = False            # pages reserved ahead, for any prefix (token_ids is empty)

    def transition(self, new_state: LeaseState) -> None:
        if new_state not in _LEGAL_TRANSITIONS[self.state]:
            raise IllegalTransition(f"lease {self.lease_id}: {self.state.value} -> {new_state.value}")
        self.state = new_state


@dataclasses.dataclass(eq=False)
class Session:
    session_id: int
    namespace_id: int
    pid: int
    client_name: str
    attached_at: float
    last_seen: float
    lease_ids: set[int] = dataclasses.field(default_factory=set)
    report: dict = dataclasses.field(default_factory=dict)      # the engine's last ENGINE_REPORT
