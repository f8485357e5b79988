"""An engine process whose GPU cache (here: CPU tensors in shared memory) other engines copy from.

    python -m tests.integration.peer_engine --socket S --seed 7 --role hold [--device cuda]
    python -m tests.integration.peer_engine --socket S --seed 7 --role churn [--device cuda]

Both register a connector with peer restores on, fill blocks with the KV of ``prefixes(seed)``
(``page_kv``: random bytes determined by the tokens up to the page's end, so that a reader can
check any page it restored without asking) and publish them, then print ``READY`` and a JSON line.

  hold    keeps every prefix cached, polling, until stdin closes
  churn   reuses blocks as fast as it can until stdin closes: a cached prefix is dropped and its
          blocks are refilled with another prefix's pages, written noise first and then layer by
          layer, each write announced (``will_write_blocks``) before it and published
          (``blocks_cached``) after it, the way an engine's prefix cache does it
  read    a reader instead: restores the prefixes of another engine of the same seed over and over
          (prints READY once one restore came from it) until stdin closes or it is killed

At the end it prints a JSON line with what it did and closes its connector.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
import zlib

import numpy as np
import torch

from engine_client.client import connect
from engine_client.connector import ConnectorConfig, KVConnector

LAYERS, PAGE, HEADS, HEAD_DIM = 2, 4, 2, 16
NUM_BLOCKS = 48
NUM_PREFIXES, PREFIX_PAGES = 8, 5
MODEL = "peer-test"
BLOCK_SHAPE = (2, PAGE, HEADS, HEAD_DIM)        # one layer of a block: K/V, token, head, dim


def prefixes(seed: int) -> list[np.ndarray]:
    """The prefixes the owner caches: some share their first pages, so the tree branches."""
    rng = np.random.default_rng([seed, 1])
    stems = [rng.integers(0, 100_000, PREFIX_PAGES * PAGE, dtype=np.int32) for _ in range(3)]
    out = []
    for i in range(NUM_PREFIXES):
        stem = stems[i % 3]
        cut = int(rng.integers(1, PREFIX_PAGES))
        out.append(np.concatenate([stem[:cut * PAGE], rng.integers(0, 100_000, (PREFIX_PAGES - cut) * PAGE,
                                                                   dtype=np.int32)]))
    return out


def page_kv(seed: int, token_ids: np.ndarray, page: int) -> torch.Tensor:
    """The KV bits of page ``page`` of a prefix, [layers, 2, page, heads, dim] int16, never zeros:
    a function of the tokens up to the page's end."""
    key = zlib.crc32(np.ascontiguousarray(token_ids[:(page + 1) * PAGE], dtype=np.int32).tobytes())
    rng = np.random.default_rng([seed, key])
    bits = rng.integers(-2**15, 2**15, (LAYERS, *BLOCK_SHAPE), dtype=np.int16)
    bits[bits == 0] = 1
    return torch.from_numpy(bits)


