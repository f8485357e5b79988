"""Fencing with real processes: a stalled engine never writes into pages given to another, a dead
engine's pages come back at once, and a paused daemon does not expire a healthy engine."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import torch
import pytest

from engine_client.client import connect
from proto.messages import KVGeometry
from kvcached.testing.daemon_proc import DaemonProcess, wait_until
from kvcached.testing.fencing_engine import PREFIX_PAGES
from kvcached.testing.fencing import GRACE_S, UNSHARE_PID, Engine, session_names, stalled_copy_scenario

SESSION_TIMEOUT_S = 1.5          # the daemon's default
STALL_S = 2.5                    # past the session timeout


def stale_writer_scenario(daemon: DaemonProcess, seed: int, expect_expiry: bool) -> dict:
    """Engine A prepares a prefix (its acquire reserves pages) and is SIGSTOPped past the
    session timeout; engine B backs up the same prefix with other KV and commits; A resumes and
    finishes; engine C restores the prefix. Returns C's result with the daemon's last status."""
    a_state, b_state = (os.path.join(daemon.socket_dir, f"{n}.kv") for n in "ab")
    engines = [Engine(daemon.socket_path, "fence-A", seed, kv_seed=seed + 1, state=a_state),
               Engine(daemon.socket_path, "fence-B", seed, kv_seed=seed + 2, state=b_state),
               Engine(daemon.socket_path, "fence-C", seed, compare=b_state)]
    a, b, c = engines
    try:
        for engine in engines:
            assert engine.read()["attached"] == engine.name
        with connect(daemon.socket_path, timeout_s=5.0) as observer:
            prepared = a.ask("prepare")
            assert len(prepared["reserved_page_ids"]) == PREFIX_PAGES, prepared
            os.kill(a.proc.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            if expect_expiry:      # heartbeats only: the daemon ends A's session
                wait_until(lambda: "fence-A" not in session_names(observer), 10.0, "A's session ended")
            time.sleep(max(0.0, stopped_at + STALL_S - time.monotonic()))     # the stall itself
            stalled = observer.status(check_integrity=True)
            assert b.ask("prepare")["cached_tokens"] == 0
            finished = b.ask("finish")
            assert finished["backed_up"] == PREFIX_PAGES and finished["errors"] == [], finished
            os.kill(a.proc.pid, signal.SIGCONT)
            a_finished = a.ask("finish")
            assert a.ask("exit")["exited"] == "fence-A"
            restored = c.ask("restore")
            final = observer.status(check_integrity=True)
        return {"restored": restored, "stalled": stalled, "final": final, "a_finished": a_finished}
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.parametrize("pid_watch", [True, False], ids=["pid-watched", "heartbeats-only"])
def test_an_engine_stalled_past_its_session_never_overwrites_pages_given_to_another(pid_watch):
    """C restores exactly B's bytes, all 8 pages from L2, although A (whose match had reserved
    reserved pages) was SIGSTOPped past the session timeout and finished its backup after B's
    commit. With the pid watched, A keeps its session through the stall; with heartbeats only, A's
    session ends and its pages stay quarantined while B backs up."""
    seed = 1000 + pid_watch
    extra = ("--l3-size", "0") + (() if pid_watch else ("--no-pid-watch", "--session-grace", "10"))
    daemon = DaemonProcess(extra_args=extra).start()
    try:
        outcome = stale_writer_scenario(daemon, seed, expect_expiry=not pid_watch)
    finally:
        daemon.cleanup()
    restored, stalled, final = outcome["restored"], outcome["stalled"], outcome["final"]
    assert restored["restored_tokens"] == PREFIX_PAGES * 16, f"seed {seed}: {outcome}"
    assert restored["equal_pages"] == restored["pages"] == PREFIX_PAGES, f"seed {seed}: {outcome}"
    assert restored["integrity"] == "ok" and final["integrity"] == "ok", f"seed {seed}: {outcome}"
    (namespace,) = stalled["namespaces"]
    if pid_watch:
        assert "fence-A" in [s["client_name"] for s in stalled["sessions"]], f"seed {seed}: {outcome}"
        assert namespace["tiers"]["l2"]["private_pages"] == PREFIX_PAGES
    else:
        assert namespace["tiers"]["l2"]["quarantined_pages"] == PREFIX_PAGES, f"seed {seed}: {outcome}"
        assert final["metrics"]["quarantines"] == 1
        assert outcome["a_finished"]["backed_up"] == 0, f"seed {seed}: {outcome}"


def test_a_daemon_stopped_for_two_seconds_keeps_a_healthy_engines_session():
    """A daemon SIGSTOPped for 2 s (longer than the 1.5 s session timeout; engine pids not watched,
    so heartbeats alone keep sessions) does not expire the session of an engine that kept sending
    heartbeats: for 1 s after the daemon resumes (ten reaper ticks) the session is there, the
    engine is attached to it again (the first session, never replaced), and its requests are served."""
    daemon = DaemonProcess(extra_args=("--l3-size", "0", "--no-pid-watch")).start()
    geometry = KVGeometry("pause-model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", page_size=4)
    try:
        with connect(daemon.socket_path, timeout_s=5.0, client_name="healthy") as engine, \
                connect(daemon.socket_path, timeout_s=5.0) as observer:
            engine.attach(geometry)
            assert session_names(observer) == ["healthy"]
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(2.0)                      # the pause itself
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            resumed_at = time.monotonic()
            while time.monotonic() < resumed_at + 1.0:
                status = observer.status()
                assert [s["client_name"] for s in status["sessions"]] == ["healthy"], status["metrics"]
                time.sleep(0.05)
            # A heartbeat that timed out during the pause leaves the engine DOWN until its next probe.
            wait_until(lambda: engine.is_attached(), 10.0, f"the engine attached again: {engine.connection}")
            assert engine.generation == 1 and engine.is_attached(1)     # the first session, never replaced
            reply = engine.acquire(np.arange(16, dtype=np.int32))
            assert reply.hit_tokens["l2"] == 0
            assert "sessions_expired" not in observer.status()["metrics"]
    finally:
        daemon.cleanup()


def test_an_engine_whose_session_is_not_known_valid_still_loads_and_saves(daemon):
    """Once its heartbeats have stopped getting through for longer than the session timeout (the
    daemon, watching its pid, still keeps the session), an engine still loads the pages its lease
    holds, bit for bit, and saves the page L2 lacks: no time margin is asked of a session, the
    pages' write generations fence it (a busy host no longer turns the cache off); nothing leaks."""
    from engine_client.cache_manager import CacheManager
    from kvcached.testing.engine_proc import GEOMETRY as E2E, random_kv_

    seed = 77
    tokens = np.random.default_rng(seed).integers(0, 150_000, size=9 * E2E.page_size, dtype=np.int32)
    writer = CacheManager.attach(connect(daemon.socket_path, timeout_s=5.0, client_name="writer"), E2E,
                                 num_l1_pages=16, device="cpu")
    reader = CacheManager.attach(connect(daemon.socket_path, timeout_s=5.0, client_name="reader"), E2E,
                                 num_l1_pages=16, device="cpu")
    try:
        plan = writer.prepare(tokens[:8 * E2E.page_size])
        generator = torch.Generator().manual_seed(seed)
        for page_id in plan.new_l1_page_ids:
            random_kv_(writer.l1_pool.kv[:, :, page_id], generator)
        assert writer.finish(plan) == 8 and writer.client.flush() == []

        reader.client._stop_heartbeats.set()          # heartbeats no longer get through
        reader.client._heartbeat_thread.join()
        wait_until(lambda: reader.client.session_valid_for() == 0, 5.0, "the session no longer known valid")
        plan = reader.prepare(tokens)
        assert plan.l2_hit_tokens == 8 * E2E.page_size, f"seed {seed}"
        assert plan.restored_tokens == 8 * E2E.page_size, f"seed {seed}"
        written = writer.read_tokens_kv(writer.prepare(tokens[:8 * E2E.page_size], save=False).l1_page_ids)
        restored = reader.read_tokens_kv(plan.l1_page_ids[:8])
        assert torch.equal(restored.view(torch.int16), written.view(torch.int16)), f"seed {seed}"
        assert reader.stats().get("load_failed_pages", 0) == 0
        assert reader.finish(plan) == 1                                    # the 9th page: L2 lacked it
        reader.check_integrity()
        assert reader.client.flush() == []
        status = reader.client.status(check_integrity=True)
        assert status["integrity"] == "ok", status["integrity"]
        (namespace,) = status["namespaces"]
        assert namespace["tiers"]["l2"]["owned_pages"] == 9
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("watch", ["pid-watched", "no-pid-watch", "unshare-pid"])
def test_an_engine_stalled_between_its_checks_and_its_copy_never_serves_wrong_bytes(watch):
    """C restores exactly B's bytes, all 8 pages, bit for bit, although A was SIGSTOPped between
    its save's checks and its copy into L2 for longer than the session grace and then went on with
    the copy. Unwatched (--no-pid-watch, or A in another pid namespace), A's pages went to B after
    the grace: A's copy finds them no longer reserved for it and writes none of them (counted as
    stale_generation); watched, A's pages stay quarantined while it lives."""
    seed = {"pid-watched": 2000, "no-pid-watch": 2001, "unshare-pid": 2002}[watch]
    extra = ("--l3-size", "0", "--session-timeout", "1", "--session-grace", str(GRACE_S))
    extra += ("--no-pid-watch",) if watch == "no-pid-watch" else ()
    daemon = DaemonProcess(extra_args=extra).start()
    try:
        outcome = stalled_copy_scenario(daemon, seed, UNSHARE_PID if watch == "unshare-pid" else ())
    finally:
        daemon.cleanup()
    restored, final = outcome["restored"], outcome["final"]
    assert restored["restored_tokens"] == PREFIX_PAGES * 16, f"seed {seed}: {outcome}"
    assert restored["equal_pages"] == restored["pages"] == PREFIX_PAGES, f"seed {seed}: {outcome}"
    assert restored["integrity"] == "ok" and final["integrity"] == "ok", f"seed {seed}: {outcome}"
    assert outcome["a_finished"]["backed_up"] == 0, f"seed {seed}: {outcome}"
    if watch != "pid-watched":      # the stale writer's pages really were B's
        assert outcome["b_prepared"]["reserved_page_ids"] == outcome["a_prepared"]["reserved_page_ids"], outcome
        assert outcome["a_finished"]["stats"]["save_skipped_pages_stale_generation"] == PREFIX_PAGES, outcome
