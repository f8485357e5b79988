"""An in-process connector for the engine's tests: it keeps pages of KV in its own tensors (keyed
by the hash of the tokens up to each page's end) and moves them between those and the engine's
blocks for real, each transfer some ``finished()`` calls after it was queued (as an asynchronous
DMA completes on a later scheduler step). A save reads the blocks when it completes, so an engine
that reused a block too early would save the wrong bytes."""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Hashable, Sequence

import torch

from bench.engine.block_manager import block_hashes
from bench.engine.connector import Finished, LoadResult


@dataclasses.dataclass
class _Transfer:
    request_id: Hashable
    polls_left: int
    run: Callable[[], LoadResult | None]


class FakeConnector:
    def __init__(self, kv_caches: Sequence[torch.Tensor], block_size: int, latency_polls: int = 1,
                 max_load_pages: int | None = None):
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.latency_polls = latency_polls
        self.max_load_pages = max_load_pages     # a load fills at most this many pages, fails the rest
        self.pages: dict[bytes, torch.Tensor] = {}   # [layer, K/V, token in block, head, dim]
        self.transfers: list[_Transfer] = []
        self.finished_requests: set[Hashable] = set()
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

        def run() -> LoadResult:
            loaded = 0
            for page_hash, block_id in zip(hashes, block_ids):
                if page_hash not in self.pages or loaded == self.max_load_pages:
                    break
                for layer, kv_cache in enumerate(self.kv_caches):
                    kv_cache[:, block_id].copy_(self.pages[page_hash][layer])
                loaded += 1
            self.counters["loaded_pages"] += loaded
            failed = block_ids[loaded:]
            return LoadResult(request_id, loaded * self.block_size, failed, "not_cached" if failed else None)

        self.transfers.append(_Transfer(request_id, self.latency_polls, run))

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
        return Finished(loads, released)

    def request_finished(self, request_id) -> bool:
        if any(t.request_id == request_id for t in self.transfers):
            self.finished_requests.add(request_id)
            return True
        return False
