"""`Futures`: every call the SDK makes asynchronously returns a request id at once; its result is retrieved by
that id (`retrieve_future`). A result is JSON (a dict) or protobuf bytes, or a failure with its message; a
retrieval of one still running waits up to `wait_s` and then answers `try_again` (the SDK asks again).

A call may carry a key (a model's `seq_id`): a retry with the same key gets the first call's request id, so it is
applied once. A result is kept `keep_s` after it finished, then forgotten with its key (a week-long service must
not hold every step's result): a retrieval or a retry after that finds no such request."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Hashable
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
    def __init__(self, wait_s: float = 20.0, keep_s: float = 3600.0) -> None:
        self.wait_s, self.keep_s = wait_s, keep_s
        self._tasks: dict[str, asyncio.Task[Result]] = {}
        self._keys: dict[Hashable, str] = {}  # a call's key -> its request id
        self._key_of: dict[str, Hashable] = {}
        self._finished: dict[str, float] = {}  # request id -> when it finished, in that order
        self._ids = itertools.count(1)

    def start(self, work: Awaitable[Result], key: Hashable | None = None) -> str:
        """Run `work` now; its request id. An exception it raises becomes its `Failure`. `key`: see `by_key`."""
        self._forget_old()
        request_id = f"req-{next(self._ids)}"
        task = asyncio.ensure_future(_failing_softly(work))
        task.add_done_callback(lambda _: self._finished.setdefault(request_id, time.monotonic()))
        self._tasks[request_id] = task
        if key is not None:
            self._keys[key], self._key_of[request_id] = request_id, key
        return request_id

    def by_key(self, key: Hashable) -> str | None:
        """The request id of the call started with `key` (a retry gets it, not a second call), if still kept."""
        return self._keys.get(key)

    def _forget_old(self) -> None:
        """Forget the results that finished more than `keep_s` ago, and their keys."""
        horizon = time.monotonic() - self.keep_s
        for request_id, finished in list(self._finished.items()):
            if finished > horizon:
                break
            del self._finished[request_id], self._tasks[request_id]
            key = self._key_of.pop(request_id, None)
            if key is not None and self._keys.get(key) == request_id:
                del self._keys[key]

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