def new_tensors(device: str = "cpu") -> list[torch.Tensor]:
    return [torch.ones(2, NUM_BLOCKS, PAGE, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
            for _ in range(LAYERS)]


def register(socket_path: str, name: str, tensors: list[torch.Tensor], **config) -> KVConnector:
    return KVConnector.register(connect(socket_path, client_name=name), tensors, "layer", model_id=MODEL,
                                page_size=PAGE, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                                config=ConnectorConfig(peer=True, save=False, report_interval_s=0, **config))


def read_block(tensors: list[torch.Tensor], block_id: int) -> torch.Tensor:
    return torch.stack([t[:, block_id] for t in tensors]).view(torch.int16).cpu()


class Owner:
    def __init__(self, socket_path: str, seed: int, device: str):
        self.seed = seed
        self.device = torch.device(device)
        self.tensors = new_tensors(device)
        self.connector = register(socket_path, f"peer-owner-{seed}", self.tensors)
        self.prefixes = prefixes(seed)
        # Every page's bytes, on the device: on CUDA a fill is a few kernels queued, like a prefill.
        self.contents = [[page_kv(seed, tokens, page).to(self.device) for page in range(PREFIX_PAGES)]
                         for tokens in self.prefixes]
        self.free = list(range(NUM_BLOCKS))
        self.cached: dict[int, list[int]] = {}           # prefix index -> its blocks
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.rng = np.random.default_rng([seed, 2])
        self.refills = 0

    def fill(self, index: int, noise_first: bool) -> None:
        """Take blocks for a prefix, announce the write, write it, publish it."""
        blocks = [self.free.pop() for _ in range(PREFIX_PAGES)]
        self.connector.will_write_blocks(blocks)          # before any write: readers stop trusting them
        words = [t.view(torch.int16) for t in self.tensors]
        if noise_first:
            for layer in range(LAYERS):
                for block in blocks:
                    words[layer][:, block] = torch.randint(-2**15, 2**15, BLOCK_SHAPE, generator=self.generator,
                                                           dtype=torch.int16, device=self.device)
            time.sleep(0)
        for layer in range(LAYERS):
            for block, content in zip(blocks, self.contents[index]):
                words[layer][:, block] = content[layer]
            time.sleep(0)                                 # a reader may copy between the layers
        self.cached[index] = blocks
        self.connector.blocks_cached(self.prefixes[index], blocks)      # published once the writes are done
        self.connector.poll()

    def drop(self, index: int) -> None:
        self.free += self.cached.pop(index)


def read(args) -> int:
    tensors = new_tensors(args.device)
    # Policy "always": the reader copies whatever the owner offers, however long its copies took.
    connector = register(args.socket, f"peer-reader-{args.seed}", tensors, policy="always")
    blocks = list(range(PREFIX_PAGES))
    loaded = restores = 0
    while not stdin_closed(0.0):
        tokens = prefixes(args.seed)[restores % NUM_PREFIXES]
        restores += 1
        connector.load(restores, tokens, blocks, PREFIX_PAGES * PAGE)
        result = None
        while result is None:
            result = next(iter(connector.finished().loads), None)
        connector.request_finished(restores)
        while connector.is_open(restores):
            connector.poll()
        if result.num_tokens and not loaded:
            print("READY", flush=True)
            print(json.dumps({"peer_id": connector.peer.peer_id}), flush=True)
        loaded += result.num_tokens // PAGE
    connector.close()
    print(json.dumps({"restores": restores, "loaded": loaded}), flush=True)
    return 0


def stdin_closed(timeout_s: float) -> bool:
    readable, _, _ = select.select([sys.stdin], [], [], timeout_s)
    return bool(readable) and not sys.stdin.read(1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--role", choices=("hold", "churn", "read"), required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.role == "read":
        return read(args)
    owner = Owner(args.socket, args.seed, args.device)
    for index in range(NUM_PREFIXES if args.role == "hold" else NUM_PREFIXES // 2):
        owner.fill(index, noise_first=False)
    if owner.device.type == "cuda":
        torch.cuda.synchronize(owner.device)
    owner.connector.poll()                                # the fills are done: published
    owner.connector.flush()
    print("READY", flush=True)
    # What a reader maps of this engine: its tensors' shared memory and its epoch file.
    inodes = [os.fstat(t.untyped_storage()._share_fd_cpu_()[0]).st_ino for t in owner.tensors] \
        if owner.device.type == "cpu" else []
    inodes.append(os.stat(owner.connector.peer.epochs_path).st_ino)
    print(json.dumps({"peer_id": owner.connector.peer.peer_id, "cached": sorted(owner.cached), "inodes": inodes}),
          flush=True)
    if args.role == "hold":
        while not stdin_closed(0.002):
            owner.connector.poll()
    else:
        while not stdin_closed(0.0):
            victim = int(owner.rng.choice(sorted(owner.cached)))
            owner.drop(victim)
            choices = [i for i in range(NUM_PREFIXES) if i not in owner.cached]
            owner.fill(int(owner.rng.choice(choices)), noise_first=True)
            owner.refills += 1
    stats = owner.connector.stats()
    owner.connector.close()
    print(json.dumps({"refills": owner.refills, "published": stats.get("peer_blocks_published", 0)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
