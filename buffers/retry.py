"""Retries for store calls: transient `StoreError`s are retried with backoff; a missing key is not
transient and is raised at once. After the last attempt the typed error surfaces unchanged.
`retry_while` is the backends' own loop: the errors they name, retried for a while."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from buffers.store import KeyNotFound, StoreError

T = TypeVar("T")


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, StoreError) and not isinstance(exc, KeyNotFound)


ATTEMPTS = 3  # tries of a store call before its typed error surfaces
FIRST_WAIT_S = 0.05  # before the second


async def with_retries(call: Callable[[], Awaitable[T]], attempts: int = ATTEMPTS, max_wait_s: float = 1.0) -> T:
    """`await call()`, up to `attempts` times while it raises a transient StoreError (0.05 s, then
    exponentially longer, apart). The first call runs bare: the retry loop is only entered after a
    failure."""
    try:
        return await call()
    except Exception as exc:
        if attempts <= 1 or not _transient(exc):
            raise
    await anyio.sleep(FIRST_WAIT_S)
    return await _retrying(call, _transient, FIRST_WAIT_S, max_wait_s, attempts=attempts - 1)


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
    return await _retrying(call, lambda exc: isinstance(exc, errors), first_wait_s, max_wait_s, within_s=within_s)


async def _retrying(
    call: Callable[[], Awaitable[T]], retry: Callable[[BaseException], bool], first_wait_s: float, max_wait_s: float,
    attempts: int | None = None, within_s: float | None = None,
) -> T:
    """`await call()` while it raises an error `retry` accepts, `first_wait_s` then exponentially longer (at
    most `max_wait_s`) apart, for `attempts` tries or until `within_s` seconds have passed; then the error
    surfaces. A plain loop on purpose: a failed try leaves no reference cycle behind (tenacity's retry state,
    its futures and the exception's traceback hold each other, garbage only the cyclic collector frees: on the
    removal of every payload read under Mooncake's read lease, megabytes between collections; measured on a
    Ray long run, the learner's second-half RSS growth went from 29 to 22 MB per 100k samples)."""
    started, wait, tries = time.monotonic(), first_wait_s, 0
    while True:
        tries += 1
        try:
            return await call()
        except Exception as exc:
            if not retry(exc) or (attempts is not None and tries >= attempts) or (
                within_s is not None and time.monotonic() - started >= within_s
            ):
                raise
        await anyio.sleep(wait)
        wait = min(wait * 2, max_wait_s)
