"""Engine A of the peer-restore benchmarks: a process of its own on the same GPU (CUDA IPC does not
open a handle in the process that made it), whose GPU cache the benchmark's engine B copies from.
It prints READY once registered; then it is driven by lines on stdin, each answered by one line on
stdout once done:

    python -m bench.peer_owner tensors --socket S --model M --layers L --kv-heads H --head-dim D
           --blocks N --seed S          (bench_connector: KV tensors like B's, from the same seed)
        fill PATH      PATH (.npy) holds a prefix's tokens: blocks 0.. hold its pages from now on
                       (announced, "written", published; answered once the daemon has it)

    python -m bench.peer_owner engine --socket S --model PRESET --seed S --blocks N
                                        (bench_ttft: the reference engine, the same random weights)
        fill PATH      the engine prefills PATH's tokens (1 output token), its prefix cache keeps
                       them, the connector publishes them; answered with the path of a file
                       holding the KV its cache holds for them (bench.tiers.prefix_kv)

    quit (or end of input): the connector is closed, the process exits

Both register their connector with peer restores on and saves off (nothing of A reaches L2).
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from engine_client.client import connect
from engine_client.connector import ConnectorConfig, KVConnector

CONFIG = ConnectorConfig(peer=True, save=False)


class PeerOwner:
    """The benchmark's handle on engine A: ``python -m bench.peer_owner WHAT ...`` in a process of
    its own; ``fill`` sends a prefix and returns A's answer."""

    def __init__(self, what: str, socket_path: str, *, model: str, seed: int, blocks: int, page_size: int = 16,
                 layers: int = 0, kv_heads: int = 0, head_dim: int = 128, start_timeout_s: float = 600.0):
        from kvcached.testing.daemon_proc import REPO_ROOT, child_env

        self.directory = tempfile.mkdtemp(prefix="kvpeer-")
        self.fills = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.peer_owner", what, "--socket", socket_path, "--model", model,
             "--seed", str(seed), "--blocks", str(blocks), "--page-size", str(page_size), "--layers", str(layers),
             "--kv-heads", str(kv_heads), "--head-dim", str(head_dim)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=child_env(), cwd=REPO_ROOT)
        try:
            self._line(start_timeout_s, "READY")
        except BaseException:
            self.close()
            raise

    def fill(self, token_ids, timeout_s: float = 300.0) -> str:
        """A caches (and publishes) the prefix; returns what it answered after "filled "."""
        path = os.path.join(self.directory, f"prefix-{self.fills}.npy")
        self.fills += 1
        np.save(path, np.asarray(token_ids, dtype=np.int32))
        self.proc.stdin.write(f"fill {path}\n".encode())
        return self._line(timeout_s, None).removeprefix("filled ")

    def _line(self, timeout_s: float, expected: str | None) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"engine A (bench.peer_owner) said nothing within {timeout_s} s")
            if select.select([self.proc.stdout], [], [], remaining)[0]:
                line = self.proc.stdout.readline().decode().strip()
                if not line and self.proc.poll() is not None:
                    raise RuntimeError(f"engine A (bench.peer_owner) exited with {self.proc.returncode}")
                if line and (expected is None or line == expected):
                    return line

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.proc.stdin.write(b"quit\n")
                    self.proc.stdin.close()
                    self.proc.wait(60)
                except (OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
                    self.proc.wait()
        finally:
            self.proc.stdout.close()
            shutil.rmtree(self.directory, ignore_errors=True)


def serve_tensors(args, device: torch.device) -> None:
    generator = torch.Generator(device=device).manual_seed(args.seed)
    tensors = [torch.randint(-2**15, 2**15, (2, args.blocks, args.page_size, args.kv_heads, args.head_dim),
                             generator=generator, dtype=torch.int16, device=device).view(torch.bfloat16)
               for _ in range(args.layers)]
    connector = KVConnector.register(connect(args.socket, timeout_s=60.0, client_name="peer-owner"), tensors,
                                     "layer", model_id=args.model, page_size=args.page_size,
                                     num_kv_heads=args.kv_heads, head_dim=args.head_dim, config=CONFIG)
    print("READY", flush=True)
    try:
        for command in commands():
            tokens = np.load(command)
            blocks = list(range(len(tokens) // args.page_size))
            connector.will_write_blocks(blocks)
            # The bytes stay what the seed made them (B holds the same): the write is announced and
            # published as an engine's would be.
            connector.blocks_cached(tokens, blocks)
            synchronize(device)             # the (empty) write is done: the next poll publishes it
            connector.poll()
            connector.flush()
            print(f"filled {len(blocks)}", flush=True)
    finally:
        connector.close()


def serve_engine(args, device: torch.device) -> None:
    from bench.engine import Engine, EngineConfig, load_model
    from bench.tiers import attach_kvcached, detach_kvcached, prefix_kv, run_request, run_to_idle

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(args.model, dtype=dtype, device=device, seed=args.seed)
    engine = Engine(model, EngineConfig(num_blocks=args.blocks, block_size=args.page_size, max_num_seqs=4,
                                        max_prefill_tokens=args.blocks * args.page_size))
    connector = attach_kvcached(engine, args.socket, model_id=args.model, model_revision=f"random-seed-{args.seed}",
                                client_name="peer-owner-engine", config=CONFIG)
    print("READY", flush=True)
    try:
        for command in commands():
            tokens = np.load(command).tolist()
            run_request(engine, tokens, 1)
            run_to_idle(engine)
            synchronize(device)
            connector.poll()
            connector.flush()
            path = command + ".kv.pt"
            torch.save(prefix_kv(engine, tokens).cpu(), path)
            print(f"filled {path}", flush=True)
    finally:
        detach_kvcached(engine)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def commands():
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            return
        if not command.startswith("fill "):
            raise SystemExit(f"unknown command {command!r}")
        yield command[len("fill "):]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("tensors", "engine"))
    parser.add_argument("--socket", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--kv-heads", type=int, default=0)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    (serve_tensors if args.what == "tensors" else serve_engine)(args, device)


if __name__ == "__main__":
    main()
