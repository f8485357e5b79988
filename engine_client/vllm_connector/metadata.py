"""What the scheduler tells the worker each step (``KVCachedMetadata``, carried in vLLM's scheduler
output): the two sides never share memory."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


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
