"""Retries for store calls: transient `StoreError`s are retried with backoff; a missing key is not
transient and is raised at once. After the last attempt the typed error surfaces unchanged."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from buffers.store import KeyNotFound, StoreError

T = TypeVar("T")


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, StoreError) and not isinstance(exc, KeyNotFound)


async def with_retries(call: Callable[[], Awaitable[T]], attempts: int = 3, max_wait_s: float = 1.0) -> T:
    async for attempt in AsyncRetrying(
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.05, max=max_wait_s),
        retry=retry_if_exception(_transient),
        reraise=True,
    ):
        with attempt:
            return await call()
    raise AssertionError("unreachable")
