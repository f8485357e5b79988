"""The remote tier's pure parts: what a stored page's header proves, the breaker, and the daemon
state's side of remote restores and write-throughs (no store: the I/O layer is played here)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcached.core.cost_model import CostModel, CostPriors
from kvcached.core.daemon import DaemonState
from kvcached.core.remote import HEADER_BYTES, Breaker, checksum, header_mismatch, pack_header, remote_key
from kvcached.core.tier_ops import OpState, TierMove
from kvcached.core.tiers import Tier
from kvcached.testing.clock import FakeClock
from proto.page_keys import chain_page_keys
from proto.schema import Acquire, Commit, Release
from tests.core.test_daemon_state import GEOMETRY, PAGE, tokens

NAMESPACE = "0123456789abcdef0123456789abcdef"
OTHER_NAMESPACE = "fedcba9876543210fedcba9876543210"


@pytest.fixture
def rng():
    return np.random.default_rng(43)


def test_a_header_proves_namespace_page_length_and_bytes(rng):
    """A value is served only as the page it was stored for: the same bytes under another
    namespace or page key, another length, a flipped bit or a bad magic are each refused."""
    payload = rng.integers(0, 256, 8192, dtype=np.uint8).tobytes()
    key, other_key = (rng.bytes(16) for _ in range(2))
    header = pack_header(NAMESPACE, key, payload)
    assert len(header) == HEADER_BYTES
    assert header_mismatch(header, NAMESPACE, key, payload) == ""
    assert header_mismatch(header, OTHER_NAMESPACE, key, payload) == "another page"
    assert header_mismatch(header, NAMESPACE, other_key, payload) == "another page"
    assert header_mismatch(header, NAMESPACE, key, payload[:-1]) == "another length"
    flipped = bytearray(payload)
    flipped[int(rng.integers(len(payload)))] ^= 1 << int(rng.integers(8))
    assert header_mismatch(header, NAMESPACE, key, bytes(flipped)) == "checksum"
    assert header_mismatch(b"X" + header[1:], NAMESPACE, key, payload) == "bad magic"
    assert header_mismatch(header[:20], NAMESPACE, key, payload) == "short header"
    assert checksum(payload).to_bytes(8, "little") in header


def test_keys_name_one_prefix_page_of_one_namespace(rng):
    """The store key of a page digests the whole prefix up to it: two paths that share the first
    page and differ in the second share the first key only; another namespace shares none."""
    first = rng.integers(0, 1 << 30, PAGE, dtype=np.int32)
    a = np.concatenate([first, rng.integers(0, 1 << 30, PAGE, dtype=np.int32)])
    b = np.concatenate([first, rng.integers(0, 1 << 30, PAGE, dtype=np.int32)])
    keys_a, keys_b = chain_page_keys(a, PAGE, 2), chain_page_keys(b, PAGE, 2)
    assert keys_a[0] == keys_b[0] and keys_a[1] != keys_b[1]
    assert remote_key(NAMESPACE, keys_a[0]) != remote_key(OTHER_NAMESPACE, keys_a[0])


def test_breaker_opens_on_failure_and_backs_off_until_a_probe():
    """After a failure no request asks the store; a probe is due after the backoff, which doubles
    with each failed probe (bounded); a successful probe closes it."""
    breaker = Breaker(backoff_s=1.0, max_backoff_s=4.0)
    assert breaker.allows(0.0) and not breaker.probe_due(0.0)
    breaker.failed(10.0)
    assert not breaker.allows(10.0) and not breaker.probe_due(10.5) and breaker.probe_due(11.0)
    breaker.failed(11.0)                        # the probe failed
    assert not breaker.probe_due(12.5) and breaker.probe_due(13.0)
    for now in (13.0, 17.0, 21.0):
        breaker.failed(now)
    assert breaker.open_until_s == 25.0         # capped at max_backoff_s
    breaker.succeeded()
    assert breaker.allows(25.0) and breaker.status(25.0)["state"] == "closed"
    assert breaker.opened_total == 1


class Sink:
    def __init__(self):
        self.writes = []

    def __call__(self, write):
        self.writes.append(write)


@pytest.fixture
def sink():
    return Sink()


@pytest.fixture
def state(sink):
    return DaemonState(2 << 20, max_namespaces=1, session_timeout_s=1.5, clock=FakeClock(), remote_write_sink=sink,
                       cost_model=CostModel(policy="always"))


def attach(state) -> int:
    session, _ = state.attach(GEOMETRY, pid=1)
    return session.session_id


def commit(state, session_id, token_bytes) -> list[int]:
    reply = state.acquire(Acquire(session_id, token_bytes, save=True))
    state.commit(Commit(session_id, reply.lease_id, reply.reserved_page_ids))
    return reply.reserved_page_ids


def test_a_commit_writes_its_new_pages_through_locked_until_finished(state, sink, rng):
    """A commit hands the store's writer the pages it added (not those L2 held before), locked in
    L2 (the integrity check counts the lock) until the write ends; then nothing is locked."""
    session_id = attach(state)
    prefix = tokens(rng, 6)
    commit(state, session_id, prefix[: 2 * PAGE * 4])
    first = sink.writes.pop()
    state.finish_remote_write(first, 2)
    page_ids = commit(state, session_id, prefix)
    write = sink.writes.pop()
    assert write.start_page == 2 and write.page_ids == page_ids and len(write.token_ids) == 6 * PAGE
    namespace = state.namespaces[write.namespace_id]
    assert namespace.tree.protected_pages(Tier.L2) == 6
    state.check_integrity()
    state.finish_remote_write(write, 4)
    state.check_integrity()
    assert namespace.tree.protected_pages(Tier.L2) == 0
    assert state.metrics.counters["remote_pages_written"] == 6


def test_remote_ask_names_the_pages_after_the_l2_hit(state, rng):
    """The store is asked about the pages after the L2 hit, none when L2 holds the whole prompt."""
    session_id = attach(state)
    prefix = tokens(rng, 5)
    commit(state, session_id, prefix[: 2 * PAGE * 4])
    ask = state.remote_ask(session_id, prefix)
    assert (ask.start_page, ask.end_page, ask.page_size) == (2, 5, PAGE)
    assert ask.namespace_key == state.remote_namespace_key(state.namespaces[ask.namespace_id])
    commit(state, session_id, prefix)
    assert state.remote_ask(session_id, prefix) is None


def play_get(state, move: TierMove, verified: int, mismatch: str = "") -> None:
    """The I/O layer's part: the leading pages whose values checked, then the move ends."""
    move.num_verified_pages, move.mismatch = verified, mismatch
    state.finish_move(move, ok=True)


