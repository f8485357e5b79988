"""Transfers as jobs: each copy a request needs is queued by the handler of its route (source,
destination) and, once seen complete, checked by it into a ``JobResult``: the pages kept, the
bytes copied and the copy's device time, which are also the cost sample the daemon learns from.

    L2 -> GPU        a load from the request's leased L2 pages, whole or by groups of layers; a
                     page is kept only if its generation is the published one before and after
    GPU -> L2        a save into the pages reserved for the request's lease; each page claimed at
                     the copy and stamped with the lease's generation once complete
    peer GPU -> GPU  a load from another engine's blocks; a block is kept only if its epoch did not
                     change during the copy (``engine_client.peer``)
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, NamedTuple

import numpy as np

from engine_client.connector.config import ConnectorConfig
from engine_client.connector.state import Cause
from engine_client.kv_transfer import KVTransfer, Transfer
from engine_client.shared_pool import SharedHostPool


class Route(enum.Enum):
    L2_TO_GPU = ("l2", "gpu")
    GPU_TO_L2 = ("gpu", "l2")
    PEER_TO_GPU = ("peer_gpu", "gpu")

    @property
    def direction(self) -> str:
        """The cost model's name for the copy (``proto.schema.EngineReport``'s cost samples)."""
        return {Route.L2_TO_GPU: "h2d", Route.GPU_TO_L2: "d2h", Route.PEER_TO_GPU: "d2d"}[self]


@dataclasses.dataclass(eq=False)
class TransferJob:
    route: Route
    transfer: Transfer
    num_pages: int                      # pages copied
    num_bytes: int
    page_ids: np.ndarray                # L2 routes: the L2 pages it reads or writes
    page_generations: np.ndarray | None = None  # L2 -> GPU: each page's published generation
    generation: int = 0                 # GPU -> L2: the lease's write generation
    peer_copy: Any = None               # peer route: engine_client.peer.PeerCopy

    def done(self) -> bool:
        return self.transfer.done()

    def blocks_free(self) -> bool:
        return self.transfer.blocks_free()


class Queued(NamedTuple):
    job: TransferJob | None             # None: nothing copied
    num_pages: int                      # leading pages queued
    cause: Cause | None                 # why the pages beyond num_pages are not


class JobResult(NamedTuple):
    num_pages: int                      # leading pages kept
    num_bytes: int                      # bytes copied
    device_s: float                     # the copy's device time
    cause: Cause | None                 # why the copied pages beyond num_pages are not kept
    direction: str

    @property
    def cost_sample(self) -> tuple[str, int, float]:
        return self.direction, self.num_bytes, self.device_s


class L2ToGpu:
    route = Route.L2_TO_GPU

    def __init__(self, transfer: KVTransfer, bytes_per_page: int, config: Callable[[], ConnectorConfig]):
        self.transfer = transfer
        self.bytes_per_page = bytes_per_page
        self._config = config

    def queue(self, pool: SharedHostPool, host_page_ids: np.ndarray, generations: np.ndarray,
              block_ids: np.ndarray, after: Any) -> Queued:
        """Copy the leading pages still at their published generation (a job may raise: the
        caller fails its blocks)."""
        num_pages = pool.generations.num_leading_intact(host_page_ids, generations)
        cause = Cause.STALE_GENERATION if num_pages < len(host_page_ids) else None
        if not num_pages:
            return Queued(None, 0, cause)
        config = self._config()
        num_bytes = num_pages * self.bytes_per_page
        layered = config.layered_loads and num_bytes >= config.layered_min_bytes
        transfer = self.transfer.load(host_page_ids[:num_pages], block_ids[:num_pages], after, layered)
        job = TransferJob(self.route, transfer, num_pages, num_bytes, host_page_ids[:num_pages],
                          generations[:num_pages])
        return Queued(job, num_pages, cause)

    def complete(self, job: TransferJob, pool: SharedHostPool | None) -> JobResult:
        """``pool``: the job's session's, None once dropped. A page whose generation changed
        while the DMA read it may hold another's bytes: that page and those after are not kept."""
        if pool is None:
            kept, cause = 0, Cause.SESSION_LOST
        else:
            kept = pool.generations.num_leading_intact(job.page_ids, job.page_generations)
            cause = Cause.STALE_GENERATION if kept < job.num_pages else None
        return JobResult(kept, job.num_bytes, job.transfer.seconds(), cause, self.route.direction)


