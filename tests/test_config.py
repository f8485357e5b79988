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
    """--restore-policy, --cost-margin and the four priors parse into DaemonConfig and its
    cost_priors (microseconds and GiB/s as given); an unknown policy, a margin below 1 or a
    non-positive prior is a ConfigError naming the field it is about."""
    import pytest

    from kvcached.config import ConfigError

    base = {"KVCACHED_SOCKET": "/tmp/kvt-config/kvcached.sock", "KVCACHED_L2_SIZE": "64MiB"}
    args = build_parser().parse_args(["serve", "--restore-policy", "never", "--cost-margin", "1.25",
                                      "--prior-recompute-us", "30", "--prior-host-gibps", "50",
                                      "--prior-storage-gibps", "1.5", "--prior-peer-gibps", "400"])
    config = DaemonConfig.from_env(base, restore_policy=args.restore_policy, cost_margin=args.cost_margin,
                                   prior_recompute_us_per_token=args.prior_recompute_us_per_token,
                                   prior_host_gibps=args.prior_host_gibps, prior_storage_gibps=args.prior_storage_gibps,
                                   prior_peer_gibps=args.prior_peer_gibps)
    priors = config.cost_priors
    assert config.restore_policy == "never" and priors.margin == 1.25
    assert priors.recompute_s_per_token == pytest.approx(30e-6)
    assert priors.host_bytes_per_s == 50 * 2**30 and priors.storage_bytes_per_s == 1.5 * 2**30
    assert priors.peer_bytes_per_s == 400 * 2**30
    assert DaemonConfig.from_env(base).restore_policy == "cost"
    for bad in ({"restore_policy": "sometimes"}, {"cost_margin": 0.9}, {"prior_storage_gibps": 0.0},
                {"prior_recompute_us_per_token": float("nan")}, {"prior_peer_gibps": -1.0}):
        with pytest.raises(ConfigError) as error:
            DaemonConfig.from_env(base, **bad)
        assert error.value.field == next(iter(bad)), bad

def test_sizes_read_k_m_g_t_and_their_ibi_forms_as_binary_and_kb_mb_gb_tb_as_decimal():
    """One letter and KiB/MiB/GiB/TiB are powers of 1024 (as docker and the JVM read them), KB/MB/GB/TB
    powers of 1000, in any case, fractions included; anything else is refused."""
    import pytest

    from kvcached.config import parse_size

    expected = {"64g": 64 << 30, "64G": 64 << 30, "64GiB": 64 << 30, "64gib": 64 << 30, "64GB": 64 * 10**9,
                "64gb": 64 * 10**9, "512k": 512 << 10, "3KB": 3000, "2m": 2 << 20, "1.5t": 3 << 39,
                "1.5g": 3 << 29, "4096": 4096, "7 MiB": 7 << 20, "0": 0, "2TB": 2 * 10**12}
    assert {text: parse_size(text) for text in expected} == expected
    for text in ("abc", "1.2.3", "5x", "-1g", "g", "1gibs", ""):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(text)


def test_a_bad_variable_is_named_with_its_value_and_the_field_it_sets():
    """from_env raises ConfigError naming the KVCACHED_* variable and its value, for text that does
    not parse and for a value out of range; a flag's value (an override) wins over the variable."""
    import pytest

    from kvcached.config import ConfigError

    base = {"KVCACHED_SOCKET": "/tmp/kvt-config/kvcached.sock", "KVCACHED_L2_SIZE": "64MiB"}
    cases = {"KVCACHED_L2_SIZE": ("lots", "l2_bytes"), "KVCACHED_MAX_NAMESPACES": ("0", "max_namespaces"),
             "KVCACHED_LOG_LEVEL": ("loud", "log_level"), "KVCACHED_L3_FRESH": ("perhaps", "l3_fresh")}
    for variable, (text, field) in cases.items():
        with pytest.raises(ConfigError) as error:
            DaemonConfig.from_env({**base, variable: text})
        assert str(error.value).startswith(f"{variable}={text!r}: ") and error.value.field == field
    assert DaemonConfig.from_env({**base, "KVCACHED_MAX_NAMESPACES": "0"}, max_namespaces=3).max_namespaces == 3
    assert DaemonConfig.from_env({**base, "KVCACHED_LOG_LEVEL": "debug"}).log_level == "DEBUG"


def test_session_share_comes_from_its_flag_and_a_share_outside_0_to_1_is_refused():
    import pytest

    from kvcached.config import ConfigError

    base = {"KVCACHED_SOCKET": "/tmp/kvt-config/kvcached.sock", "KVCACHED_L2_SIZE": "64MiB"}
    args = build_parser().parse_args(["serve", "--session-share", "1"])
    assert DaemonConfig.from_env(base, session_share=args.session_share).session_share == 1.0
    assert DaemonConfig.from_env(base).session_share == 0.5
    for bad in (0.0, 1.01, -1.0):
        with pytest.raises(ConfigError) as error:
            DaemonConfig.from_env(base, session_share=bad)
        assert error.value.field == "session_share"


def test_the_shared_memory_directory_comes_from_its_variable_or_flag_and_must_be_absolute(tmp_path):
    """KVCACHED_SHM_DIR and --shm-dir (which wins) set shm_dir, /dev/shm by default; the default L2
    size is taken from that directory's free space; a relative directory is refused (engines open
    the pool by the path the daemon names)."""
    import pytest

    from kvcached.config import ConfigError, default_l2_bytes

    base = {"KVCACHED_SOCKET": "/tmp/kvt-config/kvcached.sock", "KVCACHED_L2_SIZE": "64MiB"}
    assert DaemonConfig.from_env(base).shm_dir == "/dev/shm"
    assert DaemonConfig.from_env({**base, "KVCACHED_SHM_DIR": str(tmp_path)}).shm_dir == str(tmp_path)
    args = build_parser().parse_args(["serve", "--shm-dir", "/run/kvcached/shm"])
    assert DaemonConfig.from_env({**base, "KVCACHED_SHM_DIR": str(tmp_path)},
                                 shm_dir=args.shm_dir).shm_dir == "/run/kvcached/shm"
    sized = DaemonConfig.from_env({"KVCACHED_SOCKET": base["KVCACHED_SOCKET"], "KVCACHED_SHM_DIR": str(tmp_path)})
    assert sized.l2_bytes == default_l2_bytes(str(tmp_path))
    with pytest.raises(ConfigError) as error:
        DaemonConfig.from_env({**base, "KVCACHED_SHM_DIR": "shm"})
    assert error.value.field == "shm_dir"
