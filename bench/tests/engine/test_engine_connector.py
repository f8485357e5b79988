"""The engine's connector hook, with an in-process fake connector that really moves KV bytes:
loads replace prefill without changing tokens in every load mode, decode goes on while a load is
pending (not under "blocking"), a layer-by-layer prefill waits for each layer and is redone when
its load is voided, blocks a transfer still touches are kept until released, and nothing leaks
when requests are aborted."""

from __future__ import annotations

import pytest
import torch

from bench.engine import Engine, RequestState
from bench.engine.load import LoadState
from bench.tests.engine.fake_connector import FakeConnector
from bench.tests.engine.reference import engine_on, hf_model, random_prompt

MAX_STEPS = 500
LOGITS_ATOL = 1e-4
LOAD_MODES = ["layerwise", "async", "blocking"]


def connected(engine: Engine, **options) -> FakeConnector:
    connector = FakeConnector(engine.kv_caches, engine.block_size, **options)
    engine.attach_connector(connector)
    return connector


def run_until(engine: Engine, condition, what: str) -> None:
    for _ in range(MAX_STEPS):
        if condition():
            return
        engine.step()
    raise AssertionError(f"not {what} within {MAX_STEPS} steps")


def run_to_idle(engine: Engine) -> None:
    run_until(engine, lambda: not engine.has_unfinished(), "idle")


def cold_run(engine: Engine, prompt, max_new_tokens):
    """The request alone, no connector, cold prefix cache."""
    connector = engine.connector
    engine.attach_connector(None)
    engine.reset_prefix_cache()
    (request,) = engine.generate([prompt], max_new_tokens)
    engine.reset_prefix_cache()
    engine.attach_connector(connector)
    return request


def assert_same_output(request, reference, seed):
    assert request.output_token_ids == reference.output_token_ids, f"seed {seed}"
    difference = (torch.stack(request.logits) - torch.stack(reference.logits)).abs().max().item()
    assert difference < LOGITS_ATOL, f"seed {seed}: logits differ by {difference}"


def assert_all_blocks_back(engine: Engine, seed):
    blocks = engine.scheduler.blocks
    blocks.check_integrity()
    assert not any(blocks.ref_counts), f"seed {seed}: blocks still referenced"
    assert blocks.num_allocatable_blocks == blocks.num_blocks, f"seed {seed}"
    assert not engine.scheduler.held_block_ids, f"seed {seed}"


@pytest.mark.parametrize("load_mode", LOAD_MODES)
def test_loaded_blocks_give_the_tokens_of_a_cold_run(tmp_path, load_mode):
    """What the connector lacks is saved after prefill; later, with the engine's cache cold, it is
    loaded instead of recomputed (beyond the engine's own hit, from that hit on), and the request
    gets the tokens and logits of a cold run, whichever the load mode."""
    seed = 2000
    engine = engine_on(hf_model(seed), tmp_path, keep_logits=True, load_mode=load_mode)
    connector = connected(engine, latency_polls=2)
    prompt = random_prompt(torch.Generator().manual_seed(seed), 70)
    cold_short, cold = cold_run(engine, prompt[:33], 6), cold_run(engine, prompt, 6)

    (first,) = engine.generate([prompt], 6)
    run_to_idle(engine)
    assert connector.counters["saved_pages"] == 4 and first.num_loaded_tokens == 0, f"seed {seed}"
    engine.reset_prefix_cache()
    (short,) = engine.generate([prompt[:33]], 6)                   # loads pages 0-1
    (full,) = engine.generate([prompt], 6)                         # its own hit: 0-1; loads 2-3
    run_to_idle(engine)
    assert (short.num_cached_tokens, short.num_loaded_tokens) == (0, 32), f"seed {seed}"
    assert (full.num_cached_tokens, full.num_loaded_tokens) == (32, 32), f"seed {seed}"
    assert (short.num_prefilled_tokens, full.num_prefilled_tokens) == (1, 6), f"seed {seed}: loaded tokens recomputed"
    assert connector.counters["loaded_pages"] == 4, f"seed {seed}"
    assert_same_output(short, cold_short, seed)
    assert_same_output(first, cold, seed)
    assert_same_output(full, cold, seed)
    assert_all_blocks_back(engine, seed)


