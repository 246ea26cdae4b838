"""The process check of the dashboard tests, which share one browser per module."""

from __future__ import annotations

import gc
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
    left = processes.survivors(before, grace_s=3.0, ignoring=("chrom",))
    assert not left, "processes outlived the test:\n" + processes.describe(left)
