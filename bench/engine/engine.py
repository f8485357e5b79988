"""The engine: requests in, one scheduler step at a time, greedy tokens out.

    engine = Engine(load_model("qwen3-8b", seed=0), EngineConfig(num_blocks=4096))
    request = engine.add_request(prompt_token_ids, max_new_tokens=16)
    while engine.has_unfinished():
        for done in engine.step(): ...          # requests finished this step
    request.output_token_ids, request.ttft_s
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Iterable, NamedTuple, Sequence

import numpy as np
import torch

from bench.engine.attention import PAGED_PREFILL_MAX_ROWS, PagedPrefill, PrefillSeq
from bench.engine.block_manager import block_hashes
from bench.engine.config import EngineConfig
from bench.engine.model import DecodeBatch, PrefillBatch, Qwen3Model
from bench.engine.request import Request
from bench.engine.scheduler import PrefillChunk, Scheduler
from engine_client.engine_api import EngineConnector

MAX_PREFILL_TIMINGS = 10_000        # the latest prefill steps' timings kept (prefill_timings)


class PrefillTiming(NamedTuple):
    """Where a prefill step's time goes, for benchmarks: from the last step's tokens to this
    step's first launch, on the host (``gap_s``) and on the GPU (``gpu_gap_s``, CUDA events; None
    on CPU or for the first step: longer than ``gap_s`` where the GPU was still busy with other
    work, such as a save's DMA); host seconds to schedule it (the connector's news, admission:
    ``schedule_s``; of it, the connector's news at its start: ``schedule_poll_s``), to launch its
    forward and tokens (``launch_s``), in the connector's saves queued after them
    (``save_call_s``), waiting for the tokens while polling (``token_wait_s``), and from the tokens
    to the step's return (finishes, saves due: ``after_s``); and the GPU's span from its first
    launch to its tokens' copy, by CUDA events (``span_s``; None on CPU). What the step ran: its
    chunks, those on top of tokens already in the request's blocks (``cached_chunks``: a restored
    request's suffix, a prefix-cache hit's rest, or a later chunk of a prompt prefilled in chunks),
    those that waited for a load layer by layer (``loading_chunks``) and the new tokens of all
    (``tokens``); and the device time of those chunks' loads' copies, added up (``load_device_s``:
    from each load's start on the connector's load lane to its end; 0 for a chunk dropped because
    its load's result was not in yet)."""
    gap_s: float | None
    gpu_gap_s: float | None
    schedule_s: float
    schedule_poll_s: float
    launch_s: float
    save_call_s: float
    token_wait_s: float
    after_s: float
    span_s: float | None
    chunks: int
    cached_chunks: int
    loading_chunks: int
    tokens: int
    load_device_s: float


class Engine:
    def __init__(self, model: Qwen3Model, config: EngineConfig):
        self.model = model
        self.config = config
        self.device = model.device
        self.block_size = config.block_size
        mc = model.config
        # One tensor per layer, [K/V, block, token in block, KV head, head dim]: the "layer" layout
        # of engine_client.layout, which the connector registers as it is.
        self.kv_caches = [torch.zeros(2, config.num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                                      dtype=model.dtype, device=self.device) for _ in range(mc.num_layers)]
        backend = config.decode_backend
        self.decode_backend = backend if backend != "auto" else ("triton" if self.device.type == "cuda" else "torch")
        if config.graph_max_tokens and self.device.type == "cuda":
            model.use_graphs(config.graph_max_tokens)           # captured once per model
        # The engine's GPU work goes on a stream of the highest priority: where a decode batch and
        # the connector's copies and scatters (default priority) both wait for SMs, the batch goes
        # first, and a restore slows the other requests' steps less.
        self.stream = None
        self._host_tokens = None            # a step's greedy tokens on their way to the host (CUDA)
        self._last_tokens = None            # the last step's tokens: (seen on the host, their copy's event)
        if self.device.type == "cuda":
            self._host_tokens = torch.empty(config.max_num_seqs, dtype=torch.int64, pin_memory=True)
            self.stream = torch.cuda.Stream(self.device, priority=-(1 << 10))   # the highest there is
            self.stream.wait_stream(torch.cuda.current_stream(self.device))     # kv_caches, the graphs
        self.scheduler = Scheduler(config)
        self.prefill_timings: collections.deque[PrefillTiming] = collections.deque(maxlen=MAX_PREFILL_TIMINGS)
        self._next_request_id = itertools.count()
        self._requests: dict[int, Request] = {}

    @property
    def connector(self) -> EngineConnector | None:
        return self.scheduler.connector

    def attach_connector(self, connector: EngineConnector | None) -> None:
        """Plug in (or, with None, take out) the connector; only while no request is open (it
        registers ``kv_caches``, so it is built after the engine)."""
        if self.has_unfinished():
            raise RuntimeError("attach the connector while the engine is idle")
        self.scheduler.connector = connector

    # ---- requests -----------------------------------------------------------------------------------

    def add_request(self, token_ids: Sequence[int], max_new_tokens: int = 1,
                    stop_token_ids: Iterable[int] = ()) -> Request:
        arrival_s = time.perf_counter()
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1 or not tokens.size or max_new_tokens < 1:
            raise ValueError("a request needs at least one token (a flat sequence) and max_new_tokens >= 1")
        if tokens.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got {tokens.dtype}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.model.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.model.config.vocab_size})")
        token_ids = tokens.tolist()
        num_tokens = len(token_ids) + max_new_tokens
        if num_tokens > self.model.config.max_position_embeddings:
            raise ValueError(f"{num_tokens} tokens exceed max_position_embeddings "
                             f"{self.model.config.max_position_embeddings}")
        if -(-num_tokens // self.block_size) > self.config.num_blocks:
            raise ValueError(f"{num_tokens} tokens need more than the {self.config.num_blocks} KV blocks")
        request = Request(next(self._next_request_id), token_ids, len(token_ids), max_new_tokens,
                          frozenset(stop_token_ids), arrival_s, _token_array=tokens.astype(np.int32))
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        request.added_s = time.perf_counter()
        return request

    def abort(self, request_id: int) -> bool:
        """Finish the request now (its blocks are freed, or held for the connector). False if it
        had finished already."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, "abort", time.perf_counter())
        return True

    def clear_prefill_timings(self) -> None:
        """Forget the prefill steps' timings so far; the next step's gap is not timed (None), as
        an engine's first step's."""
        self.prefill_timings.clear()
        self._last_tokens = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One scheduler step (a prefill batch or a decode batch, or only the connector's news);
        returns the requests that finished in it. Its GPU work is done on return."""
        if self.stream is None:
            return self._step()
        with torch.cuda.stream(self.stream):
            return self._step()

    def _step(self) -> list[Request]:
        scheduled = time.perf_counter()
        plan = self.scheduler.schedule()
        started = time.perf_counter()
        # Recompute samples for the cost model: prefills of whole prompts alone. A prefill that waits
        # for loads layer by layer times those loads too, and one on top of cached or loaded tokens
        # also reads their KV (its time is not its tokens'): neither is a sample.
        loads_in_flight = self.scheduler.loads_in_flight(plan.prefill)
        loading = [chunk.request for chunk in plan.prefill if chunk.request.connector_id in loads_in_flight]
        prefill_sample = bool(plan.prefill) and not loading \
            and all(chunk.first_token == 0 for chunk in plan.prefill)
        if plan.prefill:
            forward_started = self._record_event()
            forward_started_s = time.perf_counter()
            last_s, last_event = self._last_tokens or (None, None)
            logits = self._run_prefill(plan.prefill)
            tokens = self._launch_tokens(logits)
            launched_s = time.perf_counter()
            # While the GPU computes; the saves' copies go after the tokens' (a save's DMA to the
            # host queued first would hold the tokens' copy up behind it: ~1 ms per 50 MB).
            self.scheduler.save_prefilled(plan.prefill)
            saved_s = time.perf_counter()
            token_ids = self._tokens(tokens)
            tokens_s = time.perf_counter()
            sampled = self.scheduler.prefill_done(plan.prefill)     # None: a dropped chunk's row
        elif plan.decode:
            logits = self._run_decode(plan.decode)
            token_ids = self._tokens(self._launch_tokens(logits))
            self.scheduler.decode_done(plan.decode)
            sampled = plan.decode
        else:
            return []
        now_s = time.perf_counter()
        if prefill_sample and self.connector is not None:
            # The forward's time, sampling included: what the connector's cost model prices recompute by.
            self.connector.report_prefill(sum(chunk.num_tokens for chunk in plan.prefill), now_s - started)
        finished = []
        for i, (request, token_id) in enumerate(zip(sampled, token_ids, strict=True)):
            if request is None:
                continue
            if self.config.keep_logits:
                request.logits.append(logits[i].cpu())
            if self.scheduler.append_token(request, token_id, now_s):
                del self._requests[request.request_id]
                finished.append(request)
        self.scheduler.save_due()          # the saves left, once the first tokens are out
        if plan.prefill:
            self.prefill_timings.append(PrefillTiming(
                None if last_s is None else forward_started_s - last_s,
                None if last_event is None else last_event.elapsed_time(forward_started) / 1e3,
                started - scheduled, self.scheduler.schedule_poll_s, launched_s - started,
                saved_s - launched_s, tokens_s - saved_s,
                time.perf_counter() - tokens_s,
                None if forward_started is None else forward_started.elapsed_time(tokens[1]) / 1e3,
                len(plan.prefill), sum(chunk.first_token > 0 for chunk in plan.prefill), len(loading),
                sum(chunk.num_tokens for chunk in plan.prefill), sum(request.load.transfer_s for request in loading)))
        return finished

    def _record_event(self) -> torch.cuda.Event | None:
        """A timing event recorded on the current stream now (None on CPU)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _launch_tokens(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Queue the step's greedy tokens and, on CUDA, their copy into pinned host memory; the
        event after it (None on CPU, where they are there on return)."""
        token_ids = logits.argmax(-1)
        if self.device.type != "cuda":
            return token_ids, None
        host = self._host_tokens[: token_ids.shape[0]]     # the last step's tokens are read already
        host.copy_(token_ids, non_blocking=True)
        return host, self._record_event()

    def _tokens(self, launched: tuple[torch.Tensor, torch.cuda.Event | None]) -> list[int]:
        """The step's greedy tokens (``_launch_tokens``), once the GPU is done with them. Meanwhile the connector's
        replies come in and the copies they allow are queued (their host work hidden under the
        GPU's), waiting requests whose lookup replies are in are admitted (their loads go out),
        and loads done are seen a step sooner. The host polls until the GPU is done, so that what
        a reply allows (a load's copies, a save's) is queued within this step rather than at the
        start of the next (where it would hold up that step's batch); first it hashes the running
        requests' prompt blocks that admission left unhashed."""
        token_ids, copied = launched
        scheduler = self.scheduler
        scheduler.poll_connector()
        scheduler.admit_during_step()
        if copied is not None:
            if scheduler.connector is not None:
                scheduler.hash_ahead()
                while not copied.query():
                    scheduler.poll_connector()
                    scheduler.admit_during_step()
            copied.synchronize()
        self._last_tokens = (time.perf_counter(), copied)
        return token_ids.tolist()

    def close(self, timeout_s: float = 30.0) -> None:
        """Abort every request (their pending loads are cancelled), step until the connector no
        longer holds any of their blocks (TimeoutError after timeout_s), then take the connector
        out and close it."""
        for request_id in list(self._requests):
            self.abort(request_id)
        deadline = time.monotonic() + timeout_s
        while self.has_unfinished():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the connector still holds blocks of {len(self.scheduler.held_block_ids)} "
                                   f"requests after {timeout_s} s")
            self.step()
        connector, self.scheduler.connector = self.scheduler.connector, None
        if connector is not None and hasattr(connector, "close"):
            connector.close()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 1) -> list[Request]:
        """Run prompts together to the end; the requests in prompt order."""
        requests = [self.add_request(p, max_new_tokens) for p in prompts]
        while self.has_unfinished():
            self.step()
        return requests

    # ---- the prefix cache ----------------------------------------------------------------------------

    def cached_block_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The blocks of the prefix cache that hold the leading full blocks of token_ids (for
        reading their KV in ``kv_caches``). Changes nothing."""
        num_blocks = len(token_ids) // self.block_size
        return self.scheduler.blocks.match(block_hashes(list(token_ids), self.block_size, num_blocks))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds; returns how many."""
        return self.scheduler.blocks.evict_all()

    # ---- the model --------------------------------------------------------------------------------

    def _run_prefill(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """The chunks' tokens in one forward; logits of the last token of each chunk that ends its
        request's prompt, in chunk order."""
        input_ids, positions, slots, seqs, logits_rows = [], [], [], [], []
        start = 0
        for request, num_tokens, first in chunks:
            token_positions = np.arange(first, first + num_tokens)
            block_ids = np.asarray(request.block_ids, dtype=np.int64)
            input_ids.append(np.asarray(request.token_ids[first: first + num_tokens]))
            positions.append(token_positions)
            slots.append(block_ids[token_positions // self.block_size] * self.block_size
                         + token_positions % self.block_size)
            block_table = None
            if first:
                block_table = self._to_device(block_ids.astype(np.int32))
            paged = bool(first) and self.decode_backend == "triton" and num_tokens <= PAGED_PREFILL_MAX_ROWS
            seqs.append(PrefillSeq(start, num_tokens, first, block_table, paged))
            start += num_tokens
            if first + num_tokens == len(request.token_ids):
                logits_rows.append(start - 1)
        loads_in_flight = self.scheduler.loads_in_flight(chunks)
        wait_for_layer = None
        if loads_in_flight:
            def wait_for_layer(layer: int) -> None:
                self.connector.wait_for_layer_load(layer, None, loads_in_flight)
        paged = PagedPrefill(seqs) if any(seq.paged for seq in seqs) else None
        return self.model(self._int64(input_ids), self._int64(positions), self.kv_caches, self._int64(slots),
                          PrefillBatch(seqs, wait_for_layer, paged), self._int64([logits_rows]))

    def _run_decode(self, requests: list[Request]) -> torch.Tensor:
        """The last token of each request in one forward; their logits in order."""
        positions = np.array([len(r.token_ids) - 1 for r in requests], dtype=np.int64)
        block_tables = np.zeros((len(requests), max(len(r.block_ids) for r in requests)), dtype=np.int32)
        for i, request in enumerate(requests):
            block_tables[i, : len(request.block_ids)] = request.block_ids
        slots = block_tables[np.arange(len(requests)), positions // self.block_size].astype(np.int64) \
            * self.block_size + positions % self.block_size
        batch = DecodeBatch(self._to_device(block_tables), self._to_device((positions + 1).astype(np.int32)),
                            self.decode_backend)
        return self.model(self._int64([[r.token_ids[-1] for r in requests]]), self._int64([positions]),
                          self.kv_caches, self._int64([slots]), batch, self._int64([np.arange(len(requests))]))

    def _int64(self, parts) -> torch.Tensor:
        return self._to_device(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A step's input on the device. On CUDA through pinned memory (torch's caching host
        allocator), copied without a host wait: a copy from pageable memory makes the host wait
        for the copy engine, which a save's DMA to L2 may hold."""
        host = torch.from_numpy(array)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)
