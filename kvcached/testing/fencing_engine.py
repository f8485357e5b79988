"""An engine process driven line by line on stdin, for fencing scenarios (``fencing.py`` drives it).

    python -m kvcached.testing.fencing_engine --socket S --name A --prefix-seed 1 --kv-seed 2 --state F

Commands (one per line), each answered by one JSON line on stdout:
  prepare   prepare the prefix made from --prefix-seed (the acquire reserves pages), then
            "prefill" it with random KV from --kv-seed (never zeros); the KV of its full pages
            is saved to --state
  finish    finish the prepared request (its save's DMA and commit), then flush
  restore   prepare the prefix without backing it up and compare what was restored with the
            KV saved in the file named by --compare, page by page, bit for bit
  prefix N  from now on, the prefix is the one made from seed N (as --prefix-seed makes it)
  exit      close the manager and exit
The first line out, once attached, is {"attached": ...}.

With --hold-before-save-copy, a save stops between the connector's checks and its copy into L2
(the call that queues the copy): it says {"at_copy": <pid>} (the pid as the host sees it, also
from another pid namespace) and reads one line from stdin before it goes on, so that the test
can SIGSTOP it exactly there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

from engine_client.cache_manager import CacheManager
from engine_client.client import DaemonError, DaemonUnavailable, connect
from kvcached.testing.engine_proc import GEOMETRY, random_kv_

PREFIX_PAGES = 8


def prefix_tokens(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 150_000, size=PREFIX_PAGES * GEOMETRY.page_size, dtype=np.int32)


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def hold_before_save_copy(transfer) -> None:
    """The seam: the transfer's save (the call that queues the copy) first waits for a line."""
    save = transfer.save

    def held_save(*args, **kwargs):
        say(at_copy=int(os.readlink("/proc/self")))     # the host's pid, whatever namespace we are in
        sys.stdin.readline()
        return save(*args, **kwargs)

    transfer.save = held_save


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--prefix-seed", type=int, required=True)
    parser.add_argument("--kv-seed", type=int, default=0)
    parser.add_argument("--state", help="where prepare saves the prefix's KV")
    parser.add_argument("--compare", help="the KV that restore must find")
    parser.add_argument("--hold-before-save-copy", action="store_true")
    args = parser.parse_args()
    client = connect(args.socket, timeout_s=10.0, client_name=args.name)
    manager = CacheManager.attach(client, GEOMETRY, num_l1_pages=32, device="cpu")
    tokens = prefix_tokens(args.prefix_seed)
    if args.hold_before_save_copy:
        hold_before_save_copy(manager.connector.transfer)
    say(attached=args.name)
    plan = None
    for line in sys.stdin:
        command = line.strip()
        if command == "prepare":
            plan = manager.prepare(tokens)
            generator = torch.Generator().manual_seed(args.kv_seed)
            for page_id in plan.new_l1_page_ids:
                page = torch.empty(manager.l1_pool.kv[:, :, page_id].shape, dtype=manager.l1_pool.kv.dtype)
                random_kv_(page, generator)
                manager.l1_pool.kv[:, :, page_id].copy_(page)
            torch.save(manager.read_tokens_kv(plan.new_l1_page_ids[:PREFIX_PAGES]).cpu(), args.state)
            say(prepared=args.name, cached_tokens=plan.num_cached_tokens, reserved_page_ids=plan.reserved_page_ids)
        elif command == "finish":
            backed_up = manager.finish(plan)
            try:
                errors = [str(e) for e in manager.client.flush()]
            except (DaemonError, DaemonUnavailable) as exc:
                errors = [str(exc)]
            say(finished=args.name, backed_up=backed_up, errors=errors, stats=manager.stats())
        elif command == "restore":
            plan = manager.prepare(tokens, save=False)
            expected = torch.load(args.compare)
            restored = manager.read_tokens_kv(plan.l1_page_ids).cpu()
            equal_pages = sum(torch.equal(restored[i].view(torch.int16), expected[i].view(torch.int16))
                              for i in range(min(len(restored), len(expected))))
            manager.finish(plan)
            status = manager.client.status(check_integrity=True)
            say(restored_tokens=plan.restored_tokens, equal_pages=int(equal_pages), pages=len(expected),
                integrity=status["integrity"])
        elif command.startswith("prefix "):
            tokens = prefix_tokens(int(command.split()[1]))
            say(prefix=int(command.split()[1]))
        elif command == "exit":
            break
    manager.close()
    say(exited=args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