@pytest.mark.parametrize("load_mode", LOAD_MODES)
def test_blocks_a_load_did_not_fill_are_recomputed(tmp_path, load_mode):
    """A load that fills only its first page reports the rest failed; those tokens are
    recomputed and the tokens are a cold run's."""
    seed = 2100
    engine = engine_on(hf_model(seed), tmp_path, keep_logits=True, load_mode=load_mode)
    connector = connected(engine, max_load_pages=1)
    prompt = random_prompt(torch.Generator().manual_seed(seed), 70)
    cold = cold_run(engine, prompt, 6)
    engine.generate([prompt], 6)
    run_to_idle(engine)
    engine.reset_prefix_cache()
    (partial,) = engine.generate([prompt], 6)
    assert partial.num_loaded_tokens == 16 and connector.counters["loaded_pages"] == 1, f"seed {seed}"
    assert partial.num_prefilled_tokens == 70 - 16, f"seed {seed}"
    assert_same_output(partial, cold, seed)


def test_decode_goes_on_while_a_load_is_pending(tmp_path):
    """load_mode "async": while one request's load is in flight (LOADING, its load IN_FLIGHT after
    MATCHING), another request keeps decoding; once the load is DONE the loaded request is
    prefilled; both get their cold-run tokens."""
    seed = 2200
    engine = engine_on(hf_model(seed), tmp_path, keep_logits=True, load_mode="async")
    connected(engine, latency_polls=10)           # two finished() calls per decode step
    generator = torch.Generator().manual_seed(seed)
    loaded_prompt, decoding_prompt = random_prompt(generator, 70), random_prompt(generator, 20)
    cold_loaded, cold_decoding = cold_run(engine, loaded_prompt, 4), cold_run(engine, decoding_prompt, 20)
    engine.generate([loaded_prompt], 1)
    run_to_idle(engine)
    engine.reset_prefix_cache()

    decoding = engine.add_request(decoding_prompt, 20)
    run_until(engine, lambda: decoding.state is RequestState.DECODE, "decoding")
    loaded = engine.add_request(loaded_prompt, 4)
    tokens_while_loading, load_states = 0, []
    while loaded.state in (RequestState.WAITING, RequestState.LOADING):
        before = len(decoding.output_token_ids)
        engine.step()
        if loaded.state is RequestState.LOADING:
            tokens_while_loading += len(decoding.output_token_ids) - before
            load_states.append(loaded.load.state)
    assert loaded.load.state is LoadState.DONE and loaded.load.num_tokens == 64, f"seed {seed}"
    run_to_idle(engine)
    assert tokens_while_loading >= 3, f"seed {seed}: {tokens_while_loading} decode tokens during the load"
    assert LoadState.IN_FLIGHT in load_states and set(load_states) <= {LoadState.MATCHING, LoadState.IN_FLIGHT}
    assert loaded.load.started_s < loaded.load.queued_s < loaded.load.done_s, f"seed {seed}"
    assert loaded.num_loaded_tokens == 64, f"seed {seed}"
    assert_same_output(loaded, cold_loaded, seed)
    assert_same_output(decoding, cold_decoding, seed)


def test_blocks_are_kept_until_the_connector_releases_them(tmp_path):
    """A finished request whose save is still in flight keeps its blocks (a waiting request that
    needs them is not admitted) until the connector releases them; the saved pages are the
    request's KV (loading them gives its cold-run tokens)."""
    seed = 2300
    engine = engine_on(hf_model(seed), tmp_path, num_blocks=8, keep_logits=True)
    connector = connected(engine, latency_polls=4)
    generator = torch.Generator().manual_seed(seed)
    saved_prompt, other_prompt = random_prompt(generator, 70), random_prompt(generator, 60)
    cold = cold_run(engine, saved_prompt, 3)

    saved = engine.add_request(saved_prompt, 1)                   # 5 blocks
    run_until(engine, lambda: saved.state is RequestState.FINISHED, "finished")
    other = engine.add_request(other_prompt, 1)                   # needs 4 blocks, 3 are free
    engine.step()
    assert engine.scheduler.held_block_ids, f"seed {seed}: the save's blocks were not held"
    assert other.state is RequestState.WAITING, f"seed {seed}: admitted into held blocks"
    assert engine.scheduler.blocks.num_allocatable_blocks == 3, f"seed {seed}"
    run_to_idle(engine)
    assert other.state is RequestState.FINISHED and connector.counters["saved_pages"] == 4 + 3, f"seed {seed}"

    engine.reset_prefix_cache()
    (restored,) = engine.generate([saved_prompt], 3)
    assert restored.num_loaded_tokens == 64, f"seed {seed}"
    assert_same_output(restored, cold, seed)
    run_to_idle(engine)
    assert_all_blocks_back(engine, seed)


