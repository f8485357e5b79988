"""Engine-side edges (issue 41, items 11 and 12): what an engine meets first, each on a real
daemon process over ipc://."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from engine_client.cache_manager import CacheManager
from engine_client.client import ConnectionState, DaemonUnavailable, connect
from engine_client.connector import KVConnector
from proto.messages import KVGeometry
from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess, child_env
from kvcached.testing.daemon_proc import wait_until
from kvcached.testing.managers import engine_warnings, prefill_and_finish, random_tokens

DROP_WITHOUT_CLOSE = """
import gc, sys
import torch
from engine_client.client import connect
from engine_client.connector import KVConnector
c = connect(sys.argv[1])
del c
gc.collect()
client = connect(sys.argv[1])
try:          # a registration that fails (dtype= contradicts the tensors), caught; the client dropped
    KVConnector.register(client, torch.zeros(2, 2, 4, 16, 2, 32, dtype=torch.float16), "pool",
                         model_id="m", page_size=16, num_kv_heads=2, head_dim=32, dtype="bfloat16")
except ValueError:
    pass
del client
gc.collect()
print("collected", flush=True)
"""


def test_a_client_dropped_without_close_is_collected(daemon):
    """``c = connect(); del c; gc.collect()`` returns (the ZeroMQ context is not left to wait for
    a live socket), also for a client whose registration failed and was caught: in a subprocess
    that must end within 30 s."""
    done = subprocess.run([sys.executable, "-c", DROP_WITHOUT_CLOSE, daemon.socket_path], env=child_env(),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "collected", done.stderr[-2000:]


def test_a_dtype_that_contradicts_the_tensors_is_refused(daemon):
    """float16 tensors registered as dtype="bfloat16" are refused with a clear error (they would
    share pages with bfloat16 engines: 1.0 read back as 0.0078125); dtype= naming their own dtype
    is accepted."""
    tensors = torch.zeros(2, 2, 4, 16, 2, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="contradicts the KV tensors, which are float16"):
        KVConnector.register(connect(daemon.socket_path), tensors, "pool", model_id="m", page_size=16,
                             num_kv_heads=2, head_dim=32, dtype="bfloat16")
    with KVConnector.register(connect(daemon.socket_path), tensors, "pool", model_id="m", page_size=16,
                              num_kv_heads=2, head_dim=32, dtype="float16") as connector:
        assert connector.geometry.dtype == "float16"


@pytest.mark.parametrize("num_kv_heads,page_size", [(1, 16), (2, 1), (1, 1)])
def test_one_kv_head_and_one_token_pages_are_accepted(daemon, num_kv_heads, page_size):
    """CacheManager.attach takes 1 KV head and pages of 1 token (their block's byte shape lacks the
    size-1 dims, its bytes are the default key's); what one engine backs up, another restores bit
    for bit into other pages."""
    seed = 1100 + 10 * num_kv_heads + page_size
    rng = np.random.default_rng(seed)
    geometry = KVGeometry("edge-model", num_layers=2, num_kv_heads=num_kv_heads, head_dim=32, dtype="bfloat16",
                          page_size=page_size)
    writer = CacheManager.attach(connect(daemon.socket_path), geometry, num_l1_pages=64)
    reader = CacheManager.attach(connect(daemon.socket_path), geometry, num_l1_pages=64)
    try:
        assert writer.connector.geometry == geometry
        reader.prepare(random_tokens(rng, 3 * page_size), save=False)   # other L1 pages than the writer's
        tokens = random_tokens(rng, 5 * page_size)
        plan = writer.prepare(tokens)
        kv = writer.l1_pool.kv
        generator = torch.Generator().manual_seed(seed)
        for page in plan.new_l1_page_ids:
            kv[:, :, page] = (torch.randn(kv[:, :, page].shape, generator=generator) + 0.5).to(kv.dtype)
        expected = writer.read_tokens_kv(plan.new_l1_page_ids)
        assert writer.finish(plan) == 5 and writer.client.flush() == []
        restored = reader.prepare(tokens, save=False)
        assert restored.restored_tokens == len(tokens), f"seed {seed}"
        assert torch.equal(reader.read_tokens_kv(restored.l1_page_ids).view(torch.int16), expected.view(torch.int16))
        reader.finish(restored)
    finally:
        writer.close()
        reader.close()


def test_an_empty_token_list_is_an_empty_lookup(daemon):
    """An empty token list (a Python list, so numpy makes it float64) is a valid lookup: zero hit,
    no error, from the client and from the connector."""
    geometry = KVGeometry("edge-empty", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", page_size=16)
    manager = CacheManager.attach(connect(daemon.socket_path), geometry, num_l1_pages=8)
    try:
        assert manager.client.lookup_async([]).result().hit_tokens == {"l2": 0, "l3": 0}
        assert manager.connector.lookup([]) == 0
        assert manager.stats().get("lookup_failures_unavailable", 0) == 0
    finally:
        manager.close()


def test_connect_waits_for_a_daemon_started_after_the_engine():
    """connect(wait_s=...) waits, bounded, for the daemon's socket: an engine started before its
    daemon attaches once it is there; with no daemon at all, DaemonUnavailable after wait_s."""
    daemon = DaemonProcess()
    try:
        started = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="wait_s=0.3"):
            connect(daemon.socket_path, wait_s=0.3)
        assert 0.3 <= time.monotonic() - started < 3.0
        starter = threading.Timer(0.5, daemon.start)
        starter.start()
        with connect(daemon.socket_path, wait_s=30.0) as client:
            starter.join()
            geometry = KVGeometry("edge-late", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16",
                                  page_size=16)
            client.attach(geometry)
            assert client.acquire(np.arange(32, dtype=np.int32)).hit_tokens["l2"] == 0
    finally:
        daemon.cleanup()


def test_register_at_max_namespaces_runs_without_the_cache_then_attaches_by_itself(caplog):
    """A daemon at --max-namespaces: register does not raise; the engine runs without the cache
    (one warning; its requests are misses counted daemon_down), and once the other engine's
    namespace is idle it attaches by itself and backs up and restores, bit for bit."""
    seed = 1200
    rng = np.random.default_rng(seed)
    caplog.set_level(logging.INFO)
    daemon = DaemonProcess(extra_args=("--max-namespaces", "1")).start()
    first = second = None
    try:
        geometry_a = KVGeometry("edge-a", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", page_size=16)
        geometry_b = KVGeometry("edge-b", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", page_size=16)
        first = CacheManager.attach(connect(daemon.socket_path), geometry_a, num_l1_pages=32)
        second = CacheManager.attach(connect(daemon.socket_path), geometry_b, num_l1_pages=32)
        assert second.client.state is ConnectionState.DOWN
        warnings = engine_warnings(caplog)
        assert len(warnings) == 1 and "without the kvcached cache" in warnings[0] and "namespaces" in warnings[0], \
            warnings
        plan = second.prepare(random_tokens(rng, 4 * 16))
        assert plan.num_cached_tokens == 0 and plan.lease_id is None
        assert second.finish(plan) == 0
        assert second.stats()["match_failures_daemon_down"] == 1, second.stats()

        first.close()
        first = None
        wait_until(lambda: second.client.is_attached(), 10.0, "attached once a namespace is free")
        tokens = random_tokens(rng, 5 * 16)

        expected = None
        deadline = time.monotonic() + 10.0
        while expected is None and time.monotonic() < deadline:     # until the new pool is swapped in
            expected, count = prefill_and_finish(second, tokens, seed)
            if count != 5:
                expected = None
                second.l1_pool.free(second.l1_index.evict(second.l1_index.num_cached_pages))
                time.sleep(0.05)
        assert expected is not None, "no backup within 10 s of the attach"
        assert second.client.flush() == []
        second.l1_pool.free(second.l1_index.evict(second.l1_index.num_cached_pages))
        restored = second.prepare(tokens, save=False)
        assert restored.restored_tokens == len(tokens), f"seed {seed}"
        assert torch.equal(second.read_tokens_kv(restored.l1_page_ids).view(torch.int16), expected.view(torch.int16))
        second.finish(restored)
        assert len(engine_warnings(caplog)) == 1, engine_warnings(caplog)
    finally:
        for manager in (first, second):
            if manager is not None:
                manager.close()
        daemon.cleanup()
