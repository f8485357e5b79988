"""POST /lookup against a real daemon process, with real engines over ipc:// and real HTTP
requests: hits per tier of the longest cached prefix, per namespace of the model (a salted one only
with its salt), nothing changed by asking, and bad requests refused with a 4xx."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from kvcached.testing.pytest_plugin import fresh_seed
from kvcached.testing.daemon_proc import DaemonProcess, wait_until
from kvcached.testing.connector_engine import MODEL, N, P, Engine, random_tokens
from kvcached.testing.floods import get
from tests.integration.test_http import scrape, value
from kvcached.server.lookup import MAX_LOOKUP_BODY_BYTES, MAX_LOOKUP_TOKENS

SALT = "tenant-a"
# What of the daemon's own samples changes by itself while engines stay attached: clocks, and the
# engines' heartbeats (the process_* samples are the process's CPU and memory).
CLOCKS = ("kvcached_uptime_seconds", "kvcached_start_time_seconds", "kvcached_engine_idle_seconds",
          "kvcached_engine_age_seconds")


def post(url: str, body: bytes | dict, content_type: str = "application/json",
         headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/lookup", data=data, method="POST",
                                     headers={"Content-Type": content_type, **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Type"] == "application/json"
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        text = exc.read()
        return exc.code, json.loads(text) if exc.headers["Content-Type"] == "application/json" else {"text": text}


class Cached:
    """Engine A saves a 6-page prefix and engine B, of the same model with a cache salt, a 4-page
    one (random blocks); both reach L3. Both stay attached."""

    def __init__(self, daemon: DaemonProcess, seed: int):
        rng = np.random.default_rng(seed)
        self.seed = seed
        self.url = daemon.http_url()
        self.a = Engine(daemon.socket_path, "layer", seed=seed)
        self.b = Engine(daemon.socket_path, "layer", seed=seed + 1, cache_salt=SALT)
        self.prefix, self.salted_prefix = random_tokens(rng, 6 * P), random_tokens(rng, 4 * P)
        self.rng = rng
        for engine, tokens in ((self.a, self.prefix), (self.b, self.salted_prefix)):
            engine.connector.save("r", tokens, rng.permutation(N)[: len(tokens) // P])
            engine.connector.request_finished("r")
            engine.settle()
        wait_until(lambda: value(scrape(self.url), "kvcached_io_published_pages_total", direction="h2s") == 10, 20.0,
                 "10 pages to reach L3")

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(scope="module")
def cached():
    daemon = DaemonProcess().start()
    done = None
    try:
        done = Cached(daemon, seed=fresh_seed(31))
        yield daemon, done
    finally:
        if done is not None:
            done.close()
        daemon.cleanup()


@pytest.fixture(autouse=True)
def report_seed(request):
    if "cached" in request.fixturenames:
        request.node.user_properties.append(("seed", request.getfixturevalue("cached")[1].seed))


def test_lookup_answers_the_cached_prefix_per_tier(cached):
    """By model: the unsalted namespace's hit in L2 and L3 is the cached prefix's whole pages (a
    prompt that goes on past it, or stops inside a page); tokens never saved hit nothing. By the
    namespace's geometry (as the engine sent it at ATTACH): the same answer."""
    daemon, c = cached
    longer = np.concatenate([c.prefix, random_tokens(c.rng, 2 * P + 5)])
    status, answer = post(c.url, {"model": MODEL, "token_ids": longer.tolist()})
    assert status == 200, answer
    [entry] = answer["namespaces"]
    assert answer["num_tokens"] == len(longer)
    assert entry["hit_tokens"] == {"l2": 6 * P, "l3": 6 * P}
    assert entry["geometry"]["model_id"] == MODEL and entry["geometry"]["cache_salt"] == ""
    status, inside = post(c.url, {"model": MODEL, "token_ids": c.prefix[: 3 * P + 7].tolist()})
    assert status == 200 and inside["namespaces"][0]["hit_tokens"] == {"l2": 3 * P, "l3": 3 * P}
    status, missed = post(c.url, {"model": MODEL, "token_ids": random_tokens(c.rng, 4 * P).tolist()})
    assert status == 200 and missed["namespaces"][0]["hit_tokens"] == {"l2": 0, "l3": 0}
    status, by_namespace = post(c.url, {"namespace": entry["geometry"], "token_ids": longer.tolist()})
    assert status == 200 and by_namespace == answer


