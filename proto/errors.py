"""Error codes carried by error replies, and the typed error a bad peer input raises."""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    BAD_FRAME = 1            # not msgpack, wrong shape, or a field of the wrong type
    UNKNOWN_KIND = 2
    VERSION_MISMATCH = 3
    GEOMETRY_MISMATCH = 4    # the geometry is invalid or does not fit the pool
    NOT_ATTACHED = 5         # unknown or expired session
    BAD_PAGES = 6            # page ids out of range or malformed
    NOT_LEASED = 7           # pages or lease not held by the caller
    UNKNOWN_LEASE = 8        # lease already ended (released twice, committed, reclaimed)
    FRAME_TOO_LARGE = 9
    OUT_OF_SPACE = 10
    SHUTTING_DOWN = 11
    INTERNAL = 12


class ProtocolError(Exception):
    """A peer sent something we refuse; becomes an error reply to that peer only."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = ErrorCode(code)
        self.message = message
