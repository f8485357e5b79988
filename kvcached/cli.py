"""``kvcached serve`` runs the daemon; ``kvcached status`` asks a running one how it is.

What a user can get wrong ends in one line on stderr, never a traceback: a bad flag or a bad
KVCACHED_* variable (named; exit status 2), an L2 pool that /dev/shm or memory cannot hold (exit
status 2, before anything is made), a path the daemon cannot use (exit status 1, checked before the
L2 pool is populated). SIGTERM or SIGINT while the daemon starts stops it as promptly as once it
serves, with nothing left behind (exit status 0). A closed stdout (``kvcached status | head -3``)
ends the command quietly with status 141, as SIGPIPE ends other tools.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from typing import IO, Any

from kvcached import __version__
from kvcached.config import (DEFAULT_HTTP_ADDRESS, ENV_VARIABLES, LOG_LEVELS, SIZE_HELP, ConfigError, DaemonConfig,
                             format_size, parse_size)
from kvcached.server.status import columns_help
from proto.messages import RESTORE_POLICIES
from proto.paths import default_socket_path


# A pool at least this large shows its population's progress on stdout.
PROGRESS_MIN_BYTES = 1 << 30
BROKEN_PIPE_EXIT_STATUS = 128 + 13          # what a shell reports for a process ended by SIGPIPE
INTERRUPTED_EXIT_STATUS = 128 + 2           # ... and by SIGINT


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        """One line instead of argparse's usage block and error line."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> float:
    """A finite number above 0 (seconds, shares, rates): argparse names the flag of a bad one."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def _default_socket() -> str:
    try:
        return default_socket_path()
    except ValueError as exc:           # a bad $KVCACHED_SOCKET: serve and status report it
        return f"none ({exc})"


_ENVIRONMENT_HELP = ("environment: KVCACHED_SOCKET and " + ", ".join(ENV_VARIABLES)
                     + " give the defaults of the flags of the same name; a flag wins.")


def build_parser() -> argparse.ArgumentParser:
    defaults = DaemonConfig.__dataclass_fields__
    parser = _Parser(prog="kvcached", description="Hierarchical KV-cache sidecar daemon",
                     epilog=f"{SIZE_HELP}. {_ENVIRONMENT_HELP}")
    parser.add_argument("--version", action="version", version=f"kvcached {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,status}")

    serve = commands.add_parser("serve", help="run the daemon in the foreground",
                                epilog=f"{SIZE_HELP}. {_ENVIRONMENT_HELP}")
    # Each flag's dest is the DaemonConfig field it sets: _serve passes them on by name, and names
    # the flag in an error about its field.
    flags: dict[str, str] = {}

    def add(name: str, field: str, **kwargs: Any) -> None:
        flags[field] = name
        serve.add_argument(name, dest=field, **kwargs)

    add("--socket", "socket_path", help="socket path or ipc:// URL (default: $KVCACHED_SOCKET, else "
        f"$XDG_RUNTIME_DIR/kvcached/kvcached.sock, else /tmp/kvcached-<uid>/; here {_default_socket()})")
    add("--l2-size", "l2_bytes", type=_size, metavar="SIZE", help="the shared pinned host pool, e.g. 64g; "
        "one model alone gets all of it, several share it; one that --shm-dir or memory cannot hold is refused at "
        "start (default: 1 GiB or half of --shm-dir's free space, whichever is less)")
    add("--l3-path", "l3_path", help="local file for the L3 tier, kept with its index (PATH.index) across "
        "restarts (default: a temporary file, empty at every start)")
    add("--l3-fresh", "l3_fresh", action="store_true", default=None,
        help="with --l3-path: start with an empty L3, dropping what the last run left there")
    add("--l3-size", "l3_bytes", type=_size, metavar="SIZE", help="L3 file size, e.g. 1t; 0 turns L3 off "
        f"(default {format_size(defaults['l3_bytes'].default)}, a sparse file)")
    add("--l3-o-direct", "l3_o_direct", action="store_true", default=None,
        help="read and write the L3 file with O_DIRECT (bypass the page cache)")
    add("--shm-dir", "shm_dir", metavar="DIR", help="the directory of the L2 pool's shared-memory files, "
        "which every engine must see at the same path: a memory-backed one (a tmpfs) shared with the engines' "
        f"pods or containers (default {defaults['shm_dir'].default})")
    add("--io-threads", "io_threads", type=int, help="L3 file I/O threads "
        f"(default {defaults['io_threads'].default})")
    add("--spin-us", "socket_spin_us", type=int, help="busy-poll the socket this many microseconds after a "
        f"request before sleeping (default {defaults['socket_spin_us'].default}; 0: never)")
    add("--socket-cpu", "socket_cpu", type=int, help="run the socket thread and ZeroMQ's I/O thread on this "
        "CPU, so that a request wakes a busy CPU, not an idle one (default: any)")
    add("--max-namespaces", "max_namespaces", type=int, help="distinct KV geometries (models, ranks, "
        f"layouts) served at once; they share the pools (default {defaults['max_namespaces'].default})")
    add("--heartbeat-interval", "heartbeat_interval_s", type=_positive, metavar="SECONDS",
        help=f"how often engines send heartbeats (default {defaults['heartbeat_interval_s'].default})")
    add("--session-timeout", "session_timeout_s", type=_positive, metavar="SECONDS", help="an engine whose pid "
        "cannot be watched is taken for gone after this long without a heartbeat "
        f"(default {defaults['session_timeout_s'].default})")
    add("--session-grace", "session_grace_s", type=_positive, metavar="SECONDS", help="a living engine keeps its "
        "session this long without a heartbeat, and pages an engine may still write stay "
        f"quarantined this long (default {defaults['session_grace_s'].default})")
    add("--no-pid-watch", "pid_watch", action="store_false", default=None,
        help="do not watch engines' pids; detect their end by heartbeats alone")
    add("--session-share", "session_share", type=_positive, metavar="SHARE", help="the most of L2 one engine may "
        "hold reserved at once, for its saves and L3 promotions in flight (0 to 1; default "
        f"{defaults['session_share'].default}: one engine cannot crowd out the others; 1 for a lone engine)")
    add("--restore-policy", "restore_policy", choices=RESTORE_POLICIES, help="which cached prefixes "
        "are restored: cost, those the cost model predicts beat recomputing them; always; never "
        f"(default {defaults['restore_policy'].default}; an engine may ask for another)")
    add("--cost-margin", "cost_margin", type=_positive, help="a restore must be predicted this many times faster "
        f"than recompute (default {defaults['cost_margin'].default})")
    add("--prior-recompute-us", "prior_recompute_us_per_token", type=_positive, metavar="US",
        help="the cost model's prior for prefill, microseconds per token, until engines report theirs "
        f"(default {defaults['prior_recompute_us_per_token'].default})")
    add("--prior-host-gibps", "prior_host_gibps", type=_positive, metavar="GIBPS", help="its prior for L2 <-> GPU "
        f"copies (default {defaults['prior_host_gibps'].default})")
    add("--prior-storage-gibps", "prior_storage_gibps", type=_positive, metavar="GIBPS", help="its prior for L3 "
        f"reads and writes (default {defaults['prior_storage_gibps'].default})")
    add("--prior-peer-gibps", "prior_peer_gibps", type=_positive, metavar="GIBPS", help="its prior for copies out "
        f"of another engine's GPU memory (default {defaults['prior_peer_gibps'].default})")
    add("--prior-remote-gibps", "prior_remote_gibps", type=float, metavar="GIBPS", help="its prior for reads "
        f"from the remote store (default {defaults['prior_remote_gibps'].default})")
    add("--remote", "remote", metavar="mooncake://HOST:PORT", help="a remote tier below L3 on the Mooncake "
        "Store whose master is there, shared by the hosts' daemons: saved pages are written through to it, "
        "a prefix this host lacks is restored from it (default: off)")
    add("--remote-metadata", "remote_metadata", metavar="URL", help="Mooncake's metadata server (default: "
        "the master's own, http://HOST:8080/metadata; P2PHANDSHAKE: none)")
    add("--remote-local-host", "remote_local_host", metavar="HOST", help="the address the other hosts reach "
        f"this daemon's store client at (default {defaults['remote_local_host'].default})")
    add("--remote-segment-size", "remote_segment_bytes", type=_size, metavar="SIZE", help="memory this "
        "daemon lends the remote store (0: none; default "
        f"{format_size(defaults['remote_segment_bytes'].default)})")
    add("--remote-exist-timeout", "remote_exist_timeout_s", type=float, metavar="SECONDS", help="a lookup asks "
        "the store which pages it holds within this (default "
        f"{defaults['remote_exist_timeout_s'].default}); later, or the store unreachable: a local miss")
    add("--remote-get-timeout", "remote_get_timeout_s", type=float, metavar="SECONDS", help="a restore's gets "
        f"finish within this (default {defaults['remote_get_timeout_s'].default}) plus their bytes at "
        f"{defaults['remote_get_min_gibps'].default} GiB/s, or the request recomputes")
    add("--kv-events", "kv_events", metavar="ENDPOINT", help="publish KV events for cache-aware routers "
        "(vLLM's BlockStored, BlockRemoved, AllBlocksCleared of what L2, L3 and the remote tier gain and lose) on a "
        "ZeroMQ PUB socket: tcp://*:PORT or ipc://PATH is bound, tcp://HOST:PORT connected to (an indexer that "
        "binds); topics kv@NODE@MODEL (default: $KVCACHED_KV_EVENTS, else off)")
    add("--kv-events-replay", "kv_events_replay", metavar="ENDPOINT", help="with --kv-events: bind a replay "
        "socket there (a ROUTER, as vLLM's replay_endpoint) that sends the recent messages again from a sequence "
        "number on")
    add("--kv-events-node", "kv_events_node", metavar="NAME", help="this node's name in the events' topics "
        "(default: the host name)")
    add("--log-level", "log_level", metavar="LEVEL",
        help=f"{', '.join(LOG_LEVELS)} (default {defaults['log_level'].default})")
    add("--http", "http_address", metavar="HOST:PORT", help="serve GET /metrics (Prometheus), /status (the "
        "status JSON) and / (a live status page) there; off: not at all (default: $KVCACHED_HTTP, "
        f"else {DEFAULT_HTTP_ADDRESS}, off with a warning if taken; taken when asked for: exit 2; port 0: any free one)")
    add("--http-allow-host", "http_allow_hosts", action="append", metavar="NAME", help="a host name HTTP "
        "requests may give in their Host header, besides loopback names and addresses and the --http host "
        "(repeat for more; default: $KVCACHED_HTTP_ALLOW_HOST, comma-separated); others get 421, so that a "
        "web page cannot read the status through a name rebound to this address")
    serve.set_defaults(run=_serve, flags=flags)

    status = commands.add_parser("status", help="print the daemon's status", epilog=columns_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    status.add_argument("--socket", help="socket path or ipc:// URL of the daemon (default: as for serve)")
    status.add_argument("--daemon-uid", help="uid or user name the daemon runs as, when not ours (a shared "
                        "system daemon); its socket must belong to it (default: $KVCACHED_DAEMON_UID, else ours)")
    status.add_argument("--json", action="store_true", help="one JSON object per snapshot")
    status.add_argument("--follow", action="store_true", help="keep printing snapshots until interrupted; "
                        "the table then also shows the rates over each interval")
    status.add_argument("--interval-s", type=_positive, default=1.0, help="seconds between snapshots with --follow")
    status.add_argument("--timeout-s", type=_positive, default=2.0, help="how long to wait for the daemon")
    status.add_argument("--check-integrity", action="store_true", help="also run the daemon's integrity check")
    status.set_defaults(run=_status)
    return parser


class PopulateProgress:
    """How far the L2 pool is populated, on a stream (stdout): a bar redrawn in place on a
    terminal, a line per quarter otherwise; nothing for a pool under PROGRESS_MIN_BYTES. A stream
    that cannot be written to (closed) is given up on, never an error."""

    def __init__(self, stream: IO[str]):
        self.stream = stream
        self.tty = stream.isatty()
        self._started = time.monotonic()
        self._quarters_shown = 0
        self._broken = False

    def __call__(self, done_bytes: int, total_bytes: int) -> None:
        if total_bytes < PROGRESS_MIN_BYTES or self._broken:
            return
        try:
            if self.tty:
                filled = 30 * done_bytes // total_bytes
                self.stream.write(f"\rkvcached: populating the L2 pool [{'#' * filled}{'.' * (30 - filled)}] "
                                  f"{100 * done_bytes // total_bytes:3d}% of {format_size(total_bytes)}")
                if done_bytes == total_bytes:
                    self.stream.write(f" in {time.monotonic() - self._started:.1f} s\n")
            else:
                while self._quarters_shown < 4 and 4 * done_bytes >= (self._quarters_shown + 1) * total_bytes:
                    self._quarters_shown += 1
                    self.stream.write(f"kvcached: populating the L2 pool: {25 * self._quarters_shown}% of "
                                      f"{format_size(total_bytes)} after {time.monotonic() - self._started:.1f} s\n")
            self.stream.flush()
        except (OSError, ValueError):         # stdout closed: the daemon goes on without it
            self._broken = True


def _serve(args: argparse.Namespace) -> int:
    from kvcached.server.startup import run
    from kvcached.server.shm import PoolTooLarge, StartupError

    overrides = {field: getattr(args, field) for field in args.flags}
    try:
        config = DaemonConfig.from_env(os.environ, **overrides)
    except ConfigError as exc:
        given = exc.field in args.flags and overrides.get(exc.field) is not None
        print(f"kvcached serve: error: {f'argument {args.flags[exc.field]}: ' if given else ''}{exc}",
              file=sys.stderr)
        return 2
    except ValueError as exc:                 # a check of the configuration without a field
        print(f"kvcached serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(config, progress=PopulateProgress(sys.stdout))
    except PoolTooLarge as exc:               # checked before anything is made, as a bad flag is
        variable = os.environ.get("KVCACHED_L2_SIZE")
        source = ("argument --l2-size: " if args.l2_bytes is not None
                  else f"KVCACHED_L2_SIZE={variable!r}: " if variable else "")
        print(f"kvcached serve: error: {source}{exc}", file=sys.stderr)
        return 2
    except StartupError as exc:
        print(f"kvcached: {exc}", file=sys.stderr)
        return getattr(exc, "exit_status", 1)
    return 0


def _status(args: argparse.Namespace) -> int:
    from kvcached.server.status import DaemonUnavailable, StatusClient, render_table, status_json
    from proto.paths import UntrustedSocket

    try:
        client = StatusClient(args.socket, timeout_s=args.timeout_s, daemon_uid=args.daemon_uid)
    except (DaemonUnavailable, UntrustedSocket, ValueError) as exc:
        print(f"kvcached: {exc}", file=sys.stderr)
        return 1
    previous = None
    try:
        with client:
            while True:
                snapshot = client.status(check_integrity=args.check_integrity)
                if args.json:
                    print(status_json(snapshot), flush=True)
                else:
                    if args.follow:
                        print(f"--- {time.strftime('%H:%M:%S')}")
                    print(render_table(snapshot, previous), flush=True)
                previous = snapshot
                if not args.follow:
                    return 0
                time.sleep(args.interval_s)
    except DaemonUnavailable as exc:
        print(f"kvcached: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except KeyboardInterrupt:
        # Ctrl-C before the daemon's own handlers are in place (while Python imports it): the
        # daemon had made nothing yet.
        return INTERRUPTED_EXIT_STATUS
    except BrokenPipeError:
        # The reader went away (`kvcached status | head -3`): no traceback, and nothing more is
        # written, not even by the interpreter's flush at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE_EXIT_STATUS


if __name__ == "__main__":
    sys.exit(main())
