"""Restores hidden under other requests' decode and under the request's own prefill: the reference
engine on the real KVConnector and a real daemon process over ipc:// (fp32 on CPU). In each load
mode a prefix restored from L2 while another request decodes gives a recompute's tokens; a load
pending when its request is aborted, when the engine is closed, or when the daemon dies leaves no
lease, block, private L2 page or connector request behind."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
import torch

from bench.engine import Engine, EngineConfig, RequestState, load_model
from bench.engine.load import LoadState
from engine_client.connector import BegunLookup, PendingLookup
from bench.tiers import attach_kvcached, detach_kvcached, run_to_idle, settle
from kvcached.testing.tiers import TierControl
from bench.tests.engine.reference import hf_model, random_prompt
from kvcached.testing.daemon_proc import PATIENT_DAEMON, DaemonProcess, stop_process

MODEL_ID = "engine-overlap-test"
LOGITS_ATOL = 1e-4


@pytest.fixture
def daemon():
    process = DaemonProcess(l2_size="64MiB", extra_args=PATIENT_DAEMON).start()
    yield process
    process.cleanup()


class Setup:
    """An engine on a tiny Qwen3's weights with its connector, a prefix it prefilled and saved to
    L2 (then dropped from its own cache), and the recompute of a prompt with that prefix."""

    def __init__(self, daemon: DaemonProcess, tmp_path, seed: int, load_mode: str, **config):
        """config: more of the engine's EngineConfig."""
        hf_model(seed).save_pretrained(tmp_path)
        self.engine = Engine(load_model(str(tmp_path), dtype=torch.float32, device="cpu"),
                             EngineConfig(num_blocks=64, keep_logits=True, load_mode=load_mode, **config))
        generator = torch.Generator().manual_seed(seed)
        self.prefix = random_prompt(generator, 100)
        self.prompt = self.prefix + random_prompt(generator, 7)
        self.decoding_prompt = random_prompt(generator, 20)
        self.recompute = run_request_alone(self.engine, self.prompt, 6)
        self.decoding_recompute = run_request_alone(self.engine, self.decoding_prompt, 12)
        self.connector = attach_kvcached(self.engine, daemon.socket_path, model_id=MODEL_ID)
        self.control = TierControl(daemon, self.connector.geometry)
        self.engine.generate([self.prefix + random_prompt(generator, 3)], 1)
        settle(self.engine, self.control)
        self.engine.reset_prefix_cache()
        assert self.control.hits(self.prefix)["l2"] == 96
        self.start_counts = self.counts()

    def counts(self) -> dict:
        """What must come back: the engine's allocatable blocks and held blocks, the connector's open
        requests, the daemon's leases and private L2 pages."""
        status = self.control.client.status(check_integrity=True)
        (namespace,) = status["namespaces"]
        return {"allocatable_blocks": self.engine.scheduler.blocks.num_allocatable_blocks,
                "held_blocks": len(self.engine.scheduler.held_block_ids),
                "connector_requests": self.connector.num_open_requests if self.engine.connector else 0,
                "leases": status["leases"], "l2_private_pages": namespace["tiers"]["l2"]["private_pages"],
                "integrity": status["integrity"]}

    def start_decoding(self):
        request = self.engine.add_request(self.decoding_prompt, 12)
        deadline = time.monotonic() + 30
        while request.state is not RequestState.DECODE:
            self.engine.step()
            assert time.monotonic() < deadline
        return request

    def close(self) -> None:
        self.control.close()
        if self.engine.connector is not None:
            detach_kvcached(self.engine)


def step_until_admitted(setup: Setup, request, decoding) -> None:
    """Step until the request is admitted: its lookup went out on arrival (a step with a decode
    batch to run does not wait for it); the step that finds the reply in admits it while its batch
    runs (a load is not admitted at a step's start while a decode batch is to run; another request
    is). The decoding request gets a token in every step meanwhile. Between steps the test waits
    for the lookup's reply, so that admission takes the same number of steps however slowly the
    daemon answers (the decoding request must not run out of tokens before the steps that
    follow)."""
    deadline = time.monotonic() + 10
    while request.state is RequestState.WAITING:
        tokens_before = len(decoding.output_token_ids)
        setup.engine.step()
        assert len(decoding.output_token_ids) == tokens_before + 1, "a step without a decode token"
        while request.lookup is not None and not request.lookup.ready():
            assert time.monotonic() < deadline, "the lookup's reply never came"
            time.sleep(0.001)
        assert time.monotonic() < deadline, "the request was never admitted"


