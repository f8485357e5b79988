"""``kvcached serve`` runs the daemon; ``kvcached status`` asks a running one how it is."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from kvcached.config import DaemonConfig, parse_size
from proto.paths import default_socket_path

logger = logging.getLogger(__name__)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _default_socket() -> str:
    try:
        return default_socket_path()
    except ValueError as exc:           # a bad $KVCACHED_SOCKET: serve and status report it
        return f"none ({exc})"


def build_parser() -> argparse.ArgumentParser:
    defaults = DaemonConfig.__dataclass_fields__
    parser = argparse.ArgumentParser(prog="kvcached", description="Hierarchical KV-cache sidecar daemon")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--socket", help="socket path or ipc:// URL (default: $KVCACHED_SOCKET, else "
                       f"$XDG_RUNTIME_DIR/kvcached/kvcached.sock, else /tmp/kvcached-<uid>/; here {_default_socket()})")
    serve.add_argument("--l2-size", type=_size, help="shared pinned host pool size, e.g. 64GiB "
                       "(default: 1 GiB or half of free /dev/shm, whichever is less)")
    serve.add_argument("--l3-path", help="local file for the L3 tier, kept with its index (PATH.index) across "
                       "restarts (default: a temporary file, empty at every start)")
    serve.add_argument("--l3-fresh", action="store_true", default=None,
                       help="with --l3-path: start with an empty L3, dropping what the last run left there")
    serve.add_argument("--l3-size", type=_size, help="L3 file size, e.g. 1TiB; 0 turns L3 off "
                       "(default 4 GiB, a sparse file)")
    serve.add_argument("--l3-o-direct", action="store_true", default=None,
                       help="read and write the L3 file with O_DIRECT (bypass the page cache)")
    serve.add_argument("--io-threads", type=int, help=f"L3 file I/O threads (default {defaults['io_threads'].default})")
    serve.add_argument("--spin-us", type=int, help="busy-poll the socket this many microseconds after a "
                       f"request before sleeping (default {defaults['socket_spin_us'].default}; 0: never)")
    serve.add_argument("--socket-cpu", type=int, help="run the socket thread and ZeroMQ's I/O thread on this "
                       "CPU, so that a request wakes a busy CPU, not an idle one (default: any)")
    serve.add_argument("--max-namespaces", type=int,
                       help=f"distinct KV geometries served at once (default {defaults['max_namespaces'].default})")
    serve.add_argument("--heartbeat-interval", type=float, metavar="SECONDS", help="how often engines send "
                       f"heartbeats (default {defaults['heartbeat_interval_s'].default})")
    serve.add_argument("--session-timeout", type=float, metavar="SECONDS", help="an engine whose pid cannot be "
                       "watched is taken for gone after this long without a heartbeat "
                       f"(default {defaults['session_timeout_s'].default})")
    serve.add_argument("--session-grace", type=float, metavar="SECONDS", help="a living engine keeps its "
                       "session this long without a heartbeat, and pages an engine may still write stay "
                       f"quarantined this long (default {defaults['session_grace_s'].default})")
    serve.add_argument("--no-pid-watch", dest="pid_watch", action="store_false", default=None,
                       help="do not watch engines' pids; detect their end by heartbeats alone")
    serve.add_argument("--restore-policy", choices=("cost", "always", "never"), help="which cached prefixes are "
                       "restored: cost, those the cost model predicts beat recomputing them; always; never "
                       f"(default {defaults['restore_policy'].default}; an engine may ask for another)")
    serve.add_argument("--cost-margin", type=float, help="a restore must be predicted this many times faster "
                       f"than recompute (default {defaults['cost_margin'].default})")
    serve.add_argument("--prior-recompute-us", type=float, dest="prior_recompute_us_per_token", metavar="US",
                       help="the cost model's prior for prefill, microseconds per token, until engines report "
                       f"theirs (default {defaults['prior_recompute_us_per_token'].default})")
    serve.add_argument("--prior-host-gibps", type=float, metavar="GIBPS", help="its prior for L2 <-> GPU "
                       f"copies (default {defaults['prior_host_gibps'].default})")
    serve.add_argument("--prior-storage-gibps", type=float, metavar="GIBPS", help="its prior for L3 reads and "
                       f"writes (default {defaults['prior_storage_gibps'].default})")
    serve.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO)")

    status = commands.add_parser("status", help="print the daemon's status")
    status.add_argument("--socket", help="socket path or ipc:// URL of the daemon (default: as for serve)")
    status.add_argument("--daemon-uid", help="uid or user name the daemon runs as, when not ours (a shared "
                        "system daemon); its socket must belong to it (default: $KVCACHED_DAEMON_UID, else ours)")
    status.add_argument("--json", action="store_true", help="one JSON object per snapshot")
    status.add_argument("--follow", action="store_true", help="keep printing snapshots until interrupted")
    status.add_argument("--interval-s", type=float, default=1.0, help="seconds between snapshots with --follow")
    status.add_argument("--timeout-s", type=float, default=2.0, help="how long to wait for the daemon")
    status.add_argument("--check-integrity", action="store_true", help="also run the daemon's integrity check")
    return parser


def _serve(args: argparse.Namespace) -> int:
    from kvcached.server.loop import run
    from kvcached.server.shm import StartupError

    try:
        config = DaemonConfig.from_env(socket_path=args.socket, l2_bytes=args.l2_size, l3_path=args.l3_path,
                                       l3_bytes=args.l3_size, l3_o_direct=args.l3_o_direct,
                                       l3_fresh=args.l3_fresh,
                                       io_threads=args.io_threads, socket_spin_us=args.spin_us,
                                       socket_cpu=args.socket_cpu,
                                       max_namespaces=args.max_namespaces,
                                       heartbeat_interval_s=args.heartbeat_interval,
                                       session_timeout_s=args.session_timeout,
                                       session_grace_s=args.session_grace, pid_watch=args.pid_watch,
                                       restore_policy=args.restore_policy, cost_margin=args.cost_margin,
                                       prior_recompute_us_per_token=args.prior_recompute_us_per_token,
                                       prior_host_gibps=args.prior_host_gibps,
                                       prior_storage_gibps=args.prior_storage_gibps, log_level=args.log_level)
    except ValueError as exc:
        print(f"kvcached: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(config)
    except StartupError as exc:
        print(f"kvcached: {exc}", file=sys.stderr)
        return 1
    return 0


def _status(args: argparse.Namespace) -> int:
    from kvcached.server.status import DaemonUnavailable, StatusClient, render_table
    from proto.paths import UntrustedSocket

    try:
        client = StatusClient(args.socket, timeout_s=args.timeout_s, daemon_uid=args.daemon_uid)
    except (DaemonUnavailable, UntrustedSocket, ValueError) as exc:
        print(f"kvcached: {exc}", file=sys.stderr)
        return 1
    try:
        with client:
            while True:
                snapshot = client.status(check_integrity=args.check_integrity)
                if args.json:
                    print(json.dumps(snapshot, sort_keys=True), flush=True)
                else:
                    if args.follow:
                        print(f"--- {time.strftime('%H:%M:%S')}")
                    print(render_table(snapshot), flush=True)
                if not args.follow:
                    return 0
                time.sleep(args.interval_s)
    except DaemonUnavailable as exc:
        print(f"kvcached: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return _status(args)


if __name__ == "__main__":
    sys.exit(main())
