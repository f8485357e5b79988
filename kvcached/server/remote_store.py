"""The remote tier's I/O: one Mooncake Store client (``MooncakeDistributedStore``), the threads its
calls run on, their deadlines and the breaker (``kvcached/core/remote.py``).

Every call runs on a worker of this module's pool, never on the socket thread or the event loop,
and its caller waits at most its deadline: a store whose master is gone blocks for seconds per call,
and gets from a host that died fail only after a long wait each. A call past its deadline, or failed,
opens the breaker: until a probe (``health_check``, off every request's path) finds the store
again, no request asks it, so an unreachable store costs a request a local miss and nothing more.
A call past its deadline still runs on its worker; a get's destination pages stay reserved until
it returns (the daemon's move ends only then), so a late get never lands in pages given out again.

Gets land in place: the daemon's L2 segment is registered with the client, and a page's value is
got into two buffers, its header (into this module's registered header area) and its bytes (into
the L2 page reserved for it). Puts send the same two parts from the same places.

The daemon maps its L2 segment in (``MADV_POPULATE_WRITE``, on a thread of its own at start, low
priority): the segment is populated without the daemon's mapping (``shm.py``), so a get would
otherwise take a page fault for every 4 KiB of a page it receives, on the request's path, which
slows a get into pages not touched since start well below the store's own get rate (bench_remote
records both). The cost moves to start and to exit (the daemon then unmaps what it mapped).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import os
import threading
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from kvcached.core import counters
from kvcached.core.remote import HEADER_BYTES, Breaker, header_mismatch, pack_header, remote_key
from proto.counters import Counter, Counts
from proto.page_keys import chain_page_keys

logger = logging.getLogger(__name__)

NUM_WORKERS = 4
MAX_PAGES_PER_CALL = 4096           # a worker's header area: MAX_PAGES_PER_CALL * HEADER_BYTES
CHECK_CHUNK_BYTES = 32 << 20        # a restore's gets are checked in chunks of this, while the next is got
LOCAL_BUFFER_BYTES = 16 << 20       # the client's own transfer buffer (we send from registered memory)
PROBE_TIMEOUT_S = 1.0
MAP_SLICE_BYTES = 64 << 20          # the segment is mapped in slices of this (close waits at most one)
MAP_NICENESS = 10                   # the mapping thread's: engines' and requests' threads go first
_MADV_POPULATE_WRITE = 23           # Linux 5.14; elsewhere gets fault pages in themselves
EXIST = 1                           # batch_is_exist: 1 held, 0 not held, < 0 an error
# Mooncake's error codes: -7xx are about one object (not found, its lease): a miss; -8xx (a
# transfer failed) and -9xx (an RPC failed) are the store's or a host's: a failure, the breaker opens.
FIRST_FAILURE_CODE = -800


def store_failed(codes: list[int]) -> bool:
    """Every one of a batch's results is a failure of the store, not a miss of one object."""
    return bool(codes) and all(code <= FIRST_FAILURE_CODE for code in codes)


class RemoteUnavailable(Exception):
    """The store was not asked (breaker open, not connected) or its call failed or was late."""


class RemoteSettings(NamedTuple):
    master: str                     # HOST:PORT
    metadata_server: str
    local_host: str
    segment_bytes: int
    exist_timeout_s: float
    get_timeout_s: float
    get_min_bytes_per_s: float


def _address(buffer: Any) -> int:
    view = np.frombuffer(buffer, dtype=np.uint8)
    address = view.ctypes.data
    del view                        # no export kept: the owner may close its mapping later
    return address


