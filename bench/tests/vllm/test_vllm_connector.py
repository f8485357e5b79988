"""kvcached under real vLLM (its CPU build): bench/vllm_check.py runs vLLM processes against a real
daemon; each test checks one property of that run. Skipped where vLLM is not installed (the main
test environment); .ci/vllm builds an environment with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from kvcached.testing.daemon_proc import REPO_ROOT, child_env  # noqa: E402

CHECK_TIMEOUT_S = 1500
SHARED_TOKENS = 512          # the prompts' whole pages that kvcached can hold (4 blocks of 128)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm") / "vllm.json"
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "vllm_check.py"), "--part", "tiny",
                           "--out", str(out)],
                          env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    assert done.returncode == 0, f"vllm_check failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    with open(out) as f:
        return json.load(f)


pytestmark = pytest.mark.timeout(CHECK_TIMEOUT_S + 60)


def test_fresh_process_loads_the_prompt_from_kvcached(run):
    """A fresh vLLM process gets at least 512 of the prompt's tokens from kvcached, as vLLM's own
    counter of external prefix-cache hits shows, and kvcached loaded them."""
    assert run["external_hit_tokens"] >= SHARED_TOKENS, run["steps"]["process2"]
    assert run["steps"]["process2"]["kvcached"]["loaded_tokens"] >= SHARED_TOKENS, run["steps"]["process2"]


def test_loaded_prompt_generates_what_vllm_alone_does(run):
    """Greedy tokens after a load from kvcached equal those of vLLM without any connector."""
    assert run["outputs_equal"], run["steps"]["process2"]
    assert run["steps"]["process1"]["outputs_equal"], run["steps"]["process1"]


def test_noise_in_l2_changes_the_output(run):
    """The loaded KV is used: with the prompt's L2 pages overwritten by noise, a fresh vLLM that
    loads them generates other tokens."""
    noise = run["steps"]["noise"]
    assert noise["pages_overwritten"] >= SHARED_TOKENS // run["block_size"], noise
    assert noise["external_hit_tokens"] >= SHARED_TOKENS, noise
    assert run["noise_changes_output"], noise


def test_second_process_gets_the_shared_system_prompt_from_the_first(run):
    """Two vLLM processes at once, prompts sharing a 512-token system prompt: the first computes
    it (no external hit), the second loads it from the first's saves; both generate what vLLM
    alone does."""
    two = run["steps"]["two_at_once"]
    assert two["a_external_hit_tokens"] == 0, two
    assert two["b_external_hit_tokens"] >= SHARED_TOKENS, two
    assert two["a_outputs_equal"] and two["b_outputs_equal"], two


def test_failed_load_is_recomputed(run):
    """A load that fails after a lookup promised the prompt (L3 only, no L2 page to bring it
    into) does not fail the request: the failed blocks are reported to vLLM, which recomputes
    them and generates what vLLM alone does."""
    failed = run["steps"]["failed_load"]
    # the set-up: every L2 page held, the prompt in L3 alone (else the load promotes and succeeds)
    assert failed["l2_pages_held"] == failed["l2_capacity_pages"], failed
    assert failed["tiers_at_lookup"].get("l2", 0) == 0 and failed["l3_tokens"] >= SHARED_TOKENS, failed
    assert failed["external_hit_tokens"] >= SHARED_TOKENS, failed
    assert run["failed_load_tokens"] >= SHARED_TOKENS, failed
    assert run["failed_load_outputs_equal"], failed


def test_daemon_killed_requests_complete_then_hits_resume(run):
    """With the daemon SIGKILLed under a running vLLM, its requests complete with vLLM's own
    tokens (no external hit); once the daemon is restarted, the same vLLM hits again."""
    kill = run["steps"]["daemon_kill"]
    assert kill["before_external_hit_tokens"] >= SHARED_TOKENS, kill
    assert run["daemon_kill_requests_completed"], kill
    assert kill["during_external_hit_tokens"] == 0, kill
    assert run["hits_resume_after_restart"], kill


def test_connector_asks_for_plain_vllms_cpu_reservation():
    """vLLM-CPU reserves one more CPU per local rank once any KV connector is configured, which
    this connector does not use: on the CPU platform, with VLLM_CPU_NUM_OF_RESERVED_CPU unset, the
    connector says which value gives plain vLLM's reservation (one per local rank); set, or on
    another platform, it says nothing."""
    from engine_client.vllm_connector.config import cpu_reservation_note

    for ranks in (1, 2):
        note = cpu_reservation_note(True, ranks, {"OMP_NUM_THREADS": "2"})
        assert note is not None and f"VLLM_CPU_NUM_OF_RESERVED_CPU={ranks} " in note, note
    assert cpu_reservation_note(True, 1, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}) is None
    assert cpu_reservation_note(False, 1, {}) is None
