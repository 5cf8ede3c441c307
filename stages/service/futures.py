"""`Futures`: every call the SDK makes asynchronously returns a request id at once; its result is retrieved by
that id (`retrieve_future`). A result is JSON (a dict) or protobuf bytes, or a failure with its message; a
retrieval of one still running waits up to `wait_s` and then answers `try_again` (the SDK asks again)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable
from dataclasses import dataclass

from stages.service.refusals import Refused


@dataclass(frozen=True)
class Failure:
    error: str
    category: str = "server"  # Tinker's RequestErrorCategory: "user", "server" or "unknown"


Result = dict | bytes | Failure


class UnknownFuture(KeyError):
    """No future has this request id."""


class Futures:
    def __init__(self, wait_s: float = 20.0) -> None:
        self.wait_s = wait_s
        self._tasks: dict[str, asyncio.Task[Result]] = {}
        self._ids = itertools.count(1)

    def start(self, work: Awaitable[Result]) -> str:
        """Run `work` now; its request id. An exception it raises becomes its `Failure`."""
        request_id = f"req-{next(self._ids)}"
        self._tasks[request_id] = asyncio.ensure_future(_failing_softly(work))
        return request_id

    async def result(self, request_id: str) -> Result | None:
        """The result of `request_id`, or None while it still runs after `wait_s`; UnknownFuture for an unknown id."""
        task = self._tasks.get(request_id)
        if task is None:
            raise UnknownFuture(request_id)
        done, _ = await asyncio.wait({task}, timeout=self.wait_s)
        return task.result() if done else None

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)


async def _failing_softly(work: Awaitable[Result]) -> Result:
    try:
        return await work
    except Refused as exc:
        return Failure(str(exc), "user")
    except Exception as exc:  # the client sees the failure by its future's id, with its type and message
        return Failure(f"{type(exc).__name__}: {exc}")
