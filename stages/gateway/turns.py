"""One model turn per request: the prompt ids (extending the episode's record or starting a new
segment), the host's generation, the text and tool calls made from it, and the record appended.

Token-in token-out: inside an episode the prompt is never re-tokenized. When a request extends the
current segment's transcript (`transcript.py`), the prompt is the segment's recorded ids plus only
the added messages rendered alone (`ChatRenderer.reply_ids`); otherwise the whole conversation is
rendered (`prompt_ids`) into a new segment, counted in `stats["segments"]`. The record changes only
after the host answered, so a failed request leaves it as it was and the agent may resend.

A stop string ends the completion at the first token whose text completes it: the record keeps the
engine's tokens up to that one; the client gets the text before the stop string. Tool calls are
parsed from the text in the Hermes format (`stages.environments.tool_calls`); a turn with a call that
does not parse (or names a tool the request did not declare) comes back as plain content, the
model's whole text, with no `tool_calls`. `n > 1` is served outside episodes only (an episode is
one conversation; a GRPO group is several episodes).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from stages.data.model import prompt_token_ids, stop_token_ids
from stages.engines.base import Completion, SamplingParams
from stages.environments.base import Tool
from stages.environments.tokens import EpisodeTokens
from stages.gateway.episodes import Episode, EpisodeBook, Limits, Segment
from stages.gateway.errors import ApiError
from stages.gateway.schema import ChatRequest, CompletionRequest, FunctionCall, Message, Sampling, ToolCallIn
from stages.gateway.transcript import ChatTranscript, TextTranscript, as_dict, tool_key

ROLES = {"system", "developer", "user", "assistant", "tool"}  # "developer" is rendered as "system"


@dataclass
class Choice:
    """One generated answer: the engine's completion (cut at a stop string), its text, and for chat
    the assistant message returned (content and tool calls)."""

    completion: Completion
    text: str
    finish_reason: str  # OpenAI's: "stop" | "length" | "tool_calls"
    after_stop: bool
    message: Message | None = None
    prompt_tokens: int = 0


def _cut(completion: Completion, k: int) -> Completion:
    """`completion`'s first k tokens (cut at a stop string), with their logprobs, versions and routed experts."""
    experts = completion.routed_experts
    return Completion(completion.tokens[:k], completion.logprobs[:k], completion.versions[:k], "stop",
                      dict(completion.meta), None if experts is None else experts[:k])


