"""A preempted engine's requests continued in the run's other producer processes (the Ray runtime, where each
engine has a process of its own and a process's relay holds its one engine).

Each producer process serves its relay on the mailbox `relay` (`serve`): a request (the prompt with the tokens
the preempted engine generated, and the sampling parameters with the budget left) is generated on the least
loaded engine of that process taking work, and the completion goes back. `PeerEngines` is what the preempted
process's relay continues on when none of its own engines takes work: it asks the peers in turn until one
serves. Invariants:

* a peer serves only from an engine that takes work (one that passed its fence and is not leaving); one that
  has none refuses (an empty reply), as does a dead peer (`Peer.ask` gives None), and the next peer is asked;
  none serving is an `EngineError` (the episode is generated again from its sample, counted);
* every generated token comes back with its logprob, the weight version that computed it and its routed
  experts, so the relay stitches the sample as it does locally;
* no pickle: the request and the completion are msgspec msgpack, the arrays raw little-endian bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import numpy as np

from stages.engines.base import Completion, EngineError, SamplingParams

MAILBOX = "relay"


class Continue(msgspec.Struct, frozen=True):
    """One request to continue: the whole input (prompt + tokens already generated) and what is left to sample."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: tuple[int, ...]


class Continued(msgspec.Struct, frozen=True):
    """Its completion on engine `engine` (at weight `version` when it answered), arrays as raw bytes."""

    engine: str
    version: int
    tokens: bytes  # int32
    logprobs: bytes  # float32
    versions: bytes  # int32
    finish_reason: str
    experts: bytes | None = None
    experts_dtype: str = ""
    experts_shape: tuple[int, ...] = ()


_CONTINUE, _CONTINUED = msgspec.msgpack.Decoder(Continue), msgspec.msgpack.Decoder(Continued)


def _array(data: bytes, dtype: str) -> np.ndarray:
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)


async def serve(engines: Callable[[], Iterable[Any]], header: bytes, _blob: Any = None) -> bytes:
    """The mailbox: `header` (a `Continue`) generated on the least loaded of `engines()`; b"" when none takes work."""
    request = _CONTINUE.decode(header)
    engine = min(engines(), key=lambda e: e.load, default=None)
    if engine is None:
        return b""
    params = SamplingParams(request.max_new_tokens, request.temperature, request.top_p, request.stop_token_ids)
    (done,) = await engine.generate([request.prompt], params)
    experts = done.routed_experts
    return msgspec.msgpack.encode(Continued(
        engine=engine.name, version=int(done.versions.max()) if len(done.versions) else engine.version,
        tokens=done.tokens.astype("<i4").tobytes(), logprobs=done.logprobs.astype("<f4").tobytes(),
        versions=done.versions.astype("<i4").tobytes(), finish_reason=done.finish_reason,
        experts=None if experts is None else np.ascontiguousarray(experts).tobytes(),
        experts_dtype="" if experts is None else experts.dtype.str,
        experts_shape=() if experts is None else experts.shape,
    ))


def _completion(reply: Continued) -> Completion:
    experts = None
    if reply.experts is not None:
        experts = np.frombuffer(reply.experts, dtype=np.dtype(reply.experts_dtype)).reshape(reply.experts_shape)
    return Completion(_array(reply.tokens, "int32"), _array(reply.logprobs, "float32"),
                      _array(reply.versions, "int32"), reply.finish_reason, {}, experts)


class PeerEngines:
    """The engines of the other producer processes, as one successor of `Relay.carry` (see the module docstring).
    `version` is the preempted engine's until a peer answered (every engine of a run passed the same fence),
    then the serving engine's; `name` names the peer and engine that served last."""

    load = 0

    def __init__(self, peers: Callable[[], Iterable[Any]], version: int) -> None:
        self._peers, self.version, self.name = peers, version, "peers"

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return [await self._one(prompt, params) for prompt in prompts]

    async def _one(self, prompt: list[int], params: SamplingParams) -> Completion:
        request = msgspec.msgpack.encode(Continue(list(map(int, prompt)), params.max_new_tokens, params.temperature,
                                                  params.top_p, tuple(params.stop_token_ids)))
        asked = []
        for peer in self._peers():
            asked.append(getattr(peer, "name", "?"))
            reply = await peer.ask(MAILBOX, request)
            if reply:
                continued = _CONTINUED.decode(reply)
                self.name, self.version = f"{asked[-1]}/{continued.engine}", continued.version
                return _completion(continued)
        raise EngineError(f"no other producer process took the preempted request (asked: {asked or 'none'}): it is "
                          "generated again from its sample")
