"""Two real engine processes and a real daemon: one backs up, the other restores bit for bit."""

from __future__ import annotations


import numpy as np
import pytest

from engine_client.client import connect
from proto.messages import KVGeometry
from kvcached.testing.daemon_proc import DaemonProcess
from kvcached.testing.engine_proc import run_engine


def test_engine_b_restores_what_engine_a_backed_up(daemon, tmp_path, rng):
    """Engine A backs up three random prefixes; engine B, another process, restores all of them
    from L2 into different L1 pages, equal bit for bit; daemon integrity holds after each phase."""
    state_path = str(tmp_path / "a.pt")
    backup = run_engine(daemon.socket_path, "backup", state_path, seed=int(rng.integers(2**31)))
    assert backup["prefixes"] == 3
    restore = run_engine(daemon.socket_path, "restore", state_path, seed=int(rng.integers(2**31)))
    for result in restore["results"]:
        assert result["restored_tokens"] == result["tokens"] // 16 * 16, result
        assert result["bit_exact"], result
        assert not result["same_pages_as_source"], result
    with connect(daemon.socket_path, timeout_s=5.0) as observer:
        status = observer.status(check_integrity=True)
    assert status["integrity"] == "ok"
    assert status["leases"] == 0 and status["sessions"] == []
    assert status["metrics"]["backup_pages_committed"] == backup["pages"]
    assert status["metrics"]["hit_tokens_l2"] >= sum(r["restored_tokens"] for r in restore["results"])


# 64 KiB pages in a 2 MiB pool: exactly 32 L2 pages.
SMALL = KVGeometry("pressure-model", num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16", page_size=16)


def test_l2_pressure_evicts_lru_prefixes_but_never_leased_ones(rng):
    """Over the wire, with a 32-page L2: backing up more than fits evicts the least recently used
    prefixes, while a prefix another engine holds a lease on stays, whatever its age.
    (L3 is off: a write-through in flight also protects its source pages, which would blur the LRU order.)"""
    daemon = DaemonProcess(l2_size="2MiB", extra_args=("--max-namespaces", "1", "--l3-size", "0")).start()
    try:
        writer = connect(daemon.socket_path, timeout_s=5.0, client_name="writer")
        reader = connect(daemon.socket_path, timeout_s=5.0, client_name="reader")
        assert writer.attach(SMALL).num_pages == 32
        reader.attach(SMALL)
        prefixes = [rng.integers(0, 150_000, size=10 * 16, dtype=np.int32) for _ in range(3)]
        for tokens in prefixes:
            reply = writer.acquire(tokens, save=True)
            assert len(reply.reserved_page_ids) == 10
            writer.commit(reply.lease_id, reply.reserved_page_ids)
        assert writer.flush() == []
        held = reader.acquire(prefixes[0])            # oldest prefix, now leased by the reader
        assert held.hit_tokens["l2"] == 160
        assert writer.status(check_integrity=True)["integrity"] == "ok"

        newcomer = rng.integers(0, 150_000, size=12 * 16, dtype=np.int32)   # 12 > 2 free pages
        reply = writer.acquire(newcomer, save=True)
        assert len(reply.reserved_page_ids) == 12
        writer.commit(reply.lease_id, reply.reserved_page_ids)
        assert writer.flush() == []
        status = writer.status(check_integrity=True)
        assert status["integrity"] == "ok"
        hits = []
        for tokens in prefixes:
            probe = writer.acquire(tokens, promote="none")     # look at L2 alone
            hits.append(probe.hit_tokens["l2"])
            if probe.lease_id is not None:
                writer.release(probe.lease_id)
        assert hits == [160, 0, 160], hits        # prefixes[1] was the least recently used unleased one
        assert status["metrics"]["evicted_pages_l2"] == 10
        reader.release(held.lease_id)
        assert reader.flush() == [] and writer.flush() == []
        assert writer.status(check_integrity=True)["integrity"] == "ok"
        writer.close()
        reader.close()
    finally:
        daemon.stop()
        daemon.cleanup()


@pytest.mark.gpu
def test_gpu_engines_restore_bit_for_bit(daemon, tmp_path):
    """The same end to end with L1 on the GPU and the shared segment pinned: restores are bit for bit."""
    state_path = str(tmp_path / "a.pt")
    run_engine(daemon.socket_path, "backup", state_path, seed=7, device="cuda")
    restore = run_engine(daemon.socket_path, "restore", state_path, device="cuda")
    assert restore["pinned"]
    for result in restore["results"]:
        assert result["bit_exact"] and not result["same_pages_as_source"], result
