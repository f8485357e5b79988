"""The engine connector against a real daemon process over ipc://, on CPU tensors."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from engine_client.client import connect
from engine_client.connector import ConnectorConfig, LoadResult
from kvcached.server.status import render_table
from kvcached.testing.daemon_proc import PATIENT_DAEMON, DaemonProcess, stop_process
from kvcached.testing.connector_engine import L, N, P, SEED, Engine, random_tokens


def untimed(results) -> list[LoadResult]:
    """Load results without their copies' device time (which differs from run to run)."""
    return [result._replace(transfer_s=0.0) for result in results]


def session_counters(daemon, name: str) -> dict:
    with connect(daemon.socket_path) as client:
        for session in client.status()["sessions"]:
            if session["client_name"] == name:
                return session["report"].get("connector", {}).get("counters", {})
    raise AssertionError(f"no session named {name}")


@pytest.fixture
def daemon():
    process = DaemonProcess().start()
    yield process
    process.cleanup()


@pytest.mark.parametrize("kind", ["pool", "layer", "blocks"])
def test_a_saved_prefix_loads_into_other_blocks_bit_for_bit(daemon, kind):
    """Engine A saves a prefix from random blocks; engine B (its own session and random tensors, same
    namespace) finds it by lookup, loads it into different blocks, and holds A's bytes bit for bit;
    B's other blocks are untouched. Its result reports its copies' time (more than none)."""
    rng = np.random.default_rng(SEED)
    a, b = Engine(daemon.socket_path, kind, seed=SEED), Engine(daemon.socket_path, kind, seed=SEED + 1)
    try:
        tokens = random_tokens(rng, 7 * P + 5)
        source = rng.permutation(N)[:7]
        a.connector.save("r", tokens, source)
        a.connector.request_finished("r")
        a.settle()
        assert b.connector.lookup(tokens) == 7 * P
        destination = np.setdiff1d(rng.permutation(N), source)[:7]
        untouched = {block: b.block(block) for block in range(N) if block not in destination}
        b.connector.load("r", tokens, destination, 7 * P)
        b.poll_until(lambda: b.loads, "the load")
        assert untimed(b.loads) == [LoadResult("r", 7 * P, [], None)] and b.loads[0].transfer_s > 0, b.loads
        for src, dst in zip(source, destination):
            assert torch.equal(b.block(dst), a.block(src)), (kind, SEED, src, dst)
        for block, before in untouched.items():
            assert torch.equal(b.block(block), before), (kind, block)
        b.connector.request_finished("r")
        b.settle()
        with connect(daemon.socket_path) as client:
            status = client.status(check_integrity=True)
        assert status["integrity"] == "ok" and status["leases"] == 0
    finally:
        a.close()
        b.close()


def test_a_finished_requests_blocks_are_released_once_its_gathers_are_done_not_its_dma():
    """A finished request whose save is queued holds its blocks only while the save's gathers read
    them: with the save's DMA to L2 still in flight (its completion held back here), ``released``
    names the request, nothing is committed yet, and the id may be used again at once (vLLM resumes
    a preempted request under its id once it is released): a second save under it is a request of
    its own. Once the DMA completes the pages of both are committed, and each request that held its
    blocks is released once. (The daemon is stopped while the first save and request_finished are
    called, so that the acquire's reply is not in yet and the request does hold its blocks; its
    heartbeats are slow, as in the test below, so that the pause costs no session.)"""
    daemon = DaemonProcess(extra_args=PATIENT_DAEMON).start()
    rng = np.random.default_rng(SEED + 40)
    engine = queue_save = None
    dma_done = False

    class DmaInFlight:
        """The queued save, its blocks read (blocks_free), its DMA not done until dma_done."""

        def __init__(self, transfer):
            self.transfer = transfer

        def __getattr__(self, name):
            return getattr(self.transfer, name)

        def done(self) -> bool:
            return dma_done and self.transfer.done()

    try:
        engine = Engine(daemon.socket_path)
        queue_save = engine.connector.transfer.save
        engine.connector.transfer.save = lambda *args, **kwargs: DmaInFlight(queue_save(*args, **kwargs))
        tokens = random_tokens(rng, 4 * P)
        stop_process(daemon.proc.pid)
        try:
            engine.connector.save("r", tokens, [3, 7, 11, 2])
            holds = engine.connector.request_finished("r")
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert holds
        engine.poll_until(lambda: "r" in engine.released, "the blocks' release")
        assert engine.connector.stats().get("committed_pages", 0) == 0 and engine.connector.is_open("r")
        again = random_tokens(rng, 2 * P)
        engine.connector.save("r", again, [13, 14])
        assert engine.connector.num_open_requests == 2
        holds_again = engine.connector.request_finished("r")
        dma_done = True
        engine.poll_until(lambda: engine.connector.stats().get("committed_pages") == 6, "the commits")
        engine.settle()
        assert engine.released == ["r"] * (1 + holds_again) and not engine.connector.is_open("r")
        assert engine.connector.lookup(tokens) == 4 * P and engine.connector.lookup(again) == 2 * P
        with connect(daemon.socket_path) as client:
            assert client.status(check_integrity=True)["integrity"] == "ok"
    finally:
        dma_done = True
        if engine is not None:
            engine.connector.transfer.__dict__.pop("save", None)    # nothing here keeps the pool's views
            queue_save = None
            engine.close()
        daemon.cleanup()


