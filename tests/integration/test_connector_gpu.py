"""The connector with per-layer KV tensors on a GPU: bit for bit, and in order with the engine's stream."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from engine_client.client import connect
from engine_client.connector import ConnectorConfig, KVConnector
from kvcached.testing.daemon_proc import DaemonProcess

pytestmark = pytest.mark.gpu

L, N, P, H, D = 8, 64, 16, 8, 128        # 64 KiB per layer and block: a page is 1 MiB
SEED = 20261202
SLEEP_CYCLES = 200_000_000               # ~0.1 s of a GPU: far longer than any copy here


@pytest.fixture
def daemon():
    process = DaemonProcess(l2_size="512MiB").start()
    yield process
    process.cleanup()


class GpuEngine:
    def __init__(self, socket_path: str, seed: int, backend: str = "auto"):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        self.tensors = [torch.randint(-2**15, 2**15, (2, N, P, H, D), generator=generator, dtype=torch.int16,
                                      device="cuda").view(torch.bfloat16) for _ in range(L)]
        self.connector = KVConnector.register(connect(socket_path), self.tensors, "layer", model_id="gpu-test",
                                              page_size=P, num_kv_heads=H, head_dim=D,
                                              config=ConnectorConfig(backend=backend, report_interval_s=0,
                                                                     policy="always", layered_min_bytes=0))

    def block(self, block_id: int) -> torch.Tensor:
        return torch.stack([t[:, block_id] for t in self.tensors]).view(torch.int16).cpu()

    def fill(self, block_ids, seed: int) -> None:
        """Overwrite blocks with new random bits, queued on the current stream."""
        generator = torch.Generator(device="cuda").manual_seed(seed)
        for t in self.tensors:
            t[:, block_ids] = torch.randint(-2**15, 2**15, t[:, block_ids].shape, generator=generator,
                                            dtype=torch.int16, device="cuda").view(torch.bfloat16)


def save_all(engine: GpuEngine, request_id, tokens, block_ids) -> None:
    engine.connector.save(request_id, tokens, block_ids)
    engine.connector.request_finished(request_id)
    torch.cuda.synchronize()
    deadline = time.monotonic() + 10.0
    while engine.connector.stats()["requests_open"]:
        engine.connector.poll()
        assert time.monotonic() < deadline, engine.connector.stats()
    engine.connector.flush()            # the daemon has the commits: another engine's match sees them


def load_all(engine: GpuEngine, request_id, tokens, block_ids, num_tokens):
    engine.connector.load(request_id, tokens, block_ids, num_tokens)
    deadline, loads = time.monotonic() + 10.0, []
    while not loads:
        loads = engine.connector.finished().loads
        assert time.monotonic() < deadline, engine.connector.stats()
    engine.connector.request_finished(request_id)
    return loads[0]


def fragment_l2(socket_path: str, geometry, rng):
    """Take every free L2 page of the namespace with a one-page lease, then give back every other
    one: each page a save is given after this is a run of its own. Returns the client holding the rest."""
    client = connect(socket_path)
    client.attach(geometry)
    leases = []
    while True:
        reply = client.acquire(rng.integers(0, 100_000, size=P, dtype=np.int32), save=True)
        if not reply.reserved_page_ids:
            break
        leases.append((reply.reserved_page_ids[0], reply.lease_id))
    for _, lease_id in sorted(leases)[::2]:
        client.release(lease_id)
    assert client.flush() == []
    return client


@pytest.mark.parametrize("l2", ["contiguous", "fragmented"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_per_layer_tensors_round_trip_bit_for_bit(daemon, backend, l2):
    """Blocks saved from one engine's per-layer GPU tensors load into another engine's different
    blocks bit for bit, with the saved L2 pages in one run or each a run of its own."""
    rng = np.random.default_rng(SEED)
    a, b = GpuEngine(daemon.socket_path, SEED, backend), GpuEngine(daemon.socket_path, SEED + 1, backend)
    holder = fragment_l2(daemon.socket_path, a.connector.geometry, rng) if l2 == "fragmented" else None
    try:
        tokens = rng.integers(0, 100_000, size=20 * P, dtype=np.int32)
        source = rng.permutation(N)[:20]
        save_all(a, "r", tokens, source)
        assert a.connector.stats()["committed_pages"] == 20
        destination = np.setdiff1d(rng.permutation(N), source)[:20]
        result = load_all(b, "r", tokens, destination, 20 * P)
        assert result.ok, result
        for src, dst in zip(source, destination):
            assert torch.equal(b.block(dst), a.block(src)), (backend, l2, SEED, src, dst)
    finally:
        a.connector.close()
        b.connector.close()
        if holder is not None:
            holder.close()


def test_gpu_save_reads_blocks_only_after_the_callers_stream_wrote_them(daemon):
    """save() right after the engine queued (behind a long kernel) new bytes into the blocks saves
    the new bytes: the gather waits for the caller's stream."""
    rng = np.random.default_rng(SEED + 2)
    a, b = GpuEngine(daemon.socket_path, SEED + 2), GpuEngine(daemon.socket_path, SEED + 3)
    try:
        tokens = rng.integers(0, 100_000, size=4 * P, dtype=np.int32)
        torch.cuda._sleep(SLEEP_CYCLES)
        a.fill([0, 1, 2, 3], seed=SEED + 4)
        a.connector.save("r", tokens, [0, 1, 2, 3])
        a.connector.request_finished("r")
        save_all(a, "flush", rng.integers(0, 100_000, size=P, dtype=np.int32), [9])
        result = load_all(b, "r", tokens, [10, 11, 12, 13], 4 * P)
        assert result.ok
        for src, dst in zip([0, 1, 2, 3], [10, 11, 12, 13]):
            assert torch.equal(b.block(dst), a.block(src)), (SEED, src)
    finally:
        a.connector.close()
        b.connector.close()


