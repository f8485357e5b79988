"""Engines made of a ``CacheManager`` in this process (an L1 pool on CPU): attach one to a daemon,
prefill random KV and back it up, and what the engine client logged."""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import torch

from engine_client.cache_manager import CacheManager
from engine_client.client import connect
from kvcached.testing.engine_proc import GEOMETRY

PAGE = GEOMETRY.page_size


def random_tokens(rng: np.random.Generator, num_tokens: int) -> np.ndarray:
    return rng.integers(0, 150_000, size=num_tokens, dtype=np.int32)


def prefill_and_finish(manager: CacheManager, tokens: np.ndarray, seed: int) -> tuple[torch.Tensor, int]:
    """prepare, random KV into the new pages (the prefill), finish: the full pages' KV, and how
    many pages were backed up."""
    plan = manager.prepare(tokens)
    kv = manager.l1_pool.kv
    generator = torch.Generator().manual_seed(seed)
    for page in plan.new_l1_page_ids:
        kv[:, :, page] = (torch.randn(kv[:, :, page].shape, generator=generator) + 0.5).to(kv.dtype)
    pages = (plan.l1_page_ids + plan.new_l1_page_ids)[:len(tokens) // PAGE]
    expected = manager.read_tokens_kv(pages)
    return expected, manager.finish(plan)


def segment_mapped(segment: str) -> bool:
    """Whether this process maps ``segment`` (or the file unlinked from it)."""
    with open("/proc/self/maps") as maps:
        return any(segment in line for line in maps)


def engine_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("engine_client") and r.levelno >= logging.WARNING]


def make_manager(socket_path: str, name: str) -> CacheManager:
    return CacheManager.attach(connect(socket_path, timeout_s=5.0, client_name=name), GEOMETRY,
                               num_l1_pages=64, device="cpu")


def can_run_small_shm() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None
