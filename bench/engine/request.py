"""A request and its life cycle.

    WAITING ──admit──▶ LOADING ──load reported──▶ PREFILL ──last chunk──▶ DECODE ──▶ FINISHED
       │   └──admit (nothing to load)──────────────▲  │                     │
       │                                              └── preempt: back to WAITING (blocks freed) ◀┘
       └── abort, or finished from any state ─────────────────────────────────────────▶ FINISHED

"Load reported": done (load_mode "async", "blocking"), or queued ("layerwise": the load may still
be IN_FLIGHT in PREFILL; see ``bench/engine/load.py`` for the load's own states).

A request always computes tokens [num_computed_tokens, len(token_ids)): all of its prompt (less
what was cached or loaded) in PREFILL, the last sampled token in DECODE.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Hashable

import numpy as np
import torch

from bench.engine.load import PendingLoad


class RequestState(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


_TRANSITIONS = {
    RequestState.WAITING: {RequestState.LOADING, RequestState.PREFILL, RequestState.FINISHED},
    RequestState.LOADING: {RequestState.PREFILL, RequestState.WAITING, RequestState.FINISHED},
    RequestState.PREFILL: {RequestState.DECODE, RequestState.WAITING, RequestState.FINISHED},
    RequestState.DECODE: {RequestState.WAITING, RequestState.FINISHED},
    RequestState.FINISHED: set(),
}


@dataclasses.dataclass(eq=False)
class Request:
    request_id: int
    token_ids: list[int]                   # the prompt, then each sampled token
    num_prompt_tokens: int
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    arrival_s: float                       # time.perf_counter() when it entered the engine
    state: RequestState = RequestState.WAITING
    block_ids: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)   # of the leading full blocks
    num_computed_tokens: int = 0           # tokens whose KV is in block_ids
    num_registered_blocks: int = 0         # leading blocks known to the prefix cache (or tried)
    num_cached_tokens: int = 0             # the engine's own prefix-cache hit at admission
    num_loaded_tokens: int = 0             # tokens the connector loaded at admission
    num_prefilled_tokens: int = 0          # tokens prefill computed (over preemptions too)
    load: PendingLoad | None = None        # the connector's load of this admission, if any
    lookup: Any = None                     # WAITING: the connector's lookup sent, its reply not taken
    lookup_local_hit_tokens: int = 0       # the engine's own hit that lookup was sent with
    lookup_sent_s: float = 0.0             # time.monotonic() when it was sent
    lookup_waited: bool = False            # the host waited (lookup_wait_s) for that lookup's reply
    lookup_begun: bool = False             # that lookup is the request's match (connector.begin)
    num_preemptions: int = 0
    added_s: float | None = None           # time.perf_counter() when add_request returned (its lookup sent)
    admitted_s: float | None = None        # time.perf_counter() at its (latest) admission
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None       # "length", "stop" or "abort"
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)  # per sampled token (keep_logits)
    _token_array: np.ndarray | None = dataclasses.field(default=None, repr=False)

    def token_array(self, num_tokens: int | None = None) -> np.ndarray:
        """The first num_tokens (default all) of token_ids as int32 (what the connector and the
        hashes take), converted once: tokens are only ever appended, so a cached array that is long
        enough holds them."""
        num_tokens = len(self.token_ids) if num_tokens is None else num_tokens
        if self._token_array is None or len(self._token_array) < num_tokens:
            self._token_array = np.asarray(self.token_ids, dtype=np.int32)
        return self._token_array[:num_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def connector_id(self) -> Hashable:
        """The request's id at the connector: new after each preemption (the old one may still
        be held there)."""
        return (self.request_id, self.num_preemptions)

    @property
    def ttft_s(self) -> float | None:
        """From entering the engine to its first sampled token (None before it)."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    def move_to(self, state: RequestState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"request {self.request_id}: no transition {self.state.value} -> {state.value}")
        self.state = state
