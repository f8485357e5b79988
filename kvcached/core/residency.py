"""Peer restores, the daemon's side: which engines registered their KV tensors for others to copy
blocks from, and who may open whose. What each engine's GPU cache holds is kept on its namespace's
tree (``PeerResidency``, keyed by the registration's ``peer_id``).

The daemon relays what an owner registered (its storages' handles and its tensors' shapes) and
what it published (block ids and epochs), and never interprets the handles: a reader opens them,
checks what it opened against its own layout, and checks every block it copies against the
block's live epoch in the owner's epoch file (docs/architecture.md, "Peer restores"). So a wrong
or stale record costs a reader a failed copy, never wrong bytes. No I/O here: the server makes
each registration's epoch file and closes it when the registration ends.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import operator
import secrets
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import numpy as np

from kvcached.core import counters
from kvcached.core.hints import AdmissionHints
from kvcached.core.leases import Session
from kvcached.core.metrics import Metrics
from kvcached.core.tiers import IntegrityError
from kvcached.core.tree import PrefixTree, TreeNode
from proto.errors import ErrorCode, ProtocolError
from proto.procfs import ProcessIdentity
from proto.schema import PeerPublish, PeerRegister
from proto.tokens import token_array

if TYPE_CHECKING:
    from kvcached.core.namespaces import Namespace

logger = logging.getLogger(__name__)


class PeerHit(NamedTuple):
    """An engine's blocks holding the leading pages of a prefix, with their epochs."""

    block_ids: list[int]
    epochs: list[int]


class PeerResidency:
    """Which blocks of which engine's own GPU cache hold a namespace's pages, each with the epoch it
    was filled at (``put``; the engine's word, checked by readers against the block's live epoch).
    Kept on the tree's nodes: per node and owner an array ``[num_pages, 2]`` of (block, epoch), -1
    where that engine holds no block: an engine's cache need not be prefix-closed, a hit is its
    leading run. Each owner's block is in one place at most (``_block_nodes`` finds it; a split
    moves the upper half's entries to the new node and tells ``_moved``)."""

    def __init__(self, tree: PrefixTree):
        self._tree = tree
        self._block_nodes: dict[int, dict[int, TreeNode]] = {}     # owner -> block -> its node
        tree.on_peer_moved = self._moved

    def put(self, token_ids, owner: int, start_page: int, block_ids: Sequence[int],
                 epochs: Sequence[int]) -> int:
        """Record that ``owner``'s blocks hold pages [start_page, start_page + len(block_ids)) of
        token_ids (block_ids[i] page start_page + i, filled at epochs[i]). A block recorded
        elsewhere for this owner moves here; a page this owner held in another block is now this
        one's. The path is made as needed. Returns the pages recorded; ValueError (nothing
        changed) when token_ids do not cover them or a block is named twice."""
        start_page = operator.index(start_page)
        block_ids = [operator.index(b) for b in block_ids]
        epochs = [operator.index(e) for e in epochs]
        total_pages = start_page + len(block_ids)
        data = self._tree.token_bytes(token_ids)
        if start_page < 0 or len(epochs) != len(block_ids) or len(data) < total_pages * self._tree.page_bytes:
            raise ValueError(f"pages [{start_page}, {total_pages}) with {len(epochs)} epochs for "
                             f"{len(block_ids)} blocks do not fit {len(data) // self._tree.page_bytes} pages of tokens")
        if len(set(block_ids)) != len(block_ids) or any(b < 0 for b in block_ids):
            raise ValueError("peer block ids must be distinct and >= 0")
        if not block_ids:
            return 0
        where = self._block_nodes.setdefault(owner, {})
        self._forget(owner, [b for b in block_ids if b in where])
        entries = np.array([block_ids, epochs], dtype=np.int64).T
        for node, first_page in self._tree.grow_path(data[:total_pages * self._tree.page_bytes], total_pages):
            lo, hi = max(start_page, first_page), min(total_pages, first_page + node.num_pages)
            if lo >= hi:
                continue
            if node.peer is None:
                node.peer = {}
            held = node.peer.get(owner)
            if held is None:
                held = node.peer[owner] = np.full((node.num_pages, 2), -1, dtype=np.int64)
            part = held[lo - first_page: hi - first_page]
            for replaced in part[:, 0][part[:, 0] >= 0].tolist():
                del where[replaced]
            part[:] = entries[lo - start_page: hi - start_page]
            for block_id in part[:, 0].tolist():
                where[block_id] = node
        return len(block_ids)

    def remove(self, owner: int, block_ids: Sequence[int]) -> int:
        """Forget these blocks of ``owner`` (unknown ones are skipped); returns how many were known."""
        where = self._block_nodes.get(owner, {})
        known = list(dict.fromkeys(b for b in block_ids if b in where))
        self._forget(owner, known)
        return len(known)

    def drop(self, owner: int) -> int:
        """Forget everything of ``owner``; returns the blocks forgotten."""
        block_ids = list(self._block_nodes.get(owner, ()))
        self._forget(owner, block_ids)
        self._block_nodes.pop(owner, None)
        return len(block_ids)

    def blocks(self, owner: int) -> int:
        """How many of ``owner``'s blocks are recorded."""
        return len(self._block_nodes.get(owner, ()))

    def hits(self, token_ids, owners) -> dict[int, PeerHit]:
        """Per owner among ``owners`` that holds any, its blocks for the leading pages of token_ids
        (whole pages, from the first: up to its first page not held). Changes nothing."""
        running = {owner: ([], []) for owner in owners if self._block_nodes.get(owner)}
        done: dict[int, tuple[list[int], list[int]]] = {}
        for child, _, common in self._tree.walk(self._tree.token_bytes(token_ids)):
            if not running:
                break
            for owner in list(running):
                held = child.peer.get(owner) if child.peer is not None else None
                if held is None:
                    done[owner] = running.pop(owner)
                    continue
                part = held[:common]
                absent = part[:, 0] < 0
                count = int(np.argmax(absent)) if absent.any() else common
                running[owner][0].extend(part[:count, 0].tolist())
                running[owner][1].extend(part[:count, 1].tolist())
                if count < common:
                    done[owner] = running.pop(owner)
        done.update(running)
        return {owner: PeerHit(blocks, epochs) for owner, (blocks, epochs) in done.items() if blocks}

    def _forget(self, owner: int, block_ids: Sequence[int]) -> None:
        """Forget these recorded blocks of ``owner`` (distinct): one pass over each node that holds
        some (an engine withdraws or moves hundreds of blocks at once), then the nodes left holding
        nothing are dropped."""
        if not block_ids:
            return
        where = self._block_nodes[owner]
        by_node: dict[int, tuple[TreeNode, list[int]]] = {}
        for block_id in block_ids:
            node = where.pop(block_id)
            by_node.setdefault(id(node), (node, []))[1].append(block_id)
        emptied = []
        for node, blocks in by_node.values():
            held = node.peer[owner]
            held[np.isin(held[:, 0], blocks)] = -1
            if (held[:, 0] < 0).all():
                del node.peer[owner]
                if not node.peer:
                    node.peer = None
                    emptied.append(node)
        for node in emptied:                # an emptied ancestor goes with its last emptied child
            self._tree.remove_if_empty(node)

    def _moved(self, owner: int, block_ids: list[int], node: TreeNode) -> None:
        where = self._block_nodes[owner]
        for block_id in block_ids:
            where[block_id] = node

    def check_integrity(self) -> None:
        """Every recorded block is in the node its record names, once."""
        entries: collections.Counter[int] = collections.Counter()
        for node in self._tree.nodes():
            for owner, held in (node.peer or {}).items():
                where = self._block_nodes.get(owner, {})
                for block_id in held[:, 0][held[:, 0] >= 0].tolist():
                    if where.get(block_id) is not node:
                        raise IntegrityError(f"{node!r}: block {block_id} of owner {owner} is recorded elsewhere")
                    entries[owner] += 1
        for owner, where in self._block_nodes.items():
            if len(where) != entries[owner]:
                raise IntegrityError(f"owner {owner}: {len(where)} blocks recorded, {entries[owner]} in the tree "
                                     "(a block held twice, or a record of a node that left the tree)")


