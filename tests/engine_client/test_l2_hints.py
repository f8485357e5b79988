"""L2Hints: where an engine's own backups went, found again by any whole-page prefix."""

from __future__ import annotations

import numpy as np
import pytest

from engine_client.reserved import L2Hints

PAGE = 16


def random_tokens(rng, num_pages: int, extra: int = 0) -> np.ndarray:
    return rng.integers(0, 150_000, size=num_pages * PAGE + extra, dtype=np.int32)


def test_the_longest_recorded_prefix_is_found_and_only_a_prefix():
    rng = np.random.default_rng()
    hints = L2Hints(PAGE)
    tokens = random_tokens(rng, 20)
    pages, epochs = list(rng.permutation(1000)[:12]), list(rng.integers(1, 99, size=12))
    hints.record(tokens[:12 * PAGE], pages, epochs)
    assert hints.longest(tokens) == (pages, epochs)                    # a longer request
    assert hints.longest(tokens[:7 * PAGE + 5]) == (pages[:7], epochs[:7])   # a shorter one
    assert hints.get(tokens[:12 * PAGE + 3]) == (pages, epochs)        # exactly its whole pages
    assert hints.get(tokens) is None and hints.get(tokens[:7 * PAGE]) == (pages[:7], epochs[:7])
    changed = tokens.copy()
    changed[5 * PAGE + 2] += 1                                         # differs in page 5
    assert hints.longest(changed) == (pages[:5], epochs[:5])
    changed[0] += 1
    assert hints.longest(changed) is None
    assert hints.longest(tokens[:PAGE - 1]) is None                    # no whole page
    assert hints.longest(list(tokens[:3 * PAGE])) == (pages[:3], epochs[:3])             # any int sequence
    assert hints.longest(tokens[:3 * PAGE].astype(np.int64)) == (pages[:3], epochs[:3])
    strided = np.repeat(tokens, 2)[::2]                                # not contiguous
    assert not strided.flags.c_contiguous
    assert hints.longest(strided[:6 * PAGE]) == (pages[:6], epochs[:6])


def test_the_newest_record_wins_and_old_records_go_first():
    rng = np.random.default_rng()
    hints = L2Hints(PAGE, max_pages=10)
    head = random_tokens(rng, 4)
    hints.record(head, [1, 2, 3, 4], [1, 1, 1, 1])
    longer = np.concatenate([head, random_tokens(rng, 2)])
    hints.record(longer, [11, 12, 13, 14, 15, 16], [2] * 6)          # the same 4 pages backed up again
    assert hints.get(head) == ([11, 12, 13, 14], [2] * 4)
    assert hints.get(longer) == ([11, 12, 13, 14, 15, 16], [2] * 6)
    other = random_tokens(rng, 3)
    hints.record(other, [20, 21, 22], [3] * 3)                       # 13 pages > 10: the oldest goes
    assert len(hints) == 2
    assert hints.get(head) == ([11, 12, 13, 14], [2] * 4)             # still the newer record's
    hints.record(random_tokens(rng, 5), [30, 31, 32, 33, 34], [4] * 5)
    assert hints.get(longer) is None and hints.get(head) is None and hints.get(other) == ([20, 21, 22], [3] * 3)


def test_bad_records_are_refused():
    hints = L2Hints(PAGE)
    tokens = np.arange(3 * PAGE, dtype=np.int32)
    with pytest.raises(ValueError):
        hints.record(tokens, [1, 2], [1])
    with pytest.raises(ValueError):
        hints.record(tokens, [1, 2, 3, 4], [1, 1, 1, 1])      # more pages than tokens
    with pytest.raises(ValueError):
        hints.record(tokens, [], [])
    with pytest.raises(ValueError):
        L2Hints(0)
    assert len(hints) == 0 and hints.longest(tokens) is None
