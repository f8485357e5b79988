"""The connector's configuration, and what a request's match gave it (``KVConnector.wait_for_match``)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from engine_client.kv_transfer import DEFAULT_WORKSPACE_BYTES

# Timings go to the daemon this soon (with a report), so that its cost model decides on fresh ones.
COST_REPORT_INTERVAL_S = 0.1


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    save: bool = True                  # reserve L2 pages for each request's new blocks, and save them
    promote_l3: bool = True            # a load's match first brings pages only L3 holds into L2
    backend: str = "auto"              # gather/scatter: "auto" (timed on CUDA; torch on CPU), "triton", "torch"
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES     # packed device buffer, per direction
    reply_timeout_s: float = 5.0       # a match unanswered this long is given up (loads fail, saves skip)
    report_interval_s: float = 1.0     # how often changed counters (and timings) go to the daemon
    policy: str = ""                   # restore policy: "cost", "always", "never" ("": the daemon's)
    # Loads go group by group of layers, so that wait_for_layer_load waits for a layer's group
    # alone (engines whose prefill runs while a load is in flight); False: every load whole, the
    # fewest host calls (engines that wait for a load's result). A load under layered_min_bytes
    # goes whole anyway: queueing it group by group would take the host about as long as its DMA.
    layered_loads: bool = True
    layered_min_bytes: int = 64 << 20
    # Peer restores (engine_client/peer.py): register this engine's KV tensors for other engines of
    # the namespace on its device to copy from, and load a prefix from theirs when the daemon's
    # decision chooses another engine's GPU cache (one tensor-parallel rank only).
    peer: bool = False
    # ``begin`` answers "recompute" at once where the daemon's admission hints show it would
    # decline every restore (no round trip before the request's prefill); False: always wait.
    predict: bool = True


class RequestLease(NamedTuple):
    """What a request's match gave it (``KVConnector.wait_for_match``)."""

    lease_id: int | None               # None: nothing leased (nothing hit or reserved, or no match)
    hit_tokens: int                    # leading tokens its loads can fill: the L2 hit (L3 promotions in)
    host_page_ids: np.ndarray          # the hit's L2 pages, locked by the lease
    reserved_page_ids: np.ndarray      # private L2 pages its saves write, pages hit_tokens // page_size on
    failure: str | None                # why the match failed (None when it did not)
