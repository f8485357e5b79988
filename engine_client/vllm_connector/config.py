"""The vLLM connector's configuration (``kv_connector_extra_config``) and the namespace of a rank's
pages, worked out from vLLM's configuration alone, the same on the scheduler and the worker."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from engine_client.dtypes import dtype_name
from proto.messages import KVGeometry
from proto.paths import default_socket_path

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclasses.dataclass(frozen=True)
class VLLMConnectorConfig:
    """``kv_connector_extra_config`` keys (all optional)."""

    socket: str = ""                  # the daemon's socket ("": the per-user default)
    cache_salt: str = ""              # keeps this engine's pages apart from others' of the same model
    save: bool = True                 # save prompts' pages (False: only load)
    lookup_timeout_s: float = 1.0     # a lookup unanswered this long is a miss (then none is sent
                                  # until the daemon answers a heartbeat again)
    lookup_wait_s: float = 0.002      # the scheduler waits this long, once, for a lookup's reply (then
                                  # the request is scheduled in this step, not the next); 0: never
    reply_timeout_s: float = 5.0      # a load's or save's match unanswered this long: failed / skipped
    retry_interval_s: float = 1.0     # how often a side with no daemon at start-up tries to attach
    client_timeout_s: float = 2.0     # attach and detach
    policy: str = ""                  # restore policy: "cost", "always", "never" ("": the daemon's)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "VLLMConnectorConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(extra) - names
        if unknown:
            raise ValueError(f"unknown kvcached kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(names)}")
        return cls(**extra)

    def __post_init__(self) -> None:
        def number(value) -> bool:          # (a bool is an int to Python, not a timing to a user)
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        for name in ("lookup_timeout_s", "reply_timeout_s", "retry_interval_s", "client_timeout_s"):
            value = getattr(self, name)
            if not number(value) or not value > 0:
                raise ValueError(f"kvcached kv_connector_extra_config {name} must be a positive number, got {value!r}")
        if not number(self.lookup_wait_s) or not 0 <= self.lookup_wait_s < self.lookup_timeout_s:
            raise ValueError(f"kvcached kv_connector_extra_config lookup_wait_s must be >= 0 and below "
                             f"lookup_timeout_s ({self.lookup_timeout_s}), got {self.lookup_wait_s!r}")

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path()


def attention_group(kv_cache_config: "KVCacheConfig"):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        raise ValueError("kvcached's vLLM connector supports models with one group of full-attention layers, got "
                         f"{[type(g.kv_cache_spec).__name__ for g in groups]}")
    return groups[0]


def namespace_geometry(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", tp_rank: int,
                       cache_salt: str = "") -> KVGeometry:
    """The namespace of one rank's pages, from vLLM's configuration alone (the scheduler holds no
    tensors): the model and its revision, the per-rank KV shape, and the page format "blocks" with
    the block's byte shape in memory order as vLLM's KV cache layout puts it ([H, N, C] for the
    identity layout LBHNC, C = K and V of a token packed). The worker checks that its tensors have
    exactly this shape. The layout's name goes into the salt: blocks of equal shape but another
    order never share pages."""
    group = attention_group(kv_cache_config)
    spec = group.kv_cache_spec
    layout = kv_cache_config.kv_cache_layout or "LBHNC"
    sizes = {"H": spec.num_heads, "N": spec.block_size, "C": spec.state_content_size_bytes}
    order = [d for d in layout if d in sizes]
    if sorted(order) != ["C", "H", "N"] or order[-1] != "C":
        raise ValueError(f"kvcached cannot describe vLLM's KV cache layout {layout!r}")
    block_shape = tuple(sizes[d] for d in order if sizes[d] != 1 or d == "C")
    model = vllm_config.model_config
    salt = f"vllm-{layout}" + (f":{cache_salt}" if cache_salt else "")
    return KVGeometry(str(model.model)[-256:], num_layers=len(group.layer_names), num_kv_heads=spec.num_kv_heads,
                      head_dim=spec.head_size, dtype=dtype_name(spec.dtype),
                      page_size=spec.block_size, tp_rank=tp_rank, tp_size=vllm_config.parallel_config.tensor_parallel_size,
                      layout="blocks", block_shape=block_shape, model_revision=str(model.revision or ""),
                      cache_salt=salt)


def cpu_reservation_note(is_cpu: bool, local_world_size: int, environ: dict[str, str]) -> str | None:
    """What to tell a vLLM-CPU user whose instance reserves CPUs for this connector; None where
    nothing is. vLLM-CPU reserves one CPU per local rank for its engine core, and once any KV
    connector is configured one more per rank (for a connector's transfer threads), unless
    VLLM_CPU_NUM_OF_RESERVED_CPU says how many. This connector needs none: its threads wait on
    sockets and, on CPU, its copies run in the worker's own step. So each rank loses a core to
    it, and on a host with no core to spare vLLM cannot reserve them: its OpenMP threads take
    every core, beside the engine core's loop, and forwards slow down under any other load (two
    instances sharing system prompts, each with this connector, then ran slower than two plain
    ones)."""
    if not is_cpu or "VLLM_CPU_NUM_OF_RESERVED_CPU" in environ:
        return None
    return (f"kvcached: vLLM-CPU reserves {local_world_size} more CPU(s) for any KV connector; kvcached's needs "
            f"none: set VLLM_CPU_NUM_OF_RESERVED_CPU={local_world_size} (what vLLM reserves without a connector) "
            f"to give this instance plain vLLM's threads")
