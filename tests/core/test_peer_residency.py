"""Peer residency (PeerResidency on a PrefixTree): engines' GPU-cache blocks per node, their
leading runs, moves, removals, splits by the tiers, and the integrity of both throughout."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvcached.core.residency import PeerResidency
from kvcached.core.tiers import Tier
from kvcached.core.tree import PrefixTree

PAGE = 4
L2 = Tier.L2


def _tree() -> tuple[PrefixTree, PeerResidency]:
    ticks = itertools.count(1)
    tree = PrefixTree(PAGE, clock=lambda: float(next(ticks)))
    return tree, PeerResidency(tree)


def _check(tree: PrefixTree, peers: PeerResidency) -> None:
    tree.check_integrity()
    peers.check_integrity()


def _tokens(rng: np.random.Generator, num_pages: int) -> np.ndarray:
    return rng.integers(1, 150_000, num_pages * PAGE, dtype=np.int32)


def test_leading_run_per_owner_with_epochs(rng, seed):
    """hits gives each owner the blocks and epochs of the leading pages it holds, up to its
    first page not held; owners are independent and a prefix shorter than a run is cut to it."""
    tree, peers = _tree()
    tokens = _tokens(rng, 8)
    blocks_a = rng.choice(1000, 8, replace=False).tolist()
    epochs_a = (2 * rng.integers(1, 100, 8)).tolist()
    peers.put(tokens, 1, 0, blocks_a, epochs_a)
    peers.put(tokens, 2, 0, [7, 8, 9], [2, 4, 6])
    _check(tree, peers)
    hits = peers.hits(tokens, {1, 2, 3})
    assert hits[1].block_ids == blocks_a and hits[1].epochs == epochs_a, f"seed {seed}"
    assert hits[2].block_ids == [7, 8, 9] and hits[2].epochs == [2, 4, 6]
    assert 3 not in hits
    assert peers.hits(tokens[:5 * PAGE + 1], {1})[1].block_ids == blocks_a[:5]
    # A hole at page 3 ends owner 1's run there.
    peers.remove(1, [blocks_a[3]])
    _check(tree, peers)
    assert peers.hits(tokens, {1})[1].block_ids == blocks_a[:3]
    # Another prefix sharing two pages hits those two only.
    other = np.concatenate([tokens[:2 * PAGE], _tokens(rng, 3)])
    assert peers.hits(other, {1, 2}) == {1: (blocks_a[:2], epochs_a[:2]), 2: ([7, 8], [2, 4])}


def test_pages_from_a_start_page_and_a_block_that_moves(rng, seed):
    """Pages published from start_page on leave the earlier ones unheld (no leading run until they
    are published); a block published again elsewhere leaves its old place; a page taken by
    another block of the same owner drops the old block."""
    tree, peers = _tree()
    tokens = _tokens(rng, 6)
    peers.put(tokens, 1, 3, [30, 31, 32], [2, 2, 2])
    assert peers.hits(tokens, {1}) == {}
    peers.put(tokens, 1, 0, [10, 11, 12], [4, 4, 4])
    assert peers.hits(tokens, {1})[1].block_ids == [10, 11, 12, 30, 31, 32], f"seed {seed}"
    other = _tokens(rng, 2)
    peers.put(other, 1, 0, [11, 40], [6, 8])         # block 11 now holds another page
    _check(tree, peers)
    assert peers.hits(tokens, {1})[1].block_ids == [10]
    assert peers.hits(other, {1})[1] == ([11, 40], [6, 8])
    peers.put(tokens, 1, 1, [50], [2])                # page 1 of tokens: block 50 instead
    _check(tree, peers)
    assert peers.hits(tokens, {1})[1].block_ids == [10, 50, 12, 30, 31, 32]
    assert peers.blocks(1) == 8      # those six, and 11 and 40 on the other prefix


def test_removal_and_drop_leave_no_node_behind_but_keep_tiers(rng, seed):
    """Nodes made only for peer residency leave the tree once their blocks are forgotten; a node
    that L2 also holds stays with its L2 pages; dropping an owner forgets all its blocks."""
    tree, peers = _tree()
    shared = _tokens(rng, 4)
    tree.insert(shared[:2 * PAGE], L2, [100, 101])
    peers.put(shared, 1, 0, [0, 1, 2, 3], [2, 2, 2, 2])
    peers.put(_tokens(rng, 3), 1, 0, [5, 6, 7], [2, 2, 2])
    peers.put(shared, 2, 0, [0, 1], [8, 8])
    _check(tree, peers)
    assert tree.num_nodes == 3, f"seed {seed}"
    assert peers.remove(1, [2, 3, 99]) == 2
    _check(tree, peers)
    assert peers.drop(1) == 5 and peers.blocks(1) == 0
    _check(tree, peers)
    assert peers.hits(shared, {1, 2}) == {2: ([0, 1], [8, 8])}
    peers.drop(2)
    _check(tree, peers)
    assert tree.num_nodes == 1
    assert tree.match(shared).page_ids[L2] == [100, 101]


def test_tier_splits_and_evictions_keep_peer_entries(rng, seed):
    """An L2 insert or match that splits a node with peer residency keeps every block at its page;
    evicting L2 from a node a peer holds leaves the node and its peer blocks."""
    tree, peers = _tree()
    tokens = _tokens(rng, 6)
    blocks = rng.choice(500, 6, replace=False).tolist()
    peers.put(tokens, 1, 0, blocks, [2] * 6)
    tree.insert(tokens[:2 * PAGE], L2, [1, 2])           # splits after page 2
    tree.match(tokens[:4 * PAGE])                        # and after page 4
    _check(tree, peers)
    assert tree.num_nodes == 3, f"seed {seed}"
    assert peers.hits(tokens, {1})[1].block_ids == blocks
    assert sorted(tree.evict(L2, 2)) == [1, 2]
    _check(tree, peers)
    assert peers.hits(tokens, {1})[1].block_ids == blocks
    assert peers.remove(1, blocks[2:4]) == 2
    _check(tree, peers)
    assert peers.hits(tokens, {1})[1].block_ids == blocks[:2]


def test_bad_publications_change_nothing(rng):
    """A block named twice, a missing epoch, or pages beyond the tokens raise ValueError, and the
    tree is as it was."""
    tree, peers = _tree()
    tokens = _tokens(rng, 3)
    peers.put(tokens, 1, 0, [1, 2], [2, 2])
    for args in ((0, [5, 5], [2, 2]), (0, [5, 6], [2]), (2, [5, 6], [2, 2])):
        with pytest.raises(ValueError):
            peers.put(tokens, 1, *args)
    _check(tree, peers)
    assert peers.hits(tokens, {1})[1].block_ids == [1, 2] and peers.blocks(1) == 2


def test_random_publications_match_a_model(rng, seed):
    """Random puts, removals and drops over prefixes that share pages give, for every prefix and
    owner, the leading run a plain model computes (which block holds which page path, each block
    in one place), with the tree's integrity checked after every step."""
    tree, peers = _tree()
    stems = [_tokens(rng, 6) for _ in range(3)]
    prefixes = []
    for _ in range(8):       # prefixes branching off the stems at random pages
        stem = stems[rng.integers(len(stems))]
        cut = int(rng.integers(1, 6))
        prefixes.append(np.concatenate([stem[:cut * PAGE], _tokens(rng, int(rng.integers(0, 4)))]))
    owners = (1, 2)
    model: dict[int, dict[int, tuple[bytes, int]]] = {o: {} for o in owners}   # owner -> block -> (path, epoch)

    def key(prefix: np.ndarray, page: int) -> bytes:
        return prefix[:(page + 1) * PAGE].tobytes()

    for step in range(300):
        owner = owners[rng.integers(2)]
        action = rng.random()
        if action < 0.6:
            prefix = prefixes[rng.integers(len(prefixes))]
            num_pages = len(prefix) // PAGE
            start = int(rng.integers(0, num_pages))
            count = int(rng.integers(1, num_pages - start + 1))
            blocks = rng.choice(40, count, replace=False).tolist()
            epochs = (2 * rng.integers(0, 50, count)).tolist()
            peers.put(prefix, owner, start, blocks, epochs)
            held = model[owner]
            for block in blocks:
                held.pop(block, None)
            for i, (block, epoch) in enumerate(zip(blocks, epochs)):
                path = key(prefix, start + i)
                for other in [b for b, (p, _) in held.items() if p == path]:
                    del held[other]
                held[block] = (path, epoch)
        elif action < 0.95:
            blocks = rng.choice(40, int(rng.integers(1, 6)), replace=False).tolist()
            peers.remove(owner, blocks)
            for block in blocks:
                model[owner].pop(block, None)
        else:
            peers.drop(owner)
            model[owner].clear()
        _check(tree, peers)
        for prefix in prefixes:
            hits = peers.hits(prefix, owners)
            for o in owners:
                by_path = {path: (block, epoch) for block, (path, epoch) in model[o].items()}
                expected = []
                for page in range(len(prefix) // PAGE):
                    if key(prefix, page) not in by_path:
                        break
                    expected.append(by_path[key(prefix, page)])
                got = list(zip(*hits[o])) if o in hits else []
                assert got == expected, f"step {step}, owner {o} (seed {seed})"
