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
