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


def test_the_cost_model_flags_reach_its_priors_and_bad_values_are_refused():
    """--restore-policy, --cost-margin and the three priors parse into DaemonConfig and its
    cost_priors (microseconds and GiB/s as given); an unknown policy, a margin below 1 or a
    non-positive prior is a ValueError at construction."""
    import pytest

    base = {"KVCACHED_SOCKET": "/tmp/kvt-config/kvcached.sock", "KVCACHED_L2_SIZE": "64MiB"}
    args = build_parser().parse_args(["serve", "--restore-policy", "never", "--cost-margin", "1.25",
                                      "--prior-recompute-us", "30", "--prior-host-gibps", "50",
                                      "--prior-storage-gibps", "1.5"])
    config = DaemonConfig.from_env(base, restore_policy=args.restore_policy, cost_margin=args.cost_margin,
                                   prior_recompute_us_per_token=args.prior_recompute_us_per_token,
                                   prior_host_gibps=args.prior_host_gibps, prior_storage_gibps=args.prior_storage_gibps)
    priors = config.cost_priors
    assert config.restore_policy == "never" and priors.margin == 1.25
    assert priors.recompute_s_per_token == pytest.approx(30e-6)
    assert priors.host_bytes_per_s == 50 * 2**30 and priors.storage_bytes_per_s == 1.5 * 2**30
    assert DaemonConfig.from_env(base).restore_policy == "cost"
    for bad in ({"restore_policy": "sometimes"}, {"cost_margin": 0.9}, {"prior_storage_gibps": 0.0},
                {"prior_recompute_us_per_token": float("nan")}):
        with pytest.raises(ValueError):
            DaemonConfig.from_env(base, **bad)