def wait_until_ready(pending, message: str) -> None:
    """Until a reply (a lookup's, an acquire's) is in the client's hands, at most 10 s."""
    deadline = time.monotonic() + 10
    while not pending.ready():
        assert time.monotonic() < deadline, message
        time.sleep(0.001)


def run_request_alone(engine: Engine, prompt, max_new_tokens: int):
    engine.reset_prefix_cache()
    (request,) = engine.generate([prompt], max_new_tokens)
    engine.reset_prefix_cache()
    return request


def recompute_without_the_connector(setup: Setup, prompts, max_new_tokens: int) -> list:
    """Each prompt alone with the connector taken out, so that nothing of it is saved to L2."""
    connector = setup.engine.scheduler.connector
    setup.engine.attach_connector(None)
    try:
        return [run_request_alone(setup.engine, p, max_new_tokens) for p in prompts]
    finally:
        setup.engine.attach_connector(connector)


def assert_same_output(request, reference, seed):
    assert request.output_token_ids == reference.output_token_ids, f"seed {seed}"
    difference = (torch.stack(request.logits) - torch.stack(reference.logits)).abs().max().item()
    assert difference < LOGITS_ATOL, f"seed {seed}: logits differ by {difference}"


def settled_counts(setup: Setup, timeout_s: float = 20.0) -> dict:
    """The counts once the engine is idle and the connector's leases ended (the daemon handled them)."""
    run_to_idle(setup.engine, timeout_s)
    deadline = time.monotonic() + timeout_s
    while setup.connector.num_open_requests:
        setup.connector.poll()
        assert time.monotonic() < deadline, setup.connector.stats()
        time.sleep(0.001)
    setup.connector.flush()
    return setup.counts()


def stop_before_the_match(setup: Setup, daemon: DaemonProcess, resume_after_s: float | None = None) -> None:
    """SIGSTOP the daemon just before each load's match goes out: the load stays MATCHING until
    the daemon is resumed (``resume_after_s``: by a timer started once the daemon is stopped).
    The engine's lookups are lookups here (``begin_lookups=False``): a begun lookup would have
    sent the match already."""
    real_load = setup.connector.load

    def load_with_the_daemon_stopped(*args, **kwargs):
        stop_process(daemon.proc.pid)
        if resume_after_s is not None:
            threading.Timer(resume_after_s, os.kill, (daemon.proc.pid, signal.SIGCONT)).start()
        return real_load(*args, **kwargs)

    setup.connector.load = load_with_the_daemon_stopped


