"""kvcached inside vLLM: a ``KVConnectorBase_V1`` on top of ``engine_client.connector``.

    LLM(model, kv_transfer_config={
        "kv_connector": "KVCachedConnector", "kv_connector_module_path": "engine_client.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/user/1000/kvcached/kvcached.sock"}})

vLLM makes two objects of this class: one in the scheduler (role SCHEDULER), one per worker (role
WORKER). They never share memory; the scheduler tells the worker what to do through the step's
metadata (``KVCachedMetadata``), the worker answers through ``get_finished`` and the failed blocks.

Scheduler, per request:
  get_num_new_matched_tokens   a side-effect-free lookup (``PrefixLookup``) of the prompt less its
                               last token; the first call sends it and answers None ("ask again")
                               until the reply is in, so the scheduler never waits on the daemon.
                               Hits are loaded asynchronously: (n, True).
  update_state_after_alloc     a load of [local hit, local hit + n) into the request's blocks.
  build_connector_meta         the step's loads; the saves of the prompt's pages the step fills; the
                               requests finished or preempted since the last step; the step's
                               tokens where it computes only prompts from their first token.
  request_finished             True (keep the blocks) while a load is in flight or once a save was
                               asked for: the worker reports the request when its transfers are done.
Worker, per step:
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

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engine_client.client import DaemonError, DaemonUnavailable, KVCacheClient
from engine_client.connector import ConnectorConfig, KVConnector, PendingLookup, PrefixLookup
from engine_client.dtypes import dtype_name
from proto import counters
from proto.messages import KVGeometry
from proto.paths import default_socket_path
from proto.tokens import page_aligned, token_array

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


# ---- configuration and namespace ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VLLMConnectorConfig:
    """``kv_connector_extra_config`` keys (all optional)."""

    socket: str = ""                  # the daemon's socket ("": the per-user default)
    cache_salt: str = ""              # keeps this engine's pages apart from others' of the same model
    save: bool = True                 # save prompts' pages (False: only load)
    lookup_timeout_s: float = 1.0     # a lookup unanswered this long is a miss (then none is sent
                                  # until the daemon answers a heartbeat again)
    lookup_wait_s: float = 0.002      # the scheduler waits this long, once, for a lookup's reply (then
                                  # the request is scheduled in this step, not the next); 0: never
    reply_timeout_s: float = 5.0      # a load's or save's match unanswered this long: failed / skipped
    retry_interval_s: float = 1.0     # how often a side with no daemon at start-up tries to attach
    client_timeout_s: float = 2.0     # attach and detach
    policy: str = ""                  # restore policy: "cost", "always", "never" ("": the daemon's)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "VLLMConnectorConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(extra) - names
        if unknown:
            raise ValueError(f"unknown kvcached kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(names)}")
        return cls(**extra)

    def __post_init__(self) -> None:
        def number(value) -> bool:          # (a bool is an int to Python, not a timing to a user)
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        for name in ("lookup_timeout_s", "reply_timeout_s", "retry_interval_s", "client_timeout_s"):
            value = getattr(self, name)
            if not number(value) or not value > 0:
                raise ValueError(f"kvcached kv_connector_extra_config {name} must be a positive number, got {value!r}")
        if not number(self.lookup_wait_s) or not 0 <= self.lookup_wait_s < self.lookup_timeout_s:
            raise ValueError(f"kvcached kv_connector_extra_config lookup_wait_s must be >= 0 and below "
                             f"lookup_timeout_s ({self.lookup_timeout_s}), got {self.lookup_wait_s!r}")

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path()


def _attention_spec(kv_cache_config: "KVCacheConfig"):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        raise ValueError("kvcached's vLLM connector supports models with one group of full-attention layers, got "
                         f"{[type(g.kv_cache_spec).__name__ for g in groups]}")
    return groups[0]


def namespace_geometry(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", tp_rank: int,
                       cache_salt: str = "") -> KVGeometry:
    """The namespace of one rank's pages, from vLLM's configuration alone (the scheduler holds no
    tensors): the model and its revision, the per-rank KV shape, and the page format "blocks" with
    the block's byte shape in memory order as vLLM's KV cache layout puts it ([H, N, C] for the
    identity layout LBHNC, C = K and V of a token packed). The worker checks that its tensors have
    exactly this shape. The layout's name goes into the salt: blocks of equal shape but another
    order never share pages."""
    group = _attention_spec(kv_cache_config)
    spec = group.kv_cache_spec
    layout = kv_cache_config.kv_cache_layout or "LBHNC"
    sizes = {"H": spec.num_heads, "N": spec.block_size, "C": spec.state_content_size_bytes}
    order = [d for d in layout if d in sizes]
    if sorted(order) != ["C", "H", "N"] or order[-1] != "C":
        raise ValueError(f"kvcached cannot describe vLLM's KV cache layout {layout!r}")
    block_shape = tuple(sizes[d] for d in order if sizes[d] != 1 or d == "C")
    model = vllm_config.model_config
    salt = f"vllm-{layout}" + (f":{cache_salt}" if cache_salt else "")
    return KVGeometry(str(model.model)[-256:], num_layers=len(group.layer_names), num_kv_heads=spec.num_kv_heads,
                      head_dim=spec.head_size, dtype=dtype_name(spec.dtype),
                      page_size=spec.block_size, tp_rank=tp_rank, tp_size=vllm_config.parallel_config.tensor_parallel_size,
                      layout="blocks", block_shape=block_shape, model_revision=str(model.revision or ""),
                      cache_salt=salt)


def cpu_reservation_note(is_cpu: bool, local_world_size: int, environ: dict[str, str]) -> str | None:
    """What to tell a vLLM-CPU user whose instance reserves CPUs for this connector; None where
    nothing is. vLLM-CPU reserves one CPU per local rank for its engine core, and once any KV
    connector is configured one more per rank (for a connector's transfer threads), unless
    VLLM_CPU_NUM_OF_RESERVED_CPU says how many. This connector needs none: its threads wait on
    sockets and, on CPU, its copies run in the worker's own step. So each rank loses a core to
    it, and on a host with no core to spare vLLM cannot reserve them: its OpenMP threads take
    every core, beside the engine core's loop, and forwards slow down under any other load (two
    instances sharing system prompts, each with this connector, then ran slower than two plain
    ones)."""
    if not is_cpu or "VLLM_CPU_NUM_OF_RESERVED_CPU" in environ:
        return None
    return (f"kvcached: vLLM-CPU reserves {local_world_size} more CPU(s) for any KV connector; kvcached's needs "
            f"none: set VLLM_CPU_NUM_OF_RESERVED_CPU={local_world_size} (what vLLM reserves without a connector) "
            f"to give this instance plain vLLM's threads")


# ---- the first attach ---------------------------------------------------------------------------

_T = TypeVar("_T")


class _Attacher(Generic[_T]):
    """A side's session, attached once: ``attach()`` is tried at once; while it fails for want of
    a daemon, a thread of our own tries again every retry_interval_s, never on the engine's path.
    ``result`` is None until then. Once attached, the client re-attaches by itself after outages."""

    def __init__(self, what: str, attach: Callable[[], _T], close: Callable[[_T], None], retry_interval_s: float):
        self.what = what
        self.result: _T | None = None
        self._attach = attach
        self._close = close
        self._retry_interval_s = retry_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not self._try(first=True):
            self._thread = threading.Thread(target=self._retry, name="kvcached-attach", daemon=True)
            self._thread.start()

    def _try(self, first: bool = False) -> bool:
        try:
            result = self._attach()
        except (DaemonUnavailable, DaemonError) as exc:
            if first:
                logger.warning("kvcached: %s could not attach (%s); running without it until the daemon answers",
                               self.what, exc)
            return False
        if self._stop.is_set():             # closed meanwhile
            self._close(result)
            return True
        if not first:
            logger.info("kvcached: %s is attached", self.what)
        self.result = result
        return True

    def _retry(self) -> None:
        while not self._stop.wait(self._retry_interval_s):
            if self._try():
                return

    def close(self, timeout_s: float) -> _T | None:
        """Stop trying (waiting at most timeout_s for an attempt under way); what was attached."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.result


