"""Peer restores, the engine's side: other engines copy blocks out of this engine's KV tensors, and
this engine copies blocks out of theirs, through handles the daemon relays (docs/architecture.md,
"Peer restores", has the protocol and why it is safe).

    owner   at registration sends the handles of its KV tensors' storages and its device; marks
            a block's epoch odd before it writes the block (``will_write``) and even once that
            write is done (``cached``, seen done by an event at a later ``poll``), and publishes
            what its cache holds, batched, never waited for (PEER_PUBLISH)
    reader  asks for the registrations it may open (PEER_LIST), opens each once on a thread of
            its own, copies the blocks a match names on the load lane (one block copy out of the
            owner's tensors, through their segment table, into its own), and keeps a copied block
            only if its epoch was the published one before the copy and still is after it, the
            owner's registration still open and its process not exiting

Transports. "cuda": torch's CUDA IPC (``UntypedStorage._share_cuda_`` / ``_new_shared_cuda``, what
torch.multiprocessing uses), same GPU only, named by UUID so that engines with different
CUDA_VISIBLE_DEVICES agree. "host": CPU tensors in shared memory (``share_memory_``), opened
through ``/proc/<pid>/fd``: CPU engines, and the tests, where a copy is a real read of memory that
another process rewrites meanwhile.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Sequence

import numpy as np
import torch

from engine_client.block_copy import SegmentTable, check_same_pages
from engine_client.client import DaemonError, DaemonUnavailable, KVCacheClient, PendingReply
from engine_client.dtypes import dtype_name, tensor_dtype
from engine_client.kv_transfer import KVTransfer, Transfer
from engine_client.layout import KVLayout, describe_layout
from engine_client.peer_memory import EpochFile, PeerError, _export_storage, _open_storage, device_identity
from proto import counters, procfs
from proto.counters import Counts
from proto.messages import MsgKind
from proto.replies import AcquireReply, PeerListReply, PeerRegisterReply
from proto.tokens import TOKEN_BYTES, token_bytes

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 10.0
LIVENESS_INTERVAL_S = 0.1
MAX_BLOCKS_PER_PUBLICATION = 1 << 16
_FIRST_EPOCH = 1            # odd: a block holds nothing published until its first fill is done


# ---- what readers hold -------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class OpenedPeer:
    """Another engine's registration, opened: its tensors as a segment table of this process."""

    peer_id: int
    table: SegmentTable
    epochs: EpochFile
    pid: int
    start_time: int
    in_flight: int = 0
    closing: bool = False

    def usable(self) -> bool:
        """Its registration is open and its process has not begun to exit."""
        return not self.closing and not self.epochs.closed and procfs.running(self.pid, self.start_time)

    def close(self) -> None:
        """Drop the mappings (CUDA: the IPC handles close with the last storage that uses them)."""
        self.table = None
        self.epochs.close()


@dataclasses.dataclass(frozen=True)
class PeerPlan:
    """A match's peer candidate, its owner opened here."""

    peer: OpenedPeer
    block_ids: np.ndarray        # the owner's block for page i
    epochs: np.ndarray           # the epoch it was published at

    @property
    def num_pages(self) -> int:
        return len(self.block_ids)


@dataclasses.dataclass(eq=False)
class PeerCopy:
    peer: OpenedPeer
    source_block_ids: np.ndarray
    epochs: np.ndarray
    transfer: Transfer


@dataclasses.dataclass(eq=False)
class _Fill:
    token_ids: bytes            # the leading pages the blocks hold
    block_ids: np.ndarray       # block of page i
    epochs: np.ndarray          # each block's epoch when the engine said it was written
    event: Any                  # the engine's stream after the writes (None on CPU)


def _leading(mask: np.ndarray) -> int:
    return int(np.argmin(mask)) if not mask.all() else len(mask)


