"""The KV events' socket: a ZeroMQ PUB socket that sends what the state recorded
(``kvcached/core/kv_events.py``) as vLLM's ``ZmqEventPublisher`` does, and its replay socket.

A message is three frames: the topic, the sequence number (8 bytes, big-endian), the payload (one
``KVEventBatch``). The topic is ``kv@<node>@<model>``, the form llm-d's indexer reads a pod and a
model from; sequence numbers count up by one per message, over all topics, and skip one where the
state's buffer dropped events, so that a subscriber sees every loss as a gap. The socket is bound
for ``tcp://*:PORT`` (any wildcard) and ``ipc://PATH``, and connects to any other ``tcp://HOST:PORT``
(an indexer that binds), vLLM's rule. PUB never blocks: a subscriber that does not keep up loses
what goes beyond the high-water mark (ZeroMQ drops it), and can ask the replay socket (a ROUTER:
request ``[b"", start seq]``, as vLLM's) for the last ``REPLAY_BATCHES`` messages from that number
on, then an end marker (seq -1). Both sockets belong to the daemon's socket thread, which hashes and
sends events a slice at a time while no request waits (``Server._socket_loop``).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Iterable, Iterator

import zmq

from kvcached.core.kv_events import KeyCache, TierEvent, encode_in_slices

logger = logging.getLogger(__name__)

SNDHWM_MESSAGES = 100_000           # vLLM's default high-water mark
REPLAY_BATCHES = 10_000             # messages the replay socket can send again (vLLM's buffer_steps)
# Pages hashed (or their token ids packed) between two looks at the daemon's socket: a request
# waits for one slice at most.
PAGES_PER_SLICE = 8
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcards and ipc:// are bound, other tcp:// addresses connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, context: zmq.Context, endpoint: str, node: str, replay_endpoint: str | None = None):
        """Raises zmq.ZMQError for an endpoint that cannot be bound (the caller names it)."""
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.node = node
        self.seq = 0                        # of the next message
        self.sent_messages = 0
        self.sent_events = 0
        self.lost_events = 0                # dropped by the state's buffer
        self._topics: dict[str, bytes] = {}
        self.key_cache = KeyCache()
        self._replay_buffer: collections.deque[tuple[int, bytes, bytes]] = collections.deque(maxlen=REPLAY_BATCHES)
        self.pub = context.socket(zmq.PUB)
        self.replay: zmq.Socket | None = None
        try:
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.setsockopt(zmq.SNDHWM, SNDHWM_MESSAGES)
            if binds(endpoint):
                self.pub.bind(endpoint)
            else:
                self.pub.connect(endpoint)
            if replay_endpoint is not None:
                self.replay = context.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self.close()
            raise

    def topic(self, model_id: str) -> bytes:
        topic = self._topics.get(model_id)
        if topic is None:
            topic = self._topics[model_id] = f"kv@{self.node}@{model_id}".encode()
        return topic

    def publish(self, events: Iterable[TierEvent], dropped: int, ts: float | None = None) -> Iterator[None]:
        """Send one batch per model of ``events`` (``dropped`` events recorded meanwhile were lost),
        a slice of the work per step of the iterator: the caller serves requests between steps."""
        if dropped:
            self.lost_events += dropped
            self.seq += 1                   # the gap that tells subscribers
            logger.warning("KV events: %d dropped (the buffer was full); sequence number %d skipped", dropped,
                           self.seq - 1)
        events = list(events)
        batches = yield from encode_in_slices(events, time.time() if ts is None else ts, self.key_cache,
                                                 PAGES_PER_SLICE)
        self.sent_events += len(events)
        for model_id, payload in batches:
            topic, seq = self.topic(model_id), self.seq.to_bytes(8, "big")
            try:
                self.pub.send_multipart([topic, seq, payload], flags=zmq.NOBLOCK)
            except zmq.Again:               # PUB drops rather than block; kept for replay all the same
                pass
            self._replay_buffer.append((self.seq, topic, payload))
            self.seq += 1
            self.sent_messages += 1

    def serve_replay(self) -> None:
        """Answer every replay request waiting (never blocks): each gets the messages kept from its
        start number on, then the end marker."""
        if self.replay is None:
            return
        while True:
            try:
                frames = self.replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.debug("KV events: a replay request of %d frames ignored", len(frames))
                continue
            identity, start_seq = frames[0], int.from_bytes(frames[2], "big")
            try:
                for seq, topic, payload in self._replay_buffer:
                    if seq >= start_seq:
                        self.replay.send_multipart([identity, b"", topic, seq.to_bytes(8, "big"), payload],
                                                   flags=zmq.NOBLOCK)
                self.replay.send_multipart([identity, b"", b"", END_SEQ, b""], flags=zmq.NOBLOCK)
            except zmq.Again:               # that peer does not read: it asks again
                continue

    def status(self) -> dict:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "next_seq": self.seq,
                "messages": self.sent_messages, "events": self.sent_events, "lost_events": self.lost_events}

    def close(self) -> None:
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
