"""The status page (GET /) rendered in headless Chromium from a real daemon with two engines'
traffic: it shows the daemon's live numbers, and new ones after more traffic without a reload."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from tests.integration.browser import Browser, chromium_path
from kvcached.testing.daemon_proc import DaemonProcess
from kvcached.testing.connector_engine import MODEL, N, P, Engine, random_tokens
from tests.integration.test_http import BYTES_PER_PAGE

pytestmark = pytest.mark.skipif(chromium_path() is None, reason="needs chromium (.ci/run installs it)")


def status(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/status", timeout=10) as response:
        return json.load(response)


def shown(browser: Browser, key: str) -> dict:
    """What the page shows under data-k=key: its text and raw value."""
    return browser.evaluate(f"(() => {{ const el = document.querySelector('[data-k=\"{key}\"]'); "
                            "return el && {text: el.textContent, v: el.dataset.v}; })()")


def save_and_load(saver: Engine, loader: Engine, rng, num_pages: int, request_id: str) -> None:
    tokens = random_tokens(rng, num_pages * P)
    saver.connector.save(request_id, tokens, rng.permutation(N)[:num_pages])
    saver.connector.request_finished(request_id)
    saver.settle()
    loader.connector.load(request_id, tokens, rng.permutation(N)[:num_pages], num_pages * P)
    loader.poll_until(lambda: any(r.request_id == request_id for r in loader.loads), "the load")
    loader.connector.request_finished(request_id)
    loader.settle()
    saver.connector.flush_report()
    loader.connector.flush_report()


def test_the_page_shows_live_numbers(seed):
    """Loaded in Chromium, the page shows (after its scripts polled /status) the engines attached
    and their names, the L2 bytes and tokens each tier owns, the L2 hit tokens and the bytes the
    engines loaded and saved, as the daemon's /status has them. After more traffic, with no reload,
    it shows the new totals and a load bandwidth above zero in its chart."""
    rng = np.random.default_rng(seed)
    daemon = DaemonProcess().start()
    engines = []
    try:
        engines = [Engine(daemon.socket_path, "layer", seed=seed), Engine(daemon.socket_path, "layer", seed=seed + 1)]
        save_and_load(*engines, rng, 6, "first")
        url = daemon.http_url()
        with Browser() as browser:
            browser.open(f"{url}/?interval_ms=200")
            browser.wait_for("Number(document.querySelector('#polls').dataset.v) >= 2", "two polls")
            snapshot = status(url)
            assert shown(browser, "engines")["text"] == "2"
            names = browser.evaluate("[...document.querySelectorAll('#engines [data-k=name]')].map(e => e.textContent)")
            assert sorted(names) == sorted(f"layer-{s}" for s in (seed, seed + 1))
            l2 = snapshot["namespaces"][0]["tiers"]["l2"]
            assert l2["owned_pages"] == 6
            owned = browser.evaluate("(() => { const el = document.querySelector("
                                     "'tr[data-tier=\"l2\"] [data-k=\"owned\"]'); "
                                     "return {bytes: el.dataset.bytes, tokens: el.dataset.tokens, text: el.innerText}; })()")
            assert owned["bytes"] == str(6 * BYTES_PER_PAGE) and owned["tokens"] == str(6 * P), owned
            assert f"{6 * P} tok" in owned["text"] and "KiB" in owned["text"], owned
            assert MODEL in browser.evaluate("document.querySelector('#tiers').innerText")
            assert shown(browser, "hit_tokens_l2") == {"text": f"{6 * P}", "v": str(6 * P)}
            assert shown(browser, "load_bytes_total")["v"] == str(6 * BYTES_PER_PAGE)
            assert shown(browser, "save_bytes_total")["v"] == str(6 * BYTES_PER_PAGE)

            save_and_load(*engines, rng, 5, "second")        # while the page keeps polling
            total = 11 * BYTES_PER_PAGE
            browser.wait_for(f"document.querySelector('[data-k=\"load_bytes_total\"]').dataset.v === '{total}'",
                             "the second load's bytes")
            assert shown(browser, "hit_tokens_l2")["v"] == str(11 * P)
            assert shown(browser, "save_bytes_total")["v"] == str(total)
            assert browser.evaluate("Number(document.querySelector('#c-bw-max').dataset.v)") > 0
            assert status(url)["metrics"]["hit_tokens_l2"] == 11 * P
    finally:
        for engine in engines:
            engine.close()
        daemon.cleanup()
