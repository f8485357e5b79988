"""How many STATUS replies each peer may leave unread in the daemon's memory.

ZeroMQ queues a reply to a peer that does not read it, up to the socket's SNDHWM messages,
whatever their size; a status snapshot is large (up to a 64 KiB report per session), so a peer
that asks for status and never reads would make the daemon hold SNDHWM snapshots. The daemon
cannot see what a peer has read, so a peer shows it: each STATUS reply carries a fresh random
``read_token``, and the peer's next STATUS request gives back the token of the last reply it read.
A peer whose ``max_unread`` replies are all unread gets a small error instead of another snapshot.

The tokens are random, so only a peer that received a reply can give its token back; replies to
one socket arrive in order, so the token of one reply shows every earlier reply read too. A reply
unread for ``forget_after_s`` is forgotten, so a client that lost a token (it gave up waiting for
a reply, then dropped it) is not refused for good: a peer that never reads holds at most
``max_unread`` snapshots per ``forget_after_s`` (and never more than the socket's SNDHWM).
"""

from __future__ import annotations

import collections
import secrets
import time
from typing import Callable

READ_TOKEN_BYTES = 8


class StatusCredits:
    def __init__(self, max_unread: int, max_peers: int, forget_after_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.max_unread = max_unread
        self.max_peers = max_peers
        self.forget_after_s = forget_after_s
        self._clock = clock
        # peer identity -> (token, when sent) of its unread replies, oldest first; least recent peer first
        self._unread: collections.OrderedDict[bytes, list[tuple[bytes, float]]] = collections.OrderedDict()

    def grant(self, identity: bytes, read_token: object) -> bytes | None:
        """A token for a new reply to ``identity``, or None: it has max_unread replies unread.
        ``read_token`` (what its request gave back, if anything) marks that reply and those
        before it read."""
        now = self._clock()
        unread = [(token, sent) for token, sent in self._unread.pop(identity, [])
                  if now - sent < self.forget_after_s]
        tokens = [token for token, _ in unread]
        if isinstance(read_token, bytes) and read_token in tokens:
            del unread[:tokens.index(read_token) + 1]
        if len(unread) >= self.max_unread:
            self._unread[identity] = unread
            return None
        token = secrets.token_bytes(READ_TOKEN_BYTES)
        unread.append((token, now))
        self._unread[identity] = unread
        while len(self._unread) > self.max_peers:      # the least recent peer's count is forgotten
            self._unread.popitem(last=False)
        return token

    def unread(self, identity: bytes) -> int:
        return len(self._unread.get(identity, ()))
