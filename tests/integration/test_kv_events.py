"""KV events over real sockets: a daemon started with --kv-events publishes what its L2 and L3 gain
and lose, as vLLM's engines publish theirs, on a ZeroMQ PUB socket a router subscribes to; a bad
endpoint stops the start with one clear line. The page hashes are recomputed here from the tokens
(blake2b chained, as l3_index documents them), not taken from kvcached's code."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq

from engine_client.client import connect
from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess, child_env, commit_written
from kvcached.testing.engine_proc import GEOMETRY
from kvcached.testing.l3 import back_up_random

PAGE = GEOMETRY.page_size
NUM_L2_PAGES = (2 << 20) // GEOMETRY.bytes_per_page          # 256 pages of 8 KiB
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOPIC = b"kv@test-node@e2e-model"


def page_hashes(tokens: np.ndarray, num_pages: int) -> list[int]:
    """Each page's chained key (blake2b-128 of the parent's key and the page's int32 tokens, the
    root's key 16 zero bytes) as vLLM's default int block hash: its last 8 bytes, big-endian."""
    hashes, parent = [], bytes(16)
    for page in range(num_pages):
        data = np.ascontiguousarray(tokens[page * PAGE:(page + 1) * PAGE], dtype="<i4").tobytes()
        parent = hashlib.blake2b(parent + data, digest_size=16).digest()
        hashes.append(int.from_bytes(parent[8:], "big"))
    return hashes


def replay_all(endpoint: str, timeout_s: float = 10.0) -> list[list[bytes]]:
    """Every message the replay socket keeps, from sequence number 0: [topic, seq, payload] each."""
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        messages = []
        while True:
            assert dealer.poll(int(timeout_s * 1000)), "no end marker from the replay socket"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return messages
            messages.append([topic, seq, payload])
    finally:
        dealer.close()


def wait_until_settled(client, timeout_s: float = 20.0) -> None:
    """No tier move pending and the daemon's buffer of events taken (the publisher's counters stop)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        status = client.status()
        now = (status["pending"], status["daemon"]["kv_events"]["next_seq"])
        if not any(status["pending"].values()) and now == last:
            return
        assert time.monotonic() < deadline, f"the daemon did not settle: {status['pending']}"
        last = now
        time.sleep(0.2)


def apply(events: list[dict], index: dict[str, set[int]]) -> None:
    """A router's index: which block hashes each medium holds, after these events."""
    for event in events:
        if event["type"] == "BlockStored":
            index.setdefault(event["medium"], set()).update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            index.setdefault(event["medium"], set()).difference_update(event["block_hashes"])
        else:
            index.clear()


def leading(hashes: list[int], held: set[int]) -> int:
    count = 0
    while count < len(hashes) and hashes[count] in held:
        count += 1
    return count


