"""The ledger of STATUS replies a peer has not shown it read: each peer gets at most max_unread
snapshots until it gives back a token it received; forged or foreign tokens free nothing; a
reply unread for forget_after_s is forgotten; peers beyond max_peers are forgotten, least recent first."""

from __future__ import annotations

from kvcached.server.status_credits import READ_TOKEN_BYTES, StatusCredits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_that_never_reads_gets_max_unread_replies():
    """Without a token back, the third request of a peer is refused (None), however many follow;
    another peer is not affected."""
    credits = StatusCredits(max_unread=2, max_peers=16, forget_after_s=60.0, clock=Clock())
    granted = [credits.grant(b"flood", None) for _ in range(1000)]
    assert all(len(token) == READ_TOKEN_BYTES for token in granted[:2]) and granted[2:] == [None] * 998
    assert credits.unread(b"flood") == 2
    assert credits.grant(b"other", None) is not None


def test_giving_back_a_token_frees_that_reply_and_those_before():
    """The token of the last reply frees every unread reply; that of the first frees one; a
    forged token, one of another peer or one already used frees nothing."""
    credits = StatusCredits(max_unread=2, max_peers=16, forget_after_s=60.0, clock=Clock())
    first, second = credits.grant(b"a", None), credits.grant(b"a", None)
    foreign = credits.grant(b"b", None)
    for useless in (b"x" * READ_TOKEN_BYTES, foreign, "text", 7):
        assert credits.grant(b"a", useless) is None
    third = credits.grant(b"a", first)
    assert third is not None and credits.unread(b"a") == 2
    assert credits.grant(b"a", first) is None
    fourth = credits.grant(b"a", third)
    assert fourth is not None and credits.unread(b"a") == 1
    for _ in range(100):          # a client that reads each reply is never refused
        fourth = credits.grant(b"a", fourth)
        assert fourth is not None and credits.unread(b"a") == 1


def test_unread_replies_are_forgotten_after_a_while():
    """A peer refused for two unread replies is served again once they are forget_after_s old."""
    clock = Clock()
    credits = StatusCredits(max_unread=2, max_peers=16, forget_after_s=60.0, clock=clock)
    credits.grant(b"a", None), credits.grant(b"a", None)
    clock.now += 59.0
    assert credits.grant(b"a", None) is None
    clock.now += 1.0
    assert credits.grant(b"a", None) is not None and credits.unread(b"a") == 1


def test_peers_are_bounded():
    """The ledger holds max_peers peers; the least recent is forgotten first."""
    credits = StatusCredits(max_unread=1, max_peers=3, forget_after_s=60.0, clock=Clock())
    for peer in (b"p0", b"p1", b"p2", b"p3"):
        credits.grant(peer, None)
    assert [credits.unread(p) for p in (b"p0", b"p1", b"p2", b"p3")] == [0, 1, 1, 1]
