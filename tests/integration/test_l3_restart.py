"""A kept L3 file across daemon restarts (SIGTERM and SIGKILL): real daemon and engine processes.

Prefixes backed up before a restart are L3 hits after it and restore bit for bit into an engine;
what the daemon evicted is not served, a flipped byte in the file is caught by its checksum,
``--l3-fresh`` starts empty, and a temporary L3 writes no index.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import tempfile

import numpy as np
import torch

from engine_client.client import connect
from proto.page_keys import chain_page_keys
from kvcached.testing.daemon_proc import DaemonProcess
from kvcached.testing.engine_proc import GEOMETRY
from kvcached.testing.engine_proc import run_engine
from kvcached.testing.l3 import back_up_random, l2_l3, wait_for_write_through
from kvcached.testing.l3 import PAGE, RestartingDaemon, flip_byte


def l3_tier(status: dict) -> dict:
    return status["namespaces"][0]["tiers"]["l3"]


def new_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def assert_restored_whole(restore: dict, seed: int) -> None:
    for result in restore["results"]:
        assert result["restored_tokens"] == result["tokens"] // PAGE * PAGE, (seed, result)
        assert result["bit_exact"] and not result["same_pages_as_source"], (seed, result)


def test_prefixes_backed_up_before_a_sigterm_are_l3_hits_after_a_restart(tmp_path):
    """Engine A backs up three prefixes (written through to L3); the daemon is stopped with SIGTERM
    and started again on the same L3 file: its L3 holds those pages, and engine B restores every
    prefix from them (promoted to L2), bit for bit."""
    run = RestartingDaemon()
    seed = new_seed()
    try:
        run.start()
        backup = run_engine(run.daemon.socket_path, "backup", str(tmp_path / "a.pt"), seed=seed)
        with connect(run.daemon.socket_path, timeout_s=5.0) as observer:
            observer.attach(GEOMETRY)
            wait_for_write_through(observer)
        assert run.stop(signal.SIGTERM) == 0

        run.start()
        status = run.status()
        assert status["integrity"] == "ok"
        assert l3_tier(status)["owned_pages"] == backup["pages"], (seed, status["namespaces"])
        assert status["metrics"]["l3_pages_restored"] == backup["pages"]
        restore = run_engine(run.daemon.socket_path, "restore", str(tmp_path / "a.pt"))
        assert_restored_whole(restore, seed)
        status = run.status()
        assert status["integrity"] == "ok" and status["metrics"]["promotions"] >= 3
        assert status["metrics"].get("l3_checksum_mismatches", 0) == 0
        assert status["io"]["s2h"]["bytes"] == backup["pages"] * GEOMETRY.bytes_per_page
    finally:
        run.cleanup()


def test_what_was_indexed_before_a_sigkill_is_served_after_a_restart(tmp_path):
    """Once the write-throughs and their index rows are committed, a SIGKILLed daemon's successor
    serves every prefix from L3, bit for bit."""
    run = RestartingDaemon()
    seed = new_seed()
    try:
        run.start()
        backup = run_engine(run.daemon.socket_path, "backup", str(tmp_path / "a.pt"), seed=seed)
        run.wait_until_indexed()
        run.stop(signal.SIGKILL)

        run.start()
        assert l3_tier(run.status())["owned_pages"] == backup["pages"], seed
        assert_restored_whole(run_engine(run.daemon.socket_path, "restore", str(tmp_path / "a.pt")), seed)
        assert run.status()["integrity"] == "ok"
    finally:
        run.cleanup()


def test_a_sigkill_amid_evictions_and_reused_slots_serves_nothing_wrong(tmp_path):
    """Engine A backs up; a filler then overflows L3 (2048 slots), so that A's slots are evicted and
    written again with other pages; engine B backs up and the daemon is SIGKILLed at once, with
    write-throughs possibly in flight. After the restart A is not served at all (its rows went
    before its slots were reused), whatever of B is served is B's bytes, and no slot ever failed
    its checksum: the index never named a slot holding another page."""
    run = RestartingDaemon()
    seeds = new_seed(), new_seed()
    rng = np.random.default_rng([seeds[0], 1])     # not the engines' token streams
    try:
        run.start()
        run_engine(run.daemon.socket_path, "backup", str(tmp_path / "a.pt"), seed=seeds[0])
        a_tokens = [entry["tokens"] for entry in torch.load(str(tmp_path / "a.pt"), weights_only=False)]
        with connect(run.daemon.socket_path, timeout_s=5.0) as filler:
            filler.attach(GEOMETRY)
            status = wait_for_write_through(filler)
            capacity = l3_tier(status)["capacity_pages"]
            for _ in range(capacity // 128 + 1):
                back_up_random(filler, 128, rng)
                status = wait_for_write_through(filler)
            assert status["metrics"]["evicted_pages_l3"] >= 15, seeds
            assert [l2_l3(filler, tokens)[1] for tokens in a_tokens] == [0, 0, 0], seeds
        run_engine(run.daemon.socket_path, "backup", str(tmp_path / "b.pt"), seed=seeds[1])
        run.stop(signal.SIGKILL)

        run.start()
        for state, served in (("a.pt", False), ("b.pt", True)):
            restore = run_engine(run.daemon.socket_path, "restore", str(tmp_path / state))
            for result in restore["results"]:
                assert result["restored_part_bit_exact"], (seeds, state, result)
                if not served:
                    assert result["restored_tokens"] == 0, (seeds, state, result)
        status = run.status()
        assert status["integrity"] == "ok"
        assert status["metrics"].get("l3_checksum_mismatches", 0) == 0, seeds
    finally:
        run.cleanup()


def test_a_flipped_byte_in_the_l3_file_is_detected_and_not_served(tmp_path):
    """With one byte of page 2 of a 5-page prefix flipped in the file while the daemon was down,
    that prefix restores its first 2 pages only (bit for bit) and recomputes the rest; the mismatch
    is counted and pages 2..4 leave L3; the other prefixes restore whole."""
    run = RestartingDaemon()
    seed = new_seed()
    try:
        run.start()
        backup = run_engine(run.daemon.socket_path, "backup", str(tmp_path / "a.pt"), seed=seed)
        run.wait_until_indexed()
        assert run.stop(signal.SIGTERM) == 0
        saved = torch.load(str(tmp_path / "a.pt"), weights_only=False)
        assert len(saved[0]["tokens"]) == 5 * PAGE
        flip_byte(run.l3_path, run.index_path, saved[0]["tokens"], page=2,
                  byte_in_page=int(np.random.default_rng(seed).integers(GEOMETRY.bytes_per_page)))

        run.start()
        restore = run_engine(run.daemon.socket_path, "restore", str(tmp_path / "a.pt"))
        first, *others = restore["results"]
        assert first["restored_tokens"] == 2 * PAGE and first["restored_part_bit_exact"], (seed, first)
        for result in others:
            assert result["restored_tokens"] == result["tokens"] // PAGE * PAGE and result["bit_exact"], (seed, result)
        status = run.status()
        assert status["integrity"] == "ok"
        assert status["metrics"]["l3_checksum_mismatches"] == 1
        assert status["metrics"]["l3_pages_dropped_corrupt"] == 3
        assert l3_tier(status)["owned_pages"] == backup["pages"] - 3
    finally:
        run.cleanup()


def test_l3_fresh_starts_empty(tmp_path):
    """A restart with --l3-fresh finds nothing of the last run: no namespace, no L3 page, an
    engine restores nothing, and the index holds no row."""
    run = RestartingDaemon()
    seed = new_seed()
    try:
        run.start()
        run_engine(run.daemon.socket_path, "backup", str(tmp_path / "a.pt"), seed=seed)
        run.wait_until_indexed()
        assert run.stop(signal.SIGTERM) == 0

        run.start("--l3-fresh")
        status = run.status()
        assert status["namespaces"] == [] and "l3_pages_restored" not in status["metrics"]
        restore = run_engine(run.daemon.socket_path, "restore", str(tmp_path / "a.pt"))
        assert [r["restored_tokens"] for r in restore["results"]] == [0, 0, 0], seed
        assert run.stop(signal.SIGTERM) == 0
        reader = sqlite3.connect(run.index_path)
        try:
            assert reader.execute("SELECT COUNT(*) FROM slots").fetchone() == (0,)
        finally:
            reader.close()
    finally:
        run.cleanup()


def test_a_temporary_l3_writes_no_index():
    """Without --l3-path, L3 works (write-through happens) and no index file is made beside the
    temporary file, nor in the directory it was made in."""
    daemon = DaemonProcess().start()
    try:
        temp_dir = tempfile.gettempdir()
        before = {name for name in os.listdir(temp_dir) if name.endswith((".index", ".index-wal"))}
        with connect(daemon.socket_path, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
            back_up_random(client, 4, np.random.default_rng(new_seed()))
            status = wait_for_write_through(client)
        assert status["io"]["h2s"]["count"] == 1 and status["daemon"]["l3_index"] is None
        path = status["daemon"]["l3_file"]
        assert os.path.dirname(path) == temp_dir
        assert daemon.stop(signal.SIGTERM) == 0
        assert not any(os.path.exists(path + suffix) for suffix in (".index", ".index-wal", ".index-shm"))
        after = {name for name in os.listdir(temp_dir) if name.endswith((".index", ".index-wal"))}
        assert after <= before
    finally:
        daemon.cleanup()


def test_an_index_of_the_older_layout_is_refused_not_misread(tmp_path):
    """An L3 file whose index was written with the older layout (schema 1: a region per namespace)
    is not served from: the daemon says so in one warning, starts with an empty L3, and a prefix
    the old rows name is a miss, not bytes read from the wrong place (an older daemon would have
    served them from its region 0)."""
    from tests.server.test_l3_index_store import write_schema_1_index
    from kvcached.core.l3_index import SlotRow
    from proto.page_keys import ROOT_KEY

    run = RestartingDaemon()
    rng = np.random.default_rng(new_seed())
    try:
        tokens = rng.integers(0, 150_000, size=3 * PAGE, dtype=np.int32)
        keys = chain_page_keys(tokens, PAGE, 3)
        with open(os.open(run.l3_path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:     # as a daemon made it
            f.write(rng.bytes(16 << 20))
        rows = [SlotRow(page, keys[page], keys[page - 1] if page else ROOT_KEY,
                        tokens[page * PAGE:(page + 1) * PAGE].tobytes(), 0) for page in range(3)]
        write_schema_1_index(run.index_path, GEOMETRY, 0, 0, rows)     # the older daemon's first region
        run.start()
        status = run.status()
        assert status["integrity"] == "ok" and status["metrics"].get("l3_pages_restored", 0) == 0
        assert status["namespaces"] == []
        assert sum("older kvcached (schema 1" in line for line in run.daemon.log().splitlines()) == 1
        with connect(run.daemon.socket_path, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
            assert l2_l3(client, tokens) == (0, 0)
    finally:
        run.cleanup()
