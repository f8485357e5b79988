"""The connector's request states, against the in-process fake daemon (no sockets), on CPU tensors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine_client.client import DaemonDown
from engine_client.connector import Cause, ConnectorConfig, IllegalTransition, KVConnector, RequestState
from engine_client.connector.state import _NEXT_STATES, Request
from kvcached.testing.blocks import random_bits
from kvcached.testing.daemon_proc import wait_until
from kvcached.testing.fake_daemon import FakeDaemon, saves_held
from proto.counters import LOAD_FAILURE_REASONS, SAVE_SKIP_REASONS

L, N, P, H, D = 2, 16, 4, 2, 8
S = RequestState

# The diagram of engine_client/connector/state.py, edge by edge.
EDGES = {(S.DEFERRED, S.MATCHING), (S.DEFERRED, S.FAILED), (S.MATCHING, S.LEASED), (S.MATCHING, S.FAILED),
         (S.LEASED, S.ENDING), (S.FAILED, S.ENDING), (S.ENDING, S.ENDED)}


class Setup:
    def __init__(self, seed: int, num_pages: int = 32, **config):
        self.daemon = FakeDaemon(num_pages)
        generator = torch.Generator().manual_seed(seed)
        self.tensors = [random_bits((2, N, P, H, D), generator) for _ in range(L)]
        self.connector = KVConnector.register(
            self.daemon, self.tensors, "layer", model_id="fake", page_size=P, num_kv_heads=H, head_dim=D,
            config=ConnectorConfig(report_interval_s=0, **config))
        self.loads = []
        self.moves: list[tuple[object, RequestState, RequestState]] = []

    def block(self, block_id: int) -> torch.Tensor:
        return torch.stack([t[:, block_id] for t in self.tensors]).view(torch.int16).clone()

    def settle(self) -> None:
        """Poll until no request is open (CPU copies are done on return: a few polls)."""
        def polled() -> bool:
            self.loads += self.connector.finished().loads
            return not self.connector.num_open_requests
        wait_until(polled, 5.0, "every request's end")

    def close(self) -> None:
        self.connector.close()
        self.daemon.cleanup()


@pytest.fixture
def setup(seed, monkeypatch):
    made = []

    def make(**config) -> Setup:
        s = Setup(seed + len(made), **config)
        made.append(s)
        real = Request.transition

        def recorded(request, new_state):
            old = request.state
            real(request, new_state)
            s.moves.append((request.request_id, old, new_state))
        monkeypatch.setattr(Request, "transition", recorded)
        return s
    yield make
    for s in made:
        s.close()


def tokens_of(rng, num_pages: int) -> np.ndarray:
    return rng.integers(0, 50_000, size=num_pages * P, dtype=np.int32)


def path_of(s: Setup, request_id) -> list[RequestState]:
    moves = [(old, new) for rid, old, new in s.moves if rid == request_id]
    return [moves[0][0]] + [new for _, new in moves] if moves else []


def saved(s: Setup, rng, num_pages: int, request_id="saved") -> tuple[np.ndarray, np.ndarray]:
    tokens = tokens_of(rng, num_pages)
    source = rng.permutation(N)[:num_pages]
    s.connector.save(request_id, tokens, source)
    s.connector.request_finished(request_id)
    s.settle()
    return tokens, source


def predicted(s: Setup, monkeypatch) -> None:
    """Every begin from here on finds the hints predicting a decline (the fake publishes none)."""
    monkeypatch.setattr(s.connector, "_predicts_recompute", lambda *args: True)


def test_the_table_allows_exactly_the_documented_moves_and_an_illegal_one_changes_nothing():
    """Every (state, state) pair: the move is allowed iff it is an edge of the diagram; an illegal
    one raises IllegalTransition and leaves the state as it was."""
    assert {(a, b) for a, nexts in _NEXT_STATES.items() for b in nexts} == EDGES
    for old, new in itertools.product(RequestState, RequestState):
        request = Request("r", np.empty(0, np.int32), {}, state=old)
        if (old, new) in EDGES:
            request.transition(new)
            assert request.state is new
        else:
            with pytest.raises(IllegalTransition):
                request.transition(new)
            assert request.state is old


def test_the_causes_are_the_counters_declared_reasons():
    """Each cause a page is not moved for is a declared label of the load or save counters, and
    each declared label is a cause (no bare string can reach a counter unnoticed)."""
    assert {cause.value for cause in Cause} == set(LOAD_FAILURE_REASONS) | set(SAVE_SKIP_REASONS)
    assert f"{Cause.NOT_CACHED}" == str(Cause.NOT_CACHED) == "not_cached" == Cause.NOT_CACHED


def test_a_save_then_a_load_round_trip_bit_for_bit_into_other_blocks(setup, rng):
    """A request saves random blocks (DEFERRED -> MATCHING at once -> LEASED -> ENDING -> ENDED, its
    pages committed);
    another loads them into different blocks, which then hold the saved bytes bit for bit, the
    other blocks untouched. Each job's bytes and device time are the cost samples reported."""
    s = setup()
    tokens, source = saved(s, rng, 5)
    destination = np.setdiff1d(rng.permutation(N), source)[:5]
    expected = {int(src): s.block(src) for src in source}
    untouched = {block: s.block(block) for block in range(N) if block not in destination}
    assert s.connector.lookup(tokens) == 5 * P
    s.connector.load("loaded", tokens, destination, 5 * P)
    s.connector.request_finished("loaded")
    s.settle()
    results = [(r.request_id, r.num_tokens, r.failed_block_ids, r.reason) for r in s.loads]
    assert results == [("loaded", 5 * P, [], None)]
    for src, dst in zip(source, destination):
        assert torch.equal(s.block(dst), expected[int(src)]), (src, dst)
    for block, before in untouched.items():
        assert torch.equal(s.block(block), before), block
    for request_id in ("saved", "loaded"):
        assert path_of(s, request_id) == [S.DEFERRED, S.MATCHING, S.LEASED, S.ENDING, S.ENDED], request_id
    page_bytes = s.connector.geometry.bytes_per_page
    samples = [(direction, size) for direction, size, _ in s.daemon.cost_samples if direction != "prefill"]
    assert samples == [("d2h", 5 * page_bytes), ("h2d", 5 * page_bytes)]
    assert all(seconds >= 0 for *_, seconds in s.daemon.cost_samples)
    assert not s.daemon.leases and len(s.daemon.free_page_ids) == s.daemon.num_pages - 5


