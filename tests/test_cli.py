"""The ``sandboxq`` command line against a real redis-server."""

from __future__ import annotations

import time

import psutil
import pytest

from sandboxq.errors import BackendError
from sandboxq.testing.redis_server import free_port
from sandboxq.worker import SandboxWorker

H = "sandboxq.testing.handlers:"


def _family() -> set[int]:
    """Every live process below this one, shared helpers (fork server...) included."""
    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()}


@pytest.mark.timeout(30)
def test_a_worker_fails_fast_and_starts_nothing_when_its_backend_is_unreachable(
    queue_name: str,
) -> None:
    """A wrong URL is a startup error: no pool, no fork server, a BackendError at once."""
    before = _family()
    worker = SandboxWorker(
        queue_name, H + "echo", url=f"redis://127.0.0.1:{free_port()}/0", concurrency=2
    )
    started = time.monotonic()
    with pytest.raises(BackendError, match="unreachable"):
        worker.run()
    assert time.monotonic() - started < 10
    assert _family() <= before
