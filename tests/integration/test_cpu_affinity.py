"""--socket-cpu (daemon) and connect(cpu=...) (client) put ZeroMQ's I/O thread, and the daemon's
socket thread, on the named CPU; a CPU the process may not use is refused clearly."""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine_client.client import connect
from kvcached.config import DaemonConfig
from proto.messages import KVGeometry
from kvcached.testing.daemon_proc import DaemonProcess

GEOMETRY = KVGeometry("affinity-model", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", page_size=16)
ZMQ_IO_THREAD = "ZMQbg/IO/0"


def threads_allowed_cpus(pid: int) -> dict[int, tuple[str, str]]:
    """tid -> (thread name, Cpus_allowed_list) of every thread of the process."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            name = f.read().strip()
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            allowed = next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list"))
        threads[int(tid)] = (name, allowed)
    return threads


def a_cpu() -> int:
    return max(os.sched_getaffinity(0))


def unusable_cpu() -> int:
    return max(os.sched_getaffinity(0)) + 1


def test_daemon_socket_cpu_pins_the_socket_and_io_threads_only():
    cpu = a_cpu()
    daemon = DaemonProcess(extra_args=("--socket-cpu", str(cpu))).start()
    try:
        with connect(daemon.socket_path, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
            tokens = np.random.default_rng().integers(1, 2**31 - 1, size=32, dtype=np.int32)
            reply = client.acquire(tokens, save=True)
            assert len(reply.reserved_page_ids) == 2
            client.release(reply.lease_id)
            assert client.flush() == []
            threads = threads_allowed_cpus(daemon.proc.pid)
        pinned = [name for name, allowed in threads.values() if allowed == str(cpu)]
        assert ZMQ_IO_THREAD in pinned, threads
        assert len(pinned) >= 2, threads                 # the socket thread too
        if len(os.sched_getaffinity(0)) > 1:
            assert len(pinned) < len(threads), threads   # but not the whole process
    finally:
        daemon.cleanup()


def test_client_cpu_pins_its_io_thread(daemon):
    cpu = a_cpu()
    with connect(daemon.socket_path, timeout_s=5.0, cpu=cpu) as client:
        client.attach(GEOMETRY)
        assert client.status()["leases"] == 0
        io_threads = [allowed for name, allowed in threads_allowed_cpus(os.getpid()).values()
                      if name == ZMQ_IO_THREAD and allowed == str(cpu)]
        assert io_threads, threads_allowed_cpus(os.getpid())


def test_unusable_cpus_are_refused(daemon):
    with pytest.raises(ValueError, match="not among the CPUs"):
        DaemonConfig(socket_path="/tmp/x.sock", l2_bytes=64 << 20, socket_cpu=unusable_cpu())
    with pytest.raises(ValueError, match="not among the CPUs"):
        connect(daemon.socket_path, cpu=unusable_cpu())
    failed = DaemonProcess(extra_args=("--socket-cpu", str(unusable_cpu())))
    with pytest.raises(RuntimeError, match="not among the CPUs"):
        failed.start()
    failed.cleanup()


@pytest.mark.parametrize("pinned", [False, True])
def test_a_client_pinned_to_a_cpu_yields_it_right_after_sending_an_awaited_request(monkeypatch, pinned):
    """With connect(cpu=...) the engine thread shares its CPU with ZeroMQ's I/O thread, which must
    run for a request to leave: sending a request whose reply is awaited yields the CPU once, and a
    request sent without waiting for its reply (a release) does not. An unpinned client does not
    yield there (its I/O thread runs elsewhere)."""
    from engine_client import client as client_module

    daemon = DaemonProcess().start()
    try:
        with connect(daemon.socket_path, timeout_s=5.0, cpu=a_cpu() if pinned else None) as client:
            client.attach(GEOMETRY)
            yields = []
            monkeypatch.setattr(client_module.os, "sched_yield", lambda: yields.append(1))
            tokens = np.random.default_rng().integers(1, 2**31 - 1, size=32, dtype=np.int32)
            pending = client.acquire_async(tokens, save=True)
            sent_yields = len(yields)
            lease_id = pending.result().lease_id            # a miss whose reservation is leased
            before_release = len(yields)
            client.release(lease_id)                        # not awaited: no yield
            release_yields = len(yields) - before_release
            monkeypatch.undo()
            assert client.flush() == []
        assert sent_yields == (1 if pinned else 0)
        assert release_yields == 0
    finally:
        daemon.cleanup()
