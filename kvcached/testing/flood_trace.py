"""A trace for L2 fairness, on the daemon's state (no sockets, a fake clock, seeded): engine A
reuses a set of hot prefixes, each request the prefix and a page of its own; engine B floods
one-use prompts. B is another session of A's namespace (same model) or a session of a second
namespace (another model). What it measures: A's hit share (requests whose hot prefix L2 held
whole) and how much of L2 each namespace holds."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvcached.core.daemon import DaemonState
from kvcached.core.tiers import Tier
from kvcached.testing.clock import FakeClock
from proto.messages import KVGeometry
from proto.schema import Acquire, Commit, Release

GEOMETRY_A = KVGeometry("model-a", num_layers=4, num_kv_heads=4, head_dim=128, dtype="float32", page_size=8)
GEOMETRY_B = KVGeometry("model-b", num_layers=2, num_kv_heads=8, head_dim=64, dtype="float32", page_size=16)


@dataclasses.dataclass(frozen=True)
class FloodTrace:
    l2_bytes: int = 32 << 20                 # 256 pages of A's geometry (128 KiB a page)
    hot_prefixes: int = 12
    hot_pages: int = 4                       # A's hot set: 48 pages, under a fifth of L2
    flood_pages: int = 4
    flood_per_request: int = 0               # B's one-use prompts per A request (0: no flood)
    requests: int = 600                      # A's, the first third of them a warm-up
    same_model: bool = True
    flood_first: bool = False                # B attaches first (then A starts with none of the pool)


@dataclasses.dataclass
class FloodResult:
    hit_share: float                         # A's requests (after warm-up) whose hot prefix L2 held whole
    a_l2_pages: int                          # L2 pages A's namespace holds at the end
    a_l2_capacity: int


def request(state: DaemonState, session_id: int, token_bytes: bytes) -> int:
    """One request's match (it reserves what L2 lacks) and the save of its pages; its L2 hit in tokens."""
    reply = state.acquire(Acquire(session_id, token_bytes, save=True))
    if reply.lease_id is not None:
        if reply.reserved_page_ids:
            state.commit(Commit(session_id, reply.lease_id, reply.reserved_page_ids))
        else:
            state.release(Release(session_id, reply.lease_id))
    return reply.hit_tokens["l2"]


def run(trace: FloodTrace, seed: int) -> FloodResult:
    rng = np.random.default_rng(seed)
    clock = FakeClock()
    state = DaemonState(trace.l2_bytes, max_namespaces=2, session_timeout_s=1e9, session_grace_s=1e9,
                         clock=clock)
    order = [(1, GEOMETRY_A), (2, GEOMETRY_A if trace.same_model else GEOMETRY_B)]
    attached = {pid: state.attach(geometry, pid=pid) for pid, geometry in order[::-1 if trace.flood_first else 1]}
    (a, a_namespace), (b, _) = attached[1], attached[2]
    b_page = (GEOMETRY_A if trace.same_model else GEOMETRY_B).page_size

    def tokens(num_tokens: int) -> bytes:
        return rng.integers(0, 1 << 30, size=num_tokens, dtype=np.int32).tobytes()

    page = GEOMETRY_A.page_size
    hot = [tokens(trace.hot_pages * page) for _ in range(trace.hot_prefixes)]
    warm_up = trace.requests // 3
    hits = 0
    for number in range(trace.requests):
        prefix = hot[int(rng.integers(trace.hot_prefixes))]
        clock.advance(0.01)
        if request(state, a.session_id, prefix + tokens(page)) >= len(prefix) // 4 and number >= warm_up:
            hits += 1
        for _ in range(trace.flood_per_request):
            clock.advance(0.01)
            request(state, b.session_id, tokens(trace.flood_pages * b_page))
        if number % 50 == 0:
            state.check_integrity()
    state.check_integrity()
    return FloodResult(hits / (trace.requests - warm_up), a_namespace.tree.owned_pages(Tier.L2),
                       a_namespace.capacity[Tier.L2])
