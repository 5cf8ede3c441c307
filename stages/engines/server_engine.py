"""What an engine that drives an HTTP server (SGLang's, vLLM's) shares: its version, its load, the server it
launched, moving to another process only while unstarted, and being preempted (`Preemptible`).

`preempt()` ends every request in flight with the tokens its server generated so far: each call in flight sends
its requests' ids to the server's abort route as soon as the engine is preempted (again every `ABORT_AGAIN_S`
until its answer is back: an abort that reached the server before the request did aborts nothing), and both
servers answer an aborted request with the tokens, logprobs and weight-version spans it had (SGLang 0.5.23's
`/generate` after `/abort_request`, vLLM 0.32.0's `/inference/v1/generate` after `/abort_requests`, measured);
the engine returns them with `finish_reason` "preempted". A request it can no longer ask (its server died as
it was preempted, or one the policy had aborted) comes back preempted with no tokens (it goes on from its
prompt elsewhere). Calls after `preempt` raise `EnginePreempted`. `preempt` runs on the engine's event loop.

A subclass keeps `_version` (the version its server holds), `_inflight` (its requests in flight), `_server` (the
server process it launched, None when attached by url) and `_http` (its client, None until started), and
rebuilds its private state in `__post_init__` (a dataclass's): a moved engine is its public fields alone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from stages.engines.base import EngineError, EnginePreempted

# The servers' HTTP layer (uvicorn) closes a connection idle for 5 s; a client that takes such a connection
# from its pool sees it dropped, which reads like a dead server. The clients keep idle connections for less.
IDLE_CONNECTION_S = 2.0
ABORT_AGAIN_S = 0.2  # a preempted call's abort is sent again this often until its answer is back


class ServerEngine:
    """The shared part of the server engines (see the module docstring)."""

    _version: int
    _inflight: dict
    _server: Any
    _http: Any
    name: str
    _preempted = False  # `preempt` was called: requests in flight end with their tokens, no new ones
    _preempting: anyio.Event | None = None  # set by `preempt`: the calls in flight abort their requests

    def preempt(self) -> None:
        """Every request in flight ends now with the tokens its server generated (`finish_reason` "preempted");
        later calls raise EnginePreempted (see the module docstring)."""
        self._preempted = True
        if self._preempting is not None:
            self._preempting.set()

    def _refuse_if_preempted(self) -> None:
        if self._preempted:
            raise EnginePreempted(f"engine {self.name} was preempted: it takes no request")

    async def _preemptible(self, call: Awaitable[Any], abort: Callable[[], Awaitable[Any]]) -> Any:
        """`call`'s answer; should the engine be preempted meanwhile, `abort` (its requests on the server) runs
        then and again every ABORT_AGAIN_S until the answer (an aborted request's tokens so far) is back."""
        if self._preempting is None:
            self._preempting = anyio.Event()
            if self._preempted:
                self._preempting.set()
        preempting, outcome = self._preempting, {}

        async def abort_once_preempted() -> None:
            await preempting.wait()
            while True:
                try:
                    await abort()
                except EngineError:  # the answer may be on its way; the call itself says what happened
                    pass
                await anyio.sleep(ABORT_AGAIN_S)

        async with anyio.create_task_group() as tg:
            tg.start_soon(abort_once_preempted)
            try:
                outcome["answer"] = await call
            except Exception as exc:  # raised as itself below, not in a group
                outcome["error"] = exc
            tg.cancel_scope.cancel()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["answer"]

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
