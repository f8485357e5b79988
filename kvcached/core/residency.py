"""Peer restores, the daemon's side: which engines registered their KV tensors for others to copy
blocks from, and who may open whose. What each engine's GPU cache holds is kept in its namespace's
tree (``PrefixTree.peer_put``, keyed by the registration's ``peer_id``).

The daemon relays what an owner registered (its storages' handles and its tensors' shapes) and
what it published (block ids and epochs), and never interprets the handles: a reader opens them,
checks what it opened against its own layout, and checks every block it copies against the
block's live epoch in the owner's epoch file (docs/architecture.md, "Peer restores"). So a wrong
or stale record costs a reader a failed copy, never wrong bytes. No I/O here: the server makes
each registration's epoch file and closes it when the registration ends.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import Any

from proto.schema import PeerRegister

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class PeerExport:
    """One engine's registration, for the life of its session."""

    peer_id: int                  # random: readers name the owner by it (a session id is a capability)
    session_id: int
    namespace_id: int
    request: PeerRegister
    pid: int
    pid_namespace_id: int
    process_start_time: int
    epochs_path: str = ""         # set once the server has made the file (ready)
    epochs_offset_bytes: int = 0

    @property
    def ready(self) -> bool:
        return bool(self.epochs_path)

    def can_read(self, other: "PeerExport") -> bool:
        """Whether this engine may copy out of ``other``'s tensors: another engine of the namespace,
        on the same device, whose process it can see (its liveness is checked after each copy)."""
        return (other is not self and other.ready and other.namespace_id == self.namespace_id
                and other.request.transport == self.request.transport
                and other.request.device_id == self.request.device_id
                and other.pid_namespace_id != 0 and other.pid_namespace_id == self.pid_namespace_id)

    def to_wire(self) -> dict[str, Any]:
        request = self.request
        return {"peer_id": self.peer_id, "transport": request.transport, "device_id": request.device_id,
                "layout": request.layout, "dtype": request.dtype, "num_blocks": request.num_blocks,
                "storages": request.storages, "tensors": [t.to_wire() for t in request.tensors],
                "epochs_path": self.epochs_path, "epochs_offset_bytes": self.epochs_offset_bytes,
                "pid": self.pid, "pid_namespace_id": self.pid_namespace_id,
                "process_start_time": self.process_start_time}


class PeerRegistry:
    """Registrations by session and by peer id (at most one per session)."""

    def __init__(self) -> None:
        self.by_session: dict[int, PeerExport] = {}
        self.by_peer_id: dict[int, PeerExport] = {}

    def add(self, session_id: int, namespace_id: int, request: PeerRegister, pid: int, pid_namespace_id: int,
            process_start_time: int) -> PeerExport:
        assert session_id not in self.by_session, "one registration per session"
        peer_id = secrets.randbits(62) + 1
        while peer_id in self.by_peer_id:
            peer_id = secrets.randbits(62) + 1
        export = PeerExport(peer_id, session_id, namespace_id, request, pid, pid_namespace_id, process_start_time)
        self.by_session[session_id] = export
        self.by_peer_id[peer_id] = export
        return export

    def remove(self, session_id: int) -> PeerExport | None:
        export = self.by_session.pop(session_id, None)
        if export is not None:
            del self.by_peer_id[export.peer_id]
        return export

    def readable_by(self, reader: PeerExport) -> list[PeerExport]:
        return [export for export in self.by_peer_id.values() if reader.can_read(export)]