def open_lookups(config: VLLMConnectorConfig, geometry: KVGeometry) -> PrefixLookup:
    """The scheduler's session: a client attached with rank 0's namespace, its lookups for the
    whole TP group. The client keeps it: after an outage it re-attaches by itself."""
    client = KVCacheClient(config.socket_path, timeout_s=config.client_timeout_s, client_name="vllm-scheduler")
    try:
        client.attach(geometry)
    except BaseException:
        client.close()
        raise
    return PrefixLookup(client, tp_group=geometry.tp_size > 1, policy=config.policy)


# ---- metrics ------------------------------------------------------------------------------------

# kvcached's counters (the connector's, the lookups') as vLLM connector stats, each a Prometheus
# counter "vllm:kvcached_<name>_total" per engine.
METRICS = {
    "lookup_tokens": "prompt tokens asked about (the scheduler's lookups)",
    "lookup_hit_tokens": "tokens kvcached offered the scheduler (its decision: the prefix to hold, vLLM's own hit in)",
    "lookup_failures": "lookups not answered (daemon away or late): counted as misses",
    "loaded_tokens": "tokens loaded from kvcached into vLLM's blocks",
    "load_failed_tokens": "tokens whose load failed: recomputed by vLLM",
    "saved_tokens": "tokens saved into kvcached's L2",
    "save_skipped_tokens": "tokens a save could not write (no space, daemon away, ...)",
    "reattaches": "sessions attached again after the daemon was away",
}


