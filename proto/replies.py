"""Reply bodies: each defined once, built by the daemon (``to_wire``) and decoded by engines
(``from_wire``), strictly: a field missing or of the wrong type raises ``ProtocolError`` naming the
reply and the field. Fields a peer does not know are ignored (new fields go last).

Replies with no fields (HEARTBEAT, RELEASE, ENGINE_REPORT) are ``{}``; STATUS is a free-form map
meant for people and dashboards (``kvcached/server/status.py`` renders it).
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any, NamedTuple, TypeVar

from proto.errors import ErrorCode, ProtocolError


class AttachInfo(NamedTuple):
    """The reply to ATTACH: the session, where its L2 pages are, and the daemon's timings."""

    session_id: int
    namespace_id: int
    shm_path: str
    num_pages: int
    bytes_per_page: int
    heartbeat_interval_s: float
    session_timeout_s: float
    max_frame_bytes: int
    daemon_pid: int
    protocol_version: int
    pid_watched: bool = False          # the daemon sees this process exit: the session lives session_grace_s unseen
    session_grace_s: float = 0.0
    # The admission hints file (proto.hints) and the namespace's slot in it ("": none published).
    hints_path: str = ""
    hints_offset_bytes: int = 0
    # The namespace's L2 page generations (proto.generations; "": none, every L2 page is a miss).
    generations_path: str = ""


class DetachReply(NamedTuple):
    leases_reclaimed: int


class Decision(NamedTuple):
    """The cost model's answer for a prompt: where the tokens beyond the engine's own hit come from
    (``choice``: one of proto.messages.RESTORE_CHOICES, "engine" when no tier holds more; "": no
    decision), the leading tokens to hold once restored (``restore_tokens``, the engine's own hit
    included), and the predicted seconds to hold the longest hit through each candidate and
    "recompute" (``predicted_s``)."""

    choice: str = ""
    restore_tokens: int = 0
    predicted_s: dict[str, float] = {}


NO_DECISION = Decision()


class LookupReply(NamedTuple):
    """The reply to LOOKUP: the hit per tier (tier label -> leading tokens; "peer" for a session
    registered for peer restores, "remote" where the store was asked), and the cost model's
    decision: where the tokens beyond the engine's own hit come from (``choice``, one of
    proto.messages.RESTORE_CHOICES), the leading tokens to hold after the restore (the engine's own
    hit included), the predicted seconds to hold the longest hit through each candidate and
    "recompute", and the policy applied."""

    hit_tokens: dict[str, int]
    choice: str
    restore_tokens: int
    predicted_s: dict[str, float]
    policy: str

    @property
    def decision(self) -> Decision:
        return Decision(self.choice, self.restore_tokens, self.predicted_s)


class AcquireReply(NamedTuple):
    """The reply to ACQUIRE. ``lease_id`` None: nothing was locked or reserved (no L2 hit, nothing
    reserved), and there is nothing to release or commit."""

    hit_tokens: dict[str, int]         # per tier label, as in LookupReply
    lease_id: int | None
    host_page_ids: list[int]           # L2 pages of the hit prefix, in order (under the lease)
    # The write generation each page of host_page_ids was published with: a reader trusts a page
    # only while its word holds it (proto.generations).
    host_page_generations: list[int] = []
    reserved_start_token: int = 0      # the L2 hit: the reserved pages hold the pages from here on
    reserved_page_ids: list[int] = []  # private L2 pages reserved for the request's saves (with save)
    reserved_generation: int = 0       # what the writer of reserved_page_ids stamps once their bytes are complete
    # Why no pages were reserved for saves of the pages beyond the L2 hit ("": it reserved what it
    # could): "evicted_before_reuse", a path L3 holds that L2 would evict before its next use.
    save_skipped: str = ""
    promoted_tokens: int = 0           # of the L2 hit, tokens just promoted from L3 or the store for it
    # The peer candidate (a session registered for peer restores; 0 and [] otherwise): another
    # engine's blocks holding the leading pages, each at the epoch it was published at.
    peer_id: int = 0
    peer_block_ids: list[int] = []
    peer_epochs: list[int] = []
    # The decision, as in LookupReply ("" and empty: none was taken: promote "none" and no peer).
    # A restore from L2, L3 or the store names no more tokens than the lease can load.
    choice: str = ""
    restore_tokens: int = 0
    predicted_s: dict[str, float] = {}
    policy: str = ""

    @property
    def decision(self) -> Decision:
        return Decision(self.choice, self.restore_tokens, self.predicted_s)


class CommitReply(NamedTuple):
    new_pages: int
    duplicate_pages: int


class PeerRegisterReply(NamedTuple):
    """The reply to PEER_REGISTER: the registration's id, and the shared file of its block epochs
    (a header, then one little-endian u64 per block from ``epochs_offset_bytes``)."""

    peer_id: int
    epochs_path: str
    epochs_offset_bytes: int


class PeerListReply(NamedTuple):
    """The reply to PEER_LIST: the registrations this engine may open, each as its owner sent it
    (``transport``, ``device_id``, ``layout``, ``dtype``, ``num_blocks``, ``storages``, ``tensors``) plus
    ``peer_id``, ``epochs_path``, ``epochs_offset_bytes`` and the owner's ``pid``,
    ``pid_namespace_id`` and ``process_start_time``. Relayed from another engine: check before use."""

    peers: list[dict]


Reply = TypeVar("Reply", AttachInfo, DetachReply, LookupReply, AcquireReply, CommitReply, PeerRegisterReply, PeerListReply)


def to_wire(reply: NamedTuple) -> dict[str, Any]:
    return reply._asdict()


def from_wire(reply_type: type[Reply], body: Any) -> Reply:
    """Decode a reply body, every field checked against its annotation."""
    name = reply_type.__name__
    if type(body) is not dict:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"{name}: the reply is not a map: {body!r:.80}")
    values = {}
    for field, hint in _hints(reply_type).items():
        if field not in body:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"{name}: the reply has no field {field!r}")
        value = body[field]
        if not _conforms(value, hint):
            raise ProtocolError(ErrorCode.BAD_FRAME,
                                f"{name}: field {field!r} must be {_describe(hint)}, got {value!r:.80}")
        values[field] = value
    return reply_type(**values)


@functools.cache
def _hints(reply_type: type) -> dict[str, Any]:
    return typing.get_type_hints(reply_type)


def _conforms(value: Any, hint: Any) -> bool:
    if hint is float:
        return type(value) in (int, float)
    if hint in (int, str, bool):
        return type(value) is hint          # bool is not an int here, nor an int a bool
    if hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if origin is list:
        # set(map(type, ...)) runs in C: a reply's page ids are checked at little cost.
        return type(value) is list and (not value or set(map(type, value)) == {args[0]})
    if origin is dict:
        return type(value) is dict and all(_conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items())
    raise AssertionError(f"no wire check for {hint!r}")


def _describe(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)