class PeerSharing:
    """One engine's side of peer restores, owner and reader at once; see the module note. Driven
    by its connector on the scheduler thread (not thread-safe), except the opening of peers."""

    def __init__(self, client: KVCacheClient, layout: KVLayout, transfer: KVTransfer, page_size: int,
                 counts: Counts):
        self.client = client
        self.layout = layout
        self.transfer = transfer
        self.page_size = page_size
        self.counters = counts
        self.transport, self.device_id = device_identity(layout.device)
        self.daemon_uid = os.stat(client.socket_path).st_uid
        self._body = self._registration()
        num_blocks = layout.num_blocks
        # The owner's epochs: the registration's file once it is mapped, a private array before.
        self._epoch_file: EpochFile | None = None
        self._epochs = np.full(num_blocks, _FIRST_EPOCH, dtype=np.int64)
        self._published = np.full(num_blocks, -1, dtype=np.int64)     # the epoch each block was published at
        self._removed: list[int] = []
        self._fills: collections.deque[_Fill] = collections.deque()
        self._generation = client.generation        # the client session the registration is of
        self._registering: PendingReply | None = None
        self._refused_generation = -1               # a session whose registration failed: not retried
        self.peer_id = 0
        # Reader.
        self._peers: dict[int, OpenedPeer] = {}
        self._closing: list[OpenedPeer] = []
        self._listing: PendingReply | None = None
        self._list_wanted = False
        self._opening: set[int] = set()
        self._open_lock = threading.Lock()
        self._opened: list[OpenedPeer] = []
        self._open_failed: set[int] = set()
        self._open_threads: list[threading.Thread] = []
        self._liveness_checked_at = 0.0
        self._closed = False

    @classmethod
    def register(cls, client: KVCacheClient, layout: KVLayout, transfer: KVTransfer, page_size: int,
                 counts: Counts) -> "PeerSharing":
        """Register the tensors (one round trip, at the engine's start) and ask for the peers."""
        sharing = cls(client, layout, transfer, page_size, counts)
        sharing._register()
        reply = sharing._registering.result(REGISTER_TIMEOUT_S)
        sharing._registering = None
        sharing._registered(reply)
        return sharing

    def _registration(self) -> dict[str, Any]:
        storages: list[dict[str, Any]] = []
        index_by_address: dict[int, int] = {}
        tensors = []
        for tensor in self.layout.tensors:
            storage = tensor.untyped_storage()
            index = index_by_address.setdefault(storage.data_ptr(), len(storages))
            if index == len(storages):
                storages.append(_export_storage(storage, self.transport))
            tensors.append({"storage": index, "offset": tensor.storage_offset(), "shape": list(tensor.shape),
                            "stride": list(tensor.stride())})
        return {"transport": self.transport, "device_id": self.device_id, "layout": self.layout.kind,
                "dtype": dtype_name(self.layout.dtype), "num_blocks": self.layout.num_blocks,
                "storages": storages, "tensors": tensors}

    @property
    def epochs_path(self) -> str | None:
        """The epoch file of the live registration (None while there is none)."""
        return self._epoch_file.path if self._epoch_file is not None else None

    def _register(self) -> None:
        self._registering = self.client.request_async(MsgKind.PEER_REGISTER, dict(self._body), PeerRegisterReply,
                                                      self._generation)

    def _registered(self, reply: PeerRegisterReply) -> None:
        epoch_file = EpochFile(reply.epochs_path, reply.epochs_offset_bytes, self.layout.num_blocks, writable=True,
                               daemon_uid=self.daemon_uid)
        epoch_file.epochs[:] = self._epochs      # every write from here on is seen there
        self._epoch_file, self._epochs, self.peer_id = epoch_file, epoch_file.epochs, reply.peer_id
        self._list_wanted = True
        logger.info("KV tensors registered for peer restores (%s %s, peer %x)", self.transport, self.device_id,
                    reply.peer_id)

    # ---- owner ------------------------------------------------------------------------------

    def will_write(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Before the engine queues any work that writes these blocks: their epochs go odd (a new
        odd value each time), and those published are withdrawn."""
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if not len(blocks):
            return
        epochs = self._epochs[blocks]
        self._epochs[blocks] = epochs + np.where(epochs % 2 == 0, 1, 2)
        published = np.unique(blocks[self._published[blocks] >= 0])
        if len(published):
            self._removed.extend(published.tolist())
            self._published[published] = -1

    def cached(self, token_ids: Sequence[int] | np.ndarray, block_ids: Sequence[int] | np.ndarray) -> None:
        """block_ids[i] holds page i of token_ids, written by the work queued so far on the current
        stream; published once that work is done."""
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if not len(blocks):
            return
        epochs = self._epochs[blocks].copy()
        if (self._published[blocks] == epochs).all():
            return                          # each published as it is: nothing new
        num_bytes = len(blocks) * self.page_size * TOKEN_BYTES
        data = token_bytes(token_ids)[:num_bytes]
        if len(data) < num_bytes:
            raise ValueError(f"{len(blocks)} blocks need {len(blocks) * self.page_size} tokens")
        event = None
        if self.layout.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.layout.device))
        self._fills.append(_Fill(data, blocks, epochs, event))

    def _publish_fills(self) -> list[dict[str, Any]]:
        """Fills whose writes are done: their epochs go even (unless the block was reused since),
        and the leading run of blocks holding what was said becomes a publication."""
        runs = []
        while self._fills and (self._fills[0].event is None or self._fills[0].event.query()):
            fill = self._fills.popleft()
            blocks = fill.block_ids
            now = self._epochs[blocks]
            written = (now == fill.epochs) & (now % 2 == 1)
            self._epochs[blocks[written]] = now[written] + 1
            now = self._epochs[blocks]
            holds = (now % 2 == 0) & ((now == fill.epochs) | (now == fill.epochs + 1))
            count = _leading(holds)
            fresh = self._published[blocks[:count]] != now[:count]
            if not fresh.any():
                continue
            start = int(np.argmax(fresh))
            runs.append({"token_ids": fill.token_ids[: count * self.page_size * TOKEN_BYTES], "start_page": start,
                         "block_ids": blocks[start:count].tolist(), "epochs": now[start:count].tolist()})
            self._published[blocks[:count]] = now[:count]
        return runs

    def _send_publications(self) -> None:
        runs = self._publish_fills()
        if not runs and not self._removed:
            return
        while runs or self._removed:
            removed, self._removed = self._removed[:MAX_BLOCKS_PER_PUBLICATION], self._removed[MAX_BLOCKS_PER_PUBLICATION:]
            batch, size = [], len(removed)
            while runs and (not batch or size + len(runs[0]["block_ids"]) <= MAX_BLOCKS_PER_PUBLICATION):
                size += len(runs[0]["block_ids"])
                batch.append(runs.pop(0))
            if not self.client.send_async(MsgKind.PEER_PUBLISH, {"removed": removed, "runs": batch}, self._generation):
                return                      # the session ended: the next registration starts afresh
            self.counters.add(counters.ENGINE_PEER_BLOCKS_PUBLISHED, size - len(removed))
            self.counters.add(counters.ENGINE_PEER_PUBLICATIONS)

    # ---- reader -----------------------------------------------------------------------------

    def plan(self, reply: AcquireReply) -> PeerPlan | None:
        """The acquire's peer candidate, if its owner is opened here and usable (an owner not opened
        yet is asked for: later requests may use it)."""
        if not reply.peer_id or not reply.peer_block_ids:
            return None
        peer = self._peers.get(reply.peer_id)
        if peer is None:
            self.counters.add(counters.ENGINE_PEER_CANDIDATES_SKIPPED, 1, "not_open")
            if reply.peer_id not in self._opening and reply.peer_id not in self._open_failed:
                self._list_wanted = True
            return None
        if len(reply.peer_epochs) != len(reply.peer_block_ids) or \
                max(reply.peer_block_ids) >= peer.epochs.num_blocks or min(reply.peer_block_ids) < 0:
            self.counters.add(counters.ENGINE_PEER_CANDIDATES_SKIPPED, 1, "malformed")
            return None
        return PeerPlan(peer, np.asarray(reply.peer_block_ids, dtype=np.int64),
                        np.asarray(reply.peer_epochs, dtype=np.int64))

    def copy(self, plan: PeerPlan, first_page: int, block_ids: np.ndarray, after: Any) -> PeerCopy | None:
        """Queue the copy of the plan's pages [first_page, first_page + len(block_ids)) into this
        engine's block_ids, cut before the first block no longer holding its published page (None:
        not one does, or the owner is not usable)."""
        peer = plan.peer
        if not peer.usable():               # closing first: a closed peer's file is unmapped
            return None
        source = plan.block_ids[first_page: first_page + len(block_ids)]
        expected = plan.epochs[first_page: first_page + len(block_ids)]
        count = _leading((peer.epochs.epochs[source] == expected) & (expected % 2 == 0))
        if count == 0:
            return None
        transfer = self.transfer.copy_from(peer.table, source[:count], block_ids[:count], after)
        peer.in_flight += 1
        self.counters.add(counters.ENGINE_PEER_COPIES)
        return PeerCopy(peer, source[:count], expected[:count], transfer)

    def finish(self, copy: PeerCopy) -> int:
        """After the copy is seen done: the leading pages whose blocks held their published page
        throughout (epoch unchanged), the owner's registration open and its process not exiting."""
        peer = copy.peer
        peer.in_flight -= 1
        count = _leading(peer.epochs.epochs[copy.source_block_ids] == copy.epochs)
        if not (not peer.epochs.closed and procfs.running(peer.pid, peer.start_time)):
            count = 0
        self.counters.add(counters.ENGINE_PEER_PAGES, count, "verified")
        self.counters.add(counters.ENGINE_PEER_PAGES, len(copy.source_block_ids) - count, "changed")
        return count

    def _open(self, entry: dict[str, Any]) -> OpenedPeer:
        """Open a registration PEER_LIST relayed (another engine's word: every part is checked)."""
        try:
            peer_id, pid, start_time = int(entry["peer_id"]), int(entry["pid"]), int(entry["process_start_time"])
            if entry["transport"] != self.transport or entry["device_id"] != self.device_id:
                raise PeerError("it is on another device")
            if int(entry["pid_namespace_id"]) != procfs.pid_namespace_id():
                raise PeerError("its process is in another pid namespace: its liveness cannot be checked")
            device = self.layout.device
            dtype = tensor_dtype(entry["dtype"])
            storages = [_open_storage(handle, self.transport, device, pid) for handle in entry["storages"]]
            tensors = []
            for spec in entry["tensors"]:
                tensor = torch.empty(0, dtype=dtype, device=device)
                tensors.append(tensor.set_(storages[spec["storage"]], spec["offset"], spec["shape"], spec["stride"]))
            kind = entry["layout"]
            layout = describe_layout(kind, tensors[0] if kind == "pool" else tensors)
        except PeerError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
            raise PeerError(f"its registration cannot be opened: {type(exc).__name__}: {exc}") from None
        own = self.layout
        if (layout.page_layout, layout.block_shape, layout.num_segments, layout.num_blocks) != \
                (own.page_layout, own.block_shape, own.num_segments, int(entry["num_blocks"])):
            raise PeerError(f"its blocks ({layout.kind}, {layout.num_segments} segments of {layout.block_shape}) "
                            f"are not this engine's ({own.kind}, {own.num_segments} of {own.block_shape})")
        table = SegmentTable(layout)
        try:
            check_same_pages(table, self.transfer.table)    # one block copy moves words of one size
        except ValueError as exc:
            raise PeerError(f"its blocks cannot be copied into this engine's: {exc}") from None
        epoch_file = EpochFile(entry["epochs_path"], entry["epochs_offset_bytes"], layout.num_blocks,
                               writable=False, daemon_uid=self.daemon_uid)
        return OpenedPeer(peer_id, table, epoch_file, pid, start_time)

    def _open_in_background(self, entry: dict[str, Any]) -> None:
        peer_id = entry.get("peer_id")
        try:
            peer = self._open(entry)
        except (PeerError, OSError) as exc:
            # Logged as text: a record holding the exception would hold this object through its frames.
            logger.warning("peer %s not opened (its blocks are not copied): %s", peer_id, str(exc))
            with self._open_lock:
                self._opening.discard(peer_id)
                self._open_failed.add(peer_id)
            return
        with self._open_lock:
            self._opening.discard(peer_id)
            if self._closed:
                peer.close()
            else:
                self._opened.append(peer)

    def _take_list(self, reply: PeerListReply) -> None:
        self.counters.add(counters.ENGINE_PEER_LISTS_TAKEN)
        for entry in reply.peers:
            peer_id = entry.get("peer_id") if isinstance(entry, dict) else None
            if type(peer_id) is not int or peer_id in self._peers or peer_id in self._open_failed:
                continue
            with self._open_lock:
                if peer_id in self._opening:
                    continue
                self._opening.add(peer_id)
            thread = threading.Thread(target=self._open_in_background, args=(entry,), name="kvcached-peer-open",
                                      daemon=True)
            self._open_threads = [t for t in self._open_threads if t.is_alive()] + [thread]
            thread.start()

    # ---- each step ----------------------------------------------------------------------------

    def poll(self) -> None:
        """Publish what is done; follow the client's session (a new one: register again); take in
        the peer list and the peers opened meanwhile; close the peers whose registrations ended."""
        if self._closed:
            return
        generation = self.client.generation
        if generation != self._generation:
            self._session_ended()
            self._generation = generation
        if self._epoch_file is None and self._registering is None and self._refused_generation != generation \
                and self.client.is_attached(generation):
            try:
                self._register()
            except DaemonUnavailable:
                pass                        # down again: at a later poll
        if self._registering is not None and self._registering.ready():
            pending, self._registering = self._registering, None
            try:
                self._registered(pending.result(0.0))
            except (DaemonUnavailable, DaemonError, PeerError, OSError) as exc:
                self._refused_generation = generation
                logger.warning("peer restores off until the next session: registration failed: %s", str(exc))
        if self._epoch_file is not None:
            self._send_publications()
            self._poll_list()
        with self._open_lock:
            opened, self._opened = self._opened, []
        for peer in opened:
            self._peers[peer.peer_id] = peer
            self.counters.add(counters.ENGINE_PEERS_OPENED, 1, "opened")
        # Whether each owner lives is read from /proc at most every LIVENESS_INTERVAL_S here (each
        # copy checks it anyway); a closed registration is seen at once.
        now = time.monotonic()
        check_liveness = now - self._liveness_checked_at >= LIVENESS_INTERVAL_S
        if check_liveness:
            self._liveness_checked_at = now
        for peer in list(self._peers.values()):
            if peer.epochs.closed or (check_liveness and not procfs.running(peer.pid, peer.start_time)):
                del self._peers[peer.peer_id]
                peer.closing = True
                self._closing.append(peer)
        for peer in [p for p in self._closing if p.in_flight == 0]:
            self._closing.remove(peer)
            peer.close()
            self.counters.add(counters.ENGINE_PEERS_OPENED, 1, "closed")

    def _poll_list(self) -> None:
        if self._listing is not None and self._listing.ready():
            pending, self._listing = self._listing, None
            try:
                self._take_list(pending.result(0.0))
            except (DaemonUnavailable, DaemonError) as exc:
                logger.debug("peer list not taken: %s", str(exc))
        if self._list_wanted and self._listing is None:
            self._list_wanted = False
            try:
                self._listing = self.client.request_async(MsgKind.PEER_LIST, {}, PeerListReply, self._generation)
            except DaemonUnavailable:
                pass

    def _session_ended(self) -> None:
        """The registration went with the client's session: stop writing its file (marked closed
        first, so that no reader keeps a copy made after), forget what was published, and close
        every peer (their registrations were of the same daemon session). ``poll`` registers anew
        once the client is attached again; blocks are published again as the engine caches them."""
        if self._epoch_file is not None:
            self._epoch_file.mark_closed()
            self._epochs = self._epochs.copy()
            self._epoch_file.close()
            self._epoch_file = None
        self._published[:] = -1
        self._removed = []
        for pending in (self._registering, self._listing):
            if pending is not None:
                pending.cancel()
        self._registering = self._listing = None
        for peer in self._peers.values():
            peer.closing = True
            self._closing.append(peer)
        self._peers.clear()
        with self._open_lock:
            self._open_failed.clear()

    def close(self) -> None:
        """The engine stops sharing (before its KV tensors may go): readers stop copying from it;
        the peers it opened are closed. The caller has drained its copies."""
        with self._open_lock:
            self._closed = True
            opened, self._opened = self._opened, []
        if self._epoch_file is not None:
            self._epoch_file.mark_closed()
        for thread in self._open_threads:
            thread.join()
        for peer in [*self._peers.values(), *self._closing, *opened]:
            peer.close()
        self._peers.clear()
        self._closing.clear()
        if self._epoch_file is not None:
            self._epochs = self._epochs.copy()
            self._epoch_file.close()
            self._epoch_file = None
