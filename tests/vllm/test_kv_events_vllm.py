"""The daemon's KV events decoded by vLLM's own event classes (``vllm.distributed.kv_events``), as a
router of a vLLM fleet decodes vLLM's: a daemon with --kv-events and a raw engine client, no model.
Skipped where vLLM is not installed (the main test environment); .ci/vllm builds an environment
with it."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest

pytest.importorskip("vllm")

import msgspec  # noqa: E402
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from engine_client.client import connect  # noqa: E402
from kvcached.testing.daemon_proc import DaemonProcess, commit_written  # noqa: E402
from kvcached.testing.engine_proc import GEOMETRY  # noqa: E402
from tests.integration.test_kv_events import TOPIC, page_hashes, replay_all, wait_until_settled  # noqa: E402
from kvcached.testing.l3 import back_up_random  # noqa: E402

PAGE = GEOMETRY.page_size
NUM_L2_PAGES = (2 << 20) // GEOMETRY.bytes_per_page


def test_vllm_decodes_the_daemons_events(rng):
    """An engine client saves a 4-page prefix, then fills L2 until it is evicted. Every message the
    daemon published decodes with ``msgspec.msgpack.Decoder(KVEventBatch)``, and vLLM's encoder
    gives back the very bytes sent (the same wire format, field for field). The batches hold, in
    order: AllBlocksCleared; BlockStored of the prefix's pages with their hashes, no parent, their
    token ids, block size 16, medium "CPU", locality "LOCAL", no LoRA; later BlockRemoved of those
    hashes from "CPU"."""
    directory = tempfile.mkdtemp(prefix="kvt-ev-", dir="/tmp")
    daemon = DaemonProcess(l2_size="2MiB", extra_args=(
        "--l3-size", "0", "--kv-events", f"ipc://{directory}/events", "--kv-events-replay",
        f"ipc://{directory}/replay", "--kv-events-node", "test-node")).start()
    try:
        with connect(daemon.socket_path, timeout_s=5.0) as client:
            client.attach(GEOMETRY)
            prefix = rng.integers(0, 150_000, size=4 * PAGE, dtype=np.int32)
            commit_written(client, client.acquire(prefix, save=True))
            assert client.flush() == []
            for _ in range(3):
                back_up_random(client, NUM_L2_PAGES // 2, rng)
            wait_until_settled(client)
            assert client.lookup_async(prefix).result().hit_tokens["l2"] == 0
        messages = replay_all(f"ipc://{directory}/replay")
    finally:
        daemon.cleanup()
        shutil.rmtree(directory, ignore_errors=True)

    decoder, encoder = msgspec.msgpack.Decoder(KVEventBatch), msgspec.msgpack.Encoder()
    events = []
    for topic, _, payload in messages:
        assert topic == TOPIC
        batch = decoder.decode(payload)
        assert encoder.encode(batch) == payload
        assert batch.data_parallel_rank is None
        events.extend(batch.events)
    assert isinstance(events[0], AllBlocksCleared)
    hashes = page_hashes(prefix, 4)
    (stored,) = [e for e in events if isinstance(e, BlockStored) and hashes[0] in e.block_hashes]
    assert stored.block_hashes == hashes and stored.parent_block_hash is None
    assert stored.token_ids == prefix.tolist() and stored.block_size == PAGE
    assert (stored.medium, stored.locality, stored.lora_id, stored.lora_name) == ("CPU", "LOCAL", None, None)
    removed = [e for e in events if isinstance(e, BlockRemoved) and set(hashes) & set(e.block_hashes)]
    assert removed and {h for e in removed for h in e.block_hashes} >= set(hashes)
    assert all(e.medium == "CPU" and e.locality == "LOCAL" for e in removed)
    assert events.index(stored) < events.index(removed[0])
