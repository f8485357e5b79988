"""The reference engine against Hugging Face transformers' Qwen3 (fp32, CPU, tiny random weights
read through the engine's safetensors loader), and against itself: prefix-cache hits, continuous
batching and preemption must not change any request's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from bench.engine import Engine, EngineConfig, RequestState
from bench.tests.engine.reference import engine_on, hf_greedy, hf_model, random_prompt

LOGITS_ATOL = 1e-4   # fp32; observed differences are ~3e-6


def solo_run(engine: Engine, prompt: list[int], max_new_tokens: int):
    """The request alone on a cold prefix cache."""
    engine.reset_prefix_cache()
    (request,) = engine.generate([prompt], max_new_tokens)
    engine.reset_prefix_cache()
    return request


@pytest.mark.parametrize("architecture, tie_word_embeddings, max_prefill_tokens", [
    ("qwen3", False, 4096), ("qwen3", True, 4096), ("qwen3", False, 24), ("qwen3", True, 24), ("llama", True, 24)],
    ids=["untied", "tied", "untied-chunks-of-24", "tied-chunks-of-24", "llama-tied-chunks-of-24"])
def test_prefill_and_decode_match_transformers(tmp_path, architecture, tie_word_embeddings, max_prefill_tokens):
    """The engine's logits at every sampled position are those of transformers' Qwen3 (or Llama)
    within 1e-4, and its greedy tokens are transformers' greedy tokens, whole-prompt or chunked
    prefill."""
    seed = 1000 + 10 * tie_word_embeddings + (max_prefill_tokens == 24) + 100 * (architecture == "llama")
    hf = hf_model(seed, tie_word_embeddings, architecture)
    engine = engine_on(hf, tmp_path, max_prefill_tokens=max_prefill_tokens, keep_logits=True)
    prompt = random_prompt(torch.Generator().manual_seed(seed), 53)
    (request,) = engine.generate([prompt], max_new_tokens=8)
    expected_tokens, expected_logits = hf_greedy(hf, prompt, 8)
    assert request.output_token_ids == expected_tokens, f"seed {seed}"
    difference = (torch.stack(request.logits) - expected_logits).abs().max().item()
    assert difference < LOGITS_ATOL, f"seed {seed}: logits differ by {difference}"


def test_a_prefix_cache_hit_gives_the_tokens_of_a_cold_run(tmp_path):
    """A request whose leading blocks are in the engine's prefix cache reuses them (whole blocks,
    at least one token computed) and gets the tokens and logits of a cold run of it."""
    seed = 1100
    engine = engine_on(hf_model(seed), tmp_path, keep_logits=True)
    generator = torch.Generator().manual_seed(seed)
    prompt = random_prompt(generator, 70)
    shares_3_blocks = prompt[:50] + random_prompt(generator, 30)
    whole_blocks = prompt[:64]
    cold = {len(p): solo_run(engine, p, 6) for p in (prompt, shares_3_blocks, whole_blocks)}

    (warm,) = engine.generate([prompt], 6)          # prompt is cached now
    (again,) = engine.generate([prompt], 6)
    (sharing,) = engine.generate([shares_3_blocks], 6)
    (aligned,) = engine.generate([whole_blocks], 6)
    assert (warm.num_cached_tokens, again.num_cached_tokens) == (0, 64), f"seed {seed}"
    assert sharing.num_cached_tokens == 48, f"seed {seed}"
    assert aligned.num_cached_tokens == 48, f"seed {seed}: the last block is recomputed for its logits"
    for request in (again, sharing, aligned):
        reference = cold[request.num_prompt_tokens]
        assert request.output_token_ids == reference.output_token_ids, f"seed {seed}"
        difference = (torch.stack(request.logits) - torch.stack(reference.logits)).abs().max().item()
        assert difference < LOGITS_ATOL, f"seed {seed}: logits differ by {difference}"


def test_batched_requests_each_get_the_tokens_they_get_alone(tmp_path):
    """Requests prefilled in shared chunks and decoded in one batch, one of them arriving while
    the others decode, each get the tokens (and logits) they get alone."""
    seed = 1200
    engine = engine_on(hf_model(seed), tmp_path, max_prefill_tokens=40, keep_logits=True)
    generator = torch.Generator().manual_seed(seed)
    prompts = [random_prompt(generator, n) for n in (5, 33, 70, 16)]
    alone = [solo_run(engine, p, 10) for p in prompts]

    requests = [engine.add_request(p, 10) for p in prompts[:3]]
    most_decoding_at_once = 0
    while engine.has_unfinished():
        engine.step()
        decoding = [r for r in requests if r.state is RequestState.DECODE]
        most_decoding_at_once = max(most_decoding_at_once, len(decoding))
        if len(requests) == 3 and len(decoding) == 3:
            requests.append(engine.add_request(prompts[3], 10))   # joins a running decode batch
    assert len(requests) == 4 and most_decoding_at_once >= 3, f"seed {seed}: no batch formed"
    for request, reference in zip(requests, alone):
        assert request.output_token_ids == reference.output_token_ids, f"seed {seed}"
        difference = (torch.stack(request.logits) - torch.stack(reference.logits)).abs().max().item()
        assert difference < LOGITS_ATOL, f"seed {seed}: logits differ by {difference}"


def test_preempted_requests_get_the_tokens_they_get_alone(tmp_path):
    """With too few blocks for every request to decode to its end, requests are preempted and
    recomputed, and each still gets the tokens it gets alone; every block comes back. (The last
    request, with a 48-token prompt, needs a block at the first decode step, so a request already
    in that step's batch is preempted.)"""
    seed = 1300
    engine = engine_on(hf_model(seed), tmp_path, num_blocks=9)
    generator = torch.Generator().manual_seed(seed)
    prompts = [random_prompt(generator, n) for n in (40, 40, 48)]     # 3 blocks each, 4-5 at the end
    alone = [solo_run(engine, p, 24) for p in prompts]
    requests = engine.generate(prompts, 24)
    assert engine.scheduler.num_preemptions > 0, f"seed {seed}: nothing was preempted"
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in alone], f"seed {seed}"
    blocks = engine.scheduler.blocks
    blocks.check_integrity()
    assert blocks.num_allocatable_blocks == blocks.num_blocks, f"seed {seed}"


