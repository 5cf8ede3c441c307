"""Loopback networking helpers shared by everything that starts a server."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it; another process may take it later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