def test_a_refused_match_fails_the_request_its_loads_fail_and_saves_skip(setup, rng):
    """DEFERRED -> MATCHING -> FAILED -> ENDING -> ENDED: a refused match fails its load (match_refused) and
    skips its save; no lease is left."""
    s = setup()
    tokens = tokens_of(rng, 3)
    s.daemon.refuse_next()
    s.connector.load("r", tokens, [1, 2], 2 * P)
    s.connector.save("r", tokens, [1, 2, 3])
    s.connector.request_finished("r")
    s.settle()
    assert path_of(s, "r") == [S.DEFERRED, S.MATCHING, S.FAILED, S.ENDING, S.ENDED]
    assert [(r.failed_block_ids, r.reason) for r in s.loads] == [([1, 2], "match_refused")]
    stats = s.connector.stats()
    assert stats["save_skipped_pages_match_refused"] == 3 and stats["match_failures_match_refused"] == 1
    assert not s.daemon.leases


def test_a_predicted_decline_is_deferred_then_sent_by_the_requests_next_call(setup, rng, monkeypatch):
    """DEFERRED -> MATCHING -> LEASED: a begun request predicted to decline answers "recompute" with
    nothing sent; its save sends the match, whose reservation the save then writes."""
    s = setup()
    predicted(s, monkeypatch)
    tokens = tokens_of(rng, 2)
    begun = s.connector.begin("r", tokens)
    assert begun.ready() and begun.decision().choice == "recompute"
    assert s.connector._requests["r"].state is S.DEFERRED and not s.daemon.leases
    s.connector.save("r", tokens, [4, 5])
    s.connector.request_finished("r")
    s.settle()
    assert path_of(s, "r") == [S.DEFERRED, S.MATCHING, S.LEASED, S.ENDING, S.ENDED]
    assert s.connector.stats()["committed_pages"] == 2 and s.connector.lookup(tokens) == 2 * P


