"""Random KV bits and block ids, for the copy tests and the connector's engines."""

from __future__ import annotations

import numpy as np
import torch


def random_bits(shape, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu") -> torch.Tensor:
    """Random 16-bit patterns viewed as ``dtype`` (NaN and infinity patterns included), on ``device``."""
    return torch.randint(-2**15, 2**15, shape, generator=generator, dtype=torch.int16).view(dtype).to(device)


def distinct_block_pairs(rng, count: int, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """count distinct random source blocks and count distinct random target blocks of num_blocks,
    target i never block number source i."""
    source = rng.permutation(num_blocks)[:count]
    for _ in range(1000):
        target = rng.permutation(num_blocks)[:count]
        if (target != source).all():
            return source, target
    raise AssertionError("no target blocks apart from the source's in 1000 draws")