@pytest.mark.parametrize("load_mode", ["layerwise", "async", "blocking"])
def test_a_prefix_restored_while_another_request_decodes_gives_the_recompute_tokens(daemon, tmp_path, load_mode):
    """While a request decodes, another with a 96-token prefix in L2 is admitted, the daemon stopped
    (SIGSTOP) just before its match goes out. "layerwise", "async": the steps until it is admitted
    (its lookup's reply taken in) and four more run decode batches, the last four with its load
    MATCHING; then the daemon is resumed. "blocking":
    that step waits for the load on the host (the daemon resumed 0.3 s later) and prefills the
    request, with no decode token. "layerwise":
    the step that takes in the reply prefills it with the load IN_FLIGHT, its attention of each
    layer waiting for that layer of the load, in order. It loads all 96 tokens; both requests get
    their recompute's tokens; every count (engine blocks, held blocks, connector requests, leases,
    private L2 pages) returns to its value before, and the daemon's integrity holds."""
    seed = 6100
    setup = Setup(daemon, tmp_path, seed, load_mode, begin_lookups=False)
    waits = []
    real_wait = setup.connector.wait_for_layer_load
    setup.connector.wait_for_layer_load = lambda layer, stream=None, request_ids=None: (
        waits.append((layer, tuple(request_ids or ()), restored.load.state)), real_wait(layer, stream, request_ids))[1]
    # "blocking": the daemon resumed 0.3 s after it is stopped, while the step waits on the host
    stop_before_the_match(setup, daemon, 0.3 if load_mode == "blocking" else None)
    try:
        decoding = setup.start_decoding()
        restored = setup.engine.add_request(setup.prompt, 6)
        if load_mode != "blocking":
            step_until_admitted(setup, restored, decoding)
        tokens_before = len(decoding.output_token_ids)
        if load_mode == "blocking":
            setup.engine.step()             # waits on the host until the load is done
            assert len(decoding.output_token_ids) == tokens_before, f"seed {seed}: a decode step ran"
            assert restored.load.state is LoadState.DONE and len(restored.output_token_ids) == 1
        else:
            for _ in range(4):
                setup.engine.step()
            assert len(decoding.output_token_ids) == tokens_before + 4, f"seed {seed}: decode held up"
            assert restored.state is RequestState.LOADING and restored.load.state is LoadState.MATCHING
            os.kill(daemon.proc.pid, signal.SIGCONT)
            # The reply in the client's socket before the next step, whose first poll takes it in:
            # "layerwise" then prefills in that step with the load still in flight.
            match = setup.connector._requests[restored.connector_id].match
            wait_until_ready(match, "no reply from the resumed daemon")
        counts = settled_counts(setup)
        assert restored.load.state is LoadState.DONE and restored.num_loaded_tokens == 96, f"seed {seed}"
        assert restored.num_prefilled_tokens == len(setup.prompt) - 96, f"seed {seed}: loaded tokens recomputed"
        cid = restored.connector_id
        expected = [(layer, (cid,), LoadState.IN_FLIGHT) for layer in range(2)] if load_mode == "layerwise" else []
        assert waits == expected, f"seed {seed}: {waits}"
        assert_same_output(restored, setup.recompute, seed)
        assert_same_output(decoding, setup.decoding_recompute, seed)
        assert counts == setup.start_counts, f"seed {seed}"
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        setup.close()


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
@pytest.mark.parametrize("how", ["abort", "close"])
def test_a_load_pending_at_abort_or_close_leaks_nothing(daemon, tmp_path, load_mode, how):
    """The daemon is stopped (SIGSTOP) just before a request's match goes out, so its load is
    pending (MATCHING) for as long as the daemon stays stopped. Aborting the request cancels the load
    (CANCELLED) at once; the decoding request keeps decoding meanwhile; once the daemon resumes and
    the reply is taken in, the lease ends. Closing the engine instead aborts it and closes the
    connector. Either way no lease, private L2 page, block or connector request is left, and the
    daemon's integrity holds."""
    seed = 6200 + (how == "close")
    setup = Setup(daemon, tmp_path, seed, load_mode, begin_lookups=False)
    stop_before_the_match(setup, daemon)
    try:
        decoding = setup.start_decoding()
        restored = setup.engine.add_request(setup.prompt, 6)
        step_until_admitted(setup, restored, decoding)
        assert restored.load.state is LoadState.MATCHING, f"seed {seed}: {restored.load}"
        if how == "abort":
            assert setup.engine.abort(restored.request_id)
            assert restored.load.state is LoadState.CANCELLED
            tokens_before = len(decoding.output_token_ids)
            for _ in range(3):
                setup.engine.step()
            assert len(decoding.output_token_ids) == tokens_before + 3, f"seed {seed}: decode held up"
            os.kill(daemon.proc.pid, signal.SIGCONT)
            counts = settled_counts(setup)
            assert counts == setup.start_counts, f"seed {seed}"
            assert_same_output(decoding, setup.decoding_recompute, seed)
        else:
            os.kill(daemon.proc.pid, signal.SIGCONT)
            setup.engine.close()
            assert restored.load.state is LoadState.CANCELLED and setup.engine.connector is None
            blocks = setup.engine.scheduler.blocks
            blocks.check_integrity()
            assert blocks.num_allocatable_blocks == setup.start_counts["allocatable_blocks"], f"seed {seed}"
            deadline = time.monotonic() + 20
            while True:            # the closed session's lease ends with its DETACH
                counts = setup.counts()
                if counts["leases"] == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            assert (counts["leases"], counts["l2_private_pages"], counts["integrity"]) == (0, 0, "ok"), counts
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)      # a no-op if it runs
        setup.close()


