"""The daemon's HTTP listener against a real daemon process and two real engines over ipc://:
/metrics (parsed with prometheus_client's parser) counts what the engines did, /status is what
`kvcached status --json` prints, bad requests are refused, the listener's address is checked."""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from engine_client.client import connect
from kvcached.server.status import StatusClient, format_tokens, render_table
from kvcached.testing.pytest_plugin import fresh_seed
from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess, child_env, wait_until
from engine_client.connector import LoadResult
from kvcached.testing.connector_engine import L, MODEL, N, P, Engine, random_tokens
from kvcached.testing.floods import get, idle_flood_scrapes

H, D = 2, 32
BYTES_PER_PAGE = 2 * L * P * H * D * 2          # K and V, every layer, bf16: the engines' geometry


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, by (name, sorted labels)."""
    status, headers, body = get(f"{base_url}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain"), (status, headers)
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    """The one sample of name whose labels include these; 0 when there is none."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) <= 1, f"{name}{labels}: {len(found)} samples"
    return found[0] if found else 0.0


class Traffic:
    """Engine A saves a 6-page prefix (random blocks) and a request whose save goes 2 pages beyond
    its lease (3 saved, 2 skipped: beyond_lease); once those reached L3, engine B looks the prefix
    up, loads it into other blocks asking for 2 pages more than are cached (6 loaded, 2 failed:
    not_cached), and saves the 2 new pages. Both stay attached; their counters are reported."""

    def __init__(self, daemon: DaemonProcess, seed: int):
        rng = np.random.default_rng(seed)
        self.a = Engine(daemon.socket_path, "layer", seed=seed)
        self.b = Engine(daemon.socket_path, "layer", seed=seed + 1)
        self.url = daemon.http_url()
        self.seed = seed
        prefix = random_tokens(rng, 8 * P)
        source = rng.permutation(N)[:6]
        self.a.connector.save("r", prefix[: 6 * P], source)
        self.a.connector.request_finished("r")
        short = random_tokens(rng, 5 * P)
        self.a.connector.load("s", short[: 3 * P], [], 0)         # the lease covers 3 pages
        self.a.connector.save("s", short, rng.permutation(N)[:5])
        self.a.connector.request_finished("s")
        self.a.settle()
        wait_until(lambda: value(scrape(self.url), "kvcached_io_published_pages_total", direction="h2s") == 9, 20.0,
                 "A's 9 pages to reach L3")
        self.lookup_tokens = self.b.connector.lookup(prefix)
        destination = np.setdiff1d(rng.permutation(N), source)[:8]
        self.b.connector.load("r", prefix, destination, 8 * P)
        self.b.poll_until(lambda: self.b.loads, "B's load")
        self.b.connector.save("r", prefix, destination)
        self.b.connector.request_finished("r")
        self.b.settle()
        wait_until(lambda: value(scrape(self.url), "kvcached_io_published_pages_total", direction="h2s") == 11, 20.0,
                 "B's 2 pages to reach L3")
        self.a.connector.flush_report()
        self.b.connector.flush_report()

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(scope="module")
def traffic():
    daemon = DaemonProcess().start()
    done = None
    try:
        done = Traffic(daemon, seed=fresh_seed(31))
        yield daemon, done
    finally:
        if done is not None:
            done.close()
        daemon.cleanup()


@pytest.fixture(autouse=True)
def report_traffic_seed(request):
    """A failure names the seed of the module's traffic (replayed with the same variable)."""
    if "traffic" in request.fixturenames:
        request.node.user_properties.append(("seed", request.getfixturevalue("traffic")[1].seed))


