"""Request bodies and their validation.

Every field a peer sends is checked here, on the receiving side, before any state is touched.
New fields go last and carry defaults, so older peers keep working; a field a request does not
define is ignored (a newer peer's). No field's meaning depends on another's: each verb is one intent.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import msgpack

from proto.errors import ErrorCode, ProtocolError, preview
from proto.messages import PROMOTE_MODES, PROTOCOL_VERSION, RESTORE_POLICIES, KVGeometry, MsgKind, mismatch_advice
from proto.tokens import TOKEN_BYTES

MAX_TOKENS_PER_REQUEST = 1 << 20          # 4 MiB of int32 token ids
MAX_PAGE_IDS_PER_REQUEST = 1 << 20
MAX_ID = 2**63 - 1
# Linux pids are below PID_MAX_LIMIT (2^22, the most pid_max can be set to on 64-bit), and above 0.
MAX_PID = (1 << 22) - 1


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_FRAME, message)


def _int(body: dict, name: str, lo: int = 0, hi: int = MAX_ID, default: Any = dataclasses.MISSING) -> int:
    value = body.get(name, default)
    if value is dataclasses.MISSING:
        raise _bad(f"missing field {name!r}")
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(f"{name} must be an integer in {lo}..{hi}, got {preview(value)}")
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if type(value) is not bool:
        raise _bad(f"{name} must be a boolean, got {preview(value)}")
    return value


def _str(body: dict, name: str, max_len: int, default: Any = dataclasses.MISSING) -> str:
    value = body.get(name, default)
    if value is dataclasses.MISSING:
        raise _bad(f"missing field {name!r}")
    if not isinstance(value, str) or len(value) > max_len:
        raise _bad(f"{name} must be a string of at most {max_len} characters")
    return value


def _token_bytes(body: dict, name: str) -> bytes:
    value = body.get(name)
    if not isinstance(value, bytes):
        raise _bad(f"{name} must be bytes of little-endian int32 token ids")
    if len(value) % TOKEN_BYTES:
        raise _bad(f"{name} has {len(value)} bytes, not a multiple of {TOKEN_BYTES}")
    if len(value) // TOKEN_BYTES > MAX_TOKENS_PER_REQUEST:
        raise _bad(f"{name} holds more than {MAX_TOKENS_PER_REQUEST} tokens")
    return value


def _page_ids(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if not isinstance(value, list) or len(value) > MAX_PAGE_IDS_PER_REQUEST:
        raise _bad(f"{name} must be a list of at most {MAX_PAGE_IDS_PER_REQUEST} page ids")
    for page_id in value:
        if type(page_id) is not int:
            raise _bad(f"{name} must hold integers, got {preview(page_id)}")
    return value




def check_protocol_version(body: dict) -> None:
    """An ATTACH of another protocol version is refused before anything else of it is read (its
    other fields may mean something else): one error naming both versions."""
    version = body.get("protocol_version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.VERSION_MISMATCH,
                            f"protocol version mismatch: daemon speaks {PROTOCOL_VERSION}, engine sent "
                            f"{preview(version)}; {mismatch_advice(version)}")


@dataclasses.dataclass(frozen=True)
class Attach:
    kind: ClassVar[MsgKind] = MsgKind.ATTACH
    protocol_version: int
    pid: int
    geometry: KVGeometry
    client_name: str = ""
    # Which process this is, so that the daemon can watch it exit (0: unknown, heartbeats only):
    # the inode of its pid namespace and its start time (field 22 of /proc/self/stat).
    pid_namespace_id: int = 0
    process_start_time: int = 0
    # A session of this process that it has given up, every transfer into its pages drained: the
    # daemon ends it, or frees its quarantined pages (0: none).
    previous_session_id: int = 0

    @classmethod
    def parse(cls, body: dict) -> "Attach":
        return cls(
            protocol_version=_int(body, "protocol_version", 0, 2**31),
            pid=_int(body, "pid", 1, MAX_PID),
            geometry=KVGeometry.from_wire(body.get("geometry")),
            client_name=_str(body, "client_name", 256, ""),
            pid_namespace_id=_int(body, "pid_namespace_id", default=0),
            process_start_time=_int(body, "process_start_time", default=0),
            previous_session_id=_int(body, "previous_session_id", default=0),
        )


@dataclasses.dataclass(frozen=True)
class SessionRequest:
    """Detach and heartbeat: just the session."""

    session_id: int

    @classmethod
    def parse(cls, body: dict) -> "SessionRequest":
        return cls(session_id=_int(body, "session_id"))


def _policy(body: dict) -> str:
    policy = _str(body, "policy", 16, "")
    if policy and policy not in RESTORE_POLICIES:
        raise _bad(f"policy must be one of {RESTORE_POLICIES} (or empty: the daemon's), got {preview(policy)}")
    return policy


def _local_hit_tokens(body: dict) -> int:
    return _int(body, "local_hit_tokens", 0, MAX_TOKENS_PER_REQUEST, default=0)


@dataclasses.dataclass(frozen=True)
class Lookup:
    """The hit per tier of a prompt and the cost model's decision for it. Changes nothing: no
    lease, no lock, no reservation, no LRU update, no page ids."""

    kind: ClassVar[MsgKind] = MsgKind.LOOKUP
    session_id: int
    token_ids: bytes
    # Leading tokens the engine holds itself (its GPU cache): the cost model prices what lies beyond.
    local_hit_tokens: int = 0
    # The restore policy for this request, one of RESTORE_POLICIES ("": the daemon's).
    policy: str = ""
    # The hit of the session's whole tensor-parallel group: per tier the least over its ranks'
    # namespaces (0 while a rank has none): a prefix is cached only where every rank holds its shard.
    tp_group: bool = False
    # What an engine's lookups ask: the lookup stands for a restore that may come from below L2, so
    # L3 is a candidate of the decision (as for an ACQUIRE that promotes) and, for one rank (a
    # group's ranks promote their own shards), the remote store is asked and an L3 hit the decision
    # declines may be promoted in the background. False (a tool reading the hits): the decision
    # weighs L2 and peers only.
    prefetch: bool = False

    @classmethod
    def parse(cls, body: dict) -> "Lookup":
        return cls(
            session_id=_int(body, "session_id"),
            token_ids=_token_bytes(body, "token_ids"),
            local_hit_tokens=_local_hit_tokens(body),
            policy=_policy(body),
            tp_group=_bool(body, "tp_group", False),
            prefetch=_bool(body, "prefetch", False),
        )


@dataclasses.dataclass(frozen=True)
class Acquire:
    """The request's lease: its L2 hit locked (what its loads read) and, with ``save``, private L2
    pages reserved for the pages the daemon lacks (what its saves write, then COMMIT publishes)."""

    kind: ClassVar[MsgKind] = MsgKind.ACQUIRE
    session_id: int
    token_ids: bytes
    local_hit_tokens: int = 0      # as for Lookup
    policy: str = ""               # as for Lookup
    save: bool = False
    promote: str = "none"          # one of PROMOTE_MODES (proto.messages)

    @classmethod
    def parse(cls, body: dict) -> "Acquire":
        promote = _str(body, "promote", 16, "none")
        if promote not in PROMOTE_MODES:
            raise _bad(f"promote must be one of {PROMOTE_MODES}, got {preview(promote)}")
        return cls(
            session_id=_int(body, "session_id"),
            token_ids=_token_bytes(body, "token_ids"),
            local_hit_tokens=_local_hit_tokens(body),
            policy=_policy(body),
            save=_bool(body, "save", False),
            promote=promote,
        )


@dataclasses.dataclass(frozen=True)
class Release:
    kind: ClassVar[MsgKind] = MsgKind.RELEASE
    session_id: int
    lease_id: int
    ack: bool = True          # False: reply only on error (the engine does not wait for it)

    @classmethod
    def parse(cls, body: dict) -> "Release":
        return cls(session_id=_int(body, "session_id"), lease_id=_int(body, "lease_id"),
                   ack=_bool(body, "ack", True))


@dataclasses.dataclass(frozen=True)
class Commit:
    kind: ClassVar[MsgKind] = MsgKind.COMMIT
    session_id: int
    lease_id: int
    page_ids: list[int]        # the reserved pages that were written, a prefix of the reservation, in order
    ack: bool = True

    @classmethod
    def parse(cls, body: dict) -> "Commit":
        return cls(
            session_id=_int(body, "session_id"),
            lease_id=_int(body, "lease_id"),
            page_ids=_page_ids(body, "page_ids"),
            ack=_bool(body, "ack", True),
        )


MAX_REPORT_BYTES = 64 * 1024
# Timings an engine measured for the cost model, per report: [direction, size, seconds] each, size in
# bytes (h2d: L2 -> GPU, d2h: GPU -> L2, d2d: another engine's GPU memory -> this one's) or tokens
# (prefill).
COST_SAMPLE_DIRECTIONS = ("h2d", "d2h", "d2d", "prefill")
MAX_COST_SAMPLES = 1024
MAX_COST_SAMPLE_SIZE = 1 << 50
MAX_COST_SAMPLE_SECONDS = 3600.0


def _cost_samples(body: dict) -> tuple[tuple[str, int, float], ...]:
    value = body.get("cost_samples", [])
    if not isinstance(value, list) or len(value) > MAX_COST_SAMPLES:
        raise _bad(f"cost_samples must be a list of at most {MAX_COST_SAMPLES} [direction, size, seconds]")
    samples = []
    for sample in value:
        if not (isinstance(sample, list) and len(sample) == 3 and sample[0] in COST_SAMPLE_DIRECTIONS
                and type(sample[1]) is int and 0 <= sample[1] <= MAX_COST_SAMPLE_SIZE
                and type(sample[2]) in (int, float) and 0 <= sample[2] <= MAX_COST_SAMPLE_SECONDS):
            raise _bad(f"a cost sample must be [one of {COST_SAMPLE_DIRECTIONS}, a size in 0..{MAX_COST_SAMPLE_SIZE}, "
                       f"seconds in 0..{MAX_COST_SAMPLE_SECONDS}], got {preview(sample)}")
        samples.append((sample[0], sample[1], float(sample[2])))
    return tuple(samples)


@dataclasses.dataclass(frozen=True)
class EngineReport:
    kind: ClassVar[MsgKind] = MsgKind.ENGINE_REPORT
    session_id: int
    report: dict           # free-form facts, shown as-is in the daemon's status
    ack: bool = True
    cost_samples: tuple[tuple[str, int, float], ...] = ()     # fed to the cost model, not shown

    @classmethod
    def parse(cls, body: dict) -> "EngineReport":
        report = body.get("report")
        if not isinstance(report, dict):
            raise _bad("report must be a map")
        if len(msgpack.packb(report, use_bin_type=True)) > MAX_REPORT_BYTES:
            raise _bad(f"report is larger than {MAX_REPORT_BYTES} bytes")
        return cls(session_id=_int(body, "session_id"), report=report, ack=_bool(body, "ack", True),
                   cost_samples=_cost_samples(body))


# ---- peer restores: engines copying prefixes out of each other's GPU memory -------------------------

MAX_PEER_BLOCKS = 1 << 22              # blocks of one engine's KV tensors
MAX_PEER_TENSORS = 4096                # KV tensors (one per layer, or one pool) of one engine
MAX_PEER_STORAGES = 4096
MAX_TENSOR_DIMS = 8
MAX_HANDLE_FIELDS = 16
MAX_HANDLE_VALUE_BYTES = 1024
PEER_TRANSPORTS = ("cuda", "host")     # CUDA IPC memory handles; host shared memory (CPU engines, tests)


def _handle(value: Any, name: str) -> dict:
    """A storage's handle: a small map of scalars and short byte strings, opaque to the daemon
    (only an engine that opens it interprets it)."""
    if not isinstance(value, dict) or len(value) > MAX_HANDLE_FIELDS:
        raise _bad(f"{name} must be a map of at most {MAX_HANDLE_FIELDS} fields")
    for key, item in value.items():
        if not isinstance(key, str) or len(key) > 64:
            raise _bad(f"{name} keys must be short strings")
        if item is not None and type(item) not in (bool, int, str, bytes):
            raise _bad(f"{name}[{key!r}] must be a scalar or bytes, got {preview(item)}")
        if isinstance(item, (str, bytes)) and len(item) > MAX_HANDLE_VALUE_BYTES:
            raise _bad(f"{name}[{key!r}] is longer than {MAX_HANDLE_VALUE_BYTES}")
        if type(item) is int and not -MAX_ID - 1 <= item <= MAX_ID:
            raise _bad(f"{name}[{key!r}] is out of range")
    return value


def _int_list(value: Any, name: str, max_len: int, lo: int = 0, hi: int = MAX_ID) -> list[int]:
    if not isinstance(value, list) or len(value) > max_len:
        raise _bad(f"{name} must be a list of at most {max_len} integers")
    for item in value:
        if type(item) is not int or not lo <= item <= hi:
            raise _bad(f"{name} must hold integers in {lo}..{hi}, got {preview(item)}")
    return value


@dataclasses.dataclass(frozen=True)
class PeerTensor:
    """One KV tensor as a view of one of the registration's storages (in elements of its dtype)."""

    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def parse(cls, body: Any, num_storages: int) -> "PeerTensor":
        if not isinstance(body, dict):
            raise _bad("a peer tensor must be a map")
        shape = _int_list(body.get("shape"), "shape", MAX_TENSOR_DIMS, 0, 2**40)
        stride = _int_list(body.get("stride"), "stride", MAX_TENSOR_DIMS, 0, 2**48)
        if len(shape) != len(stride) or not shape:
            raise _bad("a peer tensor's shape and stride must have one length, at least 1")
        return cls(storage=_int(body, "storage", 0, num_storages - 1), offset=_int(body, "offset", 0, 2**48),
                   shape=tuple(shape), stride=tuple(stride))

    def to_wire(self) -> dict[str, Any]:
        return {"storage": self.storage, "offset": self.offset, "shape": list(self.shape), "stride": list(self.stride)}


