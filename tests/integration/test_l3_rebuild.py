"""Restart memory: a daemon rebuilding a large, branchy L3 index (one long history, many
continuations branching off it) holds O(rows) in memory, not a token path per continuation."""

from __future__ import annotations

import secrets


from kvcached.testing.l3_rebuild import MAX_REBUILD_RSS_BYTES, TEST_ROWS, restart_on_branchy_index


def test_rebuilding_160k_branchy_rows_stays_under_500_mb():
    """A daemon restarting on an index of 160,000 rows (a 40,000-page history, 2,400 continuations
    of 50 pages branching off it) restores every row with a peak RSS of at most 500 MB."""
    seed = secrets.randbits(32)
    result = restart_on_branchy_index(TEST_ROWS, seed)
    assert result["l3_pages"] == TEST_ROWS, (seed, result)
    assert result["integrity"] == "ok", result
    assert result["peak_rss_bytes"] <= MAX_REBUILD_RSS_BYTES, (seed, result)