def test_loads_and_saves_return_at_once_and_complete_by_polling():
    """With the daemon stopped (SIGSTOP), save(), load() and request_finished() still return at
    once: nothing waits for a reply. The saved request holds its blocks (request_finished says so)
    until, the daemon resumed, polling completes everything and reports the request released.

    The stop is a pause, not an outage: with the default timings a loaded machine's few hundred ms
    between SIGSTOP and the next poll is enough for the session to be no longer known valid for the
    fence margin (1.5 s counted from the last answered heartbeat's sending, up to 0.5 s before the
    stop), and the load then fails by design (session_margin). So this daemon's heartbeats are 5 s
    apart and its sessions time out after 30 s: the client would see an outage after 10 s."""
    daemon = DaemonProcess(extra_args=PATIENT_DAEMON).start()
    rng = np.random.default_rng(SEED + 2)
    engine = None
    try:
        engine = Engine(daemon.socket_path, "layer", seed=SEED + 2)
        cached = random_tokens(rng, 4 * P)
        engine.connector.save("warm", cached, [0, 1, 2, 3])
        engine.connector.request_finished("warm")
        engine.settle()
        fresh = random_tokens(rng, 3 * P)
        stop_process(daemon.proc.pid)
        try:
            started = time.monotonic()
            engine.connector.load("load", cached, [10, 11, 12, 13], 4 * P)
            engine.connector.save("save", fresh, [20, 21, 22])
            holds = engine.connector.request_finished("save")
            engine.connector.poll()
            finished = engine.connector.finished()
            elapsed = time.monotonic() - started
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert holds and finished.loads == [] and finished.released == []
        assert elapsed < 2.0, f"the calls took {elapsed:.3f} s with the daemon stopped"
        engine.poll_until(lambda: engine.loads and "save" in engine.released, "the load and the save")
        assert engine.loads[0].ok, (engine.loads, engine.connector.stats())
        for src, dst in zip([0, 1, 2, 3], [10, 11, 12, 13]):
            assert torch.equal(engine.block(src), engine.block(dst))
        engine.connector.request_finished("load")
        engine.settle()
        assert engine.connector.lookup(fresh) == 3 * P
    finally:
        if engine is not None:
            engine.close()
        daemon.cleanup()


def test_one_match_per_request_however_many_saves(daemon):
    """A request's load and its chunked saves share one lease: the daemon sees one match for the
    request, and the pages of every chunk are committed."""
    rng = np.random.default_rng(SEED + 3)
    engine = Engine(daemon.socket_path, "layer", seed=SEED + 3)
    other = Engine(daemon.socket_path, "layer", seed=SEED + 4)
    try:
        prompt = random_tokens(rng, 6 * P)
        engine.connector.load("r", prompt, [], 0)               # opens the request: lease + reservation
        engine.connector.save("r", prompt[: 2 * P], [4, 5])     # chunked prefill: three chunks
        engine.connector.save("r", prompt[: 4 * P], [6, 7], start_token=2 * P)
        engine.connector.save("r", prompt, [8, 9], start_token=4 * P)
        engine.connector.request_finished("r")
        engine.settle()
        assert engine.connector.stats()["matches"] == 1
        assert engine.connector.stats()["committed_pages"] == 6
        assert other.connector.lookup(prompt) == 6 * P
        other.connector.load("r", prompt, [0, 1, 2, 3, 10, 11], 6 * P)
        other.poll_until(lambda: other.loads, "the load")
        for src, dst in zip([4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 10, 11]):
            assert torch.equal(other.block(dst), engine.block(src)), (src, dst)
    finally:
        engine.close()
        other.close()


