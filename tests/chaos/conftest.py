"""Fixtures of the chaos tests: each test gets its own ``Scene`` (queue, ledger, event
tally, worker fleets), torn down and checked even when the test fails half-way."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import Scene


@pytest.fixture
def make_scene(queue_name: str, tmp_path: Path) -> Iterator[Callable[[str], Scene]]:
    scenes: list[Scene] = []

    def make(url: str) -> Scene:
        scenes.append(Scene(queue_name, url, tmp_path))
        return scenes[-1]

    yield make
    for scene in scenes:
        scene.close()


@pytest.fixture
def scene(make_scene: Callable[[str], Scene], redis_url: str) -> Scene:
    """A scene on the session's redis-server."""
    return make_scene(redis_url)
