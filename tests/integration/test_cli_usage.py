"""`kvcached` as a user meets it, each case a real process: --version, sizes as docker reads them,
one-line errors naming the bad flag or variable, paths refused before the pool is populated,
progress while a large pool is populated, a closed stdout that ends `status` quietly."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import kvcached
from kvcached.server.shm import hints_file_name, segment_name
from kvcached.testing.daemon_proc import REPO_ROOT, DaemonProcess, child_env

CLI = [sys.executable, "-m", "kvcached.cli"]


def kvcached_run(*args: str, env: dict[str, str] | None = None, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env={**child_env(), **(env or {})}, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


@pytest.fixture
def socket_dir():
    """A directory for the socket (kvcached.sock); removed afterwards, with any segment of a daemon
    that was killed on the socket."""
    path = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)
    for name in (segment_name, hints_file_name):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join("/dev/shm", name(os.path.join(path, "kvcached.sock"))))


def test_version_prints_the_package_version():
    """`kvcached --version` prints `kvcached <version>` (the package's, which pyproject reads too)
    and exits 0."""
    result = kvcached_run("--version")
    assert (result.returncode, result.stdout, result.stderr) == (0, f"kvcached {kvcached.__version__}\n", "")
    with open(os.path.join(REPO_ROOT, "pyproject.toml")) as f:
        assert 'version = { attr = "kvcached.__version__" }' in f.read()


def test_sizes_are_binary_for_k_m_g_t_and_decimal_for_kb_mb_gb_tb_as_help_says():
    """`serve --help` says which units are binary and which decimal; a daemon started with
    `--l2-size 8m` has a segment of 8 MiB (8388608 bytes), not 8,000,000."""
    help_text = " ".join(kvcached_run("serve", "--help").stdout.split())
    assert "k m g t and KiB MiB GiB TiB are binary" in help_text and "KB MB GB TB decimal" in help_text
    daemon = DaemonProcess(l2_size="8m", extra_args=("--l3-size", "1g")).start()
    try:
        result = kvcached_run("status", "--json", "--socket", daemon.socket_path)
        status = json.loads(result.stdout)["daemon"]
        assert (status["l2_bytes"], status["l3_bytes"]) == (8 << 20, 1 << 30)
    finally:
        daemon.cleanup()


TOO_LONG_SOCKET = "/tmp/" + "s" * 120 + ".sock"


@pytest.mark.parametrize("args, env, named", [
    (["serve", "--bogus"], {}, "--bogus"),
    (["serve", "--l2-size", "abc"], {}, "--l2-size"),
    (["serve", "--l2-size", "1MiB"], {}, "--l2-size"),
    (["serve", "--log-level", "bogus"], {}, "--log-level"),
    (["serve", "--max-namespaces", "0"], {}, "--max-namespaces"),
    (["serve", "--io-threads", "many"], {}, "--io-threads"),
    (["serve", "--socket", TOO_LONG_SOCKET], {}, "--socket"),
    (["serve", "--session-grace", "inf"], {}, "--session-grace"),
    (["serve", "--heartbeat-interval", "nan"], {}, "--heartbeat-interval"),
    (["serve", "--session-timeout", "-1"], {}, "--session-timeout"),
    (["serve", "--cost-margin", "-1"], {}, "--cost-margin"),
    (["serve", "--prior-host-gibps", "0"], {}, "--prior-host-gibps"),
    (["serve", "--spin-us", "-1"], {}, "--spin-us"),
    (["status", "--follow", "--interval-s", "-1"], {}, "--interval-s"),
    (["status", "--interval-s", "0"], {}, "--interval-s"),
    (["status", "--timeout-s", "nan"], {}, "--timeout-s"),
    ([], {}, "serve,status"),
    (["serve"], {"KVCACHED_L2_SIZE": "abc"}, "KVCACHED_L2_SIZE='abc'"),
    (["serve"], {"KVCACHED_L3_SIZE": "12x"}, "KVCACHED_L3_SIZE='12x'"),
    (["serve"], {"KVCACHED_MAX_NAMESPACES": "many"}, "KVCACHED_MAX_NAMESPACES='many'"),
    (["serve"], {"KVCACHED_MAX_NAMESPACES": "0"}, "KVCACHED_MAX_NAMESPACES='0'"),
    (["serve"], {"KVCACHED_LOG_LEVEL": "bogus"}, "KVCACHED_LOG_LEVEL='bogus'"),
    (["serve"], {"KVCACHED_L3_O_DIRECT": "maybe"}, "KVCACHED_L3_O_DIRECT='maybe'"),
    (["serve"], {"KVCACHED_SOCKET": TOO_LONG_SOCKET}, "KVCACHED_SOCKET="),
    (["status"], {"KVCACHED_DAEMON_UID": "no-such-user-kvt"}, "KVCACHED_DAEMON_UID='no-such-user-kvt'"),
])
def test_a_bad_flag_or_variable_is_one_line_naming_it(args, env, named, socket_dir):
    """Each bad flag or KVCACHED_* variable ends the command with a non-zero status and exactly one
    line on stderr that names the flag or the variable (and its value), no traceback, and nothing
    started: no socket, no segment."""
    socket_path = os.path.join(socket_dir, "kvcached.sock")
    env = {"KVCACHED_SOCKET": socket_path, "KVCACHED_L2_SIZE": "8MiB", **env}
    result = kvcached_run(*args, env=env, timeout_s=30.0)
    lines = result.stderr.splitlines()
    assert result.returncode in (1, 2) and len(lines) == 1 and named in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not os.path.exists(socket_path)
    assert not os.path.exists(os.path.join("/dev/shm", segment_name(socket_path)))


def test_every_path_is_checked_before_the_pool_is_populated(socket_dir, tmp_path):
    """An L3 path in a directory that does not exist, one that is a directory, and a socket whose
    directory would have to be made inside a regular file are each refused in one line naming the
    path, before the L2 segment is populated (the daemon never logs it populated, leaves none)."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    socket_path = os.path.join(socket_dir, "kvcached.sock")
    cases = [(["--socket", socket_path, "--l3-path", str(tmp_path / "missing" / "l3.bin")], "missing/l3.bin"),
             (["--socket", socket_path, "--l3-path", str(tmp_path)], str(tmp_path)),
             (["--socket", str(a_file / "sub" / "kvcached.sock")], str(a_file))]
    for args, named in cases:
        result = kvcached_run("serve", "--l2-size", "64MiB", "--log-level", "INFO", *args)
        errors = [line for line in result.stderr.splitlines() if line.startswith("kvcached:")]
        assert result.returncode == 1 and len(errors) == 1 and named in errors[0], result.stderr
        assert "Traceback" not in result.stderr and "populated" not in result.stderr, result.stderr
    assert not os.path.exists(os.path.join("/dev/shm", segment_name(socket_path)))


def test_a_large_pool_shows_plain_progress_lines_when_stdout_is_not_a_terminal():
    """A 1 GiB pool, stdout a file: a plain line at 25, 50, 75 and 100% (no carriage return),
    before the daemon serves."""
    daemon = DaemonProcess(l2_size="1GiB", extra_args=("--l3-size", "0")).start(timeout_s=60.0)
    try:
        log = daemon.log()
    finally:
        daemon.cleanup()
    lines = [line for line in log.splitlines() if "populating the L2 pool" in line]
    assert [line.split(": ")[2].split("%")[0] for line in lines] == ["25", "50", "75", "100"], log
    assert "\r" not in log and log.index("100% of 1.0 GiB") < log.index("kvcached serving on")


def test_a_large_pool_shows_a_bar_on_a_terminal(socket_dir):
    """A 1 GiB pool, stdout a terminal: one bar redrawn in place (carriage returns) up to 100%,
    ended by a newline."""
    socket_path = os.path.join(socket_dir, "kvcached.sock")
    master, slave = pty.openpty()
    proc = subprocess.Popen([*CLI, "serve", "--socket", socket_path, "--l2-size", "1GiB", "--l3-size", "0"],
                            env=child_env(), cwd=REPO_ROOT, stdout=slave, stderr=subprocess.DEVNULL)
    os.close(slave)
    output = b""
    try:
        deadline = time.monotonic() + 60.0
        while b"100%" not in output or not output.endswith(b"\n"):
            assert time.monotonic() < deadline and proc.poll() is None, output
            if select.select([master], [], [], 0.5)[0]:
                output += os.read(master, 4096)
        # Stopped once it serves (its signal handlers are in place), so that it removes its segment.
        while kvcached_run("status", "--socket", socket_path, "--timeout-s", "0.5").returncode != 0:
            assert time.monotonic() < deadline and proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        os.close(master)
    text = output.decode()
    assert text.count("\r") >= 4 and "[" + "#" * 30 + "] 100% of 1.0 GiB" in text and text.count("\n") == 1, text


def test_a_closed_stdout_ends_status_quietly(daemon):
    """`kvcached status` into a pipe nobody reads, and `status --follow` into `head -3`, end with
    no traceback and nothing on stderr; the first with status 141, as a SIGPIPE would."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    result = subprocess.run([*CLI, "status", "--socket", daemon.socket_path], env=child_env(), cwd=REPO_ROOT,
                            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=30)
    os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")
    pipeline = subprocess.run(
        f"{sys.executable} -m kvcached.cli status --follow --interval-s 0.05 --socket {daemon.socket_path} "
        "2>stderr.txt | head -3", shell=True, env=child_env(), cwd=daemon.socket_dir, capture_output=True,
        text=True, timeout=60)
    assert len(pipeline.stdout.splitlines()) == 3
    with open(os.path.join(daemon.socket_dir, "stderr.txt")) as f:
        assert f.read() == ""