@pytest.mark.parametrize("with_connector,load_mode", [(False, "async"), (True, "async"), (True, "layerwise")],
                         ids=["recompute", "fake-connector-async", "fake-connector-layerwise"])
def test_aborts_in_every_state_leave_no_block_behind(tmp_path, with_connector, load_mode):
    """Requests aborted while waiting, loading (connector only: its load pending, then CANCELLED),
    between prefill chunks and while decoding end at once; once the engine is idle every block is
    free or cached, none referenced or held; aborting a finished request is refused."""
    seed = 2400 + with_connector
    engine = engine_on(hf_model(seed), tmp_path, num_blocks=40, max_num_seqs=3, max_prefill_tokens=32,
                       load_mode=load_mode)
    generator = torch.Generator().manual_seed(seed)
    cached_prompt = random_prompt(generator, 70)
    if with_connector:
        connected(engine, latency_polls=3)
        engine.generate([cached_prompt], 1)
        run_to_idle(engine)
        engine.reset_prefix_cache()
    start = engine.scheduler.blocks.num_allocatable_blocks

    decoding = engine.add_request(random_prompt(generator, 10), 50)
    run_until(engine, lambda: decoding.state is RequestState.DECODE, "decoding")
    chunked = engine.add_request(random_prompt(generator, 100), 5)     # 4 chunks of 32
    loading = engine.add_request(cached_prompt, 5)
    waiting = engine.add_request(random_prompt(generator, 20), 5)      # no seat: max_num_seqs=3
    run_until(engine, lambda: 0 < chunked.num_computed_tokens < 100, "between chunks")
    assert waiting.state is RequestState.WAITING
    if with_connector:
        assert loading.load is not None and loading.load.pending, f"seed {seed}: {loading.state} {loading.load}"
        assert engine.abort(loading.request_id)
        assert loading.load.state is LoadState.CANCELLED, f"seed {seed}"
    elif loading.state is RequestState.PREFILL:
        assert engine.abort(loading.request_id)
    for request in (waiting, chunked, decoding):
        assert engine.abort(request.request_id), f"seed {seed}"
    for request in (waiting, chunked, decoding, loading):
        if request.finish_reason == "abort":
            assert request.state is RequestState.FINISHED
    run_to_idle(engine)
    assert not engine.abort(decoding.request_id)
    assert engine.scheduler.blocks.num_allocatable_blocks == start
    assert_all_blocks_back(engine, seed)


def test_blocking_runs_nothing_else_while_a_load_is_pending(tmp_path):
    """load_mode "blocking" (the switch off): the step that admits a request with something to load
    waits on the host until the load is DONE and prefills the request; the decoding request gets no
    token in it, and no step ends with the request LOADING. Both get their cold-run tokens."""
    seed = 2500
    engine = engine_on(hf_model(seed), tmp_path, keep_logits=True, load_mode="blocking")
    connected(engine, latency_polls=6)
    generator = torch.Generator().manual_seed(seed)
    loaded_prompt, decoding_prompt = random_prompt(generator, 70), random_prompt(generator, 20)
    cold_loaded, cold_decoding = cold_run(engine, loaded_prompt, 4), cold_run(engine, decoding_prompt, 12)
    engine.generate([loaded_prompt], 1)
    run_to_idle(engine)
    engine.reset_prefix_cache()

    decoding = engine.add_request(decoding_prompt, 12)
    run_until(engine, lambda: decoding.state is RequestState.DECODE, "decoding")
    loaded = engine.add_request(loaded_prompt, 4)
    before = len(decoding.output_token_ids)
    engine.step()
    assert loaded.load.state is LoadState.DONE and len(loaded.output_token_ids) == 1, f"seed {seed}: {loaded.state}"
    assert len(decoding.output_token_ids) == before, f"seed {seed}: a decode step ran while the load was pending"
    run_to_idle(engine)
    assert loaded.num_loaded_tokens == 64, f"seed {seed}"
    assert_same_output(loaded, cold_loaded, seed)
    assert_same_output(decoding, cold_decoding, seed)


