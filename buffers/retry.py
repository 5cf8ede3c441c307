"""Retries for store calls: transient `StoreError`s are retried with backoff; a missing key is not
transient and is raised at once. After the last attempt the typed error surfaces unchanged.
`retry_while` is the backends' own loop: the errors they name, retried for a while."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from tenacity import AsyncRetrying, retry_if_exception, retry_if_exception_type, stop_after_attempt, stop_after_delay
from tenacity import wait_exponential as backoff

from buffers.store import KeyNotFound, StoreError

T = TypeVar("T")


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, StoreError) and not isinstance(exc, KeyNotFound)


ATTEMPTS = 3  # tries of a store call before its typed error surfaces
FIRST_WAIT_S = 0.05  # before the second


async def with_retries(call: Callable[[], Awaitable[T]], attempts: int = ATTEMPTS, max_wait_s: float = 1.0) -> T:
    """`await call()`, up to `attempts` times while it raises a transient StoreError (0.05 s, then
    exponentially longer, apart). The first call runs bare: tenacity's loop costs ~0.1 ms a call, a
    tenth of a small store get, and is only entered after a failure."""
    try:
        return await call()
    except Exception as exc:
        if attempts <= 1 or not _transient(exc):
            raise
    await anyio.sleep(FIRST_WAIT_S)
    return await _retrying(
        call, stop_after_attempt(attempts - 1), backoff(FIRST_WAIT_S, max_wait_s), retry_if_exception(_transient)
    )


async def retry_while(
    call: Callable[[], Awaitable[T]], errors: tuple[type[BaseException], ...], *, first_wait_s: float,
    max_wait_s: float, within_s: float,
) -> T:
    """`await call()`, retried while it raises one of `errors`: at once, then with exponential backoff
    (from `first_wait_s`, at most `max_wait_s` apart) for up to `within_s` seconds; then the error
    surfaces. The first call runs bare, so the common case costs no retry machinery."""
    try:
        return await call()
    except errors:
        pass
    return await _retrying(
        call, stop_after_delay(within_s), backoff(first_wait_s, max_wait_s), retry_if_exception_type(errors)
    )


async def _retrying(call: Callable[[], Awaitable[T]], stop, wait, retry) -> T:
    async for attempt in AsyncRetrying(stop=stop, wait=wait, retry=retry, reraise=True):
        with attempt:
            return await call()
    raise AssertionError("unreachable")
