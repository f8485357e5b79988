"""The cost model inside DaemonState: lookups and restoring matches carry its decision, samples reach
it through engine reports, and a declined L3 hit is promoted in the background only when it pays."""

from __future__ import annotations

import pytest

from kvcached.core.cost_model import STALE_DECLINES, CostModel, CostPriors
from kvcached.core.daemon import DaemonState
from kvcached.core.tier_ops import TierMove
from kvcached.core.tiers import Tier
from proto.replies import AcquireReply
from tests.core.test_daemon_l3 import L3_BYTES, commit, only_in_l3
from kvcached.testing.clock import FakeClock
from proto.schema import Acquire, Lookup, Release
from tests.core.test_daemon_state import GEOMETRY, PAGE, back_up, tokens
from tests.server.test_metrics import exported, value

BYTES_PER_PAGE = GEOMETRY.bytes_per_page


def make_state(**priors) -> DaemonState:
    return DaemonState(2 << 20, max_namespaces=1, session_timeout_s=1.5, l3_bytes=L3_BYTES, clock=FakeClock(),
                       cost_model=CostModel(CostPriors(**priors)))


def slow_disk(state: DaemonState, rng) -> None:
    """Storage reads as the server measures them (its own L3 I/O): 0.5 s each, of varied sizes."""
    for num_pages in rng.integers(1, 16, size=8).tolist():
        state.cost.add_storage_sample("s2h", num_pages * BYTES_PER_PAGE, 0.5 + num_pages * 1e-3)


def test_a_lookup_carries_the_decision_and_status_counts_it(rng):
    """An L2 hit worth restoring: the lookup answers "l2", the tokens to hold, a prediction per
    candidate and the policy; a lookup whose engine holds as much itself answers "engine". Status
    counts both per choice under the engine's namespace."""
    state = make_state()
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = tokens(rng, 6)
    state.finish_move(commit(state, session.session_id, prefix)[1], ok=True)
    reply = state.lookup(Lookup(session.session_id, prefix + tokens(rng, 1), prefetch=True))
    assert (reply.choice, reply.restore_tokens, reply.policy) == ("l2", 6 * PAGE, "cost")
    assert set(reply.predicted_s) == {"l2", "recompute"} and reply.predicted_s["l2"] < reply.predicted_s["recompute"]
    held = state.lookup(Lookup(session.session_id, prefix, local_hit_tokens=6 * PAGE, prefetch=True))
    assert (held.choice, held.restore_tokens) == ("engine", 6 * PAGE)
    engine = state.status()["cost_model"]["engines"][0]
    assert engine["namespace_id"] == namespace.namespace_id
    assert engine["decisions_total"] == {"lookup": {"l2": 1, "engine": 1}}
    state.check_integrity()


def test_a_slow_l3_is_declined_while_l2_is_taken(rng):
    """Once the daemon has measured slow storage reads, a restoring match of a prefix only L3 holds
    promotes nothing (it answers recompute, and the engine computes it), while a prefix in L2 is
    leased as before; the policy "always" still promotes the L3 one."""
    state = make_state()
    session, _ = state.attach(GEOMETRY, pid=1)
    in_l3 = only_in_l3(state, session.session_id, rng, 4)
    in_l2 = tokens(rng, 4)
    state.finish_move(commit(state, session.session_id, in_l2)[1], ok=True)
    assert state.lookup(Lookup(session.session_id, in_l3, prefetch=True)).choice == "l3"        # by the prior: a fast disk
    slow_disk(state, rng)

    declined = state.acquire(Acquire(session.session_id, in_l3, promote="wait"))
    assert isinstance(declined, AcquireReply) and declined.choice == "recompute"
    assert declined.hit_tokens == {"l2": 0, "l3": 4 * PAGE} and declined.restore_tokens == 0 and not state.moves
    taken = state.acquire(Acquire(session.session_id, in_l2, promote="wait"))
    assert (taken.choice, taken.restore_tokens, taken.reserved_start_token) == ("l2", 4 * PAGE, 4 * PAGE)
    assert taken.lease_id is not None and len(taken.host_page_ids) == 4
    state.release(Release(session.session_id, taken.lease_id))

    request = Acquire(session.session_id, in_l3, policy="always", promote="wait")
    forced = state.acquire(request)
    assert isinstance(forced, TierMove) and forced.direction == "s2h" and forced.decision.choice == "l3"
    state.finish_move(forced, ok=True)
    after = state.acquire_after(request, forced)
    assert (after.choice, after.restore_tokens, after.hit_tokens["l2"]) == ("l3", 4 * PAGE, 4 * PAGE)
    state.release(Release(session.session_id, after.lease_id))
    state.check_integrity()


