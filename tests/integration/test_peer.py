"""Peer restores with real processes over ipc://, on CPU: an owner engine process whose cache
(shared memory) a reader engine copies from, through the registration the daemon brokers; the
owner holding its prefixes, reusing its blocks as fast as it can, closing, and SIGKILLed."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from engine_client.client import connect
from kvcached.server.shm import epoch_file_prefix
from kvcached.testing.daemon_proc import DaemonProcess, REPO_ROOT, child_env
from tests.integration.peer_engine import (NUM_BLOCKS, PAGE, PREFIX_PAGES, new_tensors, page_kv, prefixes,
                                           read_block, register)


class OwnerProcess:
    """``tests.integration.peer_engine`` in a process of its own; it stops when its stdin closes."""

    def __init__(self, socket_path: str, seed: int, role: str, device: str = "cpu"):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.peer_engine", "--socket", socket_path, "--seed", str(seed),
             "--role", role, "--device", device], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(), cwd=REPO_ROOT,
            bufsize=0)       # unbuffered: select() sees every line the owner wrote
        self.ready = self._line(60.0, "READY")
        self.info = json.loads(self._line(10.0))

    def _line(self, timeout_s: float, expected: str | None = None) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"the owner process said nothing within {timeout_s} s"
            if select.select([self.proc.stdout], [], [], remaining)[0]:
                line = self.proc.stdout.readline().decode().strip()
                assert line or self.proc.poll() is None, f"the owner exited with {self.proc.returncode}"
                if expected is None or line == expected:
                    return line

    def stop(self) -> dict:
        self.proc.stdin.close()
        report = json.loads(self._line(30.0))
        assert self.proc.wait(30) == 0
        return report

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self.proc.stdout.close()


class Reader:
    """An engine of the same namespace with its own (untouched) tensors and connector."""

    def __init__(self, socket_path: str, device: str = "cpu", policy: str = "always", **config):
        # Policy "always" unless a test is about the decision: a cost decision turns on how long
        # earlier copies took, which on a loaded 2-core machine can be any time (one slow copy
        # priced the peer out of every later match: no copy, and so no sample, ever came again).
        self.tensors = new_tensors(device)
        self.connector = register(socket_path, "peer-reader", self.tensors, policy=policy, **config)
        self.requests = 0

    def wait_for_peers(self, count: int = 1, timeout_s: float = 20.0, peer_id: int | None = None) -> None:
        """Until ``count`` peers were opened (a first candidate asks for them), ``peer_id`` among them
        if given (where other readers are engines too, the first one opened may be another reader)."""
        deadline = time.monotonic() + timeout_s
        while self.connector.stats().get("peers_opened", 0) < count or \
                (peer_id is not None and peer_id not in self.connector.peer._peers):
            assert time.monotonic() < deadline, f"no peer opened: {self.connector.stats()}"
            self.connector.poll()
            time.sleep(0.005)

    def restore(self, tokens: np.ndarray, blocks, timeout_s: float = 10.0):
        """Load every whole page of tokens into blocks; the LoadResult once the load is done and the
        request has ended."""
        request_id = self.start(tokens, blocks)
        return self.finish(request_id, timeout_s)

    def start(self, tokens: np.ndarray, blocks) -> int:
        request_id = self.requests = self.requests + 1
        self.connector.load(request_id, tokens, blocks, len(blocks) * PAGE)
        return request_id

    def finish(self, request_id: int, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        result = None
        while result is None or self.connector.is_open(request_id):
            loads = self.connector.finished().loads
            result = result or next((r for r in loads if r.request_id == request_id), None)
            if result is not None and self.connector.is_open(request_id):
                self.connector.request_finished(request_id)
            assert time.monotonic() < deadline, f"load {request_id} not done: {self.connector.stats()}"
        return result

    def check(self, seed: int, tokens: np.ndarray, blocks, num_pages: int) -> list[int]:
        """Pages among the first num_pages whose bytes are not the owner's for that page."""
        return [page for page in range(num_pages)
                if not torch.equal(read_block(self.tensors, blocks[page]), page_kv(seed, tokens, page))]


def shared_mapping_inodes() -> set[int]:
    """Inodes of the files this process has mapped shared (/proc/self/maps)."""
    inodes = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[1][3] == "s" and fields[4] != "0":
                inodes.add(int(fields[4]))
    return inodes


