"""bench/drills.py runs: its cheapest drill, on a real daemon and real engine processes."""

from __future__ import annotations

from bench import drills


def test_the_sigkill_drill_reports_a_passing_row():
    """The SIGKILL-mid-backup drill (two engines SIGKILLed while holding leases) yields one row
    with the drill's fields, passing: every lease gone within 1 s."""
    (row,) = drills.run_drills(("sigkill_mid_backup",), repeats=1, workdir="/tmp")
    assert set(row) >= {"drill", "expect", "measured", "pass"}
    assert row["pass"], row