def test_policy_never_restores_nothing_and_always_the_longest_hit(rng):
    """never: a lookup answers recompute and the engine's own hit, a restoring match promotes
    nothing; always: the lookup names L3 (longer than L2) though the model says it is slow."""
    state = make_state()
    session, _ = state.attach(GEOMETRY, pid=1)
    prefix = only_in_l3(state, session.session_id, rng, 5)
    slow_disk(state, rng)
    never = state.lookup(Lookup(session.session_id, prefix, local_hit_tokens=PAGE, policy="never", prefetch=True))
    assert (never.choice, never.restore_tokens, never.policy) == ("recompute", PAGE, "never")
    assert isinstance(state.acquire(Acquire(session.session_id, prefix, policy="never", promote="wait")), AcquireReply)
    assert not state.moves
    always = state.lookup(Lookup(session.session_id, prefix, policy="always", prefetch=True))
    assert (always.choice, always.restore_tokens) == ("l3", 5 * PAGE)
    skips = state.status()["cost_model"]["engines"][0]["policy_skips_total"]
    assert skips == {"lookup": {"l3": 1}, "match": {"l3": 1}}


def test_samples_an_engine_reports_make_short_prefixes_recompute_and_long_ones_restore(rng):
    """An engine reports (ENGINE_REPORT's cost samples) DMAs of 2 ms before any byte moves and a
    prefill of 100 us per token: then a 1-page L2 hit is recomputed (0.8 ms) and an 8-page one
    restored (6.4 ms against 1.1 x 2.1 ms); before, with priors alone, both were restored."""
    state = make_state()
    session, _ = state.attach(GEOMETRY, pid=1)
    short, long = tokens(rng, 1), tokens(rng, 8)
    back_up(state, session.session_id, short)
    back_up(state, session.session_id, long)
    assert [state.lookup(Lookup(session.session_id, t, prefetch=True)).choice for t in (short, long)] == ["l2", "l2"]
    samples = []
    for num_pages in rng.integers(1, 16, size=16).tolist():
        samples.append(("h2d", num_pages * BYTES_PER_PAGE, 0.002 + num_pages * BYTES_PER_PAGE / 10e9))
    for num_tokens in rng.integers(16, 2048, size=16).tolist():
        samples.append(("prefill", num_tokens, 0.004 + num_tokens * 100e-6))
    state.engine_report(session.session_id, {}, samples + [("prefill", 8, 1.0)])     # too short: ignored
    decided = [state.lookup(Lookup(session.session_id, t, prefetch=True)) for t in (short, long)]
    assert [(r.choice, r.restore_tokens) for r in decided] == [("recompute", 0), ("l2", 8 * PAGE)]
    cost = state.status()["cost_model"]
    directions = cost["engines"][0]["directions"]
    assert directions["h2d"]["mode"] == directions["prefill"]["mode"] == "fit"
    assert directions["prefill"]["slope_s_per_token"] == pytest.approx(100e-6)
    assert directions["h2d"]["fixed_s"] == pytest.approx(0.002) and cost["samples_ignored_total"] == 1


def test_a_declined_l3_hit_is_promoted_in_the_background_one_at_a_time(rng):
    """A lookup declines a slow L3 hit whose L2 copy would win for a later request: the daemon plans
    its promotion (no request waits for it), one per namespace at a time; published, a later lookup
    restores it from L2. Under always (L3 taken on the request's path) nothing is planned."""
    state = make_state()
    session, _ = state.attach(GEOMETRY, pid=1)
    first = only_in_l3(state, session.session_id, rng, 4)
    slow_disk(state, rng)
    looked_up = state.lookup(Lookup(session.session_id, first, prefetch=True))
    assert looked_up.choice == "recompute" and not state.moves
    move = state.promote_in_background(session.session_id, first, looked_up)
    assert isinstance(move, TierMove) and move.direction == "s2h" and len(move.private_page_ids) == 4
    assert state.promote_in_background(session.session_id, first, state.lookup(Lookup(session.session_id, first, prefetch=True))) is None
    state.check_integrity()
    state.finish_move(move, ok=True)
    looked_up = state.lookup(Lookup(session.session_id, first, prefetch=True))
    assert (looked_up.choice, looked_up.restore_tokens) == ("l2", 4 * PAGE)
    cost = state.status()["cost_model"]
    assert cost["background_promotions_total"] == 1 and cost["background_promotion_skips_busy_total"] == 1
    assert cost["background_promoted_pages_total"] == 4
    # always: the lookup chose L3 itself, nothing to do in the background.
    second = only_in_l3(state, session.session_id, rng, 3)
    assert state.promote_in_background(session.session_id, second,
                                       state.lookup(Lookup(session.session_id, second, policy="always", prefetch=True))) is None
    assert not state.moves
    state.check_integrity()


