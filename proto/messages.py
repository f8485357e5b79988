"""Message kinds and the KV geometry that defines a namespace."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from proto.errors import ErrorCode, ProtocolError, preview

PROTOCOL_VERSION = 1

# Bytes per element of each dtype an engine may attach with (torch dtype names).
DTYPE_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


class MsgKind(enum.IntEnum):
    # requests (engine -> daemon)
    ATTACH = 1
    DETACH = 2
    HEARTBEAT = 3
    MATCH = 4
    RELEASE = 5
    BACKUP_RESERVE = 6
    BACKUP_COMMIT = 7
    STATUS = 8
    ENGINE_REPORT = 9      # engine facts for status: transfer backends and their timings
    RESERVE_PAGES = 10     # a standing lease on private L2 pages, for backups written before their commit
    COMMIT_PAGES = 11      # publish pages of a standing lease as pages of a prefix
    # replies (daemon -> engine)
    REPLY = 64
    ERROR = 65


@dataclasses.dataclass(frozen=True)
class KVGeometry:
    """What makes KV pages interchangeable: engines share pages only if these are equal."""

    model_id: str
    num_layers: int
    num_kv_heads: int      # heads held by this tensor-parallel rank
    head_dim: int
    dtype: str             # a torch dtype name, e.g. "bfloat16"
    page_size: int         # tokens per page
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """One L2 page: [K/V, layer, token_in_page, kv_head, head_dim]."""
        return (2, self.num_layers, self.page_size, self.num_kv_heads, self.head_dim)

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, body: Any) -> "KVGeometry":
        if not isinstance(body, dict):
            raise ProtocolError(ErrorCode.BAD_FRAME, "geometry must be a map")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(body) - set(fields)
        if unknown:
            raise ProtocolError(ErrorCode.BAD_FRAME,
                                f"unknown geometry fields {preview(sorted(map(str, unknown)))}")
        values: dict[str, Any] = {}
        for name in fields:
            if name not in body:
                if name in ("tp_rank", "tp_size"):
                    continue
                raise ProtocolError(ErrorCode.BAD_FRAME, f"geometry is missing {name!r}")
            values[name] = body[name]
        geometry = cls(**values)
        geometry.validate()
        return geometry

    def validate(self) -> None:
        def bad(message: str) -> ProtocolError:
            return ProtocolError(ErrorCode.GEOMETRY_MISMATCH, message)

        if not isinstance(self.model_id, str) or not 0 < len(self.model_id) <= 256:
            raise bad("model_id must be a string of 1..256 characters")
        for name, upper in (("num_layers", 1024), ("num_kv_heads", 1024), ("head_dim", 4096),
                            ("page_size", 4096), ("tp_size", 1024)):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= upper:
                raise bad(f"{name} must be an integer in 1..{upper}, got {preview(value)}")
        if type(self.tp_rank) is not int or not 0 <= self.tp_rank < self.tp_size:
            raise bad(f"tp_rank must be in 0..tp_size-1, got {preview(self.tp_rank)}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_ITEMSIZE:
            raise bad(f"dtype must be one of {sorted(DTYPE_ITEMSIZE)}, got {preview(self.dtype)}")
