"""CacheManager.attach: the transfer backend it builds and what it reports to the daemon.

A stand-in client answers attach with a real /dev/shm segment and records reports, so no daemon runs
here; the wire path of ENGINE_REPORT is covered by tests/integration.
"""

from __future__ import annotations

import mmap
from typing import Any

import pytest
import torch

from engine_client.cache_manager import CacheManager
from engine_client.client import AttachInfo
from proto.messages import KVGeometry
from tests.engine_client.test_shared_pool import shm_segment

GEOMETRY = KVGeometry(model_id="test-model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16",
                      page_size=4)
NUM_HOST_PAGES = 6


class RecordingClient:
    """Answers attach() with a region of a real segment; keeps every report() body."""

    def __init__(self, shm_path: str):
        self.shm_path = shm_path
        self.reports: list[dict[str, Any]] = []
        self.closed = False
        self.generation = 1
        self.reattach_listeners: list = []

    def add_reattach_listener(self, listener) -> None:
        self.reattach_listeners.append(listener)

    def remove_reattach_listener(self, listener) -> None:
        self.reattach_listeners.remove(listener)

    def attach(self, geometry: KVGeometry) -> AttachInfo:
        return AttachInfo(session_id=1, namespace_id=0, shm_path=self.shm_path,
                          arena_offset_bytes=mmap.ALLOCATIONGRANULARITY, num_pages=NUM_HOST_PAGES,
                          bytes_per_page=geometry.bytes_per_page, heartbeat_interval_s=0.5,
                          session_timeout_s=1.5, max_frame_bytes=1 << 20, daemon_pid=0, protocol_version=1)

    def report(self, report: dict[str, Any]) -> None:
        self.reports.append(report)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def client():
    with shm_segment(mmap.ALLOCATIONGRANULARITY + NUM_HOST_PAGES * GEOMETRY.bytes_per_page) as path:
        yield RecordingClient(path)


def test_attach_defaults_to_auto_and_reports_the_backends_and_pinning(client):
    """attach() without a backend uses auto (torch on CPU) and sends one report holding the transfer
    engine's backend report and the pool's pinning facts (not pinned on CPU)."""
    manager = CacheManager.attach(client, GEOMETRY, num_l1_pages=8)
    try:
        assert len(client.reports) == 1
        report = client.reports[0]
        assert report["transfer"] == manager.transfer.backend_report()
        assert report["transfer"]["requested"] == "auto"
        assert report["transfer"]["chosen"] == {"D2H": "torch", "H2D": "torch"}
        assert report["pin_seconds"] is None and report["pin"]["requested"] is False
        manager.check_integrity()
    finally:
        manager.close()
    assert client.closed


def test_attach_with_an_unknown_backend_raises_and_sends_nothing(client):
    """An unknown backend name makes attach() raise ValueError before anything is reported."""
    with pytest.raises(ValueError, match="unknown transfer backend"):
        CacheManager.attach(client, GEOMETRY, num_l1_pages=8, backend="no-such-backend")
    assert client.reports == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attach_on_a_gpu_reports_the_pinning_time_once_background_pinning_is_done(client):
    """On a GPU the pool is pinned in the background; once pinning has finished, the latest report
    carries the pinning time (the attach report if it was done by then, else one sent by the next
    prepare())."""
    manager = CacheManager.attach(client, GEOMETRY, num_l1_pages=8, device="cuda")
    try:
        manager.host_pool.wait_until_pinned(timeout_s=30)
        assert client.reports[0]["transfer"]["requested"] == "auto"
        try:
            manager.prepare([5, 6, 7, 8, 9], backup=False)
        except AttributeError:
            pass      # the stand-in client has no match(); the report is sent before it is needed
        last = client.reports[-1]
        assert last["pin_seconds"] is not None and last["pin_seconds"] > 0
        assert last["pin"]["pinned_chunks"] == last["pin"]["chunks"] >= 1
    finally:
        manager.close()
