"""Where daemon and engines meet by default: both sides must agree, so it lives in the contract."""

from __future__ import annotations

import os
from typing import Mapping


def default_socket_path(env: Mapping[str, str] = os.environ) -> str:
    """$KVCACHED_SOCKET, else $XDG_RUNTIME_DIR/kvcached/kvcached.sock, else /tmp/kvcached-<uid>/kvcached.sock."""
    if env.get("KVCACHED_SOCKET"):
        return env["KVCACHED_SOCKET"]
    runtime_dir = env.get("XDG_RUNTIME_DIR")
    if runtime_dir and os.path.isdir(runtime_dir):
        return os.path.join(runtime_dir, "kvcached", "kvcached.sock")
    return os.path.join("/tmp", f"kvcached-{os.getuid()}", "kvcached.sock")
