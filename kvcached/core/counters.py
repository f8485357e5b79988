"""Every counter and time histogram of the daemon, declared once (``proto.counters.Counter``).

Four groups, one per place in the status snapshot: ``DAEMON`` (status ``metrics``, and
``metrics_by_model`` for the per-model ones), ``HISTOGRAMS`` (status ``histograms``), ``REMOTE``
(the remote store client's, status ``daemon.remote.counters``) and ``COST_MODEL`` (status
``cost_model``). docs/metrics.md lists them (``python -m kvcached.server.metrics --docs``).
"""

from __future__ import annotations

from proto.counters import Counter
from proto.errors import ErrorCode
from proto.messages import MsgKind

TIERS = ("l2", "l3")
L3_DIRECTIONS = ("h2s", "s2h")              # L2 to the L3 file and back
MOVE_DIRECTIONS = ("h2s", "s2h", "r2h")      # and the remote store to L2
REMOTE_OPS = ("exist", "get", "put")
# The refusals (an error reply for the peer's request); INTERNAL, a daemon bug, is INTERNAL_ERRORS.
REFUSAL_CODES = tuple(code.name.lower() for code in ErrorCode if code is not ErrorCode.INTERNAL)
REQUEST_KINDS = tuple(kind.name.lower() for kind in MsgKind)
SESSION_END_REASONS = ("expired", "grace_exceeded", "ended_process_gone", "replaced")
QUARANTINE_END_CAUSES = ("reattach", "process_gone", "grace")

# ---- status "metrics" --------------------------------------------------------------------------

ACQUIRES = Counter("matches", "kvcached_matches", "Acquires handled (requests that may lease pages)", per_model=True)
ACQUIRE_TOKENS = Counter("match_tokens", "kvcached_match_tokens", "Tokens (whole pages) of the prompts acquired",
                         per_model=True)
HIT_TOKENS = Counter("hit_tokens_{}", "kvcached_hit_tokens", "Leading tokens of acquired prompts the tier held (l2: "
                     "after any promotion from L3; peer: another engine's GPU cache)", "tier", (*TIERS, "peer"),
                     per_model=True)
LOOKUPS = Counter("lookups", "kvcached_lookups", "Lookups handled (they change nothing)", per_model=True)
LOOKUP_TOKENS = Counter("lookup_tokens", "kvcached_lookup_tokens", "Tokens (whole pages) looked up", per_model=True)
LOOKUP_HIT_TOKENS = Counter("lookup_hit_tokens_{}", "kvcached_lookup_hit_tokens", "Leading tokens of looked-up "
                            "prompts the tier held (remote: L2 and the remote store together; peer: another "
                            "engine's GPU cache)", "tier", ("l2", "remote", "peer"), per_model=True)
EVICTED_PAGES = Counter("evicted_pages_{}", "kvcached_evicted_pages", "Pages evicted (LRU) to make room", "tier",
                        TIERS, per_model=True)
PRESSURE_EPISODES = Counter("pressure_episodes_{}", "kvcached_pressure_episodes", "Times a namespace's tier began "
                            "evicting after a quiet while (each logged once)", "tier", TIERS)
CHUNKS_TAKEN = Counter("chunks_taken_{}", "kvcached_chunks_taken", "Chunks of a tier moved from one namespace to "
                       "another (its cached pages evicted)", "tier", TIERS)
COMMITTED_PAGES = Counter("backup_pages_committed", "kvcached_committed_pages", "Pages engines saved that entered "
                          "L2 (new to the tree)", per_model=True)
DUPLICATE_PAGES = Counter("backup_pages_duplicate", "kvcached_duplicate_pages", "Saved pages another engine had "
                          "committed first (freed)")
RESERVED_PAGES = Counter("backup_pages_reserved", "kvcached_reserved_pages", "L2 pages reserved for engines' saves")
RESERVATION_FAILURES = Counter("backup_reserve_failures", "kvcached_reservation_failures", "Acquires that wanted "
                               "pages for saves and got none")
RESERVATIONS_CAPPED = Counter("reservations_capped", "kvcached_reservations_capped", "Reservations cut to a "
                              "session's share of a namespace")
PROMOTIONS = Counter("promotions", "kvcached_promotions", "Acquires served after an L3 -> L2 promotion")
PROMOTION_FALLBACKS = Counter("restore_fallbacks", "kvcached_fallbacks", "Acquires whose restore failed (the engine "
                              "recomputes), by reason", fixed={"reason": "promotion_failed"})
