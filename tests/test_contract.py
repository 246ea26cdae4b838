"""The backend contract (``tests.support.contract``) against every backend, and what only
the in-memory backend can show."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sandboxq.backends.base import Backend, NewJob
from sandboxq.backends.memory import MemoryBackend
from sandboxq.errors import ConfigError
from sandboxq.models import JobState
from tests.support.contract import BackendContract, MakeBackend

pytestmark = pytest.mark.timeout(15)


@pytest.fixture
def backend(make_backend: MakeBackend) -> Backend:
    return make_backend()


class TestMemoryBackend(BackendContract):
    @pytest.fixture
    def make_backend(self, queue_name: str) -> Iterator[MakeBackend]:
        made: list[MemoryBackend] = []

        def make(**options: Any) -> Backend:
            # A private instance, not the shared registry: each test gets an empty queue.
            made.append(MemoryBackend(f"{queue_name}-{len(made)}", **options))
            return made[-1]

        yield make
        for backend in made:
            backend.close()

    def test_shared_instance_per_queue_name(self, queue_name: str) -> None:
        first = MemoryBackend.shared(queue_name)
        assert MemoryBackend.shared(queue_name) is first
        assert MemoryBackend.shared(f"{queue_name}-other") is not first

    def test_invalid_options_fail_at_enqueue_and_add_nothing(self, backend: Backend) -> None:
        # As in Redis: a record that is stored can always be claimed and read back.
        bad = NewJob(b"[[],{}]", "json", "{oops", "bad")
        with pytest.raises(ConfigError, match="bad"):
            backend.enqueue([NewJob(b"[[],{}]", job_id="good"), bad])
        with pytest.raises(ConfigError, match="priority"):
            backend.enqueue([NewJob(b"[[],{}]", priority=10**6)])
        assert backend.get("good") is None and backend.counts()[JobState.WAITING] == 0

    def test_events_since_any_id_of_a_trimmed_stream(self, make_backend: MakeBackend) -> None:
        # The new events are read off the end of a capped stream: from an id it still
        # holds, from one trimmed away, from the newest, and from one not reached yet.
        backend = make_backend(max_events=50)
        backend.enqueue([NewJob(b"[[],{}]", job_id=f"j{i}") for i in range(120)])
        ids = [int(e.id) for e in backend.events()]
        assert ids == list(range(71, 121))  # the newest 50 of 120 "added" events
        assert [int(e.id) for e in backend.events(since="100")] == list(range(101, 121))
        assert [int(e.id) for e in backend.events(since="3")] == ids
        assert list(backend.events(since="120")) == []
        assert list(backend.events(since="500")) == []


class TestRedisBackend(BackendContract):
    @pytest.fixture
    def make_backend(self, redis_url: str, queue_name: str) -> Iterator[MakeBackend]:
        # Imported here so the memory tests run wherever the Redis backend does not (yet).
        from sandboxq.backends.redis.backend import RedisBackend

        made: list[RedisBackend] = []

        def make(**options: Any) -> Backend:
            made.append(RedisBackend(redis_url, f"{queue_name}-{len(made)}", **options))
            return made[-1]

        yield make
        for backend in made:
            backend.close()
