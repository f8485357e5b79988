"""A daemon restart where /dev/shm cannot hold two L2 pools, with two live engines.

    unshare --mount sh -c 'mount -t tmpfs -o size=100M tmpfs /dev/shm && \
        python -m kvcached.testing.small_shm --signal KILL'

Run as root in a private mount namespace (``run_in_small_shm``), so that the real /dev/shm is not
touched. A 64 MiB L2, two engines that back up and restore; the daemon is stopped by the signal,
the engines see it down and drop its pool, a new daemon starts on the same socket (it needs the
room of the old pool), and each engine restores, bit for bit, what the other backed up into the
new daemon. With ``--idle`` the engines make no call at all from the signal until the new daemon
runs (an idle engine makes no scheduler steps): the pool must go without one. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import torch

from engine_client.client import ConnectionState
from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess, child_env, wait_until
from kvcached.testing.engine_proc import GEOMETRY
from kvcached.testing.managers import (
    make_manager,
    prefill_and_finish,
    random_tokens,
    segment_mapped,
)

L2_SIZE = "64MiB"
SHM_SIZE = "100M"
PAGE = GEOMETRY.page_size


def hit_exactly(reader, tokens: np.ndarray, expected: torch.Tensor, timeout_s: float) -> float:
    """Seconds until ``reader`` restores ``tokens`` from L2, compared bit for bit with ``expected``."""
    started = time.monotonic()

    def restored():
        plan = reader.prepare(tokens, save=False)
        if plan.restored_tokens == len(tokens):
            return plan
        reader.abort(plan)
        return None

    plan = wait_until(restored, timeout_s, "an L2 hit after the restart")
    exact = torch.equal(reader.read_tokens_kv(plan.l1_page_ids).view(torch.int16), expected.view(torch.int16))
    reader.finish(plan)
    assert exact, "restored KV differs"
    return time.monotonic() - started


def run(sig: signal.Signals, seed: int, idle: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    extra = ("--l3-size", "0")
    daemon = DaemonProcess(l2_size=L2_SIZE, extra_args=extra).start()
    restarted = None
    engines = []
    try:
        engines = [make_manager(daemon.socket_path, name) for name in ("small-shm-a", "small-shm-b")]
        for index, engine in enumerate(engines):
            assert prefill_and_finish(engine, random_tokens(rng, 4 * PAGE), seed + index)[1] == 4
            assert engine.client.flush() == []
        segment = os.path.join("/dev/shm", os.path.basename(engines[0].client.info.shm_path))
        assert segment_mapped(segment)
        stopped_at = time.monotonic()
        daemon.stop(sig)

        def dropped():
            if not idle:
                for engine in engines:       # an engine's scheduler polls each step
                    engine.connector.poll()
            return all(e.client.state is ConnectionState.DOWN and e.client.connection.session_ended
                       for e in engines) and not segment_mapped(segment)
        wait_until(dropped, 10.0, "both engines saw the daemon go and unmapped its pool")
        dropped_s = time.monotonic() - stopped_at
        restarted = DaemonProcess(l2_size=L2_SIZE, extra_args=extra, socket_dir=daemon.socket_dir).start()
        back_at = time.monotonic()
        hit_s = []
        for writer, reader, offset in ((engines[0], engines[1], 10), (engines[1], engines[0], 20)):
            tokens = random_tokens(rng, 6 * PAGE)

            def backed_up():
                kv, count = prefill_and_finish(writer, tokens, seed + offset)
                return (kv,) if count == 6 else None
            (expected,) = wait_until(backed_up, 20.0, "a backup into the restarted daemon")
            assert writer.client.flush() == []
            hit_s.append(hit_exactly(reader, tokens, expected, 20.0))
        return {"signal": sig.name, "idle": idle, "restarted": True, "dropped_s": round(dropped_s, 3),
                "both_hit_bit_exact": True, "back_to_second_hit_s": round(time.monotonic() - back_at, 3),
                "hit_s": [round(h, 3) for h in hit_s]}
    finally:
        for engine in engines:
            engine.close()
        for process in (restarted, daemon):
            if process is not None:
                process.cleanup()


def run_in_small_shm(sig: str, seed: int, idle: bool = False, timeout_s: float = 120.0) -> dict:
    """``run`` in a private mount namespace whose /dev/shm is a SHM_SIZE tmpfs (root only)."""
    command = (f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && "
               f"exec {sys.executable} -m kvcached.testing.small_shm --signal {sig} --seed {seed}"
               + (" --idle" if idle else ""))
    done = subprocess.run([shutil.which("unshare") or "unshare", "--mount", "sh", "-c", command],
                          env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise AssertionError(f"small-shm run ({sig}) failed, exit {done.returncode}:\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--signal", choices=("KILL", "TERM"), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle", action="store_true", help="no engine call from the signal to the restart")
    args = parser.parse_args()
    print(json.dumps(run(signal.Signals[f"SIG{args.signal}"], args.seed, args.idle)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
