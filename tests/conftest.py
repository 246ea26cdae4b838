from __future__ import annotations

import gc
import time
import uuid
from collections.abc import Iterator

import psutil
import pytest

from sandboxq.testing.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the whole session, on a free port."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def queue_name() -> str:
    """A queue name no other test uses, so tests sharing one Redis never see each other."""
    return f"t-{uuid.uuid4().hex[:12]}"


# -- no process outlives its test ----------------------------------------------------------

# Shared, long-lived helpers: the fork server, multiprocess's resource tracker, the
# session's redis-server. Everything else a test starts must be gone when it ends.
_SHARED = ("forkserver", "resource_tracker", "redis-server")


def _descendants() -> dict[int, str]:
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if not any(name in cmd for name in _SHARED):
            found[proc.pid] = cmd
    return found


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    before = set(_descendants())
    yield
    # Collect now, inside the test: an unclosed socket or file then fails the test that
    # leaked it (ResourceWarning is an error) instead of surfacing after the session.
    gc.collect()
    deadline = time.monotonic() + 3.0
    while (leaked := {p: c for p, c in _descendants().items() if p not in before}) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not leaked, f"processes outlived the test: {leaked}"
