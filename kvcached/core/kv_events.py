"""KV events for cache-aware routers: which prefixes the daemon's tiers gained and lost, in the
format vLLM's engines publish (``vllm/distributed/kv_events.py``), so that an indexer of a vLLM
fleet (llm-d's, Dynamo's router) learns which node holds a prefix in host memory. Pure logic: the
state records its tier changes into an ``EventBuffer``; the I/O layer (the daemon's socket thread,
``kvcached/server/kv_events.py``) takes them, then hashes, encodes and sends them a slice at a time
between requests (``encode_in_slices``).

Wire format, as vLLM's msgspec classes encode it: a batch is the msgpack array ``[ts, [event, ...],
data_parallel_rank]`` (``KVEventBatch``, array_like; the rank is nil here); an event is a map whose
first key ``"type"`` names it (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), then its
fields in vLLM's order, those at their default left out (omit_defaults). AllBlocksCleared is sent
when a model's first namespace appears (what an earlier run published of it is gone); a namespace
reclaimed for another model sends the removal of each page it held instead (so that the model's
other namespaces, of other salts say, keep theirs in a router).

Where a page is (``medium``, ``locality``), vLLM's names for its own offloading tiers: L2, the host
memory pool, is ("CPU", "LOCAL"); L3, the local file, ("STORAGE", "LOCAL") as vLLM's file tier;
the remote tier, a store other hosts share, ("STORAGE", "REMOTE"). ``ownership`` is "kvcached"
(vLLM's field for the secondary tier that published an event).

Hashes. A page's block hash is its chained key (``proto/page_keys.py``: a digest of every
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

from kvcached.core.tiers import Tier
from proto.page_keys import ROOT_KEY, page_key
from proto.tokens import TOKEN_BYTES, token_array

OWNERSHIP = "kvcached"
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
        return len(self.path) // (self.page_size * TOKEN_BYTES)


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


class PathHashes(NamedTuple):
    """A path's block hashes, page by page, and its last page's key (a longer path chains from it)."""

    hashes: np.ndarray          # uint64
    last_key: bytes


class KeyCache:
    """The hashes of recently encoded paths, keyed by page size and the path's bytes (the hashes
    are a function of these alone), at most ``max_bytes`` of paths (least recently used first out):
    an eviction names the pages a store named before, and an extension's parent is the last page of
    a path stored before, so most pages are hashed once."""

    def __init__(self, max_bytes: int = 16 << 20):
        self.max_bytes = max_bytes
        self._paths: collections.OrderedDict[tuple[int, bytes], PathHashes] = collections.OrderedDict()
        self._bytes = 0
        self.hits = 0

    def get(self, page_size: int, path: bytes) -> PathHashes | None:
        known = self._paths.get((page_size, path))
        if known is not None:
            self._paths.move_to_end((page_size, path))
            self.hits += 1
        return known

    def put(self, page_size: int, path: bytes, known: PathHashes) -> None:
        if (page_size, path) in self._paths or len(path) > self.max_bytes:
            return
        self._paths[page_size, path] = known
        self._bytes += len(path)
        while self._bytes > self.max_bytes:
            (_, oldest), _ = self._paths.popitem(last=False)
            self._bytes -= len(oldest)


def _path_hashes(event: TierEvent, cache: KeyCache, pages_per_slice: int) -> Generator[None, None, PathHashes]:
    """The block hashes of the path's pages (from the cache where it can); yields after each
    ``pages_per_slice`` pages hashed (a path's keys chain from its first page)."""
    known = cache.get(event.page_size, event.path)
    if known is not None:
        return known
    page_bytes = event.page_size * TOKEN_BYTES
    prefix = cache.get(event.page_size, event.path[:event.start_page * page_bytes]) if event.start_page else None
    first_page = len(prefix.hashes) if prefix is not None else 0
    parent = prefix.last_key if prefix is not None else ROOT_KEY
    keys: list[bytes] = []
    for page in range(first_page, event.end_page):
        parent = page_key(parent, event.path[page * page_bytes:(page + 1) * page_bytes])
        keys.append(parent)
        if len(keys) % pages_per_slice == 0:
            yield
    # vLLM's int of each key (block_hash), all in one pass: the last 8 bytes, big-endian.
    hashes = np.frombuffer(b"".join(keys), dtype=">u8")[1::2].astype(np.uint64)
    if prefix is not None:
        hashes = np.concatenate([prefix.hashes, hashes])
    known = PathHashes(hashes, parent)
    cache.put(event.page_size, event.path, known)
    return known


# msgpack as msgspec writes vLLM's structs: each int in its shortest form, a map's keys in field order.
_PACKER = msgpack.Packer(use_bin_type=True)
_KEYS = {key: _PACKER.pack(key) for key in ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                            "lora_id", "medium", "lora_name", "locality", "ownership")}