class TurnServer:
    def __init__(self, host, tokenizer, renderer, parse_tool_calls, limits: Limits, book: EpisodeBook,
                 stats: Counter) -> None:
        self.host, self.tokenizer, self.renderer, self.limits = host, tokenizer, renderer, limits
        self.parse_tool_calls, self.book, self.stats = parse_tool_calls, book, stats
        self.stop_ids = stop_token_ids(tokenizer)

    def _params(self, request: Sampling, max_tokens: int) -> SamplingParams:
        temperature = 1.0 if request.temperature is None else request.temperature
        top_p = 1.0 if request.top_p is None else request.top_p
        if not 0.0 <= temperature <= 2.0 or not 0.0 < top_p <= 1.0:
            raise ApiError(400, "temperature must be in [0, 2] and top_p in (0, 1]", "invalid_value")
        return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              stop_token_ids=self.stop_ids)

    def _max_tokens(self, requested: int | None, episode: Episode | None, added: int) -> int:
        if requested is not None and not 1 <= requested <= self.limits.max_tokens:
            raise ApiError(400, f"max_tokens must be in 1..{self.limits.max_tokens}, got {requested}", "invalid_value")
        wanted = requested or self.limits.max_tokens
        if episode is None:
            return wanted
        left = self.limits.max_episode_tokens - episode.token_count() - added
        if left <= 0:
            raise ApiError(400, f"episode {episode.id} reached its token limit ({self.limits.max_episode_tokens})",
                           "episode_token_limit")
        return min(wanted, left)

    def _decode(self, completion: Completion, stops: list[str]) -> tuple[Completion, str, bool]:
        """The completion cut at the first stop string, its text, and whether a stop string cut it."""
        text = self.tokenizer.decode(completion.tokens.tolist(), skip_special_tokens=True)
        hits = [(text.find(s), s) for s in stops if s and s in text]
        if not hits:
            return completion, text, False
        at, stop = min(hits)
        low, high = 1, len(completion.tokens)  # the shortest prefix whose text holds the stop string
        while low < high:
            mid = (low + high) // 2
            if stop in self.tokenizer.decode(completion.tokens[:mid].tolist(), skip_special_tokens=True):
                high = mid
            else:
                low = mid + 1
        return _cut(completion, low), text[:at], True

    def _choice(self, completion: Completion, stops: list[str], tools: tuple[Tool, ...] | None,
                prompt_tokens: int) -> Choice:
        completion, text, cut = self._decode(completion, stops)
        stopped = cut or completion.finish_reason == "stop"
        after_stop = self.renderer.ended_on_stop(completion.tokens)
        reason = "stop" if stopped else "length"
        if tools is None:
            return Choice(completion, text, reason, after_stop, None, prompt_tokens)
        content, calls, malformed = self.parse_tool_calls(text, tools)
        if malformed or not calls:
            content, calls = text, ()
        tool_calls = [ToolCallIn(FunctionCall(c.name, json.dumps(c.arguments)), id=f"call_{uuid.uuid4().hex[:24]}")
                      for c in calls]
        message = Message("assistant", content or (None if tool_calls else ""), tool_calls=tool_calls or None)
        reason = "tool_calls" if calls and stopped else reason
        return Choice(completion, text, reason, after_stop, message, prompt_tokens)

    def _render(self, render, *args) -> list[int]:
        """The renderer's ids; a conversation the chat template refuses is the client's error (400)."""
        try:
            return render(*args)
        except (ValueError, TemplateError) as exc:
            raise ApiError(400, f"the chat template cannot render these messages: {exc}", "invalid_value") from None

    async def chat(self, episode: Episode | None, request: ChatRequest) -> list[Choice]:
        if request.top_logprobs:
            raise ApiError(400, "top_logprobs > 0 is not supported: the engines report the sampled token's "
                                "logprob only", "unsupported_value")
        stops = _stops(request.stop)
        unknown = {m.role for m in request.messages} - ROLES
        if unknown:
            raise ApiError(400, f"unknown message role(s) {sorted(unknown)}; use {sorted(ROLES)}", "invalid_value")
        tools = tuple(Tool(t.function.name, t.function.description, t.function.parameters)
                      for t in request.tools or ())
        requested = request.max_completion_tokens or request.max_tokens
        if episode is None:
            prompt = self._render(self.renderer.prompt_ids, [as_dict(m) for m in request.messages], tools)
            params = self._params(request, self._max_tokens(requested, None, 0))
            completions = await self._generate_n(prompt, params, request.n)
            return [self._choice(c, stops, tools, len(prompt)) for c in completions]
        key = tool_key(request.tools)

        def prompt_of(segment: Segment | None):
            transcript = segment.transcript if segment is not None else None
            added = transcript.added(request.messages, key) if isinstance(transcript, ChatTranscript) else None
            if added is None:
                return None, self._render(self.renderer.prompt_ids, [as_dict(m) for m in request.messages], tools)
            return segment, self._render(self.renderer.reply_ids, [as_dict(m) for m in added], segment.after_stop)

        def record(choice: Choice) -> TextTranscript | ChatTranscript:
            transcript = ChatTranscript(key)
            transcript.record(request.messages, choice.message)
            return transcript

        choice = await self._in_episode(episode, request, requested, prompt_of, stops, tools, record)
        return [choice]

    async def complete(self, episode: Episode | None, request: CompletionRequest) -> list[Choice]:
        if request.echo:
            raise ApiError(400, "echo is not supported", "unsupported_value")
        stops = _stops(request.stop)
        prompts = _prompts(request.prompt)
        if episode is None:
            params = self._params(request, self._max_tokens(request.max_tokens, None, 0))
            ids = [self._text_ids(p) for p in prompts]
            batches = await asyncio.gather(*(self._generate_n(p, params, request.n) for p in ids))
            return [self._choice(c, stops, None, len(p)) for p, batch in zip(ids, batches, strict=True) for c in batch]
        if len(prompts) != 1:
            raise ApiError(400, "inside an episode the prompt is one string or one list of token ids", "invalid_value")
        prompt = prompts[0]

        def prompt_of(segment: Segment | None):
            transcript = segment.transcript if segment is not None else None
            added = transcript.added(prompt) if isinstance(transcript, TextTranscript) else None
            if added is None:
                return None, self._text_ids(prompt)
            ids = list(added) if isinstance(added, list) else self.tokenizer.encode(added, add_special_tokens=False)
            return segment, ids

        def record(choice: Choice) -> TextTranscript:
            if isinstance(prompt, str):
                return TextTranscript(prompt + choice.text)
            return TextTranscript(list(prompt) + choice.completion.tokens.tolist())

        return [await self._in_episode(episode, request, request.max_tokens, prompt_of, stops, None, record)]

    def _text_ids(self, prompt: str | list[int]) -> list[int]:
        ids = prompt_token_ids(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", "invalid_value")
        if not all(0 <= i < len(self.tokenizer) for i in ids):
            raise ApiError(400, f"prompt token ids must be in 0..{len(self.tokenizer) - 1}", "invalid_value")
        return ids

    async def _generate_n(self, prompt: list[int], params: SamplingParams, n: int) -> list[Completion]:
        if not 1 <= n <= self.limits.max_n:
            raise ApiError(400, f"n must be in 1..{self.limits.max_n}", "invalid_value")
        return list(await asyncio.gather(*(self.host.generate(None, prompt, params) for _ in range(n))))

    async def _in_episode(self, episode, request, requested, prompt_of, stops, tools, record) -> Choice:
        """Serve one turn of `episode` under its lock and append it to the record (see the module doc)."""
        if request.n != 1:
            raise ApiError(400, "n must be 1 inside an episode (an episode is one conversation); open one "
                                "episode per sample of a group instead", "invalid_value")
        if self.book.expired(episode, time.monotonic()) == "episode time limit":
            await self.book.finish(episode, None, "episode time limit")
        episode.busy += 1
        try:
            async with episode.lock:
                if episode.ended is not None:
                    raise ApiError(409, f"episode {episode.id} has ended ({episode.ended})", "episode_ended")
                segment, ids = prompt_of(episode.current)
                params = self._params(request, self._max_tokens(requested, episode, len(ids)))
                prompt = segment.tokens.ids() + ids if segment is not None else ids
                completion = await self.host.generate(episode.id, prompt, params)
                choice = self._choice(completion, stops, tools, len(prompt))
                if segment is None:
                    self.stats["segments"] += bool(episode.segments)
                    segment = Segment(EpisodeTokens(ids), record(choice))
                    episode.segments.append(segment)
                else:
                    segment.tokens.add_env(ids)
                    segment.transcript = record(choice)
                segment.tokens.add_model(choice.completion)
                segment.after_stop = choice.after_stop
                return choice
        finally:
            episode.busy -= 1
            episode.active_at = time.monotonic()


def _prompts(prompt: str | list) -> list[str | list[int]]:
    """A completion request's prompts: one text, texts, one list of ids or lists of ids (not mixed)."""
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                   "invalid_value")


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > 4:
        raise ApiError(400, "at most 4 stop strings", "invalid_value")
    return stops