def test_set_policy_applies_to_the_lookups_and_matches_sent_after_it(daemon):
    """One connector, its policy switched between requests: under "never" a cached prefix is
    neither looked up as a hit nor loaded (its match restores nothing), under "always" both take
    it whole; a lookup sent before the switch keeps its policy; an unknown policy is refused and
    changes nothing."""
    rng = np.random.default_rng(SEED + 5)
    a = Engine(daemon.socket_path, "layer", seed=SEED + 5)
    b = Engine(daemon.socket_path, "layer", seed=SEED + 6)
    try:
        tokens = random_tokens(rng, 5 * P + 3)
        a.connector.save("r", tokens, rng.permutation(N)[:5])
        a.connector.request_finished("r")
        a.settle()
        b.connector.set_policy("never")
        sent_under_never = b.connector.lookup_async(tokens)
        b.connector.set_policy("always")
        assert sent_under_never.result() == 0 and b.connector.lookup(tokens) == 5 * P
        b.connector.set_policy("never")
        assert b.connector.lookup(tokens) == 0
        begun = b.connector.begin("n", tokens)
        assert begun.result() == 0
        b.connector.request_finished("n")
        b.connector.set_policy("always")
        begun = b.connector.begin("y", tokens)
        assert begun.result() == 5 * P
        b.connector.load("y", tokens, rng.permutation(N)[:5], 5 * P)
        b.poll_until(lambda: b.loads, "the load")
        assert untimed(b.loads) == [LoadResult("y", 5 * P, [], None)], b.loads
        b.connector.request_finished("y")
        with pytest.raises(ValueError, match="policy must be one of"):
            b.connector.set_policy("sometimes")
        assert b.connector.config.policy == "always" and b.connector.lookup(tokens) == 5 * P
        b.settle()
    finally:
        a.close()
        b.close()


def test_two_tensor_parallel_ranks(daemon):
    """Each rank saves and loads its own shard; a prefix counts as cached (for both ranks' lookups)
    only as far as every rank holds it; a rank asked for more than it holds loads its part and
    reports the rest failed."""
    rng = np.random.default_rng(SEED + 5)
    ranks = [Engine(daemon.socket_path, "layer", seed=SEED + 10 + r, tp_rank=r, tp_size=2) for r in range(2)]
    try:
        tokens = random_tokens(rng, 5 * P)
        ranks[0].connector.save("a", tokens, [0, 1, 2, 3, 4])
        ranks[0].connector.request_finished("a")
        ranks[0].settle()
        assert [rank.connector.lookup(tokens) for rank in ranks] == [0, 0]      # rank 1 holds nothing
        ranks[1].connector.save("a", tokens[: 3 * P], [5, 6, 7])
        ranks[1].connector.request_finished("a")
        ranks[1].settle()
        assert [rank.connector.lookup(tokens) for rank in ranks] == [3 * P, 3 * P]
        ranks[1].connector.load("b", tokens, [10, 11, 12, 13, 14], 5 * P)         # more than it holds
        ranks[1].poll_until(lambda: ranks[1].loads, "rank 1's load")
        assert untimed(ranks[1].loads) == [LoadResult("b", 3 * P, [13, 14], "not_cached")]
        ranks[1].connector.request_finished("b")
        ranks[1].connector.save("c", tokens, [5, 6, 7, 8, 9])                      # pages 3, 4 are new
        ranks[1].connector.request_finished("c")
        ranks[1].settle()
        assert [rank.connector.lookup(tokens) for rank in ranks] == [5 * P, 5 * P]
        for rank, source in zip(ranks, ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])):
            rank.connector.load("d", tokens, [15, 16, 17, 18, 19], 5 * P)
            rank.poll_until(lambda: any(r.request_id == "d" for r in rank.loads), "the load")
            for src, dst in zip(source, [15, 16, 17, 18, 19]):
                assert torch.equal(rank.block(dst), rank.block(src)), (rank.connector.geometry.tp_rank, src)
        assert not torch.equal(ranks[0].block(15), ranks[1].block(15))              # two shards, not one
    finally:
        for rank in ranks:
            rank.close()


