"""Daemon configuration: one frozen dataclass; the CLI takes its defaults from here.

Environment variables (``KVCACHED_*``) are read in this module only.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from typing import Mapping

from kvcached.core.cost_model import POLICIES, CostPriors
from proto.paths import default_socket_path, normalize_socket_path

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}

DEFAULT_L2_MAX_BYTES = 1 << 30       # modest: a sidecar on any box
DEFAULT_L3_BYTES = 4 << 30           # a sparse temporary file: only written pages use disk
SHM_DIR = "/dev/shm"


def parse_size(text: str) -> int:
    """'64GiB' -> 68719476736; '1.5G' -> 1500000000; plain integers are bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 64GiB, 1TiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def format_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def default_l2_bytes(shm_dir: str = SHM_DIR) -> int:
    """1 GiB, or half of what the shared-memory filesystem has free where that is less."""
    try:
        free = shutil.disk_usage(shm_dir).free
    except OSError:
        free = DEFAULT_L2_MAX_BYTES
    return max(64 << 20, min(DEFAULT_L2_MAX_BYTES, free // 2)) // (2 << 20) * (2 << 20)


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    socket_path: str
    l2_bytes: int
    l3_path: str | None = None
    l3_bytes: int = DEFAULT_L3_BYTES
    l3_o_direct: bool = False
    l3_fresh: bool = False              # with l3_path: start with an empty L3 (and index), not the last run's
    max_namespaces: int = 4
    heartbeat_interval_s: float = 0.5
    session_timeout_s: float = 1.5      # an engine whose pid is not watched: silent this long, it is gone
    # A watched engine that lives keeps its session this long silent (a stall, say); an unwatched
    # one's pages stay quarantined this long after its last sign of life (docs: "Fencing").
    session_grace_s: float = 30.0
    pid_watch: bool = True              # watch engines' pids (pidfd) where the pid namespace allows
    max_frame_bytes: int = 16 << 20
    io_threads: int = 4
    socket_spin_us: int = 100           # busy-poll the socket this long after a request (0: never)
    socket_cpu: int | None = None       # run the socket thread and ZeroMQ's I/O thread on this CPU
    max_pending_writes: int = 64        # write-throughs to L3 in flight; beyond it, new pages skip L3
    shm_dir: str = SHM_DIR
    refusal_log_interval_s: float = 10.0   # refused requests: DEBUG each, one WARNING summary per interval
    log_level: str = "INFO"
    # The cost model (kvcached/core/cost_model.py): which restores are taken, and its priors.
    restore_policy: str = "cost"        # "cost": restore what beats recompute; "always"; "never"
    cost_margin: float = 1.1            # a restore must beat recompute by this factor
    prior_recompute_us_per_token: float = 50.0
    prior_host_gibps: float = 12.0      # L2 <-> GPU
    prior_storage_gibps: float = 3.0    # L3 reads and writes

    def __post_init__(self) -> None:
        # A path or an ipc:// URL, made absolute; too long for a socket address: ValueError.
        object.__setattr__(self, "socket_path", normalize_socket_path(self.socket_path))
        if self.l2_bytes < (2 << 20):
            raise ValueError(f"l2_bytes must be at least 2 MiB, got {self.l2_bytes}")
        if not 1 <= self.max_namespaces <= 1024:
            raise ValueError("max_namespaces must be in 1..1024")
        if not 0 < self.heartbeat_interval_s < self.session_timeout_s:
            raise ValueError("heartbeat_interval_s must be positive and below session_timeout_s")
        if not self.session_grace_s >= self.session_timeout_s:
            raise ValueError(f"session_grace_s ({self.session_grace_s}) must be at least session_timeout_s "
                             f"({self.session_timeout_s})")
        if self.l3_bytes < 0:
            raise ValueError("l3_bytes must be >= 0")
        if not 0 <= self.socket_spin_us <= 100_000:
            raise ValueError("socket_spin_us must be in 0..100000")
        if self.socket_cpu is not None and self.socket_cpu not in os.sched_getaffinity(0):
            raise ValueError(f"socket_cpu {self.socket_cpu} is not among the CPUs this process may use: "
                             f"{sorted(os.sched_getaffinity(0))}")
        if not self.refusal_log_interval_s > 0:
            raise ValueError("refusal_log_interval_s must be positive")
        if not 1 <= self.io_threads <= 256:
            raise ValueError("io_threads must be in 1..256")
        if self.restore_policy not in POLICIES:
            raise ValueError(f"restore_policy must be one of {POLICIES}, got {self.restore_policy!r}")
        self.cost_priors        # raises ValueError for a prior or margin out of range

    @property
    def cost_priors(self) -> CostPriors:
        return CostPriors(recompute_s_per_token=self.prior_recompute_us_per_token * 1e-6,
                          host_bytes_per_s=self.prior_host_gibps * 2**30,
                          storage_bytes_per_s=self.prior_storage_gibps * 2**30, margin=self.cost_margin)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **overrides) -> "DaemonConfig":
        values: dict = {
            "socket_path": overrides.get("socket_path") or default_socket_path(env),
            "l2_bytes": parse_size(env["KVCACHED_L2_SIZE"]) if env.get("KVCACHED_L2_SIZE") else default_l2_bytes(),
            "l3_path": env.get("KVCACHED_L3_PATH") or None,
            "log_level": env.get("KVCACHED_LOG_LEVEL", "INFO"),
        }
        if env.get("KVCACHED_L3_SIZE"):
            values["l3_bytes"] = parse_size(env["KVCACHED_L3_SIZE"])
        if env.get("KVCACHED_L3_O_DIRECT"):
            values["l3_o_direct"] = env["KVCACHED_L3_O_DIRECT"].lower() in ("1", "true", "yes")
        if env.get("KVCACHED_L3_FRESH"):
            values["l3_fresh"] = env["KVCACHED_L3_FRESH"].lower() in ("1", "true", "yes")
        if env.get("KVCACHED_MAX_NAMESPACES"):
            values["max_namespaces"] = int(env["KVCACHED_MAX_NAMESPACES"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
