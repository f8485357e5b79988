"""The engine's block allocator and prefix cache, alone."""

from __future__ import annotations

import random

from bench.engine.block_manager import BlockManager, block_hashes


def test_hashes_name_the_whole_prefix():
    """A block's hash depends on every token up to its end: equal prefixes give equal hashes,
    a change in block 0 changes every later hash, a change in block 1 leaves block 0's."""
    tokens = list(range(100, 148))
    hashes = block_hashes(tokens, 16, 3)
    assert hashes == block_hashes(list(tokens), 16, 3)
    assert block_hashes(tokens, 16, 3, known=hashes[:1]) == hashes
    changed_first = block_hashes([7] + tokens[1:], 16, 3)
    assert all(a != b for a, b in zip(hashes, changed_first))
    changed_second = block_hashes(tokens[:16] + [7] + tokens[17:], 16, 3)
    assert changed_second[0] == hashes[0] and changed_second[1:] != hashes[1:]


def test_eviction_is_least_recently_released_first_and_a_requests_tail_first():
    """With no free block left, allocate evicts cached blocks in the order they were released,
    and of one request's blocks the last ones first; a cached block a request acquires again is
    not evicted."""
    blocks = BlockManager(num_blocks=6, block_size=4)
    first, second = blocks.allocate(3), blocks.allocate(3)
    for block_id, block_hash in zip(first + second, [b"a0", b"a1", b"a2", b"b0", b"b1", b"b2"]):
        assert blocks.register(block_id, block_hash)
    blocks.release(first)
    blocks.release(second)
    assert blocks.match([b"a0", b"a1", b"a2"]) == first
    blocks.acquire(blocks.match([b"b0"]))                       # b0 is in use again
    assert blocks.can_allocate(5) and not blocks.can_allocate(6)
    evicted = blocks.allocate(4)
    assert evicted == [first[2], first[1], first[0], second[2]]
    assert blocks.match([b"a0"]) == [] and blocks.match([b"b0", b"b1"]) == [second[0], second[1]]
    assert blocks.num_evictions == 4
    blocks.check_integrity()


def test_a_hash_names_one_block():
    """Registering a hash that another block holds changes nothing; the first block keeps it."""
    blocks = BlockManager(num_blocks=4, block_size=4)
    one, two = blocks.allocate(2)
    assert blocks.register(one, b"h") and not blocks.register(two, b"h") and not blocks.register(one, b"g")
    blocks.release([one, two])
    assert blocks.match([b"h"]) == [one] and blocks.num_allocatable_blocks == 4
    blocks.check_integrity()


def test_random_operations_keep_the_accounting():
    """Random allocate / register / acquire / release / evict_all sequences keep every block in
    exactly one of free, cached and referenced (check_integrity after each step), and releasing
    everything returns all blocks."""
    seed = 77
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks=32, block_size=4)
    held: list[list[int]] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.35:
            got = blocks.allocate(rng.randint(1, 6))
            if got is not None:
                for block_id in got:
                    if rng.random() < 0.7:
                        blocks.register(block_id, rng.randbytes(2))
                held.append(got)
        elif op < 0.5 and blocks.hash_to_block:
            hit = blocks.match([rng.choice(list(blocks.hash_to_block))])
            assert blocks.can_allocate(0, hit)
            blocks.acquire(hit)
            held.append(hit)
        elif op < 0.95 and held:
            blocks.release(held.pop(rng.randrange(len(held))))
        else:
            blocks.evict_all()
        blocks.check_integrity()
        referenced = sum(1 for count in blocks.ref_counts if count)
        assert blocks.num_allocatable_blocks + referenced == 32, f"seed {seed}, step {step}"
    for block_ids in held:
        blocks.release(block_ids)
    blocks.check_integrity()
    assert blocks.num_allocatable_blocks == 32 and not any(blocks.ref_counts), f"seed {seed}"
