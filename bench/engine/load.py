"""A request's load from the connector, from ``load()`` to its result, in one object.

    MATCHING ──queued (its copies on the copy stream)──▶ IN_FLIGHT ──result──▶ DONE
       │   └───────────────────result───────────────────────────────────────▲
       └───────────── the request ends first (abort, preemption, close) ──▶ CANCELLED ◀── IN_FLIGHT

MATCHING: the connector has the load, its copies are not queued yet (the acquire's round trip, an L3
promotion). IN_FLIGHT: copies queued for ``num_tokens`` tokens; a layer-by-layer prefill may read
them, its attention of layer i waiting on the GPU for layer i. DONE: the connector's result, the
only state in which the loaded blocks may be published (the prefix cache, a save). A DONE load
with fewer tokens than IN_FLIGHT said is ``voided``: what a prefill read from its blocks is void.
The legal transitions are in ``_TRANSITIONS``; an illegal one raises and changes nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Hashable


class LoadState(enum.Enum):
    MATCHING = "matching"
    IN_FLIGHT = "in_flight"
    DONE = "done"
    CANCELLED = "cancelled"


_TRANSITIONS = {
    LoadState.MATCHING: {LoadState.IN_FLIGHT, LoadState.DONE, LoadState.CANCELLED},
    LoadState.IN_FLIGHT: {LoadState.DONE, LoadState.CANCELLED},
    LoadState.DONE: set(),
    LoadState.CANCELLED: set(),
}


@dataclasses.dataclass(eq=False)
class PendingLoad:
    connector_id: Hashable
    start_token: int                   # the load fills tokens [start_token, start_token + num_tokens)
    num_tokens_asked: int
    started_s: float                   # time.perf_counter() at load()
    state: LoadState = LoadState.MATCHING
    num_tokens: int = 0                # IN_FLIGHT: tokens being copied; DONE: tokens loaded
    reason: str | None = None          # DONE: why blocks were not loaded (None when all were)
    voided: bool = False               # DONE with fewer tokens than IN_FLIGHT promised
    queued_s: float | None = None
    done_s: float | None = None
    transfer_s: float = 0.0            # DONE: the device time of its copies (the connector's, if it says)

    @property
    def pending(self) -> bool:
        return self.state in (LoadState.MATCHING, LoadState.IN_FLIGHT)

    def queued(self, num_tokens: int, now_s: float) -> None:
        self._move_to(LoadState.IN_FLIGHT)
        self.num_tokens, self.queued_s = num_tokens, now_s

    def done(self, num_tokens: int, reason: str | None, now_s: float, transfer_s: float = 0.0) -> None:
        was_in_flight = self.state is LoadState.IN_FLIGHT
        self._move_to(LoadState.DONE)
        self.voided = was_in_flight and num_tokens < self.num_tokens
        self.num_tokens, self.reason, self.done_s, self.transfer_s = num_tokens, reason, now_s, transfer_s

    def cancel(self) -> None:
        self._move_to(LoadState.CANCELLED)

    def _move_to(self, state: LoadState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"load of {self.connector_id!r}: no transition {self.state.value} -> {state.value}")
        self.state = state
