"""The pool over the real wire: a daemon serving several namespaces gives one geometry all of its
L2; a second geometry takes chunks from an idle first one, whose engine's prefixes in the chunks
it keeps still restore bit for bit while the second writes its own pages."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from engine_client.client import connect
from engine_client.shared_pool import SharedHostPool
from proto.messages import KVGeometry
from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess, child_env
from kvcached.testing.engine_proc import GEOMETRY
from kvcached.testing.engine_proc import run_engine
from kvcached.testing.l3 import back_up_random

PAGE = GEOMETRY.page_size
POOL_ARGS = ("--l3-size", "0", "--max-namespaces", "4")
NUM_PAGES = (8 << 20) // GEOMETRY.bytes_per_page      # 1024 pages of 8 KiB in 8 MiB: 256 per chunk
WIDE = KVGeometry("wide-model", num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16", page_size=16)


def l2_of(status: dict, model_id: str) -> dict:
    (namespace,) = [n for n in status["namespaces"] if n["geometry"]["model_id"] == model_id]
    return namespace["tiers"]["l2"]


def pressure_warnings(daemon: DaemonProcess) -> list[str]:
    return [line for line in daemon.log().splitlines() if "WARNING" in line and "is full" in line]


def test_one_geometry_fills_the_whole_pool(rng, seed):
    """With four namespaces allowed, the only geometry is given every page of the 8 MiB segment and
    fills it to the last before anything is evicted; then evictions are counted, status says the
    namespace is under pressure (the table with a warning line), and the daemon logs one warning
    for the episode."""
    daemon = DaemonProcess(l2_size="8MiB", extra_args=POOL_ARGS).start()
    try:
        with connect(daemon.socket_path, timeout_s=5.0) as client:
            assert client.attach(GEOMETRY).num_pages == NUM_PAGES, seed
            back_up_random(client, NUM_PAGES, rng)
            l2 = l2_of(client.status(check_integrity=True), "e2e-model")
            assert (l2["capacity_pages"], l2["owned_pages"], l2["evicted_pages"]) == (NUM_PAGES, NUM_PAGES, 0), l2
            assert not l2["under_pressure"] and pressure_warnings(daemon) == []
            back_up_random(client, 16, rng)
            back_up_random(client, 16, rng)
            status = client.status(check_integrity=True)
            l2 = l2_of(status, "e2e-model")
            assert status["integrity"] == "ok" and l2["evicted_pages"] >= 32 and l2["under_pressure"], l2
            assert status["pool"]["l2"]["free_chunks"] == 0
        assert len(pressure_warnings(daemon)) == 1, daemon.log()
        table = subprocess.run([sys.executable, "-m", "kvcached.cli", "status", "--socket", daemon.socket_path],
                               env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
        assert "WARNING ns 0 e2e-model l2: full, evicting cached pages" in table.stdout, table.stdout
    finally:
        daemon.cleanup()


def test_a_second_geometry_takes_space_from_an_idle_first_one(tmp_path, rng, seed):
    """A filler fills the pool with the first geometry, an engine process backs up three prefixes
    of it and exits: the namespace is idle. A client of a second geometry reserves 256 pages and
    writes random bytes into them through its mapping of the segment: it gets them from the
    first namespace's chunks (its cached pages there evicted, counted), and the engine's prefixes,
    in a chunk it kept, restore into a new engine bit for bit."""
    daemon = DaemonProcess(l2_size="8MiB", extra_args=POOL_ARGS).start()
    try:
        with connect(daemon.socket_path, timeout_s=5.0) as filler:
            filler.attach(GEOMETRY)
            back_up_random(filler, NUM_PAGES, rng)
        run_engine(daemon.socket_path, "backup", str(tmp_path / "a.pt"), seed=seed + 1)     # not the filler's tokens

        with connect(daemon.socket_path, timeout_s=5.0, client_name="wide") as wide:
            info = wide.attach(WIDE)
            assert info.num_pages == (8 << 20) // WIDE.bytes_per_page
            status = wide.status()
            assert l2_of(status, "e2e-model")["capacity_pages"] == NUM_PAGES
            assert l2_of(status, "wide-model")["capacity_pages"] == 0
            tokens = rng.integers(0, 150_000, size=256 * PAGE, dtype=np.int32)
            reply = wide.acquire(tokens, save=True)
            assert len(reply.reserved_page_ids) == 256, (seed, reply)
            pool = SharedHostPool.open(info.shm_path, info.num_pages, WIDE, pin=False)
            try:
                pages = pool.byte_view().view(-1, WIDE.bytes_per_page)
                noise = torch.from_numpy(rng.integers(0, 256, size=(256, WIDE.bytes_per_page), dtype=np.uint8))
                pages[torch.tensor(reply.reserved_page_ids)] = noise
                del pages
            finally:
                pool.close()
            wide.commit(reply.lease_id, reply.reserved_page_ids)
            assert wide.flush() == []
            status = wide.status(check_integrity=True)
        assert status["integrity"] == "ok"
        first, second = l2_of(status, "e2e-model"), l2_of(status, "wide-model")
        assert second["capacity_pages"] >= 256 and second["owned_pages"] == 256
        assert first["capacity_pages"] <= NUM_PAGES - 512 and first["evicted_pages"] > 0 and first["under_pressure"]
        assert status["metrics"]["chunks_taken_l2"] == 2, status["metrics"]

        restore = run_engine(daemon.socket_path, "restore", str(tmp_path / "a.pt"))
        assert restore["bit_exact"], (seed, restore)
        assert all(r["l2_hit_tokens"] == r["tokens"] // PAGE * PAGE for r in restore["results"]), (seed, restore)
    finally:
        daemon.cleanup()