REMOTE_FALLBACKS = Counter("remote_restore_fallbacks", "kvcached_fallbacks", "", fixed={"reason": "remote_failed"})
IO_PUBLISHED_PAGES = Counter("{}_pages_published", "kvcached_io_published_pages", "Pages an L3 write (h2s), "
                             "promotion (s2h) or remote restore (r2h) added to its tier", "direction", MOVE_DIRECTIONS)
IO_PAGES_CUT = Counter("{}_pages_cut_no_space", "kvcached_io_pages_cut", "Pages an L3 write (h2s) or promotion "
                       "(s2h) left out for want of room in the tier it copies to (the pages before them were "
                       "copied)", "direction", L3_DIRECTIONS)
IO_BYTES = Counter("{}_bytes", "kvcached_io_bytes", "Bytes moved between L2 and the L3 file", "direction",
                   L3_DIRECTIONS)
IO_EXTENTS = Counter("{}_extents", "kvcached_io_extents", "File extents (coalesced I/Os) of L3 moves", "direction",
                     L3_DIRECTIONS)
IO_FAILURES = Counter("{}_failures", "kvcached_io_failures", "L3 moves and remote restores that failed (their pages "
                      "returned)", "direction", MOVE_DIRECTIONS)
# Status only: each duplicates a histogram's count or sum (HISTOGRAMS), which Prometheus gets.
IO_MOVES = Counter("{}_count", None, "L3 moves done (kvcached_io_service_seconds_count)", "direction", L3_DIRECTIONS)
IO_SERVICE_SECONDS_SUM = Counter("{}_seconds", None, "Their file I/O time (kvcached_io_service_seconds_sum)",
                                 "direction", L3_DIRECTIONS)
IO_QUEUE_WAIT_SECONDS_SUM = Counter("{}_queue_wait_seconds", None, "Their wait for an I/O thread "
                                    "(kvcached_io_queue_wait_seconds_sum)", "direction", L3_DIRECTIONS)
IO_END_TO_END_SECONDS_SUM = Counter("{}_end_to_end_seconds", None, "Enqueue to completion "
                                    "(kvcached_io_end_to_end_seconds_sum)", "direction", L3_DIRECTIONS)
NO_SPACE_SKIPS = Counter("{}_no_space", "kvcached_policy_skips", "Copies to another tier not made, by reason",
                         "direction", MOVE_DIRECTIONS, fixed={"reason": "no_space"})
BACKLOG_SKIPS = Counter("{}_policy_skips", "kvcached_policy_skips", "", "direction", L3_DIRECTIONS,
                        fixed={"reason": "backlog"})
EVICTED_BEFORE_REUSE_SKIPS = Counter("backup_policy_skips", "kvcached_policy_skips", "",
                                     fixed={"direction": "d2h", "reason": "evicted_before_reuse"})
WRITE_BACKOFF_SKIPS = Counter("h2s_backoff_skips", "kvcached_l3_write_backoff_skips", "L3 writes not tried during "
                              "the pause after a failed one (also in kvcached_policy_skips_total{reason=backlog})")
STALE_GENERATION_PAGES = Counter("pages_stale_generation", "kvcached_stale_generation_pages", "Pages of an L3 write "
                                 "not written: an engine rewrote them while they were read")
ATTACHES = Counter("attaches", "kvcached_attaches", "Engine sessions attached")
SESSIONS_ENDED = Counter("sessions_{}", "kvcached_sessions_ended", "Sessions ended other than by detaching, by "
                         "reason", "reason", SESSION_END_REASONS)
PREVIOUS_SESSION_REFUSED = Counter("previous_session_refused", "kvcached_previous_session_refused", "Attaches "
                                   "naming a previous session of another process (ignored)")
LEASES_ENDED = Counter("leases_{}", "kvcached_leases_ended", "Leases ended, by how", "how", ("released", "reclaimed"))
LEASES_COMMITTED = Counter("backup_commits", "kvcached_leases_ended", "", fixed={"how": "committed"})
COMMITS_REFUSED = Counter("commits_refused_session_ended", "kvcached_commits_refused", "Commits refused, by reason",
                          fixed={"reason": "session_ended"})
QUARANTINES = Counter("quarantines", "kvcached_quarantines", "Sessions whose private pages were quarantined")
QUARANTINED_PAGES = Counter("pages_quarantined", "kvcached_quarantined_pages", "Pages quarantined")
QUARANTINES_ENDED = Counter("quarantines_ended_{}", "kvcached_quarantines_ended", "Quarantines ended, by cause",
                            "reason", QUARANTINE_END_CAUSES)
NAMESPACES_RECLAIMED = Counter("namespaces_reclaimed", "kvcached_namespaces_reclaimed", "Idle namespaces whose "
                               "space went to a new one")
DAEMON_PAUSES = Counter("daemon_pauses", "kvcached_daemon_pauses", "Times the daemon did not run for a while "
                        "(stopped, starved)")
