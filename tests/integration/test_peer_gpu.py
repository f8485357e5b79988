"""Peer restores on a GPU: two engine processes on the one GPU, the reader copying out of the
owner's GPU memory through CUDA IPC handles (the H200: ``pytest -m gpu``)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from engine_client.client import connect
from tests.integration.peer_engine import NUM_BLOCKS, PAGE, PREFIX_PAGES, prefixes, read_block
from tests.integration.test_peer import Reader, daemon, owners, wait_until  # noqa: F401 (fixtures)

pytestmark = pytest.mark.gpu


def test_b_restores_a_prefix_out_of_a_gpu_memory_bit_for_bit(daemon, owners, seed):
    """Engine A (its own process) holds prefixes in its GPU memory; engine B, on the same GPU,
    restores each into other blocks over CUDA IPC (nothing in L2), bit for bit, its other blocks
    untouched."""
    owner = owners(daemon.socket_path, seed, "hold", "cuda")
    reader = Reader(daemon.socket_path, "cuda")
    try:
        assert reader.connector.peer.transport == "cuda"
        reader.wait_for_peers()
        untouched = {block: read_block(reader.tensors, block) for block in range(PREFIX_PAGES + 1, NUM_BLOCKS)}
        for index, tokens in enumerate(prefixes(seed)):
            blocks = list(range(1, PREFIX_PAGES + 1))[::-1]
            result = reader.restore(tokens, blocks)
            assert result.ok and result.num_tokens == PREFIX_PAGES * PAGE, (result, seed)
            assert reader.check(seed, tokens, blocks, PREFIX_PAGES) == [], f"prefix {index} (seed {seed})"
        for block, before in untouched.items():
            assert torch.equal(read_block(reader.tensors, block), before), block
        stats = reader.connector.stats()
        assert stats["peer_loaded_pages"] == len(prefixes(seed)) * PREFIX_PAGES
        assert stats.get("saved_pages", 0) == 0
        owner.stop()
    finally:
        reader.connector.close()


def test_an_owner_reusing_gpu_blocks_never_hands_changed_bytes(daemon, owners, seed):
    """A refills its blocks with other prefixes (kernels queued: noise, then layer by layer) as fast
    as it can while B restores over and over: every page B keeps holds exactly its bytes."""
    owner = owners(daemon.socket_path, seed, "churn", "cuda")
    reader = Reader(daemon.socket_path, "cuda")
    loaded = 0
    try:
        reader.wait_for_peers()
        blocks = list(range(NUM_BLOCKS - PREFIX_PAGES, NUM_BLOCKS))
        rng = np.random.default_rng(seed)
        deadline = time.monotonic() + 10.0
        restores = 0
        while time.monotonic() < deadline or loaded < 20:
            assert time.monotonic() < deadline + 60.0, f"only {loaded} pages restored: {reader.connector.stats()}"
            tokens = prefixes(seed)[int(rng.integers(len(prefixes(seed))))]
            result = reader.restore(tokens, blocks)
            pages = result.num_tokens // PAGE
            assert reader.check(seed, tokens, blocks, pages) == [], f"restore {restores}: changed bytes kept (seed {seed})"
            loaded += pages
            restores += 1
        report = owner.stop()
        stats = reader.connector.stats()
        assert report["refills"] > 0 and loaded == stats["peer_loaded_pages"] > 0
        print(f"{restores} restores, {loaded} pages kept, {stats.get('peer_pages_changed', 0)} changed under a copy, "
              f"owner refilled {report['refills']} times")
    finally:
        reader.connector.close()


def test_a_killed_while_b_copies(daemon, owners, seed):
    """A is SIGKILLed right after B's copy out of its memory was queued: B keeps only A's exact
    bytes from that copy, nothing after; B's CUDA context stays usable; B closes its mapping of A
    (the IPC handles) and nobody is offered A any more."""
    owner = owners(daemon.socket_path, seed, "hold", "cuda")
    reader = Reader(daemon.socket_path, "cuda")
    try:
        reader.wait_for_peers()
        tokens = prefixes(seed)[2]
        blocks = list(range(NUM_BLOCKS - PREFIX_PAGES, NUM_BLOCKS))
        assert reader.restore(tokens, blocks).ok
        queued = reader.connector.stats()["peer_copies"]
        request_id = reader.start(tokens, blocks)
        wait_until(lambda: reader.connector.stats()["peer_copies"] > queued, "the copy to be queued",
                   reader.connector.poll)
        owner.proc.kill()
        result = reader.finish(request_id)
        assert reader.check(seed, tokens, blocks, result.num_tokens // PAGE) == [], (result, seed)
        owner.proc.wait(10)
        result = reader.restore(tokens, blocks)
        assert result.num_tokens == 0, result
        wait_until(lambda: reader.connector.stats().get("peers_closed", 0) == 1, "B to close its mapping of A",
                   reader.connector.poll)
        assert reader.connector.lookup(tokens) == 0
        check = torch.arange(1 << 20, device="cuda").sum().item()       # B's context still works
        assert check == (1 << 20) * ((1 << 20) - 1) // 2
        with connect(daemon.socket_path) as client:
            assert client.status(check_integrity=True)["integrity"] == "ok"
    finally:
        reader.connector.close()
