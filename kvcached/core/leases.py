"""Sessions and leases: who holds which pages.

A lease is the only way an engine holds daemon pages: it locks the tree path of an acquire's hit
(so those L2 pages are never evicted or reused while the engine reads them) and owns the private
pages reserved for the request's saves. It ends exactly once, by release, by commit, or by
reclaim when its session ends; the legal transitions live in ``_LEGAL_TRANSITIONS`` and nowhere
else. The private pages of a lease reclaimed while its process may still be alive go to a
``Quarantine``, not back to the allocator (see "Fencing" in docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from kvcached.core.tree import TreeNode
from proto.procfs import ProcessIdentity


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
    generation: int = 0               # the write generation its writer stamps on its pages (0: none reserved)

    def transition(self, new_state: LeaseState) -> None:
        if new_state not in _LEGAL_TRANSITIONS[self.state]:
            raise IllegalTransition(f"lease {self.lease_id}: {self.state.value} -> {new_state.value}")
        self.state = new_state


@dataclasses.dataclass(eq=False)
class Session:
    session_id: int
    namespace_id: int
    identity: ProcessIdentity         # the engine's process, as it said at attach
    client_name: str
    attached_at: float
    last_seen: float
    lease_ids: set[int] = dataclasses.field(default_factory=set)
    report: dict = dataclasses.field(default_factory=dict)      # the engine's last ENGINE_REPORT
    pid_watched: bool = False         # the daemon sees this process exit (a pidfd); else heartbeats only


@dataclasses.dataclass(eq=False)
class Quarantine:
    """Pages an ended session's process may still be writing (its backup DMAs): neither free nor
    allocatable until that process is seen gone, re-attaches naming the session as ended, or, when
    its process cannot be watched, ``session_grace_s`` after the session's last sign of life."""

    session: Session                  # the ended session, with its last_seen and process identity
    page_ids: list[int]
    reason: str                       # why the session ended
