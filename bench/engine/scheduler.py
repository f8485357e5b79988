"""Continuous batching with a prefix cache and a connector hook; no tensors here.

Each step: the connector's finished loads and released blocks come in; waiting requests are
admitted in arrival order while blocks and seats last (but for one whose begun lookup has no reply
yet, or, at a step's start with a decode batch to run, one that would load: those behind it go
first); then either a prefill batch (chunks of PREFILL requests up to ``max_prefill_tokens``) or,
when no request has anything to prefill, a decode batch of every DECODE request. While the GPU runs
that batch, the engine admits the waiting requests whose lookup replies come in meanwhile
(``admit_during_step``): their loads go out in the GPU's shadow. The host waits for lookup replies
(``lookup_wait_s`` in all) only in a step with nothing else to run, so that no other request's
batch is ever held up by it. A LOADING request waits for its load without holding up the others
(``load_mode`` "blocking": the host waits for it at admission). When a decode step lacks a block,
the latest admitted request is preempted (its blocks freed, recomputed later).

A request's load (``bench/engine/load.py``) is published (its blocks in the prefix cache, saved)
only once DONE. With ``load_mode`` "layerwise" a request's prefill may run while its load is
IN_FLIGHT; ``prefill_done`` then takes the load's result first, and drops the chunk (no token,
nothing registered or saved; it runs again) unless the result confirms what the prefill read.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import time
from typing import Hashable, NamedTuple

from bench.engine.block_manager import BlockManager, block_hashes
from bench.engine.config import EngineConfig
from bench.engine.load import LoadState, PendingLoad
from bench.engine.request import Request, RequestState
from engine_client.engine_api import EngineConnector

logger = logging.getLogger(__name__)

HASH_AHEAD_BLOCKS = 16       # a request's own hit is looked for with at least this many block hashes


class Admission(enum.Enum):
    """What ``Scheduler._allocate_for`` did with a waiting request."""
    ADMITTED = "admitted"            # blocks allocated: LOADING, or PREFILL
    NOT_YET = "not yet"              # still WAITING: no reply yet, no blocks, or its next block being computed
    LOAD_LEFT = "load left"          # still WAITING: it would load, left for the admission in the batch's shadow


class PrefillChunk(NamedTuple):
    request: Request
    num_tokens: int                  # tokens [first_token, + num_tokens) of the request
    first_token: int                 # its num_computed_tokens when the chunk was planned


class StepPlan(NamedTuple):
    prefill: list[PrefillChunk]      # at most one of the two is non-empty
    decode: list[Request]


class Scheduler:
    def __init__(self, config: EngineConfig, connector: EngineConnector | None = None):
        self.config = config
        self.block_size = config.block_size
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self._connector: EngineConnector | None = None
        self.connector = connector
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []             # LOADING, PREFILL and DECODE, in admission order
        self.held_block_ids: dict[Hashable, list[int]] = {}    # connector id -> blocks it still touches
        self.num_preemptions = 0
        # Prompts prefilled this step whose chunk read a load IN_FLIGHT (the request, its tokens
        # then): saved once their first tokens are out (``save_due``). The others are saved while
        # the GPU runs the forward (``save_prefilled``), those of this step in ``saved_early``.
        self.saves_due: list[tuple[Request, int]] = []
        self.saved_early: set[int] = set()
        self.schedule_poll_s = 0.0      # the last schedule's time in poll_connector (PrefillTiming)

    @property
    def connector(self) -> EngineConnector | None:
        return self._connector

    @connector.setter
    def connector(self, connector: EngineConnector | None) -> None:
        """A connector that reads the engine's blocks (peer restores) hears of every block before
        it is written (``will_write_blocks``) and of every block the prefix cache holds
        (``blocks_cached``, in ``_register_blocks``)."""
        self._connector = connector
        self.blocks.on_write = getattr(connector, "will_write_blocks", None)

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        # Its lookup goes out on arrival where a seat could take it (the bound of ``_admit``'s
        # lookups): the round trip runs while the engine ends its step, or while an idle engine's
        # caller gets to the next one, not from that step's admission on.
        if self.connector is not None and self._lookups_async() and \
                len(self.waiting) <= self._free_seats():
            self._looked_up(request, len(self._own_hit(request)) * self.block_size)

    def has_unfinished(self) -> bool:
        """Requests not finished, or blocks the connector still holds."""
        return bool(self.waiting or self.running or self.held_block_ids)

    # ---- a step ----------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        started = time.perf_counter()
        self.poll_connector()
        self.schedule_poll_s = time.perf_counter() - started    # the connector's news first (timings)
        if self._admit() and self.config.load_mode == "layerwise":
            self.poll_connector()       # a load queued at its admission (its match was in) prefills now
        if self.config.load_mode == "blocking":
            self._wait_for_loads()
        budget = self.config.max_prefill_tokens
        chunks = []
        for request in self.running:
            if request.state is RequestState.PREFILL and budget > 0:
                num_tokens = min(len(request.token_ids) - request.num_computed_tokens, budget)
                chunks.append(PrefillChunk(request, num_tokens, request.num_computed_tokens))
                budget -= num_tokens
        if chunks:
            return StepPlan(chunks, [])
        return StepPlan([], self._schedule_decode())

    @staticmethod
    def loads_in_flight(chunks: list[PrefillChunk]) -> list[Hashable]:
        """The connector ids of the chunks' requests whose load is still IN_FLIGHT: their prefill
        waits for each layer of it."""
        return [c.request.connector_id for c in chunks if c.request.load is not None
                and c.request.load.state is LoadState.IN_FLIGHT]

    def prefill_done(self, chunks: list[PrefillChunk]) -> list[Request | None]:
        """After the prefill forward (and the host's wait for it): advance each chunk. Returns, for
        each chunk that ended its request's prompt, in chunk order (the rows of the forward's
        logits), the request (sampled next), or None when the chunk is dropped: it read an
        IN_FLIGHT load that its result then voided, or that has no result yet."""
        if self.loads_in_flight(chunks):
            self.poll_connector()        # the copies they waited for are done: their results are in
        sampled: list[Request | None] = []
        for request, num_tokens, first_token in chunks:
            ends_prompt = first_token + num_tokens == len(request.token_ids)
            load = request.load
            if request.num_computed_tokens != first_token or (load is not None and load.state is LoadState.IN_FLIGHT):
                if ends_prompt:
                    sampled.append(None)  # what it computed is void, or not yet known to hold: again
                continue
            request.num_computed_tokens += num_tokens
            request.num_prefilled_tokens += num_tokens
            self._register_blocks(request)
            if ends_prompt:
                if self._saves(request) and request.request_id not in self.saved_early:
                    self.saves_due.append((request, len(request.token_ids)))
                sampled.append(request)
        self.saved_early.clear()
        return sampled

    def save_prefilled(self, chunks: list[PrefillChunk]) -> None:
        """With the chunks' prefill queued on the GPU, not yet done: queue the saves of the prompts
        they end that ``prefill_done`` takes as they are (no load IN_FLIGHT, whose result could
        void the chunk), so that a save's host work goes in the GPU's shadow rather than after
        the request's first token. The connector reads the blocks after the work queued so far on
        the engine's stream (this forward)."""
        self.saved_early.clear()
        for request, num_tokens, first_token in chunks:
            if first_token + num_tokens == len(request.token_ids) and self._saves(request) \
                    and request.num_computed_tokens == first_token \
                    and (request.load is None or request.load.state is not LoadState.IN_FLIGHT):
                self.saved_early.add(request.request_id)
                self._save(request, len(request.token_ids))

    def _saves(self, request: Request) -> bool:
        """Whether the request's prompt, once prefilled, is saved (a connector, a full block)."""
        return self.connector is not None and len(request.token_ids) >= self.block_size

    def _save(self, request: Request, num_tokens: int) -> None:
        self.connector.save(request.connector_id, request.token_array(num_tokens),
                            request.block_ids[: num_tokens // self.block_size], 0)

    def save_due(self, request: Request | None = None) -> None:
        """Queue the saves left due by ``prefill_done`` (after their first tokens are out: a save's
        host work is not the user's wait), or ``request``'s alone (before it ends)."""
        for due in [d for d in self.saves_due if request is None or d[0] is request]:
            self.saves_due.remove(due)
            self._save(*due)

    def decode_done(self, requests: list[Request]) -> None:
        for request in requests:
            request.num_computed_tokens += 1

    def append_token(self, request: Request, token_id: int, now_s: float) -> bool:
        """A sampled token; True when it finishes the request."""
        request.token_ids.append(token_id)
        if request.first_token_s is None:
            request.first_token_s = now_s
        if request.state is RequestState.PREFILL:
            request.move_to(RequestState.DECODE)
        if token_id in request.stop_token_ids:
            self.finish(request, "stop", now_s)
        elif len(request.output_token_ids) >= request.max_new_tokens:
            self.finish(request, "length", now_s)
        return request.state is RequestState.FINISHED

    def finish(self, request: Request, reason: str, now_s: float) -> None:
        self.save_due(request)
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
            if request.lookup is not None:
                request.lookup.cancel()
                request.lookup = None
        else:
            self.running.remove(request)
            self._free_blocks(request)      # a pending load is cancelled with them
        request.move_to(RequestState.FINISHED)
        request.finish_reason, request.finish_s = reason, now_s

    # ---- admission ----------------------------------------------------------------------------------

    def admit_during_step(self) -> None:
        """While the GPU runs the step's batch: admit the waiting requests whose lookup replies are
        in (no wait), so that their loads' matches go out, and their copies are queued, before the
        next step rather than in it."""
        if self.waiting and self.connector is not None and self._lookups_async():
            self._admit(may_wait=False)

    def _hashes_being_computed(self) -> frozenset[bytes]:
        """The hashes of the full prompt blocks that running requests are prefilling and have not
        yet put in the prefix cache."""
        hashes: set[bytes] = set()
        for request in self.running:
            if request.state is not RequestState.PREFILL:
                continue
            hashes.update(self._hashes(request, len(request.token_ids) // self.block_size)[
                request.num_registered_blocks:])
        return frozenset(hashes)

    def _hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The hashes of the request's first num_blocks full blocks (``request.block_hashes``
        extended as far as that, never cut: tokens are only ever appended)."""
        if len(request.block_hashes) < num_blocks:
            request.block_hashes = block_hashes(request.token_array(), self.block_size, num_blocks,
                                                request.block_hashes)
        return request.block_hashes[:num_blocks]

    def _decode_batch_only(self) -> bool:
        """Whether this step's batch, as admission finds it, is a decode batch: requests decode,
        none prefills."""
        states = {r.state for r in self.running}
        return RequestState.DECODE in states and RequestState.PREFILL not in states

    def _free_seats(self) -> int:
        """How many more requests may be admitted now (``max_num_seqs`` less those running)."""
        return self.config.max_num_seqs - len(self.running)

    def _has_batch(self) -> bool:
        """Whether a running request has work for this step's batch (a prefill or a decode)."""
        return any(r.state in (RequestState.PREFILL, RequestState.DECODE) for r in self.running)

    def _admit(self, may_wait: bool = True) -> bool:
        """Admit waiting requests in order while seats and blocks last; True if one of them went
        LOADING. ``may_wait``: in a step that had nothing to run, the host may wait for the lookup
        replies of the requests it admits, ``lookup_wait_s`` at most in all (a round trip takes a
        fraction of that, and the lookups of a burst go out together, so their replies come
        together): the requests of a burst then share the step's batch, where admitting the first
        alone would run it in a forward of its own and the others a step later. A request whose
        next block past its own hit is one a running request is prefilling waits (and those behind
        it) until that block is in the prefix cache: admitted now, it would compute or load the
        block again."""
        has_batch = self._has_batch()
        wait_until = time.monotonic() + self.config.lookup_wait_s if may_wait and not has_batch else None
        # At a step's start with a decode batch to run, a request that would load is left for the
        # admission while the GPU runs that batch (``admit_during_step``, with asynchronous lookups):
        # its blocks' allocation and its copies' queueing then take the host in the GPU's shadow, not
        # ahead of the batch's launch. Where a prefill batch runs instead, it is admitted now, to
        # join that batch (its layers' loads waited for on the GPU, ``layerwise``).
        defer_loads = may_wait and self._lookups_async() and self._decode_batch_only()
        if self._lookups_async():
            # The lookups of every waiting request that a seat could take go out together (one
            # round trip for a burst), the engine's own hit of each as it is now.
            for request in itertools.islice(self.waiting, self._free_seats()):
                self._looked_up(request, len(self._own_hit(request)) * self.block_size)
        deferred = None             # the blocks being computed: they change only with a PREFILL admission
        index, loading = 0, False
        # Only the requests a seat could take (the first ones, as many as seats are free) are tried:
        # going past one whose begun lookup is not in never sends the lookup of one beyond them.
        while index < min(len(self.waiting), self._free_seats()):
            request = self.waiting[index]
            wait_s = 0.0 if wait_until is None else wait_until - time.monotonic()
            if deferred is None:
                deferred = self._hashes_being_computed()
            admission = self._allocate_for(request, wait_s, deferred, defer_loads)
            if admission is not Admission.ADMITTED:
                if admission is Admission.LOAD_LEFT or \
                        request.lookup_begun and request.lookup is not None and not request.lookup.ready():
                    # Its load is left for the admission while the GPU runs the batch, or its match
                    # has no reply yet (it may wait on a promotion from L3, which a lookup's reply
                    # would not): the requests behind it are admitted meanwhile.
                    index += 1
                    continue
                break
            del self.waiting[index]
            self.running.append(request)
            if request.state is RequestState.PREFILL:
                deferred = None
            loading = loading or request.state is RequestState.LOADING
        return loading

    def _allocate_for(self, request: Request, wait_s: float = 0.0, deferred: frozenset[bytes] = frozenset(),
                      defer_loads: bool = False) -> Admission:
        """The prefix cache's hit, the connector's decision beyond it (NOT_YET while its lookup's
        reply is not in, after a wait of at most wait_s), blocks for the rest, and the connector's
        load beyond the hit. NOT_YET, too, while its next block past the hit is among ``deferred``
        (being computed); LOAD_LEFT with ``defer_loads`` where it would load."""
        num_tokens = len(request.token_ids)
        num_reusable_blocks = (num_tokens - 1) // self.block_size    # at least one token is computed
        hit_block_ids = self._own_hit(request)
        if len(hit_block_ids) < num_reusable_blocks and \
                self._hashes(request, len(hit_block_ids) + 1)[len(hit_block_ids)] in deferred:
            return Admission.NOT_YET
        num_new_blocks = -(-num_tokens // self.block_size) - len(hit_block_ids)
        can_allocate = self.blocks.can_allocate(num_new_blocks, hit_block_ids)
        looked_up = None
        if self.connector is not None and self._lookups_async():
            # The host waits for the reply only where the request could be admitted now.
            looked_up = self._looked_up(request, len(hit_block_ids) * self.block_size, wait_s if can_allocate else 0.0)
            if looked_up is None:
                return Admission.NOT_YET
        if not can_allocate:
            return Admission.NOT_YET
        if self.connector is not None and looked_up is None:      # the host waits for the reply
            looked_up = self.connector.lookup(request.token_array(),
                                              local_hit_tokens=len(hit_block_ids) * self.block_size)
        if defer_loads and self._external_tokens(looked_up, num_reusable_blocks) > len(hit_block_ids) * self.block_size:
            return Admission.LOAD_LEFT
        request.lookup = None
        request.admitted_s = time.perf_counter()
        self.blocks.acquire(hit_block_ids)
        request.block_ids = hit_block_ids + self.blocks.allocate(num_new_blocks)
        request.num_cached_tokens = request.num_computed_tokens = len(hit_block_ids) * self.block_size
        request.num_registered_blocks = len(hit_block_ids)
        request.num_loaded_tokens = 0
        request.load = None
        if self.connector is not None:
            num_external = self._external_tokens(looked_up, num_reusable_blocks)
            if num_external > request.num_computed_tokens:
                start = request.num_computed_tokens
                request.load = PendingLoad(request.connector_id, start, num_external - start, time.perf_counter())
                self.connector.load(request.connector_id, request.token_array(),
                                    request.block_ids[start // self.block_size: num_external // self.block_size],
                                    num_external - start, start)
                request.move_to(RequestState.LOADING)
                return Admission.ADMITTED
        request.move_to(RequestState.PREFILL)
        return Admission.ADMITTED

    def _external_tokens(self, looked_up: int | None, num_reusable_blocks: int) -> int:
        """Of the connector's answer, the leading tokens a load may fill: whole blocks, short of
        the block holding the prompt's last token (computed)."""
        if looked_up is None:
            return 0
        num_external = min(looked_up, num_reusable_blocks * self.block_size)
        return num_external - num_external % self.block_size

    def _own_hit(self, request: Request) -> list[int]:
        """The prefix cache's blocks for the request's leading reusable blocks (all but the one
        holding its last token, which is always computed). Its block hashes are computed as far as
        the hit goes and a little beyond (HASH_AHEAD_BLOCKS at least, doubling while all hit): a
        long prompt's lookup goes out without waiting for the hashes of blocks nobody holds (the
        rest come in ``hash_ahead``, while the GPU runs, or where they are needed)."""
        num_reusable_blocks = (len(request.token_ids) - 1) // self.block_size
        num_hashed = min(num_reusable_blocks, max(len(request.block_hashes), HASH_AHEAD_BLOCKS))
        while True:
            hit_block_ids = self.blocks.match(self._hashes(request, num_hashed))
            if len(hit_block_ids) < num_hashed or num_hashed == num_reusable_blocks:
                return hit_block_ids
            num_hashed = min(num_reusable_blocks, 2 * num_hashed)

    def hash_ahead(self) -> None:
        """The hashes of every running request's full prompt blocks (registration and the check of
        blocks being computed take them): host work for while the GPU runs."""
        for request in self.running:
            if request.state is not RequestState.DECODE:
                self._hashes(request, len(request.token_ids) // self.block_size)

    def _lookups_async(self) -> bool:
        """Whether admission sends lookups without waiting for their replies (but for the bounded
        wait of ``_looked_up``): a connector with ``lookup_async``, outside "blocking" (there, and
        without it, the host waits at admission, once blocks are there for the request)."""
        return getattr(self.connector, "lookup_async", None) is not None and self.config.load_mode != "blocking"

    def _looked_up(self, request: Request, local_hit_tokens: int, wait_s: float = 0.0) -> int | None:
        """The connector's lookup of the request: the leading tokens to hold, or None while its
        reply is not in. Sent once (again only if the engine's own hit changed meanwhile). With
        ``wait_s`` > 0 (a request an idle step may admit), the host waits for the reply, once, at
        most that long (a round trip takes a fraction of a millisecond; without the wait the
        request would be admitted a whole step later); beyond that the step goes on, and a later
        one takes the reply. A reply not in within ``lookup_timeout_s`` of the first send is given
        up (0: recomputed)."""
        pending = request.lookup
        if pending is None:
            request.lookup_sent_s = time.monotonic()
            request.lookup = self._lookup_async(request, local_hit_tokens)
        elif request.lookup_local_hit_tokens != local_hit_tokens and not request.lookup_begun:
            if pending.ready():
                request.lookup_sent_s = time.monotonic()    # a resend while one is out keeps its time
            pending.cancel()
            request.lookup = self._lookup_async(request, local_hit_tokens)
        wait_for_reply = getattr(request.lookup, "wait", None)      # optional (engine_client/engine_api.py)
        if wait_s > 0 and not request.lookup_waited and wait_for_reply is not None:
            request.lookup_waited = True
            ready = wait_for_reply(wait_s)
        else:
            ready = request.lookup.ready()
        if not ready:
            waited_s = time.monotonic() - request.lookup_sent_s
            if waited_s < self.config.lookup_timeout_s:
                return None
            request.lookup.give_up(waited_s)
        return request.lookup.result()

    def _lookup_async(self, request: Request, local_hit_tokens: int):
        """The request's lookup, sent. Where the connector can (``can_begin``), the lookup is the
        request's match (``begin``): its load and save then need no round trip of their own. Such
        a lookup is not sent again when the engine's own hit grows: its lease covers the hit
        beyond it all the same."""
        request.lookup_local_hit_tokens = local_hit_tokens
        request.lookup_waited = False
        # A begun lookup holds a lease and an L2 reservation while the request waits: lookups go out
        # only for the requests a seat could take (``_admit``), so at most max_num_seqs of them.
        request.lookup_begun = self.config.begin_lookups and bool(getattr(self.connector, "can_begin", False))
        if request.lookup_begun:
            return self.connector.begin(request.connector_id, request.token_array(), local_hit_tokens)
        return self.connector.lookup_async(request.token_array(), local_hit_tokens=local_hit_tokens)

    def poll_connector(self) -> None:
        """The connector's news: loads queued (IN_FLIGHT; "layerwise": the request may prefill),
        loads done (DONE: published, the request prefills what they did not fill), blocks released."""
        if self.connector is None:
            return
        finished = self.connector.finished()
        now_s = time.perf_counter()
        pending = {r.connector_id: r for r in self.running if r.load is not None and r.load.pending}
        for result in finished.queued:
            request = pending.get(result.request_id)
            if request is None or request.load.state is not LoadState.MATCHING:
                continue                 # ended meanwhile
            request.load.queued(result.num_tokens, now_s)
            if self.config.load_mode == "layerwise":
                request.num_computed_tokens = request.load.start_token + result.num_tokens
                request.move_to(RequestState.PREFILL)
        for result in finished.loads:
            request = pending.get(result.request_id)
            if request is None:          # finished, aborted or preempted meanwhile
                continue
            if result.failed_block_ids:
                logger.debug("request %s: %d blocks not loaded (%s), recomputed", request.request_id,
                             len(result.failed_block_ids), result.reason)
            load = request.load
            load.done(result.num_tokens, result.reason, now_s, getattr(result, "transfer_s", 0.0))
            if load.voided:
                logger.debug("request %s: its load was voided (%s) after its copies were queued",
                             request.request_id, result.reason)
            request.num_loaded_tokens = result.num_tokens
            # Tokens past the load are not computed yet (LOADING), or were computed by a prefill
            # that prefill_done has not taken in yet (it compares with the chunk's first token).
            request.num_computed_tokens = load.start_token + result.num_tokens
            self._register_blocks(request)
            if request.state is RequestState.LOADING:
                request.move_to(RequestState.PREFILL)
        for connector_id in finished.released:
            self.blocks.release(self.held_block_ids.pop(connector_id))

    def _wait_for_loads(self) -> None:
        """"blocking": the host waits until no admitted request is LOADING (nothing else runs)."""
        deadline = time.monotonic() + self.config.load_timeout_s
        while any(r.state is RequestState.LOADING for r in self.running):
            if time.monotonic() > deadline:
                raise TimeoutError(f"loads not done within load_timeout_s={self.config.load_timeout_s} s")
            self.poll_connector()

    # ---- blocks -------------------------------------------------------------------------------------

    def _register_blocks(self, request: Request) -> None:
        """Publish the request's newly complete prompt blocks in the prefix cache."""
        num_full_blocks = request.num_computed_tokens // self.block_size
        if num_full_blocks <= request.num_registered_blocks:
            return
        hashes = self._hashes(request, num_full_blocks)
        for i in range(request.num_registered_blocks, num_full_blocks):
            self.blocks.register(request.block_ids[i], hashes[i])
        request.num_registered_blocks = num_full_blocks
        blocks_cached = getattr(self.connector, "blocks_cached", None)
        if blocks_cached is not None:       # written by the work queued so far (this step's forward)
            blocks_cached(request.token_array(num_full_blocks * self.block_size), request.block_ids[:num_full_blocks])

    def _free_blocks(self, request: Request) -> None:
        if request.load is not None and request.load.pending:
            request.load.cancel()           # the connector keeps the blocks while its copies run
        block_ids, request.block_ids = request.block_ids, []
        if self.connector is not None and self.connector.request_finished(request.connector_id):
            self.held_block_ids[request.connector_id] = block_ids
        else:
            self.blocks.release(block_ids)

    def _schedule_decode(self) -> list[Request]:
        """Every DECODE request, each with a block for its next token; preempts to find blocks."""
        batch = []
        for request in list(self.running):
            if request.state is not RequestState.DECODE:
                continue
            while len(request.block_ids) * self.block_size < len(request.token_ids):
                new = self.blocks.allocate(1)
                if new is not None:
                    request.block_ids += new
                elif not self._preempt_latest(but=request):
                    self._preempt(request)
                    break
            batch.append(request)
        return [r for r in batch if r.state is RequestState.DECODE]   # less those preempted

    def _preempt_latest(self, but: Request) -> bool:
        for victim in reversed(self.running):
            if victim is not but:
                self._preempt(victim)
                return True
        return False

    def _preempt(self, request: Request) -> None:
        logger.debug("preempting request %s", request.request_id)
        self.running.remove(request)
        self._free_blocks(request)
        request.move_to(RequestState.WAITING)
        request.num_preemptions += 1
        request.num_computed_tokens = request.num_registered_blocks = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1
