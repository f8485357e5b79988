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
from typing import Any, Callable

import numpy as np

from kvcached.core import counters
from kvcached.core.hints import AdmissionHints
from kvcached.core.leases import Session
from kvcached.core.metrics import Metrics
from kvcached.core.namespaces import Namespace
from proto.errors import ErrorCode, ProtocolError
from proto.schema import PeerPublish, PeerRegister

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
    """Registrations by session and by peer id (at most one per session), and what each published
    into its namespace's tree."""

    def __init__(self, namespaces: dict[int, Namespace], metrics: Metrics, hints: AdmissionHints,
                 end_sink: Callable[[PeerExport], None] | None = None) -> None:
        """``namespaces``: the daemon's; ``hints``: where each namespace's count of registrations is
        published; ``end_sink``: called with each registration that ends (the I/O layer closes its
        epoch file)."""
        self.by_session: dict[int, PeerExport] = {}
        self.by_peer_id: dict[int, PeerExport] = {}
        self._namespaces = namespaces
        self.metrics = metrics
        self._hints = hints
        self._end_sink = end_sink

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

    def register(self, session: Session, request: PeerRegister) -> PeerExport:
        """Register the session's KV tensors for engines of its namespace to copy blocks from. Not
        listed until ``peer_ready`` names its epoch file (the I/O layer makes it)."""
        session_id = session.session_id
        if session_id in self.by_session:
            raise ProtocolError(ErrorCode.BAD_FRAME, "this session has registered its KV tensors already")
        export = self.add(session_id, session.namespace_id, request, session.pid, session.pid_namespace_id,
                       session.process_start_time)
        self.metrics.add(counters.PEER_REGISTRATIONS)
        self._publish_count(session.namespace_id)
        logger.info("session %x: KV tensors registered for peer restores (%s %s, %d blocks)", session_id,
                    request.transport, request.device_id, request.num_blocks)
        return export

    def end(self, session_id: int, notify: bool = True) -> None:
        """The session's registration ends (its blocks are forgotten); ``notify``: the end sink is told."""
        export = self.remove(session_id)
        if export is None:
            return
        namespace = self._namespaces.get(export.namespace_id)
        if namespace is not None:
            self.metrics.add(counters.PEER_BLOCKS_FORGOTTEN, namespace.tree.peer_drop(export.peer_id))
        self.metrics.add(counters.PEER_REGISTRATIONS_ENDED)
        self._publish_count(export.namespace_id)
        if notify and self._end_sink is not None:
            self._end_sink(export)

    def _publish_count(self, namespace_id: int) -> None:
        namespace = self._namespaces.get(namespace_id)
        if namespace is not None:
            self._hints.set_peers(namespace.hints_slot, sum(export.namespace_id == namespace_id
                                                           for export in self.by_session.values()))

    def publish(self, session_id: int, request: PeerPublish) -> None:
        """What entered and left the session's GPU cache: removals first, then each run."""
        export = self.by_session.get(session_id)
        if export is None:
            raise ProtocolError(ErrorCode.NOT_ATTACHED, "this session has not registered its KV tensors "
                                "(PEER_REGISTER) or its registration ended")
        num_blocks = export.request.num_blocks
        names = list(request.removed) + [b for run in request.runs for b in run.block_ids]
        if names and max(names) >= num_blocks:
            raise ProtocolError(ErrorCode.BAD_PAGES, f"block id {max(names)} is beyond the registration's "
                                f"{num_blocks} blocks")
        tree = self._namespaces[export.namespace_id].tree
        self.metrics.add(counters.PEER_BLOCKS_REMOVED, tree.peer_remove(export.peer_id, request.removed))
        for run in request.runs:
            try:
                added = tree.peer_put(np.frombuffer(run.token_ids, dtype="<i4"), export.peer_id, run.start_page,
                                      run.block_ids, run.epochs)
            except ValueError as exc:       # what came before in the message stands
                raise ProtocolError(ErrorCode.BAD_PAGES, f"a peer run does not fit: {exc}") from None
            self.metrics.add(counters.PEER_BLOCKS_PUBLISHED, added)
        self.metrics.add(counters.PEER_PUBLICATIONS)

    def list_for(self, session_id: int) -> list[dict[str, Any]]:
        """The registrations the session may open (none unless it registered itself)."""
        reader = self.by_session.get(session_id)
        return [export.to_wire() for export in self.readable_by(reader)] if reader is not None else []

    def candidate(self, session_id: int, namespace: Namespace, token_ids: np.ndarray
                  ) -> tuple[int, list[int], list[int]]:
        """The longest run of another engine's blocks this session may copy, for the leading pages
        of token_ids: (peer id, blocks, epochs), or (0, [], []). The first registered wins a tie."""
        reader = self.by_session.get(session_id)
        if reader is None:
            return 0, [], []
        owners = [export.peer_id for export in self.readable_by(reader)]
        if not owners:
            return 0, [], []
        hits = namespace.tree.peer_hits(token_ids, owners)
        if not hits:
            return 0, [], []
        peer_id = max(owners, key=lambda owner: len(hits[owner].block_ids) if owner in hits else 0)
        return peer_id, hits[peer_id].block_ids, hits[peer_id].epochs
