"""Fixtures of the bad-input suite (invariant 7: bad input gets a clear error, never a
dead worker): both backends, and workers on background threads that must survive."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from sandboxq import Queue
from sandboxq.worker import SandboxWorker

from .support import H, StartWorker


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
def start_worker(url: str, queue_name: str) -> Iterator[StartWorker]:
    """Run workers on background threads; each is checked to be still running at teardown
    (bad input must never kill it), then stopped and joined."""
    running: list[tuple[SandboxWorker, threading.Thread]] = []

    def start(processor: str, **kwargs: Any) -> SandboxWorker:
        kwargs.setdefault("concurrency", 1)
        kwargs.setdefault("lease_s", 5.0)
        worker = SandboxWorker(queue_name, H + processor, url=url, **kwargs)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        running.append((worker, thread))
        return worker

    yield start
    alive = [thread.is_alive() for _, thread in running]
    for worker, _ in running:
        worker.stop(now=True)
    for _, thread in running:
        thread.join(20)
    assert all(alive), "a worker died while it was served bad input"
    assert not any(thread.is_alive() for _, thread in running), "a worker did not stop"
