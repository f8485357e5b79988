"""A client that sends STATUS requests and never reads the replies (a real process, over ipc://)
cannot grow the daemon's memory: its replies beyond a few are refused with a small error, and a
client that reads is served as usual meanwhile."""

from __future__ import annotations



from kvcached.testing.pytest_plugin import fresh_seed
from kvcached.testing.daemon_proc import DaemonProcess
from kvcached.testing.floods import MAX_RSS_GROWTH_BYTES, never_reading_flood


def test_a_never_reading_client_cannot_grow_the_daemon():
    """3,000 STATUS requests of a process that never reads, against ~0.7 MB snapshots (which the
    daemon used to queue, ~2 GB): the daemon's RSS grows by less than 100 MB, all but 2 of them
    are refused, and a client that reads gets every status it asks for meanwhile, each within 2 s."""
    seed = fresh_seed(31)
    daemon = DaemonProcess(extra_args=("--l3-size", "0")).start()
    try:
        measured = never_reading_flood(daemon, 3000, seed)
    finally:
        daemon.cleanup()
    assert measured["snapshot_bytes"] > 500_000, measured["snapshot_bytes"]
    assert measured["refused"] == 3000 - 2, measured
    assert measured["rss_growth_bytes"] < MAX_RSS_GROWTH_BYTES, measured
    assert max(measured["round_trips_s"]) < 2.0, measured["round_trips_s"]