def test_no_background_promotion_where_a_later_l2_restore_would_not_win(rng):
    """A recompute cheaper than the DMA (so an L2 copy would not be restored either): the declined
    L3 hit is not promoted, and the skip is counted."""
    state = make_state(recompute_s_per_token=1e-9)
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = only_in_l3(state, session.session_id, rng, 4)
    looked_up = state.lookup(Lookup(session.session_id, prefix, prefetch=True))
    assert looked_up.choice == "recompute"
    assert state.promote_in_background(session.session_id, prefix, looked_up) is None and not state.moves
    assert state.status()["cost_model"]["background_promotion_skips_no_gain_total"] == 1
    assert state.lookup(Lookup(session.session_id, prefix, prefetch=True)).hit_tokens["l2"] == 0


def test_slow_storage_writes_do_not_stop_backups_to_l3(rng):
    """Admission to L3 prices only a later restore, never the write: with the daemon's measured
    writes taking seconds, a commit still plans the write-through of its new pages, and the
    decision for a later read is the read line's alone."""
    state = make_state()
    session, _ = state.attach(GEOMETRY, pid=1)
    for num_pages in rng.integers(1, 16, size=16).tolist():
        state.cost.add_storage_sample("h2s", num_pages * BYTES_PER_PAGE, 5.0 + num_pages)
    _, write_through = commit(state, session.session_id, tokens(rng, 4))
    assert write_through is not None and write_through.direction == "h2s" and len(write_through.private_page_ids) == 4
    state.finish_move(write_through, ok=True)
    assert state.status()["cost_model"]["storage"]["s2h"]["samples_total"] == 0
    state.check_integrity()



def declined_path_l2_full(state: DaemonState, session_id: int, rng) -> bytes:
    """A 4-page path only L3 holds, last used before anything L2 now holds (L2 is full of a later
    16-page backup), on a disk the model has measured slow."""
    prefix = tokens(rng, 4)
    _, move = commit(state, session_id, prefix)
    state.finish_move(move, ok=True)
    state.clock.advance(1.0)
    _, move = commit(state, session_id, tokens(rng, 16))       # all of L2: evicts the prefix there
    state.finish_move(move, ok=True)
    state.clock.advance(1.0)
    slow_disk(state, rng)
    hits = state.lookup(Lookup(session_id, prefix, prefetch=True)).hit_tokens          # a lookup: uses nothing
    assert (hits["l2"], hits["l3"]) == (0, 4 * PAGE)
    return prefix


@pytest.mark.parametrize("promote", ["wait", "recompute"])
def test_a_save_of_a_declined_l3_path_l2_would_evict_before_its_reuse_reserves_nothing(promote, rng):
    """A match (with a backup reservation; one that may promote L3, or a predicted decline's) of a
    path whose L3 hit the model declines, last used before the least recently used page of a full
    L2: no page is reserved (its copy would be evicted before its next use), the reply says why,
    the skip is counted, L2 keeps what it held. The path used again at once (sooner than anything
    L2 holds) gets its reservation."""
    state = make_state()
    session, _ = state.attach(GEOMETRY, pid=1)
    prefix = declined_path_l2_full(state, session.session_id, rng)
    l2_before = state.namespaces[session.namespace_id].tree.owned_pages(Tier.L2)
    request = prefix + tokens(rng, 1)
    skipped = state.acquire(Acquire(session.session_id, request, save=True, promote=promote))
    assert isinstance(skipped, AcquireReply) and skipped.choice == "recompute", skipped
    assert (skipped.lease_id, skipped.reserved_page_ids, skipped.save_skipped) == (None, [], "evicted_before_reuse")
    assert state.metrics.counters["backup_policy_skips"] == 1
    assert value(exported(state.status()), "kvcached_policy_skips_total", direction="d2h",
                 reason="evicted_before_reuse") == 1
    assert state.namespaces[session.namespace_id].tree.owned_pages(Tier.L2) == l2_before
    state.check_integrity()
    state.clock.advance(1.0)
    again = state.acquire(Acquire(session.session_id, request, save=True, promote=promote))
    assert again.choice == "recompute" and again.save_skipped == "" and len(again.reserved_page_ids) == 5, again
    state.release(Release(session.session_id, again.lease_id))
    assert state.metrics.counters["backup_policy_skips"] == 1
    state.check_integrity()


