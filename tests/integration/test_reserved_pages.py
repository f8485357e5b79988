"""Backups into pages reserved ahead and speculative restores from hints, over the wire: a real
daemon process, its real shared L2 segment mapped by the engine, real transfers (CPU here, and
the same checks on a GPU)."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch

from engine_client import kernels
from engine_client.client import connect
from engine_client.l1_pool import L1Pool
from engine_client.reserved import L2Hints, ReservedPages, confirm_restore, hint_holds
from engine_client.shared_pool import SharedHostPool
from engine_client.transfer import TransferEngine
from proto.messages import KVGeometry, MsgKind
from tests.integration.daemon_proc import DaemonProcess

GEOMETRY = KVGeometry("reserved-model", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", page_size=16)
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
NUM_L1_PAGES = 24


class Engine:
    """A client, the mapped L2 pool, an L1 pool of random bits and a transfer engine."""

    def __init__(self, socket_path: str, device: str, seed: int):
        self.client = connect(socket_path, timeout_s=5.0, client_name=f"reserved-{seed}")
        info = self.client.attach(GEOMETRY)
        self.num_l2_pages = info.num_pages
        self.host_pool = SharedHostPool.open(info.shm_path, info.arena_offset_bytes, info.num_pages, GEOMETRY,
                                             pin=device == "cuda", device=device if device == "cuda" else None)
        self.l1_pool = L1Pool(GEOMETRY, NUM_L1_PAGES, device)
        generator = torch.Generator().manual_seed(seed)
        bits = self.l1_pool.kv.view(torch.int16)
        bits.copy_(torch.randint(-2**15, 2**15, bits.shape, dtype=torch.int16, generator=generator))
        # On a GPU, the backend whose launches run as CUDA graphs once they recur.
        backend = "triton" if device == "cuda" and kernels.triton_available() else "torch"
        self.transfer = TransferEngine(self.l1_pool, self.host_pool, backend=backend)
        self.device = device

    def pages(self, l1_page_ids: list[int]) -> torch.Tensor:
        return self.l1_pool.kv.view(torch.int16)[:, :, l1_page_ids].cpu()

    def scribble(self, l1_page_ids: list[int]) -> None:
        self.l1_pool.kv.view(torch.int16)[:, :, l1_page_ids] = 7

    def close(self) -> None:
        self.transfer.close()
        self.host_pool.close()
        self.client.close()


@pytest.fixture
def daemon():
    # 2 MiB of L2 at most per namespace here: 256 pages of 8 KiB.
    process = DaemonProcess(l2_size="2MiB", extra_args=("--max-namespaces", "1", "--l3-size", "0")).start()
    yield process
    process.cleanup()


@pytest.fixture
def make_engine(daemon):
    engines = []

    def build(device: str, seed: int) -> Engine:
        engines.append(Engine(daemon.socket_path, device, seed))
        return engines[-1]

    yield build
    for engine in engines:
        engine.close()


def random_tokens(rng, num_pages: int) -> np.ndarray:
    return rng.integers(1, 2**31 - 1, size=num_pages * GEOMETRY.page_size, dtype=np.int32)


def assert_sound(client, leases: int = 0) -> dict:
    assert client.flush() == []
    status = client.status(check_integrity=True)
    assert status["integrity"] == "ok"
    assert status["leases"] == leases, status
    return status


@pytest.mark.parametrize("device", DEVICES)
def test_backup_into_reserved_pages_then_speculative_restore_is_exact(make_engine, device):
    """A backup written into pages reserved ahead and then committed is what a match of its prefix
    names (pages and epochs); a restore queued from the hint before the reply is confirmed by it
    and restores the backed-up pages bit for bit into other L1 pages."""
    engine = make_engine(device, seed=1)
    rng = np.random.default_rng()
    reserved = ReservedPages(engine.client, chunk_pages=16, low_water_pages=4)
    reserved.fill()
    hints = L2Hints(GEOMETRY.page_size)
    sources, destinations = [3, 9, 1, 14, 6], [20, 2, 11, 17, 8]
    tokens = random_tokens(rng, len(sources))

    taken = reserved.take(len(sources))
    assert taken is not None and len(taken.page_ids) == len(sources)
    engine.transfer.backup(sources, taken.page_ids).wait()
    reserved.commit(taken, tokens)
    hints.record(tokens, taken.page_ids, taken.page_epochs)
    assert_sound(engine.client, leases=1)          # the rest of the chunk
    engine.scribble(destinations)

    pending = engine.client.match_async(tokens)
    hint = hints.get(tokens)
    assert hint is not None
    speculative = engine.transfer.start_restore(destinations).receive_from(hint.page_ids)
    reply = pending.result()
    assert reply.host_page_ids == taken.page_ids and reply.host_page_epochs == taken.page_epochs
    restore, held = confirm_restore(engine.transfer, speculative, hint, reply, destinations)
    assert held and restore is speculative
    restore.wait()
    assert torch.equal(engine.pages(destinations), engine.pages(sources))
    engine.client.release(reply.lease_id)
    reserved.close()
    engine.transfer.check_integrity()
    status = assert_sound(engine.client)
    assert status["namespaces"][0]["tiers"]["l2"]["owned_pages"] == len(sources)


@pytest.mark.parametrize("device", DEVICES)
def test_stale_hint_is_caught_and_the_restore_redone_from_the_reply(make_engine, device):
    """The pages of a hint are evicted and rewritten by another engine's backups, then the same
    prefix is backed up again elsewhere: the match reply disproves the hint (other pages or other
    epochs), and confirm_restore restores the prefix's real pages, bit for bit."""
    a, b = make_engine(device, seed=2), make_engine(device, seed=3)
    rng = np.random.default_rng()
    hints = L2Hints(GEOMETRY.page_size)
    sources, destinations = [0, 5, 10, 15], [1, 6, 11, 16]
    tokens = random_tokens(rng, len(sources))
    reply = a.client.match(tokens, reserve_backup=True)
    a.transfer.backup(sources, reply.backup_page_ids).wait()
    a.client.commit_backup(reply.lease_id, reply.backup_page_ids)
    hints.record(tokens, reply.backup_page_ids, reply.backup_page_epochs)
    hinted = hints.get(tokens)

    # b fills L2 twice over with its own random pages: a's prefix is evicted, its pages reused.
    for _ in range(2 * b.num_l2_pages // 8):
        other = random_tokens(rng, 8)
        taken = b.client.match(other, reserve_backup=True)
        b.transfer.backup(list(range(8)), taken.backup_page_ids).wait()
        b.client.commit_backup(taken.lease_id, taken.backup_page_ids)
    assert a.client.match(tokens).hit_tokens["l2"] == 0
    # a backs the prefix up again, with the same bits; the hint still names the old pages.
    again = a.client.match(tokens, reserve_backup=True)
    a.transfer.backup(sources, again.backup_page_ids).wait()
    a.client.commit_backup(again.lease_id, again.backup_page_ids)
    assert_sound(a.client)

    a.scribble(destinations)
    pending = a.client.match_async(tokens)
    speculative = a.transfer.start_restore(destinations).receive_from(hinted.page_ids)
    reply = pending.result()
    assert not hint_holds(hinted, reply)
    restore, held = confirm_restore(a.transfer, speculative, hinted, reply, destinations)
    assert not held and restore is not speculative
    restore.wait()
    assert torch.equal(a.pages(destinations), a.pages(sources))
    a.client.release(reply.lease_id)
    a.transfer.check_integrity()
    assert_sound(a.client)


def test_a_hint_with_a_reused_page_at_the_same_place_is_refused(make_engine):
    """The comparison itself: the same page ids at other epochs, or the right pages in another
    order, do not hold. (That a reused page does get another epoch: tests/core.)"""
    engine = make_engine("cpu", seed=4)
    rng = np.random.default_rng()
    tokens = random_tokens(rng, 3)
    reply = engine.client.match(tokens, reserve_backup=True)
    engine.client.commit_backup(reply.lease_id, reply.backup_page_ids)
    hints = L2Hints(GEOMETRY.page_size)
    hints.record(tokens, reply.backup_page_ids, reply.backup_page_epochs)
    match = engine.client.match(tokens)
    assert hint_holds(hints.get(tokens), match)
    stale = hints.get(tokens)._replace(page_epochs=[e - 1 for e in reply.backup_page_epochs])
    assert not hint_holds(stale, match)
    assert not hint_holds(hints.get(tokens)._replace(page_ids=reply.backup_page_ids[::-1]), match)
    engine.client.release(match.lease_id)
    assert_sound(engine.client)


def test_reserved_pages_are_topped_up_and_all_given_back(make_engine):
    """Chunks are topped up in the background once pages run low; pages put back can be taken
    again; a commit of a chunk's last pages ends its lease; close releases the rest."""
    engine = make_engine("cpu", seed=5)
    rng = np.random.default_rng()
    reserved = ReservedPages(engine.client, chunk_pages=8, low_water_pages=6)
    reserved.fill()
    assert reserved.num_free == 8
    first = reserved.take(5)            # 3 left: below the low water
    assert first is not None
    reserved.top_up()                   # so a second chunk is asked for
    turns = 1000
    while reserved.num_free < 11 and turns:     # 3 + the second chunk's 8, once its reply is in
        assert reserved.take(100) is None
        turns -= 1
    assert reserved.num_free == 11
    reserved.put_back(first)
    again = reserved.take(5)
    assert again == first
    tokens = random_tokens(rng, 5)
    reserved.commit(again, tokens)
    rest = reserved.take(3)
    assert rest.lease_id == first.lease_id and reserved.num_free == 8
    reserved.commit(rest, random_tokens(rng, 3))         # the first chunk's last pages: its lease ends
    status = assert_sound(engine.client, leases=1)
    assert status["namespaces"][0]["tiers"]["l2"]["private_pages"] == 8
    match = engine.client.match(tokens)
    assert match.hit_tokens["l2"] == 5 * GEOMETRY.page_size
    engine.client.release(match.lease_id)
    reserved.close()
    status = assert_sound(engine.client)
    assert status["namespaces"][0]["tiers"]["l2"]["private_pages"] == 0


def test_reservation_given_up_before_its_reply_leaves_no_lease(make_engine):
    engine = make_engine("cpu", seed=6)
    pending = engine.client.reserve_pages_async(10)
    pending.cancel()
    del pending
    gc.collect()
    status = assert_sound(engine.client)
    assert status["namespaces"][0]["tiers"]["l2"]["private_pages"] == 0


def test_bad_reservation_requests_are_refused(make_engine):
    engine = make_engine("cpu", seed=7)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            engine.client.reserve_pages(bad)
    reservation = engine.client.reserve_pages(4)
    engine.client.commit_pages(reservation.lease_id, random_tokens(np.random.default_rng(), 2), 0,
                               [reservation.page_ids[0], 10**6])
    errors = engine.client.flush()
    assert len(errors) == 1 and errors[0].code.name == "NOT_LEASED", errors
    engine.client.release(reservation.lease_id)
    assert_sound(engine.client)


def test_taken_pages_are_committed_or_put_back_once_and_checked_first(make_engine):
    """A commit whose tokens fall short is refused before anything is sent; pages committed or put
    back cannot be committed or put back again; nothing drifts from the daemon's view."""
    engine = make_engine("cpu", seed=8)
    rng = np.random.default_rng()
    reserved = ReservedPages(engine.client, chunk_pages=8, low_water_pages=1)
    reserved.fill()
    taken = reserved.take(3)
    with pytest.raises(ValueError, match="do not cover"):
        reserved.commit(taken, random_tokens(rng, 2))
    tokens = random_tokens(rng, 3)
    reserved.commit(taken, tokens)
    with pytest.raises(ValueError, match="not out"):
        reserved.commit(taken, tokens)
    with pytest.raises(ValueError, match="not out"):
        reserved.put_back(taken)
    other = reserved.take(2)
    reserved.put_back(other)
    with pytest.raises(ValueError, match="not out"):
        reserved.put_back(other)
    status = assert_sound(engine.client, leases=1)
    assert status["namespaces"][0]["tiers"]["l2"]["private_pages"] == reserved.num_free == 5
    assert status["namespaces"][0]["tiers"]["l2"]["owned_pages"] == 3
    reserved.close()
    assert_sound(engine.client)


def test_no_pages_are_taken_once_the_session_may_be_gone(make_engine):
    """Pages are taken only while the daemon surely keeps the session: never once it is lost (the
    daemon reclaimed the pages; another engine may be writing them), nor while heartbeats are
    late."""
    engine = make_engine("cpu", seed=9)
    reserved = ReservedPages(engine.client, chunk_pages=8)
    reserved.fill()
    assert reserved.take(2) is not None
    confirmed = engine.client._session_confirmed_at
    engine.client._session_confirmed_at = confirmed - engine.client.info.session_timeout_s   # late heartbeats
    assert reserved.take(2) is None
    engine.client._session_confirmed_at = confirmed
    generation = engine.client.generation
    engine.client.request_raw(MsgKind.DETACH, {"session_id": engine.client.info.session_id})
    deadline = time.monotonic() + 3.0
    while engine.client.generation == generation:     # the session ended: the client re-attached
        assert time.monotonic() < deadline, "the client did not notice its session was gone"
        time.sleep(0.02)
    assert reserved.take(2) is None and reserved.num_free == 0
    reserved.close()           # nothing to release, nothing raised
    assert engine.client.flush() == []