def test_a_salted_namespace_answers_only_with_its_salt(cached):
    """The salted engine's prefix is not seen by a lookup of the model without the salt (only the
    unsalted namespace answers, with no hit); with the salt, only the salted namespace answers,
    its hit, and the salt shown as /status shows it (a digest); a wrong salt is a 404."""
    daemon, c = cached
    tokens = c.salted_prefix.tolist()
    status, unsalted = post(c.url, {"model": MODEL, "token_ids": tokens})
    assert status == 200 and [e["hit_tokens"] for e in unsalted["namespaces"]] == [{"l2": 0, "l3": 0}]
    status, salted = post(c.url, {"model": MODEL, "cache_salt": SALT, "token_ids": tokens})
    assert status == 200, salted
    [entry] = salted["namespaces"]
    assert entry["hit_tokens"] == {"l2": 4 * P, "l3": 4 * P}
    digests = {ns["geometry"]["cache_salt"] for ns in json.loads(get(f"{c.url}/status")[2])["namespaces"]}
    assert entry["geometry"]["cache_salt"] in digests - {""} and SALT not in json.dumps(salted)
    assert post(c.url, {"model": MODEL, "cache_salt": "tenant-b", "token_ids": tokens})[0] == 404


def test_lookups_change_nothing(cached):
    """Many lookups (hits, misses, a prompt stopping inside the prefix) leave every sample of /metrics
    but the clocks as it was: no lease, lock, promotion, eviction or count (the one change allowed
    is a tree node split at a hit's end, as an engine's lookup splits it); an engine's own lookup
    then sees the same hit."""
    daemon, c = cached
    before = scrape(c.url)
    for num_tokens in (6 * P, 2 * P + 3, 5 * P, 6 * P + 40):
        tokens = np.concatenate([c.prefix, random_tokens(c.rng, 40)])[:num_tokens]
        for _ in range(5):
            assert post(c.url, {"model": MODEL, "token_ids": tokens.tolist()})[0] == 200
    after = scrape(c.url)
    changed = {key: (before.get(key), after.get(key)) for key in set(before) | set(after)
               if before.get(key) != after.get(key) and key[0].startswith("kvcached_") and key[0] not in CLOCKS
               and ("kind", "heartbeat") not in key[1]}
    assert set(changed) <= {("kvcached_namespace_tree_nodes", (("model", MODEL), ("namespace", "0")))}, changed
    assert c.a.connector.lookup(c.prefix) == 6 * P


@pytest.mark.parametrize("body, status, says", [
    (b"{not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"token_ids": [1]}, 400, '"model"'),
    ({"model": MODEL, "namespace": {}, "token_ids": [1]}, 400, '"model"'),
    ({"model": MODEL}, 400, "token_ids"),
    ({"model": MODEL, "token_ids": "1 2 3"}, 400, "token_ids"),
    ({"model": MODEL, "token_ids": [1, 2.0]}, 400, "token_ids[1]"),
    ({"model": MODEL, "token_ids": [1, "2"]}, 400, "token_ids[1]"),
    ({"model": MODEL, "token_ids": [True]}, 400, "token_ids[0]"),
    ({"model": MODEL, "token_ids": [1 << 31]}, 400, "token_ids[0]"),
    ({"model": MODEL, "token_ids": [0] * (MAX_LOOKUP_TOKENS + 1)}, 400, "max_lookup_tokens"),
    ({"model": MODEL, "token_ids": [1], "extra": 1}, 400, "unknown fields"),
    ({"model": 7, "token_ids": [1]}, 400, '"model"'),
    ({"namespace": {"model_id": MODEL}, "token_ids": [1]}, 400, "bad namespace"),
    ({"model": "no-such-model", "token_ids": [1]}, 404, "no-such-model"),
    (b"[" + b"1," * (MAX_LOOKUP_BODY_BYTES // 2) + b"1]", 413, "max_lookup_body_bytes"),
])
def test_bad_lookups_are_refused_with_a_4xx(cached, body, status, says):
    """Malformed JSON, a missing or doubled identity, tokens that are not int32 or too many, unknown
    fields, an unknown model and an oversized body each get their 4xx and a JSON error naming the
    fault; the daemon answers the next lookup."""
    daemon, c = cached
    got, answer = post(c.url, body)
    assert (got, says in answer.get("error", "")) == (status, True), answer
    assert post(c.url, {"model": MODEL, "token_ids": c.prefix.tolist()})[0] == 200


def test_lookup_wants_post_json_and_a_known_host(cached):
    """GET /lookup is 405 (Allow: POST); a body not declared JSON is 415; a Host that is not this
    listener's is 421, as for every path."""
    daemon, c = cached
    body = {"model": MODEL, "token_ids": c.prefix.tolist()}
    try:
        urllib.request.urlopen(f"{c.url}/lookup", timeout=10)
        raise AssertionError("GET /lookup answered")
    except urllib.error.HTTPError as exc:
        assert exc.code == 405 and exc.headers["Allow"] == "POST"
    assert post(c.url, body, content_type="text/plain")[0] == 415
    assert post(c.url, body, headers={"Host": "attacker.example"})[0] == 421
