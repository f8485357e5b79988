"""Daemon configuration: one frozen dataclass; the CLI takes its defaults from here.

Environment variables (``KVCACHED_*``) are read in this module only (``ENV_VARIABLES``; the socket's
``KVCACHED_SOCKET`` through ``proto.paths``, which engines share). A bad value raises
``ConfigError``, whose message names the variable (or, from ``DaemonConfig`` itself, the field).
"""

from __future__ import annotations

import dataclasses
import fractions
import os
import re
import shutil
from typing import Any, Callable, Iterable, Mapping

from kvcached.core.cost_model import CostPriors
from proto.messages import RESTORE_POLICIES
from proto.paths import default_socket_path, normalize_socket_path

# Sizes: k, m, g, t and KiB, MiB, GiB, TiB are binary, as docker and the JVM read them; KB, MB, GB,
# TB are decimal. Case does not matter. No unit: bytes.
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 1000,
    "m": 1 << 20, "mib": 1 << 20, "mb": 1000**2,
    "g": 1 << 30, "gib": 1 << 30, "gb": 1000**3,
    "t": 1 << 40, "tib": 1 << 40, "tb": 1000**4,
}
SIZE_HELP = ("sizes are a number and a unit: k m g t and KiB MiB GiB TiB are binary (64g = 64GiB = 64 * 2^30 "
             "bytes), KB MB GB TB decimal (64GB = 64 * 10^9 bytes), no unit is bytes; case does not matter, "
             "fractions are allowed (1.5g)")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

DEFAULT_L2_MAX_BYTES = 1 << 30       # modest: a sidecar on any box
DEFAULT_L3_BYTES = 4 << 30           # a sparse temporary file: only written pages use disk
SHM_DIR = "/dev/shm"
# /metrics, /status and the status page. The default is loopback only, and best effort: a second
# daemon on the host (another user's) runs without it rather than not at all.
DEFAULT_HTTP_ADDRESS = "127.0.0.1:9464"
_REMOTE_URL = re.compile(r"mooncake://[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}")
_ZMQ_ENDPOINT = re.compile(r"tcp://(\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}|ipc://\S+")


# CostPriors' field (the first word of its ValueError) -> the DaemonConfig field that sets it
_COST_PRIOR_FIELDS = {"recompute_s_per_token": "prior_recompute_us_per_token", "host_bytes_per_s": "prior_host_gibps",
                      "storage_bytes_per_s": "prior_storage_gibps", "margin": "cost_margin",
                      "peer_bytes_per_s": "prior_peer_gibps", "remote_bytes_per_s": "prior_remote_gibps"}


class ConfigError(ValueError):
    """A setting that cannot be used; ``field`` is the DaemonConfig field it is about, if any."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def parse_size(text: str) -> int:
    """'64GiB' and '64g' -> 68719476736; '64GB' -> 64000000000; '1.5g' -> 1610612736; plain
    integers are bytes. ValueError for anything else."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 512MiB, 64g, 1TiB: g and GiB are 2^30 bytes, GB 10^9)")
    return int(fractions.Fraction(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a yes/no value: {text!r} (1, true, yes, on or 0, false, no, off)")


def parse_int(text: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def parse_log_level(text: str) -> str:
    level = str(text).strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"not a log level: {text!r} (one of {', '.join(LOG_LEVELS)})")
    return level


# KVCACHED_* variable -> (the DaemonConfig field it sets, how its text is read)
ENV_VARIABLES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "KVCACHED_L2_SIZE": ("l2_bytes", parse_size),
    "KVCACHED_L3_PATH": ("l3_path", str),
    "KVCACHED_L3_SIZE": ("l3_bytes", parse_size),
    "KVCACHED_SHM_DIR": ("shm_dir", str),
    "KVCACHED_L3_O_DIRECT": ("l3_o_direct", parse_bool),
    "KVCACHED_L3_FRESH": ("l3_fresh", parse_bool),
    "KVCACHED_MAX_NAMESPACES": ("max_namespaces", parse_int),
    "KVCACHED_LOG_LEVEL": ("log_level", parse_log_level),
    "KVCACHED_HTTP": ("http_address", str),
    "KVCACHED_HTTP_ALLOW_HOST": ("http_allow_hosts", lambda text: parse_host_names(text.split(","))),
    "KVCACHED_KV_EVENTS": ("kv_events", str),
}


def format_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def parse_http_address(text: str) -> tuple[str, int] | None:
    """'127.0.0.1:9464' -> ('127.0.0.1', 9464); '[::1]:9464' -> ('::1', 9464); 'off' -> None."""
    if text == "off":
        return None
    match = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})", text)
    if not match or int(match.group(2)) > 65535:
        raise ValueError(f"not an HTTP listen address: {text!r} (use HOST:PORT, e.g. 127.0.0.1:9464, "
                         "[::1]:9464, 0.0.0.0:9464, or off)")
    return match.group(1).strip("[]"), int(match.group(2))


