"""A screenshot of the status page with a minute of traffic behind it (docs/status-page.png):

    python -m tests.integration.status_page_demo docs/status-page.png [--seconds 75]

A real daemon (64 MiB of L2, so that it evicts), two engines on CPU tensors: one saves new
prefixes and reuses some, the other loads what is cached, at a rate that changes over the run.
Not a test: it makes the picture the docs show.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import threading
import time

import numpy as np

from tests.integration.browser import Browser
from kvcached.testing.daemon_proc import DaemonProcess
from kvcached.testing.connector_engine import N, P, Engine, random_tokens


def traffic(saver: Engine, loader: Engine, rng, seconds: float, stop: threading.Event) -> int:
    """Until stop: the saver saves new prefixes (60%) or one it saved before, the loader loads
    what a lookup finds cached; busier and quieter by turns. Returns the number of requests."""
    prefixes: list[np.ndarray] = []
    started = time.monotonic()
    step = 0
    while not stop.is_set():
        busy = 0.5 + 0.5 * math.sin((time.monotonic() - started) / seconds * 3 * math.pi)
        if rng.random() < 0.6 or not prefixes:
            prefixes.append(random_tokens(rng, int(rng.integers(8, 64)) * P))
            tokens = prefixes[-1]
        else:
            tokens = prefixes[int(rng.integers(len(prefixes)))]
        request = f"r{step}"
        saver.connector.save(request, tokens, rng.permutation(N * 4)[: len(tokens) // P])
        saver.connector.request_finished(request)
        saver.settle()
        cached = loader.connector.lookup(tokens)
        if cached:
            loader.connector.load(request, tokens, rng.permutation(N * 4)[: cached // P], cached)
            loader.poll_until(lambda: any(r.request_id == request for r in loader.loads), "the load")
            loader.connector.request_finished(request)
            loader.settle()
        saver.connector.poll()
        loader.connector.poll()
        step += 1
        stop.wait(0.05 + 0.6 * (1 - busy))
    return step


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--seconds", type=float, default=75.0)
    parser.add_argument("--seed", type=int, default=17)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    daemon = DaemonProcess(l2_size="64MiB").start()
    engines: list[Engine] = []
    stop = threading.Event()
    try:
        engines = [Engine(daemon.socket_path, "layer", seed=args.seed, num_blocks=N * 4),
                   Engine(daemon.socket_path, "layer", seed=args.seed + 1, num_blocks=N * 4)]
        with Browser(width=1280, height=900) as browser, concurrent.futures.ThreadPoolExecutor(1) as pool:
            browser.open(f"{daemon.http_url()}/")
            steps = pool.submit(traffic, *engines, rng, args.seconds, stop)
            time.sleep(args.seconds)        # the page polls meanwhile; the picture is taken under traffic
            browser.screenshot(args.output)
            stop.set()
            print(f"{args.output}: {steps.result()} requests over {args.seconds:.0f} s")
    finally:
        stop.set()
        for engine in engines:
            engine.close()
        daemon.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
