"""Frames on the wire: one msgpack array ``[kind, request_id, body]`` per ZeroMQ message.

Decoding is strict: a peer's frame is refused with a typed ``ProtocolError`` when it is too
large, not msgpack, not the right shape, or of an unknown kind. Bodies are validated against
the schemas in ``proto.schema`` by the receiver.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack

from proto.errors import ErrorCode, ProtocolError, cap_message, preview
from proto.messages import PROTOCOL_VERSION, RETIRED_KINDS, MsgKind, mismatch_advice

DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_REQUEST_ID = 2**63 - 1


_KIND_BY_VALUE = {int(kind): kind for kind in MsgKind}   # a dict lookup is cheaper than MsgKind(value)


class Frame(NamedTuple):
    kind: MsgKind
    request_id: int
    body: dict[str, Any]


def encode(kind: MsgKind, request_id: int, body: dict[str, Any]) -> bytes:
    return msgpack.packb([int(kind), request_id, body], use_bin_type=True)


def decode(data: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    if len(data) > max_frame_bytes:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE,
                            f"frame of {len(data)} bytes exceeds max_frame_bytes={max_frame_bytes}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True,
                              max_bin_len=max_frame_bytes, max_str_len=max_frame_bytes)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(ErrorCode.BAD_FRAME, f"not a msgpack frame: {exc}") from None
    if not isinstance(obj, list) or len(obj) != 3:
        raise ProtocolError(ErrorCode.BAD_FRAME, "a frame is a 3-element array [kind, request_id, body]")
    kind, request_id, body = obj
    if type(request_id) is not int or not 0 <= request_id <= MAX_REQUEST_ID:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"request_id must be a non-negative integer, got {preview(request_id)}")
    if type(kind) is not int:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"kind must be an integer, got {preview(kind)}")
    known_kind = _KIND_BY_VALUE.get(kind)
    if known_kind is None:
        retired = RETIRED_KINDS.get(kind)
        if retired is not None:         # a peer of an earlier protocol: say so, never guess
            raise ProtocolError(ErrorCode.UNKNOWN_KIND,
                                f"message kind {kind} ({retired}) is not in protocol {PROTOCOL_VERSION}, the "
                                f"daemon's: {mismatch_advice(PROTOCOL_VERSION - 1)}")   # its sender is older
        raise ProtocolError(ErrorCode.UNKNOWN_KIND, f"unknown message kind {kind}")
    kind = known_kind
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "body must be a map")
    return Frame(kind, request_id, body)


def peek_request_id(data: bytes) -> int:
    """Best-effort request id of a frame that failed to decode, so the error reply can name it."""
    try:
        obj = msgpack.unpackb(data, raw=False)
        if isinstance(obj, list) and len(obj) >= 2 and type(obj[1]) is int and 0 <= obj[1] <= MAX_REQUEST_ID:
            return obj[1]
    except Exception:
        pass
    return 0


def error_body(code: ErrorCode, message: str) -> dict[str, Any]:
    """Every error reply's body; its message is capped, whatever it quotes."""
    return {"code": int(code), "message": cap_message(message)}
