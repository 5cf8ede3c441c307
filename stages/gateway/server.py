"""The gateway's HTTP server: the OpenAI API in front of a `Host`, per episode or outside episodes.

    POST /v1/episodes[?wait=false]            open an episode -> {id, base_url, sample, group}
    POST /v1/episodes/{id}/reward {reward}    finish it with its reward
    POST /v1/episodes/{id}/close              end it (dropped unless its reward came first)
    GET  /v1/models, POST /v1/chat/completions, POST /v1/completions     outside any episode
    the same under /episodes/{id}/v1/...      every request belongs to episode {id}

An agent that is a function rather than a process runs one episode per `Gateway.run_agent(agent)`
call: opened like `POST /v1/episodes`, finished with the reward the function returns.

Every request needs `Authorization: Bearer <token>` (401). Errors are OpenAI-shaped (`errors.py`):
400 malformed body or a bound exceeded, 404 unknown episode or route, 409 ended episode, 413 body
over `limits.max_body_bytes`, 429 over budget with `Retry-After`, 503 the engines failed, 500 for
anything unexpected (logged here, never sent). The server binds 127.0.0.1 unless told otherwise.

Streaming (`"stream": true`) answers server-sent events in OpenAI's chunk format ending with
`data: [DONE]`; the engines answer whole completions, so the content comes in one chunk after the
role chunk (tool calls in the next, then the finish reason, then usage when asked).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from stages.engines.base import ContextFull, EngineError
from stages.environments.render import ChatRenderer
from stages.environments.tool_calls import parse_tool_calls
from stages.gateway.episodes import Episode, EpisodeBook, Limits
from stages.gateway.errors import ApiError
from stages.gateway.host import Host
from stages.gateway.responses import Responses
from stages.gateway.schema import ChatRequest, CompletionRequest, RewardBody
from stages.gateway.turns import Choice, TurnServer

log = logging.getLogger(__name__)


class Gateway:
    """An OpenAI-compatible server over `host`; `start()` binds it (port 0: a free one), then
    `base_url` and `episode_url(id)` are known. `tokenizer` is the engines' (a chat template is
    required: the gateway renders conversations itself); `renderer` defaults to its ChatRenderer."""

    def __init__(self, host: Host, token: str, port: int = 0, bind: str = "127.0.0.1", limits: Limits | None = None,
                 *, tokenizer, renderer=None, model: str = "baton") -> None:
        if not token:
            raise ValueError("the gateway needs a bearer token")
        self.host, self.token, self.port, self.bind = host, token, port, bind
        self.limits = limits or Limits()
        self.model = model
        self.stats: Counter[str] = Counter()
        self.book = EpisodeBook(host, self.limits, self.stats)
        self.turns = TurnServer(host, tokenizer, renderer or ChatRenderer(tokenizer), parse_tool_calls,
                                self.limits, self.book, self.stats)
        self.responses = Responses(model, tokenizer)
        self._runner: web.AppRunner | None = None
        self._watch: asyncio.Task | None = None

    @property
    def _origin(self) -> str:
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "") else f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self._origin}/v1"

    def episode_url(self, episode_id: str) -> str:
        return f"{self._origin}/episodes/{episode_id}/v1"

    async def start(self) -> None:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=self.limits.max_body_bytes)
        for prefix in ("/v1", "/episodes/{episode}/v1"):
            app.router.add_get(f"{prefix}/models", self._models)
            app.router.add_post(f"{prefix}/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/completions", self._complete)
        app.router.add_post("/v1/episodes", self._open)
        app.router.add_post("/v1/episodes/{episode}/reward", self._reward)
        app.router.add_post("/v1/episodes/{episode}/close", self._close)
        # stopping waits this long for requests in flight (an open waiting for budget never ends by itself)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=self.limits.shutdown_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.bind, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._watch = asyncio.create_task(self.book.watch())

    async def stop(self) -> None:
        """Stop serving; episodes still open are finished as dropped ("gateway stopped")."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.book.close_all("gateway stopped")

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return self._refused(exc)
        except web.HTTPException as exc:  # aiohttp's own: 404 route, 405, 413 body too large
            return self._refused(ApiError(exc.status, exc.reason or "request refused"))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return self._refused(ApiError(400, f"malformed request: {exc}", "invalid_request"))
        except ContextFull as exc:  # the request's fault: sent again it fails again
            return self._refused(ApiError(400, str(exc), "context_length_exceeded"))
        except EngineError as exc:
            return self._refused(ApiError(503, f"the engine failed: {exc}", "engine_error"))
        except Exception:
            log.exception("gateway: unexpected error serving %s %s", request.method, request.path)
            return self._refused(ApiError(500, "internal error in the gateway", "internal_error"))

    def _refused(self, error: ApiError) -> web.Response:
        self.stats[f"http {error.status}"] += 1
        return error.response()

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            raise ApiError(401, "a valid bearer token is required (Authorization: Bearer <key>)", "invalid_api_key")
        size = request.content_length
        if size is not None and size > self.limits.max_body_bytes:
            raise ApiError(413, f"request body over {self.limits.max_body_bytes} bytes", "body_too_large")
        return await handler(request)

    async def _body(self, request: web.Request, kind: type) -> Any:
        return msgspec.json.decode(await request.read(), type=kind)

    def _episode(self, request: web.Request) -> Episode | None:
        episode_id = request.match_info.get("episode")
        return None if episode_id is None else self.book.get(episode_id)

    async def _models(self, request: web.Request) -> web.Response:
        self._episode(request)
        return _json({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                   "owned_by": "baton"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        episode = self._episode(request)
        body = await self._body(request, ChatRequest)
        if not body.messages:
            raise ApiError(400, "messages must not be empty", "invalid_value")
        self.stats["requests"] += 1
        choices = await self.turns.chat(episode, body)
        prompt_tokens = _prompt_tokens(choices)
        logprobs = bool(body.logprobs)
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return await _stream(request, self.responses.chat_chunks(choices, prompt_tokens, logprobs, usage))
        return _json(self.responses.chat(choices, prompt_tokens, logprobs))

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        episode = self._episode(request)
        body = await self._body(request, CompletionRequest)
        self.stats["requests"] += 1
        choices = await self.turns.complete(episode, body)
        prompt_tokens = _prompt_tokens(choices)
        if body.stream:
            return await _stream(request, self.responses.completion_chunks(choices, prompt_tokens, body.logprobs))
        return _json(self.responses.completion(choices, prompt_tokens, body.logprobs))

    async def run_agent(self, agent: Callable[[dict, str, str], Awaitable[float | None]], wait: bool = True) -> str:
        """One episode run by an agent function `agent(sample, base_url, api_key)` (the sample as
        `POST /v1/episodes` gives it, the episode's base URL, the token); returns the episode's id.
        Its returned reward finishes the episode; when it returns None it must have posted the reward
        itself (else the episode is dropped: "agent gave no reward"); when it raises, the episode is
        dropped with the error as its reason. Raises `ApiError` (429) when `wait` is False and the
        host is over budget."""
        episode = await self.book.start(wait)
        try:
            reward = await agent(_sample(episode), self.episode_url(episode.id), self.token)
        except Exception as exc:  # the agent's failure is the episode's, never the run's
            await self.book.finish(episode, None, f"agent failed: {type(exc).__name__}: {exc}"[:300])
            return episode.id
        if reward is not None:
            await self.book.finish(episode, float(reward), None)
        elif episode.ended is None:
            await self.book.finish(episode, None, "agent gave no reward")
        return episode.id

    async def _open(self, request: web.Request) -> web.Response:
        wait = request.query.get("wait", "true").lower() not in ("false", "0", "no")
        episode = await self.book.start(wait)
        return _json({"id": episode.id, "base_url": self.episode_url(episode.id), "group": episode.group,
                      "sample": _sample(episode)})

    async def _reward(self, request: web.Request) -> web.Response:
        episode = self.book.get(request.match_info["episode"])
        body = await self._body(request, RewardBody)
        if not math.isfinite(body.reward):
            raise ApiError(400, f"reward must be a finite number, got {body.reward}", "invalid_value")
        if not await self.book.finish(episode, body.reward, None):
            raise ApiError(409, f"episode {episode.id} has ended ({episode.ended})", "episode_ended")
        return _json({"id": episode.id, "status": "rewarded"})

    async def _close(self, request: web.Request) -> web.Response:
        episode_id = request.match_info["episode"]
        if episode_id in self.book.open:  # closing an episode that has ended is a no-op
            await self.book.finish(self.book.open[episode_id], None, "closed without reward")
        elif episode_id not in self.book.ended:
            raise ApiError(404, f"no episode {episode_id!r}", "episode_not_found")
        return _json({"id": episode_id, "status": self.book.ended[episode_id]})


def _sample(episode: Episode) -> dict[str, Any]:
    sample = episode.sample
    return {"prompt": sample.text, "messages": sample.messages, "answer": sample.answer, "metadata": sample.metadata}


def _prompt_tokens(choices: list[Choice]) -> int:
    return sum(c.prompt_tokens for c in choices)


def _json(body: dict) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def _stream(request: web.Request, chunks: list[dict]) -> web.StreamResponse:
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
