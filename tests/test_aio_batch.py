"""``sandboxq.aio.Queue.batch``: the asyncio twin of ``Queue.batch`` on memory:// and a real
Redis, against real workers: the same answers, the same refusals (word for word), and an
event loop that keeps running while a batch is streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import pytest

from sandboxq import JobFailed, JobState, Queue, aio
from sandboxq.batch import AsyncBatch
from sandboxq.errors import BatchNotFound, ConfigError, SerializationError
from sandboxq.models import member_id
from sandboxq.testing.workers import BackgroundWorkers

H = "sandboxq.testing.handlers:"


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coro

    return asyncio.run(main())


@pytest.mark.timeout(90)
def test_an_async_batch_runs_streams_collects_retries_and_forgets(
    url: str, queue_name: str, workers: BackgroundWorkers
) -> None:
    async def main() -> None:
        async with aio.Queue(queue_name, url) as q, aio.Queue(queue_name + "-then", url) as then:
            calls: list[tuple[list[Any], dict[str, Any]]] = [([0, i], {}) for i in range(5)]
            calls[2] = (["soon"], {})  # raises TypeError: failed, no retries
            batch = await q.options(priority=3).batch(calls, then=then.name)
            assert isinstance(batch, AsyncBatch) and len(batch) == 5
            assert [j.id for j in batch.jobs()] == [member_id(batch.id, i) for i in range(5)]
            assert (await batch.jobs()[0].info()).options.priority == 3
            progress = await batch.progress()
            assert (progress.total, progress.waiting, progress.done) == (5, 5, False)
            workers.start(queue_name, H + "succeed_after", url=url, concurrency=2)

            # the loop runs on while as_completed waits: a ticker counts meanwhile
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticking = asyncio.create_task(ticker())
            again = await q.get_batch(batch.id)  # a second handle
            streamed = [job.id async for job in again.as_completed(timeout_s=60)]
            ticking.cancel()
            assert sorted(streamed) == sorted(member_id(batch.id, i) for i in range(5))
            assert ticks > 0
            results = await batch.results(timeout_s=30)
            assert [r for i, r in enumerate(results) if i != 2] == [0, 1, 3, 4]
            assert isinstance(results[2], JobFailed) and "TypeError" in str(results[2].error)
            done = await batch.wait(timeout_s=5)
            assert (done.completed, done.failed, done.done, done.then_sent) == (4, 1, True, True)
            assert await batch.retry_failed() == 1
            assert isinstance((await batch.results(timeout_s=30))[2], JobFailed)
            follow_up = then.job(batch.id + ".then")
            assert (await follow_up.info()).state is JobState.WAITING  # sent once
            await batch.forget()
            with pytest.raises(BatchNotFound):
                await batch.progress()
            with pytest.raises(BatchNotFound):
                await q.get_batch(batch.id)

    run(main())


@pytest.mark.timeout(60)
def test_a_done_async_batch_is_read_whole_whatever_the_timeout(url: str, queue_name: str) -> None:
    async def main() -> None:
        async with aio.Queue(queue_name, url) as q:
            batch = await q.batch([([i], {}) for i in range(2500)])
            with pytest.raises(TimeoutError, match="2500 of 2500 members not finished"):
                await batch.wait(timeout_s=0)
            assert await batch.cancel() == 2500
            assert (await batch.wait(timeout_s=0)).done
            assert len([j async for j in batch.as_completed(timeout_s=0)]) == 2500
            assert len(await batch.results(timeout_s=0)) == 2500

    run(main())


@pytest.mark.timeout(60)
def test_an_async_wait_after_a_retry_waits_for_the_retried_members(
    url: str, queue_name: str
) -> None:
    """As the sync test: a batch of one read's worth (1,000), done, then retried."""

    async def main() -> None:
        async with aio.Queue(queue_name, url) as q:
            batch = await q.batch([([i], {}) for i in range(1000)])
            assert await batch.cancel() == 1000 and (await batch.wait(timeout_s=0)).done
            assert await batch.retry_failed() == 1000
            with pytest.raises(TimeoutError, match="1000 of 1000 members not finished"):
                await batch.wait(timeout_s=0.2)

    run(main())


@pytest.mark.timeout(60)
def test_cancel_stops_the_members_that_have_not_run(url: str, queue_name: str) -> None:
    async def main() -> None:
        async with aio.Queue(queue_name, url) as q:
            batch = await q.batch([([i], {}) for i in range(1200)])  # chunks of 500 and more
            assert (await batch.progress()).waiting == 1200
            assert await batch.cancel() == 1200
            progress = await batch.wait(timeout_s=10)
            assert (progress.cancelled, progress.done) == (1200, True)
            results = await batch.results()
            assert len(results) == 1200 and all(isinstance(r, JobFailed) for r in results)
            with pytest.raises(TimeoutError, match="2 of 2 members not finished"):
                other = await q.batch([([1], {}), ([2], {})])
                started = time.monotonic()
                await other.wait(timeout_s=0.3)
            assert time.monotonic() - started < 2

    run(main())


def test_refusals_are_the_sync_apis_word_for_word(url: str, queue_name: str) -> None:
    bad: list[tuple[Any, ...]] = [
        ([], None),
        ([([1], {})], "no way"),
        ([([1], {}), "not a call"], None),
        ([([object()], {})], None),
    ]
    sync = Queue(queue_name, url)

    async def main() -> None:
        async with aio.Queue(queue_name, url) as q:
            for calls, then in bad:
                with pytest.raises((ConfigError, SerializationError)) as a:
                    await q.batch(calls, then=then)
                with pytest.raises((ConfigError, SerializationError)) as s:
                    sync.batch(calls, then=then)
                assert (type(a.value), str(a.value)) == (type(s.value), str(s.value))
            with pytest.raises(ConfigError, match="job_id"):
                await q.options(job_id="x").batch([([1], {})])
            started = time.monotonic()
            with pytest.raises(BatchNotFound, match="does not exist"):
                await q.get_batch("0123456789abcdef")
            assert time.monotonic() - started < 1
            with pytest.raises(ConfigError, match="batch id"):
                await q.get_batch("a.b")
            assert sum((await q.counts()).values()) == 0

    try:
        run(main())
    finally:
        sync.close()