def test_a_load_pending_when_the_daemon_dies_is_recomputed_and_leaks_nothing(tmp_path):
    """The daemon is killed (SIGKILL) just before a request's match goes out. The other request
    keeps decoding; the load fails once the client sees the daemon gone, the request recomputes
    its prefix and gets the recompute's tokens; every engine block comes back, none is held, and
    the connector has no request open."""
    seed = 6300
    process = DaemonProcess(l2_size="64MiB").start()
    setup = None
    try:
        setup = Setup(process, tmp_path, seed, "async", begin_lookups=False)     # the match goes out at load
        real_load = setup.connector.load

        def load_with_the_daemon_killed(*args, **kwargs):
            process.proc.kill()
            process.proc.wait()
            return real_load(*args, **kwargs)

        setup.connector.load = load_with_the_daemon_killed
        decoding = setup.start_decoding()
        restored = setup.engine.add_request(setup.prompt, 6)
        run_to_idle(setup.engine, timeout_s=30)
        assert restored.load.state is LoadState.DONE and restored.num_loaded_tokens == 0, f"seed {seed}"
        assert restored.num_prefilled_tokens == len(setup.prompt), f"seed {seed}"
        assert_same_output(restored, setup.recompute, seed)
        assert_same_output(decoding, setup.decoding_recompute, seed)
        blocks = setup.engine.scheduler.blocks
        blocks.check_integrity()
        assert blocks.num_allocatable_blocks == setup.start_counts["allocatable_blocks"]
        assert not setup.engine.scheduler.held_block_ids and setup.connector.num_open_requests == 0
        setup.engine.attach_connector(None)
        setup.connector.close(timeout_s=2.0)
    finally:
        if setup is not None:
            setup.control.client.close()
        process.cleanup()


@pytest.mark.parametrize("begun", [False, True], ids=["lookup", "begun"])
def test_an_idle_engine_waits_once_briefly_for_a_lookup_and_gives_up_one_unanswered(daemon, tmp_path, monkeypatch,
                                                                                    begun):
    """With nothing else running and the daemon stopped (SIGSTOP) before a request with a 96-token
    prefix in L2 arrives, its lookup goes out and is waited for once, lookup_wait_s (0.1 s here),
    then no more: of three steps, the first waits once with that bound, the others not at all,
    and the request stays WAITING on its one lookup. Resumed, the reply is taken in and the prefix
    loaded. A second request's lookup, the daemon stopped again, gets no reply within
    lookup_timeout_s (0.5 s here): it is given up, the request is admitted and recomputes its
    prompt. Both get their recompute's tokens; every count returns to its value before. Alike
    whether the lookup is a lookup or the request's match (``begun``)."""
    seed = 6300
    # lookup_timeout_s: the first request's reply is never given up, however slow the steps are
    setup = Setup(daemon, tmp_path, seed, "async", lookup_timeout_s=60.0, lookup_wait_s=0.1, begin_lookups=begun)
    lookup_class = BegunLookup if begun else PendingLookup
    scheduler = setup.engine.scheduler
    try:
        stop_process(daemon.proc.pid)
        restored = setup.engine.add_request(setup.prompt, 6)
        waits = []                      # (step, timeout_s, the reply in) of every lookup's wait
        real_wait = lookup_class.wait
        step = 0

        def recorded_wait(lookup, timeout_s):
            in_time = real_wait(lookup, timeout_s)
            waits.append((step, timeout_s, in_time))
            return in_time

        monkeypatch.setattr(lookup_class, "wait", recorded_wait)
        first_lookup = None
        for step in range(3):
            setup.engine.step()
            first_lookup = first_lookup or restored.lookup
            assert restored.lookup is first_lookup, f"seed {seed}: the lookup was sent again"
        assert restored.state is RequestState.WAITING and first_lookup is not None, f"seed {seed}"
        assert len(waits) == 1 and waits[0][0] == 0 and 0 < waits[0][1] <= 0.1 and not waits[0][2], \
            f"seed {seed}: not one wait of at most lookup_wait_s, in the first step: {waits}"
        monkeypatch.undo()
        os.kill(daemon.proc.pid, signal.SIGCONT)
        run_to_idle(setup.engine, timeout_s=30)
        assert restored.num_loaded_tokens == 96, f"seed {seed}: {restored.num_loaded_tokens}"
        assert_same_output(restored, setup.recompute, seed)
        setup.engine.reset_prefix_cache()

        failures_before = setup.connector.stats().get("lookup_failures_no_reply", 0)
        scheduler.config = dataclasses.replace(scheduler.config, lookup_timeout_s=0.5)
        stop_process(daemon.proc.pid)
        started = time.monotonic()
        given_up = setup.engine.add_request(setup.prompt, 6)
        while given_up.state is RequestState.WAITING:
            setup.engine.step()
            assert time.monotonic() - started < 30, f"seed {seed}: the lookup was never given up"
        assert time.monotonic() - started >= 0.5, f"seed {seed}: given up before lookup_timeout_s"
        assert given_up.load is None and given_up.lookup is None
        assert setup.connector.stats()["lookup_failures_no_reply"] == failures_before + 1
        os.kill(daemon.proc.pid, signal.SIGCONT)
        counts = settled_counts(setup)
        assert given_up.num_loaded_tokens == 0 and given_up.num_prefilled_tokens == len(setup.prompt)
        assert_same_output(given_up, setup.recompute, seed)
        assert counts == setup.start_counts, f"seed {seed}"
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)      # a no-op if it runs
        setup.close()