def test_stop_tokens_and_limits(tmp_path):
    """A stop token ends a request (kept as its last token); requests too long for the KV blocks
    or the positions, or without valid token ids, are refused when added."""
    seed = 1400
    engine = engine_on(hf_model(seed), tmp_path, num_blocks=8)
    prompt = random_prompt(torch.Generator().manual_seed(seed), 20)
    (free_running,) = engine.generate([prompt], 6)
    stop_at = free_running.output_token_ids[2]
    first_stop = free_running.output_token_ids.index(stop_at)
    stopped = engine.add_request(prompt, 6, stop_token_ids=[stop_at])
    while engine.has_unfinished():
        engine.step()
    assert stopped.output_token_ids == free_running.output_token_ids[: first_stop + 1], f"seed {seed}"
    assert stopped.finish_reason == "stop" and free_running.finish_reason == "length"
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(prompt, 8 * 16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.add_request(prompt, 1024)
    vocab_size = engine.model.config.vocab_size
    for bad, message in (([], "at least one token"), ([[1, 2]], "flat"), ([1.0, 2.0], "integers"),
                         ([1, vocab_size], r"\[0, "), ([-1, 2], r"\[0, ")):
        with pytest.raises(ValueError, match=message):
            engine.add_request(bad, 1)
    assert not engine.has_unfinished()


def test_a_long_prefix_cache_hit_is_found_whole_and_a_miss_hashes_few_blocks(tmp_path):
    """Block size 2: a prompt of 100 blocks shares its first 70 with one cached, far past the
    first batch of hashes (HASH_AHEAD_BLOCKS, doubled while all hit): the whole 70-block hit is
    reused, with the tokens of a cold run. A prompt whose first block nobody holds is admitted
    with no more than HASH_AHEAD_BLOCKS of its blocks hashed; registration hashes the rest."""
    from bench.engine.scheduler import HASH_AHEAD_BLOCKS

    seed = 1150
    engine = engine_on(hf_model(seed), tmp_path, keep_logits=True, block_size=2, num_blocks=256)
    generator = torch.Generator().manual_seed(seed)
    cached = random_prompt(generator, 200)
    sharing = cached[:140] + random_prompt(generator, 60)
    cold = solo_run(engine, sharing, 4)
    engine.generate([cached], 1)
    (warm,) = engine.generate([sharing], 4)
    assert warm.num_cached_tokens == 140, f"seed {seed}: {warm.num_cached_tokens}"
    assert warm.output_token_ids == cold.output_token_ids, f"seed {seed}"
    difference = (torch.stack(warm.logits) - torch.stack(cold.logits)).abs().max().item()
    assert difference < LOGITS_ATOL, f"seed {seed}: logits differ by {difference}"

    fresh = engine.add_request(random_prompt(generator, 200), 1)
    engine.scheduler.schedule()
    assert fresh.state is RequestState.PREFILL and len(fresh.block_hashes) <= HASH_AHEAD_BLOCKS, \
        f"seed {seed}: {len(fresh.block_hashes)} hashed"
    while engine.has_unfinished():
        engine.step()
    assert fresh.num_registered_blocks == 100 and len(fresh.block_hashes) >= 100, f"seed {seed}"
    assert engine.cached_block_ids(fresh.token_ids[:200]) != [], f"seed {seed}"


def test_a_request_left_waiting_for_a_seat_is_timed_from_its_admission(tmp_path):
    """admitted_s is set when a request leaves WAITING, not before: with one seat, the second of
    two requests is admitted only once the first has finished, between its arrival and its first
    token."""
    seed = 1600
    engine = engine_on(hf_model(seed), tmp_path, max_num_seqs=1)
    generator = torch.Generator().manual_seed(seed)
    first, second = (engine.add_request(random_prompt(generator, 24), 2) for _ in range(2))
    assert first.admitted_s is None and second.admitted_s is None
    engine.step()
    assert first.admitted_s is not None and first.arrival_s <= first.admitted_s <= first.first_token_s
    assert second.state is RequestState.WAITING and second.admitted_s is None, f"seed {seed}"
    while engine.has_unfinished():
        engine.step()
    assert first.finish_s <= second.admitted_s <= second.first_token_s, f"seed {seed}"


def test_prefill_timings_cover_each_prefill_step_and_its_gap_since_the_last_tokens(tmp_path):
    """One PrefillTiming per prefill step (none for decode steps). The gap since the last step's
    tokens is None for the first step and after clear_prefill_timings, and otherwise runs from
    those tokens to this step's first launch: it holds the add_request in between. The connector's
    part of scheduling is within scheduling; on CPU nothing is timed on the GPU."""
    seed = 1700
    engine = engine_on(hf_model(seed), tmp_path, max_num_seqs=1)
    generator = torch.Generator().manual_seed(seed)
    prompts = [random_prompt(generator, 20 + 7 * i) for i in range(3)]
    (first,) = engine.generate([prompts[0]], 3)          # one prefill step, two decode steps
    assert len(engine.prefill_timings) == 1 and engine.prefill_timings[0].gap_s is None, f"seed {seed}"
    second = engine.add_request(prompts[1], 1)
    engine.step()
    timing = engine.prefill_timings[-1]
    assert len(engine.prefill_timings) == 2, f"seed {seed}"
    assert timing.gap_s >= second.added_s - second.arrival_s > 0, f"seed {seed}"
    assert first.finish_s <= second.arrival_s <= second.added_s <= second.admitted_s, f"seed {seed}"
    assert 0 <= timing.schedule_poll_s <= timing.schedule_s and timing.span_s is None, f"seed {seed}"
    assert timing.gpu_gap_s is None, f"seed {seed}: no GPU"

    engine.clear_prefill_timings()
    engine.generate([prompts[2]], 1)
    assert len(engine.prefill_timings) == 1 and engine.prefill_timings[0].gap_s is None, f"seed {seed}"


def test_prefill_timings_say_what_each_step_ran(tmp_path):
    """Each prefill step's record counts its chunks, those on top of tokens the prefix cache held,
    and its new tokens; with no connector, none waited for a load and no load's copies were timed."""
    seed = 1701
    engine = engine_on(hf_model(seed), tmp_path, max_num_seqs=2)
    generator = torch.Generator().manual_seed(seed)
    prefix = random_prompt(generator, 37)                      # 2 whole blocks of 16 and 5 tokens
    first = prefix + random_prompt(generator, 4)
    engine.generate([first], 1)
    (step,) = engine.prefill_timings
    assert (step.chunks, step.cached_chunks, step.loading_chunks, step.tokens) == (1, 0, 0, len(first)), \
        f"seed {seed}: {step}"
    # Together: one prompt over the 2 cached blocks of the prefix, one new prompt of its own.
    cached, fresh = prefix + random_prompt(generator, 9), random_prompt(generator, 23)
    engine.clear_prefill_timings()
    requests = engine.generate([cached, fresh], 1)
    assert requests[0].num_cached_tokens == 32 and requests[1].num_cached_tokens == 0, f"seed {seed}"
    (step,) = engine.prefill_timings
    assert (step.chunks, step.cached_chunks, step.loading_chunks) == (2, 1, 0), f"seed {seed}: {step}"
    assert step.tokens == len(cached) - 32 + len(fresh) and step.load_device_s == 0.0, f"seed {seed}: {step}"
