"""The status snapshot as JSON and as a human table; the client ``kvcached status`` uses.

``status_json`` is the one JSON encoding (``kvcached status --json`` and GET /status).
``render_table(snapshot, previous)`` prints it for people: sizes in bytes and in tokens, and,
given the snapshot before (``--follow``), the rates over the interval between them.
``COLUMNS`` explains every column; ``kvcached status --help`` prints it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import Any

from kvcached.config import format_size
from kvcached.core import counters
from proto.counters import ENGINE_LOADED_PAGES, ENGINE_SAVED_PAGES, Counter

# Every column and figure the table prints, with what it means (``kvcached status --help``).
COLUMNS: dict[str, dict[str, str]] = {
    "namespaces (one per KV geometry; two rows per tier: bytes, then tokens)": {
        "ns": "namespace id; engines share prefixes only within one",
        "model": "the model id engines attached with",
        "page": "bytes of one page = tokens of one page (the engines' page size)",
        "tier": "l2: the shared pinned host pool; l3: the local file",
        "unit": "bytes or tokens: the row's sizes in that unit (pages x page bytes, or pages x page tokens)",
        "capacity": "all of the tier the namespace holds: free + owned + private + quarant.",
        "free": "not in use: a reservation takes these first",
        "owned": "holding cached prefixes (the prefix tree owns them)",
        "protected": "owned and locked by a lease or a pending move: never evicted while locked",
        "evictable": "owned, unlocked leaves: evicted (LRU) when a reservation needs room",
        "private": "reserved by a lease (an engine is saving into them) or a pending move",
        "quarant.": "private to an ended session whose engine may still write them; free once it cannot",
    },
    "sessions (one per attached engine process or TP rank)": {
        "session": "a digest of the session id (the id itself is a capability and never shown)",
        "pid": "the engine's process id",
        "watched": "yes: its exit is seen at once (pidfd); no: heartbeats only",
        "leases": "leases it holds (an acquire's locked hit and reserved pages)",
        "age_s": "seconds since it attached",
        "idle_s": "seconds since its last request or heartbeat",
        "name": "the client name it attached with",
        "not saved / not loaded / failed": "the engine's own counts of work not done, by cause (its last report)",
    },
    "quarantines": {
        "quarantine of": "the ended session whose pages are held back",
        "pages": "L2 pages held back",
        "why": "how its session ended",
    },
    "io (L2 <-> L3 file moves since start; h2s: L2 to L3 writes, s2h: L3 to L2 promotions)": {
        "io": "the direction: h2s (L2 to the L3 file) or s2h (the L3 file to L2)",
        "count": "moves completed",
        "bytes": "bytes moved",
        "GiB/s": "bytes / seconds spent in file I/O (service time)",
        "extents": "file I/Os, after coalescing runs of pages consecutive in both tiers",
        "failures": "moves that failed (their pages returned; the engine recomputes)",
        "queue_s": "mean seconds a move waited for an I/O thread",
        "e2e_s": "mean seconds from a move's enqueue to its completion",
    },
    "rates (with --follow: over the interval since the previous snapshot)": {
        "matches/s": "acquires handled per second",
        "hit": "per tier: leading tokens of acquired prompts the tier held, per second (l2: after promotion)",
        "miss": "tokens of acquired prompts L2 did not hold (after promotion), per second: recomputed unless in the engine's GPU cache",
        "hit rate": "l2 hit tokens / acquired tokens over the interval",
        "lookups/s": "side-effect-free lookups per second",
        "load": "bytes engines loaded from L2 into GPU memory (h2d), GB/s (10^9 bytes)",
        "save": "bytes engines saved from GPU memory into L2 (d2h), GB/s",
        "l3 write": "bytes written from L2 to the L3 file (h2s), GB/s",
        "l3 read": "bytes read from the L3 file into L2 (s2h), GB/s",
        "evicted": "pages evicted per second, per tier",
    },
    "cost model (per engine and direction: restore or recompute; docs/architecture.md \"The cost model\")": {
        "dir": "h2d, d2h: L2 <-> GPU; d2d: out of another engine's GPU memory; prefill: recompute; s2h, h2s: the L3 file",
        "mode": "prior: no sample yet; ewma: sizes barely vary, the fixed term learned; fit: both terms fitted",
        "samples": "samples taken in since start",
        "fixed_ms": "the line's fixed term, milliseconds",
        "slope": "its slope, as a bandwidth (GiB/s) or, for prefill, microseconds per token",
        "decisions": "restore choices taken per lookup and acquire, by choice",
        "policy skips": "hits not restored, by the tier skipped",
    },
    "other": {
        "metrics": "every daemon counter since start, by name (docs/metrics.md maps them to /metrics)",
    },
}


def columns_help() -> str:
    """The column explanations, as ``kvcached status --help`` prints them."""
    lines = ["columns and figures:"]
    for section, columns in COLUMNS.items():
        lines += ["", f"  {section}"]
        width = max(len(name) for name in columns)
        lines += [f"    {name:<{width}}  {meaning}" for name, meaning in columns.items()]
    return "\n".join(lines)


# A salt keeps engines' pages apart only while it is not known: status shows a digest of it, keyed
# by this process's random key, so that a reader tells namespaces apart but cannot test guesses.
_SALT_DIGEST_KEY = secrets.token_bytes(16)


def salt_digest(salt: str) -> str:
    """'' for no salt; else 'salted:' and 8 hex digits of a digest keyed for this daemon's run."""
    if not salt:
        return ""
    return "salted:" + hmac.new(_SALT_DIGEST_KEY, salt.encode(), hashlib.sha256).hexdigest()[:8]


