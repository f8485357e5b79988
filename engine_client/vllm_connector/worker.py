"""The worker's side of the vLLM connector: it holds vLLM's KV tensors and does what the step's
metadata says. Per step:

  register_kv_caches           vLLM's own per-layer tensors, as opaque blocks ("blocks" layout: the
                               CPU attention kernel packs K and V inside a block); the page format and
                               the block's byte shape are part of the namespace.
  bind_connector_metadata      (just before the forward) the step's loads, asynchronous
                               (``KVConnector.load``): their replies come in during the forward, so
                               that get_finished, right after it, can report them done. A step marked
                               with prompt tokens is timed (``ForwardTimer``) up to wait_for_save: a
                               prefill sample for the daemon's cost model, sent with get_finished's
                               report, so that its restore decisions follow this engine's prefill.
  start_load_kv                nothing: the loads were sent at the binding.
  wait_for_layer_load          nothing to wait for: loads are asynchronous, reported by get_finished.
  save_kv_layer                nothing per layer: whole blocks are saved after the forward pass.
  wait_for_save                the step's saves, queued (``KVConnector.save``); never waited for.
  get_finished                 loads done (finished_recving; failed blocks through
                               get_block_ids_with_load_errors, recomputed by vLLM) and finished
                               requests whose saves are done (finished_sending).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from engine_client.client import KVCacheClient
from engine_client.connector import ConnectorConfig, KVConnector
from engine_client.vllm_connector.attach import Attacher
from engine_client.vllm_connector.config import VLLMConnectorConfig, attention_group, namespace_geometry
from engine_client.vllm_connector.metadata import KVCachedMetadata
from engine_client.vllm_connector.stats import Counts, KVCachedStats
from proto import counters
from proto.tokens import token_array

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


class ForwardTimer:
    """The forward's time of each step the scheduler marked (``KVCachedMetadata.prefill_tokens``):
    from the metadata's binding (vLLM binds it just before the forward; the step's loads are sent
    first) to ``wait_for_save`` (just after it). On CPU the forward runs on the host: host time. On a GPU the forward is
    only launched by then: events on the current stream, read once the end one is done, never
    waited for. ``take()`` gives the (tokens, seconds) samples finished since the last call."""

    def __init__(self, device: torch.device):
        self.on_gpu = device.type == "cuda"
        self._step: tuple[int, float, Any] | None = None     # (tokens, host start, start event)
        self._in_flight: collections.deque = collections.deque()   # (tokens, start event, end event)
        self._done: list[tuple[int, float]] = []

    def started(self, num_tokens: int) -> None:
        self._step = None
        if num_tokens > 0:
            event = None
            if self.on_gpu:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
            self._step = (num_tokens, time.perf_counter(), event)

    def ended(self) -> None:
        if self._step is None:
            return
        num_tokens, started_s, start_event = self._step
        self._step = None
        if start_event is None:
            self._done.append((num_tokens, time.perf_counter() - started_s))
            return
        end_event = torch.cuda.Event(enable_timing=True)
        end_event.record()
        self._in_flight.append((num_tokens, start_event, end_event))

    def take(self) -> list[tuple[int, float]]:
        while self._in_flight and self._in_flight[0][2].query():
            num_tokens, start_event, end_event = self._in_flight.popleft()
            self._done.append((num_tokens, start_event.elapsed_time(end_event) / 1000.0))
        done, self._done = self._done, []
        return done


class WorkerSide:
    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", config: VLLMConnectorConfig):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.config = config
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = vllm_config.cache_config.block_size
        self.geometry = namespace_geometry(vllm_config, kv_cache_config, get_tensor_model_parallel_rank(),
                                           config.cache_salt)
        self.connector_config = ConnectorConfig(save=config.save, reply_timeout_s=config.reply_timeout_s,
                                                policy=config.policy)
        self.kv_caches: list[torch.Tensor] | None = None
        self.forward_timer: ForwardTimer | None = None
        self._loads_sent_for: KVCachedMetadata | None = None
        self._attacher: Attacher[KVConnector] | None = None
        self.counts = Counts()
        self._reported = collections.Counter()        # the connector's counters already counted
        self._loading: dict[str, list[int]] = {}       # req id -> blocks of its load, not reported yet
        self._held: set[str] = set()                   # finished, to report once released
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_blocks: set[int] = set()

    # -- the session

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = attention_group(self.kv_cache_config).layer_names
        missing = [name for name in names if name not in kv_caches]
        if missing:
            raise ValueError(f"kvcached: vLLM registered no KV tensor for layers {missing}")
        self.kv_caches = [kv_caches[name] for name in names]
        self.forward_timer = ForwardTimer(self.kv_caches[0].device)
        if self.kv_caches[0].shape[0] != self.kv_cache_config.num_blocks:
            raise ValueError(f"kvcached: the KV tensors hold {self.kv_caches[0].shape[0]} blocks (kernel blocks "
                             f"smaller than vLLM's blocks?), vLLM schedules {self.kv_cache_config.num_blocks}")
        self._attacher = Attacher("the worker", self._register, lambda connector: connector.close(),
                                   self.config.retry_interval_s)

    def _register(self) -> KVConnector:
        g = self.geometry
        client = KVCacheClient(self.config.socket_path, timeout_s=self.config.client_timeout_s,
                               client_name=f"vllm-worker-{g.tp_rank}")
        try:
            connector = KVConnector.register(
                client, self.kv_caches, "blocks", model_id=g.model_id, page_size=g.page_size,
                num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, dtype=g.dtype, model_revision=g.model_revision,
                cache_salt=g.cache_salt, tp_rank=g.tp_rank, tp_size=g.tp_size, config=self.connector_config)
        except BaseException:
            client.close()
            raise
        if connector.geometry != g:
            connector.close()
            raise ValueError(f"kvcached: vLLM's KV tensors make the namespace {connector.geometry}, its "
                             f"configuration {g}: the scheduler's lookups would ask another namespace")
        return connector

    @property
    def connector(self) -> KVConnector | None:
        """The engine connector once attached (it follows the client's re-attaches itself)."""
        return self._attacher.result if self._attacher is not None else None

    # -- vLLM's calls

    def handle_preemptions(self, meta: KVCachedMetadata) -> None:
        """A preempted request's blocks are free already and are written by this very step: its
        saves not yet started must not read them. Their match's reply is waited for (bounded by
        reply_timeout_s; on CPU the copy itself runs at once), a rare host wait."""
        connector = self.connector
        for req_id in meta.preempted:
            if connector is None or not connector.request_finished(req_id):
                continue
            deadline = time.monotonic() + self.config.reply_timeout_s + 1.0
            while time.monotonic() < deadline:
                finished = connector.finished()
                self._take_loads(finished.loads)
                if req_id in finished.released:
                    break
                self._finished_sending.update(r for r in finished.released if r in self._held)
                self._held.difference_update(finished.released)
                time.sleep(0.001)
            else:
                logger.error("kvcached: a preempted request's save did not end in time")

    def start_loads(self, meta: KVCachedMetadata) -> None:
        """The step's loads, sent as vLLM binds the step's metadata, before the forward: their
        match's reply comes in while the forward runs, and get_finished, right after it, queues
        their copies (on CPU: does them) and reports them done, so that vLLM schedules the
        requests in the next step. Sent after the forward (start_load_kv), the reply was not in
        yet by get_finished, and each restore waited one more step: with other prompts in
        prefill, a whole chunk's forward (the slow latency mode of restores under vLLM)."""
        if meta is self._loads_sent_for:        # bound again (a draft model's forward): sent already
            return
        self._loads_sent_for = meta
        connector = self.connector
        for load in meta.loads:
            if connector is None:
                self._load_failed(load.req_id, load.block_ids)
                continue
            self._loading[load.req_id] = load.block_ids
            connector.load(load.req_id, token_array(load.token_ids), load.block_ids,
                           load.num_tokens, load.start_token)

    def forward_starts(self, meta: KVCachedMetadata) -> None:
        if self.forward_timer is not None:
            self.forward_timer.started(meta.prefill_tokens)

    def wait_for_save(self, meta: KVCachedMetadata) -> None:
        if self.forward_timer is not None:
            self.forward_timer.ended()
        connector = self.connector
        for save in meta.saves:
            if connector is None:
                self.counts.total["save_skipped_tokens"] += save.end_token - save.start_token
                continue
            tokens = token_array(save.token_ids)
            connector.load(save.req_id, tokens, [], 0)        # the request's lease covers the whole prompt
            connector.save(save.req_id, tokens[: save.end_token], save.block_ids, save.start_token)

    def get_finished(self, meta: KVCachedMetadata | None) -> tuple[set[str], set[str]]:
        ended = (meta.finished_held + meta.finished_freed) if meta is not None else []
        for req_id in ended:
            if self.connector is not None and self.connector.request_finished(req_id):
                if req_id in meta.finished_held:
                    self._held.add(req_id)
            elif req_id in meta.finished_held:
                self._finished_sending.add(req_id)
        if self.connector is not None:
            # The step's prefill samples go out with the report that finished() sends.
            for num_tokens, seconds in self.forward_timer.take():
                self.connector.report_prefill(num_tokens, seconds)
            finished = self.connector.finished()
            self._take_loads(finished.loads)
            for req_id in finished.released:
                if req_id in self._held:
                    self._held.discard(req_id)
                    self._finished_sending.add(req_id)
            self._take_counters(self.connector)
        sending, self._finished_sending = self._finished_sending, set()
        recving, self._finished_recving = self._finished_recving, set()
        return sending, recving

    def _take_loads(self, loads) -> None:
        for result in loads:
            block_ids = self._loading.pop(result.request_id, None)
            if block_ids is None:
                continue
            self._finished_recving.add(result.request_id)
            if result.failed_block_ids:
                self._failed_blocks.update(result.failed_block_ids)

    def _load_failed(self, req_id: str, block_ids: list[int]) -> None:
        self._finished_recving.add(req_id)
        self._failed_blocks.update(block_ids)
        self.counts.total["load_failed_tokens"] += len(block_ids) * self.block_size

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _take_counters(self, connector: KVConnector) -> None:
        stats = collections.Counter(connector.stats())
        page = self.block_size
        for ours, theirs in (("loaded_tokens", counters.ENGINE_LOADED_PAGES.key),
                             ("load_failed_tokens", counters.ENGINE_LOAD_FAILED_PAGES_SUM.key),
                             ("saved_tokens", counters.ENGINE_SAVED_PAGES.key),
                             ("save_skipped_tokens", counters.ENGINE_SAVE_SKIPPED_PAGES_SUM.key)):
            self.counts.total[ours] += (stats[theirs] - self._reported[theirs]) * page
        self._reported = stats

    def stats(self) -> KVCachedStats | None:
        if self.connector is not None:
            self.counts.total["reattaches"] = self.connector.client.generation - 1
        return self.counts.take()

    def close(self) -> None:
        connector = self._attacher.close(self.config.client_timeout_s) if self._attacher is not None else None
        if connector is not None:
            connector.close()