def test_a_layerwise_prefill_runs_on_a_load_in_flight_waiting_for_each_layer(tmp_path):
    """load_mode "layerwise": the step that admits the request (its load reported queued by the
    connector's next poll, which the step takes right after admission) prefills it while the load
    is IN_FLIGHT, its attention of each layer waiting first for that layer of the load (the fake
    lands a layer's bytes only then, garbage before); its result comes in after the forward, and
    the request gets the tokens and logits of a cold run."""
    seed = 2600
    engine = engine_on(hf_model(seed), tmp_path, keep_logits=True, load_mode="layerwise")
    connector = connected(engine, latency_polls=2)
    prompt = random_prompt(torch.Generator().manual_seed(seed), 70)
    cold = cold_run(engine, prompt, 4)
    engine.generate([prompt], 1)
    run_to_idle(engine)
    engine.reset_prefix_cache()

    request = engine.add_request(prompt, 4)
    connector.layer_waits.clear()
    engine.step()                                   # admitted -> queued -> prefilled on it -> confirmed
    cid = request.connector_id
    assert connector.layer_waits == [(0, (cid,)), (1, (cid,))], f"seed {seed}: {connector.layer_waits}"
    assert request.load.state is LoadState.DONE and len(request.output_token_ids) == 1, f"seed {seed}"
    assert request.load.queued_s <= request.load.done_s
    # The step's record: one chunk, on top of the loaded tokens, read while its load was in flight,
    # the load's copies' device time (the fake's: a millisecond a page).
    step = engine.prefill_timings[-1]
    assert (step.chunks, step.cached_chunks, step.loading_chunks, step.tokens) == (1, 1, 1, 6), f"seed {seed}: {step}"
    assert step.load_device_s == request.load.transfer_s == pytest.approx(4e-3), f"seed {seed}: {step}"
    run_to_idle(engine)
    assert (request.num_loaded_tokens, request.num_prefilled_tokens) == (64, 6), f"seed {seed}"
    assert_same_output(request, cold, seed)
    assert_all_blocks_back(engine, seed)


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
def test_a_load_voided_after_it_was_queued_is_recomputed(tmp_path, load_mode):
    """A load reported queued whose result then voids it (the fake lands other bytes and reports
    every block failed, as when the session ended during the copy): under "layerwise" the prefill
    that read it is dropped (no token from it, none of its blocks in the prefix cache) and the whole
    prompt is prefilled again; under "async" it is just recomputed. The tokens and logits are a
    cold run's, and every block comes back."""
    seed = 2700
    engine = engine_on(hf_model(seed), tmp_path, keep_logits=True, load_mode=load_mode)
    connector = connected(engine, latency_polls=2)
    prompt = random_prompt(torch.Generator().manual_seed(seed), 70)
    cold = cold_run(engine, prompt, 4)
    engine.generate([prompt], 1)
    run_to_idle(engine)
    engine.reset_prefix_cache()
    connector.void_loads = True

    request = engine.add_request(prompt, 4)
    if load_mode == "layerwise":        # the step that prefills on the load in flight, and voids it
        run_until(engine, lambda: request.load is not None and request.load.state is LoadState.DONE, "the load done")
        assert len(connector.layer_waits) == 2 and request.output_token_ids == [], f"seed {seed}: a token from it"
        assert engine.cached_block_ids(prompt) == [], f"seed {seed}: blocks of the voided load were published"
    run_until(engine, lambda: request.output_token_ids, "the first token")
    assert request.load.voided and request.load.num_tokens == 0, f"seed {seed}: {request.load}"
    assert request.num_prefilled_tokens == 70, f"seed {seed}: the first token is not from a recompute"
    run_to_idle(engine)
    assert (request.num_loaded_tokens, request.num_prefilled_tokens) == (0, 70), f"seed {seed}"
    assert_same_output(request, cold, seed)
    assert_all_blocks_back(engine, seed)


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
def test_prefill_times_go_to_the_connector_but_not_those_on_loaded_tokens(tmp_path, load_mode):
    """A whole prompt's prefill forward gives the connector its tokens and seconds (report_prefill:
    the cost model's recompute samples): a cold prompt's 70 tokens. A restored request's prefill of
    its 6 remaining tokens reports nothing: it reads the 64 loaded tokens' KV (under "async"), and
    under "layerwise" it also ran on the load in flight, waiting for its layers."""
    seed = 2700
    engine = engine_on(hf_model(seed), tmp_path, load_mode=load_mode)
    connector = connected(engine, latency_polls=2)
    prompt = random_prompt(torch.Generator().manual_seed(seed), 70)
    engine.generate([prompt], 1)
    run_to_idle(engine)
    assert sum(n for n, _ in connector.prefill_samples) == 70, f"seed {seed}: {connector.prefill_samples}"
    assert all(seconds > 0 for _, seconds in connector.prefill_samples), connector.prefill_samples
    engine.reset_prefix_cache()
    connector.prefill_samples.clear()
    connector.layer_waits.clear()
    request = engine.add_request(prompt, 1)
    run_to_idle(engine)
    assert (request.num_loaded_tokens, request.num_prefilled_tokens) == (64, 6), f"seed {seed}"
    if load_mode == "layerwise":
        assert connector.layer_waits and connector.prefill_samples == [], f"seed {seed}: {connector.prefill_samples}"
    else:
        assert not connector.layer_waits and connector.prefill_samples == [], f"seed {seed}: {connector.prefill_samples}"