def test_events_tell_a_router_what_l2_and_l3_hold(rng, seed):
    """An engine client saves a prefix in two steps, then fills L2 with other prefixes until the
    first is evicted from it. A SUB socket gets, on topic kv@NODE@MODEL with sequence numbers that
    rise by one: AllBlocksCleared first (the model's first namespace), then BlockStored of the
    prefix's pages in L2 ("CPU", "LOCAL") in two events, each with its pages' token ids, block size
    16 and hashes chained from the tokens, the second's parent the first's last page; BlockStored of
    the same pages in L3 ("STORAGE", "LOCAL"); later BlockRemoved of them from L2, and of pages
    from L3, which is smaller than what was saved. Applied in order,
    the events give, for every prefix saved, exactly the pages the daemon's lookup finds in each
    tier. The replay socket sends the same messages again from sequence number 0."""
    directory = tempfile.mkdtemp(prefix="kvt-ev-", dir="/tmp")      # ipc:// paths must stay short
    events_endpoint, replay_endpoint = f"ipc://{directory}/events", f"ipc://{directory}/replay"
    daemon = DaemonProcess(l2_size="2MiB", extra_args=(
        "--l3-size", "2MiB", "--kv-events", events_endpoint, "--kv-events-replay", replay_endpoint,
        "--kv-events-node", "test-node")).start()
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        sub.connect(events_endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        with connect(daemon.socket_path, timeout_s=5.0) as client:
            assert client.attach(GEOMETRY).num_pages == NUM_L2_PAGES
            first = rng.integers(0, 150_000, size=5 * PAGE + 3, dtype=np.int32)
            for held_pages, num_pages in ((0, 3), (3, 5)):
                # It holds the pages it saved itself: hitting them is no reuse (which eviction spares).
                reply = client.acquire(first[:num_pages * PAGE], save=True, local_hit_tokens=held_pages * PAGE)
                commit_written(client, reply)
                assert client.flush() == []
                wait_until_settled(client)
            others = []
            for _ in range(3):
                # Half of L2 each: the pages a write-through still copies to L3 stay locked until it
                # ends, and a fill before that finds nothing to evict (the save gets no pages).
                others.append(back_up_random(client, NUM_L2_PAGES // 2, rng))
                wait_until_settled(client)
            held = {}
            for tokens in [first, *others]:
                reply = client.lookup_async(tokens).result()
                held[len(held)] = (tokens, reply.hit_tokens["l2"] // PAGE, reply.hit_tokens["l3"] // PAGE)
            assert held[0][1] == 0, f"the first prefix is still in L2: {held[0]}"
            status = client.status()
        assert status["daemon"]["kv_events"]["lost_events"] == 0

        messages = replay_all(replay_endpoint)
        seqs = [int.from_bytes(seq, "big") for _, seq, _ in messages]
        assert seqs == list(range(len(messages))) and len(messages) >= 3, seqs
        assert all(topic == TOPIC for topic, _, _ in messages), {topic for topic, _, _ in messages}
        # What the subscriber got is the same messages, from the one it joined at on.
        received = []
        while len(received) < len(messages) and sub.poll(5000):
            received.append(sub.recv_multipart())
        assert received and received == messages[-len(received):], (len(received), len(messages))

        events = []
        for _, _, payload in messages:
            ts, batch, rank = msgpack.unpackb(payload)
            assert abs(ts - time.time()) < 600 and rank is None
            events.extend(batch)
        assert events[0] == {"type": "AllBlocksCleared"}
        hashes = page_hashes(first, 5)
        stored = [e for e in events if e["type"] == "BlockStored" and set(e["block_hashes"]) & set(hashes)]
        cpu = [e for e in stored if (e["medium"], e["locality"]) == ("CPU", "LOCAL")]
        assert [e["block_hashes"] for e in cpu] == [hashes[:3], hashes[3:]], cpu
        assert [e["parent_block_hash"] for e in cpu] == [None, hashes[2]]
        assert [e["token_ids"] for e in cpu] == [first[:3 * PAGE].tolist(), first[3 * PAGE:5 * PAGE].tolist()]
        assert all(e["block_size"] == PAGE and e["ownership"] == "kvcached" for e in stored)
        storage = [e for e in stored if (e["medium"], e["locality"]) == ("STORAGE", "LOCAL")]
        assert sorted(h for e in storage for h in e["block_hashes"]) == sorted(hashes), storage
        removed_cpu = {h for e in events if e["type"] == "BlockRemoved" and e["medium"] == "CPU"
                       for h in e["block_hashes"]}
        assert set(hashes) <= removed_cpu
        assert any(e["type"] == "BlockRemoved" and e["medium"] == "STORAGE" for e in events)

        index: dict[str, set[int]] = {}
        apply(events, index)
        for tokens, l2_pages, l3_pages in held.values():
            tokens_hashes = page_hashes(tokens, len(tokens) // PAGE)
            assert leading(tokens_hashes, index.get("CPU", set())) == l2_pages
            assert leading(tokens_hashes, index.get("STORAGE", set())) == l3_pages
    finally:
        sub.close()
        daemon.cleanup()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_bad_events_endpoint_stops_the_start():
    """`kvcached serve --kv-events` with something that is no ZeroMQ endpoint exits with status 2
    and names the flag; one that cannot be bound (a tcp port taken) exits with status 1 and names
    the endpoint; neither leaves a daemon running."""
    socket_dir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")        # short, for ipc://, and private
    socket_path = os.path.join(socket_dir, "kvcached.sock")

    def serve(endpoint: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvcached.cli", "serve", "--socket", socket_path,
                               "--l2-size", "2MiB", "--l3-size", "0", "--http", "off", "--kv-events", endpoint],
                              env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)

    done = serve("http://example.com:5557")
    assert done.returncode == 2, done.stderr
    assert "argument --kv-events:" in done.stderr and "tcp://*:PORT" in done.stderr, done.stderr

    taken = zmq.Context.instance().socket(zmq.PUB)
    try:
        port = taken.bind_to_random_port("tcp://*")
        done = serve(f"tcp://*:{port}")
    finally:
        taken.close(0)
    assert done.returncode == 1, done.stderr
    assert f"cannot publish KV events on tcp://*:{port}" in done.stderr, done.stderr
    assert not os.path.exists(socket_path)
    os.rmdir(socket_dir)