DAEMON_PAUSED_SECONDS = Counter("daemon_pause_seconds", "kvcached_daemon_paused_seconds", "Seconds the daemon did "
                                "not run")
L3_CHECKSUM_MISMATCHES = Counter("l3_checksum_mismatches", "kvcached_l3_checksum_mismatches", "L3 pages read back "
                                 "with a wrong checksum")
L3_CORRUPT_PAGES = Counter("l3_pages_dropped_corrupt", "kvcached_l3_dropped_pages", "L3 pages dropped, by reason",
                           fixed={"reason": "corrupt"})
L3_INDEX_ROWS_DROPPED = Counter("l3_index_rows_dropped", "kvcached_l3_dropped_pages", "",
                                fixed={"reason": "index_unusable"})
L3_RESTORED_PAGES = Counter("l3_pages_restored", "kvcached_l3_restored_pages", "L3 pages rebuilt from the index at "
                            "start")
PEER_REGISTRATIONS = Counter("peer_registrations", "kvcached_peer_registrations", "Engines that offered their GPU "
                             "cache to other engines")
PEER_REGISTRATIONS_ENDED = Counter("peer_registrations_ended", "kvcached_peer_registrations_ended", "Those offers "
                                   "withdrawn (the engine unregistered or its session ended)")
PEER_PUBLICATIONS = Counter("peer_publications", "kvcached_peer_publications", "Lists of GPU blocks engines "
                            "published (blocks that hold pages, blocks that no longer do)")
PEER_BLOCKS_PUBLISHED = Counter("peer_blocks_published", "kvcached_peer_blocks", "GPU blocks of engines the tree "
                                "learnt or forgot, by how", fixed={"how": "published"})
PEER_BLOCKS_REMOVED = Counter("peer_blocks_removed", "kvcached_peer_blocks", "", fixed={"how": "removed"})
PEER_BLOCKS_FORGOTTEN = Counter("peer_blocks_forgotten", "kvcached_peer_blocks", "", fixed={"how": "forgotten"})
REMOTE_HIT_PAGES = Counter("remote_hit_pages", "kvcached_remote_hit_pages", "Pages restored from the remote store "
                           "into L2 (their header and checksum checked)")
REMOTE_WRITTEN_PAGES = Counter("remote_pages_written", "kvcached_remote_written_pages", "L2 pages written through "
                               "to the remote store")
REMOTE_BYTES = Counter("remote_bytes_{}", "kvcached_remote_bytes", "Page bytes read from and written to the remote "
                       "store", "op", ("read", "written"))
REMOTE_CHECKSUM_MISMATCHES = Counter("remote_checksum_mismatches", "kvcached_remote_checksum_mismatches", "Values "
                                     "the remote store gave that were not the page asked for (another page, torn, a "
                                     "wrong checksum): dropped, recomputed")
REMOTE_RESTORES = Counter("remote_restores", "kvcached_remote_restores", "Acquires served after a restore from the "
                          "remote store")
REMOTE_GET_CALLS = Counter("remote_get_calls", "kvcached_remote_get_calls", "Restores whose gets the remote store "
                           "answered")
KV_EVENTS_SENT = Counter("kv_events_sent", "kvcached_kv_events_sent", "KV events (BlockStored, BlockRemoved, "
                         "AllBlocksCleared) taken to be published on the --kv-events socket")
KV_EVENTS_DROPPED = Counter("kv_events_dropped", "kvcached_kv_events_dropped", "KV events dropped because their "
                            "buffer was full (a gap in the sequence numbers tells subscribers)")
INTERNAL_ERRORS = Counter("errors_internal", "kvcached_internal_errors", "Requests that hit a daemon bug (error reply)")
REFUSED_REQUESTS = Counter("errors_{}", "kvcached_refused_requests", "Requests refused with an error reply, by code",
                           "code", REFUSAL_CODES)
REPLIES_DROPPED = Counter("replies_dropped", "kvcached_replies_dropped", "Replies not delivered (peer gone or not "
                          "reading)")

# ---- status "histograms" -----------------------------------------------------------------------

IO_SERVICE_SECONDS = Counter("{}_service_seconds", "kvcached_io_service_seconds", "Time an L3 move spent in file "
                             "I/O", "direction", L3_DIRECTIONS, histogram=True)
IO_QUEUE_WAIT_SECONDS = Counter("{}_queue_wait_seconds", "kvcached_io_queue_wait_seconds", "Time an L3 move waited "
                                "for an I/O thread (end to end less service)", "direction", L3_DIRECTIONS,
                                histogram=True)