def test_a_remote_restore_publishes_only_the_verified_pages(state, rng):
    """A match whose decision takes the store returns an R2H move of private L2 pages (revoked:
    no reader trusts them); once the gets end, only the leading pages whose header and checksum
    held are published in L2, the rest are freed and counted; the match then sees them as an L2
    hit."""
    session_id = attach(state)
    prefix = tokens(rng, 5)
    request = Acquire(session_id, prefix, promote="wait")
    move = state.acquire(request, remote_tokens=5 * PAGE)
    assert isinstance(move, TierMove) and move.remote and move.direction == "r2h"
    assert move.start_page == 0 and len(move.private_page_ids) == 5
    namespace = state.namespaces[move.namespace_id]
    assert not namespace.generations.shared[move.private_page_ids].any()
    state.check_integrity()
    play_get(state, move, verified=3, mismatch="checksum")
    assert move.state is OpState.PUBLISHED and move.num_published_pages == 3
    assert state.metrics.counters["remote_checksum_mismatches"] == 1
    state.check_integrity()
    reply = state.acquire_after(request, move)
    assert reply.promoted_tokens == 3 * PAGE
    assert reply.hit_tokens["l2"] == 3 * PAGE and reply.choice == "remote" and reply.restore_tokens == 3 * PAGE
    state.release(Release(session_id, reply.lease_id))
    state.check_integrity()


def test_a_failed_or_empty_remote_restore_frees_its_pages(state, rng):
    """A get that failed, or whose first page did not check, publishes nothing and returns its
    pages: L2's pages are all free again."""
    session_id = attach(state)
    for ok, verified in ((False, 0), (True, 0)):
        prefix = tokens(rng, 4)
        move = state.acquire(Acquire(session_id, prefix, promote="wait"), remote_tokens=4 * PAGE)
        move.num_verified_pages = verified
        state.finish_move(move, ok=ok)
        assert move.state is OpState.FAILED
        state.check_integrity()
        namespace = state.namespaces[move.namespace_id]
        assert namespace.tree.owned_pages(Tier.L2) == 0


def test_the_remote_line_is_priced_and_learned():
    """The store is a candidate priced by its own line (r2h, then the DMA to the engine): taken
    while its reads are cheap against recompute, declined once the daemon's own reads measure
    them slow, so recompute wins."""
    model = CostModel(CostPriors(remote_bytes_per_s=2**30), policy="cost")
    bytes_per_token = 8192
    taken = model.decide(0, bytes_per_token, 0, 0, 0, remote_tokens=1024)
    assert taken.choice == "remote" and taken.restore_tokens == 1024
    for size in (1 << 20, 2 << 20, 4 << 20, 8 << 20):     # measured: 10 ms + 1 s per 10 MB
        model.add_storage_sample("r2h", size, 0.01 + size / 10e6)
    declined = model.decide(0, bytes_per_token, 0, 0, 0, remote_tokens=1024)
    assert declined.choice == "recompute" and declined.predicted_s["remote"] > declined.predicted_s["recompute"]
    assert model.engine(0).policy_skips["lookup"]["remote"] == 1
