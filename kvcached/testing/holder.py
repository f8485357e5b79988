"""A holder: an engine process that takes leases (one on a committed prefix, one on an acquire's
reserved pages) and then sleeps, for the tests and drills that kill it mid-backup."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from kvcached.testing.daemon_proc import REPO_ROOT, child_env
from proto.messages import KVGeometry

GEOMETRY = KVGeometry("fault-model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", page_size=4)


HOLDER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from engine_client.client import connect
    from proto.messages import KVGeometry
    geometry = KVGeometry(**eval(sys.argv[2]))
    client = connect(sys.argv[1], timeout_s=5.0, client_name="holder")
    client.attach(geometry)
    rng = np.random.default_rng(int(sys.argv[3]))
    tokens = rng.integers(0, 50_000, size=64, dtype=np.int32)
    first = client.acquire(tokens, save=True)
    client.commit(first.lease_id, first.reserved_page_ids)
    assert client.flush() == []
    held = client.acquire(tokens)        # a lease on the committed pages
    more = client.acquire(rng.integers(0, 50_000, size=64, dtype=np.int32), save=True)
    print(f"READY {len(held.host_page_ids)} {len(more.reserved_page_ids)}", flush=True)
    time.sleep(600)
""")


def start_holder(socket_path: str, seed: int) -> tuple[subprocess.Popen, int, int]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, socket_path, repr(GEOMETRY.to_wire()), str(seed)],
                            env=child_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line and line[0] == "READY", f"holder failed to start: {line}"
    return proc, int(line[1]), int(line[2])
