"""The scheduler's side of the vLLM connector. Its process holds no KV tensors: it looks prompts up
and tells the worker, through the step's metadata, what to load and save. Per request:

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
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from engine_client.client import KVCacheClient
from engine_client.connector import PendingLookup, PrefixLookup
from engine_client.vllm_connector.attach import Attacher
from engine_client.vllm_connector.config import VLLMConnectorConfig, namespace_geometry
from engine_client.vllm_connector.metadata import KVCachedMetadata, LoadOp, SaveOp, whole_prompt_tokens
from engine_client.vllm_connector.stats import Counts, KVCachedStats
from proto import counters
from proto.messages import KVGeometry
from proto.tokens import page_aligned, token_array

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


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


class SchedulerSide:
    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", config: VLLMConnectorConfig):
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        self.geometry = namespace_geometry(vllm_config, kv_cache_config, 0, config.cache_salt)
        self.counts = Counts()
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
        self._attacher = Attacher("the scheduler's lookups", lambda: open_lookups(config, self.geometry),
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
