"""`Futures`: a keyed call is found again by its key (a retry is applied once); a finished result is forgotten
`keep_s` after it finished, with its key; one still running is never forgotten."""

from __future__ import annotations

import asyncio

import pytest

from stages.service.futures import Failure, Futures, UnknownFuture

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_key_finds_its_call_and_old_results_are_forgotten_with_their_keys() -> None:
    futures = Futures(wait_s=1.0, keep_s=0.05)
    release = asyncio.Event()

    async def done(value: int) -> dict:
        return {"value": value}

    async def waiting() -> dict:
        await release.wait()
        return {"value": "late"}

    first = futures.start(done(1), key=("model", 1))
    running = futures.start(waiting(), key=("model", 2))
    assert futures.by_key(("model", 1)) == first and futures.by_key(("model", 3)) is None
    assert await futures.result(first) == {"value": 1}
    await asyncio.sleep(0.1)  # past keep_s: the next start forgets the finished one, not the running one
    failing = futures.start(_raise())
    assert futures.by_key(("model", 1)) is None and futures.by_key(("model", 2)) == running
    with pytest.raises(UnknownFuture):
        await futures.result(first)
    release.set()
    assert await futures.result(running) == {"value": "late"}
    assert isinstance(await futures.result(failing), Failure)
    await futures.close()


async def _raise() -> dict:
    raise RuntimeError("boom")
