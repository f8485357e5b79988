"""RefusalLog: every refused request at DEBUG, a WARNING summary (counts per code) at most once per interval."""

from __future__ import annotations

import logging

import pytest

from kvcached.server.refusals import RefusalLog
from kvcached.testing.clock import FakeClock


def summaries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_refusals_are_counted_per_code_and_summarised_once_per_interval(caplog):
    """The first refusal is summarised at once; later ones only as counts per code once the interval
    has passed (at a refusal or at flush_due), each also logged at DEBUG; nothing is summarised twice."""
    caplog.set_level(logging.DEBUG, logger="kvcached.server.refusals")
    clock = FakeClock()
    log = RefusalLog(interval_s=10.0, clock=clock)
    log.note("BAD_FRAME", "first")
    assert summaries(caplog) == ["refused 1 request in the last 10.0 s (BAD_FRAME 1); the last: BAD_FRAME: first"]
    for index in range(7):
        clock.advance(1.0)
        log.note("NOT_ATTACHED" if index % 2 else "BAD_FRAME", f"number {index}")
        log.flush_due()
    assert len(summaries(caplog)) == 1                 # 7 s into the interval: counted, not logged
    clock.advance(3.0)
    log.flush_due()
    assert summaries(caplog)[1:] == ["refused 7 requests in the last 10.0 s (BAD_FRAME 4, NOT_ATTACHED 3); "
                                     "the last: BAD_FRAME: number 6"]
    clock.advance(60.0)
    log.flush_due()
    log.flush()
    assert len(summaries(caplog)) == 2                 # nothing new: no summary
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 8 and debug[0] == "refused a request: BAD_FRAME: first"


def test_a_refusal_after_a_quiet_interval_is_summarised_at_once(caplog):
    caplog.set_level(logging.WARNING, logger="kvcached.server.refusals")
    clock = FakeClock()
    log = RefusalLog(interval_s=5.0, clock=clock)
    log.note("BAD_FRAME", "a")
    clock.advance(30.0)
    log.note("UNKNOWN_KIND", "b")
    assert summaries(caplog)[-1].startswith("refused 1 request in the last 30.0 s (UNKNOWN_KIND 1)")


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError):
        RefusalLog(interval_s=0)
