"""The reliability drills of issue 10, on real daemon and engine processes, with real signals.

Any Linux box, no GPU. Each drill prints and records one row {"drill", "expect", "measured",
"pass"} in bench/results/cpu/drills.json:

  1 stale writer      A prepares (its acquire reserves pages), starts its save and is
                      SIGSTOPped between its checks and its copy, past the session grace, while B
                      backs up the same prefix and commits; A resumes and goes on with its copy;
                      C restores the prefix: every page equal to B's bytes, every run, with A's pid
                      watched and with A in another pid namespace (unshare --pid, unwatched)
    SIGKILL           engines SIGKILLed mid-backup (a lease on a committed prefix and an acquire's
                      reserved pages each): every lease gone within 1 s
  2 daemon SIGKILLed  100 consecutive prepare() calls against a plain miss of the same run
  3 daemon restarted  SIGKILL + restart: the engine's next L2 hit, without restarting it, and
                      /dev/shm holding the new segment only; SIGTERM + restart on the same
                      --l3-path: earlier prefixes are L3 hits, bit for bit; a flipped byte in the
                      L3 file is caught and not served
  2 in flight         (issue 41) a lookup in flight when the daemon is SIGKILLed ends once the client
                      knows it down (the socket's close, not a heartbeat timeout); the first lookup
                      after a kill costs <= 50 ms more than a miss
  3 small /dev/shm    (issue 41) a 100 MiB tmpfs /dev/shm (private mount namespace), a 64 MiB L2, two
                      live engines: SIGKILL, and SIGTERM, of the daemon; it restarts, both engines hit
                      again, bit for bit; also with idle engines (no call from the signal until the
                      new daemon runs: they drop the old pool by themselves)
  4 socket takeover   a symlink planted at the lock path, a socket directory pre-created with the
                      wrong mode (and, run as root, one owned by another user): refused, the
                      victim file untouched
  5 L3 files          symlinks and other users' files planted at --l3-path, its index and sidecars:
                      refused, untouched; a disk full at start keeps the index; a daemon
                      restarting on a branchy L3 index of 160k rows: peak RSS and seconds

  flood fairness      engine A's hot prefixes under engine B's one-use flood, in one model and in
                      two (the daemon's state on a trace): A keeps >= 80% of its hit share
  cost model heals    one 1-s h2d sample reported: lookups of an L2 hit until one restores again
                      (<= 200 requests or 30 s), and that restore bit for bit
  client never reads  3,000 STATUS requests of a process that never reads: daemon RSS growth
                      under 100 MB, a reading client served meanwhile
  http idle flood     100 idle HTTP connections: /metrics scraped once a second, all answered
  oversized L2        --l2-size beyond /dev/shm and memory: one line, exit status 2, nothing made
  SIGINT at start-up  SIGINT (and SIGTERM) at moments of start-up of a 1 GiB pool, populate
                      included: exit within 1 s, nothing left in /dev/shm or the socket directory
  remote tier         (issue 43) a real mooncake_master and daemons as hosts in a network namespace:
                      a prefix saved on host A restores on host B bit for bit; the master hung
                      (SIGSTOP), then killed: requests miss within the default deadline (0.1 s),
                      the daemons reconnect; the host lending the memory SIGKILLed: no wrong byte,
                      recovery; the decision declines the store where recompute wins
  e2e under burners   the end-to-end backup-then-restore (two engine processes), 20 runs in a row with 6
                      CPU burners

    python -m bench.drills [--repeats 3] [--only stale_writer,outage_prepare,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from bench.common import RESULTS_DIR, git_commit, print_table, write_result
from engine_client.cache_manager import CacheManager
from engine_client.client import ConnectionState, connect
from kvcached.server.shm import segment_name
from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess, child_env, stop_process, wait_until
from kvcached.testing.engine_proc import GEOMETRY
from kvcached.testing.fencing_engine import PREFIX_PAGES
from kvcached.testing.engine_proc import run_engine
from kvcached.testing.holder import start_holder
from kvcached.testing.fencing import GRACE_S, UNSHARE_PID, stalled_copy_scenario
from kvcached.testing.l3_files import ENOSPC_ROWS, IS_ROOT, L3_NAMES
from kvcached.testing.l3_files import OTHER_UID as L3_OTHER_UID
from kvcached.testing.l3_files import can_mount_tmpfs, fingerprint, random_file, run_enospc_start, serve_once
from kvcached.testing.l3_rebuild import MAX_REBUILD_RSS_BYTES, TEST_ROWS, restart_on_branchy_index
from kvcached.testing.l3 import RestartingDaemon, flip_byte
from kvcached.testing.small_shm import run_in_small_shm
from kvcached.testing.managers import can_run_small_shm, make_manager, prefill_and_finish, random_tokens
from bench.timing import timed

PAGE = GEOMETRY.page_size


def row(drill: str, expect: str, measured: str, passed: bool, **details) -> dict:
    return {"drill": drill, "expect": expect, "measured": measured, "pass": bool(passed), **details}


# ---- 1: fencing ---------------------------------------------------------------------------------

def stale_writer_once(watch: str, seed: int) -> dict:
    """One run of the stalled-copy scenario (A SIGSTOPped between its save's checks and its copy,
    past the grace); what C restored and what the daemon and A counted."""
    extra = ("--l3-size", "0", "--session-timeout", "1", "--session-grace", str(GRACE_S))
    daemon = DaemonProcess(extra_args=extra).start()
    try:
        outcome = stalled_copy_scenario(daemon, seed, UNSHARE_PID if watch == "unshare-pid" else ())
    finally:
        daemon.cleanup()
    return {"restored": outcome["restored"], "a_backed_up": outcome["a_finished"]["backed_up"],
            "a_stale_generation": outcome["a_finished"]["stats"].get("save_skipped_pages_stale_generation", 0),
            "shared_pages": len(set(outcome["a_prepared"]["reserved_page_ids"])
                                & set(outcome["b_prepared"]["reserved_page_ids"])),
            "integrity": outcome["final"]["integrity"]}


def drill_stale_writer(repeats: int, watch: str) -> dict:
    runs = [stale_writer_once(watch, seed=5000 + 10 * i + (watch == "unshare-pid")) for i in range(repeats)]
    exact = [r["restored"]["equal_pages"] == r["restored"]["pages"] == PREFIX_PAGES
             and r["restored"]["restored_tokens"] == PREFIX_PAGES * PAGE and r["integrity"] == "ok" for r in runs]
    mode = "pid watched" if watch == "pid-watched" else "unwatched: unshare --pid"
    measured = (f"{sum(exact)}/{repeats} runs: C restored {PREFIX_PAGES}/{PREFIX_PAGES} pages equal to B's; "
                f"A backed up {[r['a_backed_up'] for r in runs]} after the stall "
                f"(stale_generation {[r['a_stale_generation'] for r in runs]}); "
                f"A's reserved pages given to B: {[r['shared_pages'] for r in runs]}")
    return row(f"1 stale writer ({mode})", f"C restores B's bytes, every page, in every run (A SIGSTOPped between "
               f"its checks and its copy, past the {GRACE_S} s grace)", measured, all(exact), runs=runs)


def drill_sigkill_mid_backup(within_s: float = 1.0) -> dict:
    """Passes when every lease is gone within ``within_s`` of the SIGKILL (the benchmark's bound: 1 s)."""
    daemon = DaemonProcess().start()
    try:
        holders = [start_holder(daemon.socket_path, seed=seed) for seed in (1, 2)]
        with connect(daemon.socket_path, timeout_s=5.0, client_name="observer") as observer:
            while observer.status()["pending"]["h2s"]:
                time.sleep(0.01)
            leases_before = observer.status()["leases"]
            for holder, _, _ in holders:
                holder.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            while observer.status()["leases"] and time.monotonic() - killed_at < max(10.0, within_s):
                time.sleep(0.005)
            gone_s = time.monotonic() - killed_at
            status = observer.status(check_integrity=True)
        for holder, _, _ in holders:
            holder.wait()
    finally:
        daemon.cleanup()
    ok = leases_before == 4 and status["leases"] == 0 and gone_s < within_s and status["integrity"] == "ok"
    return row("1 SIGKILL mid-backup", f"every lease of 2 SIGKILLed engines gone within {within_s:g} s",
               f"{leases_before} leases gone {gone_s * 1e3:.0f} ms after SIGKILL, "
               f"{len(status['quarantines'])} quarantines, integrity {status['integrity']}", ok,
               leases_before=leases_before, leases_after=status["leases"], gone_ms=round(gone_s * 1e3, 1),
               integrity=status["integrity"])


# ---- 2: outage ----------------------------------------------------------------------------------

def drill_outage_prepare(calls: int = 100) -> dict:
    seed = 20260102
    rng = np.random.default_rng(seed)
    daemon = DaemonProcess().start()
    manager = make_manager(daemon.socket_path, "drill-outage")
    try:
        plain = []
        for _ in range(30):
            tokens = random_tokens(rng, 6 * PAGE + 5)
            plan, took = timed(lambda: manager.prepare(tokens))
            plain.append(took)
            manager.abort(plan)
        daemon.stop(signal.SIGKILL)
        wait_until(lambda: manager.client.state is ConnectionState.DOWN, 5.0, "the client saw the daemon go")
        outage, skipped = [], 0
        for _ in range(calls):
            tokens = random_tokens(rng, 6 * PAGE + 5)
            plan, took = timed(lambda: manager.prepare(tokens))
            outage.append(took)
            skipped += plan.lease_id is None
            manager.finish(plan)
    finally:
        manager.close()
        daemon.cleanup()
    miss_wall = statistics.median(t.wall_s for t in plain)
    miss_cost = statistics.median(t.cost_s for t in plain)
    median_extra = statistics.median(t.wall_s for t in outage) - miss_wall
    slowest_extra = max(t.cost_s for t in outage) - miss_cost
    slowest_wall_extra = max(t.wall_s for t in outage) - miss_wall
    ok = skipped == calls and median_extra < 0.005 and slowest_extra < 0.005
    return row("2 daemon SIGKILLed: prepare()",
               f"{calls} prepare() calls, median and slowest extra over a plain miss < 5 ms "
               "(slowest: wall time less the run-queue wait)",
               f"plain miss {miss_wall * 1e3:.3f} ms; extra: median {median_extra * 1e3:.3f} ms, "
               f"slowest {slowest_extra * 1e3:.3f} ms ({slowest_wall_extra * 1e3:.3f} ms wall); "
               f"{skipped}/{calls} skipped the daemon", ok,
               plain_miss_ms=miss_wall * 1e3, median_extra_ms=median_extra * 1e3,
               slowest_extra_ms=slowest_extra * 1e3, slowest_extra_wall_ms=slowest_wall_extra * 1e3)


def outage_inflight_once(seed: int) -> dict:
    """One daemon: the median of 20 lookup misses; a lookup in flight (the daemon SIGSTOPped, then
    SIGKILLed 0.2 s later) timed from the kill; then a second daemon killed with no warning and a
    lookup at once."""
    rng = np.random.default_rng(seed)
    result = {}
    for phase in ("in_flight", "first_after_kill"):
        daemon = DaemonProcess().start()
        manager = make_manager(daemon.socket_path, f"drill-{phase}")
        try:
            walls = []
            for _ in range(20):
                tokens = random_tokens(rng, 6 * PAGE)
                started = time.perf_counter()
                assert manager.connector.lookup(tokens) == 0
                walls.append(time.perf_counter() - started)
            result["miss_s"] = min(result.get("miss_s", 1.0), statistics.median(walls))
            tokens = random_tokens(rng, 6 * PAGE)
            if phase == "in_flight":
                stop_process(daemon.proc.pid)
                killed_at = []

                def kill():
                    time.sleep(0.2)
                    killed_at.append(time.monotonic())
                    daemon.stop(signal.SIGKILL)
                killer = threading.Thread(target=kill)
                killer.start()
                manager.connector.lookup(tokens)
                ended_at = time.monotonic()
                killer.join()
                down_at = manager.client.connection.since
                result["detect_s"] = down_at - killed_at[0]
                result["in_flight_end_s"] = ended_at - killed_at[0]
                result["session_ended"] = manager.client.connection.session_ended
            else:
                daemon.proc.send_signal(signal.SIGKILL)
                started = time.perf_counter()
                manager.connector.lookup(tokens)
                result["first_after_kill_s"] = time.perf_counter() - started
                daemon.stop(signal.SIGKILL)
        finally:
            manager.close()
            daemon.cleanup()
    return result


def drill_outage_inflight(repeats: int = 3) -> dict:
    runs = [outage_inflight_once(20260141 + i) for i in range(repeats)]
    miss_s = statistics.median(r["miss_s"] for r in runs)
    worst_after_detect = max(r["in_flight_end_s"] - r["detect_s"] for r in runs)
    worst_detect = max(r["detect_s"] for r in runs)
    worst_first_extra = max(r["first_after_kill_s"] for r in runs) - miss_s
    ok = (all(r["session_ended"] for r in runs) and worst_after_detect <= 0.02 and worst_detect < 0.3
          and worst_first_extra <= 0.05)
    return row("2 daemon SIGKILLed mid-request",
               "a lookup in flight ends within the detection time (+ the 10 ms wait check); the first lookup "
               "after a kill <= 50 ms more than a miss",
               f"{repeats} runs: detected within {worst_detect * 1e3:.1f} ms of the kill (the socket closed); "
               f"in-flight lookup ended <= {worst_after_detect * 1e3:.1f} ms after that; first lookup after a "
               f"kill <= {worst_first_extra * 1e3:.1f} ms more than a miss ({miss_s * 1e3:.2f} ms)", ok,
               runs=runs)


def drill_restart_small_shm() -> list[dict]:
    expect = ("both engines hit again, bit for bit, after the daemon restarts in a 100 MiB /dev/shm "
              "with a 64 MiB L2")
    if not can_run_small_shm():
        return [row("3 small /dev/shm restart", expect, "not run: needs root and unshare", False)]
    rows = []
    for sig, seed in (("KILL", 20260142), ("TERM", 20260143)):
        report = run_in_small_shm(sig, seed)
        rows.append(row(f"3 SIG{sig} + restart, small /dev/shm", expect,
                        f"restarted; engines dropped the old pool {report['dropped_s']:.3f} s after the signal; "
                        f"both hit bit for bit (second hit {report['back_to_second_hit_s']:.2f} s after the "
                        "restart)", report["restarted"] and report["both_hit_bit_exact"], **report))
    return rows


def drill_restart_idle_engines() -> list[dict]:
    expect = ("two engines that make no call from the signal until the new daemon runs drop the old "
              "pool by themselves; the restart succeeds in a 100 MiB /dev/shm with a 64 MiB L2; both hit "
              "again, bit for bit")
    if not can_run_small_shm():
        return [row("3 idle engines, small /dev/shm restart", expect, "not run: needs root and unshare", False)]
    rows = []
    for sig, seed in (("KILL", 20260152), ("TERM", 20260153)):
        report = run_in_small_shm(sig, seed, idle=True)
        rows.append(row(f"3 SIG{sig} + restart, idle engines, small /dev/shm", expect,
                        f"idle engines dropped the old pool {report['dropped_s']:.3f} s after the signal; "
                        f"restarted; both hit bit for bit (second hit {report['back_to_second_hit_s']:.2f} s "
                        "after the restart)", report["restarted"] and report["both_hit_bit_exact"], **report))
    return rows


# ---- 3: restarts --------------------------------------------------------------------------------

def drill_restart_l2_hit() -> dict:
    seed = 4243
    rng = np.random.default_rng(seed)
    daemon = DaemonProcess().start()
    restarted = writer = None
    engine = make_manager(daemon.socket_path, "drill-engine")
    try:
        segment = os.path.join("/dev/shm", segment_name(daemon.socket_path))
        old_inode = os.stat(segment).st_ino
        prefill_and_finish(engine, random_tokens(rng, 4 * PAGE), seed)
        daemon.stop(signal.SIGKILL)
        wait_until(lambda: engine.client.state is ConnectionState.DOWN, 5.0, "the engine saw the daemon go")
        restarted = DaemonProcess(socket_dir=daemon.socket_dir).start()
        back_at = time.monotonic()
        writer = make_manager(restarted.socket_path, "drill-writer")
        tokens = random_tokens(rng, 6 * PAGE)
        expected, backed_up = prefill_and_finish(writer, tokens, seed + 1)
        writer.client.flush()
        hit_s, exact = None, False
        while time.monotonic() - back_at < 10.0:
            plan = engine.prepare(tokens, save=False)
            if plan.restored_tokens == len(tokens):
                hit_s = time.monotonic() - back_at
                exact = torch.equal(engine.read_tokens_kv(plan.l1_page_ids).view(torch.int16),
                                    expected.view(torch.int16))
                engine.finish(plan)
                break
            engine.abort(plan)
            time.sleep(0.01)
        new_inode = os.stat(segment).st_ino
        with open("/proc/self/maps") as maps:
            # the segment itself (old or new, "(deleted)" once unlinked), not its .hints/.gen- siblings
            fields = [line.split(maxsplit=5) for line in maps]
            mapped = {int(f[4]) for f in fields if len(f) == 6 and f[5].strip().removesuffix(" (deleted)") == segment}
        in_shm = [n for n in os.listdir("/dev/shm") if n == os.path.basename(segment)]
    finally:
        engine.close()
        if writer is not None:
            writer.close()
        if restarted is not None:
            restarted.stop()
            restarted.cleanup()
        daemon.cleanup()
    only_new = mapped == {new_inode} and new_inode != old_inode and len(in_shm) == 1
    ok = hit_s is not None and hit_s < 3.0 and exact and only_new and backed_up == 6
    hit = f"{hit_s:.2f} s" if hit_s is not None else "none within 10 s"
    return row("3 daemon SIGKILLed + restarted",
               "the engine's next L2 hit < 3 s after the restart, bit for bit, without restarting it; "
               "only the new segment mapped and in /dev/shm",
               f"next L2 hit {hit} after the restart, bit for bit: {exact}; "
               f"mapped segment inodes {sorted(mapped)} (new {new_inode}, old {old_inode})", ok)


def drill_warm_l3(workdir: str) -> list[dict]:
    seed = 7070
    run = RestartingDaemon()
    state = os.path.join(workdir, "l3.pt")
    try:
        run.start()
        backup = run_engine(run.daemon.socket_path, "backup", state, seed=seed)
        run.wait_until_indexed()
        sigterm_rc = run.stop(signal.SIGTERM)
        run.start()
        l3_pages = run.status()["namespaces"][0]["tiers"]["l3"]["owned_pages"]
        restore = run_engine(run.daemon.socket_path, "restore", state)
        whole = all(r["bit_exact"] and r["restored_tokens"] == r["tokens"] // PAGE * PAGE
                    for r in restore["results"])
        warm = row("3 SIGTERM + restart, same --l3-path",
                   "prefixes backed up before are L3 hits after, bit for bit",
                   f"SIGTERM exit {sigterm_rc}; {l3_pages}/{backup['pages']} pages in L3 after the restart; "
                   f"{sum(r['bit_exact'] for r in restore['results'])}/{len(restore['results'])} prefixes "
                   f"restored whole, bit for bit", sigterm_rc == 0 and l3_pages == backup["pages"] and whole)

        # A second daemon run on a fresh file: flip one byte of page 2 of the first prefix.
        run.stop(signal.SIGTERM)
        run.cleanup()
        run = RestartingDaemon()
        run.start()
        run_engine(run.daemon.socket_path, "backup", state, seed=seed + 1)
        run.wait_until_indexed()
        run.stop(signal.SIGTERM)
        saved = torch.load(state, weights_only=False)
        flip_byte(run.l3_path, run.index_path, saved[0]["tokens"], page=2,
                  byte_in_page=int(np.random.default_rng(seed).integers(GEOMETRY.bytes_per_page)))
        run.start()
        first, *others = run_engine(run.daemon.socket_path, "restore", state)["results"]
        metrics = run.status()["metrics"]
        mismatches = metrics.get("l3_checksum_mismatches", 0)
        ok = (mismatches == 1 and first["restored_tokens"] == 2 * PAGE and first["restored_part_bit_exact"]
              and all(r["bit_exact"] for r in others))
        flipped = row("3 flipped byte in the L3 file", "detected, not served (the prefix restores up to the bad page)",
                      f"{mismatches} checksum mismatch counted; the prefix restored {first['restored_tokens']} of "
                      f"{first['tokens']} tokens (bit for bit: {first['restored_part_bit_exact']}); "
                      f"the other {len(others)} prefixes whole: {all(r['bit_exact'] for r in others)}", ok)
    finally:
        run.cleanup()
    return [warm, flipped]


# ---- 4: the socket ------------------------------------------------------------------------------

def socket_safety_built() -> bool:
    """Whether the client side checks the socket's owner (issue 10, finding 4)."""
    import proto.paths

    source = inspect.getsource(proto.paths)
    return "st_uid" in source and "lstat" in source


def start_refused(env_overrides: dict[str, str], timeout_s: float = 10.0) -> tuple[int | None, str]:
    """Start `kvcached serve` on its default socket with these variables; (exit code, output).
    None: it was still running (it started) and was stopped."""
    env = child_env()
    env.update(env_overrides)
    proc = subprocess.Popen([sys.executable, "-m", "kvcached.cli", "serve", "--l2-size", "16MiB", "--l3-size", "0"],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=10)
        return None, output


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def takeover_case(name: str, prepare) -> dict:
    """prepare(runtime_dir, victim) plants the trap; the daemon, started with XDG_RUNTIME_DIR set
    to runtime_dir, must exit non-zero saying why, with the victim file untouched."""
    runtime_dir = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    victim_dir = tempfile.mkdtemp(prefix="kvv-", dir="/tmp")
    victim = os.path.join(victim_dir, "victim")
    with open(victim, "wb") as f:
        f.write(os.urandom(4096))
    before = digest(victim)
    try:
        socket_dir = os.path.join(runtime_dir, "kvcached")
        prepare(socket_dir, victim)
        rc, output = start_refused({"XDG_RUNTIME_DIR": runtime_dir})
        after = digest(victim) if os.path.exists(victim) else "removed"
        lines = [line for line in output.splitlines() if line.strip()]
        return {"case": name, "exit_code": rc, "refused": rc not in (None, 0),
                "victim_untouched": after == before, "message": lines[-1][:300] if lines else ""}
    finally:
        for directory in (runtime_dir, victim_dir):
            subprocess.run(["chmod", "-R", "u+rwx", directory], check=False)
            shutil.rmtree(directory, ignore_errors=True)


def plant_lock_symlink(socket_dir: str, victim: str) -> None:
    os.mkdir(socket_dir, 0o700)
    os.symlink(victim, os.path.join(socket_dir, "kvcached.sock.lock"))


def plant_socket_symlink(socket_dir: str, victim: str) -> None:
    os.mkdir(socket_dir, 0o700)
    os.symlink(victim, os.path.join(socket_dir, "kvcached.sock"))


def open_socket_dir(socket_dir: str, victim: str) -> None:
    os.mkdir(socket_dir)
    os.chmod(socket_dir, 0o777)


def foreign_socket_dir(socket_dir: str, victim: str) -> None:
    os.mkdir(socket_dir, 0o700)
    os.chown(socket_dir, 65534, 65534)          # nobody


def drill_socket_takeover() -> dict:
    cases = [takeover_case("symlink at the lock path", plant_lock_symlink),
             takeover_case("symlink at the socket path", plant_socket_symlink),
             takeover_case("socket dir pre-created 0777", open_socket_dir)]
    if os.geteuid() == 0:
        cases.append(takeover_case("socket dir owned by another user", foreign_socket_dir))
    held = all(c["refused"] and c["victim_untouched"] for c in cases)
    observed = "; ".join(f"{c['case']}: {'refused' if c['refused'] else 'NOT refused'}, victim "
                         f"{'untouched' if c['victim_untouched'] else 'CHANGED'}" for c in cases)
    expect = "each planted symlink and pre-created directory refused with a clear message, the victim untouched"
    if not socket_safety_built():
        return row("4 socket takeover", expect, "not built yet", False, observed=observed, cases=cases)
    return row("4 socket takeover", expect, observed, held, cases=cases)


# ---- fairness in L2 ------------------------------------------------------------------------------

def drill_flood_fairness(seed: int = 1) -> list[dict]:
    """The flood trace on the daemon's state (kvcached.testing.flood_trace: a fake clock, no sockets,
    deterministic): engine A's hot prefixes against engine B's 16 one-use prompts per A request,
    in one model and across two (either attached first)."""
    import logging

    from kvcached.testing.flood_trace import GEOMETRY_A, FloodTrace, run
    logging.disable(logging.WARNING)            # the pressure warnings
    rows = []
    try:
        for name, same_model, flood_first in (("same model", True, False), ("two models, A first", False, False),
                                              ("two models, B first", False, True)):
            trace = FloodTrace(requests=600, same_model=same_model, flood_first=flood_first)
            alone = run(trace, seed)
            flooded = run(dataclasses.replace(trace, flood_per_request=16), seed)
            share = flooded.hit_share / alone.hit_share
            l2_pages = trace.l2_bytes // GEOMETRY_A.bytes_per_page
            even = same_model or flooded.a_l2_capacity >= l2_pages // 2 - 1
            rows.append(row("flood_fairness", f"{name}: A's hot prefixes keep >= 80% of their hit share under B's "
                            "one-use flood (daemon state, a trace)" + ("" if same_model else
                                                                       "; A keeps half of L2"),
                            f"hit share {flooded.hit_share:.3f} flooded vs {alone.hit_share:.3f} alone "
                            f"({share:.0%})" + ("" if same_model else
                                                f"; A holds {flooded.a_l2_capacity} of {l2_pages} L2 pages"),
                            share >= 0.8 and even, hit_share_alone=alone.hit_share,
                            hit_share_flooded=flooded.hit_share, a_l2_pages=flooded.a_l2_capacity))
    finally:
        logging.disable(logging.NOTSET)
    return rows


# ---- the cost model heals ------------------------------------------------------------------------

def drill_cost_model_heals(max_requests: int = 200, max_s: float = 30.0) -> dict:
    """A real daemon and connector (policy cost): an 8-page prefix saved to L2, then one 1-s h2d
    sample reported; lookups until one restores from L2 again, and that restore's load."""
    from kvcached.testing.connector_engine import P, engine_of, save
    daemon = DaemonProcess(l2_size="8MiB").start()
    engine = None
    try:
        engine = engine_of(daemon, 41, "cost")
        prefix = random_tokens(np.random.default_rng(41), 8 * P)
        save(engine, prefix, list(range(8)))
        engine.connector.client.report({}, [("h2d", 8 * engine.connector.geometry.bytes_per_page, 1.0)])
        engine.connector.client.flush()
        started = time.monotonic()
        choices = []
        while "l2" not in choices and len(choices) < max_requests and time.monotonic() - started < max_s:
            choices.append(engine.connector.lookup_async(prefix).decision().choice)
        seconds = time.monotonic() - started
        engine.connector.load("again", prefix, list(range(8, 16)), 8 * P)
        engine.poll_until(lambda: engine.loads, "the load")
        restored = engine.loads[0].ok and all(torch.equal(engine.block(b + 8), engine.block(b)) for b in range(8))
        resumed_at = choices.index("l2") + 1 if "l2" in choices else None
        return row("cost_model_heals", f"after one 1-s h2d sample, an L2 restore again within {max_requests} "
                   f"requests or {max_s:.0f} s", f"declined {choices.count('recompute')} lookups, the "
                   f"{resumed_at}th restored (after {seconds:.2f} s), bit for bit: {restored}",
                   resumed_at is not None and choices[0] == "recompute" and restored,
                   requests_to_restore=resumed_at, seconds_to_restore=round(seconds, 3))
    finally:
        if engine is not None:
            engine.close()
        daemon.stop()
        daemon.cleanup()


# ---- 5: L3 files ---------------------------------------------------------------------------------

def drill_l3_plants() -> dict:
    """Symlinks and (as root) another user's files planted at --l3-path, its index and sqlite's
    sidecars: each refused with one line, the file untouched; a disk full at start keeps the index."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    cases = []
    for name in L3_NAMES:
        for plant in ("symlink", "other user") if IS_ROOT else ("symlink",):
            directory = tempfile.mkdtemp(prefix="kvl3-", dir="/tmp")
            try:
                victim = os.path.join(directory, "victim") if plant == "symlink" else os.path.join(directory, name)
                random_file(victim, rng)
                if plant == "symlink":
                    os.symlink(victim, os.path.join(directory, name))
                else:
                    os.chown(victim, L3_OTHER_UID, L3_OTHER_UID)
                before = fingerprint(victim)
                rc, output = serve_once(os.path.join(directory, "l3.bin"))
                lines = [line for line in output.splitlines() if line.strip()]
                cases.append({"case": f"{plant} at {name}", "exit_code": rc, "untouched": fingerprint(victim) == before,
                              "message": lines[-1][:300] if lines else ""})
            finally:
                shutil.rmtree(directory, ignore_errors=True)
    refused = sum(case["exit_code"] == 1 and case["untouched"] for case in cases)
    full = run_enospc_start(int(rng.integers(1 << 31))) if can_mount_tmpfs() else None
    kept = full is not None and full["full"]["index_unchanged"] and full["freed"]["l3_pages"] == ENOSPC_ROWS
    return row("l3_plants", "symlink and foreign-owner plants at --l3-path, its index and sidecars refused, the "
               "file untouched; ENOSPC at start keeps the index",
               f"{refused} of {len(cases)} plants refused, untouched; full disk at start: " +
               ("not run (needs root and unshare)" if full is None else
                f"index kept {full['full']['index_unchanged']}, {full['freed']['l3_pages']} of {ENOSPC_ROWS} rows "
                "back once space was free"),
               refused == len(cases) and kept, cases=cases, enospc=full)


def drill_l3_rebuild_rss(num_rows: int = TEST_ROWS) -> dict:
    """A real daemon restarting on a branchy L3 index (one history, continuations of 50 pages
    branching off it): its peak RSS (VmHWM) and the seconds until it answers."""
    seed = int.from_bytes(os.urandom(4), "little")
    result = restart_on_branchy_index(num_rows, seed)
    peak_mb = result["peak_rss_bytes"] / 1e6
    passed = (result["l3_pages"] == num_rows and result["integrity"] == "ok"
              and result["peak_rss_bytes"] <= MAX_REBUILD_RSS_BYTES)
    return row("l3_rebuild_rss", f"rebuild of {num_rows} branchy rows <= {MAX_REBUILD_RSS_BYTES / 1e6:.0f} MB RSS",
               f"peak RSS {peak_mb:.0f} MB, {result['l3_pages']} pages back, ready in {result['seconds']:.1f} s",
               passed, seed=seed, peak_rss_bytes=result["peak_rss_bytes"], seconds=round(result["seconds"], 2))


# ---- issue 41, items 7 and 8: per-client memory, the HTTP endpoint -----------------------------

def drill_client_never_reads(num_requests: int = 3000) -> dict:
    """A never-reading process sends num_requests STATUS requests against ~0.7 MB snapshots."""
    from kvcached.testing.floods import MAX_RSS_GROWTH_BYTES, never_reading_flood

    daemon = DaemonProcess(extra_args=("--l3-size", "0")).start()
    try:
        measured = never_reading_flood(daemon, num_requests, seed=41)
    finally:
        daemon.cleanup()
    growth_mb = measured["rss_growth_bytes"] / 1e6
    worst_s = max(measured["round_trips_s"])
    return row("client_never_reads",
               f"{num_requests} STATUS requests never read: daemon RSS +<100 MB; a reading client served (<2 s)",
               f"RSS {growth_mb:+.1f} MB over {num_requests} requests of {measured['snapshot_bytes'] / 1e6:.2f} MB "
               f"snapshots ({measured['refused']} refused); reading client: {len(measured['round_trips_s'])} "
               f"statuses, worst {worst_s * 1e3:.1f} ms",
               measured["rss_growth_bytes"] < MAX_RSS_GROWTH_BYTES and worst_s < 2.0,
               rss_growth_bytes=measured["rss_growth_bytes"], worst_round_trip_s=round(worst_s, 4))


def drill_http_idle_flood(num_idle: int = 100, num_scrapes: int = 10) -> dict:
    """100 idle TCP connections held open; /metrics scraped once a second."""
    from kvcached.testing.floods import idle_flood_scrapes

    daemon = DaemonProcess(extra_args=("--l3-size", "0")).start()
    try:
        scrapes = idle_flood_scrapes(daemon.http_url(), num_idle, num_scrapes)
    finally:
        daemon.cleanup()
    answered = sum(status == 200 for status, _ in scrapes)
    worst_s = max(seconds for _, seconds in scrapes)
    return row("http_idle_flood", f"{num_idle} idle connections: every /metrics scrape (1/s) answered, <2 s",
               f"{answered} of {num_scrapes} scrapes answered, worst {worst_s * 1e3:.1f} ms",
               answered == num_scrapes and worst_s < 2.0, worst_scrape_s=round(worst_s, 4))


def drill_oversized_l2() -> dict:
    """serve with an L2 pool beyond what /dev/shm and memory hold."""
    from kvcached.testing.startup import shm_leftovers

    total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    size = max(64 << 30, 2 * total_bytes)
    daemon = DaemonProcess(l2_size=str(size))
    try:
        started = time.monotonic()
        result = subprocess.run(daemon.args, env=daemon.env, cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=60)
        seconds = time.monotonic() - started
        lines = result.stderr.splitlines()
        left = shm_leftovers(daemon.socket_path) + os.listdir(daemon.socket_dir)
    finally:
        daemon.cleanup()
    passed = result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr and not left
    return row("oversized_l2", f"--l2-size {size / 2**30:.0f} GiB: one line, exit status 2, nothing left in /dev/shm",
               f"exit {result.returncode} after {seconds:.2f} s, {len(lines)} line(s), left: {left or 'nothing'}",
               passed, stderr=lines[:2])


def drill_sigint_startup() -> list[dict]:
    """SIGINT (SIGTERM once) at moments of start-up of a largish pool: exit time and leftovers."""
    from kvcached.testing.startup import STOP_BOUND_S, large_pool_bytes, shm_leftovers, stop_and_time, \
        wait_for_log

    pool_bytes = large_pool_bytes()
    cases = [(signal.SIGINT, "starting", 0.0), (signal.SIGINT, "starting", 0.1), (signal.SIGINT, "starting", 0.3),
             (signal.SIGINT, "populating", "25%"), (signal.SIGINT, "populating", "50%"),
             (signal.SIGINT, "populating", "75%"), (signal.SIGINT, "populating", "100%"),
             (signal.SIGTERM, "populating", "50%")]
    rows = []
    for signum, how, when in cases:
        daemon = DaemonProcess(l2_size=str(pool_bytes)).spawn()
        try:
            if how == "starting":
                wait_for_log(daemon, "kvcached starting")
                time.sleep(when)
                moment = f"{when:g} s after its first line"
            else:
                wait_for_log(daemon, f"populating the L2 pool: {when}")
                moment = f"at {when} populated"
            elapsed_s = stop_and_time(daemon, signum)
            log = daemon.log()
            left = shm_leftovers(daemon.socket_path) + os.listdir(daemon.socket_dir)
        finally:
            daemon.cleanup()
        name = signal.Signals(signum).name
        rows.append(row("sigint_startup", f"{name} {moment} ({pool_bytes / 2**30:.1f} GiB pool): exit within "
                        f"{STOP_BOUND_S:g} s, nothing left in /dev/shm or the socket directory",
                        f"exit {daemon.proc.returncode} after {elapsed_s:.3f} s, left: {left or 'nothing'}",
                        elapsed_s <= STOP_BOUND_S and not left and "Traceback" not in log,
                        exit_s=round(elapsed_s, 4)))
    return rows


def drill_remote() -> list[dict]:
    """The remote tier's scenarios (kvcached.testing.remote.scenarios), the master's at the default deadline."""
    from kvcached.testing.remote.cluster import missing, run_isolated

    why = missing()
    if why:
        return [row("remote", "the remote tier's drills run", f"not run: {why}", False)]
    rows = []
    across = run_isolated("restore_across_hosts")
    rows.append(row("remote_across_hosts", "a prefix saved on host A restores on host B, which never saw it, "
                    "bit for bit", f"{across['b_remote_hit_pages']} of {across['saved']['pages']} pages from the "
                    f"store, bit exact {across['restored']['bit_exact']}, checksum mismatches "
                    f"{across['b_checksum_mismatches']}", across["restored"]["bit_exact"]
                    and across["b_remote_hit_pages"] == across["saved"]["pages"]))
    deadline_s = 0.1
    outage = run_isolated("master_killed", deadline_s=deadline_s)
    hung = [outage["hung"]["other_prepare_seconds"]] + [r["prepare_seconds"] for r in outage["hung"]["results"]]
    bound_s = deadline_s + 0.2
    no_wrong = all(r["restored_part_bit_exact"] for phase in ("hung", "killed") for r in outage[phase]["results"])
    rows.append(row("remote_master_gone", f"master hung then killed: a request misses within the deadline "
                    f"({deadline_s:g} s, bound {bound_s:g} s with scheduling), no wrong byte; the daemons "
                    "reconnect by themselves", f"hung: prepares {max(hung):.3f} s at most; reconnected "
                    f"{outage['reconnect_s']:.1f} s after the restart; then bit exact {outage['after']['bit_exact']}",
                    max(hung) <= bound_s and no_wrong and outage["after"]["bit_exact"],
                    prepare_s=[round(x, 4) for x in hung]))
    killed = run_isolated("contributor_killed")
    during = killed["during"]["results"]
    rows.append(row("remote_lender_killed", "the host lending the store's memory SIGKILLed: misses, no wrong "
                    "byte; a new daemon there lends again and prefixes go across",
                    f"restored {sum(r['restored_tokens'] for r in during)} tokens while it was gone, checksum "
                    f"mismatches {killed['b_checksum_mismatches']}, then bit exact {killed['after']['bit_exact']}",
                    all(r["restored_part_bit_exact"] for r in during) and killed["after"]["bit_exact"]))
    decided = run_isolated("decision")
    declined = [d["choice"] for d in decided["declined"]["decisions"]]
    taken = [d["choice"] for d in decided["taken"]["decisions"]]
    rows.append(row("remote_decision", "policy cost declines remote hits priced slower than recompute, takes "
                    "those priced faster", f"slow store: {declined}; fast store: {taken}",
                    set(declined) == {"recompute"} and set(taken) == {"remote"}))
    return rows


def e2e_once(seed: int, workdir: str) -> bool:
    """Engine A (a process) backs up three random prefixes; engine B, another process, restores all
    of them from L2 into other L1 pages: whether every one came back whole, bit for bit, and the
    daemon's integrity and leases held."""
    daemon = DaemonProcess().start()
    try:
        state = os.path.join(workdir, f"e2e-{seed}.pt")
        run_engine(daemon.socket_path, "backup", state, seed=seed)
        restore = run_engine(daemon.socket_path, "restore", state, seed=seed + 1)
        with connect(daemon.socket_path, timeout_s=5.0) as observer:
            status = observer.status(check_integrity=True)
    except (AssertionError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
        return False
    finally:
        daemon.cleanup()
    whole = all(r["restored_tokens"] == r["tokens"] // PAGE * PAGE and r["bit_exact"] and not r["same_pages_as_source"]
                for r in restore["results"])
    return whole and status["integrity"] == "ok" and status["leases"] == 0


def drill_e2e_under_burners(workdir: str, runs: int = 20, burners: int = 6) -> dict:
    """The end-to-end backup-then-restore of two engine processes ``runs`` times, one after the
    other, with ``burners`` busy-looping processes sharing the CPUs all along."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    passed, seconds = 0, []
    try:
        for i in range(runs):
            started = time.monotonic()
            passed += e2e_once(20260600 + 10 * i, workdir)
            seconds.append(round(time.monotonic() - started, 1))
    finally:
        for proc in spinning:
            proc.kill()
            proc.wait()
    return row("e2e_under_burners", f"engine B restores what engine A backed up, bit for bit, in {runs} of {runs} "
               f"runs under {burners} CPU burners ({os.cpu_count()} CPUs)", f"{passed} of {runs} passed",
               passed == runs, run_seconds=seconds)


DRILLS = ("stale_writer", "sigkill_mid_backup", "outage_prepare", "outage_inflight", "restart_l2_hit",
          "daemon_restart_small_shm", "daemon_restart_idle_engines", "warm_l3", "socket_takeover", "cost_model_heals", "l3_plants", "l3_rebuild_rss",
          "client_never_reads", "http_idle_flood", "flood_fairness", "oversized_l2", "sigint_startup", "remote", "e2e_under_burners")


def run_drills(names: tuple[str, ...], repeats: int, workdir: str) -> list[dict]:
    rows: list[dict] = []
    for name in names:
        started = time.monotonic()
        try:
            produced = run_drill(name, repeats, workdir)
        except Exception as exc:          # a drill that could not run is a failed row, not a crash
            produced = [row(name, "the drill runs", f"failed to run: {exc!r}"[:500], False)]
        for entry in produced:
            entry["seconds"] = round(time.monotonic() - started, 1)
        rows += produced
    return rows


def run_drill(name: str, repeats: int, workdir: str) -> list[dict]:
    if name == "stale_writer":
        return [drill_stale_writer(repeats, "pid-watched"), drill_stale_writer(repeats, "unshare-pid")]
    if name == "sigkill_mid_backup":
        return [drill_sigkill_mid_backup()]
    if name == "outage_prepare":
        return [drill_outage_prepare()]
    if name == "outage_inflight":
        return [drill_outage_inflight()]
    if name == "restart_l2_hit":
        return [drill_restart_l2_hit()]
    if name == "daemon_restart_small_shm":
        return drill_restart_small_shm()
    if name == "daemon_restart_idle_engines":
        return drill_restart_idle_engines()
    if name == "warm_l3":
        return drill_warm_l3(workdir)
    if name == "cost_model_heals":
        return [drill_cost_model_heals()]
    if name == "l3_plants":
        return [drill_l3_plants()]
    if name == "l3_rebuild_rss":
        return [drill_l3_rebuild_rss()]
    if name == "client_never_reads":
        return [drill_client_never_reads()]
    if name == "http_idle_flood":
        return [drill_http_idle_flood()]
    if name == "flood_fairness":
        return drill_flood_fairness()
    if name == "oversized_l2":
        return [drill_oversized_l2()]
    if name == "sigint_startup":
        return drill_sigint_startup()
    if name == "remote":
        return drill_remote()
    if name == "e2e_under_burners":
        return [drill_e2e_under_burners(workdir)]
    return [drill_socket_takeover()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each stale-writer drill")
    parser.add_argument("--only", default=",".join(DRILLS), help=f"comma-separated, of {', '.join(DRILLS)}")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--merge", action="store_true",
                        help="replace only these drills' rows in the existing drills.json (each such row "
                             "records its own commit, date and command)")
    args = parser.parse_args()
    names = tuple(n for n in args.only.split(",") if n)
    unknown = [n for n in names if n not in DRILLS]
    if unknown:
        parser.error(f"unknown drills {unknown}")
    workdir = tempfile.mkdtemp(prefix="kvdrill-")
    try:
        rows = run_drills(names, args.repeats, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(rows, ("drill", "pass", "measured"))
    if args.no_write:
        return 0
    if args.merge:
        rows = merged_rows(rows, names)
    print(write_result("drills", {"rows": rows}, machine="cpu"))
    return 0


def merged_rows(rows: list[dict], names: tuple[str, ...]) -> list[dict]:
    """The existing drills.json's rows with those of ``names`` replaced by ``rows`` (in place of
    the first one replaced). A drill that failed to run left a row labelled with its name. Every
    row says which commit, date and command it comes from."""
    path = os.path.join(RESULTS_DIR, "cpu", "drills.json")
    with open(path) as f:
        existing = json.load(f)
    stamp = {"git_commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])}
    replaced = {r["drill"] for r in rows} | set(names)
    earlier = {key: existing[key] for key in ("git_commit", "date", "command")}
    merged, placed = [], False
    for old in existing["rows"]:
        if old["drill"] not in replaced:
            merged.append({**earlier, **old})
        elif not placed:
            merged += [{**r, **stamp} for r in rows]
            placed = True
    return merged if placed else merged + [{**r, **stamp} for r in rows]


if __name__ == "__main__":
    sys.exit(main())
