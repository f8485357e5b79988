"""The remote tier (L4, a Mooncake Store shared by the hosts' daemons): what a stored page is
named and holds, and when the store is worth asking. Pure logic; the I/O is in
``kvcached/server/remote_store.py``.

A page is stored under ``kvc/<namespace key>/<chained page key>`` (``l3_index.namespace_key``,
``proto/page_keys.py``): the page key digests every token of the prefix up to and
including the page, so one key names one prefix's page of one geometry. Its value is a header
of ``HEADER_BYTES`` (magic, namespace key, page key, payload length, the payload's XXH3-64), then
the page's bytes. A reader publishes a page only if the header names the page it asked for and
the payload's checksum matches (XXH3 rather than the L3 file's crc32: it is several times faster on
a CPU, and a remote restore checks every byte it gets on the request's path): a page of another namespace, a torn or half-written value, or one
overwritten under the same key by a broken writer is dropped, never served.
"""

from __future__ import annotations

import dataclasses
import struct

import xxhash

from proto.page_keys import KEY_BYTES

MAGIC = b"KVCREM02"
_HEADER = struct.Struct("<8s16s16sQQ")          # magic, namespace key, page key, payload bytes, XXH3-64
HEADER_BYTES = 64                               # the header struct, padded to a cache line
NAMESPACE_KEY_BYTES = 16
assert _HEADER.size <= HEADER_BYTES and KEY_BYTES == 16


def checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def remote_key(namespace_key: str, page_key: bytes) -> str:
    """The store's key of one page of a namespace (namespace_key: 32 hex digits)."""
    return f"kvc/{namespace_key}/{page_key.hex()}"


def pack_header(namespace_key: str, page_key: bytes, payload: memoryview | bytes) -> bytes:
    """The header stored before a page's bytes; the checksum is computed over ``payload`` here."""
    header = _HEADER.pack(MAGIC, bytes.fromhex(namespace_key), page_key, len(payload), checksum(payload))
    return header.ljust(HEADER_BYTES, b"\0")


def header_mismatch(header: memoryview | bytes, namespace_key: str, page_key: bytes,
                    payload: memoryview | bytes) -> str:
    """Why a value read does not hold this page ("" when it does): its header must name this
    namespace and page and this payload length, and the payload's checksum must match."""
    if len(header) < HEADER_BYTES:
        return "short header"
    magic, namespace, key, length, crc = _HEADER.unpack_from(header)
    if magic != MAGIC:
        return "bad magic"
    if namespace != bytes.fromhex(namespace_key) or key != page_key:
        return "another page"
    if length != len(payload):
        return "another length"
    if checksum(payload) != crc:
        return "checksum"
    return ""


@dataclasses.dataclass
class Breaker:
    """Whether the store may be asked now. Closed: every call goes. After a failure (an error
    or a deadline missed) it opens: no request asks the store for ``backoff_s`` (doubled after
    each failed probe, up to ``max_backoff_s``); then one probe, off every request's path, may
    close it again. Times are the caller's monotonic seconds."""

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    open_until_s: float = 0.0
    failures: int = 0               # consecutive
    is_open: bool = False
    opened_total: int = 0

    def allows(self, now_s: float) -> bool:
        return not self.is_open

    def probe_due(self, now_s: float) -> bool:
        return self.is_open and now_s >= self.open_until_s

    def failed(self, now_s: float) -> None:
        if not self.is_open:
            self.opened_total += 1
        self.is_open = True
        self.failures += 1
        self.open_until_s = now_s + min(self.max_backoff_s, self.backoff_s * 2 ** (self.failures - 1))

    def succeeded(self) -> None:
        self.is_open, self.failures, self.open_until_s = False, 0, 0.0

    def status(self, now_s: float) -> dict:
        return {"state": "open" if self.is_open else "closed", "consecutive_failures": self.failures,
                "retry_in_s": round(max(0.0, self.open_until_s - now_s), 3) if self.is_open else 0.0,
                "opened_total": self.opened_total}
