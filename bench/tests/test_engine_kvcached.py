"""The reference engine on engine_client's real KVConnector, against a real daemon process over
ipc:// (fp32 on CPU; the same in bf16 on CUDA, marked gpu): a prefix one engine prefilled and
saved is restored by another engine, or by the same one once its own cache is cold, from L2 and
from L3 alone, bit for bit, and gives a recompute's tokens (in bf16: its logits within rounding)."""

from __future__ import annotations

import pytest
import torch

from bench.engine import Engine, EngineConfig, load_model
from bench.tiers import KVDaemon, attach_kvcached, detach_kvcached, prefix_kv, run_request, settle
from kvcached.testing.tiers import TierControl
from bench.tests.engine.reference import hf_model, random_prompt

LOGITS_ATOL = 1e-4
BF16_RTOL = 0.02
MODEL_ID = "engine-kvcached-test"


def devices():
    yield pytest.param("cpu", torch.float32, id="cpu-fp32")
    yield pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)


@pytest.fixture
def daemon():
    with KVDaemon(l2_bytes=64 << 20, l3_bytes=64 << 20) as process:
        yield process


def make_engine(seed: int, tmp_path, device: str, dtype: torch.dtype) -> Engine:
    hf_model(seed).save_pretrained(tmp_path)
    return Engine(load_model(str(tmp_path), dtype=dtype, device=device),
                  EngineConfig(num_blocks=64, keep_logits=True))


def without_connector(engine: Engine, prompt, max_new_tokens: int, cold: bool):
    """The prompt alone on the engine with no connector: with a cold cache (a recompute), or with
    what its own prefix cache holds (the numbers a restore of the same KV must give)."""
    connector = engine.connector
    engine.attach_connector(None)
    if cold:
        engine.reset_prefix_cache()
    request = run_request(engine, prompt, max_new_tokens)
    if cold:
        engine.reset_prefix_cache()
    engine.attach_connector(connector)
    return request


def assert_same_output(restored, own_cache, recompute, seed, dtype):
    """Bit for bit the logits of the engine's own cache hit on the same KV; in fp32 the tokens of a
    recompute and its logits within rounding; in bf16 the first token's logits within bf16
    rounding of the recompute's (2% of the largest logit: greedy tokens of the two may part)."""
    assert torch.equal(torch.stack(restored.logits), torch.stack(own_cache.logits)), \
        f"seed {seed}: logits differ from the engine's own cache hit on the same KV"
    if dtype == torch.float32:
        assert restored.output_token_ids == recompute.output_token_ids, f"seed {seed}: tokens differ from recompute"
        difference = (torch.stack(restored.logits) - torch.stack(recompute.logits)).abs().max().item()
        assert difference < LOGITS_ATOL, f"seed {seed}: logits differ from recompute by {difference}"
    else:
        difference = (restored.logits[0] - recompute.logits[0]).abs().max().item()
        assert difference < BF16_RTOL * recompute.logits[0].abs().max().item(), \
            f"seed {seed}: first logits differ from recompute by {difference}"


@pytest.mark.parametrize("device,dtype", devices())
def test_another_engine_restores_a_saved_prefix_from_l2_bit_for_bit(daemon, tmp_path, device, dtype):
    """Engine A prefills a 100-token prompt and saves its 6 full pages through its KVConnector;
    engine B (same weights, its own KV tensors, cache and session) gets a prompt with that prefix:
    it loads all 6 pages from L2 (none of them recomputed), its KV of them equals A's bit for bit,
    its logits equal bit for bit A's from its own cache hit, its tokens (and logits within 1e-4)
    are a recompute's (bf16: its first logits within rounding), and the daemon's integrity holds."""
    seed = 5100
    a = make_engine(seed, tmp_path, device, dtype)
    b = Engine(a.model, EngineConfig(num_blocks=64, keep_logits=True))
    generator = torch.Generator().manual_seed(seed)
    prefix = random_prompt(generator, 100)
    prompt_a, prompt_b = prefix + random_prompt(generator, 5), prefix + random_prompt(generator, 7)
    recompute = without_connector(b, prompt_b, 6, cold=True)
    attach_kvcached(a, daemon.socket_path, model_id=MODEL_ID, client_name="a")
    attach_kvcached(b, daemon.socket_path, model_id=MODEL_ID, client_name="b")
    control = TierControl(daemon, a.connector.geometry)
    try:
        first = run_request(a, prompt_a, 1)
        settle(a, control)
        assert first.num_loaded_tokens == 0 and a.connector.stats()["committed_pages"] == 6, f"seed {seed}"
        assert control.hits(prefix)["l2"] == 96, f"seed {seed}"
        restored = run_request(b, prompt_b, 6)
        settle(b, control)
        assert (restored.num_cached_tokens, restored.num_loaded_tokens) == (0, 96), f"seed {seed}"
        assert restored.num_prefilled_tokens == len(prompt_b) - 96, f"seed {seed}: loaded tokens recomputed"
        assert torch.equal(prefix_kv(b, prefix), prefix_kv(a, prefix)), f"seed {seed}: restored KV differs"
        own_cache = without_connector(a, prompt_b, 6, cold=False)
        assert own_cache.num_cached_tokens == 96, f"seed {seed}"
        assert_same_output(restored, own_cache, recompute, seed, dtype)
        assert control.integrity() == "ok"
    finally:
        control.close()
        detach_kvcached(a)
        detach_kvcached(b)


