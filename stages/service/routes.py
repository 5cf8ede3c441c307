"""The HTTP surface the `tinker` SDK talks to, under `/api/v1/`, on aiohttp. Every request but `healthz` carries
the service's key in `X-API-Key` (the SDK's header; keys are `tml-...`, the shape the SDK requires), compared in
constant time. A `Refused` is a 400 whose body names what is refused; an endpoint the service does not serve is a
404 naming it; both reach the SDK's caller as its own errors (`BadRequestError`, `NotFoundError`).

`client/config` tells the SDK how to talk here: httpx's own transport (`use_pyqwest_transport` false: the SDK's
Rust client is an optimisation for its hosted service, and the SDK fetches this config over httpx anyway),
forward_backward chunks sent one after another and uncompressed, each sample's result polled by its own id.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from stages.service.futures import Failure, UnknownFuture
from stages.service.listing import checkpoints_of
from stages.service.losses import SUPPORTED, TINKER_LOSSES
from stages.service.refusals import Refused
from stages.service.service import Service
from stages.service.wire import PROTO

API = "/api/v1"
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: dict[str, Any], status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


def key_middleware(key: str):
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != f"{API}/healthz":
            given = request.headers.get("X-API-Key", "")
            if not hmac.compare_digest(given.encode(), key.encode()):
                return _json({"detail": "missing or wrong X-API-Key: use the key `baton serve` printed"}, 401)
        try:
            return await handler(request)
        except Refused as exc:
            return _json({"detail": str(exc)}, 400)
    return check


class Routes:
    """The endpoints (see the module docstring), each a thin step from HTTP to `Service`."""

    def __init__(self, service: Service) -> None:
        self.s = service

    async def healthz(self, _: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def capabilities(self, _: web.Request) -> web.Response:
        refused = [name for name in TINKER_LOSSES if name not in SUPPORTED]
        return _json({"supported_models": [{"model_name": self.s.name, "trainable": True, "sampleable": True}],
                      "baton": {"losses": list(SUPPORTED), "refused_losses": refused, "training": ["lora", "full"],
                                "optimizer": "adamw",
                                "sampling": f"{self.s.sampling.engine} engine, token-id and string stops",
                                "world_size": 1 if self.s.ranks is None else self.s.ranks.world_size}})

    async def client_config(self, _: web.Request) -> web.Response:
        return _json(CLIENT_CONFIG)

    async def accepted(self, request: web.Request) -> web.Response:
        """Telemetry, dynamic config and a session's finish: acknowledged, nothing kept."""
        kind = request.path.rsplit("/", 1)[-1]
        return _json({"status": "accepted"} if kind == "telemetry" else {})

    async def create_session(self, _: web.Request) -> web.Response:
        return _json({"type": "create_session", "session_id": self.s.create_session()})

    async def heartbeat(self, request: web.Request) -> web.Response:
        self.s.sessions.heartbeat((await request.json()).get("session_id", ""))
        return _json({"type": "session_heartbeat"})

    async def create_model(self, request: web.Request) -> web.Response:
        return _json({"request_id": self.s.create_model(await request.json())})

    async def get_info(self, request: web.Request) -> web.Response:
        return _json(await self.s.info((await request.json()).get("model_id", "")))

    async def forward_backward(self, request: web.Request) -> web.Response:
        if request.headers.get("Content-Encoding"):
            raise Refused(f"Content-Encoding {request.headers['Content-Encoding']!r} is not supported")
        return _json({"request_id": self.s.forward_backward(await request.read())})

    async def optim_step(self, request: web.Request) -> web.Response:
        return _json({"request_id": self.s.optim_step(await request.json())})

    async def save_for_sampler(self, request: web.Request) -> web.Response:
        return _json({"request_id": self.s.save_for_sampler(await request.json())})

    async def save_weights(self, request: web.Request) -> web.Response:
        return _json({"request_id": self.s.save_state(await request.json())})

    async def load_weights(self, request: web.Request) -> web.Response:
        return _json({"request_id": self.s.load_state(await request.json())})

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        session = self.s.create_sampling_session(await request.json())
        return _json({"type": "create_sampling_session", "sampling_session_id": session})

    async def sampler(self, request: web.Request) -> web.Response:
        return _json(self.s.sampler(request.match_info["sampler_id"]))

    async def asample(self, request: web.Request) -> web.Response:
        request_id, sequence_ids = self.s.sample(await request.json())
        return _json({"request_id": request_id, "sample_sequence_ids": sequence_ids})

    async def retrieve_future(self, request: web.Request) -> web.Response:
        request_id = (await request.json()).get("request_id", "")
        try:
            result = await self.s.futures.result(request_id)
        except UnknownFuture:  # 410: the SDK's sampling client sends the sample again; a training call raises
            return _json({"detail": f"unknown request_id {request_id!r}: its result is gone (forgotten an hour "
                                    "after it finished, or a sample lost in a restart)"}, 410)
        if result is None:
            return _json({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if isinstance(result, Failure):
            return _json({"error": result.error, "category": result.category})
        if isinstance(result, bytes):
            return web.Response(body=result, content_type=PROTO)
        return _json(result)

    async def checkpoints(self, request: web.Request) -> web.Response:
        """The SDK's `RestClient.list_checkpoints(model_id)`: the model's training and sampler checkpoints."""
        model_id = request.match_info["model_id"]
        if model_id not in self.s.order:
            return _json({"detail": f"unknown model_id {model_id!r}"}, 404)
        return _json(checkpoints_of(model_id, self.s.checkpoints, self.s.samplers.saved, self.s.samplers.when))

    async def unsupported(self, request: web.Request) -> web.Response:
        return _json({"detail": f"{request.method} {request.path} is not supported by baton serve"}, 404)


def make_app(service: Service, key: str) -> web.Application:
    """The service's aiohttp application, every route under `/api/v1/` behind `key`."""
    r = Routes(service)
    app = web.Application(middlewares=[key_middleware(key)], client_max_size=256 * 1024 * 1024)
    app.add_routes([
        web.get(f"{API}/healthz", r.healthz), web.get(f"{API}/get_server_capabilities", r.capabilities),
        web.post(f"{API}/client/config", r.client_config), web.post(f"{API}/client/dynamic_config", r.accepted),
        web.post(f"{API}/telemetry", r.accepted), web.post(f"{API}/sessions/{{session_id}}/finish", r.accepted),
        web.post(f"{API}/create_session", r.create_session), web.post(f"{API}/session_heartbeat", r.heartbeat),
        web.post(f"{API}/create_model", r.create_model), web.post(f"{API}/get_info", r.get_info),
        web.post(f"{API}/forward_backward", r.forward_backward), web.post(f"{API}/optim_step", r.optim_step),
        web.post(f"{API}/save_weights_for_sampler", r.save_for_sampler),
        web.post(f"{API}/save_weights", r.save_weights), web.post(f"{API}/load_weights", r.load_weights),
        web.post(f"{API}/create_sampling_session", r.create_sampling_session),
        web.get(f"{API}/samplers/{{sampler_id}}", r.sampler), web.post(f"{API}/asample", r.asample),
        web.post(f"{API}/retrieve_future", r.retrieve_future),
        web.get(f"{API}/training_runs/{{model_id}}/checkpoints", r.checkpoints),
        web.route("*", f"{API}/{{tail:.*}}", r.unsupported),
    ])
    app.on_cleanup.append(lambda _: service.close())
    return app