@dataclasses.dataclass(eq=False)
class PeerExport:
    """One engine's registration, for the life of its session."""

    peer_id: int                  # random: readers name the owner by it (a session id is a capability)
    session_id: int
    namespace_id: int
    request: PeerRegister
    identity: ProcessIdentity     # the engine's process (its session's)
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
                and other.identity.pid_namespace_id != 0
                and other.identity.pid_namespace_id == self.identity.pid_namespace_id)

    def to_wire(self) -> dict[str, Any]:
        request = self.request
        return {"peer_id": self.peer_id, "transport": request.transport, "device_id": request.device_id,
                "layout": request.layout, "dtype": request.dtype, "num_blocks": request.num_blocks,
                "storages": request.storages, "tensors": [t.to_wire() for t in request.tensors],
                "epochs_path": self.epochs_path, "epochs_offset_bytes": self.epochs_offset_bytes,
                **self.identity._asdict()}


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

    def add(self, session_id: int, namespace_id: int, request: PeerRegister, identity: ProcessIdentity) -> PeerExport:
        assert session_id not in self.by_session, "one registration per session"
        peer_id = secrets.randbits(62) + 1
        while peer_id in self.by_peer_id:
            peer_id = secrets.randbits(62) + 1
        export = PeerExport(peer_id, session_id, namespace_id, request, identity)
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
        export = self.add(session_id, session.namespace_id, request, session.identity)
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
            self.metrics.add(counters.PEER_BLOCKS_FORGOTTEN, namespace.peers.drop(export.peer_id))
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
        peers = self._namespaces[export.namespace_id].peers
        self.metrics.add(counters.PEER_BLOCKS_REMOVED, peers.remove(export.peer_id, request.removed))
        for run in request.runs:
            try:
                added = peers.put(token_array(run.token_ids), export.peer_id, run.start_page, run.block_ids,
                                  run.epochs)
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
        hits = namespace.peers.hits(token_ids, owners)
        if not hits:
            return 0, [], []
        peer_id = max(owners, key=lambda owner: len(hits[owner].block_ids) if owner in hits else 0)
        return peer_id, hits[peer_id].block_ids, hits[peer_id].epochs