def test_salts_revisions_and_page_formats_are_separate_namespaces(daemon):
    """A prefix saved under one cache salt is not found by engines with another salt, another
    model revision, or opaque blocks of the same size; an engine with the same salt finds it."""
    rng = np.random.default_rng(SEED + 6)
    tokens = random_tokens(rng, 4 * P)
    saver = Engine(daemon.socket_path, "layer", seed=SEED + 20, cache_salt="tenant-a")
    others = [Engine(daemon.socket_path, "layer", seed=SEED + 21, cache_salt="tenant-b"),
              Engine(daemon.socket_path, "layer", seed=SEED + 22, cache_salt="tenant-a", model_revision="r2"),
              Engine(daemon.socket_path, "blocks", seed=SEED + 23, cache_salt="tenant-a")]
    try:
        saver.connector.save("r", tokens, [0, 1, 2, 3])
        saver.connector.request_finished("r")
        saver.settle()
        assert [engine.connector.lookup(tokens) for engine in others] == [0, 0, 0]
        same = Engine(daemon.socket_path, "pool", seed=SEED + 24, cache_salt="tenant-a")
        try:
            assert same.connector.lookup(tokens) == 4 * P
        finally:
            same.close()
        with connect(daemon.socket_path) as client:
            assert len(client.status()["namespaces"]) == 4
    finally:
        for engine in [saver, *others]:
            engine.close()


def test_saves_into_pages_no_longer_reserved_for_them_are_skipped_counted_and_reported(daemon):
    """A save whose reserved pages no longer carry its lease's generation (the daemon revoked them
    or gave them to another writer) copies nothing into them: every page is skipped, counted as
    stale_generation, shown in the daemon's status (JSON and the table), and nothing is published."""
    rng = np.random.default_rng(SEED + 7)
    engine = Engine(daemon.socket_path, "layer", seed=SEED + 7,
                    config=ConnectorConfig(report_interval_s=0, policy="always"))
    try:
        tokens = random_tokens(rng, 5 * P)
        engine.connector.load("r", tokens, [], 0)                 # the request's match, nothing to load
        reserved = engine.connector.wait_for_match("r").reserved_page_ids
        assert len(reserved) == 5
        engine.connector.host_pool.generations.words[reserved] = 0     # revoked, as the daemon does
        engine.connector.save("r", tokens, [0, 1, 2, 3, 4])
        engine.connector.request_finished("r")
        engine.settle()
        stats = engine.connector.stats()
        assert stats["save_skipped_pages_stale_generation"] == 5 and stats.get("committed_pages", 0) == 0
        assert engine.connector.lookup(tokens) == 0
        engine.connector.flush_report()
        assert session_counters(daemon, f"layer-{SEED + 7}")["save_skipped_pages_stale_generation"] == 5
        with connect(daemon.socket_path) as client:
            table = render_table(client.status())
        assert "save_skipped_pages_stale_generation=5" in table and "load_failed_pages" not in table, table
    finally:
        engine.close()


def test_pages_the_daemon_cannot_reserve_are_counted_as_skipped():
    """A prefix longer than the L2 pool: the pages the daemon could not reserve are skipped (cause
    no_space), the rest committed; pages beyond the tokens the request's lease was taken for are
    skipped as beyond_lease. Every lacking page is accounted for."""
    daemon = DaemonProcess(l2_size="2MiB").start()        # 32 pages of 64 KiB
    engine = None
    try:
        engine = Engine(daemon.socket_path, "layer", seed=SEED + 8, num_blocks=48, layers=4, heads=4, head_dim=64)
        rng = np.random.default_rng(SEED + 8)
        tokens = random_tokens(rng, 40 * P)
        engine.connector.save("long", tokens, np.arange(40))
        engine.connector.request_finished("long")
        short = random_tokens(rng, 2 * P)
        engine.connector.load("short", short[:P], [], 0)                 # lease for one page only
        engine.connector.save("short", short, [40, 41])
        engine.connector.request_finished("short")
        engine.settle()
        stats = engine.connector.stats()
        assert stats["save_skipped_pages_no_space"] + stats["committed_pages"] == 40 + 1
        assert stats["save_skipped_pages_no_space"] >= 8
        assert stats["save_skipped_pages_beyond_lease"] == 1
        assert stats["save_skipped_pages"] == stats["save_skipped_pages_no_space"] + 1
    finally:
        if engine is not None:
            engine.close()
        daemon.cleanup()


