"""The driver of ``fencing_engine`` processes, and the stalled-copy scenario: engine A stopped
between its save's checks and its copy, past the session grace, while B backs up the same prefix."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

from engine_client.client import connect
from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess, child_env, wait_until
from kvcached.testing.fencing_engine import PREFIX_PAGES


class Engine:
    """A kvcached.testing.fencing_engine process: one command in, one JSON line out."""

    def __init__(self, socket_path: str, name: str, prefix_seed: int, kv_seed: int = 0,
                 state: str | None = None, compare: str | None = None, hold_before_save_copy: bool = False,
                 launcher: tuple[str, ...] = ()):
        args = [*launcher, sys.executable, "-m", "kvcached.testing.fencing_engine", "--socket", socket_path,
                "--name", name, "--prefix-seed", str(prefix_seed), "--kv-seed", str(kv_seed)]
        args += ["--state", state] if state else []
        args += ["--compare", compare] if compare else []
        args += ["--hold-before-save-copy"] if hold_before_save_copy else []
        self.name = name
        self.proc = subprocess.Popen(args, env=child_env(), cwd=REPO_ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float = 30.0) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, f"engine {self.name} said nothing within {timeout_s} s"
        line = self.proc.stdout.readline()
        assert line, f"engine {self.name} exited with {self.proc.wait()}"
        return json.loads(line)

    def ask(self, command: str, timeout_s: float = 30.0) -> dict:
        self.send(command)
        return self.read(timeout_s)

    def close(self, engine_pid: int | None = None) -> None:
        """engine_pid: the engine's own pid where a launcher runs it (unshare)."""
        for pid in (engine_pid, self.proc.pid):
            if pid is not None and self.proc.poll() is None:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def session_names(observer) -> list[str]:
    return [s["client_name"] for s in observer.status()["sessions"]]


GRACE_S = 2.0                    # --session-grace of the stalled-copy scenario


UNSHARE_PID = ("unshare", "--pid", "--fork")


def stalled_copy_scenario(daemon: DaemonProcess, seed: int, launcher: tuple[str, ...]) -> dict:
    """Engine A prepares a prefix (its acquire reserves pages), starts its save, and is
    SIGSTOPped between the connector's checks and its copy into L2, past the session grace; engine
    B then backs up the same prefix with other KV; A resumes and goes on with its copy; engine C
    restores the prefix."""
    a_state, b_state = (os.path.join(daemon.socket_dir, f"{n}.kv") for n in "ab")
    a = Engine(daemon.socket_path, "fence-A", seed, kv_seed=seed + 1, state=a_state, hold_before_save_copy=True,
               launcher=launcher)
    b = Engine(daemon.socket_path, "fence-B", seed, kv_seed=seed + 2, state=b_state)
    c = Engine(daemon.socket_path, "fence-C", seed, compare=b_state)
    a_pid = None
    try:
        for engine in (a, b, c):
            assert engine.read()["attached"] == engine.name
        with connect(daemon.socket_path, timeout_s=5.0) as observer:
            a_prepared = a.ask("prepare")
            assert len(a_prepared["reserved_page_ids"]) == PREFIX_PAGES, a_prepared
            a_pid = a.ask("finish")["at_copy"]
            os.kill(a_pid, signal.SIGSTOP)
            time.sleep(GRACE_S + 0.5)                # past the grace: the stall itself
            wait_until(lambda: "fence-A" not in session_names(observer), 10.0, "A's session ended")
            stalled = observer.status(check_integrity=True)
            b_prepared = b.ask("prepare")
            assert b_prepared["cached_tokens"] == 0, b_prepared
            b_finished = b.ask("finish")
            assert b_finished["backed_up"] == PREFIX_PAGES and b_finished["errors"] == [], b_finished
            os.kill(a_pid, signal.SIGCONT)
            a.send("")                               # on with A's copy
            a_finished = a.read()
            restored = c.ask("restore")
            final = observer.status(check_integrity=True)
        return {"restored": restored, "stalled": stalled, "final": final, "a_prepared": a_prepared,
                "b_prepared": b_prepared, "a_finished": a_finished}
    finally:
        a.close(a_pid)
        b.close()
        c.close()
