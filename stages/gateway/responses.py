"""OpenAI response bodies (chat completion, its stream chunks, text completion) from `Choice`s."""

from __future__ import annotations

import time
import uuid
from typing import Any

from stages.gateway.turns import Choice


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.completion.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _message(choice: Choice) -> dict[str, Any]:
    message = choice.message
    out: dict[str, Any] = {"role": "assistant", "content": message.content, "refusal": None}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in message.tool_calls]
    return out


def _token_logprobs(tokenizer, choice: Choice) -> list[dict[str, Any]]:
    out = []
    for token, logprob in zip(choice.completion.tokens.tolist(), choice.completion.logprobs.tolist(), strict=True):
        text = tokenizer.decode([token])
        out.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return out


class Responses:
    """Builds response bodies for one model name and tokenizer."""

    def __init__(self, model: str, tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer

    def _head(self, kind: str, prefix: str) -> dict[str, Any]:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": self.model}

    def chat(self, choices: list[Choice], prompt_tokens: int, logprobs: bool) -> dict[str, Any]:
        body = self._head("chat.completion", "chatcmpl")
        body["choices"] = [
            {"index": i, "message": _message(c), "finish_reason": c.finish_reason,
             "logprobs": {"content": _token_logprobs(self.tokenizer, c)} if logprobs else None}
            for i, c in enumerate(choices)
        ]
        body["usage"] = _usage(prompt_tokens, choices)
        return body

    def chat_chunks(self, choices: list[Choice], prompt_tokens: int, logprobs: bool, usage: bool) -> list[dict]:
        """The stream of a chat completion: per choice a role chunk, a content chunk (with its
        logprobs), a tool-calls chunk, a finish chunk; then a usage chunk when asked."""
        head = self._head("chat.completion.chunk", "chatcmpl")
        chunks = []

        def chunk(index: int, delta: dict, finish: str | None = None, lp: list | None = None) -> None:
            choice = {"index": index, "delta": delta, "finish_reason": finish,
                      "logprobs": {"content": lp} if lp is not None else None}
            chunks.append({**head, "choices": [choice]})

        for i, c in enumerate(choices):
            chunk(i, {"role": "assistant", "content": ""})
            message = _message(c)
            if message["content"]:
                chunk(i, {"content": message["content"]}, lp=_token_logprobs(self.tokenizer, c) if logprobs else None)
            if message.get("tool_calls"):
                chunk(i, {"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]})
            chunk(i, {}, c.finish_reason)
        if usage:
            chunks.append({**head, "choices": [], "usage": _usage(prompt_tokens, choices)})
        return chunks

    def completion(self, choices: list[Choice], prompt_tokens: int, logprobs: int | None) -> dict[str, Any]:
        body = self._head("text_completion", "cmpl")
        body["choices"] = [
            {"index": i, "text": c.text, "finish_reason": c.finish_reason,
             "logprobs": self._text_logprobs(c) if logprobs is not None else None}
            for i, c in enumerate(choices)
        ]
        body["usage"] = _usage(prompt_tokens, choices)
        return body

    def completion_chunks(self, choices: list[Choice], prompt_tokens: int, logprobs: int | None) -> list[dict]:
        body = self.completion(choices, prompt_tokens, logprobs)
        return [{**body, "choices": [choice]} for choice in body.pop("choices")]

    def _text_logprobs(self, choice: Choice) -> dict[str, Any]:
        tokens = [self.tokenizer.decode([t]) for t in choice.completion.tokens.tolist()]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": choice.completion.logprobs.tolist(),
                "top_logprobs": None, "text_offset": offsets}
