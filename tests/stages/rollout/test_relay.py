"""The carry-over of a preempted engine's requests (stages.rollout.relay), with scripted engines: what goes
to the successor, how the completion is stitched, what is counted as carried and as lost. The real engines
and run: tests/stages/engines/test_engine.py (a preempted torch engine) and tests/faults/test_elastic.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from policies import MaxStaleness
from stages.engines.base import Completion, EngineError, SamplingParams
from stages.rollout.relay import Relay, preempted_before_start
from stages.rollout.relay_remote import MAILBOX, PeerEngines, serve

pytestmark = pytest.mark.anyio


class Scripted:
    """An engine that answers each prompt with `answer` new tokens (ids 100, 101, ...) at its version."""

    def __init__(self, name: str, version: int = 0, load: int = 0, answer: int = 3) -> None:
        self.name, self.version, self.load, self.answer = name, version, load, answer
        self.asked: list[tuple[list[int], int]] = []

    async def generate(self, prompts, params):
        self.asked += [(list(p), params.max_new_tokens) for p in prompts]
        n = min(self.answer, params.max_new_tokens)
        return [Completion(np.arange(100, 100 + n, dtype=np.int32), np.full(n, -0.5, np.float32),
                           np.full(n, self.version, np.int32), "stop", {"rid": self.name}) for _ in prompts]


def partial(tokens: list[int], version: int) -> Completion:
    n = len(tokens)
    return Completion(np.array(tokens, np.int32), np.full(n, -1.0, np.float32), np.full(n, version, np.int32),
                      "preempted")


async def test_a_preempted_request_goes_on_at_the_least_loaded_other_engine_from_its_tokens() -> None:
    relay, gone = Relay(), Scripted("gone")
    busy, idle = Scripted("busy", load=5), Scripted("idle", version=1, load=1)
    for engine in (gone, busy, idle):
        relay.add(engine)
    done = await relay.carry(gone, [1, 2], partial([7, 8], version=0), SamplingParams(max_new_tokens=10))
    assert idle.asked == [([1, 2, 7, 8], 8)] and not busy.asked, "prompt + its tokens, the budget left"
    assert done.tokens.tolist() == [7, 8, 100, 101, 102] and done.finish_reason == "stop"
    assert done.versions.tolist() == [0, 0, 1, 1, 1] and done.logprobs.tolist() == [-1, -1, -0.5, -0.5, -0.5]
    assert done.meta["carried_tokens"] == 2
    assert relay.counts["gone"] == {"requests": 1, "tokens_carried": 2}


async def test_tokens_too_old_for_the_successor_are_lost_and_counted() -> None:
    """k = 1: tokens of version 0 may not continue under version 2; the request starts again there."""
    relay, gone, later = Relay(), Scripted("gone"), Scripted("later", version=2)
    relay.add(later)
    done = await relay.carry(gone, [1], partial([7, 8, 9], 0), SamplingParams(max_new_tokens=5), MaxStaleness(k=1))
    assert later.asked == [([1], 5)] and done.tokens.tolist() == [100, 101, 102]
    assert relay.counts["gone"] == {"tokens_lost": 3, "requests": 1}


async def test_no_engine_left_is_an_engine_error_and_its_tokens_are_lost() -> None:
    relay, gone = Relay(), Scripted("gone")
    relay.add(gone)  # itself only: never its own successor
    with pytest.raises(EngineError, match="no other engine"):
        await relay.carry(gone, [1], partial([7], 0), SamplingParams(max_new_tokens=4))
    assert relay.counts["gone"]["tokens_lost"] == 1


async def test_a_call_made_after_the_preemption_runs_whole_elsewhere() -> None:
    relay, gone, other = Relay(), Scripted("gone"), Scripted("other")
    relay.add(other)
    done = await relay.carry(gone, [1], preempted_before_start(), SamplingParams(max_new_tokens=4))
    assert other.asked == [([1], 4)] and done.tokens.tolist() == [100, 101, 102]
    assert done.meta == {"rid": "other", "carried_tokens": 0}


async def test_a_completion_that_was_not_preempted_comes_back_as_it_is() -> None:
    relay, engine = Relay(), Scripted("e")
    whole = Completion(np.array([5], np.int32), np.zeros(1, np.float32), np.zeros(1, np.int32), "stop")
    assert await relay.carry(engine, [1], whole, SamplingParams(max_new_tokens=4)) is whole


# -- other processes' engines (stages.rollout.relay_remote: the Ray runtime, one engine per process) --------------


class PeerProcess:
    """Another producer process as a relay sees it (`pipeline.contracts.Peer`): its relay served on its mailbox,
    through the wire format (msgpack bytes both ways)."""

    def __init__(self, name: str, *engines: Scripted, alive: bool = True) -> None:
        self.name, self.alive, self.relay = name, alive, Relay()
        for engine in engines:
            self.relay.add(engine)

    async def ask(self, box: str, header: bytes) -> bytes | None:
        assert box == MAILBOX and isinstance(header, bytes)
        return await serve(lambda: list(self.relay.engines.values()), header) if self.alive else None


def across(*peers: PeerProcess) -> Relay:
    """A process's relay whose own engine left, with `peers` as the other processes."""
    relay = Relay()
    relay.elsewhere = lambda preempted: PeerEngines(lambda: list(peers), preempted.version)
    return relay


