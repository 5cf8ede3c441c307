"""`ScoringServer`: where a scorer's HTTP requests go, with a concurrency cap, timeouts, retries and restarts.

The server is either launched by baton from a model folder (an `SGLangServer` on 127.0.0.1, as the
SGLang engines are: `stages.engines.sglang_server`), or given by `url`, with a bearer token read from
`token_file` (never from the config itself).

Guarantees of `post`:
- at most `concurrency` requests of this scorer are in flight at once (an asyncio semaphore);
- each attempt is bounded by `timeout_s` (past it: `ScorerError("timeout")`, not retried: a scorer too
  slow once is too slow again);
- transport errors (refused, reset, disconnected) are retried `retries` times with a short backoff
  (tenacity); when the server baton launched is dead, it is restarted first (at most `max_restarts`
  times over the run; each restart is counted in `stats["restarts"]` and reported as the run event
  `scorer.restarted`); the restart's own wait does not count against the request's timeout;
- an answer other than 200 is `ScorerError("HTTP <status>")`.
A request never raises anything but `ScorerError` (or cancellation).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from pipeline.events import report_event
from stages.engines.sglang_server import ServerFailed, SGLangServer
from stages.scorers.base import ScorerError

TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError, ConnectionError)


class _ServerDown(Exception):
    """The server baton launched is dead: restart it, then try the request again."""


@dataclass(frozen=True)
class ServerSettings:
    """Where a scorer's requests go and how they are bounded: the settings every server-backed scorer (the
    classifier, the judge, the SGLang teacher) shares, as `[reward.classifier]`, `[reward.judge]` and
    `[distill]` give them. `model`: the folder a launched server loads (unused with `url`); `token_file`:
    the file holding a given server's bearer token; `python`, `dtype`, `device`: a launched server's."""

    model: str | Path | None = None
    url: str | None = None
    token_file: str | None = None
    concurrency: int = 8
    timeout_s: float = 30.0
    retries: int = 2
    max_restarts: int = 3
    python: str | None = None
    dtype: str = "float32"
    device: str = "auto"


@dataclass
class ScoringServer:
    """One scorer's server (see the module docstring): `name` is its scorer's, restarts are counted into its
    scorer's `stats`, and `extra_args` go to a launched server verbatim."""

    name: str
    settings: ServerSettings
    stats: dict = field(default_factory=dict)
    threads: int = 1
    max_total_tokens: int = 16384
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.stats.setdefault("restarts", 0)
        settings = self.settings
        if settings.url is None and settings.model is None:
            raise ValueError(f"scorer {self.name}: give a model folder to launch a server from, or a url")
        if settings.concurrency < 1:
            raise ValueError(f"scorer {self.name}: concurrency must be >= 1, got {settings.concurrency}")
        if settings.timeout_s <= 0:
            raise ValueError(f"scorer {self.name}: timeout_s must be > 0, got {settings.timeout_s}")
        if settings.token_file is not None and not Path(settings.token_file).is_file():
            raise ValueError(f"scorer {self.name}: token_file {settings.token_file!r} does not exist; write the "
                             "server's API token there (one line)")
        self._reset()

    def _reset(self) -> None:
        self._server: SGLangServer | None = None
        self._http: aiohttp.ClientSession | None = None
        self._limit: anyio.Semaphore | None = None
        self._restart_lock: anyio.Lock | None = None
        self._start_lock: anyio.Lock | None = None
        self._users = 0
        self.log_dir: Path | None = None
        self.base_url: str | None = self.settings.url.rstrip("/") if self.settings.url else None

    def __getstate__(self) -> dict:
        """Only an unstarted server moves to another process (the Ray runtime builds the producer there)."""
        if self._http is not None:
            raise RuntimeError(f"scorer {self.name} is started; only an unstarted scorer can move to another process")
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    @property
    def server(self) -> SGLangServer | None:
        """The server baton launched (None when given by url, or before start)."""
        return self._server

    async def start(self, log_dir: Path | None = None) -> None:
        """Launch the server (unless given by url) and open the HTTP session. Counted: the workers of one
        process share a scorer; the first start launches, the last stop ends it."""
        self._users += 1
        if self._start_lock is None:
            self._start_lock = anyio.Lock()
        async with self._start_lock:  # workers start together: one launches, the others wait for it
            if self._http is None:
                await self._launch(log_dir)

    async def _launch(self, log_dir: Path | None) -> None:
        self.log_dir = log_dir
        settings = self.settings
        self._limit, self._restart_lock = anyio.Semaphore(settings.concurrency), anyio.Lock()
        if settings.url is None:
            folder = Path(log_dir) if log_dir else Path(tempfile.gettempdir())
            self._server = SGLangServer(
                settings.model, python=settings.python, dtype=settings.dtype, device=settings.device,
                threads=self.threads, max_total_tokens=self.max_total_tokens, extra_args=self.extra_args,
                log_path=folder / f"scorer-{self.name}-{os.getpid()}.log",
            )
            try:
                await self._server.start()
            except ServerFailed as exc:
                self._server = None
                raise ScorerError("server failed", str(exc)) from None
            self.base_url = self._server.url
        headers = {"Authorization": f"Bearer {self._token()}"} if self.settings.token_file else {}
        self._http = aiohttp.ClientSession(headers=headers)

    def _token(self) -> str:
        return Path(self.settings.token_file).read_text().strip()

    async def stop(self) -> None:
        self._users = max(self._users - 1, 0)
        if self._users:
            return
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._server is not None:
            await anyio.to_thread.run_sync(self._server.stop)
            self._server = None

    async def post(self, path: str, body: dict) -> Any:
        """POST `body` as JSON to `path`; the decoded JSON answer (see the module docstring)."""
        if self._http is None or self._limit is None:
            raise ScorerError("not started", f"scorer {self.name} is not started")
        async with self._limit:
            while True:
                try:
                    return await self._retried(path, body)
                except _ServerDown:
                    await self._restart()  # ScorerError past max_restarts; a restart costs no retry

    async def _retried(self, path: str, body: dict) -> Any:
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(TRANSPORT_ERRORS), stop=stop_after_attempt(self.settings.retries + 1),
                wait=wait_exponential(multiplier=0.05, max=1), reraise=True,
            ):
                with attempt:
                    return await self._attempt(path, body)
        except TRANSPORT_ERRORS as exc:
            raise ScorerError("server unreachable", f"{type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable")

    async def _attempt(self, path: str, body: dict) -> Any:
        assert self._http is not None
        if self._server is not None and not self._server.alive():
            raise _ServerDown()
        try:
            with anyio.fail_after(self.settings.timeout_s):
                async with self._http.post(self.base_url + path, json=body) as response:
                    status, text = response.status, await response.text()
        except TimeoutError:
            raise ScorerError("timeout", f"{path} took over {self.settings.timeout_s:g} s") from None
        except TRANSPORT_ERRORS:
            if self._server is not None and not self._server.alive():
                raise _ServerDown() from None
            raise
        if status != 200:
            raise ScorerError(f"HTTP {status}", text[:300])
        try:
            return json.loads(text)
        except ValueError:
            raise ScorerError("not JSON", text[:300]) from None

    async def _restart(self) -> None:
        """Bring the launched server back (one caller restarts; the others wait for it)."""
        assert self._restart_lock is not None and self._server is not None
        async with self._restart_lock:
            if self._server.alive():
                return  # another request restarted it meanwhile
            if self.stats["restarts"] >= self.settings.max_restarts:
                raise ScorerError("server down", f"scorer {self.name}: its server died again after "
                                  f"{self.settings.max_restarts} restarts")
            self.stats["restarts"] += 1
            report_event(self.log_dir, "scorer.restarted", scorer=self.name, restart=self.stats["restarts"])
            t0 = time.perf_counter()
            await anyio.to_thread.run_sync(self._server.stop)
            try:
                await self._server.start()
            except ServerFailed as exc:
                raise ScorerError("server down", f"scorer {self.name}: restart failed: {exc}") from None
            self.base_url = self._server.url
            self.stats["restart_s"] = round(time.perf_counter() - t0, 2)


class Served:
    """A scorer on its `ScoringServer` (`server`), started and stopped with it."""

    server: ScoringServer

    async def start(self, log_dir: Path | None = None) -> None:
        await self.server.start(log_dir)

    async def stop(self) -> None:
        await self.server.stop()
