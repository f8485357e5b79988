"""KV events for cache-aware routers: which prefixes the daemon's tiers gained and lost, in the
format vLLM's engines publish (``vllm/distributed/kv_events.py``), so that an indexer of a vLLM
fleet (llm-d's, Dynamo's router) learns which node holds a prefix in host memory. Pure logic: the
state records its tier changes into an ``EventBuffer``; the I/O layer
(``kvcached/server/kv_events.py``) takes them once per loop iteration, encodes and sends them.

Wire format, as vLLM's msgspec classes encode it: a batch is the msgpack array ``[ts, [event, ...],
data_parallel_rank]`` (``KVEventBatch``, array_like; the rank is nil here); an event is a map whose
first key ``"type"`` names it (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), then its
fields in vLLM's order, those at their default left out (omit_defaults).

Where a page is (``medium``, ``locality``), vLLM's names for its own offloading tiers: L2, the host
memory pool, is ("CPU", "LOCAL"); L3, the local file, ("STORAGE", "LOCAL") as vLLM's file tier;
the remote tier, a store other hosts share, ("STORAGE", "REMOTE"). ``ownership`` is "kvcached"
(vLLM's field for the secondary tier that published an event).

Hashes. A page's block hash is its chained key (``l3_index.chain_page_keys``: a digest of every
token of the prefix up to and including the page, the key the L3 index and the remote tier name it
by), as the unsigned 64-bit int vLLM publishes by default (``maybe_convert_block_hash``: the key's
last 8 bytes, big-endian); ``parent_block_hash`` is the previous page's, nil for a path's first
page. BlockStored carries the pages' token ids and ``block_size`` (the namespace's page size), so
an indexer that hashes tokens its own way can map the pages onto its keys.
"""

from __future__ import annotations

import collections
import enum
from typing import Any, Callable, Generator, Iterable, NamedTuple

import msgpack
import numpy as np

from kvcached.core.l3_index import ROOT_KEY, page_key
from kvcached.core.tiers import Tier

OWNERSHIP = "kvcached"
_TOKEN_BYTES = 4                # int32 little-endian, as the tree keys pages
_HASH_MASK = (1 << 64) - 1


class Where(NamedTuple):
    """Where pages are, in vLLM's words."""

    medium: str
    locality: str


TIER_WHERE = {Tier.L2: Where("CPU", "LOCAL"), Tier.L3: Where("STORAGE", "LOCAL")}
REMOTE_WHERE = Where("STORAGE", "REMOTE")


class EventKind(enum.Enum):
    STORED = "BlockStored"
    REMOVED = "BlockRemoved"
    CLEARED = "AllBlocksCleared"


class TierEvent(NamedTuple):
    """Pages [start_page, end_page) of one path of one model entered (STORED) or left (REMOVED) a
    tier; CLEARED: everything the model had here is gone (path empty)."""

    kind: EventKind
    model_id: str
    page_size: int
    where: Where | None
    path: bytes                 # the tokens of pages [0, end_page), int32 little-endian
    start_page: int

    @property
    def end_page(self) -> int:
        return len(self.path) // (self.page_size * _TOKEN_BYTES)


def _continues(previous: TierEvent, event: TierEvent) -> bool:
    return (event.kind is previous.kind and event.model_id == previous.model_id
            and event.where == previous.where and event.page_size == previous.page_size)


class EventBuffer:
    """The events recorded since the I/O layer last took them, at most ``max_buffered_bytes`` of
    paths: one recorded beyond that is dropped and counted (``dropped_events``). ``notify`` is
    called when an event lands in an empty buffer (the I/O layer schedules a take). Consecutive
    events of one path merge: a store of the pages that continue the last store (an insert walking
    down the tree), or a removal of the pages just above the last removal (evicting leaf after leaf
    up a path), or just below it (clearing a subtree top down)."""

    def __init__(self, max_buffered_bytes: int, notify: Callable[[], None] = lambda: None):
        if max_buffered_bytes < 0:
            raise ValueError(f"max_buffered_bytes must be >= 0, got {max_buffered_bytes}")
        self.max_buffered_bytes = max_buffered_bytes
        self._notify = notify
        self._events: collections.deque[TierEvent] = collections.deque()
        self._buffered_bytes = 0
        self.recorded_events = 0
        self.dropped_events = 0             # since the start
        self._dropped_since_take = 0

    def __len__(self) -> int:
        return len(self._events)

    def record(self, event: TierEvent) -> None:
        self.recorded_events += 1
        if self._events and event.kind is not EventKind.CLEARED and _continues(self._events[-1], event):
            merged = self._merged(self._events[-1], event)
            if merged is not None:
                grown = len(merged.path) - len(self._events[-1].path)
                if self._buffered_bytes + grown <= self.max_buffered_bytes:
                    self._events[-1] = merged
                    self._buffered_bytes += grown
                    return
        if self._buffered_bytes + len(event.path) > self.max_buffered_bytes:
            self.dropped_events += 1
            self._dropped_since_take += 1
            return
        was_empty = not self._events
        self._events.append(event)
        self._buffered_bytes += len(event.path)
        if was_empty:
            self._notify()

    @staticmethod
    def _merged(previous: TierEvent, event: TierEvent) -> TierEvent | None:
        if event.start_page == previous.end_page and event.path.startswith(previous.path):
            return previous._replace(path=event.path)          # the pages right below the last ones
        if (event.kind is EventKind.REMOVED and previous.start_page == event.end_page
                and previous.path.startswith(event.path)):
            return previous._replace(start_page=event.start_page)    # the pages right above them
        return None

    def take(self) -> tuple[list[TierEvent], int]:
        """The events recorded since the last take, in order, and how many were dropped meanwhile."""
        events, dropped = list(self._events), self._dropped_since_take
        self._events.clear()
        self._buffered_bytes = 0
        self._dropped_since_take = 0
        return events, dropped