def hide_salts(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The snapshot with each namespace's cache_salt replaced by its digest (in place)."""
    for namespace in snapshot.get("namespaces", []):
        geometry = namespace.get("geometry", {})
        if "cache_salt" in geometry:
            geometry["cache_salt"] = salt_digest(geometry["cache_salt"])
    return snapshot


def status_json(snapshot: dict[str, Any]) -> str:
    """The one JSON form of a status snapshot: ``kvcached status --json`` and GET /status."""
    return json.dumps(snapshot, sort_keys=True)


def format_tokens(num_tokens: float) -> str:
    """1234 -> '1234'; 21800 -> '21.8k'; 3.4e6 -> '3.4M'."""
    for unit, scale, threshold in (("G", 1e9, 1e9), ("M", 1e6, 1e6), ("k", 1e3, 1e4)):
        if abs(num_tokens) >= threshold:
            return f"{num_tokens / scale:.1f}{unit}"
    return f"{num_tokens:.0f}"


_TIER_STATES = ("capacity", "free", "owned", "protected", "evictable", "private", "quarant.")
_TIER_KEYS = ("capacity_pages", "free_pages", "owned_pages", "protected_pages", "evictable_pages",
              "private_pages", "quarantined_pages")


def _namespace_lines(snapshot: dict[str, Any]) -> list[str]:
    lines = [f"{'ns':>3} {'model':<24} {'tier':<4} {'unit':<6} " + " ".join(f"{h:>10}" for h in _TIER_STATES)]
    for namespace in snapshot.get("namespaces", []):
        geometry = namespace["geometry"]
        bytes_per_page, page_size = namespace["bytes_per_page"], geometry["page_size"]
        head = f"{namespace['namespace_id']:>3} {geometry['model_id'][:24]:<24}"
        lines.append(f"{head} page {format_size(bytes_per_page)} = {page_size} tokens, "
                     f"{namespace['sessions']} sessions, {namespace['tree_nodes']} tree nodes")
        for tier, info in namespace["tiers"].items():
            pages = [info.get(key, 0) for key in _TIER_KEYS]
            lines.append(f"{'':>3} {'':<24} {tier:<4} {'bytes':<6} "
                         + " ".join(f"{format_size(p * bytes_per_page):>10}" for p in pages))
            lines.append(f"{'':>3} {'':<24} {'':<4} {'tokens':<6} "
                         + " ".join(f"{format_tokens(p * page_size):>10}" for p in pages))
    if not snapshot.get("namespaces"):
        lines.append("    (no engine has attached yet)")
    return lines


def engine_transfer_bytes(snapshot: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per session (its status tag): bytes its engine loaded (h2d) and saved (d2h), as last reported."""
    bytes_per_page = {ns["namespace_id"]: ns["bytes_per_page"] for ns in snapshot.get("namespaces", [])}
    moved = {}
    for session in snapshot.get("sessions", []):
        report = session.get("report")
        reported = report.get("connector", {}).get("counters", {}) if isinstance(report, dict) else {}
        if not isinstance(reported, dict):
            reported = {}
        page_bytes = bytes_per_page.get(session["namespace_id"], 0)
        moved[session["session"]] = {"h2d": int(reported.get(ENGINE_LOADED_PAGES.key, 0)) * page_bytes,
                                     "d2h": int(reported.get(ENGINE_SAVED_PAGES.key, 0)) * page_bytes}
    return moved


def interval_rates(snapshot: dict[str, Any], previous: dict[str, Any]) -> dict[str, float]:
    """Per-second rates between two snapshots of one daemon: counter deltas / time between them.
    An engine's bytes count from its previous report on, or from zero for a session new since."""
    seconds = snapshot["time"] - previous["time"]
    now, before = snapshot.get("metrics", {}), previous.get("metrics", {})

    def delta(name: str) -> float:
        return now.get(name, 0) - before.get(name, 0)

    moved_now, moved_before = engine_transfer_bytes(snapshot), engine_transfer_bytes(previous)
    zero = {"h2d": 0, "d2h": 0}
    engine_bytes = {d: sum(m[d] - moved_before.get(tag, zero)[d] for tag, m in moved_now.items())
                    for d in ("h2d", "d2h")}
    matched = delta("match_tokens")
    rates = {
        "seconds": seconds,
        "matches/s": delta("matches") / seconds,
        "hit l2": delta("hit_tokens_l2") / seconds,
        "hit l3": delta("hit_tokens_l3") / seconds,
        "miss": (matched - delta("hit_tokens_l2")) / seconds,
        "hit rate": delta("hit_tokens_l2") / matched if matched else 0.0,
        "lookups/s": delta("lookups") / seconds,
        "load": engine_bytes["h2d"] / seconds,
        "save": engine_bytes["d2h"] / seconds,
        "l3 write": delta("h2s_bytes") / seconds,
        "l3 read": delta("s2h_bytes") / seconds,
        "evicted l2": delta("evicted_pages_l2") / seconds,
        "evicted l3": delta("evicted_pages_l3") / seconds,
    }
    return rates


def _rate_lines(snapshot: dict[str, Any], previous: dict[str, Any]) -> list[str]:
    if previous.get("daemon", {}).get("pid") != snapshot.get("daemon", {}).get("pid") \
            or snapshot["time"] <= previous["time"]:
        return ["", "rates: (the daemon restarted since the previous snapshot)"]
    r = interval_rates(snapshot, previous)
    return ["", f"rates over {r['seconds']:.1f} s: matches/s {r['matches/s']:.1f}  "
                f"hit l2 {format_tokens(r['hit l2'])} l3 {format_tokens(r['hit l3'])} tokens/s  "
                f"miss {format_tokens(r['miss'])} tokens/s  hit rate {100 * r['hit rate']:.1f}%  "
                f"lookups/s {r['lookups/s']:.1f}",
            f"  load {r['load'] / 1e9:.3f} GB/s  save {r['save'] / 1e9:.3f} GB/s  "
            f"l3 write {r['l3 write'] / 1e9:.3f} GB/s  l3 read {r['l3 read'] / 1e9:.3f} GB/s  "
            f"evicted l2 {r['evicted l2']:.1f} l3 {r['evicted l3']:.1f} pages/s"]


def render_table(snapshot: dict[str, Any], previous: dict[str, Any] | None = None) -> str:
    """The status as a table; with the snapshot before it, also the rates since (``--follow``)."""
    daemon = snapshot.get("daemon", {})
    lines = [
        f"kvcached pid {daemon.get('pid')}  socket {daemon.get('socket')}  up {daemon.get('uptime_s', 0):.0f}s  "
        f"L2 {format_size(daemon.get('l2_bytes', 0))}"
        + (f"  http://{daemon['http']}/" if daemon.get("http") else ""),
        f"sessions {len(snapshot.get('sessions', []))}  leases {snapshot.get('leases', 0)}  "
        f"pending h2s {snapshot.get('pending', {}).get('h2s', 0)} s2h {snapshot.get('pending', {}).get('s2h', 0)}  "
        f"L3 {format_size(daemon.get('l3_bytes', 0))} {daemon.get('l3_file') or '(off)'}"
        f"{' (temporary, already unlinked)' if daemon.get('l3_temporary') else ''}"
        + (f"  index {daemon['l3_index']['path']} ({daemon['l3_index']['pending_changes']} changes queued"
           f"{', FAILED' if daemon['l3_index']['failed'] else ''})" if daemon.get("l3_index") else "")
        + (f"  integrity {snapshot['integrity']}" if "integrity" in snapshot else ""),
        "",
        *_namespace_lines(snapshot),
    ]
    lines += pressure_warnings(snapshot)
    sessions = snapshot.get("sessions", [])
    if sessions:
        lines += ["", f"{'session':<17} {'pid':>8} {'watched':>7} {'ns':>3} {'leases':>6} {'age_s':>8} "
                      f"{'idle_s':>7}  name"]
        for session in sessions:
            lines.append(f"{session['session']:<17} {session['pid']:>8} "
                         f"{'yes' if session.get('pid_watched') else 'no':>7} {session['namespace_id']:>3} "
                         f"{session['leases']:>6} {session['age_s']:>8.1f} {session.get('idle_s', 0):>7.1f}  "
                         f"{session['client_name']}")
        for session in sessions:
            lost = connector_losses(session.get("report", {}))
            if lost:
                lines.append(f"  {session['session']} not saved / not loaded / failed: "
                             + "  ".join(f"{k}={v}" for k, v in lost.items()))
    quarantines = snapshot.get("quarantines", [])
    if quarantines:
        lines += ["", f"{'quarantine of':<17} {'pid':>8} {'watched':>7} {'ns':>3} {'pages':>6} {'idle_s':>8}  "
                      "name: why its session ended"]
        for quarantine in quarantines:
            lines.append(f"{quarantine['session']:<17} {quarantine['pid']:>8} "
                         f"{'yes' if quarantine['pid_watched'] else 'no':>7} {quarantine['namespace_id']:>3} "
                         f"{quarantine['pages']:>6} {quarantine['idle_s']:>8.1f}  "
                         f"{quarantine['client_name']}: {quarantine['reason']}")
    io = snapshot.get("io", {})
    if io.get("h2s", {}).get("count") or io.get("s2h", {}).get("count"):
        lines += ["", f"{'io':<4} {'count':>7} {'bytes':>10} {'GiB/s':>7} {'extents':>8} {'failures':>8} "
                      f"{'queue_s':>9} {'e2e_s':>9}"]
        for direction in ("h2s", "s2h"):
            d = io[direction]
            lines.append(f"{direction:<4} {d['count']:>7} {format_size(d['bytes']):>10} {d['gibps']:>7.2f} "
                         f"{d['extents']:>8} {d['failures']:>8} {d['mean_queue_wait_s']:>9.4f} "
                         f"{d['mean_end_to_end_s']:>9.4f}")
    lines += render_remote(snapshot)
    lines += render_cost_model(snapshot.get("cost_model"))
    metrics = snapshot.get("metrics", {})
    if metrics:
        lines += ["", "metrics: " + "  ".join(f"{k}={v}" for k, v in metrics.items())]
    if previous is not None:
        lines += _rate_lines(snapshot, previous)
    return "\n".join(lines)


def render_remote(snapshot: dict[str, Any]) -> list[str]:
    """The remote tier in two lines: where, whether requests ask it, what it gave and took, what failed."""
    remote = snapshot.get("daemon", {}).get("remote")
    if not remote:
        return []
    calls, metrics = remote.get("counters", {}), snapshot.get("metrics", {})

    def metric(counter: Counter, label: str = "") -> int | float:
        return metrics.get(counter.keys[label], 0)

    def by_op(counter: Counter) -> str:
        backlog = {"put": calls.get(counters.REMOTE_WRITE_BACKLOG_SKIPS.key, 0)} \
            if counter is counters.REMOTE_SKIPS else {}
        return "/".join(str(calls.get(counter.keys[op], 0) + backlog.get(op, 0)) for op in counters.REMOTE_OPS)

    state = "up" if remote["connected"] and remote["state"] == "closed" else \
        f"DOWN (retry in {remote['retry_in_s']:.1f}s)" if remote["connected"] else "connecting"
    return ["", f"remote mooncake://{remote['master']} {state}  lends {format_size(remote['segment_bytes'])}  "
                f"lookups {calls.get(counters.REMOTE_LOOKUPS.key, 0)}  hit pages {metric(counters.REMOTE_HIT_PAGES)} "
                f"({format_size(metric(counters.REMOTE_BYTES, 'read'))})  written pages "
                f"{metric(counters.REMOTE_WRITTEN_PAGES)} ({format_size(metric(counters.REMOTE_BYTES, 'written'))})",
            f"remote exist/get/put: errors {by_op(counters.REMOTE_ERRORS)}  deadline misses "
            f"{by_op(counters.REMOTE_DEADLINE_MISSES)}  skipped {by_op(counters.REMOTE_SKIPS)}  checksum mismatches "
            f"{metric(counters.REMOTE_CHECKSUM_MISMATCHES)}"]


def render_cost_model(cost: dict[str, Any] | None) -> list[str]:
    """Per engine (namespace) and direction the model's line, then the decisions per choice."""
    if not cost:
        return []

    def line(ns: str, model: str, direction: str, d: dict[str, Any]) -> str:
        if "slope_s_per_token" in d:
            rate = f"{d['slope_s_per_token'] * 1e6:.2f} us/token"
        else:
            slope = d["slope_s_per_byte"]
            rate = f"{1 / slope / 2**30:.2f} GiB/s" if slope > 0 else "inf GiB/s"
        return (f"{ns:>3} {model[:24]:<24} {direction:<8} {d['mode']:<6} {d['samples_total']:>8} "
                f"{d['fixed_s'] * 1e3:>9.3f} {rate:>16}")

    lines = ["", f"cost model: policy {cost['policy']}, margin {cost['margin']}",
             f"{'ns':>3} {'model':<24} {'dir':<8} {'mode':<6} {'samples':>8} {'fixed_ms':>9} {'slope':>16}"]
    for engine in cost.get("engines", []):
        for direction, d in engine["directions"].items():
            lines.append(line(str(engine["namespace_id"]), engine["model_id"], direction, d))
    for direction, d in cost.get("storage", {}).items():
        lines.append(line("-", "(L3 file)", direction, d))
    for engine in cost.get("engines", []):
        for kind, key in (("decisions", "decisions_total"), ("policy skips", "policy_skips_total")):
            counts = "  ".join(f"{where}: " + " ".join(f"{c}={n}" for c, n in by.items())
                               for where, by in engine.get(key, {}).items())
            if counts:
                lines.append(f"  {kind} of ns {engine['namespace_id']}:  {counts}")
    return lines


def pressure_warnings(snapshot: dict[str, Any]) -> list[str]:
    """A line per namespace and tier that evicted cached pages to make room in the last minute."""
    return [f"  WARNING ns {namespace['namespace_id']} {namespace['geometry']['model_id']} {tier}: full, evicting "
            f"cached pages to make room ({info['evicted_pages']} evicted so far); a larger --{tier}-size keeps more"
            for namespace in snapshot.get("namespaces", []) for tier, info in namespace["tiers"].items()
            if info.get("under_pressure")]


# Counters of an engine's connector that say work was not done: pages a save skipped, pages a load
# could not fill, matches and lookups that failed, requests the daemon refused (each by cause).
_LOSS_MARKERS = ("skipped", "failed", "failures", "refusals")


def connector_losses(report: dict[str, Any]) -> dict[str, int]:
    """The non-zero loss counters of a session's connector report (ENGINE_REPORT), by name."""
    counters = report.get("connector", {}).get("counters", {}) if isinstance(report, dict) else {}
    if not isinstance(counters, dict):
        return {}
    return {name: value for name, value in sorted(counters.items())
            if isinstance(value, int) and value and any(marker in name for marker in _LOSS_MARKERS)}


class DaemonUnavailable(Exception):
    pass


class StatusClient:
    """What ``kvcached status`` uses: one DEALER socket, STATUS requests with a bounded wait."""

    def __init__(self, socket_path: str | None, timeout_s: float, daemon_uid: int | str | None = None):
        """socket_path None: the default. The socket must pass ``proto.paths.check_socket`` (it
        raises UntrustedSocket or ValueError); no socket there: DaemonUnavailable."""
        import zmq

        from proto.paths import check_socket

        try:
            socket_path = check_socket(socket_path, daemon_uid)
        except FileNotFoundError as exc:
            raise DaemonUnavailable(str(exc)) from None
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(f"ipc://{socket_path}")
        self._next_id = 1
        self._read_token: bytes | None = None

    def status(self, check_integrity: bool = False) -> dict[str, Any]:
        from proto import codec
        from proto.messages import MsgKind

        request_id, self._next_id = self._next_id, self._next_id + 1
        body = {"check_integrity": check_integrity}
        if self._read_token is not None:           # shows the daemon that its last reply was read
            body["read_token"] = self._read_token
        self._socket.send(codec.encode(MsgKind.STATUS, request_id, body))
        while True:
            if not self._socket.poll(int(self.timeout_s * 1000)):
                raise DaemonUnavailable(f"no status reply from ipc://{self.socket_path} "
                                        f"within timeout_s={self.timeout_s} (is the daemon running?)")
            frame = codec.decode(self._socket.recv())
            if frame.kind == MsgKind.REPLY and isinstance(frame.body, dict) and "read_token" in frame.body:
                self._read_token = frame.body.pop("read_token")
            if frame.request_id == request_id:
                if frame.kind == MsgKind.ERROR:
                    raise DaemonUnavailable(f"status refused: {frame.body}")
                return frame.body

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()

    def __enter__(self) -> "StatusClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
