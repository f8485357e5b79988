"""Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe): no
websocket, no driver, only the standard library. For tests that read what a page shows after its
scripts ran for a while in real time, and for screenshots.

Chromium reads NUL-terminated JSON commands on its fd 3 and writes replies and events on fd 4.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from typing import Any

CHROMIUM = "chromium"


def chromium_path() -> str | None:
    return shutil.which(CHROMIUM)


class Browser:
    def __init__(self, width: int = 1280, height: int = 1000, timeout_s: float = 30.0):
        path = chromium_path()
        if path is None:
            raise FileNotFoundError(f"{CHROMIUM} is not installed (Debian: apt-get install chromium)")
        self.timeout_s = timeout_s
        self.profile = tempfile.mkdtemp(prefix="kvt-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def at_fds_3_and_4() -> None:          # in the child, before exec
            read_fd, write_fd = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(read_fd, 3)
            os.dup2(write_fd, 4)

        self.proc = subprocess.Popen(
            [path, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
             "--hide-scrollbars", "--mute-audio", "--disable-extensions", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            preexec_fn=at_fds_3_and_4, close_fds=False, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.session: str | None = None
        self.width, self.height = width, height

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict[str, Any]:
        """One command; its result (an error reply raises RuntimeError). Events are skipped."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._from_browser], [], [], remaining)[0]:
                raise TimeoutError(f"chromium did not answer {method} within timeout_s={self.timeout_s}")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited (code {self.proc.poll()}) before answering {method}")
            self._buffer += chunk

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height,
                                                         "deviceScaleFactor": 1, "mobile": False}, self.session)
        self.send("Page.navigate", {"url": url}, self.session)

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, self.session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout_s: float = 20.0) -> Any:
        """Evaluate until the value is truthy (every 20 ms, at most timeout_s); return it."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError:        # the page is not there yet (navigating)
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page did not show {what} within {timeout_s} s: {self.evaluate('document.body && document.body.innerText')!r}")
            time.sleep(0.02)

    def screenshot(self, path: str, full_page: bool = True) -> None:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            height = self.evaluate("document.documentElement.scrollHeight")
            params["clip"] = {"x": 0, "y": 0, "width": self.width, "height": height, "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.send("Page.captureScreenshot", params, self.session)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("Browser.close")
            self.proc.wait(10)
        except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self._to_browser)
            os.close(self._from_browser)
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
