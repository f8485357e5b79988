"""The cost model over the wire: a real daemon process, real connectors (CPU tensors) over ipc://.
Lookups answer the daemon's decision; the timings engines report and the daemon's own L3 reads
move it; a slow L3 is declined while L2 is taken."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import textwrap
import time

import pytest
import torch

from kvcached.testing.tiers import TierControl
from engine_client.client import connect
from kvcached.server.status import render_table
from kvcached.testing.daemon_proc import DaemonProcess, child_env, stop_process
from kvcached.testing.connector_engine import P, random_tokens
from kvcached.testing.connector_engine import engine_of, save

L3_READ_DELAY_S = 0.5


def cost_model(daemon) -> dict:
    with connect(daemon.socket_path) as client:
        return client.status(check_integrity=True)["cost_model"]


def test_lookups_answer_the_decision_and_reported_prefill_times_move_it(rng):
    """A saved 8-page prefix: under cost (priors: a prefill of 50 us per token) the lookup answers
    l2 with the tokens to hold and a prediction per candidate; an engine holding it already gets
    "engine"; never answers recompute. Once the engine reports prefills that cost next to nothing
    (report_prefill, sent with its report), the same lookup answers recompute, while always still
    restores it; the transfers' timings reached the model too, and status counts the decisions
    (and `kvcached status` shows them)."""
    daemon = DaemonProcess(l2_size="8MiB").start()
    engines = []
    try:
        cost, always, never = (engine_of(daemon, seed, policy)
                               for seed, policy in ((11, "cost"), (12, "always"), (13, "never")))
        engines += [cost, always, never]
        prefix = random_tokens(rng, 8 * P)
        save(cost, prefix, list(range(8)))
        decision = cost.connector.lookup_async(prefix).decision()
        assert (decision.choice, decision.restore_tokens) == ("l2", 8 * P), decision
        assert decision.predicted_s["l2"] < decision.predicted_s["recompute"], decision
        assert cost.connector.lookup(prefix, local_hit_tokens=8 * P) == 8 * P
        assert cost.connector.lookup_async(prefix, 8 * P).decision().choice == "engine"
        assert never.connector.lookup_async(prefix, 2 * P).decision()[:2] == ("recompute", 2 * P)

        always.connector.load("load", prefix, list(range(10, 18)), 8 * P)
        always.poll_until(lambda: always.loads, "the load")
        assert always.loads[0].ok, always.loads
        for num_tokens in rng.integers(16, 4096, size=12).tolist():
            cost.connector.report_prefill(num_tokens, num_tokens * 1e-9)
        for engine in engines:
            engine.connector.flush_report()
            engine.connector.flush()                # handled before the lookups below
        assert cost.connector.lookup_async(prefix).decision()[:2] == ("recompute", 0)
        assert always.connector.lookup_async(prefix).decision()[:2] == ("l2", 8 * P)

        model = cost_model(daemon)
        (engine,) = model["engines"]
        directions = engine["directions"]
        assert directions["prefill"]["mode"] == "fit" and directions["prefill"]["slope_s_per_token"] < 2e-9, directions
        assert directions["h2d"]["samples_total"] >= 1 and directions["d2h"]["samples_total"] >= 1, directions
        lookups = engine["decisions_total"]["lookup"]
        assert lookups["l2"] >= 2 and lookups["recompute"] >= 2 and lookups["engine"] >= 1, lookups
        with connect(daemon.socket_path) as client:
            table = render_table(client.status())
        assert "cost model: policy cost, margin 1.1" in table and " prefill " in table and "(L3 file)" in table, table
    finally:
        for engine in engines:
            engine.close()
        daemon.stop()
        daemon.cleanup()


def throttled_daemon() -> tuple[DaemonProcess, str]:
    """A daemon whose every L3 read takes L3_READ_DELAY_S longer (a slow disk): a sitecustomize on
    its PYTHONPATH slows the one function its reads go through. Its cost model starts from the
    default priors, which take such a disk for a fast one."""
    site_dir = tempfile.mkdtemp(prefix="kvt-site-", dir="/tmp")
    with open(os.path.join(site_dir, "sitecustomize.py"), "w") as f:
        f.write(textwrap.dedent(f"""\
            import time
            from kvcached.server import io_workers

            _preadv = io_workers._preadv

            def _slow_preadv(fd, buffers, offset):
                time.sleep({L3_READ_DELAY_S})
                return _preadv(fd, buffers, offset)

            io_workers._preadv = _slow_preadv
            """))
    env = {"PYTHONPATH": site_dir + os.pathsep + child_env()["PYTHONPATH"]}
    return DaemonProcess(l2_size="8MiB", extra_args=("--max-namespaces", "1"), env=env).start(), site_dir


def test_a_slow_l3_is_declined_while_l2_is_taken(rng):
    """An engine whose prefill costs 2 ms per token (it reports so); prefix A only in L3, of a disk
    slower than the prior says: the first lookup takes A from L3 and its load promotes it (one slow
    read, measured by the daemon). Then, A again in L3 alone and B in L2: a lookup of A answers
    recompute (0.5 s of read against 0.19 s of prefill), one of B answers l2 and B's load restores
    it; A, whose L2 copy would win for a later request, is promoted in the background. The model's
    storage read line shows the slow read; its write line, apart, does not."""
    daemon, site_dir = throttled_daemon()
    engine = None
    control = None
    try:
        engine = engine_of(daemon, 21, "cost")
        for num_tokens in rng.integers(16, 2048, size=8).tolist():
            engine.connector.report_prefill(num_tokens, num_tokens * 2e-3)
        control = TierControl(daemon, engine.connector.geometry)
        a, b = random_tokens(rng, 6 * P), random_tokens(rng, 6 * P)
        save(engine, a, list(range(6)))
        control.wait_idle()                             # A written through to L3
        control.evict_l2()
        assert control.hits(a) == {"l2": 0, "l3": 6 * P, "remote": 0}
        assert engine.connector.lookup_async(a).decision()[:2] == ("l3", 6 * P)   # by the prior
        started = time.monotonic()
        engine.connector.load("a", a, list(range(6, 12)), 6 * P)
        engine.poll_until(lambda: engine.loads, "A's load (through the slow read)")
        assert engine.loads[0].ok and time.monotonic() - started >= L3_READ_DELAY_S, engine.loads
        engine.connector.request_finished("a")
        engine.settle()
        control.wait_idle()

        control.evict_l2()
        save(engine, b, list(range(12, 18)))
        control.wait_idle()
        assert control.hits(a) == {"l2": 0, "l3": 6 * P, "remote": 0} and control.hits(b)["l2"] == 6 * P
        assert engine.connector.lookup_async(a).decision()[:2] == ("recompute", 0), json.dumps(cost_model(daemon))
        assert engine.connector.lookup_async(b).decision()[:2] == ("l2", 6 * P), json.dumps(cost_model(daemon))
        engine.connector.load("b", b, list(range(18, 24)), 6 * P)
        engine.poll_until(lambda: len(engine.loads) == 2, "B's load")
        assert engine.loads[1].ok and engine.loads[1].num_tokens == 6 * P, engine.loads
        control.wait_idle()                             # A's background promotion
        assert control.hits(a)["l2"] == 6 * P

        model = cost_model(daemon)
        storage = model["storage"]
        assert storage["s2h"]["samples_total"] >= 2 and storage["s2h"]["fixed_s"] >= 0.8 * L3_READ_DELAY_S, storage
        assert storage["h2s"]["samples_total"] >= 2 and storage["h2s"]["fixed_s"] < 0.5 * L3_READ_DELAY_S, storage
        assert model["background_promotions_total"] == 1 and model["background_promoted_pages_total"] == 6, model
    finally:
        if control is not None:
            control.close()
        if engine is not None:
            engine.close()
        daemon.stop()
        daemon.cleanup()
        os.remove(os.path.join(site_dir, "sitecustomize.py"))
        os.rmdir(site_dir)


def test_a_predicted_decline_admits_without_a_round_trip_and_its_match_still_reserves(rng):
    """Under the priors an L3 restore of a few pages can win, so a begun lookup of a prefix L2 lacks
    waits for its reply. An engine whose prefills cost next to nothing (it reports so): no L3
    restore can win, so for a prefix L2 lacks, its begun lookup answers recompute at once, with the daemon stopped
    (SIGSTOP: no reply could have come); under always one waits. The predicted match is not sent
    until the request's save (the daemon has handled every other match by then, not that one).
    Once sent, its reply brings the reservation: the saved prefix is in L2, and another engine
    loads it bit for bit. The same prefix, in L2 now, is not predicted (its lookup waits for the
    reply). Status counts the prediction under "predicted", and the integrity check (the published
    first pages against the tree) holds."""
    daemon = DaemonProcess(l2_size="8MiB").start()
    engines, control = [], None
    try:
        cost, always = engine_of(daemon, 31, "cost"), engine_of(daemon, 32, "always")
        engines += [cost, always]
        before = cost.connector.begin("before", random_tokens(rng, 6 * P))
        assert cost.connector.stats().get("lookups_predicted_recompute", 0) == 0
        before.decision()
        before.cancel()
        cost.settle()
        for num_tokens in rng.integers(16, 4096, size=8).tolist():
            cost.connector.report_prefill(num_tokens, num_tokens * 1e-9)
        cost.connector.flush_report()
        cost.connector.flush()                  # the model, and what it publishes, moved
        control = TierControl(daemon, cost.connector.geometry)
        prefix = random_tokens(rng, 6 * P)
        matches_before = control.counts()["acquire_count"]
        stop_process(daemon.proc.pid)
        try:
            predicted = cost.connector.begin("a", prefix)
            assert predicted.ready() and predicted.decision()[:2] == ("recompute", 0)
            waiting = always.connector.begin("w", prefix)
            assert not waiting.ready()
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert cost.connector.stats()["lookups_predicted_recompute"] == 1
        always.connector.poll()
        cost.connector.flush()
        always.connector.flush()                # both sockets' requests so far handled
        assert control.counts()["acquire_count"] == matches_before + 1        # always's alone
        cost.connector.save("a", prefix, list(range(6)))
        cost.connector.request_finished("a")
        cost.settle()
        assert cost.connector.stats().get("prediction_misses", 0) == 0
        waiting.decision()
        waiting.cancel()
        always.settle()
        assert control.hits(prefix)["l2"] == 6 * P

        always.connector.load("c", prefix, list(range(10, 16)), 6 * P)
        always.poll_until(lambda: always.loads, "the load")
        assert always.loads[0].ok and always.loads[0].num_tokens == 6 * P, always.loads
        for page in range(6):
            assert torch.equal(always.block(10 + page), cost.block(page)), f"page {page}"
        always.connector.request_finished("c")
        always.settle()

        stop_process(daemon.proc.pid)
        try:
            again = cost.connector.begin("d", prefix)
            assert not again.ready()            # L2 holds its first page: the reply decides
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert again.decision().choice == "recompute"       # the model declines L2 too, at that prefill cost
        again.cancel()
        cost.settle()
        (engine,) = cost_model(daemon)["engines"]            # check_integrity=True
        # nothing held the prefix when the predicted match was handled: the model had no candidate
        assert engine["decisions_total"]["predicted"] == {"engine": 1}, engine["decisions_total"]
        assert engine["decisions_total"]["match"]["recompute"] >= 1, engine["decisions_total"]
    finally:
        if control is not None:
            control.close()
        for engine in engines:
            engine.close()
        daemon.stop()
        daemon.cleanup()


def test_a_predicted_request_ends_cleanly_whatever_becomes_of_its_unsent_match(rng):
    """A request admitted on a predicted decline sends its match only at its next connector call.
    Given up before any (cancel), it sends nothing and leaves nothing open; one whose send then
    fails with an error of the client's (injected once) raises it to the engine, and the connector
    goes on: its polls work, the request ends with its save skipped and counted, and the next
    predicted request saves into L2 as usual; one whose daemon is gone by then (SIGKILL) skips its
    save as daemon_down, and ends."""
    daemon = DaemonProcess(l2_size="8MiB").start()
    engine, control = None, None
    try:
        engine = engine_of(daemon, 41, "never")      # never: every begin is a predicted decline
        connector = engine.connector
        control = TierControl(daemon, connector.geometry)
        matches_before = control.counts()["acquire_count"]
        given_up = connector.begin("given-up", random_tokens(rng, 4 * P))
        assert given_up.ready() and given_up.decision().choice == "recompute"
        given_up.cancel()
        assert given_up.result() == 0
        connector.poll()
        connector.flush()
        assert connector.num_open_requests == 0
        assert control.counts()["acquire_count"] == matches_before      # nothing was sent

        failing = random_tokens(rng, 4 * P)
        connector.begin("failing", failing)
        send = connector.client.acquire_async

        def refuse(*args, **kwargs):
            connector.client.acquire_async = send
            raise RuntimeError("injected: the client refused the send")

        connector.client.acquire_async = refuse
        with pytest.raises(RuntimeError, match="injected"):
            connector.save("failing", failing, list(range(4)))
        connector.poll()
        assert connector.request_finished("failing") is False
        assert connector.num_open_requests == 0
        assert connector.stats()["match_failures_send_failed"] == 1
        saved = random_tokens(rng, 4 * P)
        connector.begin("saved", saved)
        connector.save("saved", saved, list(range(4, 8)))
        connector.request_finished("saved")
        engine.settle()
        assert control.hits(saved)["l2"] == 4 * P and control.hits(failing)["l2"] == 0

        orphan = random_tokens(rng, 4 * P)
        connector.begin("orphan", orphan)
        control.close()
        control = None
        daemon.stop(signal.SIGKILL)
        deadline = time.monotonic() + 10.0          # no connector call meanwhile: it would send the match
        while connector.client.is_attached():       # the heartbeats see the daemon gone
            assert time.monotonic() < deadline, "the client did not see the daemon gone"
            time.sleep(0.01)
        connector.save("orphan", orphan, list(range(8, 12)))
        connector.request_finished("orphan")
        engine.poll_until(lambda: connector.num_open_requests == 0, "the orphan to end")
        assert connector.stats()["match_failures_daemon_down"] == 1
        assert connector.stats().get("match_failures_no_reply", 0) == 0
    finally:
        if control is not None:
            control.close()
        if engine is not None:
            engine.close()
        daemon.cleanup()


def test_after_one_slow_h2d_sample_restores_resume_within_200_requests(rng):
    """An engine (policy cost) reports one 1-s DMA: lookups of its saved 8-page prefix then answer
    recompute, but within 200 of them (30 s at most) one answers l2 again, and its load restores
    the prefix bit for bit into other blocks; status counts the line dropped."""
    daemon = DaemonProcess(l2_size="8MiB").start()
    engine = None
    try:
        engine = engine_of(daemon, 31, "cost")
        prefix = random_tokens(rng, 8 * P)
        save(engine, prefix, list(range(8)))
        assert engine.connector.lookup_async(prefix).decision().choice == "l2"
        engine.connector.client.report({}, [("h2d", 8 * engine.connector.geometry.bytes_per_page, 1.0)])
        engine.connector.client.flush()
        started = time.monotonic()
        choices = []
        while "l2" not in choices:
            assert len(choices) < 200 and time.monotonic() - started < 30, choices
            choices.append(engine.connector.lookup_async(prefix).decision().choice)
        assert choices[0] == "recompute", choices          # the slow sample did decline it
        engine.connector.load("again", prefix, list(range(8, 16)), 8 * P)
        engine.poll_until(lambda: engine.loads, "the load")
        assert engine.loads[0].ok and engine.loads[0].num_tokens == 8 * P, engine.loads
        for block_id in range(8):
            assert torch.equal(engine.block(block_id + 8), engine.block(block_id)), block_id
        model = cost_model(daemon)
        assert model["stale_line_resets_total"] == 1, model
        assert model["engines"][0]["directions"]["h2d"]["stale_resets_total"] == 1, model
    finally:
        if engine is not None:
            engine.close()
        daemon.stop()
        daemon.cleanup()