def test_metrics_count_what_two_engines_did(traffic):
    """After the traffic, /metrics (prometheus_client's parser) shows each engine's loads, saves,
    failed loads and skipped saves, in pages and bytes, per engine; the daemon's matches, hit tokens
    per tier, committed pages, L3 writes (bytes and the seconds histogram's count) and the L2 bytes
    owned: each by the amount the engines moved."""
    daemon, t = traffic
    assert t.b.loads == [LoadResult("r", 6 * P, t.b.loads[0].failed_block_ids, "not_cached",
                                    t.b.loads[0].transfer_s)], t.seed
    assert len(t.b.loads[0].failed_block_ids) == 2 and t.lookup_tokens == 6 * P
    m = scrape(t.url)
    a, b = f"layer-{t.seed}", f"layer-{t.seed + 1}"
    engine = lambda name, who, **labels: value(m, name, engine=who, model=MODEL, **labels)  # noqa: E731
    assert engine("kvcached_engine_transfer_pages_total", a, direction="d2h") == 9
    assert engine("kvcached_engine_transfer_bytes_total", a, direction="d2h") == 9 * BYTES_PER_PAGE
    assert engine("kvcached_engine_save_skipped_pages_total", a, reason="beyond_lease") == 2
    assert engine("kvcached_engine_transfer_pages_total", b, direction="h2d") == 6
    assert engine("kvcached_engine_transfer_bytes_total", b, direction="h2d") == 6 * BYTES_PER_PAGE
    assert engine("kvcached_engine_load_failed_pages_total", b, reason="not_cached") == 2
    assert engine("kvcached_engine_transfer_pages_total", b, direction="d2h") == 2
    assert engine("kvcached_engine_save_cached_pages_total", b) == 6
    assert engine("kvcached_engine_lookups_total", b) == 1
    assert engine("kvcached_engine_loads_total", b) == 1 and engine("kvcached_engine_saves_total", a) == 2

    assert value(m, "kvcached_sessions") == 2
    assert {dict(ls)["engine"] for (n, ls) in m if n == "kvcached_engine_info"} == {a, b}
    assert value(m, "kvcached_matches_total", model=MODEL) == 3                 # A: r, s; B: r
    assert value(m, "kvcached_match_tokens_total", model=MODEL) == (6 + 3 + 8) * P
    assert value(m, "kvcached_hit_tokens_total", model=MODEL, tier="l2") == 6 * P
    assert value(m, "kvcached_miss_tokens_total", model=MODEL) == (6 + 3 + 2) * P
    assert value(m, "kvcached_lookups_total", model=MODEL) == 1
    assert value(m, "kvcached_lookup_hit_tokens_total", model=MODEL, tier="l2") == 6 * P
    assert value(m, "kvcached_committed_pages_total", model=MODEL) == 11
    assert value(m, "kvcached_io_bytes_total", direction="h2s") == 11 * BYTES_PER_PAGE
    assert value(m, "kvcached_io_service_seconds_count", direction="h2s") == 3    # one write per commit
    assert value(m, "kvcached_io_service_seconds_bucket", direction="h2s", le="+Inf") == 3
    assert value(m, "kvcached_attaches_total") == 2
    assert value(m, "kvcached_request_seconds_count", kind="attach") == 2
    assert value(m, "kvcached_tier_bytes", model=MODEL, tier="l2", state="owned") == 11 * BYTES_PER_PAGE
    assert value(m, "kvcached_tier_bytes", model=MODEL, tier="l3", state="owned") == 11 * BYTES_PER_PAGE
    capacity = value(m, "kvcached_tier_capacity_bytes", model=MODEL, tier="l2")
    states = sum(value(m, "kvcached_tier_bytes", model=MODEL, tier="l2", state=s)
                 for s in ("free", "owned", "private", "quarantined"))
    assert capacity > 0 and states == capacity
    assert value(m, "kvcached_namespace_page_bytes", model=MODEL) == BYTES_PER_PAGE


