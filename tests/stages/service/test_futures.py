"""`Futures`: a model's call is found again by its id (a retry is applied once); a finished result is forgotten
`keep_s` after it finished; one still running is never forgotten."""

from __future__ import annotations

import asyncio

import pytest

from stages.service.futures import Failure, Futures, UnknownFuture, call_id

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_call_is_found_by_its_id_and_old_results_are_forgotten() -> None:
    futures = Futures(wait_s=1.0, keep_s=0.05)
    release = asyncio.Event()

    async def done(value: int) -> dict:
        return {"value": value}

    async def waiting() -> dict:
        await release.wait()
        return {"value": "late"}

    first = futures.start(done(1), call_id("model", 1))
    running = futures.start(waiting(), call_id("model", 2))
    assert first == "model/1" and futures.known(first) and not futures.known(call_id("model", 3))
    assert await futures.result(first) == {"value": 1}
    await asyncio.sleep(0.1)  # past keep_s: the next start forgets the finished one, not the running one
    failing = futures.start(_raise())
    assert not futures.known(first) and futures.known(running) and failing.startswith("req-")
    with pytest.raises(UnknownFuture):
        await futures.result(first)
    release.set()
    assert await futures.result(running) == {"value": "late"}
    assert isinstance(await futures.result(failing), Failure)
    await futures.close()


async def _raise() -> dict:
    raise RuntimeError("boom")
