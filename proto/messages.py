"""Message kinds and the KV geometry that defines a namespace."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

from proto.errors import ErrorCode, ProtocolError, preview

# Version 2 replaced MATCH and BACKUP_COMMIT by LOOKUP, ACQUIRE and COMMIT. An ATTACH of another
# version is refused with one error naming both; a frame of a retired kind names its version.
PROTOCOL_VERSION = 2


def mismatch_advice(engine_version: Any) -> str:
    """Which side to upgrade, from the engine's protocol version and the daemon's (PROTOCOL_VERSION)."""
    if type(engine_version) is int and engine_version > PROTOCOL_VERSION:
        return "upgrade the kvcached daemon to the engine's version"
    if type(engine_version) is int and engine_version < PROTOCOL_VERSION:
        return "upgrade the engine's kvcached-sidecar to the daemon's version"
    return "run the engine's kvcached-sidecar and the daemon at one version"

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
    # 4 was MATCH (protocol 1: LOOKUP and ACQUIRE in one verb with flags): never reuse
    RELEASE = 5            # end a lease, nothing published
    # 6 was BACKUP_RESERVE (protocol 1's MATCH with reserve_backup did it): never reuse
    # 7 was BACKUP_COMMIT (protocol 1: COMMIT is its successor): never reuse
    STATUS = 8
    ENGINE_REPORT = 9      # engine facts for status: transfer backends, the connector's counters
    # 10 and 11 were RESERVE_PAGES and COMMIT_PAGES (pages held ahead of backups): unused, never reuse
    PEER_REGISTER = 12     # the engine's KV tensors (CUDA IPC handles) and its GPU, for other engines to copy from
    PEER_PUBLISH = 13      # blocks of the engine's GPU cache that now hold pages, and blocks that no longer do
    PEER_LIST = 14         # the registrations of other engines of the namespace that this engine can open
    LOOKUP = 15            # the hit per tier and the decision for a prompt; changes nothing
    ACQUIRE = 16           # the request's lease: its L2 hit locked and, to save, pages reserved
    COMMIT = 17            # publish the written reserved pages; ends the lease
    # replies (daemon -> engine)
    REPLY = 64
    ERROR = 65
    SHUTDOWN = 66          # unsolicited (request_id 0), to each socket of a live session: the daemon is stopping


# Kinds of earlier protocols, by value: a frame of one is refused with its name and both versions.
RETIRED_KINDS = {4: "MATCH", 6: "BACKUP_RESERVE", 7: "BACKUP_COMMIT", 10: "RESERVE_PAGES", 11: "COMMIT_PAGES"}


# Which restores a lookup or acquire takes (their policy; the daemon's --restore-policy): "cost",
# those the cost model says beat recompute; "always", the longest hit; "never", none.
RESTORE_POLICIES = ("cost", "always", "never")
# What a decision chooses (the replies' choice): "engine", no tier holds more than the engine's own hit;
# "l2", "l3", "remote", restore from that tier (L3, remote: promoted to L2 first); "peer", copy from
# another engine's GPU cache (the reply's peer_* fields); "recompute", a tier holds more but
# restoring it does not pay (or the policy is never).
RESTORE_CHOICES = ("engine", "l2", "l3", "remote", "peer", "recompute")
# What an ACQUIRE promotes into L2 for its request (``proto.schema.Acquire.promote``):
# "none": nothing; the decision weighs L2 and peers only (a request whose first call is a save, or
#   an engine configured not to promote).
# "recompute": nothing now; the engine recomputes beyond its own hit (it predicted a decline,
#   ``proto.hints``), the decision still weighs every tier (counted as predicted), and an L3 hit
#   it declines may be promoted in the background, as after a LOOKUP with prefetch.
# "wait": what the decision restores from L3 or the remote store is promoted before the reply;
#   an L3 hit it declines may be promoted in the background.
PROMOTE_MODES = ("none", "recompute", "wait")

# The L2 page formats (KVGeometry.layout). "kv": K and V of a block apart, page [2, layers, *block];
# "blocks": each layer's block is opaque bytes (an engine that packs K and V inside it), page [layers, *block].
PAGE_LAYOUTS = ("kv", "blocks")
MAX_BLOCK_DIMS = 8
MAX_BLOCK_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class KVGeometry:
    """What makes KV pages interchangeable: engines share pages only if these are equal.

    The namespace key is the whole geometry: model and its revision, the KV shape per rank, the
    page format and the block's byte shape, and a cache salt (a LoRA adapter, a tenant), so that
    different fine-tunes, salts or page formats never share a page. ``block_shape`` is one block of
    one layer (of K or of V, for "kv") as the engine holds it in memory: its dims in memory order,
    the last in bytes. For "kv" the default, (page_size, num_kv_heads, head_dim * itemsize), is
    written () so that every engine with the usual block has the same key.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int      # heads held by this tensor-parallel rank
    head_dim: int
    dtype: str             # a torch dtype name, e.g. "bfloat16"
    page_size: int         # tokens per page
    tp_rank: int = 0
    tp_size: int = 1
    layout: str = "kv"                    # the L2 page format, one of PAGE_LAYOUTS
    block_shape: tuple[int, ...] = ()     # see above; required for "blocks"
    model_revision: str = ""
    cache_salt: str = ""

    def __post_init__(self) -> None:
        shape = tuple(self.block_shape) if isinstance(self.block_shape, list) else self.block_shape
        # A peer's geometry may be garbage until validate(): compare only well-typed values.
        well_typed = isinstance(self.dtype, str) and self.dtype in DTYPE_ITEMSIZE and all(
            type(value) is int for value in (self.page_size, self.num_kv_heads, self.head_dim))
        if shape and self.layout == "kv" and well_typed and shape == self.default_block_shape:
            shape = ()
        object.__setattr__(self, "block_shape", shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def default_block_shape(self) -> tuple[int, ...]:
        """One K (or V) block of one layer in the usual token-major layout, the last dim in bytes."""
        return (self.page_size, self.num_kv_heads, self.head_dim * DTYPE_ITEMSIZE[self.dtype])

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (of K or V for "kv")."""
        return math.prod(self.block_shape or self.default_block_shape)

    @property
    def bytes_per_page(self) -> int:
        return (2 if self.layout == "kv" else 1) * self.num_layers * self.block_bytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token of a page (a page's bytes over its tokens, for "blocks" too)."""
        return self.bytes_per_page // self.page_size

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One L2 page in dtype elements: [K/V, layer, *block] ("kv"; by default [2, layers,
        token_in_page, kv_head, head_dim]) or [layer, block elements] ("blocks")."""
        shape = self.block_shape or self.default_block_shape
        elements = shape[:-1] + (shape[-1] // self.itemsize,)
        if self.layout == "kv":
            return (2, self.num_layers, *elements)
        return (self.num_layers, math.prod(elements))

    def to_wire(self) -> dict[str, Any]:
        wire = dataclasses.asdict(self)
        wire["block_shape"] = list(self.block_shape)
        return wire

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
        for name, field in fields.items():
            if name not in body:
                if field.default is not dataclasses.MISSING:
                    continue
                raise ProtocolError(ErrorCode.BAD_FRAME, f"geometry is missing {name!r}")
            values[name] = body[name]
        shape = values.get("block_shape", ())
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_BLOCK_DIMS:
            raise ProtocolError(ErrorCode.GEOMETRY_MISMATCH,
                                f"block_shape must be a list of at most {MAX_BLOCK_DIMS} integers")
        values["block_shape"] = tuple(shape)
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
        for name in ("model_revision", "cache_salt"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > 256:
                raise bad(f"{name} must be a string of at most 256 characters")
        if self.layout not in PAGE_LAYOUTS:
            raise bad(f"layout must be one of {PAGE_LAYOUTS}, got {preview(self.layout)}")
        shape = self.block_shape
        if not isinstance(shape, tuple) or len(shape) > MAX_BLOCK_DIMS \
                or any(type(d) is not int or d < 1 for d in shape):
            raise bad(f"block_shape must be at most {MAX_BLOCK_DIMS} positive integers, got {preview(shape)}")
        if self.layout == "blocks" and not shape:
            raise bad("a \"blocks\" layout needs the block's byte shape (block_shape)")
        if shape:
            block_bytes = math.prod(shape)
            if block_bytes > MAX_BLOCK_BYTES:
                raise bad(f"a block of {block_bytes} bytes is larger than {MAX_BLOCK_BYTES}")
            # The L2 page is viewed in the KV dtype; a block is a whole number of its elements.
            if shape[-1] % self.itemsize:
                raise bad(f"the block's last dim ({shape[-1]} bytes) is not a whole number of "
                          f"{self.dtype} elements")
            if self.layout == "kv" and block_bytes != math.prod(self.default_block_shape):
                raise bad(f"a K or V block of {self.page_size} tokens, {self.num_kv_heads} heads of "
                          f"{self.head_dim} {self.dtype} has {math.prod(self.default_block_shape)} bytes, "
                          f"not {block_bytes} (block_shape {shape})")