class RemoteStore:
    """The daemon's client of the store. ``segment``: the L2 mapping (registered for in-place
    gets and puts). Counters (``counters``) are this object's, under its own lock."""

    def __init__(self, settings: RemoteSettings, segment: Any, clock: Callable[[], float] = time.monotonic,
                 store_factory: Callable[[], Any] | None = None):
        self.settings = settings
        self.clock = clock
        self._store_factory = store_factory or mooncake_store
        self._segment_address = _address(segment)
        self._segment_bytes = len(segment)
        self._lock = threading.Lock()
        self.breaker = Breaker(is_open=True)    # not connected yet: the first probe connects
        self.counters = Counts(counters.REMOTE)
        self._store: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="kvcached-remote")
        self._probe = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcached-remote-probe")
        self._checker = concurrent.futures.ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="kvcached-remote-check")
        self._probing: concurrent.futures.Future | None = None
        self._headers = np.zeros((NUM_WORKERS + 1, MAX_PAGES_PER_CALL, HEADER_BYTES), dtype=np.uint8)
        self._local = threading.local()
        self._next_area = 0
        self._closed = False
        self._mapper = threading.Thread(target=self._map_segment, name="kvcached-remote-map", daemon=True)
        self._mapper.start()

    # ---- counters and state -------------------------------------------------------------------

    def count(self, counter: Counter, value: float = 1, label: str = "") -> None:
        with self._lock:
            self.counters.add(counter, value, label)

    def available(self) -> bool:
        """Whether a request may ask the store now (connected, breaker closed)."""
        with self._lock:
            return self._store is not None and self.breaker.allows(self.clock())

    def note_failure(self, what: str, why: str) -> None:
        """A call failed or missed its deadline: counted, and the breaker opens."""
        self._failed(what, why)

    def _failed(self, what: str, why: str) -> None:
        with self._lock:
            was_open = self.breaker.is_open
            self.breaker.failed(self.clock())
            retry_s = self.breaker.open_until_s - self.clock()
        self.count(counters.REMOTE_ERRORS, 1, what)
        if not was_open:
            logger.warning("remote store: %s failed (%s); requests skip it for %.1f s, then it is probed", what,
                           why, retry_s)

    def status(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(sorted(self.counters.items()))
            return {"master": self.settings.master, "metadata_server": self.settings.metadata_server,
                    "segment_bytes": self.settings.segment_bytes, "connected": self._store is not None,
                    "exist_timeout_s": self.settings.exist_timeout_s, "get_timeout_s": self.settings.get_timeout_s,
                    **self.breaker.status(self.clock()), "counters": counts}

    # ---- connecting and probing (off every request's path) ----------------------------------

    def probe_if_due(self) -> None:
        """Called by the server's timer: while the breaker is open and its backoff over, probe (and
        connect, the first time) on the probe thread."""
        with self._lock:
            if self._closed or (self._probing is not None and not self._probing.done()) or \
                    not self.breaker.probe_due(self.clock()):
                return
            self._probing = self._probe.submit(self._probe_now)

    def _probe_now(self) -> None:
        try:
            if self._store is None:
                store = self._connect()
                with self._lock:
                    self._store = store
            else:
                future = self._pool.submit(self._store.health_check)
                code = future.result(PROBE_TIMEOUT_S)
                if code != 0:
                    raise RemoteUnavailable(f"health_check returned {code}")
        except Exception as exc:        # concurrent.futures.TimeoutError included
            with self._lock:
                self.breaker.failed(self.clock())
            self.count(counters.REMOTE_PROBE_FAILURES)
            logger.debug("remote store probe failed: %s", exc)
            return
        with self._lock:
            was_failing = self.breaker.failures > 1
            self.breaker.succeeded()
        if was_failing:
            logger.warning("remote store at %s reachable again", self.settings.master)

    def _map_segment(self) -> None:
        """Thread: map the L2 segment's pages into this process, slice by slice, until done or
        closed (see the module's note)."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MAP_NICENESS)
        except (AttributeError, OSError):
            pass
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            madvise = libc.madvise
        except (OSError, AttributeError):
            return
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
        started_s = time.perf_counter()
        for offset in range(0, self._segment_bytes, MAP_SLICE_BYTES):
            if self._closed:
                return
            length = min(MAP_SLICE_BYTES, self._segment_bytes - offset)
            if madvise(self._segment_address + offset, length, _MADV_POPULATE_WRITE) != 0:
                logger.info("remote store: the L2 segment stays unmapped until gets touch it (madvise: %s)",
                            os.strerror(ctypes.get_errno()))
                return
        logger.info("remote store: the L2 segment (%d bytes) mapped in %.1f s", self._segment_bytes,
                    time.perf_counter() - started_s)

    def _connect(self) -> Any:
        store = self._store_factory()
        code = store.setup(self.settings.local_host, self.settings.metadata_server, self.settings.segment_bytes,
                           LOCAL_BUFFER_BYTES, "tcp", "", self.settings.master)
        if code != 0:
            raise RemoteUnavailable(f"setup returned {code}")
        for address, size in ((self._segment_address, self._segment_bytes),
                              (_address(self._headers), self._headers.nbytes)):
            code = store.register_buffer(address, size)
            if code != 0:
                raise RemoteUnavailable(f"register_buffer returned {code}")
        logger.info("remote store: connected to the master at %s (lending %d bytes)", self.settings.master,
                    self.settings.segment_bytes)
        self.count(counters.REMOTE_CONNECTS)
        return store

    def close(self) -> None:
        """Wait for the calls in flight (each returns within the store's own timeouts), then close
        the client; before the L2 mapping is closed."""
        with self._lock:
            self._closed = True
        self._mapper.join()
        self._probe.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._checker.shutdown(wait=True)
        if self._store is not None:
            try:
                self._store.close()
            except Exception as exc:
                logger.warning("remote store: close failed: %s", exc)
            self._store = None

    # ---- calls (each on a worker, each with its deadline) ------------------------------------

    def _header_area(self) -> np.ndarray:
        area = getattr(self._local, "area", None)
        if area is None:
            with self._lock:
                index, self._next_area = self._next_area, self._next_area + 1
            area = self._local.area = self._headers[index]
        return area

    def submit(self, what: str, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Start fn(store, *args) on a worker; RemoteUnavailable (counted) if the store may not be
        asked now."""
        with self._lock:
            store = self._store if self.breaker.allows(self.clock()) and not self._closed else None
        if store is None:
            self.count(counters.REMOTE_SKIPS, 1, what)
            raise RemoteUnavailable("the remote store is not reachable now")
        return self._pool.submit(fn, store, *args)

    async def wait(self, what: str, future: concurrent.futures.Future, timeout_s: float) -> Any:
        """The result of a call, waited for at most timeout_s; RemoteUnavailable if it failed or
        was late (the breaker opens). The worker may go on past the deadline."""
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except asyncio.TimeoutError:
            self.count(counters.REMOTE_DEADLINE_MISSES, 1, what)
            self._failed(what, f"no answer within {timeout_s} s")
            raise RemoteUnavailable(f"{what}: no answer within timeout_s={timeout_s}") from None
        except Exception as exc:
            self._failed(what, f"{type(exc).__name__}: {exc}")
            raise RemoteUnavailable(f"{what}: {exc}") from exc

    async def run(self, what: str, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """submit, then wait."""
        return await self.wait(what, self.submit(what, fn, *args), timeout_s)

    def get_timeout_s(self, num_bytes: int) -> float:
        return self.settings.get_timeout_s + num_bytes / self.settings.get_min_bytes_per_s

    def held_pages(self, store: Any, namespace_key: str, token_ids: np.ndarray, page_size: int,
                   start_page: int, end_page: int) -> int:
        """Worker: how many of pages [start_page, end_page) of the path the store holds, leading."""
        keys = chain_page_keys(token_ids, page_size, end_page)[start_page:end_page]
        held = 0
        for first in range(0, len(keys), MAX_PAGES_PER_CALL):
            batch = keys[first:first + MAX_PAGES_PER_CALL]
            answers = store.batch_is_exist([remote_key(namespace_key, key) for key in batch])
            if answers and all(a < 0 for a in answers):
                raise RemoteUnavailable(f"batch_is_exist returned {answers[0]}")
            for answer in answers:
                if answer != EXIST:
                    return held
                held += 1
        return held

    def get_pages(self, store: Any, namespace_key: str, token_ids: np.ndarray, page_size: int, start_page: int,
                  page_ids: list[int], bytes_per_page: int) -> tuple[int, str]:
        """Worker: get pages start_page.. of the path into L2 pages page_ids, in place; the leading
        pages whose values hold their header and checksum, and why the next one did not. Pipelined:
        the gets go in chunks of about CHECK_CHUNK_BYTES, and a chunk is checked on the checker
        threads (split among them) while the next one is got (the store's calls and XXH3 release
        the GIL)."""
        keys = chain_page_keys(token_ids, page_size, start_page + len(page_ids))[start_page:]
        area = self._header_area()
        area_address = _address(area)
        segment = np.ctypeslib.as_array((ctypes.c_uint8 * self._segment_bytes).from_address(self._segment_address))
        chunk = max(1, min(MAX_PAGES_PER_CALL, CHECK_CHUNK_BYTES // bytes_per_page))

        def check(first: int, num_pages: int) -> tuple[int, str]:
            for i in range(first, first + num_pages):
                page = page_ids[i]
                why = header_mismatch(area[i % MAX_PAGES_PER_CALL], namespace_key, keys[i],
                                      segment[page * bytes_per_page:(page + 1) * bytes_per_page])
                if why:
                    return i - first, why
            return num_pages, ""

        checks: list[tuple[int, concurrent.futures.Future]] = []     # (pages, their check), in page order
        store_s = 0.0
        try:
            for first in range(0, len(keys), chunk):
                if first % MAX_PAGES_PER_CALL == 0:
                    for _, pending in checks:      # the header slots are reused: their checks first
                        pending.result()
                last = min(len(keys), first + chunk, (first // MAX_PAGES_PER_CALL + 1) * MAX_PAGES_PER_CALL)
                names = [remote_key(namespace_key, key) for key in keys[first:last]]
                pointers = [[area_address + (i % MAX_PAGES_PER_CALL) * HEADER_BYTES,
                             self._segment_address + page_ids[i] * bytes_per_page] for i in range(first, last)]
                started_s = time.perf_counter()
                got = store.batch_get_into_multi_buffers(names, pointers, [[HEADER_BYTES, bytes_per_page]] * len(names))
                store_s += time.perf_counter() - started_s
                num_got = next((i for i, size in enumerate(got) if size != HEADER_BYTES + bytes_per_page), len(got))
                if num_got == 0 and first == 0 and store_failed(got):
                    raise RemoteUnavailable(f"batch_get_into_multi_buffers returned {got[0]}")
                piece = max(1, -(-num_got // NUM_WORKERS))     # checked on every checker at once
                for start in range(first, first + num_got, piece):
                    num_pages = min(piece, first + num_got - start)
                    checks.append((num_pages, self._checker.submit(check, start, num_pages)))
                if num_got < len(got):     # gone meanwhile (evicted, its host died) or short: a miss from here
                    break
            verified = 0
            for num_got, pending in checks:
                num_ok, why = pending.result()
                verified += num_ok
                if why or num_ok < num_got:
                    return verified, why
            return verified, ""
        finally:
            for _, pending in checks:           # the pages stay private until every check has run
                concurrent.futures.wait([pending])
            self.count(counters.REMOTE_GET_STORE_SECONDS, store_s)

    def put_pages(self, store: Any, namespace_key: str, token_ids: np.ndarray, page_size: int, start_page: int,
                  page_ids: list[int], bytes_per_page: int, intact: Callable[[], int]) -> int:
        """Worker: store pages start_page.. of the path from L2 pages page_ids (headers computed from
        the bytes sent); ``intact()`` is how many leading pages still hold the bytes they were
        published with, asked before the headers and after the put (a page that changed is
        removed from the store again). The number of leading pages stored."""
        keys = chain_page_keys(token_ids, page_size, start_page + len(page_ids))[start_page:]
        area = self._header_area()
        area_address = _address(area)
        segment = np.ctypeslib.as_array((ctypes.c_uint8 * self._segment_bytes).from_address(self._segment_address))
        stored = 0
        for first in range(0, len(keys), MAX_PAGES_PER_CALL):
            num_intact = intact() - first
            batch_keys = keys[first:first + min(MAX_PAGES_PER_CALL, max(0, num_intact))]
            batch_pages = page_ids[first:first + len(batch_keys)]
            if not batch_keys:
                break
            for i, (key, page) in enumerate(zip(batch_keys, batch_pages)):
                payload = segment[page * bytes_per_page:(page + 1) * bytes_per_page]
                area[i] = np.frombuffer(pack_header(namespace_key, key, payload), dtype=np.uint8)
            names = [remote_key(namespace_key, key) for key in batch_keys]
            pointers = [[area_address + i * HEADER_BYTES, self._segment_address + page * bytes_per_page]
                        for i, page in enumerate(batch_pages)]
            sizes = [[HEADER_BYTES, bytes_per_page]] * len(names)
            codes = store.batch_put_from_multi_buffers(names, pointers, sizes)
            still = intact() - first
            for i, code in enumerate(codes):
                if i >= still:          # rewritten while sent: take it back (its header would not match anyway)
                    store.remove(names[i])
                    return stored
                if code != 0:
                    if stored == 0 and store_failed(codes):
                        raise RemoteUnavailable(f"batch_put_from_multi_buffers returned {code}")
                    return stored
                stored += 1
            if len(batch_keys) < MAX_PAGES_PER_CALL:
                break
        return stored


def mooncake_store() -> Any:
    """A new client of the store (the wheel is the ``remote`` extra, imported only with the tier on)."""
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore()
