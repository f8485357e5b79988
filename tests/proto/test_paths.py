"""Socket paths and the engine's trust check (proto.paths), on real Unix sockets and directories."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile

import pytest

from proto.paths import (MAX_SOCKET_PATH_BYTES, UntrustedSocket, check_socket, default_socket_path,
                         expected_daemon_uid, normalize_socket_path)

OTHER_UID = 65534          # nobody


@contextlib.contextmanager
def listening_socket(dir_mode: int = 0o700):
    """A real Unix socket (mode 0600) in a fresh directory of ours; yields its path."""
    directory = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    os.chmod(directory, dir_mode)
    path = os.path.join(directory, "kvcached.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(path)
        os.chmod(path, 0o600)
        server.listen(1)
        yield path
    finally:
        server.close()
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def test_ipc_urls_and_relative_paths_become_absolute_paths(tmp_path, monkeypatch):
    """`ipc:///x` is the file /x; a relative path is made absolute; nothing else changes."""
    monkeypatch.chdir(tmp_path)
    assert normalize_socket_path("ipc:///run/kvcached/kvcached.sock") == "/run/kvcached/kvcached.sock"
    assert normalize_socket_path("ipc://k.sock") == str(tmp_path / "k.sock")
    assert normalize_socket_path("/tmp/a/../b.sock") == "/tmp/b.sock"


@pytest.mark.parametrize("bad, why", [
    ("tcp://127.0.0.1:5555", "ipc:// sockets only"),
    ("ipc://@kvcached", "abstract sockets"),
    ("ipc://", "empty"),
])
def test_other_transports_and_abstract_sockets_are_refused(bad, why):
    """Only file sockets can be checked for their owner: other transports and abstract names are refused."""
    with pytest.raises(ValueError, match=why):
        normalize_socket_path(bad)


def test_a_path_longer_than_a_socket_address_holds_is_a_clear_error():
    """sun_path holds 107 bytes of path: 107 pass, 108 are refused with a message naming the limit."""
    longest = "/tmp/" + "a" * (MAX_SOCKET_PATH_BYTES - len("/tmp/"))
    assert normalize_socket_path(longest) == longest
    with pytest.raises(ValueError, match=f"at most {MAX_SOCKET_PATH_BYTES}"):
        normalize_socket_path(longest + "b")
    with pytest.raises(ValueError, match=f"at most {MAX_SOCKET_PATH_BYTES}"):
        check_socket("ipc://" + longest + "b")


def test_the_default_is_under_xdg_runtime_dir_when_set_else_a_private_tmp_directory(tmp_path):
    """$KVCACHED_SOCKET (an ipc:// URL too) first, then $XDG_RUNTIME_DIR/kvcached, then /tmp/kvcached-<uid>;
    a relative or missing $XDG_RUNTIME_DIR is ignored."""
    assert default_socket_path({"XDG_RUNTIME_DIR": str(tmp_path)}) == str(tmp_path / "kvcached" / "kvcached.sock")
    tmp_default = f"/tmp/kvcached-{os.geteuid()}/kvcached.sock"
    assert default_socket_path({}) == tmp_default
    assert default_socket_path({"XDG_RUNTIME_DIR": "relative/dir"}) == tmp_default
    assert default_socket_path({"XDG_RUNTIME_DIR": str(tmp_path / "missing")}) == tmp_default
    assert default_socket_path({"KVCACHED_SOCKET": "ipc:///srv/k.sock", "XDG_RUNTIME_DIR": str(tmp_path)}) \
        == "/srv/k.sock"


def test_the_expected_daemon_uid_is_ours_unless_named():
    """daemon_uid (a uid or a user name) wins over $KVCACHED_DAEMON_UID, which wins over our own uid."""
    assert expected_daemon_uid(None, {}) == os.geteuid()
    assert expected_daemon_uid(None, {"KVCACHED_DAEMON_UID": str(OTHER_UID)}) == OTHER_UID
    assert expected_daemon_uid("root", {"KVCACHED_DAEMON_UID": str(OTHER_UID)}) == 0
    with pytest.raises(ValueError, match="no user named"):
        expected_daemon_uid("no-such-user-kvcached", {})


def test_a_socket_of_ours_in_a_private_directory_is_trusted():
    """The daemon's own layout (directory 0700 or 0750, socket 0600 or 0660) passes, by path or ipc:// URL."""
    for dir_mode in (0o700, 0o750):
        with listening_socket(dir_mode) as path:
            assert check_socket(path, env={}) == path
            assert check_socket(f"ipc://{path}", env={}) == path
            os.chmod(path, 0o660)          # a shared daemon admits a group this way
            assert check_socket(path, env={}) == path


def test_a_missing_socket_is_file_not_found():
    with listening_socket() as path:
        missing = path + ".other"
        with pytest.raises(FileNotFoundError, match="no kvcached daemon socket at .*other"):
            check_socket(missing, env={})


def test_a_socket_of_another_uid_is_refused_and_accepted_once_that_uid_is_expected():
    """A socket whose directory and file belong to another uid is refused, saying whose it is; naming that
    uid (daemon_uid or $KVCACHED_DAEMON_UID) accepts it. As root the files really change owner; otherwise the
    expected uid differs from the owner, which is the same comparison."""
    with listening_socket() as path:
        if os.geteuid() == 0:
            os.chown(os.path.dirname(path), OTHER_UID, OTHER_UID)
            os.chown(path, OTHER_UID, OTHER_UID)
            owner, stranger = OTHER_UID, os.geteuid()
        else:
            owner, stranger = os.geteuid(), os.geteuid() + 1
        with pytest.raises(UntrustedSocket, match=f"directory .* belongs to uid {owner}.*not to uid {stranger}"):
            check_socket(path, daemon_uid=stranger, env={})
        assert check_socket(path, daemon_uid=owner, env={}) == path
        assert check_socket(path, env={"KVCACHED_DAEMON_UID": str(owner)}) == path
        if os.geteuid() == 0:
            with pytest.raises(UntrustedSocket, match=f"belongs to uid {OTHER_UID}"):
                check_socket(path, env={})          # by default: our own uid
            os.chown(os.path.dirname(path), 0, 0)      # directory ours, socket still theirs
            with pytest.raises(UntrustedSocket, match=f"it belongs to uid {OTHER_UID}"):
                check_socket(path, env={})


@pytest.mark.parametrize("dir_mode", [0o770, 0o777, 0o1777])
def test_a_directory_others_may_write_is_refused(dir_mode):
    """Whoever may write the directory may replace the socket: group- or world-writable is refused."""
    with listening_socket(dir_mode) as path:
        with pytest.raises(UntrustedSocket, match="writable by other users"):
            check_socket(path, env={})


def test_a_socket_every_user_may_connect_to_is_refused():
    with listening_socket() as path:
        os.chmod(path, 0o666)
        with pytest.raises(UntrustedSocket, match="every user may connect"):
            check_socket(path, env={})


def test_symlinks_and_other_files_are_not_taken_for_a_socket():
    """A symlink to a good socket, a symlinked directory, or a regular file at the path is refused."""
    with listening_socket() as path:
        directory = os.path.dirname(path)
        link = os.path.join(directory, "link.sock")
        os.symlink(path, link)
        with pytest.raises(UntrustedSocket, match="it is a symlink, not a socket"):
            check_socket(link, env={})
        plain = os.path.join(directory, "plain.sock")
        with open(plain, "wb") as f:
            f.write(b"not a socket")
        with pytest.raises(UntrustedSocket, match="it is a regular file"):
            check_socket(plain, env={})
        linked_dir = directory + "-link"
        os.symlink(directory, linked_dir)
        try:
            with pytest.raises(UntrustedSocket, match="is a symlink, not a directory"):
                check_socket(os.path.join(linked_dir, "kvcached.sock"), env={})
        finally:
            os.unlink(linked_dir)