def _pack_ints(values: np.ndarray, per_slice: int) -> Generator[None, None, bytes]:
    """A msgpack array of these ints, as msgpack packs their list; yields after each ``per_slice``
    (arrays concatenate: one header, then each element's own encoding)."""
    parts = [_PACKER.pack_array_header(len(values))]
    for start in range(0, len(values), per_slice):
        chunk = values[start:start + per_slice].tolist()
        parts.append(_PACKER.pack(chunk)[len(_PACKER.pack_array_header(len(chunk))):])
        if start + per_slice < len(values):
            yield
    return b"".join(parts)


def _pack_map(fields: list[tuple[str, bytes]]) -> bytes:
    return _PACKER.pack_map_header(len(fields)) + b"".join(_KEYS[key] + value for key, value in fields)


def _event_body(event: TierEvent, cache: KeyCache, pages_per_slice: int) -> Generator[None, None, bytes]:
    """The event's map, packed."""
    kind = _PACKER.pack(event.kind.value)
    if event.kind is EventKind.CLEARED:
        return _pack_map([("type", kind)])
    assert event.where is not None
    path_hashes = (yield from _path_hashes(event, cache, pages_per_slice)).hashes
    hashes = _PACKER.pack(path_hashes[event.start_page:].tolist())
    where = [("medium", _PACKER.pack(event.where.medium)), ("locality", _PACKER.pack(event.where.locality)),
             ("ownership", _PACKER.pack(OWNERSHIP))]
    if event.kind is EventKind.REMOVED:
        return _pack_map([("type", kind), ("block_hashes", hashes), *where])
    tokens = token_array(memoryview(event.path)[event.start_page * event.page_size * TOKEN_BYTES:])
    parent = int(path_hashes[event.start_page - 1]) if event.start_page else None
    none = _PACKER.pack(None)
    token_ids = yield from _pack_ints(tokens, pages_per_slice * event.page_size)
    return _pack_map([("type", kind), ("block_hashes", hashes), ("parent_block_hash", _PACKER.pack(parent)),
                      ("token_ids", token_ids),
                      ("block_size", _PACKER.pack(event.page_size)), ("lora_id", none), where[0],
                      ("lora_name", none), where[1], where[2]])


def encode_in_slices(events: Iterable[TierEvent], ts: float, cache: KeyCache | None = None,
                     pages_per_slice: int = 16) -> Generator[None, None, list[tuple[str, bytes]]]:
    """One ``KVEventBatch`` per model, in the order each model first appears: (model_id, payload),
    returned once done; yields after each ``pages_per_slice`` pages hashed and after each event
    packed, so that its caller can serve requests between slices."""
    cache = cache if cache is not None else KeyCache()
    per_model: dict[str, list[bytes]] = {}
    for event in events:
        body = yield from _event_body(event, cache, pages_per_slice)
        per_model.setdefault(event.model_id, []).append(body)
        yield
    head = _PACKER.pack_array_header(3) + _PACKER.pack(float(ts))
    return [(model_id, head + _PACKER.pack_array_header(len(bodies)) + b"".join(bodies) + _PACKER.pack(None))
            for model_id, bodies in per_model.items()]


def encode_batches(events: Iterable[TierEvent], ts: float) -> list[tuple[str, bytes]]:
    """``encode_in_slices`` at once."""
    slices = encode_in_slices(events, ts)
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value