def test_the_cost_model_metrics_show_its_lines_and_the_decisions_taken(traffic):
    """After the traffic's real transfers and decisions, /metrics shows the cost model under names
    of its own, with the values /status has: per engine and direction the fixed term, slope,
    sample count and mode (B's one load: h2d, one sample, ewma; the three saves: d2h, fit; no
    prefill sample: prior), the L3 file's write line (three write-throughs); the decisions per
    choice (B's lookup and B's load chose l2; A's load of a prefix nothing held: engine; A's first
    request a save: none), no policy skip, and the policy."""
    _, t = traffic

    def cost_model():
        cost = json.loads(get(f"{t.url}/status")[2])["cost_model"]
        directions = cost["engines"][0]["directions"] if cost["engines"] else {}
        done = directions and directions["h2d"]["samples_total"] == 1 and directions["d2h"]["samples_total"] == 3
        return cost if done else None

    cost = wait_until(cost_model, 20.0, "the engines' transfer samples to reach the daemon")
    m = scrape(t.url)
    (engine,) = cost["engines"]
    ns = {"model": MODEL, "namespace": str(engine["namespace_id"])}
    for direction, line in engine["directions"].items():
        labels = {**ns, "direction": direction}
        assert value(m, "kvcached_cost_model_fixed_seconds", **labels) == line["fixed_s"], (direction, t.seed)
        unit = "token" if direction == "prefill" else "byte"
        assert value(m, f"kvcached_cost_model_slope_seconds_per_{unit}", **labels) == line[f"slope_s_per_{unit}"]
        assert value(m, "kvcached_cost_model_samples_total", **labels) == line["samples_total"], direction
        assert value(m, "kvcached_cost_model_mode", **labels, mode=line["mode"]) == 1, direction
    modes = {d: line["mode"] for d, line in engine["directions"].items()}
    assert modes == {"h2d": "ewma", "d2h": "fit", "d2d": "prior", "prefill": "prior"}, (modes, t.seed)
    storage = {"model": "", "namespace": "", "direction": "h2s"}
    assert value(m, "kvcached_cost_model_samples_total", **storage) == cost["storage"]["h2s"]["samples_total"] == 3
    assert value(m, "kvcached_cost_model_fixed_seconds", **storage) == cost["storage"]["h2s"]["fixed_s"]
    assert value(m, "kvcached_cost_model_mode", **storage, mode="fit") == 1
    decisions = {(dict(ls)["where"], dict(ls)["choice"]): v for (n, ls), v in m.items()
                 if n == "kvcached_cost_model_decisions_total"}
    assert decisions == {("lookup", "l2"): 1, ("match", "l2"): 1, ("match", "engine"): 1}, (decisions, t.seed)
    assert not [n for n, _ in m if n == "kvcached_cost_model_policy_skips_total"]
    assert value(m, "kvcached_cost_model_info", policy="cost", margin="1.1") == 1


