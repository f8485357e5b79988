"""Render a status snapshot (the STATUS reply) as a human table."""

from __future__ import annotations

from typing import Any

from kvcached.config import format_size


def render_table(snapshot: dict[str, Any]) -> str:
    daemon = snapshot.get("daemon", {})
    lines = [
        f"kvcached pid {daemon.get('pid')}  socket {daemon.get('socket')}  up {daemon.get('uptime_s', 0):.0f}s  "
        f"L2 {format_size(daemon.get('l2_bytes', 0))}",
        f"sessions {len(snapshot.get('sessions', []))}  leases {snapshot.get('leases', 0)}  "
        f"pending h2s {snapshot.get('pending', {}).get('h2s', 0)} s2h {snapshot.get('pending', {}).get('s2h', 0)}  "
        f"L3 {format_size(daemon.get('l3_bytes', 0))} {daemon.get('l3_file') or '(off)'}"
        f"{' (temporary, already unlinked)' if daemon.get('l3_temporary') else ''}"
        + (f"  index {daemon['l3_index']['path']} ({daemon['l3_index']['pending_changes']} changes queued"
           f"{', FAILED' if daemon['l3_index']['failed'] else ''})" if daemon.get("l3_index") else "")
        + (f"  integrity {snapshot['integrity']}" if "integrity" in snapshot else ""),
        "",
        f"{'ns':>3} {'model':<24} {'tier':<4} {'page':>10} {'capacity':>9} {'free':>9} {'owned':>9} "
        f"{'protected':>9} {'evictable':>9} {'private':>9} {'quarant.':>9}",
    ]
    for namespace in snapshot.get("namespaces", []):
        for tier, info in namespace["tiers"].items():
            lines.append(
                f"{namespace['namespace_id']:>3} {namespace['geometry']['model_id'][:24]:<24} {tier:<4} "
                f"{format_size(namespace['bytes_per_page']):>10} {info['capacity_pages']:>9} {info['free_pages']:>9} "
                f"{info['owned_pages']:>9} {info['protected_pages']:>9} {info['evictable_pages']:>9} "
                f"{info['private_pages']:>9} {info.get('quarantined_pages', 0):>9}")
    if not snapshot.get("namespaces"):
        lines.append("    (no engine has attached yet)")
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
    lines += render_cost_model(snapshot.get("cost_model"))
    metrics = snapshot.get("metrics", {})
    if metrics:
        lines += ["", "metrics: " + "  ".join(f"{k}={v}" for k, v in metrics.items())]
    return "\n".join(lines)


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
                lines.append(f"  ns {engine['namespace_id']} {kind}  {counts}")
    return lines


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

    def status(self, check_integrity: bool = False) -> dict[str, Any]:
        from proto import codec
        from proto.messages import MsgKind

        request_id, self._next_id = self._next_id, self._next_id + 1
        self._socket.send(codec.encode(MsgKind.STATUS, request_id, {"check_integrity": check_integrity}))
        while True:
            if not self._socket.poll(int(self.timeout_s * 1000)):
                raise DaemonUnavailable(f"no status reply from ipc://{self.socket_path} "
                                        f"within timeout_s={self.timeout_s} (is the daemon running?)")
            frame = codec.decode(self._socket.recv())
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