class GpuToL2:
    route = Route.GPU_TO_L2

    def __init__(self, transfer: KVTransfer, bytes_per_page: int):
        self.transfer = transfer
        self.bytes_per_page = bytes_per_page

    def queue(self, block_ids: np.ndarray, host_page_ids: np.ndarray, after: Any,
              generation: int) -> tuple[TransferJob | None, np.ndarray]:
        """Copy into the pages still reserved for ``generation`` (claimed at the copy); returns the
        job (None: none claimed) and which of host_page_ids it claimed."""
        transfer = self.transfer.save(block_ids, host_page_ids, after, generation)
        claimed = np.asarray(transfer.claimed, dtype=bool)
        if not claimed.any():
            return None, claimed
        num_pages = int(claimed.sum())
        return TransferJob(self.route, transfer, num_pages, num_pages * self.bytes_per_page, host_page_ids[claimed],
                           generation=generation), claimed

    def complete(self, job: TransferJob, pool: SharedHostPool | None) -> JobResult:
        """Stamp the written pages with the lease's generation: readers trust them once committed."""
        if pool is None:            # the ended session's pool was dropped: its lease went with it
            kept, cause = 0, Cause.SESSION_LOST
        else:
            pool.generations.stamp(job.page_ids, job.generation)
            kept, cause = job.num_pages, None
        return JobResult(kept, job.num_bytes, job.transfer.seconds(), cause, self.route.direction)


class PeerToGpu:
    route = Route.PEER_TO_GPU

    def __init__(self, peer, bytes_per_page: int):
        self.peer = peer
        self.bytes_per_page = bytes_per_page

    def queue(self, plan, start_page: int, block_ids: np.ndarray, after: Any) -> Queued:
        """Copy the plan's pages [start_page, start_page + len(block_ids)) whose blocks still hold
        their published page (a job may raise: the caller fails its blocks)."""
        copy = self.peer.copy(plan, start_page, block_ids, after)
        num_pages = 0 if copy is None else len(copy.source_block_ids)
        cause = Cause.PEER_CHANGED if num_pages < len(block_ids) else None
        if copy is None:
            return Queued(None, 0, cause)
        job = TransferJob(self.route, copy.transfer, num_pages, num_pages * self.bytes_per_page,
                          np.empty(0, np.int64), peer_copy=copy)
        return Queued(job, num_pages, cause)

    def complete(self, job: TransferJob, pool: SharedHostPool | None = None) -> JobResult:
        """Only blocks the owner did not touch during the copy count (their epochs unchanged)."""
        kept = self.peer.finish(job.peer_copy)
        cause = Cause.PEER_CHANGED if kept < job.num_pages else None
        return JobResult(kept, job.num_bytes, job.transfer.seconds(), cause, self.route.direction)


class Jobs:
    """The handler of each route of one connector."""

    def __init__(self, transfer: KVTransfer, peer, bytes_per_page: int, config: Callable[[], ConnectorConfig]):
        self.handlers: dict[Route, Any] = {Route.L2_TO_GPU: L2ToGpu(transfer, bytes_per_page, config),
                                           Route.GPU_TO_L2: GpuToL2(transfer, bytes_per_page)}
        if peer is not None:
            self.handlers[Route.PEER_TO_GPU] = PeerToGpu(peer, bytes_per_page)

    def handler(self, source: str, destination: str):
        return self.handlers[Route((source, destination))]

    def complete(self, job: TransferJob, pool: SharedHostPool | None = None) -> JobResult:
        return self.handlers[job.route].complete(job, pool)
