"""`Futures`: every call the SDK makes asynchronously returns a request id at once; its result is retrieved by
that id (`retrieve_future`). A result is JSON (a dict) or protobuf bytes, or a failure with its message; a
retrieval of one still running waits up to `wait_s` and then answers `try_again` (the SDK asks again).

A model's call is started under the id its model and seq_id name (`call_id`), the same in every run of the
service: a retry with the same seq_id finds it (`known`) and is applied once, and a restarted service answers
the ids the client already holds (`stages.service.recovery`). Other calls (samples) get `req-N`. A result is
kept `keep_s` after it finished, then forgotten (a week-long service must not hold every step's result): a
retrieval after that finds no such request."""

from __future__ import annotations

import asyncio
import itertools
import time
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


def call_id(model_id: str, seq: int) -> str:
    """The request id of a model's call `seq` (0: the call that made the model)."""
    return f"{model_id}/{seq}"


class Futures:
    def __init__(self, wait_s: float = 20.0, keep_s: float = 3600.0) -> None:
        self.wait_s, self.keep_s = wait_s, keep_s
        self._tasks: dict[str, asyncio.Task[Result]] = {}
        self._finished: dict[str, float] = {}  # request id -> when it finished, in that order
        self._ids = itertools.count(1)

    def start(self, work: Awaitable[Result], request_id: str | None = None) -> str:
        """Run `work` now under `request_id` (None: a fresh `req-N`); the id. An exception it raises becomes
        its `Failure`."""
        self._forget_old()
        request_id = request_id or f"req-{next(self._ids)}"
        task = asyncio.ensure_future(settle(work))
        task.add_done_callback(lambda _: self._finished.setdefault(request_id, time.monotonic()))
        self._tasks[request_id] = task
        return request_id

    def known(self, request_id: str) -> bool:
        """Whether `request_id` was started and is still kept (a retry of it gets it, not a second call)."""
        return request_id in self._tasks

    def _forget_old(self) -> None:
        """Forget the results that finished more than `keep_s` ago."""
        horizon = time.monotonic() - self.keep_s
        for request_id, finished in list(self._finished.items()):
            if finished > horizon:
                break
            del self._finished[request_id], self._tasks[request_id]

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


async def settle(work: Awaitable[Result]) -> Result:
    """`work`'s result, or its exception as a `Failure` (a `Refused` is the user's)."""
    try:
        return await work
    except Refused as exc:
        return Failure(str(exc), "user")
    except Exception as exc:  # the client sees the failure by its future's id, with its type and message
        return Failure(f"{type(exc).__name__}: {exc}")
