"""bench/drills.py runs: its cheapest drill, on a real daemon and real engine processes."""

from __future__ import annotations

import functools

from bench import drills


def test_the_sigkill_drill_reports_a_passing_row(monkeypatch):
    """The SIGKILL-mid-backup drill (two engines SIGKILLed while holding leases) yields one row
    with the drill's fields, passing: all 4 leases gone and integrity ok. How soon is the
    benchmark's to measure (its bound: 1 s); here the bound is 10 s, so that a loaded machine's
    scheduling does not decide the outcome."""
    monkeypatch.setattr(drills, "drill_sigkill_mid_backup",
                        functools.partial(drills.drill_sigkill_mid_backup, within_s=10.0))
    (row,) = drills.run_drills(("sigkill_mid_backup",), repeats=1, workdir="/tmp")
    assert set(row) >= {"drill", "expect", "measured", "pass"}
    assert row["pass"], row
    assert row["leases_before"] == 4 and row["leases_after"] == 0 and row["integrity"] == "ok", row
