"""The engine connector: an engine keeps its own KV tensors; kvcached loads and saves its blocks.

Shaped like vLLM's KV-connector v1, per scheduler step and never waiting on the host:

    connector = KVConnector.register(client, kv_caches, "layer", model_id=..., page_size=16, ...)
    n = connector.lookup(token_ids, local_hit_tokens=h) # side-effect free; the daemon's decision: hold
                                                        # n leading tokens (restore [h, n)), recompute the rest
    ... the engine allocates its own blocks for the request ...
    connector.load(rid, token_ids, block_ids, n)        # queued: an acquire takes the lease, the DMA and
                                                        # scatter follow its reply (poll)
    connector.poll()                                    # once per step: replies in, transfers queued
    connector.finished().loads                          # LoadResult per load: loaded or failed blocks
    connector.finished().queued                         # or earlier: its copies are queued, and
    connector.wait_for_layer_load(layer, None, [rid])   # the engine's stream waits for layer i alone
    ... prefill the rest ...
    connector.save(rid, token_ids, block_ids, start)    # the new full blocks, queued
    if connector.request_finished(rid): ...             # True: keep the blocks until finished().released

The daemon decides, at the lookup, whether restoring beats recomputing (its cost model: the
lookup's ``decision()`` has the chosen source and the predicted costs); the connector feeds that
model: each transfer's time (CUDA events; no host wait) and the engine's prefill times
(``report_prefill``) go to the daemon with the periodic report.

An engine whose scheduler holds the connector may instead ``begin(rid, token_ids, hit)``: a
lookup that is the request's acquire (the decision, the lease and the reservation in one round trip),
so that its ``load`` queues the copies at the call, a round trip sooner. Where the daemon's
admission hints (``engine_client.hints``, read from shared memory) show that it would decline every
restore of the request (no L2 hit, no peer, no L3 hit long enough to win), ``begin``'s lookup is
ready at once with "recompute": the engine admits the request with no round trip. Its acquire
(promote ``recompute``) is sent by the request's next connector call (its save, or a poll), which an
engine makes once its forward is launched: the send, and the reply that brings the save's
reservation, take the host while the GPU runs, not between admission and launch. A stale hint
costs at most a restore not taken, never a wrong byte: loads only ever read under a lease.

One lease per request. The request's first load or save sends one acquire with a reservation
(``ACQUIRE(save)``): it locks the L2 hit (what a load reads) and reserves private L2 pages
for the pages the daemon lacks (what saves write). The replies of a step's acquires are collected by
``poll`` in one sweep, so a step costs one round trip at most, and nobody waits for it. When the
request is finished and its transfers are done, the written pages are committed (``COMMIT``,
which ends the lease) or, with none written, the lease is released.

Loads go by groups of layers (``engine_client.kv_transfer``), an event per group: a prefill may
start once ``finished().queued`` names its load, its attention of layer i waiting (on the GPU) for
layer i's group alone while later groups are still copied; the load's entry in
``finished().loads`` then confirms what it read (or, rarely, voids it: see Fencing).

Fencing (``proto.generations``). A save copies only into the pages it claims at the copy (those
the daemon still reserves for its lease's generation) and stamps them once the copy is complete; a
load copies a page only while it holds the generation the daemon published it with, and keeps it
only if it still does once the copy is seen complete: a page rewritten (or given to another
writer) meanwhile is reported failed, to be recomputed (``stale_generation``). No time margin is
asked of the session: a stall anywhere costs at most a miss.

Nothing is skipped silently: a page a save could not write, or a load could not fill, is counted
by cause (``stats()``), logged once per cause, and reported to the daemon, whose status shows it.
While the daemon is down (``DaemonDown``: the client logs each outage once) requests skip it at
once, counted under ``daemon_down``.

Re-attach: ``session.py``.

Peer restores (``ConnectorConfig.peer``, ``engine_client/peer.py``): the engine's tensors are
registered for other engines on its GPU to copy from; the engine says which blocks it is about to
write (``will_write_blocks``) and which hold a prompt's pages (``blocks_cached``), published at
``poll``. An acquire whose decision is "peer" (another engine's blocks, priced by the daemon's cost
model against L2, L3 and recompute) loads from them, GPU to GPU, each copy's time a "d2d" sample;
blocks that engine changed during the copy are reported failed (``peer_changed``).

Tensor parallelism: each rank registers its own shard (its ``tp_rank``, its own namespace) and
moves only that; ``lookup`` answers for the whole group (the daemon takes the least hit over the
ranks), so a prefix counts as cached only where every rank holds its shard. A rank whose own hit
is shorter than asked loads what it has and reports the rest failed.

Modules, one concern each: ``config`` (ConnectorConfig), ``lookups`` (PrefixLookup, PendingLookup,
BegunLookup), ``state`` (RequestState and its transitions, the causes), ``lease`` (the one way a
request gets its lease; every acquire, commit and release call), ``jobs`` (copies by route),
``transfers`` (a request's loads and saves), ``session`` (the mapped pool follows the session),
``reporting`` (counters and cost samples), ``kv_connector`` (KVConnector).
"""

from engine_client.connector.config import ConnectorConfig, RequestLease
from engine_client.connector.kv_connector import KVConnector
from engine_client.connector.lookups import BegunLookup, PendingLookup, PrefixLookup
from engine_client.connector.state import Cause, IllegalTransition, RequestState
from engine_client.engine_api import Finished, LoadResult

__all__ = ["BegunLookup", "Cause", "ConnectorConfig", "Finished", "IllegalTransition", "KVConnector", "LoadResult",
           "PendingLookup", "PrefixLookup", "RequestLease", "RequestState"]