IO_END_TO_END_SECONDS = Counter("{}_end_to_end_seconds", "kvcached_io_end_to_end_seconds", "Time from an L3 move's "
                                "(or a remote restore's) enqueue to its completion", "direction", MOVE_DIRECTIONS,
                                histogram=True)
REQUEST_SECONDS = Counter("request_seconds_{}", "kvcached_request_seconds", "Time the socket thread spent handling "
                          "a request, by kind", "kind", REQUEST_KINDS, histogram=True)

# ---- status "daemon.remote.counters" (the remote store client) ---------------------------------

REMOTE_ERRORS = Counter("remote_errors_{}", "kvcached_remote_errors", "Remote store calls that failed or missed "
                        "their deadline, by call", "op", REMOTE_OPS)
REMOTE_DEADLINE_MISSES = Counter("remote_deadline_misses_{}", "kvcached_remote_deadline_misses", "Remote store calls "
                                 "not answered within their deadline (the request went on with a local miss)", "op",
                                 REMOTE_OPS)
REMOTE_SKIPS = Counter("remote_skips_{}", "kvcached_remote_skips", "Remote store calls not made: the store was "
                       "unreachable (breaker open) or too many writes in flight", "op", REMOTE_OPS)
REMOTE_WRITE_BACKLOG_SKIPS = Counter("remote_skips_put_backlog", "kvcached_remote_skips", "", fixed={"op": "put"})
REMOTE_LOOKUPS = Counter("remote_exist_calls", "kvcached_remote_lookups", "Lookups and acquires that asked the remote "
                         "store which following pages it holds")
REMOTE_LOOKUP_SECONDS = Counter("remote_exist_seconds", "kvcached_remote_lookup_seconds", "Seconds those questions "
                                "took (the latency they add to a request)")
REMOTE_LOOKUP_HELD_PAGES = Counter("remote_exist_held_pages", "kvcached_remote_lookup_held_pages", "Pages the remote "
                                   "store said it held")
REMOTE_GET_STORE_SECONDS = Counter("remote_get_store_seconds", "kvcached_remote_get_store_seconds", "Seconds the "
                                   "remote store's gets took (the checks of what they gave not included)")
REMOTE_CONNECTS = Counter("remote_connects", "kvcached_remote_connects", "Connections made to the remote store")
REMOTE_PROBE_FAILURES = Counter("remote_probe_failures", "kvcached_remote_probe_failures", "Probes of an "
                                "unreachable remote store that failed")

# ---- status "cost_model" -----------------------------------------------------------------------

BACKGROUND_PROMOTIONS = Counter("background_promotions_total", "kvcached_background_promotions", "L3 hits a lookup "
                                "declined, promoted to L2 in the background (a later request restores them at DMA "
                                "speed)")
BACKGROUND_PROMOTED_PAGES = Counter("background_promoted_pages_total", "kvcached_background_promoted_pages", "Pages "
                                    "background promotions added to L2")
BACKGROUND_PROMOTION_SKIPS = Counter("background_promotion_skips_{}_total", "kvcached_background_promotion_skips",
                                     "Background promotions not started, by reason", "reason", ("busy", "no_gain"))
STALE_LINE_RESETS = Counter("stale_line_resets_total", "kvcached_cost_model_stale_line_resets", "Lines that dropped "
                            "their samples (back to the prior) after their source was declined long with no sample "
                            "between")
SAMPLES_IGNORED = Counter("samples_ignored_total", "kvcached_cost_model_samples_ignored", "Timings engines reported "
                          "that are no sample (a prefill too short, a time out of range)")


_ALL = tuple(value for value in list(globals().values()) if isinstance(value, Counter))
HISTOGRAMS: tuple[Counter, ...] = tuple(counter for counter in _ALL if counter.histogram)
REMOTE: tuple[Counter, ...] = (REMOTE_ERRORS, REMOTE_DEADLINE_MISSES, REMOTE_SKIPS, REMOTE_WRITE_BACKLOG_SKIPS,
                               REMOTE_LOOKUPS, REMOTE_LOOKUP_SECONDS, REMOTE_LOOKUP_HELD_PAGES,
                               REMOTE_GET_STORE_SECONDS, REMOTE_CONNECTS, REMOTE_PROBE_FAILURES)
COST_MODEL: tuple[Counter, ...] = (BACKGROUND_PROMOTIONS, BACKGROUND_PROMOTED_PAGES, BACKGROUND_PROMOTION_SKIPS,
                                   STALE_LINE_RESETS, SAMPLES_IGNORED)
# The rest: every counter declared above that is neither a histogram, the remote client's nor the cost model's.
DAEMON: tuple[Counter, ...] = tuple(counter for counter in _ALL
                                    if not counter.histogram and counter not in REMOTE + COST_MODEL)
