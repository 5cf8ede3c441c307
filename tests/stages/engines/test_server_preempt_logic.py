"""The preemption server engines share (stages.engines.server_engine), against a scripted server: the abort goes
out once the engine is preempted and again until the answer is back, and later calls are refused. The real
servers: the preempted-engine tests of tests/stages/engines/test_sglang.py and test_vllm.py."""

from __future__ import annotations

import anyio
import pytest

from stages.engines.base import EnginePreempted
from stages.engines.server_engine import ServerEngine

pytestmark = pytest.mark.anyio


class ScriptedServer:
    """A request that runs until an abort reaches it; the first `lost` aborts arrive before the request does."""

    def __init__(self, lost: int) -> None:
        self.lost, self.aborts, self.aborted = lost, 0, anyio.Event()

    async def generate(self) -> str:
        await self.aborted.wait()
        return "tokens so far"

    async def abort(self) -> None:
        self.aborts += 1
        if self.aborts > self.lost:
            self.aborted.set()


def engine() -> ServerEngine:
    e = ServerEngine()
    e.name = "scripted"
    return e


async def test_a_preempted_call_aborts_its_requests_until_its_answer_is_back() -> None:
    e, server, answers = engine(), ScriptedServer(lost=2), []

    async def call() -> None:
        answers.append(await e._preemptible(server.generate(), server.abort))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await anyio.sleep(0.05)
            assert server.aborts == 0  # nothing is aborted before the preemption
            e.preempt()
    assert answers == ["tokens so far"] and server.aborts == 3  # the two that came too early, then one more
    with pytest.raises(EnginePreempted):
        e._refuse_if_preempted()


async def test_a_call_that_fails_raises_as_itself() -> None:
    async def refused() -> None:
        raise ValueError("refused")

    async def abort() -> None:
        raise AssertionError("no preemption: nothing to abort")

    with pytest.raises(ValueError, match="refused"):  # not in an exception group; and nothing was aborted
        await engine()._preemptible(refused(), abort)