@pytest.mark.parametrize("case", ["policy never", "L3 restore taken", "room in L2", "prefix in L2"])
def test_a_save_is_reserved_unless_the_model_declined_l3_and_l2_would_evict_its_copy_first(case, rng):
    """The same path and a full L2 as where the reservation is skipped, changed in one way: the
    policy is never (nothing is declined by the model), the disk is fast (the L3 restore is taken:
    the match promotes, then reserves), L2 has room (nothing would be evicted), or L2 holds the
    path (the save writes only new pages): the match reserves the pages beyond the L2 hit."""
    state = make_state()
    session, namespace = state.attach(GEOMETRY, pid=1)
    prefix = declined_path_l2_full(state, session.session_id, rng)
    request = prefix + tokens(rng, 1)
    policy, l2_hit = "", 0
    if case == "policy never":
        policy = "never"
    elif case == "L3 restore taken":
        state.cost = CostModel(CostPriors())                  # the prior: a fast disk
        acquire = Acquire(session.session_id, request, save=True, promote="wait")
        move = state.acquire(acquire)
        assert isinstance(move, TierMove) and move.decision.choice == "l3"
        state.finish_move(move, ok=True)
        reply = state.acquire_after(acquire, move)
        assert reply.promoted_tokens == 4 * PAGE
        assert reply.save_skipped == "" and reply.reserved_start_token == 4 * PAGE and len(reply.reserved_page_ids) == 1
        state.release(Release(session.session_id, reply.lease_id))
        state.check_integrity()
        return
    elif case == "room in L2":
        tree = namespace.tree
        namespace.allocator(Tier.L2).free(tree.evict(Tier.L2, 5))
    else:
        _, move = commit(state, session.session_id, prefix)    # the path back in L2, then L3 alone beyond it
        if move is not None:
            state.finish_move(move, ok=True)
        l2_hit = 4
    reply = state.acquire(Acquire(session.session_id, request, policy=policy, save=True, promote="wait"))
    assert isinstance(reply, AcquireReply) and reply.save_skipped == "", reply
    assert reply.reserved_start_token == l2_hit * PAGE and len(reply.reserved_page_ids) == 5 - l2_hit, reply
    assert state.metrics.counters["backup_policy_skips"] == 0
    state.release(Release(session.session_id, reply.lease_id))
    state.check_integrity()


def test_one_slow_h2d_sample_an_engine_reports_stops_declining_l2_within_200_requests(rng):
    """An engine reports one 1-s DMA: its lookups of an 8-page L2 hit answer recompute, but within
    STALE_DECLINES + 1 lookups (under 200) one answers l2 again; status shows the line dropped."""
    state = make_state()
    session, _ = state.attach(GEOMETRY, pid=1)
    prefix = tokens(rng, 8)
    back_up(state, session.session_id, prefix)
    assert state.lookup(Lookup(session.session_id, prefix, prefetch=True)).choice == "l2"
    state.engine_report(session.session_id, {}, [("h2d", 8 * BYTES_PER_PAGE, 1.0)])
    choices = [state.lookup(Lookup(session.session_id, prefix, prefetch=True)).choice for _ in range(200)]
    assert choices.index("l2") == STALE_DECLINES and set(choices[:STALE_DECLINES]) == {"recompute"}
    cost = state.status()["cost_model"]
    assert cost["stale_line_resets_total"] == 1
    assert cost["engines"][0]["directions"]["h2d"]["stale_resets_total"] == 1
    assert value(exported(state.status()), "kvcached_cost_model_stale_line_resets_total") == 1
    state.check_integrity()


def test_a_stale_storage_line_publishes_the_prior_hint_again(rng):
    """A disk measured slow publishes an L3 bound (hints) that predicts every L3 hit declined;
    once STALE_DECLINES decisions (the matches of predicted requests) declined it without a read
    since, the storage line is back at its prior and so is the published bound."""
    state = make_state()
    session, namespace = state.attach(GEOMETRY, pid=1)
    prior_bound = state.hints.head(namespace.hints_slot)["l3_min_tokens"]
    prefix = only_in_l3(state, session.session_id, rng, 4)
    slow_disk(state, rng)
    state.publish_cost_hints()
    assert state.hints.head(namespace.hints_slot)["l3_min_tokens"] > max(prior_bound, 4 * PAGE)
    for _ in range(STALE_DECLINES):
        reply = state.acquire(Acquire(session.session_id, prefix, promote="recompute"))
        assert reply.choice == "recompute"
    assert state.hints.head(namespace.hints_slot)["l3_min_tokens"] == prior_bound
    assert state.cost.storage["s2h"].mode == "prior"
    assert state.lookup(Lookup(session.session_id, prefix, prefetch=True)).choice == "l3"
    state.check_integrity()