def test_openmetrics_on_request(traffic):
    """A scraper that asks for OpenMetrics gets it, and it parses with the OpenMetrics parser."""
    _, t = traffic
    status, headers, body = get(f"{t.url}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and headers["Content-Type"].startswith("application/openmetrics-text"), headers
    names = {family.name for family in parse_openmetrics(body.decode())}
    assert {"kvcached_matches", "kvcached_io_service_seconds", "kvcached_tier_bytes"} <= names, names


def _stable(snapshot: dict) -> dict:
    """The snapshot less what changes with time alone: the clock, uptime, sessions' age and idle
    time, the histograms of heartbeats and status requests (engines send heartbeats meanwhile;
    each `kvcached status` is a request), and the daemon's pauses (on a loaded machine its reaper
    may run late between two snapshots)."""
    snapshot = json.loads(json.dumps(snapshot))
    del snapshot["time"], snapshot["daemon"]["uptime_s"]
    for counter in ("daemon_pauses", "daemon_pause_seconds"):
        snapshot["metrics"].pop(counter, None)
    for session in snapshot["sessions"]:
        del session["age_s"], session["idle_s"]
    for kind in ("heartbeat", "status"):
        snapshot["histograms"].pop(f"request_seconds_{kind}", None)
    return snapshot


def test_status_endpoint_is_what_status_json_prints(traffic):
    """GET /status and `kvcached status --json` print the same JSON encoding (sorted keys, one
    line) of snapshots that are equal in every field that does not change with time alone."""
    daemon, t = traffic
    status, headers, before = get(f"{t.url}/status")
    assert status == 200 and headers["Content-Type"] == "application/json"
    printed = subprocess.run([sys.executable, "-m", "kvcached.cli", "status", "--socket", daemon.socket_path, "--json"],
                             env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert printed.returncode == 0, printed.stderr
    _, _, after = get(f"{t.url}/status")
    cli = json.loads(printed.stdout)
    for text in (before.decode(), printed.stdout.rstrip("\n")):
        assert json.dumps(json.loads(text), sort_keys=True) == text
    first, last = json.loads(before), json.loads(after)
    assert first["time"] <= cli["time"] <= last["time"]
    assert _stable(first) == _stable(cli) == _stable(last)
    assert cli["daemon"]["http"] == t.url.removeprefix("http://")
    assert len(cli["sessions"]) == 2 and cli["namespaces"][0]["tiers"]["l2"]["owned_pages"] == 11


def test_bad_requests_are_refused(traffic):
    """Unknown paths get 404, other methods than GET and HEAD 405 (with Allow), HEAD the headers
    of GET and no body; the page is one HTML file that loads nothing from elsewhere."""
    _, t = traffic
    assert get(f"{t.url}/nope")[0] == 404
    assert get(f"{t.url}/metrics/x")[0] == 404
    status, headers, _ = get(f"{t.url}/status", method="POST")
    assert status == 405 and headers["Allow"] == "GET, HEAD"
    assert get(f"{t.url}/", method="DELETE")[0] == 405
    status, headers, body = get(f"{t.url}/status", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
    status, headers, page = get(f"{t.url}/?interval_ms=500")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b"fetch(\"/status\"" in page and b"http://" not in page and b"https://" not in page
    assert "connect-src 'self'" in headers["Content-Security-Policy"]


def test_status_follow_shows_rates_over_each_interval(traffic):
    """The table given the snapshot before shows, over the interval between the two, the bytes
    loaded and saved per second (GB/s) and the hit tokens per second that the engines' traffic in
    between amounts to; `status --follow` prints rates from its second snapshot on."""
    daemon, t = traffic
    rng = np.random.default_rng(t.seed + 2)
    with StatusClient(daemon.socket_path, timeout_s=5) as client:
        before = client.status()
        tokens = random_tokens(rng, 4 * P)
        t.a.connector.save("f", tokens, rng.permutation(N)[:4])
        t.a.connector.request_finished("f")
        t.a.settle()
        t.b.connector.load("f", tokens, rng.permutation(N)[:4], 4 * P)
        t.b.poll_until(lambda: any(r.request_id == "f" for r in t.b.loads), "B's load")
        t.b.connector.request_finished("f")
        t.b.settle()
        t.a.connector.flush_report()
        t.b.connector.flush_report()
        after = client.status()
    seconds = after["time"] - before["time"]
    table = render_table(after, before)
    moved = f"{4 * BYTES_PER_PAGE / seconds / 1e9:.3f} GB/s"
    assert f"load {moved}" in table and f"save {moved}" in table, table
    assert f"hit l2 {format_tokens(4 * P / seconds)} " in table, table
    assert f"rates over {seconds:.1f} s" in table
    assert "rates over" not in render_table(after)

    follow = subprocess.Popen([sys.executable, "-m", "kvcached.cli", "status", "--socket", daemon.socket_path,
                               "--follow", "--interval-s", "0.1"], env=child_env(), cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        while sum(line.startswith("--- ") for line in lines) < 3:
            line = follow.stdout.readline()
            assert line, f"status --follow ended: {lines}"
            lines.append(line)
    finally:
        follow.kill()
        follow.wait(10)
    blocks = "".join(lines).split("--- ")[1:]
    assert "rates over" not in blocks[0] and "rates over" in blocks[1], blocks[:2]


def test_status_help_explains_every_column(traffic):
    """Every column header of the table (namespaces, sessions, L3 io, the cost model, rates) is
    explained by `kvcached status --help`."""
    daemon, t = traffic
    help_text = subprocess.run([sys.executable, "-m", "kvcached.cli", "status", "--help"], env=child_env(),
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=30).stdout
    with StatusClient(daemon.socket_path, timeout_s=5) as client:
        first = client.status()
        table = render_table(client.status(), first)
    headers = [line for line in table.splitlines()
               if line.lstrip().startswith(("ns ", "session ", "io "))]
    assert len(headers) == 4, table         # the cost model's lines begin with "ns" too
    columns_part = help_text.split("columns and figures:", 1)[1]
    explained = {line.split()[0] for line in columns_part.splitlines() if line.startswith("    ")}
    for header in headers:
        for column in header.split():
            assert column in explained, (column, help_text)
    rates = [line for line in table.splitlines() if line.startswith(("rates", "  load"))]
    for name in ("matches/s", "hit", "miss", "hit rate", "lookups/s", "load", "save", "l3 write", "l3 read", "evicted"):
        assert any(name in line for line in rates) and f"    {name} " in columns_part, name


def test_an_address_asked_for_must_be_free(tmp_path):
    """`--http HOST:PORT` whose port is taken stops the start with a one-line error naming the
    address, exit status 2 (a usage error); `--http off` runs with no listener (status says none)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = DaemonProcess(extra_args=("--http", f"127.0.0.1:{port}"))
        try:
            with pytest.raises(RuntimeError, match=f"cannot serve HTTP on 127.0.0.1:{port}"):
                daemon.start()
            assert daemon.proc.returncode == 2
            errors = [line for line in daemon.log().splitlines() if "cannot serve HTTP" in line]
            assert errors == [f"kvcached: cannot serve HTTP on 127.0.0.1:{port}: Address already in use "
                              "(--http HOST:PORT, or --http off)"], daemon.log()
            assert "Traceback" not in daemon.log()
        finally:
            daemon.cleanup()
    daemon = DaemonProcess(extra_args=("--http", "off")).start()
    try:
        with connect(daemon.socket_path) as client:
            assert client.status()["daemon"]["http"] is None
    finally:
        daemon.cleanup()


def test_dashboard_queries_metrics_the_daemon_exports(traffic):
    """Every metric the Grafana dashboard (deploy/grafana) queries is one the daemon exports: in
    the scrape after the traffic, or, for events the traffic did not cause, named by the
    declarations (a counter with _total, a histogram with _bucket)."""
    from kvcached.core import counters
    from proto.counters import ENGINE

    _, t = traffic
    with open(os.path.join(REPO_ROOT, "deploy", "grafana", "kvcached-dashboard.json")) as f:
        dashboard = json.load(f)
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(exprs) >= 20
    queried = {name for expr in exprs for name in re.findall(r"\b((?:kvcached|process)_[a-z0-9_]+)\b", expr)}
    scraped = {name for name, _ in scrape(t.url)}
    declared = {f"{counter.metric}_total" for counter in (*counters.DAEMON, *counters.REMOTE, *counters.COST_MODEL,
                                                          *ENGINE) if counter.metric}
    declared |= {f"{counter.metric}_{suffix}" for counter in counters.HISTOGRAMS for suffix in ("bucket", "sum", "count")}
    assert queried - scraped - declared == set()
    assert len(queried & scraped) >= 12, queried & scraped


def test_idle_connections_do_not_stop_scrapes(traffic):
    """With 100 idle TCP connections open (each sends nothing), /metrics scraped once a second
    for 5 s answers 200 every time, each within 2 s (a loaded 2-core machine's margin)."""
    _, t = traffic
    scrapes = idle_flood_scrapes(t.url, num_idle=100, num_scrapes=5)
    assert [status for status, _ in scrapes] == [200] * 5, scrapes
    assert max(seconds for _, seconds in scrapes) < 2.0, scrapes


def test_clients_that_leave_early_log_no_traceback(traffic):
    """Clients that reset the connection right after their request, before or while the reply
    is written, send garbage, or stop halfway through a request line are ordinary: the daemon's
    log gets no traceback and no error line for them, and the listener goes on serving."""
    daemon, t = traffic
    host, port = t.url.removeprefix("http://").rsplit(":", 1)
    log_before = len(daemon.log())
    for request in [b"GET /status HTTP/1.1\r\nHost: localhost\r\n\r\n"] * 20 + \
            [b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n"] * 20 + \
            [b"\x16\x03\x01\x00\xa5garbage\r\n\r\n", b"GET /sta", b"GET / HTTP/1.1\r\nHost: x\r\nBad header\r\n\r\n"]:
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            connection.sendall(request)
    time.sleep(1.0)
    assert get(f"{t.url}/status")[0] == 200
    written = daemon.log()[log_before:]
    assert "Traceback" not in written and " ERROR " not in written, written


def test_status_shows_no_cache_salt(traffic):
    """An engine attached with a cache salt: /status and `kvcached status --json` show a short
    digest of it ("salted:" and 8 hex digits), never the salt; an unsalted namespace shows ""."""
    daemon, t = traffic
    salt = f"tenant-{secrets.token_hex(8)}"
    salted = Engine(daemon.socket_path, "layer", seed=t.seed + 9, cache_salt=salt)
    try:
        body = get(f"{t.url}/status")[2].decode()
        printed = subprocess.run([sys.executable, "-m", "kvcached.cli", "status", "--socket", daemon.socket_path,
                                  "--json"], env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True,
                                 timeout=30).stdout
        for text in (body, printed):
            assert salt not in text
            salts = sorted(ns["geometry"]["cache_salt"] for ns in json.loads(text)["namespaces"])
            assert len(salts) == 2 and salts[0] == "" and re.fullmatch(r"salted:[0-9a-f]{8}", salts[1]), salts
    finally:
        salted.close()


def test_a_rebound_host_name_reads_nothing(traffic):
    """A request as a browser sends it after DNS rebinding (Host: a name of the attacker's) gets
    421 and no status, on every path; the same request with the loopback address is served."""
    _, t = traffic
    port = t.url.rsplit(":", 1)[1]
    for path in ("/status", "/metrics", "/"):
        status, _, body = get(f"{t.url}{path}", headers={"Host": f"rebind.attacker.example:{port}"})
        assert status == 421 and b"kvcached" not in body.replace(b"kvcached serve", b""), (path, status, body)
        assert get(f"{t.url}{path}", headers={"Host": f"127.0.0.1:{port}"})[0] == 200