def test_a_reply_not_in_time_fails_the_request(setup, rng):
    """MATCHING -> FAILED (no_reply): a held reply past reply_timeout_s; the late reply's lease is
    given back."""
    s = setup(reply_timeout_s=0.0)
    s.daemon.hold_replies = True
    s.connector.load("r", tokens_of(rng, 2), [0, 1], 2 * P)
    s.connector.poll()
    assert s.connector._requests["r"].state is S.FAILED and s.connector._requests["r"].failure is Cause.NO_REPLY
    assert not s.daemon.leases
    s.connector.request_finished("r")
    s.settle()
    assert [r.reason for r in s.loads] == ["no_reply"]


def test_the_end_of_the_session_fails_a_request_waiting_for_its_reply(setup, rng):
    """MATCHING -> FAILED (daemon_down): the session ends while the reply is awaited."""
    s = setup()
    s.daemon.hold_replies = True
    s.connector.load("r", tokens_of(rng, 2), [0, 1], 2 * P)
    s.daemon.end_session()
    s.connector.poll()
    request = s.connector._requests["r"]
    assert request.state is S.FAILED and request.failure is Cause.DAEMON_DOWN


def test_a_request_whose_session_ended_sends_nothing_and_sees_no_refusal(setup, rng):
    """As against the client: a request whose acquire reply (a lease) is held when the session
    ends fails daemon_down and, given up, sends no release for its lease (it went with the
    session), so that no refusal reaches the connector's counters."""
    s = setup()
    tokens, _ = saved(s, rng, 2)
    s.daemon.hold_replies = True
    s.connector.load("r", tokens, [4, 5], 2 * P)
    s.daemon.end_session()
    s.connector.poll()
    s.connector.request_finished("r")
    s.settle()
    stats = s.connector.stats()
    assert [r.reason for r in s.loads] == ["daemon_down"], s.loads
    assert not [key for key in stats if key.startswith("daemon_refusals")], stats


def test_ending_a_request_whose_lease_is_not_ending_raises_and_changes_nothing(setup, rng):
    """The connector's own moves go through the table: ending a LEASED request (its transfers not
    settled, not finished) raises IllegalTransition, and the request stays open and LEASED."""
    s = setup()
    s.connector.load("r", tokens_of(rng, 2), [], 0)
    request = s.connector._requests["r"]
    assert request.state is S.LEASED
    with pytest.raises(IllegalTransition):
        s.connector._end(request)
    assert request.state is S.LEASED and s.connector.is_open("r")


@pytest.mark.parametrize("state", [S.DEFERRED, S.MATCHING, S.LEASED, S.FAILED, S.ENDING])
def test_a_request_given_up_in_each_state_gives_its_lease_back(setup, rng, monkeypatch, state):
    """A begun request cancelled in each state (in ENDING: finished, its save in flight, then the
    connector closed) ends, and the daemon holds no lease of it and has every page it reserved
    for it free again."""
    s = setup()
    tokens = tokens_of(rng, 3)
    if state is S.DEFERRED:
        predicted(s, monkeypatch)
    elif state is S.MATCHING:
        s.daemon.hold_replies = True
    elif state is S.FAILED:
        s.daemon.refuse_next()
    begun = s.connector.begin("r", tokens)
    if state in (S.LEASED, S.FAILED, S.ENDING):
        assert begun.ready()                        # the reply taken: LEASED or FAILED
    if state is S.ENDING:
        with saves_held(s.connector):           # never released: in flight until the close
            s.connector.save("r", tokens, [6, 7, 8])
        s.connector.request_finished("r")
    request = s.connector._requests.get("r") or s.connector._ending[0]
    assert request.state is state
    if state is S.MATCHING or state is S.LEASED:
        assert s.daemon.leases                      # the reply (held or in) holds a lease
    if state is S.ENDING:
        s.connector.close(timeout_s=0.0)            # the save never completes: skipped, lease released
        assert s.connector.counters["save_skipped_pages_closing"] == 3
    else:
        begun.cancel()
        s.daemon.deliver()
        s.settle()
    assert request.state is S.ENDED and not s.connector.is_open("r")
    assert not s.daemon.leases and len(s.daemon.free_page_ids) == s.daemon.num_pages
    assert path_of(s, "r") == GIVEN_UP_PATHS[state]