def test_a_lookup_never_holds_up_a_decode_step_and_its_request_is_admitted_during_one(daemon, tmp_path, monkeypatch):
    """While a request decodes, another with a 96-token prefix in L2 arrives, the daemon stopped
    (SIGSTOP; lookup_wait_s 60 s here: a wait would show). The step after its lookup went out (on
    arrival) does not wait for the reply: the request is still WAITING when the step's schedule is done, its decode
    batch runs (the forward made to resume the daemon and last until the reply is in, as a GPU step
    outlasts a round trip), and the request is admitted during that step, its load sent, with no
    wait at all. It loads the prefix, both get their recompute's tokens, every count returns to its
    value before."""
    seed = 6350
    setup = Setup(daemon, tmp_path, seed, "async", lookup_wait_s=60.0, lookup_timeout_s=120.0)
    try:
        decoding = setup.start_decoding()
        waits = []
        real_wait = PendingLookup.wait
        monkeypatch.setattr(PendingLookup, "wait", lambda lookup, timeout_s: waits.append(timeout_s)
                            or real_wait(lookup, timeout_s))
        stop_process(daemon.proc.pid)
        restored = setup.engine.add_request(setup.prompt, 6)
        scheduler, engine = setup.engine.scheduler, setup.engine
        real_schedule, real_decode = scheduler.schedule, engine._run_decode
        states_after_schedule = []

        def schedule():
            plan = real_schedule()
            states_after_schedule.append(restored.state)
            return plan

        def decode_with_the_reply_coming_in(requests):
            logits = real_decode(requests)
            os.kill(daemon.proc.pid, signal.SIGCONT)
            wait_until_ready(restored.lookup, "the lookup's reply never came")
            return logits

        monkeypatch.setattr(scheduler, "schedule", schedule)
        monkeypatch.setattr(engine, "_run_decode", decode_with_the_reply_coming_in)
        tokens_before = len(decoding.output_token_ids)
        engine.step()
        assert states_after_schedule == [RequestState.WAITING], f"seed {seed}: {states_after_schedule}"
        assert len(decoding.output_token_ids) == tokens_before + 1, f"seed {seed}: decode held up"
        assert waits == [], f"seed {seed}: the host waited for the lookup: {waits}"
        assert restored.state is RequestState.LOADING and restored.load is not None, \
            f"seed {seed}: not admitted during the step of its lookup ({restored.state})"
        monkeypatch.undo()
        counts = settled_counts(setup)
        assert restored.num_loaded_tokens == 96, f"seed {seed}: {restored.num_loaded_tokens}"
        assert_same_output(restored, setup.recompute, seed)
        assert_same_output(decoding, setup.decoding_recompute, seed)
        assert counts == setup.start_counts, f"seed {seed}"
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)      # a no-op if it runs
        setup.close()


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
@pytest.mark.parametrize("begun", [False, True], ids=["lookup", "begun"])
def test_a_load_whose_reply_is_in_at_a_decode_step_start_is_queued_after_that_steps_forward(
        daemon, tmp_path, monkeypatch, load_mode, begun):
    """While a request decodes, another with a 96-token prefix in L2 arrives, and its lookup's reply
    is in before the next step starts. That step's schedule leaves it WAITING and runs the decode
    batch; the request is admitted while the batch's forward runs: its load (allocation, the
    copies' queueing) comes after the forward's launch, not ahead of it. It loads the prefix, both
    get their recompute's tokens, every count returns to its value before."""
    seed = 6360
    setup = Setup(daemon, tmp_path, seed, load_mode, begin_lookups=begun)
    try:
        decoding = setup.start_decoding()
        engine, scheduler, connector = setup.engine, setup.engine.scheduler, setup.connector
        restored = engine.add_request(setup.prompt, 6)
        assert restored.lookup is not None and isinstance(restored.lookup, BegunLookup) == begun, f"seed {seed}"
        wait_until_ready(restored.lookup, "the lookup's reply never came")
        order, states_after_schedule = [], []
        real_schedule, real_decode, real_load = scheduler.schedule, engine._run_decode, connector.load

        def schedule():
            plan = real_schedule()
            states_after_schedule.append(restored.state)
            return plan

        def decode(requests):
            order.append("decode")
            return real_decode(requests)

        def load(*args, **kwargs):
            order.append("load")
            return real_load(*args, **kwargs)

        monkeypatch.setattr(scheduler, "schedule", schedule)
        monkeypatch.setattr(engine, "_run_decode", decode)
        monkeypatch.setattr(connector, "load", load)
        tokens_before = len(decoding.output_token_ids)
        engine.step()
        assert states_after_schedule == [RequestState.WAITING], f"seed {seed}: {states_after_schedule}"
        assert len(decoding.output_token_ids) == tokens_before + 1, f"seed {seed}: decode held up"
        assert order == ["decode", "load"], f"seed {seed}: {order}"
        assert restored.state is RequestState.LOADING, f"seed {seed}: {restored.state}"
        monkeypatch.undo()
        counts = settled_counts(setup)
        assert restored.num_loaded_tokens == 96, f"seed {seed}: {restored.num_loaded_tokens}"
        assert_same_output(restored, setup.recompute, seed)
        assert_same_output(decoding, setup.decoding_recompute, seed)
        assert counts == setup.start_counts, f"seed {seed}"
    finally:
        setup.close()


