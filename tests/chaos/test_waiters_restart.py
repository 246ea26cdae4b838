"""Redis dies (SIGKILL, AOF with appendfsync always) while coroutines and threads wait for
results, and comes back on the same port: the finish listeners reconnect by themselves and
every waiter gets its result once a worker runs the jobs."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from sandboxq import Queue, aio
from sandboxq.backends.redis import finishes
from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.workers import BackgroundWorkers

pytestmark = pytest.mark.timeout(120)

H = "sandboxq.testing.handlers:"
COROUTINES = 150
THREADS = 20


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(appendonly=True) as server:
        yield server


def listeners(url: str) -> int:
    with redis.Redis.from_url(url) as raw:
        return sum(1 for c in raw.client_list() if c.get("name") == finishes.CLIENT_NAME)


async def until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.02)


def test_waiters_outlive_a_redis_restart(
    server: RedisServer, queue_name: str, workers: BackgroundWorkers, caplog: Any
) -> None:
    url = server.url

    async def main() -> None:
        async with aio.Queue(queue_name, url) as q:
            jobs = await q.enqueue_many([((i,), {}) for i in range(COROUTINES + THREADS)])
            waiting = asyncio.gather(*(j.result(timeout_s=90) for j in jobs[:COROUTINES]))
            results: list[Any] = []
            sync_queue = Queue(queue_name, url)

            def wait(job_id: str) -> None:
                try:
                    results.append(sync_queue.job(job_id).result(timeout_s=90))
                except Exception as exc:
                    results.append(exc)

            threads = [threading.Thread(target=wait, args=(job.id,)) for job in jobs[COROUTINES:]]
            for t in threads:
                t.start()
            await until(
                lambda: finishes.parked_count() == COROUTINES + THREADS and listeners(url) == 2,
                30,
                "every waiter, on this loop's listener and the threads'",
            )
            assert server.process is not None
            server.process.send_signal(signal.SIGKILL)
            server.stop()
            # the subject: Redis is down while they wait; both listeners notice
            await until(
                lambda: caplog.text.count("finish listener on") >= 2, 10, "both listeners to notice"
            )
            server.start()
            await until(lambda: listeners(url) == 2, 10, "both listeners to reconnect")
            assert finishes.waiting_count() == COROUTINES + THREADS  # no waiter gave up
            workers.start(queue_name, H + "echo", url=url, concurrency=2)
            assert await waiting == list(range(COROUTINES))
            for t in threads:
                await asyncio.to_thread(t.join, 60)
            assert sorted(results) == list(range(COROUTINES, COROUTINES + THREADS))
            sync_queue.close()
        assert caplog.text.count("reconnected") == 2

    asyncio.run(main())
