"""What an engine that drives an HTTP server (SGLang's, vLLM's) shares: its version, its load, the server it
launched, and moving to another process only while unstarted.

A subclass keeps `_version` (the version its server holds), `_inflight` (its requests in flight), `_server` (the
server process it launched, None when attached by url) and `_http` (its client, None until started), and
rebuilds its private state in `__post_init__` (a dataclass's): a moved engine is its public fields alone.
"""

from __future__ import annotations

from typing import Any

# The servers' HTTP layer (uvicorn) closes a connection idle for 5 s; a client that takes such a connection
# from its pool sees it dropped, which reads like a dead server. The clients keep idle connections for less.
IDLE_CONNECTION_S = 2.0


class ServerEngine:
    """The shared part of the server engines (see the module docstring)."""

    _version: int
    _inflight: dict
    _server: Any
    _http: Any
    name: str

    @property
    def version(self) -> int:
        return self._version

    @property
    def load(self) -> int:
        """Requests this engine has in flight on its server."""
        return len(self._inflight)

    @property
    def server(self) -> Any:
        """The server this engine launched (None when attached by url)."""
        return self._server

    def __getstate__(self) -> dict:
        """Only an unstarted engine moves to another process (the Ray runtime builds it there)."""
        if self._http is not None:
            raise RuntimeError(f"engine {self.name} is started; only an unstarted engine can move to another process")
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()  # type: ignore[attr-defined]  # the subclass's dataclass hook
