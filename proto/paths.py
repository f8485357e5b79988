"""Where daemon and engines meet, and whether a socket there may be trusted.

Both sides must agree on the default path, so it lives in the contract. A socket is trusted by
where it lives, since ZeroMQ's ``ipc://`` transport cannot ask the peer who it is: the socket and
its directory must belong to the uid the engine expects (its own by default) and be writable by
no one else. Otherwise another local user who made the directory first, or replaced the socket,
would be handed every engine's KV. The daemon makes its directory 0700; a system daemon shared by
several users may open it to a group (0750, the socket 0660), never to everyone.
"""

from __future__ import annotations

import os
import pwd
import stat
from typing import Mapping

IPC_SCHEME = "ipc://"
# sun_path is 108 bytes on Linux, the last one the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107


class UntrustedSocket(Exception):
    """A socket (or its directory) that another user could control; the message says why and what to do."""


def normalize_socket_path(path: str) -> str:
    """The absolute file path of a socket given as a path or as a ZeroMQ ``ipc://`` URL.

    Raises ValueError for another transport, an abstract socket (``ipc://@name``: no file, so no
    owner to check), or a path longer than a Unix socket address holds."""
    text = str(path)
    if text.startswith(IPC_SCHEME):
        text = text[len(IPC_SCHEME):]
    elif "://" in text:
        raise ValueError(f"kvcached listens on ipc:// sockets only, not {text.split('://', 1)[0]}:// "
                         f"(give a file path or ipc:///path)")
    if not text:
        raise ValueError("the socket path is empty")
    if text.startswith("@"):
        raise ValueError("abstract sockets (ipc://@name) have no owner to check; give a file path")
    absolute = os.path.abspath(text)
    num_bytes = len(os.fsencode(absolute))
    if num_bytes > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"socket path {absolute} is {num_bytes} bytes; a Unix socket path holds at most "
                         f"{MAX_SOCKET_PATH_BYTES}: choose a shorter one")
    return absolute


def default_socket_path(env: Mapping[str, str] = os.environ) -> str:
    """$KVCACHED_SOCKET, else $XDG_RUNTIME_DIR/kvcached/kvcached.sock, else /tmp/kvcached-<uid>/kvcached.sock."""
    if env.get("KVCACHED_SOCKET"):
        try:
            return normalize_socket_path(env["KVCACHED_SOCKET"])
        except ValueError as exc:
            raise ValueError(f"KVCACHED_SOCKET={env['KVCACHED_SOCKET']!r}: {exc}") from None
    runtime_dir = env.get("XDG_RUNTIME_DIR")
    if runtime_dir and os.path.isabs(runtime_dir) and os.path.isdir(runtime_dir):
        return normalize_socket_path(os.path.join(runtime_dir, "kvcached", "kvcached.sock"))
    return os.path.join("/tmp", f"kvcached-{os.geteuid()}", "kvcached.sock")


def parse_uid(text: str | int) -> int:
    """A uid given as a number or a user name."""
    if isinstance(text, int):
        uid = text
    elif str(text).strip().isdigit():
        uid = int(str(text).strip())
    else:
        try:
            uid = pwd.getpwnam(str(text).strip()).pw_uid
        except KeyError:
            raise ValueError(f"no user named {text!r} (give a uid or a user name)") from None
    if uid < 0:
        raise ValueError(f"a uid is >= 0, got {uid}")
    return uid


def expected_daemon_uid(daemon_uid: int | str | None = None, env: Mapping[str, str] = os.environ) -> int:
    """The uid a daemon's socket must belong to: ``daemon_uid``, else $KVCACHED_DAEMON_UID, else ours."""
    if daemon_uid is not None:
        return parse_uid(daemon_uid)
    if env.get("KVCACHED_DAEMON_UID"):
        try:
            return parse_uid(env["KVCACHED_DAEMON_UID"])
        except ValueError as exc:
            raise ValueError(f"KVCACHED_DAEMON_UID={env['KVCACHED_DAEMON_UID']!r}: {exc}") from None
    return os.geteuid()


def user_label(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def file_kind(mode: int) -> str:
    """What an lstat's mode says a path is, for messages ("a symlink", "a directory", ...)."""
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISFIFO, "a FIFO")):
        if test(mode):
            return name
    return "a special file"


def check_socket(socket_path: str | None, daemon_uid: int | str | None = None,
                 env: Mapping[str, str] = os.environ) -> str:
    """The normalised path of the daemon socket to connect to, once it is shown trustworthy.

    ``socket_path`` None: the default. The socket and its directory must be what they claim (not
    symlinks), belong to ``expected_daemon_uid(daemon_uid)``, and be writable by no other user
    (the socket may be group-writable: that is how a shared daemon admits a group). Raises
    FileNotFoundError when there is no socket, UntrustedSocket when it cannot be trusted,
    ValueError for a malformed path."""
    path = normalize_socket_path(socket_path) if socket_path else default_socket_path(env)
    uid = expected_daemon_uid(daemon_uid, env)
    directory = os.path.dirname(path)
    try:
        dir_info = os.lstat(directory)
        info = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no kvcached daemon socket at {path}") from None
    why = None
    if not stat.S_ISDIR(dir_info.st_mode):
        why = f"its directory {directory} is {file_kind(dir_info.st_mode)}, not a directory"
    elif dir_info.st_uid != uid:
        why = f"its directory {directory} belongs to {user_label(dir_info.st_uid)}, not to {user_label(uid)}"
    elif dir_info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = (f"its directory {directory} is writable by other users (mode {dir_info.st_mode & 0o7777:o}), "
               "who could replace the socket")
    elif not stat.S_ISSOCK(info.st_mode):
        why = f"it is {file_kind(info.st_mode)}, not a socket"
    elif info.st_uid != uid:
        why = f"it belongs to {user_label(info.st_uid)}, not to {user_label(uid)}"
    elif info.st_mode & stat.S_IWOTH:
        why = f"every user may connect to it (mode {info.st_mode & 0o7777:o})"
    if why is not None:
        raise UntrustedSocket(
            f"refusing the kvcached socket {path}: {why}. Another user may have taken the path over; "
            f"remove what is there and restart the daemon, or, for a daemon run by another user on purpose, "
            f"pass daemon_uid= to connect() (KVCACHED_DAEMON_UID, `kvcached status --daemon-uid`)")
    return path
