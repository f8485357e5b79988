"""An in-process connector for the engine's tests: it keeps pages of KV in its own tensors (keyed
by the hash of the tokens up to each page's end) and moves them between those and the engine's
blocks for real, each transfer some ``finished()`` calls after it was queued (as an asynchronous
DMA completes on a later scheduler step). A save reads the blocks when it completes, so an engine
that reused a block too early would save the wrong bytes.

A load is reported queued on the first ``finished()`` after it, and its blocks are then filled with
random bytes; each layer of the real bytes lands only when the engine waits for that layer
(``wait_for_layer_load``) or when the load completes. So an engine that read a layer it had not
waited for, or used a load before it completed without waiting, would compute from garbage.
``void_loads``: what lands is other bytes, and the load's result reports every block failed (as
when the session ended while its copy ran), after its queued report promised them."""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Hashable, Sequence

import torch

from bench.engine.block_manager import block_hashes
from engine_client.engine_api import Finished, LoadResult


@dataclasses.dataclass
class _Transfer:
    request_id: Hashable
    polls_left: int
    run: Callable[[], LoadResult | None]


@dataclasses.dataclass(eq=False)
class _Load:
    request_id: Hashable
    pages: list[tuple[bytes, int]]          # (page hash, block) of the pages it fills
    failed_block_ids: list[int]                   # blocks it cannot fill
    layers_landed: set[int] = dataclasses.field(default_factory=set)
    queued: bool = False


class FakeConnector:
    def __init__(self, kv_caches: Sequence[torch.Tensor], block_size: int, latency_polls: int = 1,
                 max_load_pages: int | None = None, void_loads: bool = False, seed: int = 0):
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.latency_polls = latency_polls
        self.max_load_pages = max_load_pages     # a load fills at most this many pages, fails the rest
        self.void_loads = void_loads
        self.generator = torch.Generator().manual_seed(seed)
        self.pages: dict[bytes, torch.Tensor] = {}   # [layer, K/V, token in block, head, dim]
        self.transfers: list[_Transfer] = []
        self.loads: list[_Load] = []                 # loads not completed
        self.finished_requests: set[Hashable] = set()
        self.layer_waits: list[tuple[int, tuple]] = []   # (layer, request ids) of each wait_for_layer_load
        self.counters: collections.Counter[str] = collections.Counter()
        self.prefill_samples: list[tuple[int, float]] = []

    def lookup(self, token_ids: Sequence[int], local_hit_tokens: int = 0) -> int:
        self.counters["lookups"] += 1
        num_pages = 0
        for page_hash in block_hashes(token_ids, self.block_size, len(token_ids) // self.block_size):
            if page_hash not in self.pages:
                break
            num_pages += 1
        return num_pages * self.block_size

    def report_prefill(self, num_tokens: int, seconds: float) -> None:
        self.prefill_samples.append((num_tokens, seconds))

    def load(self, request_id, token_ids, block_ids, num_tokens, start_token=0) -> None:
        assert start_token % self.block_size == 0 and num_tokens == len(block_ids) * self.block_size
        first_page = start_token // self.block_size
        hashes = block_hashes(list(token_ids), self.block_size, first_page + len(block_ids))[first_page:]
        block_ids = list(block_ids)
        pages = []
        for page_hash, block_id in zip(hashes, block_ids):
            if page_hash not in self.pages or len(pages) == self.max_load_pages:
                break
            pages.append((page_hash, block_id))
        load = _Load(request_id, pages, block_ids[len(pages):])
        self.loads.append(load)

        def run() -> LoadResult:
            for layer in range(len(self.kv_caches)):
                self._land(load, layer)
            self.loads.remove(load)
            loaded = 0 if self.void_loads else len(pages)
            self.counters["loaded_pages"] += loaded
            failed = block_ids[loaded:]
            reason = ("session_lost" if self.void_loads else "not_cached") if failed else None
            # Its copies' device time, as a real connector says it: a millisecond a page here.
            return LoadResult(request_id, loaded * self.block_size, failed, reason, transfer_s=1e-3 * len(pages))

        # Reported queued on the next finished(), complete latency_polls finished() calls later (at
        # least one more).
        self.transfers.append(_Transfer(request_id, max(2, self.latency_polls), run))

    def _land(self, load: _Load, layer: int) -> None:
        """Layer `layer` of the load's pages into its blocks: the real bytes, or (void_loads) bytes
        changed under the copy."""
        if layer in load.layers_landed:
            return
        load.layers_landed.add(layer)
        for page_hash, block_id in load.pages:
            kv = self.kv_caches[layer][:, block_id]
            kv.copy_(torch.randn(kv.shape, generator=self.generator) if self.void_loads else self.pages[page_hash][layer])

    def wait_for_layer_load(self, layer: int, stream=None, request_ids=None) -> None:
        assert request_ids is not None, "the engine names the requests it waits for"
        self.layer_waits.append((layer, tuple(request_ids)))
        for load in self.loads:
            if load.request_id in request_ids and load.queued:
                self._land(load, layer)

    def save(self, request_id, token_ids, block_ids, start_token=0) -> None:
        first_page = start_token // self.block_size
        hashes = block_hashes(list(token_ids), self.block_size, len(token_ids) // self.block_size)[first_page:]
        block_ids = list(block_ids)
        assert len(block_ids) == len(hashes)

        def run() -> None:
            for page_hash, block_id in zip(hashes, block_ids):
                if page_hash not in self.pages:
                    self.pages[page_hash] = torch.stack([kv_cache[:, block_id] for kv_cache in self.kv_caches]).clone()
                    self.counters["saved_pages"] += 1

        self.transfers.append(_Transfer(request_id, self.latency_polls, run))

    def finished(self) -> Finished:
        queued = []
        for load in self.loads:
            if not load.queued:
                load.queued = True
                for kv_cache in self.kv_caches:         # "in flight": not the real bytes yet
                    for _, block_id in load.pages:
                        kv_cache[:, block_id] = torch.randn(kv_cache[:, block_id].shape, generator=self.generator)
                queued.append(LoadResult(load.request_id, len(load.pages) * self.block_size, load.failed_block_ids,
                                         "not_cached" if load.failed_block_ids else None))
        loads, still_running = [], []
        for transfer in self.transfers:
            transfer.polls_left -= 1
            if transfer.polls_left > 0:
                still_running.append(transfer)
                continue
            result = transfer.run()
            if result is not None:
                loads.append(result)
        self.transfers = still_running
        busy = {t.request_id for t in self.transfers}
        released = [r for r in self.finished_requests if r not in busy]
        self.finished_requests -= set(released)
        return Finished(loads, released, queued)

    def request_finished(self, request_id) -> bool:
        if any(t.request_id == request_id for t in self.transfers):
            self.finished_requests.add(request_id)
            return True
        return False
