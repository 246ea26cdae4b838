"""Backend URLs and options: a URL that names no backend, a malformed Redis URL, a
misspelt or invalid backend option, each gets an error naming it; an unreachable Redis
fails the worker's start with the address, and leaves no child or thread behind.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxq import BackendError, ConfigError, Queue, aio
from sandboxq.backends import REDIS_SCHEMES
from sandboxq.testing.redis_server import free_port
from sandboxq.worker import SandboxWorker

from .support import H

pytestmark = pytest.mark.timeout(60)

# Every scheme the backends take (a generated "redis+sentinel://" once fell through a
# shorter list of its own here).
_SCHEMES = ("memory://", *REDIS_SCHEMES)


@settings(deadline=None, max_examples=100)
@given(url=st.text(max_size=30).filter(lambda u: u and not u.startswith(_SCHEMES)))
def test_a_url_that_names_no_backend_is_refused_by_name(url: str) -> None:
    with pytest.raises(ConfigError) as refused:
        Queue("never-created", url=url)
    assert f"unsupported backend URL {url!r}" in str(refused.value)


@pytest.mark.parametrize("url", [123, b"redis://localhost", ["memory://"], 1.5])
def test_a_url_that_is_not_text_is_refused(queue_name: str, url: Any) -> None:
    with pytest.raises(ConfigError, match="a backend URL is a string"):
        Queue(queue_name, url=url)


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("redis://localhost:notaport/0", "Port could not be cast to integer"),
        ("redis://localhost:99999/0", "Port out of range"),
        ("redis://[::1/0", "Invalid IPv6 URL"),
        ("redis://localhost/0?socket_timeout=soon", "socket_timeout"),
        ("redis://user:secret@localhost:notaport/0", "Port could not be cast"),
        ("redis://user:secret@localhost/db1", "the database must be a number, e.g. /0, got 'db1'"),
    ],
)
def test_a_malformed_redis_url_is_a_config_error_without_the_password(
    queue_name: str, url: str, needle: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        Queue(queue_name, url=url)
    message = str(refused.value)
    assert message.startswith("invalid Redis URL ") and needle in message
    assert "secret" not in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["abc", "3/zzz", "1/2", "-1", "\u0661"])
def test_a_redis_url_whose_database_is_not_a_number_is_refused(
    redis_url: str, queue_name: str, path: str
) -> None:
    """Regression: redis-py reads a database it cannot parse as database 0 (and ``/1/2``
    as 12), so the queue was silently another database's."""
    url = f"{redis_url.rpartition('/')[0]}/{path}"
    expected = f"invalid Redis URL {url!r}: the database must be a number, e.g. /0, got {path!r}"
    with pytest.raises(ConfigError) as refused:
        Queue(queue_name, url=url)
    assert str(refused.value) == expected
    with pytest.raises(ConfigError) as refused:
        aio.Queue(queue_name, url=url)
    assert str(refused.value) == expected
    with Queue(queue_name, url=f"{redis_url.rpartition('/')[0]}/1/") as queue:
        assert queue.counts()  # a number, with a slash after it, is a database


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"retain_completed": -1}, "retain_completed must be a non-negative number, got -1"),
        ({"retain_failed": float("nan")}, "retain_failed must be a non-negative number, got nan"),
        ({"retain_s": float("inf")}, "retain_s must be a non-negative number, got inf"),
        ({"max_events": "many"}, "max_events must be a non-negative number, got 'many'"),
        ({"max_events": True}, "max_events must be a non-negative number, got True"),
    ],
)
def test_invalid_backend_options_are_refused_by_name(
    url: str, queue_name: str, options: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        Queue(queue_name, url=url, **options)
    assert needle in str(refused.value)


def test_a_misspelt_backend_option_is_refused_even_by_a_shared_memory_queue(
    url: str, queue_name: str
) -> None:
    """The in-process backend is shared by every ``Queue`` of one name; options only
    apply when it is created, but a wrong one is an error every time."""
    with Queue(queue_name, url=url):  # the queue exists now
        with pytest.raises(TypeError, match="unexpected keyword argument 'retain_complete'"):
            Queue(queue_name, url=url, retain_complete=5)
        with pytest.raises(ConfigError, match="retain_failed must be a non-negative number"):
            Queue(queue_name, url=url, retain_failed=-1)
        with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
            SandboxWorker(queue_name, H + "echo", url=url, backend_options={"bogus": 1})


def _supervisors() -> int:
    return sum(t.name == "sandboxq-supervisor" for t in threading.enumerate())


def _live_descendants() -> set[int]:
    """Every process below this one, fork server children included (the leak check in
    conftest leaves those out, since the fork server is shared)."""
    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.add(proc.pid)
        except psutil.Error:
            continue
    return found


def test_an_unreachable_redis_fails_the_worker_start_and_leaves_nothing_running(
    queue_name: str,
) -> None:
    """Regression: the pool was started before the backend was first used, so when Redis
    could not be reached run() raised with every child and the supervisor thread still
    running (until the process exited)."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    worker = SandboxWorker(queue_name, H + "echo", url=url, concurrency=2)
    supervisors, processes = _supervisors(), _live_descendants()
    started = time.monotonic()
    with pytest.raises(BackendError, match=f"Redis at {url} is unreachable"):
        worker.run()
    assert time.monotonic() - started < 10
    assert _supervisors() == supervisors
    assert _live_descendants() <= processes
