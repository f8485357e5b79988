"""DaemonConfig from the environment and the CLI: the L3 switches."""

from __future__ import annotations

from kvcached.cli import build_parser
from kvcached.config import DaemonConfig


def test_l3_fresh_comes_from_kvcached_l3_fresh_and_the_flag_wins():
    """KVCACHED_L3_FRESH=1 sets l3_fresh; unset it is False; --l3-fresh parses to True and, absent,
    leaves the environment's value (None is no override)."""
    base = {"KVCACHED_SOCKET": "/tmp/kvt-config/kvcached.sock", "KVCACHED_L2_SIZE": "64MiB"}
    assert DaemonConfig.from_env(base).l3_fresh is False
    assert DaemonConfig.from_env({**base, "KVCACHED_L3_FRESH": "1"}).l3_fresh is True
    assert DaemonConfig.from_env({**base, "KVCACHED_L3_FRESH": "no"}).l3_fresh is False
    parser = build_parser()
    assert parser.parse_args(["serve", "--l3-fresh"]).l3_fresh is True
    absent = parser.parse_args(["serve"]).l3_fresh
    assert absent is None
    assert DaemonConfig.from_env({**base, "KVCACHED_L3_FRESH": "1"}, l3_fresh=absent).l3_fresh is True