def test_a_request_behind_a_load_left_for_the_batch_is_admitted_at_the_step_start(daemon, tmp_path, monkeypatch):
    """While a request decodes, one with a 96-token prefix in L2 arrives, then a fresh one (nothing
    cached), both replies in before the next step. The step's schedule leaves the first WAITING
    (its load goes out while the GPU runs the batch) and admits the fresh one behind it, whose
    prefill is that step's batch; by the step's end the first is LOADING. Each gets its
    recompute's tokens, every count returns to its value before."""
    seed = 6365
    setup = Setup(daemon, tmp_path, seed, "async")
    try:
        fresh_prompt = random_prompt(torch.Generator().manual_seed(seed + 1), 40)
        (fresh_recompute,) = recompute_without_the_connector(setup, [fresh_prompt], 3)
        decoding = setup.start_decoding()
        engine, scheduler = setup.engine, setup.engine.scheduler
        restored = engine.add_request(setup.prompt, 6)
        fresh = engine.add_request(fresh_prompt, 3)
        for request in (restored, fresh):
            wait_until_ready(request.lookup, "a lookup's reply never came")
        states_after_schedule = []
        real_schedule = scheduler.schedule

        def schedule():
            plan = real_schedule()
            states_after_schedule.append((restored.state, fresh.state))
            return plan

        monkeypatch.setattr(scheduler, "schedule", schedule)
        engine.step()
        assert states_after_schedule == [(RequestState.WAITING, RequestState.PREFILL)], \
            f"seed {seed}: {states_after_schedule}"
        assert restored.state is RequestState.LOADING, f"seed {seed}: {restored.state}"
        monkeypatch.undo()
        counts = settled_counts(setup)
        assert restored.num_loaded_tokens == 96 and fresh.num_loaded_tokens == 0, f"seed {seed}"
        assert_same_output(restored, setup.recompute, seed)
        assert_same_output(fresh, fresh_recompute, seed)
        assert_same_output(decoding, setup.decoding_recompute, seed)
        assert counts == setup.start_counts, f"seed {seed}"
    finally:
        setup.close()


