"""The process check of the dashboard tests, which share one browser per module."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from sandboxq.testing import processes


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """The suite's check, minus the module's one browser: Chromium starts and ends renderer
    processes as pages come and go; the browser fixture checks it left nothing behind."""
    before = processes.descendants()
    yield
    gc.collect()

    def leaked() -> dict[int, str]:
        now = processes.descendants().items()
        return {pid: cmd for pid, cmd in now if pid not in before and "chrom" not in cmd}

    deadline = time.monotonic() + 3.0
    while (left := leaked()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, "processes outlived the test:\n" + processes.describe(left)