GIVEN_UP_PATHS = {
    S.DEFERRED: [S.DEFERRED, S.FAILED, S.ENDING, S.ENDED],
    S.MATCHING: [S.DEFERRED, S.MATCHING, S.FAILED, S.ENDING, S.ENDED],
    S.LEASED: [S.DEFERRED, S.MATCHING, S.LEASED, S.ENDING, S.ENDED],
    S.FAILED: [S.DEFERRED, S.MATCHING, S.FAILED, S.ENDING, S.ENDED],
    S.ENDING: [S.DEFERRED, S.MATCHING, S.LEASED, S.ENDING, S.ENDED],
}


def test_after_the_session_ends_its_pool_is_dropped_and_a_new_sessions_pool_swapped_in(setup, rng):
    """The session ends: the connector unmaps its pool (nothing in flight) and says it drained; a
    request made then skips the daemon (daemon_down). Once a new session is attached, its pool is
    swapped in by a poll, and a save and a load round trip bit for bit again."""
    s = setup()
    s.daemon.end_session()
    assert s.connector._pool_dropped and s.daemon.drained == [1]
    s.connector.load("down", tokens_of(rng, 2), [0, 1], 2 * P)
    s.connector.request_finished("down")
    s.settle()
    assert [r.reason for r in s.loads] == ["daemon_down"]
    s.daemon.reattach()
    wait_until(lambda: s.connector.poll() or s.connector._generation == 2, 5.0, "the new session's pool")
    s.loads.clear()
    tokens, source = saved(s, rng, 3)
    destination = np.setdiff1d(rng.permutation(N), source)[:3]
    s.connector.load("again", tokens, destination, 3 * P)
    s.connector.request_finished("again")
    s.settle()
    assert [(r.num_tokens, r.failed_block_ids) for r in s.loads] == [(3 * P, [])]
    for src, dst in zip(source, destination):
        assert torch.equal(s.block(dst), s.block(src)), (src, dst)


def test_a_save_skip_cause_this_connector_does_not_know_is_counted_unknown_and_the_lease_still_ends(
        setup, rng, monkeypatch):
    """An acquire reply whose save_skipped is a cause newer than this connector (a daemon of the
    same protocol version may add one) leases the request as usual: its loads fill, its saves
    beyond the hit are skipped as "unknown", and its lease ends (none left on the daemon)."""
    s = setup()
    tokens, source = saved(s, rng, 2)
    answer = s.daemon._answer

    def newer_cause(*args, **kwargs):
        reply = answer(*args, **kwargs)
        if not kwargs.get("lock"):
            return reply
        return reply._replace(save_skipped="a_cause_of_a_newer_daemon", reserved_page_ids=[], reserved_generation=0)
    monkeypatch.setattr(s.daemon, "_answer", newer_cause)
    longer = np.concatenate([tokens, tokens_of(rng, 2)])
    s.connector.load("r", longer, [8, 9], 2 * P)
    s.connector.save("r", longer, [8, 9, 10, 11])
    s.connector.request_finished("r")
    s.settle()
    assert path_of(s, "r") == [S.DEFERRED, S.MATCHING, S.LEASED, S.ENDING, S.ENDED]
    assert [(r.request_id, r.failed_block_ids, r.reason) for r in s.loads] == [("r", [], None)]
    assert s.connector.stats()["save_skipped_pages_unknown"] == 2
    assert not s.daemon.leases


def test_the_fake_daemon_returns_a_reply_in_before_the_session_ended_as_the_client_does(setup, rng):
    """As the real client's pending reply: one whose reply was in when the session ended returns it
    (its lease went with the session); one held then raises DaemonDown, also after a later
    deliver() (no reply comes for an ended session)."""
    s = setup()
    tokens, _ = saved(s, rng, 2)
    daemon = s.daemon
    arrived = daemon.acquire_async(tokens)
    daemon.hold_replies = True
    held = daemon.acquire_async(tokens)
    daemon.end_session()
    daemon.deliver()
    assert arrived.ready() and arrived.wait(0) and held.wait(0)
    reply = arrived.result()
    assert reply.hit_tokens["l2"] == 2 * P and reply.lease_id is not None
    with pytest.raises(DaemonDown):
        held.result()
    assert not daemon.leases