@dataclasses.dataclass(frozen=True)
class PeerRegister:
    """An engine's KV tensors, for engines of its namespace on the same device to copy blocks from.
    The daemon checks the shapes of what it relays, never what the handles mean."""

    kind: ClassVar[MsgKind] = MsgKind.PEER_REGISTER
    session_id: int
    transport: str              # one of PEER_TRANSPORTS
    device_id: str              # "cuda": the GPU's UUID; "host": the boot id and pid namespace
    layout: str                 # the engine_client.layout kind of the tensors
    dtype: str                  # the tensors' torch dtype name
    num_blocks: int
    storages: list[dict]        # per storage, the transport's handle (opaque here)
    tensors: list[PeerTensor]   # the KV tensors, in the layout's order

    @classmethod
    def parse(cls, body: dict) -> "PeerRegister":
        transport = _str(body, "transport", 16)
        if transport not in PEER_TRANSPORTS:
            raise _bad(f"transport must be one of {PEER_TRANSPORTS}, got {preview(transport)}")
        storages = body.get("storages")
        if not isinstance(storages, list) or not 1 <= len(storages) <= MAX_PEER_STORAGES:
            raise _bad(f"storages must be a list of 1..{MAX_PEER_STORAGES} handles")
        tensors = body.get("tensors")
        if not isinstance(tensors, list) or not 1 <= len(tensors) <= MAX_PEER_TENSORS:
            raise _bad(f"tensors must be a list of 1..{MAX_PEER_TENSORS} tensors")
        return cls(
            session_id=_int(body, "session_id"),
            transport=transport,
            device_id=_str(body, "device_id", 256),
            layout=_str(body, "layout", 16),
            dtype=_str(body, "dtype", 32),
            num_blocks=_int(body, "num_blocks", 1, MAX_PEER_BLOCKS),
            storages=[_handle(s, "storages[]") for s in storages],
            tensors=[PeerTensor.parse(t, len(storages)) for t in tensors],
        )


