"""Any number of waiters: ``Job.result()`` and ``batch.as_completed()`` (sync and
``sandboxq.aio``) share one finish listener per process and queue, whatever the number of
waiters, against a real redis-server and real workers finishing the jobs.

A waiter that held a blocking connection of its own made 200 coroutines awaiting
``job.result()`` fail with "Too many connections" (redis-py's asyncio pool holds 100)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from sandboxq import Queue, aio
from sandboxq.backends.redis import finishes
from sandboxq.models import JobState
from sandboxq.testing.workers import BackgroundWorkers

H = "sandboxq.testing.handlers:"


def listeners(raw: redis.Redis) -> int:
    """Connections the server holds for finish listeners (they name themselves)."""
    return sum(1 for c in raw.client_list() if c.get("name") == finishes.CLIENT_NAME)


def clients(raw: redis.Redis) -> int:
    return len(raw.client_list())


async def wait_all(jobs: list[aio.AsyncJob], timeout_s: float) -> list[Any]:
    return await asyncio.gather(*(job.result(timeout_s=timeout_s) for job in jobs))


async def until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.01)


def many_waiters(
    n: int, redis_url: str, raw: redis.Redis, queue_name: str, workers: BackgroundWorkers
) -> None:
    async def main() -> None:
        async with aio.Queue(queue_name, redis_url) as q:
            jobs = await q.enqueue_many([((i,), {}) for i in range(n)])
            before = clients(raw)
            waiting = asyncio.ensure_future(wait_all(jobs, timeout_s=120))
            # every waiter registered and parked before any job can finish
            await until(
                lambda: finishes.waiting_count() >= n and listeners(raw), 60, f"{n} waiters"
            )
            during = clients(raw)
            assert listeners(raw) == 1
            # every result is kept until read (retention keeps 1,000 completed by default)
            keep = {"retain_completed": n}
            workers.start(
                queue_name, H + "echo", url=redis_url, concurrency=2, backend_options=keep
            )
            assert await waiting == list(range(n))
            # the queue's own connections (main, lane) plus the one listener
            assert during - before <= 3, (before, during)
        await until(lambda: listeners(raw) == 0, 10, "the listener to stop")

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_200_coroutines_await_results_on_one_connection(
    redis_url: str, raw: redis.Redis, queue_name: str, workers: BackgroundWorkers
) -> None:
    many_waiters(200, redis_url, raw, queue_name, workers)


@pytest.mark.timeout(300)
def test_10000_coroutines_await_results_on_one_connection(
    redis_url: str, raw: redis.Redis, queue_name: str, workers: BackgroundWorkers
) -> None:
    many_waiters(10_000, redis_url, raw, queue_name, workers)


@pytest.mark.timeout(120)
def test_200_threads_wait_for_results_on_one_connection(
    redis_url: str, raw: redis.Redis, queue_name: str, workers: BackgroundWorkers
) -> None:
    n = 200
    with Queue(queue_name, redis_url) as q:
        jobs = q.enqueue_many([((i,), {}) for i in range(n)])
        results: list[Any] = [None] * n
        errors: list[BaseException] = []

        def wait(i: int) -> None:
            try:
                results[i] = jobs[i].result(timeout_s=60)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=wait, args=(i,)) for i in range(n)]
        before = clients(raw)
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while finishes.waiting_count() < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finishes.waiting_count() == n
        during = clients(raw)
        assert listeners(raw) == 1
        workers.start(queue_name, H + "echo", url=redis_url, concurrency=2)
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        assert results == list(range(n))
        # One listener; the rest is the queue's main pool, which keeps the connections
        # the 200 first reads opened at once (redis-py's pool grows to the commands in
        # flight): a parked waiter holds none. Each waiter's own blocking read held 200.
        assert during - before < 20, (before, during)
    deadline = time.monotonic() + 10
    while listeners(raw) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listeners(raw) == 0


@pytest.fixture
def finish_between_read_and_wait() -> Iterator[list[str]]:
    """Set the listener's test hook; the test says what it does."""
    called: list[str] = []
    yield called
    finishes.after_first_read = None


@pytest.mark.timeout(60)
def test_a_job_finishing_between_the_first_read_and_the_wait_still_wakes_its_waiter(
    redis_url: str,
    queue_name: str,
    workers: BackgroundWorkers,
    finish_between_read_and_wait: list[str],
) -> None:
    """The waiter read the job as waiting; before it parks, a real worker finishes the job
    (forced by the hook, which returns only once the job is completed). The waiter must
    return at once, not at its timeout."""
    with Queue(queue_name, redis_url) as q:
        job = q.enqueue(7)

        def finish_it(job_id: str) -> None:
            finish_between_read_and_wait.append(job_id)
            assert q.backend.get(job_id).state is JobState.WAITING  # type: ignore[union-attr]
            workers.burst(queue_name, H + "echo", url=redis_url)
            assert q.backend.get(job_id).state is JobState.COMPLETED  # type: ignore[union-attr]

        finishes.after_first_read = finish_it
        started = time.monotonic()
        assert job.result(timeout_s=20) == 7
        assert finish_between_read_and_wait == [job.id]
        assert time.monotonic() - started < 15  # woken, not timed out

        # the same race for a coroutine
        job = q.enqueue(8)

        async def main() -> Any:
            async with aio.Queue(queue_name, redis_url) as aq:
                return await aq.job(job.id).result(timeout_s=20)

        finish_between_read_and_wait.clear()
        started = time.monotonic()
        assert asyncio.run(main()) == 8
        assert finish_between_read_and_wait == [job.id]
        assert time.monotonic() - started < 15
