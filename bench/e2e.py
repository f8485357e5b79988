"""End to end on one machine: a daemon and two engine processes (L1 on the GPU when there is one).

Engine A backs up three random prefixes; engine B restores them into different L1 pages and
compares bit for bit. Writes ``e2e.json`` with ``bit_exact`` and both engines' reports.

    python -m bench.e2e [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from bench.common import write_result
from engine_client.client import connect
from kvcached.testing.daemon_proc import DaemonProcess
from kvcached.testing.engine_proc import run_engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--machine", default=None)
    args = parser.parse_args()
    daemon = DaemonProcess(l2_size="256MiB").start()
    try:
        state_path = os.path.join(tempfile.mkdtemp(prefix="kve-"), "a.pt")
        backup = run_engine(daemon.socket_path, "backup", state_path, seed=int.from_bytes(os.urandom(4), "little"),
                            device=args.device)
        restore = run_engine(daemon.socket_path, "restore", state_path, device=args.device)
        with connect(daemon.socket_path, timeout_s=5.0) as observer:
            status = observer.status(check_integrity=True)
    finally:
        daemon.stop()
        daemon.cleanup()
    bit_exact = restore["bit_exact"] and all(not r["same_pages_as_source"] for r in restore["results"])
    for result in restore["results"]:
        print(f"{result['tokens']:>6} tokens: restored {result['restored_tokens']:>6}  bit_exact={result['bit_exact']}")
    print(f"pinned={restore['pinned']}  pin_seconds={restore['pin_seconds']:.3f}  integrity={status['integrity']}")
    path = write_result("e2e", {
        "bit_exact": bool(bit_exact), "device": args.device, "pinned": restore["pinned"],
        "daemon_integrity": status["integrity"], "backup": backup, "restore": restore,
        "daemon_metrics": status["metrics"],
    }, machine=args.machine)
    print(f"wrote {path}")
    if not bit_exact or status["integrity"] != "ok":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