def test_a_load_whose_pages_change_generation_before_it_is_seen_done_keeps_only_what_precedes(daemon):
    """A load is queued; before it is seen done, the second of its three L2 pages changes its
    write generation (the daemon handed it to a writer: its bytes may be another's by now). The
    completed load keeps only the first page: the other blocks are reported failed, to be
    recomputed, and counted (stale_generation). Its queued report (what a layer-by-layer prefill
    may have read already) came first and is corrected by that result."""
    rng = np.random.default_rng(SEED + 9)
    engine = Engine(daemon.socket_path, "layer", seed=SEED + 9)
    try:
        tokens = random_tokens(rng, 3 * P)
        engine.connector.save("w", tokens, [0, 1, 2])
        engine.connector.request_finished("w")
        engine.settle()
        engine.connector.load("r", tokens, [5, 6, 7], 3 * P)
        deadline = time.monotonic() + 5.0
        while engine.connector.stats().get("load_pages_queued", 0) < 3:
            engine.connector.poll()      # the poll that queues the load sees it done only on a later one
            assert time.monotonic() < deadline, "the load was never queued"
            time.sleep(0.001)
        pages = engine.connector.leased_pages("r")
        engine.connector.host_pool.generations.words[pages[1]] = 0
        engine.connector.poll()
        finished = engine.connector.finished()
        assert finished.queued == [LoadResult("r", 3 * P, [], None)]       # provisional, then corrected
        assert untimed(finished.loads) == [LoadResult("r", P, [6, 7], "stale_generation")]
        assert engine.connector.stats()["load_failed_pages_stale_generation"] == 2
    finally:
        engine.close()


def test_a_load_is_reported_queued_with_what_it_fills_then_confirmed(daemon):
    """A load asked for 5 pages of which L2 holds 3 is reported once in finished().queued, with the
    3 pages' tokens and the 2 other blocks failed (not cached), no later than its result; the result
    says the same. A request with no load is never reported queued."""
    rng = np.random.default_rng(SEED + 11)
    engine = Engine(daemon.socket_path, "layer", seed=SEED + 11)
    try:
        tokens = random_tokens(rng, 5 * P)
        engine.connector.save("w", tokens[: 3 * P], [0, 1, 2])
        engine.connector.request_finished("w")
        engine.settle()
        engine.connector.load("r", tokens, [10, 11, 12, 13, 14], 5 * P)
        engine.connector.load("lease-only", random_tokens(rng, 2 * P), [], 0)
        queued, loads = [], []
        deadline = time.monotonic() + 10.0
        while not loads:
            finished = engine.connector.finished()
            queued += finished.queued
            assert loads or not finished.loads or queued, "the result came before the queued report"
            loads += finished.loads
            assert time.monotonic() < deadline, engine.connector.stats()
        expected = LoadResult("r", 3 * P, [13, 14], "not_cached")
        assert queued == [expected] and untimed(loads) == [expected]
        for src, dst in zip([0, 1, 2], [10, 11, 12]):
            assert torch.equal(engine.block(dst), engine.block(src)), (SEED, src, dst)
        for request_id in ("r", "lease-only"):
            engine.connector.request_finished(request_id)
        engine.settle()
        assert engine.connector.finished().queued == []
    finally:
        engine.close()


def test_a_wait_for_the_layer_of_a_request_takes_its_reply_and_queues_only_its_load():
    """wait_for_layer_load(layer, request_ids=[a]) with a's match unanswered (sent while the daemon
    was stopped) takes a's reply (a bounded host wait) and queues a's copies, so they are done when
    it returns on CPU; b's load, named by no one, is not queued by it; an id with no open request is
    ignored. (A patient daemon: its sessions outlive the stop by far, see the test above.)"""
    daemon = DaemonProcess(extra_args=PATIENT_DAEMON).start()
    rng = np.random.default_rng(SEED + 12)
    engine = None
    try:
        engine = Engine(daemon.socket_path, "layer", seed=SEED + 12)
        tokens = random_tokens(rng, 2 * P)
        engine.connector.save("w", tokens, [0, 1])
        engine.connector.request_finished("w")
        engine.settle()
        stop_process(daemon.proc.pid)
        try:
            engine.connector.load("a", tokens, [10, 11], 2 * P)
            engine.connector.load("b", tokens, [12, 13], 2 * P)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert engine.connector.stats().get("load_pages_queued", 0) == 0
        engine.connector.wait_for_layer_load(L - 1, request_ids=["a", "unknown"])
        assert engine.connector.stats()["load_pages_queued"] == 2
        for src, dst in zip([0, 1], [10, 11]):
            assert torch.equal(engine.block(dst), engine.block(src)), (SEED, src, dst)
        with pytest.raises(ValueError):
            engine.connector.wait_for_layer_load(L, request_ids=["a"])
        engine.poll_until(lambda: len(engine.loads) == 2, "both loads")
        assert all(result.ok for result in engine.loads), engine.loads
        for request_id in ("a", "b"):
            engine.connector.request_finished(request_id)
        engine.settle()
    finally:
        if engine is not None:
            engine.close()
        daemon.cleanup()


