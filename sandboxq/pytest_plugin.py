"""The sandboxq pytest plugin: real Redis, queues, workers and misbehaving handlers for
testing processors and their timeout handling on the real sandbox path.

Registered through the ``pytest11`` entry point, so it is active wherever sandboxq is
installed; nothing is autouse and nothing starts unless a test asks for it:

    sandboxq_redis_url (session) ─ --sandboxq-redis-url / $SANDBOXQ_TEST_REDIS_URL, else a
         │                          throwaway redis-server (port, or --sandboxq-redis-socket)
         ▼
    sandboxq_queue ─ Queue "sandboxq-test-<hex>" on it     sandboxq_memory_queue ─ memory://
         │
    sandboxq_worker(processor, **options) ─ SandboxWorkers on background threads, serving
                                            the test's queue; stopped and joined at teardown
    sandboxq_misbehaving_handler, sandboxq_hung_handler ─ parametrized HandlerCases
    sandboxq_no_orphans, @pytest.mark.sandboxq_no_orphans ─ fail the test if a process it
                                            started is still alive after its teardown

This is the only sandboxq module that imports pytest. Workers, pools, the Redis client and
the handler catalogue are imported only when a test asks for them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from sandboxq.client import Queue
    from sandboxq.testing.cases import HandlerCase
    from sandboxq.testing.workers import StartWorker
    from sandboxq.worker import SandboxWorker

#: Names an existing Redis to use instead of starting one (like --sandboxq-redis-url).
URL_ENV = "SANDBOXQ_TEST_REDIS_URL"
#: How long processes a test started may take to die after its teardown (ini option
#: sandboxq_orphan_grace_s).
ORPHAN_GRACE_S = 5.0

_SNAPSHOT = pytest.StashKey[dict[int, str]]()
_HANDLER_FIXTURES = {
    "sandboxq_misbehaving_handler": "CASES",
    "sandboxq_hung_handler": "HUNG",
    "sandboxq_contained_handler": "CONTAINED",
    "sandboxq_hostile_handler": "HOSTILE",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sandboxq", "sandboxq test fixtures")
    group.addoption(
        "--sandboxq-redis-url",
        metavar="URL",
        help=f"use this running Redis instead of starting one (also ${URL_ENV}); "
        "tests use their own queues on it and delete nothing",
    )
    group.addoption(
        "--sandboxq-redis-socket",
        action="store_true",
        help="start the throwaway redis-server on a Unix socket instead of a TCP port",
    )
    group.addoption(
        "--sandboxq-redis-server",
        metavar="PATH",
        help="the redis-server binary to start (default: redis-server on PATH)",
    )
    group.addoption(
        "--sandboxq-require-redis",
        action="store_true",
        help="make tests that need Redis error, instead of skip, when redis-server is missing",
    )
    parser.addini(
        "sandboxq_orphan_grace_s",
        "seconds processes a test started may take to die after its teardown before "
        f"sandboxq_no_orphans fails it (default {ORPHAN_GRACE_S:g})",
        default=str(ORPHAN_GRACE_S),
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "sandboxq_no_orphans: fail the test if a process it started (child or grandchild) "
        "is still alive after its teardown",
    )


# -- Redis ----------------------------------------------------------------------------------


def _check_reachable(url: str, source: str) -> None:
    from sandboxq.client import Queue
    from sandboxq.errors import SandboxqError

    try:
        with Queue("sandboxq-test-ping", url) as queue:
            queue.counts()  # reads only
    except SandboxqError as exc:
        pytest.fail(f"sandboxq: the Redis named by {source} is not usable: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def sandboxq_redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of a real Redis for this session.

    ``--sandboxq-redis-url`` or ``$SANDBOXQ_TEST_REDIS_URL`` name an existing server (it is
    only checked to answer: nothing on it is flushed or deleted). Otherwise a throwaway
    redis-server starts on first use, on a free port (or a Unix socket with
    ``--sandboxq-redis-socket``), and stops at the end of the session. Tests that need it
    are skipped when redis-server is not installed, or error with
    ``--sandboxq-require-redis``.
    """
    from sandboxq.testing.redis_server import RedisServer, RedisServerNotFound

    config = request.config
    url = config.getoption("sandboxq_redis_url")
    source = "--sandboxq-redis-url"
    if not url and os.environ.get(URL_ENV):
        url, source = os.environ[URL_ENV], f"${URL_ENV}"
    if url:
        _check_reachable(url, source)
        yield url
        return
    try:
        server = RedisServer(
            unix_socket=bool(config.getoption("sandboxq_redis_socket")),
            binary=config.getoption("sandboxq_redis_server"),
        )
    except RedisServerNotFound as exc:
        message = f"sandboxq: no Redis for this test: {exc} (--sandboxq-redis-url or ${URL_ENV})"
        if config.getoption("sandboxq_require_redis"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    try:
        server.start()
    except (OSError, RuntimeError) as exc:  # TimeoutError is an OSError
        server.close()
        pytest.fail(f"sandboxq: could not start redis-server: {exc}", pytrace=False)
    try:
        yield server.url
    finally:
        server.close()


# -- queues and workers -------------------------------------------------------------------


@pytest.fixture
def sandboxq_queue_name() -> str:
    """A queue name no other test uses, so tests sharing a Redis never see each other."""
    return f"sandboxq-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def sandboxq_queue(sandboxq_redis_url: str, sandboxq_queue_name: str) -> Iterator[Queue]:
    """A ``sandboxq.Queue`` of this test's own on the session's Redis."""
    from sandboxq.client import Queue

    with Queue(sandboxq_queue_name, sandboxq_redis_url) as queue:
        yield queue


@pytest.fixture
def sandboxq_memory_queue(sandboxq_queue_name: str) -> Iterator[Queue]:
    """A ``sandboxq.Queue`` of this test's own on the in-process backend (no Redis)."""
    from sandboxq.client import Queue

    with Queue(sandboxq_queue_name, "memory://") as queue:
        yield queue


@pytest.fixture
def sandboxq_worker(
    request: pytest.FixtureRequest, sandboxq_queue_name: str
) -> Iterator[StartWorker]:
    """Start ``SandboxWorker``s on background threads: ``sandboxq_worker(processor,
    queue=None, burst=False, **options)`` returns the running worker.

    It serves ``queue`` (a ``Queue``), by default the test's: ``sandboxq_queue``, or
    ``sandboxq_memory_queue`` when the test uses only that one (``url=`` picks another
    backend for the test's queue name). ``options`` are
    ``SandboxWorker`` keywords (``hard_timeout_s``, ``soft_timeout_s``, ``retries``...);
    tests default to ``concurrency=2``. It returns once the worker claims jobs (with
    ``burst``, at once); a start that fails (an unknown ``user``, an unreachable Redis)
    raises there, naming why.
    Every worker is stopped (running jobs interrupted)
    and joined at teardown, whether the test passed or not; teardown errors if one would
    not stop or its ``run()`` raised.
    """
    from sandboxq.testing.workers import BackgroundWorkers

    workers = BackgroundWorkers()
    memory_only = (
        "sandboxq_memory_queue" in request.fixturenames
        and "sandboxq_queue" not in request.fixturenames
    )

    def start(
        processor: str, *, queue: Queue | None = None, burst: bool = False, **options: Any
    ) -> SandboxWorker:
        # A burst worker returns at once, as it did: it runs what the queue holds once up.
        wait = not burst
        if queue is not None:
            return workers.start(queue, processor, burst=burst, wait_started=wait, **options)
        url = options.pop("url", None) or (
            "memory://" if memory_only else request.getfixturevalue("sandboxq_redis_url")
        )
        return workers.start(
            sandboxq_queue_name, processor, url=url, burst=burst, wait_started=wait, **options
        )

    try:
        yield start
    finally:
        workers.stop_all()


# -- misbehaving handlers --------------------------------------------------------------------


def _parametrized(metafunc: pytest.Metafunc, name: str) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", "")
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Parametrized here rather than with fixture(params=...), so the catalogue is only
    # imported by test runs that use it.
    for name, which in _HANDLER_FIXTURES.items():
        if name in metafunc.fixturenames and not _parametrized(metafunc, name):
            from sandboxq.testing import cases

            chosen: list[HandlerCase] = getattr(cases, which)
            metafunc.parametrize(name, chosen, ids=[c.id for c in chosen], indirect=True)


def _handler_case(request: pytest.FixtureRequest, fixture: str) -> HandlerCase:
    from sandboxq.testing import cases

    param = getattr(request, "param", None)
    if isinstance(param, cases.HandlerCase):
        return param
    own: list[HandlerCase] = getattr(cases, _HANDLER_FIXTURES[fixture])
    by_id = {case.id: case for case in own}  # a hung handler is a hang, not any case
    if isinstance(param, str) and param in by_id:
        return by_id[param]
    pytest.fail(
        f"{fixture}: unknown handler case {param!r}; known: {', '.join(by_id)}",
        pytrace=False,
    )


@pytest.fixture
def sandboxq_misbehaving_handler(request: pytest.FixtureRequest) -> HandlerCase:
    """Each misbehaving handler of ``sandboxq.testing.handlers`` in turn, as a
    ``HandlerCase``: ``.processor``, ``.args``, ``.worker_options`` and the ``.outcome``
    it must produce (``.check(attempt)`` compares). Choose some by id with
    ``@pytest.mark.parametrize("sandboxq_misbehaving_handler", ["hold_gil-soft"],
    indirect=True)``."""
    return _handler_case(request, "sandboxq_misbehaving_handler")


@pytest.fixture
def sandboxq_hung_handler(request: pytest.FixtureRequest) -> HandlerCase:
    """Like ``sandboxq_misbehaving_handler``, only the handlers that hang until a timeout
    ends them (outcome soft_timeout or hard_timeout)."""
    return _handler_case(request, "sandboxq_hung_handler")


@pytest.fixture
def sandboxq_contained_handler(request: pytest.FixtureRequest) -> HandlerCase:
    """Each handler that returns normally (ok) but leaves processes or memory behind
    (a daemon, a session helper, a fork burst, a fork bomb, a memory leak): combine it
    with ``sandboxq_no_orphans`` to check that nothing it started outlives its attempt."""
    return _handler_case(request, "sandboxq_contained_handler")


@pytest.fixture
def sandboxq_hostile_handler(request: pytest.FixtureRequest) -> HandlerCase:
    """Each handler that attacks the pool itself (kills its fork server, writes garbage to
    every descriptor, closes them all), with the outcome its job ends with through a
    worker: run it beside ordinary jobs and check the worker goes on serving."""
    return _handler_case(request, "sandboxq_hostile_handler")


# -- no orphans ------------------------------------------------------------------------------


def _snapshot() -> dict[int, str]:
    from sandboxq.pool.linux import become_subreaper
    from sandboxq.testing.processes import descendants

    # Until the check: what the test double-forks (a daemon, setsid) is re-parented here,
    # not to init, so it still descends from this process and is found.
    become_subreaper()
    return descendants()


@pytest.fixture
def sandboxq_no_orphans(request: pytest.FixtureRequest) -> None:
    """Fail the test if a process it started is still alive once its teardown is done
    (checked after every fixture of the test has been torn down, so workers are stopped
    first). The same as ``@pytest.mark.sandboxq_no_orphans``."""
    if _SNAPSHOT not in request.node.stash:
        request.node.stash[_SNAPSHOT] = _snapshot()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("sandboxq_no_orphans") is not None:
        item.stash[_SNAPSHOT] = _snapshot()  # before any fixture starts anything


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    try:
        yield
    except BaseException as exc:
        if (leaked := _orphans(item)) is not None:
            exc.add_note(leaked)
        raise
    if (leaked := _orphans(item)) is not None:
        pytest.fail(leaked, pytrace=False)


def _orphans(item: pytest.Item) -> str | None:
    """What outlived ``item`` (killed now, so it cannot disturb later tests), or None."""
    before = item.stash.get(_SNAPSHOT, None)
    if before is None:
        return None
    del item.stash[_SNAPSHOT]
    from sandboxq.pool.kill import kill_tree
    from sandboxq.testing.processes import describe, reap_adopted, survivors

    grace_s = float(item.config.getini("sandboxq_orphan_grace_s"))
    leaked = survivors(before, grace_s)
    for pid in leaked:
        kill_tree(pid)
    reap_adopted(before)
    if not leaked:
        return None
    return (
        f"sandboxq_no_orphans: {len(leaked)} process(es) started by the test were still "
        f"alive {grace_s:g} s after its teardown (now killed):\n{describe(leaked)}"
    )