def test_gpu_load_writes_blocks_only_after_the_callers_earlier_work(daemon):
    """Blocks the engine still writes (queued behind a long kernel) when it calls load() end up
    holding the loaded bytes: the scatter waits for the caller's stream."""
    rng = np.random.default_rng(SEED + 5)
    a, b = GpuEngine(daemon.socket_path, SEED + 5), GpuEngine(daemon.socket_path, SEED + 6)
    try:
        tokens = rng.integers(0, 100_000, size=4 * P, dtype=np.int32)
        save_all(a, "r", tokens, [0, 1, 2, 3])
        torch.cuda._sleep(SLEEP_CYCLES)
        b.fill([10, 11, 12, 13], seed=SEED + 7)          # the old request's last writes
        result = load_all(b, "r", tokens, [10, 11, 12, 13], 4 * P)
        torch.cuda.synchronize()
        assert result.ok
        for src, dst in zip([0, 1, 2, 3], [10, 11, 12, 13]):
            assert torch.equal(b.block(dst), a.block(src)), (SEED, src)
    finally:
        a.connector.close()
        b.connector.close()


def test_gpu_the_engines_stream_waits_for_every_open_load(daemon):
    """After wait_for_layer_load of every layer (no request ids: every open request's loads), work
    on the engine's stream sees the loaded blocks, with no host synchronisation in between (the
    load itself queued behind a long kernel)."""
    rng = np.random.default_rng(SEED + 8)
    a, b = GpuEngine(daemon.socket_path, SEED + 8), GpuEngine(daemon.socket_path, SEED + 9)
    try:
        tokens = rng.integers(0, 100_000, size=8 * P, dtype=np.int32)
        save_all(a, "r", tokens, list(range(8)))
        destination = list(range(20, 28))
        torch.cuda._sleep(SLEEP_CYCLES)
        b.connector.load("r", tokens, destination, 8 * P)
        for layer in range(L):                   # the blocks of every layer are read below
            b.connector.wait_for_layer_load(layer)
        seen = [torch.stack([t[:, block] for t in b.tensors]).clone() for block in destination]
        torch.cuda.synchronize()
        for i, block in enumerate(range(8)):
            assert torch.equal(seen[i].view(torch.int16).cpu(), a.block(block)), (SEED, block)
        b.connector.request_finished("r")
    finally:
        a.connector.close()
        b.connector.close()


