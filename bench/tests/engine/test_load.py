"""A request's load as one object with explicit states: the legal paths, and illegal transitions
refused with nothing changed."""

from __future__ import annotations

import dataclasses

import pytest

from bench.engine.load import LoadState, PendingLoad


def fresh() -> PendingLoad:
    return PendingLoad(("r", 0), start_token=16, num_tokens_asked=64, started_s=1.0)


def test_a_load_goes_matching_in_flight_done_and_is_voided_only_when_it_loads_less_than_queued():
    """MATCHING -> IN_FLIGHT (its tokens, when) -> DONE (its tokens, reason, when); voided exactly when
    DONE loads fewer tokens than IN_FLIGHT promised; a load DONE straight from MATCHING is never voided."""
    load = fresh()
    assert load.state is LoadState.MATCHING and load.pending
    load.queued(48, 2.0)
    assert (load.state, load.num_tokens, load.queued_s, load.pending) == (LoadState.IN_FLIGHT, 48, 2.0, True)
    load.done(48, "not_cached", 3.0)
    assert (load.state, load.num_tokens, load.reason, load.done_s, load.voided) == (LoadState.DONE, 48, "not_cached",
                                                                                   3.0, False)
    assert not load.pending
    voided = fresh()
    voided.queued(48, 2.0)
    voided.done(0, "session_lost", 3.0)
    assert voided.voided and voided.num_tokens == 0
    direct = fresh()
    direct.done(0, "no_reply", 2.0)
    assert direct.state is LoadState.DONE and not direct.voided


@pytest.mark.parametrize("path", ["matching", "in_flight"])
def test_a_pending_load_can_be_cancelled_and_nothing_follows_an_end(path):
    """MATCHING or IN_FLIGHT -> CANCELLED; from CANCELLED or DONE every transition raises and leaves
    the load as it was; queued twice raises too."""
    load = fresh()
    if path == "in_flight":
        load.queued(64, 2.0)
    load.cancel()
    assert load.state is LoadState.CANCELLED and not load.pending
    done = fresh()
    done.done(64, None, 2.0)
    in_flight = fresh()
    in_flight.queued(64, 2.0)
    for ended, calls in ((load, ("queued", "done", "cancel")), (done, ("queued", "done", "cancel")),
                         (in_flight, ("queued",))):
        for call in calls:
            before = dataclasses.asdict(ended)
            with pytest.raises(RuntimeError, match="no transition"):
                {"queued": lambda: ended.queued(1, 9.0), "done": lambda: ended.done(1, None, 9.0),
                 "cancel": ended.cancel}[call]()
            assert dataclasses.asdict(ended) == before, call