def leases_of(daemon, name: str) -> int:
    with connect(daemon.socket_path) as client:
        return next(s["leases"] for s in client.status()["sessions"] if s["client_name"] == name)


def test_begin_is_the_requests_match_so_its_load_and_save_send_none(daemon):
    """``begin`` answers like a lookup (the decision: the L2 hit) and is the request's one match:
    the load that follows queues its copies at the call (no reply to wait for), the save writes
    the reserved pages, and the daemon saw one match. The loaded blocks hold A's bytes bit for bit;
    the saved pages are found by A, and hold B's bytes."""
    rng = np.random.default_rng(SEED + 40)
    a, b = Engine(daemon.socket_path, "layer", seed=SEED + 40), Engine(daemon.socket_path, "layer", seed=SEED + 41)
    try:
        prefix = random_tokens(rng, 5 * P)
        prompt = np.concatenate([prefix, random_tokens(rng, 3 * P + 4)])
        source = rng.permutation(N)[:5]
        a.connector.save("a", prefix, source)
        a.connector.request_finished("a")
        a.settle()

        assert b.connector.can_begin
        begun = b.connector.begin("r", prompt, 0)
        assert begun.wait(5.0)
        decision = begun.decision()
        assert (decision.choice, decision.restore_tokens) == ("l2", 5 * P), decision
        assert begun.result() == 5 * P
        blocks = rng.permutation(N)[:8]
        b.connector.load("r", prompt, blocks[:5], 5 * P)
        assert b.connector.stats()["load_pages_queued"] == 5, b.connector.stats()    # at the call
        b.poll_until(lambda: b.loads, "the load")
        assert untimed(b.loads) == [LoadResult("r", 5 * P, [], None)], b.loads
        for src, dst in zip(source, blocks[:5]):
            assert torch.equal(b.block(dst), a.block(src)), (SEED + 40, src, dst)
        b.connector.save("r", prompt, blocks[5:], start_token=5 * P)
        b.connector.request_finished("r")
        b.settle()
        stats = b.connector.stats()
        assert (stats["matches"], stats["committed_pages"], stats["lookup_choice_l2"]) == (1, 3, 1), stats

        assert a.connector.lookup(prompt) == 8 * P
        a_blocks = np.setdiff1d(np.arange(N), source)[:8]
        a.connector.load("b", prompt, a_blocks, 8 * P)
        a.poll_until(lambda: a.loads, "A's load")
        for src, dst in zip(blocks, a_blocks):
            assert torch.equal(a.block(dst), b.block(src)), (SEED + 40, src, dst)
    finally:
        a.close()
        b.close()


def test_a_begun_request_given_up_ends_and_its_lease_goes(daemon):
    """A begun request cancelled before its reply came, and one whose decision was taken but that
    the engine then gave up, both end: no request stays open, the daemon holds no lease of the
    session, and their decisions read as recompute (0 tokens)."""
    rng = np.random.default_rng(SEED + 42)
    a, b = Engine(daemon.socket_path, "layer", seed=SEED + 42), Engine(daemon.socket_path, "layer", seed=SEED + 43)
    try:
        prefix = random_tokens(rng, 4 * P)
        a.connector.save("a", prefix, rng.permutation(N)[:4])
        a.connector.request_finished("a")
        a.settle()

        early = b.connector.begin("early", prefix, 0)
        early.cancel()                               # its reply not taken yet
        late = b.connector.begin("late", np.concatenate([prefix, random_tokens(rng, P)]), 0)
        assert late.wait(5.0) and late.result() == 4 * P
        late.cancel()
        assert (early.result(), late.result()) == (0, 0)
        b.poll_until(lambda: b.connector.num_open_requests == 0, "the begun requests to end")
        # The early one's reply is released by the client once it comes in (a later poll).
        b.poll_until(lambda: b.connector.flush() or leases_of(daemon, "layer-%d" % (SEED + 43)) == 0,
                     "the daemon to hold no lease of the session")
    finally:
        a.close()
        b.close()
