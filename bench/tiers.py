"""kvcached around the reference engine, for the time-to-first-token benchmarks: a daemon sized for
a run, the engine's connector plugged in, and the tier the next request restores from forced.

The engine (``bench.engine``) takes ``engine_client``'s ``KVConnector`` as it is: its per-layer KV
tensors ``[2, num_blocks, block_size, kv_heads, head_dim]`` are the connector's "layer" layout,
and the calls it makes (lookup, load, save, finished, request_finished) are the connector's.
``attach_kvcached`` registers them and plugs the connector in; its lookups take every hit (restore
policy "always") unless another policy is named.

Forcing a tier needs no switch in the daemon or the connector. A second session on the engine's
namespace (``kvcached.testing.tiers.TierControl``) looks at the hit per tier without changing anything, and empties L2
by taking every page L2 can free in one reservation and giving it back: the daemon evicts its LRU
L2 leaves to fill it, and only their L2 residency goes, so a prefix written through to L3 is then
held by L3 alone, and the engine's next load of it is an L3 -> L2 promotion, then a DMA. A cold
L3 read is a daemon started with ``--l3-o-direct`` whose L3 file's page cache is dropped as well.
The remote tier is another host's memory: a Mooncake master and a daemon lending the store its
memory (``RemoteHost``), and the engine's daemon with the remote tier on, no L3 and lending none,
so that what its L2 lost comes back from the store over TCP; forced by emptying its L2 likewise.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time

import torch

from bench.engine import Engine
from engine_client.client import connect
from engine_client.connector import ConnectorConfig, KVConnector
from kvcached.testing.daemon_proc import DaemonProcess
from kvcached.testing.tiers import SETTLE_TIMEOUT_S, TierControl

# none: recompute; l3: warm page cache; l3-cold: O_DIRECT; peer: another engine's GPU cache
# (bench.peer_owner), copied GPU to GPU; remote: the Mooncake Store, another host's memory
TIERS = ("none", "l2", "l3", "l3-cold", "peer", "remote")
ARENA_ALIGN_BYTES = 2 << 20


def align_up(num_bytes: int, alignment: int = ARENA_ALIGN_BYTES) -> int:
    return -(-num_bytes // alignment) * alignment


class KVDaemon:
    """A ``kvcached serve`` process for a run: one namespace (it holds the whole L2), L3 in a
    file of a directory of its own (removed by ``stop``; none where l3_bytes is 0), started empty."""

    def __init__(self, l2_bytes: int, l3_bytes: int, *, o_direct: bool = False, l3_dir: str | None = None,
                 start_timeout_s: float = 120.0, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None):
        self.o_direct = o_direct
        self.l3_dir = tempfile.mkdtemp(prefix="kvl3-", dir=l3_dir)
        self.l3_path = os.path.join(self.l3_dir, "l3.bin")
        extra = ["--max-namespaces", "1", "--log-level", "WARNING", "--l3-size", str(align_up(l3_bytes))]
        if l3_bytes:
            extra += ["--l3-path", self.l3_path, "--l3-fresh"]
        if o_direct:
            extra.append("--l3-o-direct")
        extra += extra_args
        self.process = DaemonProcess(l2_size=str(align_up(l2_bytes)), extra_args=tuple(extra), env=env)
        try:
            self.process.start(timeout_s=start_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def socket_path(self) -> str:
        return self.process.socket_path

    def stop(self) -> None:
        try:
            if self.process.alive():
                self.process.stop()
        finally:
            self.process.cleanup()
            shutil.rmtree(self.l3_dir, ignore_errors=True)

    def __enter__(self) -> "KVDaemon":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class RemoteHost:
    """The remote tier's other host: a real ``mooncake_master`` and a daemon lending the store
    ``lend_bytes`` of its memory, where every value the engine's daemon writes through lands
    (``kvcached/testing/remote/cluster.py``). Its processes must run in a network namespace of
    loopback only (some of the store's listeners bind 0.0.0.0): ``bench.bench_ttft`` enters one."""

    def __init__(self, lend_bytes: int):
        from kvcached.testing.remote.cluster import Master, connected, remote_daemon, wait_for

        self.master = Master(client_ttl_s=10).start()
        self.lender = remote_daemon(segment=str(align_up(lend_bytes)), extra_args=("--log-level", "WARNING"))
        try:
            self.lender.start()
            wait_for(self.lender, connected, "the lending daemon connected to the store", timeout_s=60.0)
        except BaseException:
            self.stop()
            raise

    def daemon_args(self) -> tuple[str, ...]:
        """A daemon's arguments for the remote tier on this store, lending none of its memory (every
        restore crosses TCP from the lender's segment), with deadlines a busy host keeps."""
        from kvcached.testing.remote.cluster import MASTER_URL, PATIENT_REMOTE

        return ("--remote", MASTER_URL, "--remote-segment-size", "0", *PATIENT_REMOTE)

    def stop(self) -> None:
        try:
            self.lender.cleanup()
        finally:
            self.master.cleanup()

    def __enter__(self) -> "RemoteHost":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def attach_kvcached(engine: Engine, socket_path: str, *, model_id: str, model_revision: str = "",
                    client_name: str = "engine", config: ConnectorConfig | None = None,
                    policy: str = "always", **connect_args) -> KVConnector:
    """Register the engine's KV tensors with a connector of its own (its own session) and plug it
    in; the engine must be idle. ``policy``: the connector's restore policy (without ``config``):
    "always" forces every hit to be restored, "cost" leaves it to the daemon's cost model.
    ``connect_args``: more of ``connect``'s (``cpu``, ``spin_s``)."""
    model_config = engine.model.config
    connector = KVConnector.register(
        connect(socket_path, timeout_s=60.0, client_name=client_name, **connect_args), engine.kv_caches, "layer",
        model_id=model_id, model_revision=model_revision, page_size=engine.block_size,
        num_kv_heads=model_config.num_kv_heads, head_dim=model_config.head_dim,
        # Layered loads only where the engine prefills while a load is in flight.
        config=dataclasses.replace(config or ConnectorConfig(policy=policy),
                                   layered_loads=engine.config.load_mode == "layerwise"))
    try:
        engine.attach_connector(connector)
    except BaseException:
        connector.close()
        raise
    return connector


def detach_kvcached(engine: Engine) -> None:
    """Take the engine's connector out (once the engine is idle) and close it."""
    connector = engine.connector
    if connector is None:
        return
    run_to_idle(engine)
    engine.attach_connector(None)
    connector.close()


def run_to_idle(engine: Engine, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished():
        engine.step()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine did not finish its requests within {timeout_s} s")


def run_request(engine: Engine, token_ids, max_new_tokens: int, timeout_s: float = SETTLE_TIMEOUT_S):
    """Add a request and step the engine until it is finished (work the connector still does for it
    afterwards, its saves, goes on in later steps)."""
    request = engine.add_request(token_ids, max_new_tokens)
    deadline = time.monotonic() + timeout_s
    while request.finish_s is None:
        engine.step()
        if time.monotonic() > deadline:
            raise TimeoutError(f"request {request.request_id} did not finish within {timeout_s} s")
    return request


def prefix_kv(engine: Engine, token_ids) -> torch.Tensor:
    """A copy of the KV bytes the engine's prefix cache holds for the leading full blocks of
    token_ids: [layers, 2, blocks, block_size, kv_heads, head_dim * itemsize] bytes (uint8, on the
    engine's device), for comparing bit for bit."""
    block_ids = engine.cached_block_ids(token_ids)
    index = torch.tensor(block_ids, dtype=torch.int64, device=engine.device)
    return torch.stack([kv.index_select(1, index) for kv in engine.kv_caches]).view(torch.uint8)


def settle(engine: Engine, control: TierControl | None = None, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """The engine idle, its connector's leases ended and handled by the daemon, and the daemon's
    write-throughs done: what a timed request must not overlap."""
    run_to_idle(engine, timeout_s)
    connector = engine.connector
    if connector is None:
        return
    deadline = time.monotonic() + timeout_s
    while connector.num_open_requests:
        connector.poll()
        if time.monotonic() > deadline:
            raise TimeoutError(f"connector leases still open after {timeout_s} s: {connector.stats()}")
        time.sleep(0.0005)
    connector.flush()
    if control is not None:
        control.wait_idle(timeout_s)