@dataclasses.dataclass
class KVCachedStats(KVConnectorStats):
    """Counter increments since the last report; ``data`` is {name: int} (it crosses processes)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVCachedPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, documentation in METRICS.items():
            counter = self._counter_cls(name=f"vllm:kvcached_{name}", documentation=f"kvcached: {documentation}",
                                        labelnames=labelnames)
            for engine_idx, labelvalues in per_engine_labelvalues.items():
                self._counters[(engine_idx, name)] = counter.labels(*labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self._counters.get((engine_idx, name))
            if counter is not None and value:
                counter.inc(value)


class _Counts:
    """Counters of one side, reported as increments."""

    def __init__(self):
        self.total: collections.Counter[str] = collections.Counter()
        self._reported: collections.Counter[str] = collections.Counter()

    def take(self) -> KVCachedStats | None:
        delta = {name: self.total[name] - self._reported[name] for name in self.total
                 if self.total[name] != self._reported[name]}
        if not delta:
            return None
        self._reported = collections.Counter(self.total)
        return KVCachedStats(data=delta)


# ---- scheduler -> worker ------------------------------------------------------------------------


@dataclasses.dataclass
class LoadOp:
    req_id: str
    token_ids: list[int]          # the prompt's whole pages: what the request's lease covers
    block_ids: list[int]          # block of page start_token // page_size + i
    start_token: int
    num_tokens: int


@dataclasses.dataclass
class SaveOp:
    req_id: str
    token_ids: list[int]          # the prompt's whole pages
    block_ids: list[int]          # block of page start_token // page_size + i
    start_token: int
    end_token: int                # the pages [start_token, end_token) are computed after this step


@dataclasses.dataclass
class KVCachedMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = dataclasses.field(default_factory=list)
    saves: list[SaveOp] = dataclasses.field(default_factory=list)
    finished_held: list[str] = dataclasses.field(default_factory=list)   # report in finished_sending
    finished_freed: list[str] = dataclasses.field(default_factory=list)  # blocks freed already
    preempted: list[str] = dataclasses.field(default_factory=list)       # blocks freed: saves must end now
    prefill_tokens: int = 0       # the step computes only prompts from their first token, this many: time it


def whole_prompt_tokens(scheduler_output: "SchedulerOutput") -> int:
    """The tokens a step computes when it computes nothing but prompts from their first token (no
    decode, no later chunk, no prefix-cache hit, no loaded tokens in it); 0 for any other step.
    Only such a forward is a prefill sample: one on top of cached or loaded tokens also reads
    their KV, and a decode's token costs more than a prompt's (docs/architecture.md, the cost model)."""
    new = scheduler_output.scheduled_new_reqs
    if not new or scheduler_output.scheduled_cached_reqs.num_reqs or any(r.num_computed_tokens for r in new):
        return 0
    return scheduler_output.total_num_scheduled_tokens


# ---- the scheduler's side -----------------------------------------------------------------------


@dataclasses.dataclass
class _Asked:
    pending: PendingLookup | None
    sent_at: float
    hit_tokens: int | None = None


@dataclasses.dataclass
class _Tracked:
    request: "Request"
    lease_tokens: list[int]
    saved_end: int = 0            # the prompt's pages up to here were asked to be saved
    saves_sent: bool = False


class _SchedulerSide:
    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", config: VLLMConnectorConfig):
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        self.geometry = namespace_geometry(vllm_config, kv_cache_config, 0, config.cache_salt)
        self.counts = _Counts()
        self._asked: dict[str, _Asked] = {}
        self._external: dict[str, int] = {}           # req id -> the local hit its lookup was for
        self._tracked: dict[str, _Tracked] = {}
        self._loading: set[str] = set()               # loads sent, finished_recving not seen yet
        self._load_blocks: dict[str, set[int]] = {}   # req id -> blocks of its load in flight
        self._load_failed: set[str] = set()           # requests whose load failed: recomputed
        self._pending_loads: list[LoadOp] = []
        self._finished_held: list[str] = []
        self._finished_freed: list[str] = []
        self._suspect_since: float | None = None      # when a lookup last went unanswered
        self._waits_this_step = True                  # until one lookup_wait_s runs out in a step
        self._attacher = _Attacher("the scheduler's lookups", lambda: open_lookups(config, self.geometry),
                                   lambda lookups: lookups.client.close(), config.retry_interval_s)

    # -- the session

    @property
    def lookups(self) -> PrefixLookup | None:
        return self._attacher.result

    def _live_lookups(self) -> PrefixLookup | None:
        """The lookups while worth sending: None before the first attach, and, after a lookup went
        unanswered, until the daemon has answered since (a heartbeat). While the client knows the
        daemon is down they answer 0 at once; it re-attaches by itself, off this path."""
        lookups = self.lookups
        if lookups is None:
            return None
        client = lookups.client
        if self._suspect_since is not None and client.is_attached():
            confirmed_at = time.monotonic() + client.session_valid_for() - client.info.session_timeout_s
            if confirmed_at <= self._suspect_since:
                return None
        self._suspect_since = None
        return lookups

    # -- vLLM's calls

    @staticmethod
    def _cacheable(request: "Request") -> bool:
        """A request with a LoRA adapter or a cache salt of its own belongs to another namespace."""
        return request.lora_request is None and not getattr(request, "cache_salt", None) \
            and bool(request.prompt_token_ids)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._cacheable(request) or request.request_id in self._load_failed:
            return 0, False     # a request whose load failed is recomputed, not loaded again
        hit = self._hit_tokens(request, num_computed_tokens)
        if hit is None:
            return None, False
        self._external[request.request_id] = num_computed_tokens
        num_new = hit - num_computed_tokens
        return (num_new, True) if num_new > 0 else (0, False)

    def _hit_tokens(self, request: "Request", num_computed_tokens: int) -> int | None:
        """The prefix of the request's tokens less the last (which vLLM always computes) to hold
        once restored, whole pages, by the daemon's decision for what lies beyond the
        num_computed_tokens vLLM holds; None while the lookup's reply is on its way."""
        req_id = request.request_id
        asked = self._asked.get(req_id)
        now = time.monotonic()
        if asked is not None and asked.hit_tokens is not None and now - asked.sent_at > self.config.lookup_timeout_s:
            asked = None                      # an old answer: ask again
        wait_s = 0.0
        if asked is None:
            # Waited for once; not at all for the rest of a step in which one reply was not in time
            # (a slow daemon costs a step one lookup_wait_s, not one per request).
            wait_s = self.config.lookup_wait_s if self._waits_this_step else 0.0
            tokens = request.all_token_ids[: request.num_tokens - 1]
            tokens = tokens[: page_aligned(len(tokens), self.block_size)]
            self.counts.total["lookup_tokens"] += len(tokens)
            lookups = self._live_lookups() if tokens else None
            if lookups is None:
                self._asked[req_id] = _Asked(None, now, 0)
                return 0
            asked = self._asked[req_id] = _Asked(
                lookups.lookup_async(token_array(tokens), num_computed_tokens), now)
        if asked.hit_tokens is None:
            failures = self._lookup_failures()
            if asked.pending.wait(wait_s):          # the lookup just sent: its reply, briefly waited for
                asked.hit_tokens = asked.pending.result()
            elif wait_s:
                self._waits_this_step = False
                return None
            elif now - asked.sent_at > self.config.lookup_timeout_s:
                asked.hit_tokens = asked.pending.result(0.0)      # 0, counted by the lookups
                self._suspect_since = now
            else:
                return None
            self.counts.total["lookup_failures"] += self._lookup_failures() - failures
            self.counts.total["lookup_hit_tokens"] += asked.hit_tokens
        return asked.hit_tokens

    def _lookup_failures(self) -> int:
        counts = self.lookups.counters
        return sum(counts.value(counters.ENGINE_LOOKUP_FAILURES, cause)
                   for cause in ("daemon_down", "unavailable", "refused"))

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        req_id = request.request_id
        self._asked.pop(req_id, None)
        local = self._external.pop(req_id, None)
        if not self._cacheable(request):
            return
        tracked = self._track(request)
        if num_external_tokens <= 0 or local is None:
            return
        assert local % self.block_size == 0 and num_external_tokens % self.block_size == 0, \
            (local, num_external_tokens)
        (block_ids,) = blocks.get_block_ids()
        first = local // self.block_size
        load = LoadOp(req_id, tracked.lease_tokens, list(block_ids[first: first + num_external_tokens // self.block_size]),
                      local, num_external_tokens)
        self._pending_loads.append(load)
        self._loading.add(req_id)
        self._load_blocks[req_id] = set(load.block_ids)

    def _track(self, request: "Request") -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            prompt = list(request.prompt_token_ids or [])
            tracked = self._tracked[request.request_id] = _Tracked(
                request, prompt[: page_aligned(len(prompt), self.block_size)])
        return tracked

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVCachedMetadata:
        self._waits_this_step = True          # the step is scheduled: the next one may wait again
        meta = KVCachedMetadata(loads=self._pending_loads, finished_held=self._finished_held,
                                finished_freed=self._finished_freed)
        self._pending_loads, self._finished_held, self._finished_freed = [], [], []
        meta.prefill_tokens = whole_prompt_tokens(scheduler_output)
        for req_id in scheduler_output.preempted_req_ids or ():
            meta.preempted.append(req_id)
            tracked = self._tracked.get(req_id)
            if tracked is not None:           # recomputed from 0 (or loaded) when it comes back
                tracked.saved_end = 0
        block_state = scheduler_output.kv_connector_block_state
        if not self.config.save or block_state is None:
            return meta
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or req_id in self._loading:
                continue
            computed_end = min(tracked.request.num_computed_tokens + num_scheduled, len(tracked.lease_tokens))
            end = page_aligned(computed_end, self.block_size)
            if end <= tracked.saved_end:
                continue
            block_ids = block_state.get_block_ids(req_id)
            if block_ids is None:
                continue
            first_page, end_page = tracked.saved_end // self.block_size, end // self.block_size
            meta.saves.append(SaveOp(req_id, tracked.lease_tokens, list(block_ids[0][first_page:end_page]),
                                     tracked.saved_end, end))
            tracked.saved_end = end
            tracked.saves_sent = True
        return meta

    def update_connector_output(self, connector_output) -> None:
        invalid = connector_output.invalid_block_ids or set()
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)
            if invalid & self._load_blocks.pop(req_id, set()):
                # vLLM recomputes what failed; a lookup would offer the same pages again, and
                # their load would fail again (the cause, say no L2 page to promote into, lasts).
                self._load_failed.add(req_id)

    def request_finished(self, request: "Request") -> bool:
        """True: vLLM keeps the blocks until the worker reports the request (finished_recving for a
        load in flight, finished_sending once the saves are done)."""
        req_id = request.request_id
        self._asked.pop(req_id, None)
        self._external.pop(req_id, None)
        tracked = self._tracked.pop(req_id, None)
        self._load_failed.discard(req_id)
        if req_id in self._loading:
            # vLLM frees the blocks when the load is reported (finished_recving); the worker ends
            # the request's lease then.
            self._finished_freed.append(req_id)
            return True
        if tracked is not None and tracked.saves_sent:
            self._finished_held.append(req_id)
            return True
        self._finished_freed.append(req_id)
        return False

    def stats(self) -> KVCachedStats | None:
        if self.lookups is not None:
            self.counts.total["reattaches"] = self.lookups.client.generation - 1
        return self.counts.take()

    def close(self) -> None:
        lookups = self._attacher.close(self.config.client_timeout_s)
        if lookups is not None:
            lookups.client.close()


# ---- the worker's side --------------------------------------------------------------------------


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


class _WorkerSide:
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
        self._attacher: _Attacher[KVConnector] | None = None
        self.counts = _Counts()
        self._reported = collections.Counter()        # the connector's counters already counted
        self._loading: dict[str, list[int]] = {}       # req id -> blocks of its load, not reported yet
        self._held: set[str] = set()                   # finished, to report once released
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_blocks: set[int] = set()

    # -- the session

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = _attention_spec(self.kv_cache_config).layer_names
        missing = [name for name in names if name not in kv_caches]
        if missing:
            raise ValueError(f"kvcached: vLLM registered no KV tensor for layers {missing}")
        self.kv_caches = [kv_caches[name] for name in names]
        self.forward_timer = ForwardTimer(self.kv_caches[0].device)
        if self.kv_caches[0].shape[0] != self.kv_cache_config.num_blocks:
            raise ValueError(f"kvcached: the KV tensors hold {self.kv_caches[0].shape[0]} blocks (kernel blocks "
                             f"smaller than vLLM's blocks?), vLLM schedules {self.kv_cache_config.num_blocks}")
        self._attacher = _Attacher("the worker", self._register, lambda connector: connector.close(),
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


# ---- the class vLLM loads -----------------------------------------------------------------------


class KVCachedConnector(KVConnectorBase_V1):
    """kvcached as vLLM's KV connector; see the module note."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = VLLMConnectorConfig.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config))
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.warning("kvcached: kv_load_failure_policy=%r would fail requests whose KV could not be "
                               "loaded; using 'recompute' (set it in kv_transfer_config to silence this)",
                               self._kv_transfer_config.kv_load_failure_policy)
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self._scheduler = _SchedulerSide(vllm_config, kv_cache_config, config)
            from vllm.platforms import current_platform

            note = cpu_reservation_note(current_platform.is_cpu(), vllm_config.parallel_config.local_world_size,
                                        dict(os.environ))
            if note:
                logger.warning(note)
        else:
            self._worker = _WorkerSide(vllm_config, kv_cache_config, config)

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
        return                  # the loads were sent as the metadata was bound (_WorkerSide.start_loads)

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