@pytest.mark.parametrize("device,dtype", devices())
def test_a_prefix_only_l3_holds_is_promoted_and_restored_bit_for_bit(daemon, tmp_path, device, dtype):
    """Once TierControl has emptied L2 (the lookup then sees the prefix in L3 alone) and the
    engine's own cache is cold, the engine's next request with the prefix restores it through an
    L3 -> L2 promotion: all 6 pages loaded, the promotion counted, its KV equal bit for bit to what
    its own prefill wrote, its logits bit for bit its own cache hit's, its tokens a recompute's
    (bf16: its first logits within rounding), and the daemon's integrity holds."""
    seed = 5200
    engine = make_engine(seed, tmp_path, device, dtype)
    generator = torch.Generator().manual_seed(seed)
    prefix = random_prompt(generator, 100)
    prompt = prefix + random_prompt(generator, 9)
    recompute = without_connector(engine, prompt, 6, cold=True)
    attach_kvcached(engine, daemon.socket_path, model_id=MODEL_ID)
    control = TierControl(daemon, engine.connector.geometry)
    try:
        run_request(engine, prefix + random_prompt(generator, 3), 1)
        settle(engine, control)
        written = prefix_kv(engine, prefix)
        own_cache = without_connector(engine, prompt, 6, cold=False)
        assert own_cache.num_cached_tokens == 96, f"seed {seed}"
        hits = control.force("l3", prefix, 96)
        assert hits == {"l2": 0, "l3": 96, "remote": 0}, f"seed {seed}: {hits}"
        engine.reset_prefix_cache()
        restored = run_request(engine, prompt, 6)
        settle(engine, control)
        assert (restored.num_cached_tokens, restored.num_loaded_tokens) == (0, 96), f"seed {seed}"
        assert engine.connector.stats()["promoted_tokens"] == 96, f"seed {seed}"
        assert torch.equal(prefix_kv(engine, prefix), written), f"seed {seed}: restored KV differs"
        assert_same_output(restored, own_cache, recompute, seed, dtype)
        assert control.integrity() == "ok"
    finally:
        control.close()
        detach_kvcached(engine)


@pytest.mark.gpu
def test_a_prompts_save_starts_on_the_gpu_after_its_first_tokens_copy_to_the_host(daemon, tmp_path):
    """On CUDA a prompt's save is queued while its prefill runs, but its copies (a gather, then a
    DMA to the host) start only after the step's tokens were copied to the host: a save's DMA
    queued first would hold the tokens' copy up behind it. The saved pages are then found in L2."""
    seed = 5300
    engine = make_engine(seed, tmp_path, "cuda", torch.bfloat16)
    prompt = random_prompt(torch.Generator().manual_seed(seed), 100)
    attach_kvcached(engine, daemon.socket_path, model_id=MODEL_ID, client_name="order")
    control = TierControl(daemon, engine.connector.geometry)
    tokens_copied, saves = [], []
    real_launch, real_save = engine._launch_tokens, engine.connector.transfer.save

    def launch_tokens(logits):
        launched = real_launch(logits)
        tokens_copied.append(torch.cuda.Event(enable_timing=True))
        tokens_copied[-1].record()           # on the engine's stream, right after the tokens' copy
        return launched

    def save(*args, **kwargs):
        saves.append(real_save(*args, **kwargs))
        return saves[-1]

    engine._launch_tokens = launch_tokens
    engine.connector.transfer.save = save
    try:
        request = run_request(engine, prompt, 1)
        settle(engine, control)
        assert len(request.output_token_ids) == 1 and len(saves) == 1 and tokens_copied, f"seed {seed}"
        assert tokens_copied[0].elapsed_time(saves[0].start_event) >= 0, \
            f"seed {seed}: the save's copies started before the tokens were copied"
        assert control.hits(prompt)["l2"] == 96, f"seed {seed}"
    finally:
        # The wrapper, and this frame's bound method, hold the transfer (and its view of the pool).
        del engine.connector.transfer.save
        real_save = None
        saves.clear()
        control.close()
        detach_kvcached(engine)