def block_hash(page_key: bytes) -> int:
    """vLLM's default external block hash of a digest: its last 8 bytes, big-endian."""
    return int.from_bytes(page_key, "big") & _HASH_MASK


class KeyCache:
    """The page keys of recently encoded paths, keyed by page size and the path's bytes (the keys
    are a function of these alone), at most ``max_bytes`` of
    paths (least recently used first out): an eviction names the pages a store named before, and an
    extension's parent is the last page of a path stored before, so most keys are hashed once."""

    def __init__(self, max_bytes: int = 16 << 20):
        self.max_bytes = max_bytes
        self._keys: collections.OrderedDict[tuple[int, bytes], list[bytes]] = collections.OrderedDict()
        self._bytes = 0
        self.hits = 0

    def get(self, page_size: int, path: bytes) -> list[bytes] | None:
        keys = self._keys.get((page_size, path))
        if keys is not None:
            self._keys.move_to_end((page_size, path))
            self.hits += 1
        return keys

    def put(self, page_size: int, path: bytes, keys: list[bytes]) -> None:
        if (page_size, path) in self._keys or len(path) > self.max_bytes:
            return
        self._keys[page_size, path] = keys
        self._bytes += len(path)
        while self._bytes > self.max_bytes:
            (_, oldest), _ = self._keys.popitem(last=False)
            self._bytes -= len(oldest)


def _page_keys(event: TierEvent, cache: KeyCache, pages_per_slice: int) -> Generator[None, None, list[bytes]]:
    """The keys of the path's pages (from the cache where it can); yields after each
    ``pages_per_slice`` pages hashed (a path's keys chain from its first page)."""
    keys = cache.get(event.page_size, event.path)
    if keys is not None:
        return keys
    page_bytes = event.page_size * _TOKEN_BYTES
    known = cache.get(event.page_size, event.path[:event.start_page * page_bytes]) if event.start_page else None
    keys = list(known) if known is not None else []
    parent = keys[-1] if keys else ROOT_KEY
    for page in range(len(keys), event.end_page):
        parent = page_key(parent, event.path[page * page_bytes:(page + 1) * page_bytes])
        keys.append(parent)
        if (page + 1) % pages_per_slice == 0:
            yield
    cache.put(event.page_size, event.path, keys)
    return keys


def _event_body(event: TierEvent, cache: KeyCache, pages_per_slice: int) -> Generator[None, None, dict[str, Any]]:
    """The event's map."""
    if event.kind is EventKind.CLEARED:
        return {"type": event.kind.value}
    assert event.where is not None
    keys = yield from _page_keys(event, cache, pages_per_slice)
    hashes = [block_hash(key) for key in keys[event.start_page:]]
    if event.kind is EventKind.REMOVED:
        return {"type": event.kind.value, "block_hashes": hashes, "medium": event.where.medium,
                "locality": event.where.locality, "ownership": OWNERSHIP}
    tokens = np.frombuffer(event.path, dtype="<i4", offset=event.start_page * event.page_size * _TOKEN_BYTES)
    return {"type": event.kind.value, "block_hashes": hashes,
            "parent_block_hash": block_hash(keys[event.start_page - 1]) if event.start_page else None,
            "token_ids": tokens.tolist(), "block_size": event.page_size,
            "lora_id": None, "medium": event.where.medium, "lora_name": None,
            "locality": event.where.locality, "ownership": OWNERSHIP}


def encode_in_slices(events: Iterable[TierEvent], ts: float, cache: KeyCache | None = None,
                     pages_per_slice: int = 16) -> Generator[None, None, list[tuple[str, bytes]]]:
    """One ``KVEventBatch`` per model, in the order each model first appears: (model_id, payload),
    returned once done; yields after each ``pages_per_slice`` pages hashed, so that its caller can
    serve requests between slices."""
    cache = cache if cache is not None else KeyCache()
    per_model: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        body = yield from _event_body(event, cache, pages_per_slice)
        per_model.setdefault(event.model_id, []).append(body)
    return [(model_id, msgpack.packb([ts, bodies, None], use_bin_type=True))
            for model_id, bodies in per_model.items()]


def encode_batches(events: Iterable[TierEvent], ts: float) -> list[tuple[str, bytes]]:
    """``encode_in_slices`` at once."""
    slices = encode_in_slices(events, ts)
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value