@dataclasses.dataclass(frozen=True)
class PeerRun:
    """Blocks holding pages [start_page, start_page + len(block_ids)) of a prefix, each at the even
    epoch it was filled at."""

    token_ids: bytes            # the prefix up to the run's end (the pages before it place it in the tree)
    start_page: int
    block_ids: list[int]
    epochs: list[int]

    @classmethod
    def parse(cls, body: Any) -> "PeerRun":
        if not isinstance(body, dict):
            raise _bad("a peer run must be a map")
        run = cls(token_ids=_token_bytes(body, "token_ids"), start_page=_int(body, "start_page", 0, MAX_PEER_BLOCKS),
                  block_ids=_int_list(body.get("block_ids"), "block_ids", MAX_PEER_BLOCKS, 0, MAX_PEER_BLOCKS - 1),
                  epochs=_int_list(body.get("epochs"), "epochs", MAX_PEER_BLOCKS))
        if len(run.block_ids) != len(run.epochs):
            raise _bad("a peer run needs one epoch per block")
        if any(epoch % 2 for epoch in run.epochs):
            raise _bad("a published block's epoch is even (odd: being written)")
        return run


@dataclasses.dataclass(frozen=True)
class PeerPublish:
    """What entered and left an engine's GPU cache since its last publication; removals apply first."""

    kind: ClassVar[MsgKind] = MsgKind.PEER_PUBLISH
    session_id: int
    removed: list[int]
    runs: list[PeerRun]
    ack: bool = True

    @classmethod
    def parse(cls, body: dict) -> "PeerPublish":
        runs = body.get("runs", [])
        if not isinstance(runs, list) or len(runs) > MAX_PEER_BLOCKS:
            raise _bad("runs must be a list")
        request = cls(session_id=_int(body, "session_id"),
                      removed=_int_list(body.get("removed", []), "removed", MAX_PEER_BLOCKS, 0, MAX_PEER_BLOCKS - 1),
                      runs=[PeerRun.parse(run) for run in runs], ack=_bool(body, "ack", True))
        if len(request.removed) + sum(len(run.block_ids) for run in request.runs) > MAX_PAGE_IDS_PER_REQUEST:
            raise _bad(f"a publication names more than {MAX_PAGE_IDS_PER_REQUEST} blocks")
        return request
