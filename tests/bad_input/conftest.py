"""Fixtures of the bad-input suite (design invariant 7: bad input gets a clear error, never a
dead worker): workers on background threads that must survive. The ``url`` and ``queue``
fixtures (both backends) come from the suite's conftest."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sandboxq.testing.workers import BackgroundWorkers, StartWorker
from sandboxq.worker import SandboxWorker

from .support import H


@pytest.fixture
def start_worker(url: str, queue_name: str) -> Iterator[StartWorker]:
    """Run workers on background threads; each is checked to be still running at teardown
    (bad input must never kill it), then stopped and joined."""
    workers = BackgroundWorkers(join_timeout_s=20)

    def start(processor: str, **kwargs: Any) -> SandboxWorker:
        options = {"concurrency": 1, "lease_s": 5.0, **kwargs}
        return workers.start(queue_name, H + processor, url=url, **options)

    yield start
    workers.stop_all(died_of="bad input")
