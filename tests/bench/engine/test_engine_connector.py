"""The engine's connector hook, with an in-process fake connector that really moves KV bytes:
loads replace prefill without changing tokens, decode goes on while a load is pending, blocks a
transfer still touches are kept until released, and nothing leaks when requests are aborted."""

from __future__ import annotations

import pytest
import torch

from bench.engine import Engine, RequestState
from tests.bench.engine.fake_connector import FakeConnector
from tests.bench.engine.reference import engine_on, hf_model, random_prompt

MAX_STEPS = 500
LOGITS_ATOL = 1e-4


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


def test_loaded_blocks_give_the_tokens_of_a_cold_run(tmp_path):
    """What the connector lacks is saved after prefill; later, with the engine's cache cold, it is
    loaded instead of recomputed (beyond the engine's own hit, from that hit on), and the request
    gets the tokens and logits of a cold run."""
    seed = 2000
    engine = engine_on(hf_model(seed), tmp_path, keep_logits=True)
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


def test_blocks_a_load_did_not_fill_are_recomputed(tmp_path):
    """A load that fills only its first page reports the rest failed; those tokens are
    recomputed and the tokens are a cold run's."""
    seed = 2100
    engine = engine_on(hf_model(seed), tmp_path, keep_logits=True)
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
    """While one request's load is in flight (LOADING), another request keeps decoding; then the
    loaded request is prefilled; both get their cold-run tokens."""
    seed = 2200
    engine = engine_on(hf_model(seed), tmp_path, keep_logits=True)
    connected(engine, latency_polls=6)
    generator = torch.Generator().manual_seed(seed)
    loaded_prompt, decoding_prompt = random_prompt(generator, 70), random_prompt(generator, 20)
    cold_loaded, cold_decoding = cold_run(engine, loaded_prompt, 4), cold_run(engine, decoding_prompt, 20)
    engine.generate([loaded_prompt], 1)
    run_to_idle(engine)
    engine.reset_prefix_cache()

    decoding = engine.add_request(decoding_prompt, 20)
    run_until(engine, lambda: decoding.state is RequestState.DECODE, "decoding")
    loaded = engine.add_request(loaded_prompt, 4)
    tokens_while_loading = 0
    while loaded.state in (RequestState.WAITING, RequestState.LOADING):
        before = len(decoding.output_token_ids)
        engine.step()
        if loaded.state is RequestState.LOADING:
            tokens_while_loading += len(decoding.output_token_ids) - before
    run_to_idle(engine)
    assert tokens_while_loading >= 3, f"seed {seed}: {tokens_while_loading} decode tokens during the load"
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


@pytest.mark.parametrize("with_connector", [False, True], ids=["recompute", "fake-connector"])
def test_aborts_in_every_state_leave_no_block_behind(tmp_path, with_connector):
    """Requests aborted while waiting, loading (connector only), between prefill chunks and while
    decoding end at once; once the engine is idle every block is free or cached, none referenced
    or held; aborting a finished request is refused."""
    seed = 2400 + with_connector
    engine = engine_on(hf_model(seed), tmp_path, num_blocks=40, max_num_seqs=3, max_prefill_tokens=32)
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
    expected_loading = RequestState.LOADING if with_connector else RequestState.PREFILL
    if loading.state is expected_loading:
        assert engine.abort(loading.request_id)
    elif with_connector:
        pytest.fail(f"seed {seed}: the cached request is {loading.state}, not loading")
    for request in (waiting, chunked, decoding):
        assert engine.abort(request.request_id), f"seed {seed}"
    for request in (waiting, chunked, decoding, loading):
        if request.finish_reason == "abort":
            assert request.state is RequestState.FINISHED
    run_to_idle(engine)
    assert not engine.abort(decoding.request_id)
    assert engine.scheduler.blocks.num_allocatable_blocks == start
    assert_all_blocks_back(engine, seed)
