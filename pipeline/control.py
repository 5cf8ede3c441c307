"""The run's control endpoint: a small HTTP server on loopback that scales a running run's fleet.

    GET  /v1/fleet                          -> the fleet's status (`Fleet.status`)
    POST /v1/fleet {"workers": N, "wait": false, "preempt": false}   scale to N workers (wait: until joins and
                                            leaves settle; preempt: leavers' work in flight goes on elsewhere now)

An elastic run (`pipeline.fleet`) serves it on 127.0.0.1 (a free port) while it runs, like the gateway:
every request needs `Authorization: Bearer <token>` (401 otherwise), the token lives in the run folder's
`control.token` (0600, a new one per attempt) and the address in `control.json`; both are removed when
the run stops, so a client that finds none knows the run is not running. Errors are JSON `{"error":
...}`: 400 a malformed body, 401 no or a wrong token, 409 a target outside the run's limits.
`scale_run(run_dir, workers)` is the client (`baton scale`); it reads those two files.
"""

from __future__ import annotations

import hmac
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from pipeline.fleet import Fleet, FleetError
from pipeline.net import make_token_file

CONTROL_FILE, TOKEN_FILE = "control.json", "control.token"


class ControlError(RuntimeError):
    """The control endpoint could not be reached or refused the request; the message says why."""


class ScaleBody(msgspec.Struct, forbid_unknown_fields=True):
    workers: int
    wait: bool = False
    preempt: bool = False


class ControlServer:
    """The endpoint as an actor of the run: it serves from `start` to `stop` (see the module docstring)."""

    name = "control"

    def __init__(self, fleet: Fleet, folder: Path, bind: str = "127.0.0.1") -> None:
        self.fleet, self.folder, self.bind = fleet, Path(folder), bind
        self.url = ""
        self._token = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self._token = make_token_file(self.folder / TOKEN_FILE)
        app = web.Application(middlewares=[self._auth], client_max_size=1 << 16)
        app.router.add_get("/v1/fleet", self._status)
        app.router.add_post("/v1/fleet", self._scale)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.bind, 0).start()
        self.url = f"http://{self.bind}:{self._runner.addresses[0][1]}"
        (self.folder / CONTROL_FILE).write_text(json.dumps({"url": self.url}) + "\n")

    async def run(self) -> None:
        return None  # it serves from start to stop; nothing to wait for

    async def stop(self) -> None:
        (self.folder / CONTROL_FILE).unlink(missing_ok=True)
        (self.folder / TOKEN_FILE).unlink(missing_ok=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode()):
            return _error(401, f"a valid bearer token is required (Authorization: Bearer <{TOKEN_FILE}>)")
        return await handler(request)

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.fleet.status())

    async def _scale(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=ScaleBody)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return _error(400, f"malformed body: {exc}; send {{\"workers\": N}}")
        try:
            return web.json_response(await self.fleet.scale(body.workers, wait=body.wait, preempt=body.preempt))
        except FleetError as exc:
            return _error(409, str(exc))


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def control_request(run_dir: Path | str, body: dict[str, Any] | None = None, timeout_s: float = 600.0) -> dict:
    """GET (no body) or POST `body` to the run's `/v1/fleet`; the decoded reply, or ControlError."""
    run_dir = Path(run_dir)
    try:
        url = json.loads((run_dir / CONTROL_FILE).read_text())["url"]
        token = (run_dir / TOKEN_FILE).read_text().strip()
    except (OSError, ValueError, KeyError):
        raise ControlError(f"{run_dir} serves no control endpoint: the run is not running, or it was started "
                           "without room to grow (set [rollout] max_engines, or Pipeline(max_workers=N))") from None
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/v1/fleet", data=data, method="GET" if body is None else "POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        raise ControlError(json.loads(exc.read() or b"{}").get("error", f"HTTP {exc.code}")) from None
    except (urllib.error.URLError, OSError) as exc:
        raise ControlError(f"the control endpoint of {run_dir} did not answer ({exc}); is the run still running?") \
            from None


def scale_run(run_dir: Path | str, workers: int, wait_s: float = 0.0, preempt: bool = False) -> dict[str, Any]:
    """Ask the running run in `run_dir` for `workers` workers (`preempt`: see `Fleet.scale`); with `wait_s`, wait
    up to that long for the joins and leaves to settle (ControlError past it). Returns the fleet's status."""
    status = control_request(run_dir, {"workers": workers, "preempt": preempt})
    deadline = time.monotonic() + wait_s
    while wait_s and (status["joining"] or status["leaving"]):
        if time.monotonic() > deadline:
            raise ControlError(f"the fleet had not settled after {wait_s} s: {status}")
        time.sleep(0.2)
        status = control_request(run_dir)
    return status


__all__ = ["CONTROL_FILE", "TOKEN_FILE", "ControlError", "ControlServer", "control_request", "scale_run"]
