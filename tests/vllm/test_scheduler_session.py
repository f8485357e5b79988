"""The vLLM connector's scheduler session comes and comes back by itself, with no lookup sent:
vLLM (and bench/vllm_check.py) may wait for it before sending any request. A real daemon over
ipc://, started late, then SIGKILLed and restarted."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

pytest.importorskip("vllm")

from engine_client.vllm_connector.attach import Attacher  # noqa: E402
from engine_client.vllm_connector.config import VLLMConnectorConfig  # noqa: E402
from engine_client.vllm_connector.scheduler import open_lookups  # noqa: E402
from proto.messages import KVGeometry  # noqa: E402
from kvcached.testing.daemon_proc import DaemonProcess  # noqa: E402

GEOMETRY = KVGeometry("vllm-session-model", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32",
                      page_size=128, layout="blocks", block_shape=(2, 128, 512), cache_salt="vllm-LBHNC")
SEED = 1213


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.02)


@pytest.mark.timeout(90)
def test_scheduler_session_attaches_and_reattaches_without_a_lookup():
    """With no daemon at start-up, the scheduler's lookups attach once one answers; with that
    daemon SIGKILLed and another started, the same client re-attaches (generation 2); neither
    needs a lookup, and lookups answer again afterwards."""
    daemon = DaemonProcess(l2_size="16MiB")
    attacher = None
    try:
        config = VLLMConnectorConfig(socket=daemon.socket_path, retry_interval_s=0.05)
        attacher = Attacher("the test's lookups", lambda: open_lookups(config, GEOMETRY),
                            lambda lookups: lookups.client.close(), config.retry_interval_s)
        assert attacher.result is None, "attached with no daemon"
        daemon.start()
        _wait(lambda: attacher.result is not None and attacher.result.client.is_attached(), 20.0,
              "the scheduler's session did not attach once the daemon answered")
        lookups = attacher.result
        assert lookups.client.generation == 1
        daemon.stop(signal.SIGKILL)
        daemon.start()
        _wait(lambda: lookups.client.is_attached() and lookups.client.generation == 2, 30.0,
              "the scheduler's session did not re-attach to the restarted daemon")
        assert attacher.result is lookups
        assert lookups.counters["lookups"] == 0, lookups.counters
        tokens = np.random.default_rng(SEED).integers(0, 1024, 4 * GEOMETRY.page_size, dtype=np.int32)
        assert lookups.lookup(tokens, timeout_s=5.0) == 0, f"seed {SEED}"
        assert not any(v for k, v in lookups.counters.items() if k.startswith("lookup_failures")), lookups.counters
    finally:
        if attacher is not None:
            result = attacher.close(5.0)
            if result is not None:
                result.client.close()
        daemon.cleanup()


@pytest.mark.parametrize("extra", [{"lookup_timeout_s": 0}, {"reply_timeout_s": "5"}, {"lookup_wait_s": -0.001},
                                   {"lookup_wait_s": 1.0}, {"client_timeout_s": -1.0}, {"lookup_timeout_s": True},
                                   {"lookup_wait_s": False}])
def test_a_bad_timing_in_kv_connector_extra_config_is_refused_with_its_name(extra):
    """Each timing key of kv_connector_extra_config must be a positive number (lookup_wait_s: at
    least 0, below lookup_timeout_s); a bad one is refused, naming the key."""
    (name,) = extra
    with pytest.raises(ValueError, match=name):
        VLLMConnectorConfig.from_extra(extra)
    assert VLLMConnectorConfig.from_extra({"lookup_timeout_s": 2, "lookup_wait_s": 0}).lookup_timeout_s == 2
