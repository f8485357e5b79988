"""CacheManager.attach: the connector it registers and what it reports to the daemon.

The in-process fake daemon answers attach with a real /dev/shm segment and records reports, so no
daemon runs here; the wire path of ENGINE_REPORT is covered by tests/integration.
"""

from __future__ import annotations

import pytest
import torch

from engine_client.cache_manager import CacheManager
from kvcached.testing.fake_daemon import FakeDaemon
from proto.messages import KVGeometry

GEOMETRY = KVGeometry(model_id="test-model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16",
                      page_size=4)
NUM_HOST_PAGES = 6


@pytest.fixture
def client():
    daemon = FakeDaemon(NUM_HOST_PAGES)
    yield daemon
    daemon.cleanup()


def test_attach_registers_the_l1_pool_and_reports_the_connector(client):
    """attach() registers the L1 pool as a "pool" layout of the same geometry, with auto backends
    (torch on CPU), and reports them with the pool's pinning facts (not pinned on CPU); close()
    removes its re-attach listener and closes the client."""
    manager = CacheManager.attach(client, GEOMETRY, num_l1_pages=8)
    try:
        assert manager.connector.geometry == GEOMETRY
        assert client.reattach_listeners == [manager.connector._on_reattach]
        (report,) = client.reports
        connector = report["connector"]
        assert connector["layout"] == "pool" and connector["page_layout"] == "kv"
        assert connector["transfer"]["backends"] == {"save": "torch", "load": "torch"}
        assert connector["pin"]["requested"] is False
        assert connector["counters"] == manager.stats()
        manager.check_integrity()
    finally:
        manager.close()
    assert client.closed and client.reattach_listeners == []


def test_attach_with_an_unknown_backend_raises_and_sends_nothing(client):
    """An unknown backend name makes attach() raise ValueError before anything is reported."""
    with pytest.raises(ValueError, match="backend must be one of"):
        CacheManager.attach(client, GEOMETRY, num_l1_pages=8, backend="no-such-backend")
    assert client.reports == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attach_on_a_gpu_pins_the_pool_and_reports_the_pinning_time(client):
    """On a GPU the L2 pool is pinned at registration: the first report carries every chunk pinned
    and the pinning time."""
    manager = CacheManager.attach(client, GEOMETRY, num_l1_pages=8, device="cuda")
    try:
        pin = client.reports[0]["connector"]["pin"]
        assert manager.host_pool.is_pinned
        assert pin["requested"] is True and pin["pinned_chunks"] == pin["chunks"] >= 1
        assert pin["pin_seconds"] is not None and pin["pin_seconds"] > 0
    finally:
        manager.close()
