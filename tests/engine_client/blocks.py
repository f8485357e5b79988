"""Block ids for the copy tests of test_block_copy.py and test_kv_transfer.py."""

from __future__ import annotations

import numpy as np


def distinct_block_pairs(rng, count: int, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """count distinct random source blocks and count distinct random target blocks of num_blocks,
    target i never block number source i."""
    source = rng.permutation(num_blocks)[:count]
    for _ in range(1000):
        target = rng.permutation(num_blocks)[:count]
        if (target != source).all():
            return source, target
    raise AssertionError("no target blocks apart from the source's in 1000 draws")