def parse_host_names(names: Iterable[str]) -> tuple[str, ...]:
    """Host names an HTTP request may name in its Host header (besides loopback and the bound address)."""
    checked = []
    for name in names:
        name = name.strip().lower().rstrip(".")
        if not re.fullmatch(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?", name):
            raise ValueError(f"not a host name: {name!r} (e.g. kvcached.example.com)")
        checked.append(name)
    return tuple(checked)


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
    max_namespaces: int = 16             # distinct geometries served at once (they share the pool: no cost)
    session_share: float = 0.5          # the most of L2 one engine's leases reserve at once (saves, promotions)
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
    # Where the L2 segment and its small files live; engines open them by the paths the daemon
    # names, so every engine must see this directory at the same path (deploy/k8s: one per node).
    shm_dir: str = SHM_DIR
    refusal_log_interval_s: float = 10.0   # refused requests: DEBUG each, one WARNING summary per interval
    # "": DEFAULT_HTTP_ADDRESS, skipped with a warning when taken; "off": none; HOST:PORT: that
    # address, or the daemon does not start (port 0: any free port; status names it).
    http_address: str = ""
    http_allow_hosts: tuple[str, ...] = ()   # names a request's Host may give (loopback and addresses pass)
    log_level: str = "INFO"
    # The cost model (kvcached/core/cost_model.py): which restores are taken, and its priors.
    restore_policy: str = "cost"        # "cost": restore what beats recompute; "always"; "never"
    cost_margin: float = 1.1            # a restore must beat recompute by this factor
    prior_recompute_us_per_token: float = 50.0
    prior_host_gibps: float = 12.0      # L2 <-> GPU
    prior_storage_gibps: float = 3.0    # L3 reads and writes
    prior_peer_gibps: float = 1000.0    # another engine's GPU memory -> this engine's
    prior_remote_gibps: float = 1.0     # remote store reads
    # The remote tier (kvcached/core/remote.py): "" off; "mooncake://HOST:PORT", a Mooncake master.
    remote: str = ""
    # Mooncake's metadata server: "" the master's own HTTP one (HOST:8080), or a URL, or "P2PHANDSHAKE".
    remote_metadata: str = ""
    remote_local_host: str = "127.0.0.1"       # the address other hosts reach this daemon's store client at
    remote_segment_bytes: int = 256 << 20     # memory this daemon lends the store (0: none, a client only)
    remote_exist_timeout_s: float = 0.1       # a lookup's question "which following pages do you hold"
    remote_get_timeout_s: float = 0.2         # a restore's gets: this, plus remote_get_min_gibps of its bytes
    remote_get_min_gibps: float = 0.25
    # KV events for cache-aware routers (kvcached/core/kv_events.py): "" off; tcp://*:PORT or ipc://PATH
    # (bound), tcp://HOST:PORT (connected to: an indexer that binds), as vLLM's KVEventsConfig.endpoint.
    kv_events: str = ""
    kv_events_replay: str = ""          # "" none; else where the replay socket is bound
    kv_events_node: str = ""            # this node's name in the events' topics, kv@NODE@MODEL ("": the host name)

    def __post_init__(self) -> None:
        # A path or an ipc:// URL, made absolute; too long for a socket address: ConfigError.
        try:
            object.__setattr__(self, "socket_path", normalize_socket_path(self.socket_path))
        except ValueError as exc:
            raise ConfigError(str(exc), "socket_path") from None
        try:
            object.__setattr__(self, "log_level", parse_log_level(self.log_level))
        except ValueError as exc:
            raise ConfigError(str(exc), "log_level") from None
        checks = (
            ("shm_dir", os.path.isabs(self.shm_dir), f"shm_dir must be an absolute path, got {self.shm_dir!r}"),
            ("l2_bytes", self.l2_bytes >= (2 << 20), f"l2_bytes must be at least 2 MiB, got {self.l2_bytes} bytes"),
            ("max_namespaces", 1 <= self.max_namespaces <= 1024, "max_namespaces must be in 1..1024"),
            ("heartbeat_interval_s", 0 < self.heartbeat_interval_s < self.session_timeout_s,
             "heartbeat_interval_s must be positive and below session_timeout_s"),
            ("session_grace_s", self.session_grace_s >= self.session_timeout_s,
             f"session_grace_s ({self.session_grace_s}) must be at least session_timeout_s "
             f"({self.session_timeout_s})"),
            ("l3_bytes", self.l3_bytes >= 0, "l3_bytes must be >= 0"),
            ("socket_spin_us", 0 <= self.socket_spin_us <= 100_000, "socket_spin_us must be in 0..100000"),
            ("socket_cpu", self.socket_cpu is None or self.socket_cpu in os.sched_getaffinity(0),
             f"socket_cpu {self.socket_cpu} is not among the CPUs this process may use: "
             f"{sorted(os.sched_getaffinity(0))}"),
            ("refusal_log_interval_s", self.refusal_log_interval_s > 0, "refusal_log_interval_s must be positive"),
            ("io_threads", 1 <= self.io_threads <= 256, "io_threads must be in 1..256"),
            ("session_share", 0 < self.session_share <= 1, "session_share must be in (0, 1]"),
            ("remote", not self.remote or _REMOTE_URL.fullmatch(self.remote) is not None,
             f"remote must be mooncake://HOST:PORT, got {self.remote!r}"),
            ("remote_segment_bytes", self.remote_segment_bytes >= 0, "remote_segment_bytes must be >= 0"),
            ("remote_exist_timeout_s", 0 < self.remote_exist_timeout_s <= 10, "remote_exist_timeout_s must be in (0, 10]"),
            ("remote_get_timeout_s", 0 < self.remote_get_timeout_s <= 60, "remote_get_timeout_s must be in (0, 60]"),
            ("remote_get_min_gibps", self.remote_get_min_gibps > 0, "remote_get_min_gibps must be positive"),
        )
        for field, ok, message in checks:
            if not ok:
                raise ConfigError(message, field)
        if self.restore_policy not in RESTORE_POLICIES:
            raise ConfigError(f"restore_policy must be one of {RESTORE_POLICIES}, got {self.restore_policy!r}",
                              "restore_policy")
        try:
            self.cost_priors
        except ValueError as exc:
            raise ConfigError(str(exc), _COST_PRIOR_FIELDS[str(exc).split()[0]]) from None
        for field in ("kv_events", "kv_events_replay"):
            endpoint = getattr(self, field)
            if endpoint and (not _ZMQ_ENDPOINT.fullmatch(endpoint)
                             or endpoint.startswith("tcp://") and int(endpoint.rsplit(":", 1)[1]) > 65535):
                raise ConfigError(f"{field} must be tcp://*:PORT or ipc://PATH (bound), or tcp://HOST:PORT "
                                  f"(connected to), got {endpoint!r}", field)
        if self.kv_events_replay and not self.kv_events:
            raise ConfigError("kv_events_replay needs kv_events", "kv_events_replay")
        if "@" in self.kv_events_node:
            raise ConfigError(f"kv_events_node must not contain '@' (topics are kv@NODE@MODEL), got "
                              f"{self.kv_events_node!r}", "kv_events_node")
        try:
            parse_http_address(self.http_address or DEFAULT_HTTP_ADDRESS)
        except ValueError as exc:
            raise ConfigError(str(exc), "http_address") from None
        try:
            object.__setattr__(self, "http_allow_hosts", parse_host_names(self.http_allow_hosts))
        except ValueError as exc:
            raise ConfigError(str(exc), "http_allow_hosts") from None

    @property
    def cost_priors(self) -> CostPriors:
        return CostPriors(recompute_s_per_token=self.prior_recompute_us_per_token * 1e-6,
                          host_bytes_per_s=self.prior_host_gibps * 2**30,
                          storage_bytes_per_s=self.prior_storage_gibps * 2**30, margin=self.cost_margin,
                          peer_bytes_per_s=self.prior_peer_gibps * 2**30,
                          remote_bytes_per_s=self.prior_remote_gibps * 2**30)

    @property
    def remote_master(self) -> str:
        """HOST:PORT of the remote tier's Mooncake master ("": no remote tier)."""
        return self.remote[len("mooncake://"):] if self.remote else ""

    @property
    def remote_metadata_server(self) -> str:
        """Mooncake's metadata server: the one named, else the master's own HTTP one."""
        if self.remote_metadata:
            return self.remote_metadata
        return f"http://{self.remote_master.rsplit(':', 1)[0]}:8080/metadata"

    @property
    def http_endpoint(self) -> tuple[str, int] | None:
        """Where the HTTP listener binds (host, port); None: no listener."""
        return parse_http_address(self.http_address or DEFAULT_HTTP_ADDRESS)

    @property
    def http_required(self) -> bool:
        """An address was asked for: failing to bind it stops the start."""
        return self.http_address not in ("", "off")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **overrides) -> "DaemonConfig":
        """The configuration from the KVCACHED_* variables, each overridden by a keyword that is
        not None (the CLI's flags). ConfigError names the variable of a bad value it read."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}            # field -> the variable (and text) it came from
        for variable, (field, parse) in ENV_VARIABLES.items():
            text = env.get(variable)
            if not text or field in overrides:
                continue
            try:
                values[field] = parse(text)
            except ValueError as exc:
                raise ConfigError(f"{variable}={text!r}: {exc}", field) from None
            origins[field] = f"{variable}={text!r}"
        if "socket_path" not in overrides:
            try:
                values["socket_path"] = default_socket_path(env)
            except ValueError as exc:
                raise ConfigError(str(exc), "socket_path") from None
        values.update(overrides)
        values.setdefault("l2_bytes", default_l2_bytes(values.get("shm_dir", SHM_DIR)))
        try:
            return cls(**values)
        except ConfigError as exc:
            if exc.field in origins:
                raise ConfigError(f"{origins[exc.field]}: {exc}", exc.field) from None
            raise