def test_a_request_sharing_the_prefix_a_prefill_computes_is_admitted_after_it_with_its_blocks(
        daemon, tmp_path, monkeypatch):
    """A fresh 64-token prefix (nothing of it in L2) is prefilled by request A in chunks of 32
    tokens; after the first, request B arrives, the same prefix and another suffix, and its
    lookup's reply comes in during the step of A's second chunk (the forward made to last until
    then). B is not admitted in that step, where its own hit would be the first chunk's 2 blocks
    and miss the 2 A is computing: the next step admits it with all 4 from the prefix cache, shared
    with A, not computed again. Both get their recompute's tokens; every count returns to its value
    before."""
    seed = 6370
    setup = Setup(daemon, tmp_path, seed, "async", max_prefill_tokens=32)
    try:
        generator = torch.Generator().manual_seed(seed + 1)
        prefix = random_prompt(generator, 64)
        prompt_a, prompt_b = prefix + random_prompt(generator, 1), prefix + random_prompt(generator, 5)
        (recompute_b,) = recompute_without_the_connector(setup, [prompt_b], 3)
        engine = setup.engine
        first = engine.add_request(prompt_a, 3)
        real_prefill = engine._run_prefill
        second = None

        def prefill_with_the_reply_coming_in(chunks):
            logits = real_prefill(chunks)
            if second is not None and second.lookup is not None and any(c.request is first for c in chunks):
                wait_until_ready(second.lookup, "the lookup's reply never came")
            return logits

        monkeypatch.setattr(engine, "_run_prefill", prefill_with_the_reply_coming_in)
        while first.num_computed_tokens < 32:
            engine.step()
        assert first.state is RequestState.PREFILL and first.num_computed_tokens == 32, f"seed {seed}"
        second = engine.add_request(prompt_b, 3)
        engine.step()                     # A's second chunk; B's lookup sent, its reply in during the step
        assert first.num_computed_tokens == 64, f"seed {seed}: {first.num_computed_tokens}"
        assert second.state is RequestState.WAITING, f"seed {seed}: admitted before A's blocks were cached"
        engine.step()
        assert second.state is not RequestState.WAITING, f"seed {seed}"
        assert second.num_cached_tokens == 64 and second.block_ids[:4] == first.block_ids[:4], \
            f"seed {seed}: cached {second.num_cached_tokens}"
        monkeypatch.undo()
        counts = settled_counts(setup)
        assert second.num_prefilled_tokens == len(prompt_b) - 64, f"seed {seed}"
        assert_same_output(second, recompute_b, seed)
        assert counts == setup.start_counts, f"seed {seed}"
    finally:
        setup.close()


@pytest.mark.parametrize("begun", [False, True], ids=["lookup", "begun"])
def test_an_idle_step_waits_for_a_burst_of_lookups_in_one_bound_and_prefills_them_together(daemon, tmp_path,
                                                                                            monkeypatch, begun):
    """Two fresh requests (nothing of them in L2) arrive at an idle engine together: the step
    waits for both replies (their lookups went out together; the second wait gets what the first
    left of the bound), lookup_wait_s at most in all, and prefills both in its one forward (each
    has its first token after that step). With the daemon stopped (SIGSTOP), a burst of two waits
    lookup_wait_s at most and admits neither. Every request gets its recompute's tokens; every count
    returns to its value before. Alike whether the lookups are lookups or the requests' matches."""
    seed = 6380
    wait_bound_s = 1.0
    setup = Setup(daemon, tmp_path, seed, "async", lookup_wait_s=wait_bound_s, begin_lookups=begun)
    lookup_class = BegunLookup if begun else PendingLookup
    try:
        generator = torch.Generator().manual_seed(seed + 1)
        prompts = [random_prompt(generator, 40) for _ in range(4)]
        recomputes = recompute_without_the_connector(setup, prompts, 3)
        waits = []                          # (timeout_s, seconds waited, the reply in) of every lookup's wait
        real_wait = lookup_class.wait

        def recorded_wait(lookup, timeout_s):
            started = time.monotonic()
            in_time = real_wait(lookup, timeout_s)
            waits.append((timeout_s, time.monotonic() - started, in_time))
            return in_time

        def share_one_bound(waits) -> bool:
            """Each wait's timeout is what the bound leaves after the waits before it."""
            return all(0 < timeout_s <= wait_bound_s - sum(w[1] for w in waits[:i]) + 1e-9
                       for i, (timeout_s, _, _) in enumerate(waits))

        monkeypatch.setattr(lookup_class, "wait", recorded_wait)
        together = [setup.engine.add_request(p, 3) for p in prompts[:2]]
        setup.engine.step()
        assert [len(r.output_token_ids) for r in together] == [1, 1], \
            f"seed {seed}: not prefilled in one step: {[r.state for r in together]}, waits {waits}"
        # The second request waited too (what is left of the bound), its reply in.
        assert len(waits) == 2 and all(in_time for _, _, in_time in waits) and share_one_bound(waits), \
            f"seed {seed}: {waits}"

        run_to_idle(setup.engine, timeout_s=30)
        waits.clear()
        stop_process(daemon.proc.pid)
        stalled = [setup.engine.add_request(p, 3) for p in prompts[2:]]
        setup.engine.step()
        os.kill(daemon.proc.pid, signal.SIGCONT)
        assert all(r.state is RequestState.WAITING for r in stalled), f"seed {seed}"
        assert waits and not any(in_time for _, _, in_time in waits), f"seed {seed}: {waits}"
        assert share_one_bound(waits), f"seed {seed}: more than one bound: {waits}"
        monkeypatch.undo()
        counts = settled_counts(setup)
        for request, recompute in zip(together + stalled, recomputes):
            assert_same_output(request, recompute, seed)
        assert counts == setup.start_counts, f"seed {seed}"
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)      # a no-op if it runs
        setup.close()


