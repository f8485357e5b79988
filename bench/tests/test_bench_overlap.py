"""bench_overlap's two measures of a restore under decode, on step timings made up to the
microsecond: what part of the restore the decode batches' forwards cover, and how much slower the
decode steps run meanwhile (blocking: how long the decoders stall, the restored request's own
prefill left out)."""

from __future__ import annotations

import pytest

from bench.bench_overlap import StepLog, hidden_and_inflation

MS = 1e-3


def steps_of(layout) -> list[StepLog]:
    """[(kind, schedule_ms, forward_ms)] -> back-to-back steps from t=0."""
    steps, now = [], 0.0
    for kind, schedule_ms, forward_ms in layout:
        forward_s = now + schedule_ms * MS
        ended_s = forward_s + forward_ms * MS
        steps.append(StepLog(now, forward_s, ended_s, kind, 8 if kind == "decode" else 1))
        now = ended_s
    return steps


def test_a_restore_under_decode_is_hidden_but_for_the_schedules_and_inflates_decode_by_them():
    """Decode steps of 1 ms schedule + 9 ms forward; the restore starts 0.5 ms into the 3rd step's
    schedule, which takes 3 ms (the lookup and the load's queueing), and is seen done 0.5 ms into
    the 6th's, whose forward is the restored request's prefill (20 ms): 32 ms of restore, 27 of them
    under decode forwards (steps 3-5). The decode steps that overlap it take 12, 10 and 10 ms
    against a 10 ms baseline: +6.7%; the slower decode step after the prefill (15 ms, one more
    request in the batch) is not the restore's and does not count."""
    steps = steps_of([("decode", 1, 9)] * 2 + [("decode", 3, 9)] + [("decode", 1, 9)] * 2
                     + [("prefill", 1, 20), ("decode", 1, 14)])
    window = (20.5 * MS, 52.5 * MS)
    hidden, inflation = hidden_and_inflation(steps, window, 10 * MS, decoders=8)
    assert hidden == pytest.approx(27 / 32)
    assert inflation == pytest.approx((12 + 10 + 10) / 3 / 10 - 1)


def test_a_blocking_restore_hides_nothing_and_its_wait_is_the_decoders_stall():
    """The admitting step waits 30 ms in its schedule, then prefills (20 ms forward); nothing of
    the restore is hidden, and the decoders' next token comes 30 + 1 + 10 ms after their last:
    41 ms for one decode step, against 10: +310%."""
    steps = steps_of([("decode", 1, 9)] * 2 + [("prefill", 31, 20), ("decode", 1, 9)])
    window = (20.5 * MS, 50.5 * MS)
    hidden, inflation = hidden_and_inflation(steps, window, 10 * MS, decoders=8)
    assert hidden == 0.0
    assert inflation == pytest.approx((31 + 10) / 10 - 1)
