"""The L3 file and its index are the daemon's own: real ``kvcached serve`` processes refuse a
symlink or another user's file planted at --l3-path, its index or sqlite's -wal and -shm files
beside it, with one line, touching nothing; a disk too full to write the index at start keeps it.

Another user is uid 65534 (nobody): the tests that chown run as root (as CI does).
"""

from __future__ import annotations

import os

import pytest

from kvcached.testing.l3_files import ENOSPC_ROWS, IS_ROOT, L3_NAMES, OTHER_UID, WRITE_THROUGHS, can_mount_tmpfs, fingerprint, random_file, run_enospc_start, run_in_tmpfs, serve_once


def refusal_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines, "the daemon said nothing"
    return lines[-1]


@pytest.mark.parametrize("name", L3_NAMES)
def test_a_symlink_planted_at_an_l3_file_is_refused_and_its_target_untouched(tmp_path, rng, name):
    """A symlink at --l3-path, its index, or the index's -wal or -shm file, pointing at another
    file of the daemon's user: the daemon exits with status 1 and one line naming the symlink; the
    file it points at keeps its inode, size and bytes."""
    victim = str(tmp_path / "victim")
    random_file(victim, rng)
    before = fingerprint(victim)
    directory = tmp_path / "l3"
    directory.mkdir(mode=0o700)
    os.symlink(victim, directory / name)
    rc, output = serve_once(str(directory / "l3.bin"))
    assert rc == 1, output
    line = refusal_line(output)
    assert "symlink" in line and name in line, line
    assert fingerprint(victim) == before


@pytest.mark.skipif(not IS_ROOT, reason="chown to another user needs root")
@pytest.mark.parametrize("name", L3_NAMES)
def test_another_users_l3_file_is_refused_untouched(tmp_path, rng, name):
    """A root daemon does not adopt a file of another user (uid 65534) at --l3-path, its index or
    the index's -wal or -shm file, though it could open it: exit status 1, one line naming the file
    and its owner, and the file keeps its owner, mode and bytes (no forged KV served, no prompt
    tokens written where that user reads them)."""
    directory = tmp_path / "l3"
    directory.mkdir(mode=0o700)
    planted = str(directory / name)
    random_file(planted, rng)
    os.chown(planted, OTHER_UID, OTHER_UID)
    before = fingerprint(planted)
    rc, output = serve_once(str(directory / "l3.bin"))
    assert rc == 1, output
    line = refusal_line(output)
    assert name in line and f"uid {OTHER_UID}" in line, line
    assert fingerprint(planted) == before


@pytest.mark.parametrize("name", L3_NAMES)
def test_an_l3_file_others_may_read_is_refused_untouched(tmp_path, rng, name):
    """A file of the daemon's user that group or others may read (0644) at --l3-path, its index or
    a sidecar: refused with one line naming its mode, and left as it was (not made 0600 and used:
    whoever could read it may hold it open)."""
    directory = tmp_path / "l3"
    directory.mkdir(mode=0o700)
    planted = str(directory / name)
    random_file(planted, rng, mode=0o644)
    before = fingerprint(planted)
    rc, output = serve_once(str(directory / "l3.bin"))
    assert rc == 1, output
    line = refusal_line(output)
    assert name in line and "0644" in line, line
    assert fingerprint(planted) == before


def test_new_l3_files_are_private_and_a_second_start_uses_them(tmp_path):
    """A daemon makes its L3 file and index 0600 (whatever the umask), and a second start on them
    is not refused."""
    directory = tmp_path / "l3"
    directory.mkdir(mode=0o700)
    l3_path = str(directory / "l3.bin")
    old_umask = os.umask(0)
    try:
        assert serve_once(l3_path)[0] is None
    finally:
        os.umask(old_umask)
    for name in os.listdir(directory):
        assert os.stat(directory / name).st_mode & 0o777 == 0o600, name
    rc, output = serve_once(l3_path)
    assert rc is None, output


# ---- ENOSPC at start ----------------------------------------------------------------------------


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root and unshare --mount to make a small tmpfs")
def test_a_full_disk_at_start_keeps_the_index(rng):
    """On a tmpfs filled up after the index was written, a daemon still starts (without L3 for
    that run, saying why in one warning) and leaves the index as it was: not removed, not
    emptied; once space is free again, a restart has every row back."""
    result = run_enospc_start(int(rng.integers(1 << 31)))
    full, freed = result["full"], result["freed"]
    assert full["index_exists"] and full["index_unchanged"], result
    assert full["warning"] and full["l3_pages"] == 0 and full["integrity"] == "ok", result
    assert freed["l3_pages"] == ENOSPC_ROWS and freed["integrity"] == "ok", result


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root and unshare --mount to make a small tmpfs")
def test_failing_write_throughs_back_off_and_log_a_line_per_cause(rng):
    """With the L3 file's disk full, WRITE_THROUGHS prefixes backed up: every write-through fails
    or is skipped while write-throughs are paused (counted: h2s_failures, h2s_backoff_skips),
    fewer fail than were asked for, the log has one line for the cause (ENOSPC) rather than one
    per failure; with space again, write-throughs resume and say so."""
    result = run_in_tmpfs("failing_write_throughs", int(rng.integers(1 << 31)))
    assert result["h2s_count"] == 0, result
    assert result["h2s_failures"] + result["h2s_backoff_skips"] == WRITE_THROUGHS, result
    assert result["h2s_backoff_skips"] > 0 and result["h2s_failures"] >= 1, result
    failed_lines = [line for line in result["log_lines"] if "failed" in line]
    assert 1 <= len(failed_lines) <= 3 and "ENOSPC" in failed_lines[0], result["log_lines"]
    assert result["h2s_count_after"] == 1, result
    assert any("succeed again" in line for line in result["log_lines"]), result["log_lines"]
