"""The reference engine of the benchmarks: a small Qwen3 serving engine that uses kvcached's
connector as any engine would. It is what time-to-first-token is measured on (restore against
recompute), so its prefill is meant to be as fast as Hugging Face transformers' SDPA prefill of the
same shape; it is not part of the installed packages.

    model.py          the Qwen3 decoder (fused QKV and gate+up); random weights from a preset
                      ("qwen3-4b", "qwen3-8b", "qwen3-32b", "tiny") or a ModelConfig, or real ones
                      from a Hugging Face safetensors directory (Qwen3, or Llama: Qwen3 without
                      the q/k norms): ``load_model(source, dtype=, device=, seed=)``
    attention.py      SDPA prefill over cached prefix + new tokens; paged decode (Triton, and the
                      torch reference); KV stores
    block_manager.py  the block allocator and the GPU prefix cache (hash chain, LRU eviction)
    scheduler.py      admission, chunked prefill, decode batches, preemption, the connector hook
    load.py           a request's load from the connector: MATCHING, IN_FLIGHT, DONE, CANCELLED
    request.py        a request's states; engine.py: ``Engine`` (add_request, step, abort)

The calls it makes on a connector are the product's engine contract (``engine_client/engine_api.py``;
``KVConnector`` has them).

Use (on the H200; bf16 on CUDA, fp32 on CPU for tests):

    from bench.engine import Engine, EngineConfig, load_model
    engine = Engine(load_model("qwen3-8b", seed=0), EngineConfig(num_blocks=2048, block_size=16))
    request = engine.add_request(token_ids, max_new_tokens=16)
    while engine.has_unfinished():
        engine.step()
    request.output_token_ids, request.ttft_s        # TTFT: add_request -> first token

With kvcached, register the engine's KV tensors (one per layer, [2, num_blocks, block_size,
kv_heads, head_dim]: the connector's "layer" layout) and plug the connector in while idle:

    connector = KVConnector.register(client, engine.kv_caches, "layer", model_id=...,
                                     page_size=engine.block_size, num_kv_heads=..., head_dim=...)
    engine.attach_connector(connector)

A request whose prefix the connector has waits in LOADING while the others go on; its prefill
starts once the load's copies are queued, each layer's attention waiting for that layer
(``EngineConfig.load_mode="layerwise"``), once the load is done ("async"), or the host waits for it
("blocking", for comparison); ``load.py`` holds a load's states. ``engine.close()`` aborts every
request, waits until the connector gives their blocks back, and closes it.

Tests: ``bench/tests/engine/`` (CPU, against transformers' Qwen3; the Triton kernel under
TRITON_INTERPRET=1; the compiled kernel and bf16 paths are marked ``gpu``).
"""

from bench.engine.config import PRESETS, EngineConfig, ModelConfig
from bench.engine.engine import Engine
from bench.engine.model import Qwen3Model, load_model
from bench.engine.request import Request, RequestState
from engine_client.engine_api import EngineConnector, Finished, LoadResult

__all__ = ["PRESETS", "Engine", "EngineConfig", "EngineConnector", "Finished", "LoadResult", "ModelConfig",
           "Qwen3Model", "Request", "RequestState", "load_model"]
