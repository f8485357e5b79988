"""An engine rank in this process for the connector over a real daemon: random KV tensors (CPU)
registered with a connector of its own, and the polling of its finished loads and saves."""

from __future__ import annotations

import time

import numpy as np
import torch

from engine_client.client import connect
from engine_client.connector import ConnectorConfig, KVConnector, LoadResult
from kvcached.testing.blocks import random_bits

L, N, P, H, D = 3, 24, 16, 2, 32


MODEL = "connector-test"


SEED = 1201


class Engine:
    """One engine rank: its own KV tensors (random), registered with a connector of its own. Its
    lookups take every hit (policy always): these tests are about the mechanics; what the cost
    model decides is tested in tests/core/test_cost_model.py and test_cost_decisions.py."""

    def __init__(self, socket_path: str, kind: str = "layer", seed: int = SEED, num_blocks: int = N,
                 layers: int = L, heads: int = H, head_dim: int = D, config: ConnectorConfig | None = None,
                 **register):
        generator = torch.Generator().manual_seed(seed)
        self.kind = kind
        if kind == "pool":
            self.tensors = random_bits((2, layers, num_blocks, P, heads, head_dim), generator)
        elif kind == "layer":
            self.tensors = [random_bits((2, num_blocks, P, heads, head_dim), generator) for _ in range(layers)]
        else:    # "blocks": K and V packed inside each block
            self.tensors = [random_bits((num_blocks, 2, heads, P, head_dim), generator) for _ in range(layers)]
        self.connector = KVConnector.register(
            connect(socket_path, client_name=f"{kind}-{seed}"), self.tensors, kind, model_id=MODEL, page_size=P,
            num_kv_heads=heads, head_dim=head_dim, config=config or ConnectorConfig(report_interval_s=0, policy="always"), **register)
        self.loads: list[LoadResult] = []
        self.released: list = []

    def block(self, block_id: int) -> torch.Tensor:
        """Every byte the engine holds for one block (all layers, K and V)."""
        if self.kind == "pool":
            return self.tensors[:, :, block_id].contiguous().view(torch.int16).clone()
        parts = [t[:, block_id] if self.kind == "layer" else t[block_id] for t in self.tensors]
        return torch.stack(parts).view(torch.int16).clone()

    def poll_until(self, done, what: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            finished = self.connector.finished()
            self.loads += finished.loads
            self.released += finished.released
            if done():
                return
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.connector.stats()}"
            time.sleep(0.002)

    def settle(self) -> None:
        """Poll until every request has ended (its lease committed or released), and the daemon has
        handled those commits and releases (other sessions see them)."""
        self.poll_until(lambda: self.connector.stats()["requests_open"] == 0, "requests to end")
        self.connector.flush()

    def close(self) -> None:
        self.connector.close()


def random_tokens(rng, num_tokens: int) -> np.ndarray:
    return rng.integers(0, 100_000, size=num_tokens, dtype=np.int32)


def engine_of(daemon, seed: int, policy: str) -> Engine:
    return Engine(daemon.socket_path, "layer", seed=seed, config=ConnectorConfig(report_interval_s=0, policy=policy))


def save(engine: Engine, tokens, block_ids) -> None:
    request_id = f"save-{block_ids[0]}-{time.monotonic_ns()}"
    engine.connector.save(request_id, tokens, block_ids)
    engine.connector.request_finished(request_id)
    engine.settle()
