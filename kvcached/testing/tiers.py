"""See and force where a prefix is cached, through a session of its own on the engine's namespace:
the hit per tier without changing anything, and L2 emptied by taking every page L2 can free in one
reservation and giving it back (the daemon evicts its LRU L2 leaves to fill it, and only their L2
residency goes, so a prefix written through to L3 is then held by L3 alone). For the benchmarks'
forced tiers and the tests of what the daemon decides per tier."""

from __future__ import annotations

import os
import time

import numpy as np

from engine_client.client import KVCacheClient, connect
from proto.messages import KVGeometry

SETTLE_TIMEOUT_S = 120.0


class TierControl:
    """A session of its own on the engine's namespace, to see and force where a prefix is cached."""

    def __init__(self, daemon, geometry: KVGeometry):
        """daemon: what serves the namespace (its socket_path; its l3_path for drop_l3_page_cache)."""
        self.daemon = daemon
        self.geometry = geometry
        self.client: KVCacheClient = connect(daemon.socket_path, timeout_s=60.0, client_name="tier-control")
        try:
            self.num_l2_pages = self.client.attach(geometry).num_pages
        except BaseException:
            self.client.close()
            raise
        self._rng = np.random.default_rng(0x7133)

    def hits(self, token_ids, remote: bool = False) -> dict[str, int]:
        """Leading tokens of token_ids each tier holds (whole pages); changes nothing (a plain
        lookup starts no background promotion either). remote: the store is asked too (a lookup
        with prefetch, on a daemon without L3: nothing to promote), "remote" the
        leading tokens L2 and the store hold together."""
        reply = self.client.lookup_async(np.asarray(token_ids, dtype=np.int32), prefetch=remote).result()
        return {"l2": reply.hit_tokens.get("l2", 0), "l3": reply.hit_tokens.get("l3", 0),
                "remote": reply.hit_tokens.get("remote", 0)}

    def evict_l2(self) -> int:
        """Evict every L2 page no lease holds (L3 keeps its copies): reserve as many pages as L2
        has, which evicts what it must, and give them back. A session may reserve only part of a
        namespace's pages, so the reservations are spread over sessions held at once. Returns the
        pages reserved."""
        clients = [self.client]
        held: list[tuple[KVCacheClient, int]] = []
        reserved = 0
        try:
            while reserved < self.num_l2_pages and len(clients) <= 8:
                client = clients[-1]
                wanted = self.num_l2_pages - reserved
                tokens = self._rng.integers(1, 2**31 - 1, size=wanted * self.geometry.page_size, dtype=np.int32)
                reply = client.acquire(tokens, save=True, promote="none")
                if reply.lease_id is not None:
                    held.append((client, reply.lease_id))
                if not reply.reserved_page_ids:
                    break                       # nothing more can be freed: what is left is leased
                reserved += len(reply.reserved_page_ids)
                if reserved < self.num_l2_pages:
                    extra = connect(self.daemon.socket_path, timeout_s=60.0, client_name="tier-control-extra")
                    clients.append(extra)
                    extra.attach(self.geometry)
        finally:
            for client, lease_id in held:
                client.release(lease_id)
            errors = [error for client in clients for error in client.flush()]
            for client in clients[1:]:
                client.close()
        if errors:
            raise RuntimeError(f"the daemon refused the eviction's releases: {errors}")
        return reserved

    def drop_l3_page_cache(self) -> None:
        """Write back and drop the L3 file's pages from the page cache: the next read goes to disk."""
        fd = os.open(self.daemon.l3_path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def wait_idle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        """Until the daemon has no L2 <-> L3 move pending (write-throughs done, to the remote store
        too)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pending = self.client.status()["pending"]
            if pending["h2s"] == 0 and pending["s2h"] == 0 and pending.get("h2r", 0) == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon L3 moves or remote writes still pending after {timeout_s} s: {pending}")
            time.sleep(0.002)

    def force(self, tier: str, token_ids, num_tokens: int) -> dict[str, int]:
        """Make the next load of token_ids' first num_tokens tokens come from ``tier`` ("l2": as it
        is; "l3", "l3-cold": L2 emptied, and for "l3-cold" L3's page cache too; "remote": L2
        emptied on a daemon without L3, the store holding it); raises unless the tiers then hold
        it so. Returns the hits per tier it checked."""
        if tier in ("l3", "l3-cold", "remote"):
            self.evict_l2()
            if tier == "l3-cold":
                self.drop_l3_page_cache()
        elif tier != "l2":
            raise ValueError(f"no tier {tier!r} to force (one of l2, l3, l3-cold, remote)")
        hits = self.hits(token_ids, remote=tier == "remote")
        wanted = {"l2": hits["l2"] >= num_tokens,
                  "l3": hits["l2"] == 0 and hits["l3"] >= num_tokens,
                  "re": hits["l2"] == 0 and hits["l3"] == 0 and hits["remote"] >= num_tokens}[tier[:2]]
        if not wanted:
            raise RuntimeError(f"could not force tier {tier} for {num_tokens} tokens: hits {hits}")
        return hits

    def integrity(self) -> str:
        return self.client.status(check_integrity=True)["integrity"]

    def counts(self) -> dict[str, float]:
        """The daemon's counters so far (status "metrics"), with its handling of ACQUIRE requests as
        ``acquire_seconds`` and ``acquire_count`` (status "histograms", request_seconds_acquire): every
        session's. Two of them around a run give what the run cost the daemon."""
        status = self.client.status()
        histogram = status["histograms"].get("request_seconds_acquire", {"sum": 0.0, "count": 0})
        return {**status["metrics"], "acquire_seconds": histogram["sum"], "acquire_count": histogram["count"]}

    def cost_model(self) -> dict:
        """The daemon's cost model as its status shows it (per engine and direction, decisions)."""
        return self.client.status()["cost_model"]

    def close(self) -> None:
        self.client.close()
