"""What an engine asks of a KV connector: ``KVConnector`` has these calls with these meanings, so an
engine written against this contract (the reference engine in bench/engine) plugs it in as it is;
its tests plug in an in-process fake. With no connector
the engine recomputes whatever its own prefix cache lacks.

The engine's side, per request (the reference engine's ``scheduler.py``):

  admission   n = lookup(tokens, local_hit_tokens=hit): the prefix to hold, by the connector's
              decision (restore beats recompute); with lookup_async (optional), sent, and
              the request admitted once its reply is in: while the GPU runs a step's batch, or
              at the next step (waited for briefly, lookup_wait_s in all, when that step had
              nothing else to run) -> allocate blocks ->
              load(cid, tokens, the blocks of [hit, n), n - hit, start_token=hit)  (LOADING)
  each step   finished(): a LoadResult admits its request to prefill with the tokens it loaded
              (its failed blocks are recomputed); a released id frees the blocks held for it;
              load_mode "layerwise": a queued load admits it already, and its prefill's attention
              of layer i first calls wait_for_layer_load(i, None, [cid]); after that prefill the
              LoadResult confirms what it read, or voids it (the prefill is redone)
  prefill     report_prefill(tokens computed, seconds) after each prefill forward;
              save(cid, tokens, every full block, 0) once the prompt's prefill is queued
  the end     request_finished(cid) when it finishes, is aborted or preempted: True keeps its
              blocks until finished().released names cid

``cid`` is the request's ``connector_id``: a preempted request comes back under a new one.

Two optional calls, for a connector that lets other engines read this engine's GPU cache (peer
restores; ``KVConnector`` has them): ``will_write_blocks(block_ids)`` before any block is written
(the block manager calls it for every block it allocates or drops), and
``blocks_cached(token_ids, block_ids)`` when blocks of a prompt's leading pages enter the prefix
cache (after the forward that wrote them was queued).
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Protocol, Sequence


class LoadResult(NamedTuple):
    request_id: Hashable
    num_tokens: int                # tokens loaded, from the load's start_token on
    failed_block_ids: list[int]    # blocks left unfilled: the engine recomputes their tokens
    reason: str | None             # why blocks failed (None when none did)
    # The device time of the load's copies, from their start on the load lane (after the engine's
    # queued work) to their end (``Transfer.seconds()``); 0.0 when nothing was copied, and in the
    # provisional result of a queued load (``Finished.queued``).
    transfer_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed_block_ids


class Finished(NamedTuple):
    loads: list[LoadResult]        # each load() once, when it is complete or has failed
    released: list[Hashable]       # requests whose request_finished() returned True: blocks free now
    # Loads whose copies were queued since the last call, each once, before (or with) its entry in
    # loads: its blocks hold num_tokens once the engine's stream waited on wait_for_layer_load for
    # every layer. Provisional: its entry in loads confirms it (or, pages rewritten while the copy
    # ran, reports their blocks failed, and what the stream read from them must be recomputed).
    queued: Sequence[LoadResult] = ()


class EngineConnector(Protocol):
    def lookup(self, token_ids: Sequence[int], local_hit_tokens: int = 0) -> int:
        """Leading tokens to hold once restored from outside the engine (whole blocks), which holds
        the first local_hit_tokens itself; at most local_hit_tokens when restoring does not pay.
        Changes nothing."""

    # Optional: lookup_async(token_ids, local_hit_tokens=0) -> a pending lookup with ready() (never
    # waits), wait(timeout_s) (optional: ready() once the reply is in, at most timeout_s later;
    # nothing given up), result(timeout_s) (lookup's answer; 0 if not in by then), cancel() and give_up(waited_s)
    # (cancel(), counted as a lookup with no reply). KVConnector has it.
    # Optional, where can_begin is true: begin(cid, token_ids, local_hit_tokens) -> the same, but the
    # lookup is the request's acquire (EngineConfig.begin_lookups): the load that follows sends nothing;
    # a cancelled one ends the request cid. KVConnector has it (one rank).

    def report_prefill(self, num_tokens: int, seconds: float) -> None:
        """A prefill forward computed num_tokens in this many seconds (what restoring saves)."""

    def load(self, request_id: Hashable, token_ids: Sequence[int], block_ids: Sequence[int], num_tokens: int,
             start_token: int = 0) -> None:
        """Queue the load of tokens [start_token, start_token + num_tokens) into block_ids."""

    def save(self, request_id: Hashable, token_ids: Sequence[int], block_ids: Sequence[int],
             start_token: int = 0) -> None:
        """Queue the save of the full blocks of token_ids from start_token on (after the work
        queued so far on the engine's stream)."""

    def finished(self) -> Finished:
        """Loads queued, loads done and requests released since the last call; never waits."""

    def wait_for_layer_load(self, layer: int, stream=None, request_ids=None) -> None:
        """Make the engine's (current) stream wait until the loads of request_ids have written
        ``layer`` of their blocks; no host wait for the copies."""

    def request_finished(self, request_id: Hashable) -> bool:
        """The engine is done with the request; True: keep its blocks until it is released."""