def test_the_lookups_of_a_burst_of_requests_go_out_on_arrival_as_far_as_the_seats_go(daemon, tmp_path):
    """Four requests arrive together at an engine of three seats, the daemon stopped (SIGSTOP):
    each of the first three sends its lookup as it is added (its round trip then runs before the
    step that admits it), the fourth, which no seat could take yet, none. No step admits any
    while no reply is in, nor sends the fourth's. Resumed, the step that takes the replies in
    admits the three; each loads the 96-token prefix and gets the recompute's tokens, and every
    count returns to its value before."""
    seed = 6400
    setup = Setup(daemon, tmp_path, seed, "async", max_num_seqs=3)
    try:
        stop_process(daemon.proc.pid)
        burst = []
        for _ in range(4):
            burst.append(setup.engine.add_request(setup.prompt, 6))
            assert (burst[-1].lookup is not None) == (len(burst) <= 3), f"seed {seed}: request {len(burst)}"
        burst, behind = burst[:3], burst[3]
        sent = [r.lookup for r in burst]
        setup.engine.step()
        assert all(r.state is RequestState.WAITING for r in burst), f"seed {seed}"
        assert [r.lookup for r in burst] == sent and behind.lookup is None, f"seed {seed}"
        setup.engine.abort(behind.request_id)
        os.kill(daemon.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while not all(lookup.ready() for lookup in sent):
            assert time.monotonic() < deadline, f"seed {seed}: no replies from the resumed daemon"
            time.sleep(0.001)
        setup.engine.step()
        assert all(r.state is not RequestState.WAITING for r in burst), f"seed {seed}: {[r.state for r in burst]}"
        counts = settled_counts(setup)
        for request in burst:
            assert request.num_loaded_tokens == 96, f"seed {seed}: {request.num_loaded_tokens}"
            assert_same_output(request, setup.recompute, seed)
        assert counts == setup.start_counts, f"seed {seed}"
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)      # a no-op if it runs
        setup.close()


def test_a_begun_lookup_not_in_does_not_hold_up_the_requests_behind_it(daemon, tmp_path, monkeypatch):
    """A begun lookup is the request's match, whose reply may wait on a promotion from L3. While
    the first waiting request's reply is not in (held back here: the test keeps its lookup
    not ready), the fresh request behind it is admitted and gets its first token; once the reply
    is let in, the first is admitted and loads its 96-token prefix. Both get their recompute's
    tokens; every count returns to its value before."""
    seed = 6400
    setup = Setup(daemon, tmp_path, seed, "async")
    try:
        generator = torch.Generator().manual_seed(seed + 1)
        fresh_prompt = random_prompt(generator, 40)
        (fresh_recompute,) = recompute_without_the_connector(setup, [fresh_prompt], 3)
        held = setup.engine.add_request(setup.prompt, 6)
        behind = setup.engine.add_request(fresh_prompt, 3)
        let_in = False
        real_ready = BegunLookup.ready
        monkeypatch.setattr(BegunLookup, "ready", lambda lookup: (let_in or lookup._request.request_id
                                                                  != held.connector_id) and real_ready(lookup))
        deadline = time.monotonic() + 10
        while not behind.output_token_ids:
            setup.engine.step()
            assert time.monotonic() < deadline, f"seed {seed}: the request behind was not admitted"
        assert held.state is RequestState.WAITING and held.lookup is not None, f"seed {seed}: {held.state}"
        let_in = True
        run_to_idle(setup.engine, timeout_s=30)
        counts = settled_counts(setup)
        assert held.num_loaded_tokens == 96, f"seed {seed}: {held.num_loaded_tokens}"
        assert_same_output(held, setup.recompute, seed)
        assert_same_output(behind, fresh_recompute, seed)
        assert counts == setup.start_counts, f"seed {seed}"
    finally:
        setup.close()
