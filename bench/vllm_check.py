"""Real vLLM (its CPU build) on kvcached: loads, their effect, sharing between two vLLM processes,
and a daemon that dies and comes back. Writes bench/results/cpu/vllm.json; tests/vllm runs it.

    python bench/vllm_check.py [--workdir DIR]              # needs vllm importable

Every vLLM here is a process of its own (``engine`` below: one ``LLM``, greedy, token-id prompts,
commands as JSON lines on stdin, answers as ``KVCHECK {...}`` lines on stdout), on a tiny random
Qwen3 made and saved first (no hub). What is measured, in order:

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


def kv_transfer_config(socket_path: str) -> dict[str, Any]:
    """What a user passes to vLLM (``--kv-transfer-config``) to run on kvcached. This check asks
    for every hit to be restored (policy always): it checks loads and their bytes, not the cost
    model's choices (a user leaves policy out: the daemon's, by default cost)."""
    return {"kv_connector": "KVCachedConnector", "kv_connector_module_path": "engine_client.vllm_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": socket_path, "policy": "always"}}


def run_engine(args: argparse.Namespace) -> int:
    """One vLLM: ``{"prompts": [[ids]]}`` on stdin -> ``KVCHECK {"outputs", "metrics"}`` on stdout."""
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if args.socket:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config(args.socket))
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048,
              block_size=BLOCK_SIZE, enforce_eager=True, disable_log_stats=False, seed=0,
              enable_prefix_caching=not args.no_prefix_caching, **kwargs)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    _answer({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        started = time.monotonic()
        outputs = [llm.generate([{"prompt_token_ids": p}], sampling, use_tqdm=False)[0] for p in command["prompts"]]
        _answer({"outputs": [list(o.outputs[0].token_ids) for o in outputs], "seconds": time.monotonic() - started,
                 "metrics": _metrics(llm)})
    return 0


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
                 start_timeout_s: float = 300.0):
        args = [sys.executable, os.path.abspath(__file__), "engine", "--model", model]
        if socket_path:
            args += ["--socket", socket_path]
        if no_prefix_caching:
            args.append("--no-prefix-caching")
        # The CPU backend's default KV space refuses to start on a 24 GiB machine; the model is
        # local, and vLLM is kept from sending its usage report anywhere.
        env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
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

    def generate(self, token_ids: list[list[int]], timeout_s: float = 300.0) -> dict[str, Any]:
        """Outputs, and the metrics' increments over this call."""
        self.proc.stdin.write(json.dumps({"prompts": token_ids}) + "\n")
        self.proc.stdin.flush()
        answer = self._wait("generate", timeout_s)
        metrics = answer["metrics"]
        answer["delta"] = {k: v - self.last_metrics.get(k, 0) for k, v in metrics.items()}
        self.last_metrics = metrics
        return answer

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


def vllm_namespace(daemon: Daemon):
    """The geometry of the one namespace vLLM attached with (page format "blocks")."""
    from proto.messages import KVGeometry

    spaces = [n for n in daemon.status()["namespaces"] if n["geometry"]["layout"] == "blocks"]
    assert len(spaces) == 1, spaces
    return KVGeometry.from_wire(spaces[0]["geometry"])


def overwrite_with_noise(daemon: Daemon, token_ids: list[int], seed: int) -> int:
    """Write N(0, 1) values over the L2 pages that hold token_ids' prefix; the number of pages."""
    import numpy as np
    import torch

    from engine_client.client import KVCacheClient
    from engine_client.shared_pool import SharedHostPool

    geometry = vllm_namespace(daemon)
    with KVCacheClient(daemon.socket_path, client_name="noise") as client:
        info = client.attach(geometry)
        reply = client.match(np.asarray(token_ids, dtype=np.int32))
        pool = SharedHostPool.open(info.shm_path, info.arena_offset_bytes, info.num_pages, geometry, pin=False)
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
                reply = client.match(tokens, reserve_backup=True)
                self._leases.append((client, reply.lease_id))
                if not reply.backup_page_ids:
                    break
                self.reserved_pages += len(reply.backup_page_ids)
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


def _kvcached(answer: dict[str, Any]) -> dict[str, float]:
    return {k.removeprefix("vllm:kvcached_"): v for k, v in answer["delta"].items() if k.startswith("vllm:kvcached_")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    engine = sub.add_parser("engine", help="one vLLM process (used by the check)")
    engine.add_argument("--model", required=True)
    engine.add_argument("--socket")
    engine.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--workdir", help="keep the model and the logs here (default: a temporary directory)")
    parser.add_argument("--out", help="write the result here instead of bench/results/cpu/vllm.json")
    args = parser.parse_args(argv)
    if args.command == "engine":
        return run_engine(args)
    # ipc:// paths must stay short (sun_path is 108 bytes): the socket lives under /tmp.
    workdir = args.workdir or tempfile.mkdtemp(prefix="kvvllm-", dir="/tmp")
    os.makedirs(workdir, exist_ok=True)
    started = time.monotonic()
    try:
        result = check(workdir)
    except BaseException:
        print(f"logs in {workdir}", file=sys.stderr)
        raise
    result["seconds"] = round(time.monotonic() - started, 1)
    from bench.common import write_result

    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        path = args.out
    else:
        path = write_result("vllm", result, machine="cpu")
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1))
    print(f"wrote {path}")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
