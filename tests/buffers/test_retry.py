"""Store-call retries (buffers.retry): how many attempts, which errors, and the bare first call."""

from __future__ import annotations

import pytest

from buffers.retry import ATTEMPTS, with_retries
from buffers.store import KeyNotFound, StoreError

pytestmark = pytest.mark.anyio


class Flaky:
    """Fails with `error` on its first `failures` calls, then returns "ok"."""

    def __init__(self, failures: int, error: type[Exception] = StoreError) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error(f"failure {self.calls}")
        return "ok"


async def test_a_transient_error_is_retried_until_a_call_succeeds() -> None:
    call = Flaky(ATTEMPTS - 1)
    assert await with_retries(call) == "ok"
    assert call.calls == ATTEMPTS


async def test_after_the_last_attempt_the_typed_error_surfaces() -> None:
    call = Flaky(ATTEMPTS)
    with pytest.raises(StoreError, match=f"failure {ATTEMPTS}"):
        await with_retries(call)
    assert call.calls == ATTEMPTS


async def test_a_missing_key_and_other_errors_are_not_retried() -> None:
    for error in (KeyNotFound, ValueError):
        call = Flaky(1, error)
        with pytest.raises(error):
            await with_retries(call)
        assert call.calls == 1


async def test_one_attempt_means_no_retry() -> None:
    call = Flaky(1)
    with pytest.raises(StoreError):
        await with_retries(call, attempts=1)
    assert call.calls == 1
