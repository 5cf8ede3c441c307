"""Loopback networking helpers shared by everything that starts a server."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it; another process may take it later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_token_file(path: str | Path) -> str:
    """A new random bearer token, written to `path` readable by its owner only (0600); returns it."""
    token = secrets.token_urlsafe(32)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    return token