def test_gpu_many_small_loads_wrap_the_id_ring_bit_for_bit(daemon):
    """Hundreds of small loads in a row (more block ids than the lane's id ring holds, so its slots
    are reused) each land bit for bit."""
    rng = np.random.default_rng(SEED + 10)
    a, b = GpuEngine(daemon.socket_path, SEED + 10), GpuEngine(daemon.socket_path, SEED + 11)
    try:
        tokens = rng.integers(0, 100_000, size=4 * P, dtype=np.int32)
        save_all(a, "r", tokens, [0, 1, 2, 3])
        capacity = b.connector.transfer.lanes["load"].ids.capacity
        for i in range(capacity // 4 + 50):
            destination = rng.choice(np.arange(4, N), size=4, replace=False)
            b.fill(destination.tolist(), seed=SEED + 100 + i)
            result = load_all(b, f"r{i}", tokens, destination, 4 * P)
            assert result.ok, (i, result)
            if i % 97 == 0 or i >= capacity // 4:
                for src, dst in zip([0, 1, 2, 3], destination):
                    assert torch.equal(b.block(dst), a.block(src)), (SEED, i, src, dst)
    finally:
        a.connector.close()
        b.connector.close()


def test_gpu_a_transfers_time_is_its_copies_not_its_wait_for_the_callers_stream(daemon):
    """A save queued behind ~0.1 s of the engine's own work is timed from its lane's start to its
    end (CUDA events): its time, and the D2H line the daemon learns from it, are a small part of
    that wait; the sample reaches the daemon with the connector's report."""
    rng = np.random.default_rng(SEED + 9)
    a = GpuEngine(daemon.socket_path, SEED + 9)
    try:
        tokens = rng.integers(0, 100_000, size=8 * P, dtype=np.int32)
        torch.cuda.synchronize()
        started = time.perf_counter()
        torch.cuda._sleep(SLEEP_CYCLES)
        a.connector.save("r", tokens, list(range(8)))
        a.connector.request_finished("r")
        torch.cuda.synchronize()
        waited_s = time.perf_counter() - started
        save_all(a, "flush", rng.integers(0, 100_000, size=P, dtype=np.int32), [9])
        a.connector.flush_report()
        a.connector.flush()
        d2h = a.connector.client.status()["cost_model"]["engines"][0]["directions"]["d2h"]
        assert d2h["samples_total"] == 2, d2h
        predicted_s = d2h["fixed_s"] + 8 * a.connector.geometry.bytes_per_page * d2h["slope_s_per_byte"]
        assert predicted_s < 0.2 * waited_s, (d2h, waited_s)
    finally:
        a.connector.close()


def test_gpu_the_engines_stream_waits_for_each_layer_alone(daemon):
    """A load queued behind a long kernel of the engine's stream, then for each layer in turn (the
    stream still in that kernel): the stream waits for that layer of the load (wait_for_layer_load with the request's id) and copies
    that layer of the destination blocks. Each copy holds the loaded bytes, with no host wait in
    between; the load has one distinct event per layer, the last one its completion."""
    rng = np.random.default_rng(SEED + 12)
    a, b = GpuEngine(daemon.socket_path, SEED + 12), GpuEngine(daemon.socket_path, SEED + 13)
    try:
        tokens = rng.integers(0, 100_000, size=24 * P, dtype=np.int32)
        source = list(range(24))
        save_all(a, "r", tokens, source)
        destination = list(range(30, 54))
        torch.cuda._sleep(SLEEP_CYCLES)      # the load starts after it, as do the stream's waits
        b.connector.load("r", tokens, destination, 24 * P)
        deadline = time.monotonic() + 10.0
        while not b.connector.finished().queued:
            assert time.monotonic() < deadline, b.connector.stats()
        (load,) = b.connector._requests["r"].loads
        events = load.transfer.layer_events
        assert len(events) == L and len({id(e) for e in events}) == L and events[-1] is load.transfer.done_event
        seen = []
        for layer in range(L):
            b.connector.wait_for_layer_load(layer, request_ids=["r"])
            seen.append(b.tensors[layer][:, destination].clone())
        torch.cuda.synchronize()
        for layer in range(L):
            expected = a.tensors[layer][:, source]
            assert torch.equal(seen[layer].view(torch.int16), expected.view(torch.int16)), (SEED, layer)
        b.connector.request_finished("r")
    finally:
        a.connector.close()
        b.connector.close()
