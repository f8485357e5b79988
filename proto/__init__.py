"""The wire contract between the kvcached daemon and engines: messages, codec, errors."""

from proto.errors import ErrorCode, ProtocolError
from proto.messages import PROTOCOL_VERSION, KVGeometry, MsgKind

__all__ = ["ErrorCode", "KVGeometry", "MsgKind", "PROTOCOL_VERSION", "ProtocolError"]