def test_a_prompt_is_saved_while_its_forward_runs_but_one_on_a_load_in_flight_after_its_token(tmp_path):
    """A prompt prefilled on nothing pending is saved before the host takes the forward's tokens
    (its host work under the GPU's); one whose forward read a load IN_FLIGHT ("layerwise") only
    once its first token is out (its chunk stands only once the load's result is in). Either way
    the saved pages restore the tokens and logits of a cold run (the early save's 64 tokens, and
    with the late one's page 80)."""
    seed = 2700
    engine = engine_on(hf_model(seed), tmp_path, keep_logits=True, load_mode="layerwise")
    connector = connected(engine, latency_polls=2)
    generator = torch.Generator().manual_seed(seed)
    prompt, longer = random_prompt(generator, 70), None
    cold = cold_run(engine, prompt, 4)
    events: list[tuple[str, object]] = []
    save, tokens = connector.save, engine._tokens
    connector.save = lambda request_id, *args: (events.append(("save", request_id)), save(request_id, *args))[1]
    engine._tokens = lambda logits: (events.append(("tokens", None)), tokens(logits))[1]

    first = engine.add_request(prompt, 1)
    run_until(engine, lambda: first.state is RequestState.FINISHED, "finished")
    assert events == [("save", first.connector_id), ("tokens", None)], f"seed {seed}: {events}"
    run_to_idle(engine)
    engine.reset_prefix_cache()

    longer = prompt + random_prompt(generator, 20)          # its first 64 tokens are saved
    events.clear()
    restored = engine.add_request(longer, 1)
    run_until(engine, lambda: restored.state is RequestState.FINISHED, "finished")
    assert restored.load is not None and restored.load.queued_s is not None, f"seed {seed}"
    assert events == [("tokens", None), ("save", restored.connector_id)], f"seed {seed}: {events}"
    run_to_idle(engine)
    engine.reset_prefix_cache()

    (again,) = engine.generate([prompt], 4)
    assert again.num_loaded_tokens == 64, f"seed {seed}"
    assert_same_output(again, cold, seed)
    run_to_idle(engine)
    engine.reset_prefix_cache()
    cold_longer = cold_run(engine, longer, 4)
    (longer_again,) = engine.generate([longer], 4)          # 80 tokens: the late save's page too
    assert longer_again.num_loaded_tokens == 80, f"seed {seed}: {longer_again.num_loaded_tokens}"
    assert_same_output(longer_again, cold_longer, seed)
    assert_all_blocks_back(engine, seed)
