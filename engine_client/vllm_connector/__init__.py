"""kvcached inside vLLM: a ``KVConnectorBase_V1`` on top of ``engine_client.connector``.

    LLM(model, kv_transfer_config={
        "kv_connector": "KVCachedConnector", "kv_connector_module_path": "engine_client.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/user/1000/kvcached/kvcached.sock"}})

vLLM makes two objects of this class: one in the scheduler (role SCHEDULER), one per worker (role
WORKER). They never share memory; the scheduler tells the worker what to do through the step's
metadata (``KVCachedMetadata``), the worker answers through ``get_finished`` and the failed blocks.
This class only hands vLLM's calls to its side; one module per concern:

  config      ``kv_connector_extra_config`` and the namespace of a rank's pages
  attach      a side's first attach, retried off the engine's path
  metadata    what the scheduler tells the worker each step
  scheduler   the scheduler's side: lookups, and the step's loads and saves
  worker      the worker's side: loads and saves into vLLM's blocks, the forward's timing
  stats       kvcached's counters as vLLM connector stats and Prometheus counters

A failed load never fails a request: its blocks are reported and vLLM recomputes them. That needs
``kv_load_failure_policy="recompute"``; vLLM's default, "fail", would fail the request, so the
scheduler side switches it to "recompute" (with a warning) when it is left at the default.

The daemon being away costs a request the miss and nothing else: lookups answer 0, loads are
reported failed, saves are dropped (counted). Each side's client re-attaches by itself once the
daemon answers again (its heartbeat thread; the engine connector follows it to the new session's
pool), so no lookup or step is needed for a session to come back; a restarted daemon starts with
an empty L2, L3 survives. With no daemon at start-up, a thread of our own tries to attach every
``retry_interval_s`` until one answers. Requests with a LoRA adapter or a per-request cache salt
are left out (each would need a namespace of its own).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engine_client.vllm_connector.config import VLLMConnectorConfig, cpu_reservation_note
from engine_client.vllm_connector.metadata import KVCachedMetadata
from engine_client.vllm_connector.scheduler import SchedulerSide
from engine_client.vllm_connector.stats import KVCachedPromMetrics, KVCachedStats
from engine_client.vllm_connector.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KVCachedConnector(KVConnectorBase_V1):
    """kvcached as vLLM's KV connector; see the module note."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = VLLMConnectorConfig.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config))
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.warning("kvcached: kv_load_failure_policy=%r would fail requests whose KV could not be "
                               "loaded; using 'recompute' (set it in kv_transfer_config to silence this)",
                               self._kv_transfer_config.kv_load_failure_policy)
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, config)
            from vllm.platforms import current_platform

            note = cpu_reservation_note(current_platform.is_cpu(), vllm_config.parallel_config.local_world_size,
                                        dict(os.environ))
            if note:
                logger.warning(note)
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False          # a save that does not happen is a later miss, nothing more

    # ---- scheduler ----

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request), None

    # ---- worker ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVCachedMetadata):
            # vLLM binds just before the forward: the loads go first, then the forward is timed.
            self._worker.start_loads(connector_metadata)
            self._worker.forward_starts(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVCachedMetadata)
        self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return                  # the loads were sent as the metadata was bound (WorkerSide.start_loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._connector_metadata if isinstance(self._connector_metadata, KVCachedMetadata) else None
        return self._worker.get_finished(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks()

    # ---- both ----

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler or self._worker
        return side.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVCachedStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVCachedPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        side = self._scheduler or self._worker
        side.close()