def epoch_files(daemon: DaemonProcess) -> list[str]:
    prefix = epoch_file_prefix(daemon.socket_path)
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def wait_until(condition, what: str, poll=None, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if poll is not None:
            poll()
        time.sleep(0.005)


@pytest.fixture
def daemon():
    process = DaemonProcess().start()
    yield process
    process.cleanup()


@pytest.fixture
def owners():
    started: list[OwnerProcess] = []
    yield lambda *args: started.append(OwnerProcess(*args)) or started[-1]
    for owner in started:
        owner.cleanup()


def test_a_reader_restores_an_owners_prefixes_bit_for_bit(daemon, owners, seed):
    """Every prefix the owner's cache holds: the reader's lookup counts all its pages, its load
    copies them out of the owner's memory (no L2 involved: nothing was saved) into other blocks,
    and they hold the owner's bytes bit for bit; its other blocks are untouched. Each load's result
    reports its copy's time (more than none)."""
    owner = owners(daemon.socket_path, seed, "hold")
    reader = Reader(daemon.socket_path)
    try:
        reader.wait_for_peers()
        untouched = {block: read_block(reader.tensors, block) for block in range(PREFIX_PAGES, NUM_BLOCKS)}
        for index, tokens in enumerate(prefixes(seed)):
            assert reader.connector.lookup(tokens) == PREFIX_PAGES * PAGE, f"prefix {index} (seed {seed})"
            blocks = list(range(1, PREFIX_PAGES + 1))[::-1]
            result = reader.restore(tokens, blocks)
            assert result.ok and result.num_tokens == PREFIX_PAGES * PAGE and result.transfer_s > 0, (result, seed)
            assert reader.check(seed, tokens, blocks, PREFIX_PAGES) == [], f"prefix {index} (seed {seed})"
        for block, before in untouched.items():
            if block > PREFIX_PAGES:
                assert torch.equal(read_block(reader.tensors, block), before), block
        stats = reader.connector.stats()
        assert stats["peer_loaded_pages"] == len(prefixes(seed)) * PREFIX_PAGES and stats.get("saved_pages", 0) == 0
        with connect(daemon.socket_path) as client:
            status = client.status(check_integrity=True)
        assert status["integrity"] == "ok"
        owner_row = next(s for s in status["sessions"] if s["client_name"].startswith("peer-owner"))
        assert owner_row["peer"]["published_blocks"] >= PREFIX_PAGES
        assert owner.stop()["published"] >= len(prefixes(seed)) * PREFIX_PAGES
    finally:
        reader.connector.close()


def test_a_peer_load_is_reported_queued_before_or_with_its_result(daemon, owners, seed):
    """A load copied from the owner is named in ``finished().queued`` (with every token it fills,
    nothing failed) no later than its result, as a load from L2 is: an engine may prefill on it
    while the copy runs (its attention waiting for the copy on the GPU); the result then confirms
    it, and the blocks hold the owner's bytes."""
    owner = owners(daemon.socket_path, seed, "hold")
    reader = Reader(daemon.socket_path)
    try:
        reader.wait_for_peers(peer_id=owner.info["peer_id"])
        tokens = prefixes(seed)[0]
        blocks = list(range(1, PREFIX_PAGES + 1))
        request_id = reader.start(tokens, blocks)
        queued, result = None, None
        deadline = time.monotonic() + 10.0
        while result is None:
            finished = reader.connector.finished()
            queued = queued or next((r for r in finished.queued if r.request_id == request_id), None)
            result = next((r for r in finished.loads if r.request_id == request_id), None)
            assert time.monotonic() < deadline, reader.connector.stats()
        assert queued is not None, f"the peer load was never reported queued (seed {seed})"
        assert (queued.num_tokens, queued.failed_block_ids) == (PREFIX_PAGES * PAGE, []), queued
        assert result.ok and reader.connector.stats()["peer_loaded_pages"] == PREFIX_PAGES, (result, seed)
        assert reader.check(seed, tokens, blocks, PREFIX_PAGES) == [], seed
        reader.connector.request_finished(request_id)
    finally:
        reader.connector.close()


def test_the_cost_model_chooses_the_peer_and_learns_its_copies_as_d2d_samples(daemon, owners, seed):
    """The daemon's decision chooses the source: under the default policy a reader's matches choose
    "peer" and its loads copy from the owner, each copy a d2d sample the daemon learns (no h2d
    sample: nothing came from L2); a reader under policy "never" is told to recompute, and its load
    copies nothing from the owner though the owner offers every page."""
    owner = owners(daemon.socket_path, seed, "hold")
    reader = Reader(daemon.socket_path, policy="cost")
    never = Reader(daemon.socket_path, policy="never")
    try:
        # The namespace's recompute priced far above any copy (prefills the reader reports, of
        # varied sizes: 50 ms a token), so that the choices below do not turn on this machine's
        # copy times.
        for num_tokens in (20, 40, 80):
            reader.connector.report_prefill(num_tokens, num_tokens * 0.050)
        reader.connector.flush_report()
        reader.connector.flush()
        reader.wait_for_peers(peer_id=owner.info["peer_id"])
        never.wait_for_peers(peer_id=owner.info["peer_id"])
        blocks = list(range(1, PREFIX_PAGES + 1))
        for tokens in prefixes(seed)[:3]:
            result = reader.restore(tokens, blocks)
            assert result.ok and reader.check(seed, tokens, blocks, PREFIX_PAGES) == [], (result, seed)
        tokens = prefixes(seed)[3]
        lookup = never.connector.lookup_async(tokens)
        assert (lookup.decision().choice, lookup.decision().restore_tokens, lookup.hit_tokens()["peer"]) == \
            ("recompute", 0, PREFIX_PAGES * PAGE), (lookup.decision(), seed)
        result = never.restore(tokens, blocks)
        assert result.num_tokens == 0 and never.connector.stats().get("peer_loaded_pages", 0) == 0, result
        reader.connector.flush_report()
        reader.connector.flush()
        with connect(daemon.socket_path) as client:
            (engine,) = client.status()["cost_model"]["engines"]
        assert engine["directions"]["d2d"]["samples_total"] == 3, engine
        assert engine["directions"]["h2d"]["samples_total"] == 0, engine
        assert engine["decisions_total"]["match"] == {"peer": 3, "recompute": 1}, engine
        owner.stop()
    finally:
        reader.connector.close()
        never.connector.close()


def test_an_owner_registered_after_the_reader_is_found_by_its_first_candidate(daemon, owners, seed):
    """A reader registered before the owner learns of it when a match first names it (the daemon
    offers it; the reader then lists and opens it): a later restore copies from it, bit for bit."""
    reader = Reader(daemon.socket_path)
    try:
        # Registered, and its first list (asked for at registration) taken: it names no owner, so
        # the owner started next can only be learnt of from a match.
        wait_until(lambda: reader.connector.peer.epochs_path is not None
                   and reader.connector.stats().get("peer_lists_taken", 0) >= 1,
                   "the reader's registration and first peer list", reader.connector.poll)
        owner = owners(daemon.socket_path, seed, "hold")
        tokens = prefixes(seed)[1]
        blocks = [9, 8, 7, 6, 5]
        deadline = time.monotonic() + 20.0
        while not (result := reader.restore(tokens, blocks)).ok:
            assert time.monotonic() < deadline, f"never restored from the owner: {reader.connector.stats()}"
            time.sleep(0.005)
        assert reader.check(seed, tokens, blocks, PREFIX_PAGES) == [], seed
        assert reader.connector.stats()["peer_candidates_not_open"] >= 1
        owner.stop()
    finally:
        reader.connector.close()


def test_an_owner_reusing_its_blocks_never_hands_a_reader_changed_bytes(daemon, owners, seed):
    """While the owner drops prefixes and refills their blocks with other prefixes' pages (noise
    first, then layer by layer) as fast as it can, the reader restores prefixes over and over:
    every page it reports loaded holds exactly that page's bytes; pages whose blocks changed under
    a copy are reported failed (recomputed), never loaded."""
    owner = owners(daemon.socket_path, seed, "churn")
    reader = Reader(daemon.socket_path)
    loaded = failed = 0
    try:
        reader.wait_for_peers()
        blocks = list(range(NUM_BLOCKS - PREFIX_PAGES, NUM_BLOCKS))
        rng = np.random.default_rng(seed)
        deadline = time.monotonic() + 6.0
        restores = 0
        while time.monotonic() < deadline or loaded < 20:
            assert time.monotonic() < deadline + 30.0, f"only {loaded} pages restored: {reader.connector.stats()}"
            tokens = prefixes(seed)[int(rng.integers(len(prefixes(seed))))]
            result = reader.restore(tokens, blocks)
            pages = result.num_tokens // PAGE
            assert reader.check(seed, tokens, blocks, pages) == [], \
                f"restore {restores}: changed bytes kept ({result}, seed {seed})"
            loaded += pages
            failed += len(result.failed_block_ids)
            restores += 1
        report = owner.stop()
        stats = reader.connector.stats()
        assert report["refills"] > restores, (report, restores)
        assert loaded == stats["peer_loaded_pages"] > 0
        print(f"{restores} restores, {loaded} pages loaded, {failed} failed; owner refilled {report['refills']} "
              f"times; {stats.get('peer_pages_changed', 0)} pages changed under a copy")
    finally:
        reader.connector.close()


@pytest.mark.parametrize("end", ["sigkill", "close"])
def test_an_owner_that_goes_away_is_dropped_and_its_memory_unmapped(daemon, owners, seed, end):
    """Once the owner is SIGKILLed (its pidfd) or closes its connector: the daemon removes its
    epoch file, no lookup or match offers it, the reader closes its mappings of the owner's memory
    and epoch file, and no load keeps a page from it (they are recomputed)."""
    owner = owners(daemon.socket_path, seed, "hold")
    reader = Reader(daemon.socket_path)
    try:
        reader.wait_for_peers()
        tokens = prefixes(seed)[0]
        assert reader.restore(tokens, [1, 2, 3, 4, 5]).ok
        peer_inodes = set(owner.info["inodes"])
        assert peer_inodes <= shared_mapping_inodes(), "the owner's memory and epoch file are mapped"
        assert len(epoch_files(daemon)) == 2          # the owner's and the reader's
        if end == "sigkill":
            owner.kill()
        else:
            owner.stop()
        wait_until(lambda: reader.connector.lookup(tokens) == 0, "lookups to stop offering the owner")
        wait_until(lambda: reader.connector.stats().get("peers_closed", 0) == 1, "the reader to close the peer",
                   reader.connector.poll)
        assert not shared_mapping_inodes() & peer_inodes, "a mapping of the gone owner stays"
        assert len(epoch_files(daemon)) == 1
        result = reader.restore(tokens, [6, 7, 8, 9, 10])
        assert result.num_tokens == 0 and len(result.failed_block_ids) == PREFIX_PAGES
        with connect(daemon.socket_path) as client:
            status = client.status(check_integrity=True)
        assert status["integrity"] == "ok" and [s["client_name"] for s in status["sessions"]] == ["peer-reader"]
    finally:
        reader.connector.close()
    wait_until(lambda: not epoch_files(daemon), "the reader's epoch file to go")


def test_a_reader_keeps_no_page_from_an_owner_once_it_is_killed(daemon, owners, seed):
    """Restores run back to back from the moment the owner is SIGKILLed: none keeps a page (the
    reader's check after each copy sees the owner's process gone, whether or not the daemon's
    notice came first), and each fails its blocks for recompute."""
    owner = owners(daemon.socket_path, seed, "hold")
    reader = Reader(daemon.socket_path)
    try:
        reader.wait_for_peers()
        blocks = list(range(NUM_BLOCKS - PREFIX_PAGES, NUM_BLOCKS))
        tokens = prefixes(seed)[3]
        assert reader.restore(tokens, blocks).ok
        owner.kill()
        killed_at = time.monotonic()
        kept_after = 0
        while time.monotonic() < killed_at + 1.0:
            result = reader.restore(tokens, blocks)
            assert len(result.failed_block_ids) + result.num_tokens // PAGE == PREFIX_PAGES
            kept_after += result.num_tokens // PAGE
        assert kept_after == 0, f"{kept_after} pages kept from a dead owner"
    finally:
        reader.connector.close()


def test_a_reader_killed_while_it_copies_leaves_nothing_behind(daemon, owners, seed):
    """A reader process restoring from the owner back to back is SIGKILLed: the daemon ends its
    session and removes its epoch file; the owner is untouched and another reader restores from it
    bit for bit."""
    owner = owners(daemon.socket_path, seed, "hold")
    doomed = owners(daemon.socket_path, seed, "read")
    assert len(epoch_files(daemon)) == 2
    doomed.kill()
    wait_until(lambda: len(epoch_files(daemon)) == 1, "the killed reader's epoch file to go")
    reader = Reader(daemon.socket_path)
    try:
        reader.wait_for_peers()
        tokens = prefixes(seed)[4]
        blocks = [10, 11, 12, 13, 14]
        assert reader.restore(tokens, blocks).ok
        assert reader.check(seed, tokens, blocks, PREFIX_PAGES) == [], seed
        with connect(daemon.socket_path) as client:
            status = client.status(check_integrity=True)
        assert status["integrity"] == "ok"
        assert sorted(s["client_name"] for s in status["sessions"]) == [f"peer-owner-{seed}", "peer-reader"]
        owner.stop()
    finally:
        reader.connector.close()


def test_stale_epoch_files_of_a_killed_daemon_are_removed_at_start(owners, seed):
    """A daemon SIGKILLed with registrations leaves their epoch files; the next daemon on the same
    socket removes them before it serves."""
    first = DaemonProcess().start()
    try:
        owner = owners(first.socket_path, seed, "hold")
        assert len(epoch_files(first)) == 1
        first.stop(signal.SIGKILL)
        owner.kill()
        assert len(epoch_files(first)) == 1
        second = DaemonProcess(socket_dir=first.socket_dir).start()
        try:
            assert epoch_files(second) == []
        finally:
            second.stop()
    finally:
        first.cleanup()
