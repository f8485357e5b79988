"""A minimal engine process for end-to-end runs: a real L1 pool, the cache manager, the daemon.

    python -m kvcached.testing.engine_proc --socket S --role backup  --seed 1 --state F
    python -m kvcached.testing.engine_proc --socket S --role restore --state F
    python -m kvcached.testing.engine_proc --socket S --role lookup --state F --policy cost

``backup`` makes three random prefixes, "prefills" them with random KV (never zeros), and backs
them up; it saves each prefix's tokens, KV bytes and L1 page ids to the state file. ``restore``
runs in another process with a fresh L1 whose allocation order differs, restores each prefix from
L2 (promoted from L3 where only L3 holds it), and compares the restored KV bytes with the saved ones
bit for bit: all of them, and the part restored (a prefix may come back in part). Each prints one
JSON line. ``lookup`` asks the daemon's decision for each saved prefix under ``--policy`` (a
lookup: nothing restored) and prints the choices.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np
import torch

from engine_client.cache_manager import CacheManager
from engine_client.client import connect
from engine_client.connector import PrefixLookup
from engine_client.dtypes import torch_dtype
from kvcached.testing.daemon_proc import REPO_ROOT, child_env
from proto.messages import KVGeometry

GEOMETRY = KVGeometry("e2e-model", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", page_size=16)
PREFIX_TOKENS = (5 * 16, 7 * 16 + 5, 3 * 16 + 15)      # full pages and partial tails


def random_kv_(tensor: torch.Tensor, generator: torch.Generator) -> None:
    values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32, device="cpu") + 0.5
    tensor.copy_(values.to(tensor.dtype))


def check_all(manager: CacheManager) -> None:
    manager.check_integrity()
    status = manager.client.status(check_integrity=True)
    if status["integrity"] != "ok":
        raise AssertionError(f"daemon integrity: {status['integrity']}")


def run_backup(manager: CacheManager, seed: int, state_path: str) -> dict:
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    saved = []
    for num_tokens in PREFIX_TOKENS:
        tokens = rng.integers(0, 150_000, size=num_tokens, dtype=np.int32)
        plan = manager.prepare(tokens)
        assert plan.num_cached_tokens == 0, "a fresh prefix must not hit"
        for page_id in plan.new_l1_page_ids:          # the "prefill": random KV per page
            page = torch.empty(manager.l1_pool.kv[:, :, page_id].shape, dtype=manager.l1_pool.kv.dtype)
            random_kv_(page, generator)
            manager.l1_pool.kv[:, :, page_id].copy_(page)
        full_pages = num_tokens // GEOMETRY.page_size
        l1_page_ids = plan.new_l1_page_ids[:full_pages]
        kv = manager.read_tokens_kv(l1_page_ids).cpu()
        backed_up = manager.finish(plan)
        assert backed_up == full_pages, (backed_up, full_pages)
        check_all(manager)
        saved.append({"tokens": tokens, "kv": kv, "l1_page_ids": l1_page_ids})
    errors = manager.client.flush()
    assert errors == [], errors
    check_all(manager)
    torch.save(saved, state_path)
    return {"role": "backup", "prefixes": len(saved), "pages": sum(len(s["l1_page_ids"]) for s in saved)}


def run_restore(manager: CacheManager, state_path: str, seed: int) -> dict:
    saved = torch.load(state_path, weights_only=False)
    # Another request holds the first L1 pages, so our destinations differ from the source pages.
    other_tokens = np.random.default_rng(seed).integers(0, 150_000, size=11 * GEOMETRY.page_size, dtype=np.int32)
    started = time.perf_counter()
    other_request = manager.prepare(other_tokens, save=False)
    other_prepare_seconds = time.perf_counter() - started
    results = []
    for entry in saved:
        tokens = entry["tokens"]
        full_tokens = len(tokens) // GEOMETRY.page_size * GEOMETRY.page_size
        started = time.perf_counter()
        plan = manager.prepare(tokens, save=False)
        prepare_seconds = time.perf_counter() - started
        check_all(manager)
        restored = manager.read_tokens_kv(plan.l1_page_ids).cpu()
        bit_exact = (plan.restored_tokens == full_tokens
                     and restored.shape == entry["kv"].shape
                     and torch.equal(restored.view(torch.int16), entry["kv"].view(torch.int16)))
        restored_pages = len(plan.l1_page_ids)
        results.append({
            "tokens": int(len(tokens)),
            "restored_tokens": plan.restored_tokens,
            # what was restored, however much, is the saved KV of those tokens
            "restored_part_bit_exact": bool(torch.equal(restored.view(torch.int16),
                                                        entry["kv"][:restored_pages].view(torch.int16))),
            "l2_hit_tokens": plan.l2_hit_tokens,
            "bit_exact": bool(bit_exact),
            "same_pages_as_source": plan.l1_page_ids == entry["l1_page_ids"],
            "restore_seconds": plan.restore_seconds,
            "prepare_seconds": prepare_seconds,
        })
        manager.finish(plan)
        check_all(manager)
    manager.abort(other_request)
    assert manager.client.flush() == []
    check_all(manager)
    return {"role": "restore", "results": results, "other_prepare_seconds": other_prepare_seconds,
            "bit_exact": all(r["bit_exact"] for r in results),
            "pinned": manager.host_pool.is_pinned, "pin_seconds": manager.host_pool.pin_seconds}


def run_lookup(manager: CacheManager, state_path: str, policy: str) -> dict:
    saved = torch.load(state_path, weights_only=False)
    lookups = PrefixLookup(manager.client, tp_group=False, policy=policy)
    decisions = []
    for entry in saved:
        pending = lookups.lookup_async(entry["tokens"])
        decision = pending.decision(10.0)
        decisions.append({"choice": decision.choice, "restore_tokens": decision.restore_tokens,
                          "hit_tokens": pending.hit_tokens(), "predicted_s": decision.predicted_s})
    return {"role": "lookup", "decisions": decisions}


def run_engine(socket_path: str, role: str, state_path: str, seed: int = 0, device: str = "cpu") -> dict:
    """One engine process of ``role`` on the daemon at socket_path; its JSON report."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvcached.testing.engine_proc", "--socket", socket_path, "--role", role,
         "--state", state_path, "--seed", str(seed), "--device", device],
        env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{role} engine failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--role", choices=("backup", "restore", "lookup"), required=True)
    parser.add_argument("--policy", default="cost")
    parser.add_argument("--state", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--l1-pages", type=int, default=64)
    args = parser.parse_args()
    assert torch_dtype(GEOMETRY.dtype) == torch.bfloat16
    client = connect(args.socket, timeout_s=10.0, client_name=f"e2e-{args.role}")
    manager = CacheManager.attach(client, GEOMETRY, num_l1_pages=args.l1_pages, device=args.device)
    started = time.perf_counter()
    try:
        if args.role == "backup":
            report = run_backup(manager, args.seed, args.state)
        elif args.role == "lookup":
            report = run_lookup(manager, args.state, args.policy)
        else:
            report = run_restore(manager, args.state, args.seed)
    finally:
        manager.close()
    report["seconds"] = time.perf_counter() - started
    report["device"] = args.device
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