async def test_a_preempted_request_goes_on_in_another_process_through_its_mailbox() -> None:
    """The first peer is dead and the second has no engine taking work: the third serves, from the tokens."""
    far = Scripted("far", version=1)
    relay = across(PeerProcess("producer-0", Scripted("x"), alive=False), PeerProcess("producer-1"),
                   PeerProcess("producer-2", far))
    done = await relay.carry(Scripted("gone"), [1, 2], partial([7, 8], version=0), SamplingParams(max_new_tokens=10))
    assert far.asked == [([1, 2, 7, 8], 8)], "prompt + its tokens, the budget left"
    assert done.tokens.tolist() == [7, 8, 100, 101, 102] and done.versions.tolist() == [0, 0, 1, 1, 1]
    assert done.logprobs.tolist() == [-1, -1, -0.5, -0.5, -0.5] and done.finish_reason == "stop"
    assert done.meta == {"carried_tokens": 2} and relay.counts["gone"] == {"requests": 1, "tokens_carried": 2}


async def test_routed_experts_and_stop_tokens_cross_processes_unchanged() -> None:
    class Routed(Scripted):
        async def generate(self, prompts, params):
            self.asked.append(params.stop_token_ids)
            (done,) = await super().generate(prompts, params)
            return [replace(done, routed_experts=np.arange(12, dtype=np.int16).reshape(3, 2, 2) * 300)]

    far = Routed("far")
    done = await across(PeerProcess("p", far)).carry(Scripted("gone"), [1], partial([7], 0),
                                                       SamplingParams(max_new_tokens=9, stop_token_ids=(5, 6)))
    assert (5, 6) in far.asked and done.routed_experts is None, "the first part had no experts: none stitched"
    first = replace(partial([7], 0), routed_experts=np.zeros((1, 2, 2), np.int16))
    done = await across(PeerProcess("p", far)).carry(Scripted("gone"), [1], first, SamplingParams(max_new_tokens=9))
    assert done.routed_experts.dtype == np.int16 and done.routed_experts.shape == (4, 2, 2)
    assert done.routed_experts[1:].ravel().tolist() == [i * 300 for i in range(12)]


async def test_no_process_serving_is_an_engine_error_naming_those_asked() -> None:
    relay = across(PeerProcess("producer-0"), PeerProcess("producer-1", Scripted("x"), alive=False))
    with pytest.raises(EngineError, match=r"asked: \['producer-0', 'producer-1'\]"):
        await relay.carry(Scripted("gone"), [1], partial([7, 8], 0), SamplingParams(max_new_tokens=4))
    assert relay.counts["gone"] == {"tokens_lost": 2}, "tokens no engine continued are lost, not carried"
