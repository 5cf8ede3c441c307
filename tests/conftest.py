"""Shared fixtures: real services, started here and stopped by their pid."""

from __future__ import annotations

import inspect
import os

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


@pytest.fixture(scope="session")
def mooncake_master():
    """A real mooncake_master on 127.0.0.1 (free port, 500 ms read lease), for the whole session."""
    from buffers.mooncake_master import MooncakeMaster

    master = MooncakeMaster(lease_ttl_ms=500, client_ttl_s=3).start()
    yield master
    master.stop()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of this test module's own (four logical CPUs), started the way the runtime starts
    one (`pipeline.runtime.ray.init_own_cluster`: never a cluster `ray start` left behind), stopped after
    the module."""
    import ray

    from pipeline.runtime.ray import init_own_cluster

    init_own_cluster(num_cpus=4, log_to_driver=False, namespace="baton-tests")
    try:
        yield
    finally:
        ray.shutdown()


def pytest_collection_modifyitems(config, items) -> None:
    """`long` is what CI runs after the suite and `nightly` what it leaves out: a test marked both would run
    in CI under `-m long`, so the two are refused together."""
    both = [item.nodeid for item in items if item.get_closest_marker("long") and item.get_closest_marker("nightly")]
    if both:
        raise pytest.UsageError(f"marked both `long` and `nightly` (choose one): {both}")
    for item in items:
        if inspect.iscoroutinefunction(getattr(item, "function", None)):
            item.add_marker(pytest.mark.timeout(timeout=_timeout_of(item), method="thread"))


def _timeout_of(item) -> float | None:
    """The test's own timeout (None: the configured one). An async test that runs past it is ended with its
    worker (pytest-timeout's `thread` method) rather than by an exception raised inside its event loop: that
    left anyio's runner busy with the test: the module's next tests failed with it, or its async fixtures
    never tore down and the suite waited forever (an SGLang test on 2026-12-06). Its worker is replaced
    and the other tests go on."""
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return None
    return marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
