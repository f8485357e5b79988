"""Error codes carried by error replies, and the typed error a bad peer input raises."""

from __future__ import annotations

import enum
import itertools


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


# An error reply or log line never carries more of a peer's input than this: a peer's 1 MB value
# must not come back as a 2 MB reply, nor fill the daemon's log.
MAX_ERROR_MESSAGE_CHARS = 1024
MAX_PREVIEW_CHARS = 64


def preview(value: object, max_chars: int = MAX_PREVIEW_CHARS) -> str:
    """A peer's value as it may appear in a message: its repr, cut to max_chars, with its type and
    length where it was cut. Only the head of a long value is formatted."""
    sized = isinstance(value, (bytes, bytearray, str, list, tuple, dict))
    if isinstance(value, dict):
        head: object = dict(itertools.islice(value.items(), max_chars))
    elif sized:
        head = value[:max_chars]
    else:
        head = value
    try:
        text = repr(head)
    except Exception:             # a repr that fails is no reason to fail the error reply
        text = f"<{type(value).__name__}>"
    if len(text) <= max_chars and (not sized or len(value) <= max_chars):
        return text
    length = f" of length {len(value)}" if sized else ""
    return f"{text[:max_chars]}... ({type(value).__name__}{length})"


def cap_message(message: str) -> str:
    """A message cut to MAX_ERROR_MESSAGE_CHARS, saying how much was cut."""
    if len(message) <= MAX_ERROR_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_ERROR_MESSAGE_CHARS]}... ({len(message) - MAX_ERROR_MESSAGE_CHARS} characters cut)"


class ProtocolError(Exception):
    """A peer sent something we refuse; becomes an error reply to that peer only. The message is
    capped at MAX_ERROR_MESSAGE_CHARS, whatever it quotes."""

    def __init__(self, code: ErrorCode, message: str):
        message = cap_message(str(message))
        super().__init__(f"{code.name}: {message}")
        self.code = ErrorCode(code)
        self.message = message
