from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Iterator

# Imported before the first gc.freeze (no_leaked_processes): at import, plugins hand it
# module-level objects and it checks, through the collector, that something refers to them;
# frozen referrers are invisible to that check, which then warns (an error here).
import hypothesis  # noqa: F401
import pytest
import redis

from sandboxq import Queue
from sandboxq.pool.containment import probe
from sandboxq.pool.privileges import pid_namespace_refused
from sandboxq.testing import processes
from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.workers import BackgroundWorkers

MODE, WHY = probe()
PID_NAMESPACE_REFUSED = pid_namespace_refused()

# The project's own test bench (tests/support) holds processors too: every process a
# test starts (`sandboxq worker`, a script) finds it, whatever its working directory.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))


def pytest_report_header() -> str:
    """Which containment the pools of this run get: the cgroup-only tests skip without one."""
    namespace = PID_NAMESPACE_REFUSED or "allowed"
    return f"sandboxq containment: {MODE} ({WHY}); PID namespaces: {namespace}"


@pytest.fixture(
    params=[
        pytest.param(False, id="own-pids"),
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                PID_NAMESPACE_REFUSED is not None,
                reason=f"no PID namespace here: {PID_NAMESPACE_REFUSED}",
            ),
            id="pid-namespace",
        ),
    ]
)
def pid_namespace(request: pytest.FixtureRequest) -> bool:
    """Both: children in the worker's PID namespace, and each in one of its own."""
    return bool(request.param)


@pytest.fixture(
    params=[
        pytest.param(
            "auto",
            marks=pytest.mark.skipif(
                MODE == "process_tree", reason=f"no writable control groups: {WHY}"
            ),
            id="cgroup",
        ),
        pytest.param("process_tree", id="process_tree"),
    ]
)
def containment(request: pytest.FixtureRequest) -> str:
    """Both containment modes: a control group where the machine has one, and the
    process-tree mode, forced (what most containers get)."""
    return str(request.param)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the whole session, on a free port."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    """A plain redis-py client on the session's server: to read or damage keys by hand."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def queue_name() -> str:
    """A queue name no other test uses, so tests sharing one Redis never see each other."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["memory", "redis"])
def url(request: pytest.FixtureRequest) -> str:
    """Both backends: the embedded one and a real redis-server."""
    if request.param == "memory":
        return "memory://"
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
def queue(url: str, queue_name: str) -> Iterator[Queue]:
    q = Queue(queue_name, url=url)
    yield q
    q.close()


@pytest.fixture
def workers() -> Iterator[BackgroundWorkers]:
    """The test's workers, on threads or as processes (``sandboxq.testing.workers``): every
    one is stopped at teardown, pass or fail, and teardown errors if one's run() raised."""
    # Well inside the shortest test timeout (30 s): a worker still running 15 s after
    # stop(now=True), which promises 1 s, fails its own test at teardown, instead of the
    # timeout ending the whole run (the suite's timeout_method is "thread").
    with BackgroundWorkers(join_timeout_s=15) as running:
        yield running


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """No process a test started outlives it: pool children and grandchildren included
    (only the fork server, the resource tracker and redis-server are shared)."""
    before = processes.descendants()
    yield
    # Collect now, inside the test: an unclosed socket or file then fails the test that
    # leaked it (ResourceWarning is an error) instead of surfacing after the session. What
    # is still alive after it is frozen: the next test's collection looks only at what
    # that test made (a full one cost 40-100 ms a test, 1-2 minutes of a run).
    gc.collect()
    gc.freeze()
    leaked = processes.survivors(before, grace_s=3.0)
    assert not leaked, "processes outlived the test:\n" + processes.describe(leaked)
