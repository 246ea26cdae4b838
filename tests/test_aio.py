"""``sandboxq.aio``: the asyncio producer, on memory:// and a real Redis, against real
workers. Its refusals must be the synchronous API's, word for word."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest

from sandboxq import Queue, aio
from sandboxq.backends.redis import aio_finishes, finishes
from sandboxq.backends.redis.aio_lane import SLICE, Coalescer
from sandboxq.errors import ConfigError, JobFailed
from sandboxq.models import JobState
from sandboxq.testing.workers import BackgroundWorkers
from tests.support.server_stats import script_calls

H = "sandboxq.testing.handlers:"


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coro

    return asyncio.run(main())


@pytest.mark.timeout(60)
def test_enqueue_and_await_results_from_a_real_worker(
    url: str, queue_name: str, workers: BackgroundWorkers
) -> None:
    async def main() -> None:
        async with aio.Queue(queue_name, url) as q:
            one = await q.enqueue(1, 2, k="v")
            assert await one.state() is JobState.WAITING
            many = await q.options(priority=5).enqueue_many([((i,), {}) for i in range(4)])
            assert (await many[0].info()).options.priority == 5
            workers.start(queue_name, H + "echo", url=url)
            assert await one.result(timeout_s=30) == [[1, 2], {"k": "v"}]
            assert [await j.result(timeout_s=30) for j in many] == [0, 1, 2, 3]
            counts = await q.counts()
            assert counts[JobState.COMPLETED] == 5
            kinds = [event.kind async for event in q.events()]
            assert kinds.count("added") == 5 and kinds.count("completed") == 5

    run(main())


@pytest.mark.timeout(60)
def test_failures_cancel_retry_and_timeouts(
    url: str, queue_name: str, workers: BackgroundWorkers
) -> None:
    async def main() -> None:
        async with aio.Queue(queue_name, url) as q:
            waiting = await q.enqueue()
            with pytest.raises(TimeoutError):
                await waiting.result(timeout_s=0.2)
            assert await waiting.cancel() is True
            with pytest.raises(JobFailed) as failed:
                await waiting.result(timeout_s=5)
            assert failed.value.job_id == waiting.id
            assert await waiting.retry() is True  # cancelled jobs can be retried
            assert await waiting.state() is JobState.WAITING
            assert await waiting.cancel() is True
            dup = await q.options(job_id="only-one").enqueue()
            again = await q.options(job_id="only-one").enqueue()
            assert again.id == dup.id == "only-one"
            assert (dup.created, again.created) == (True, False)
            exits = await q.options(retries=0).enqueue(code=3)
            workers.start(queue_name, H + "sys_exit", url=url, concurrency=1)
            with pytest.raises(JobFailed, match="exit"):
                await exits.result(timeout_s=30)
            assert await exits.retry() is True

    run(main())


class Ticker:
    """Sleeps ``every_s`` on the event loop, again and again, once started: ``ticks`` says
    how often it got to run, ``late_s`` the most it ever woke up late (a blocked loop)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.ticks = 0
        self.late_s = 0.0

    async def run(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.every_s)
            self.late_s = max(self.late_s, time.monotonic() - before - self.every_s)
            self.ticks += 1


def test_a_wait_never_blocks_the_event_loop(url: str, queue_name: str) -> None:
    async def main() -> int:
        ticker = Ticker(0.01)
        async with aio.Queue(queue_name, url) as q:
            job = await q.enqueue()
            task = asyncio.create_task(ticker.run())
            with pytest.raises(TimeoutError):
                await job.result(timeout_s=0.5)
            task.cancel()
        return ticker.ticks

    # 50 ticks would fit in 0.5 s; a blocked loop would manage none until the wait ended
    assert run(main()) >= 10


# -- the same refusals as the synchronous API ----------------------------------------------

BAD: list[tuple[str, Callable[[Any], Any]]] = [
    ("timeout_s NaN", lambda q: q.job("x").result(timeout_s=float("nan"))),
    ("since", lambda q: q.events(since="yesterday")),
    ("block_s", lambda q: q.events(block_s="long")),
    ("a call that is no pair", lambda q: q.enqueue_many(["ab"])),
    ("job_id with several calls", lambda q: q.options(job_id="j").enqueue_many([((), {})] * 2)),
    ("an unserializable argument", lambda q: q.enqueue({1, 2})),
    ("a bad option", lambda q: q.options(priority="high")),
    ("an unknown option", lambda q: q.options(colour="red")),
    ("a bad job id", lambda q: q.job("")),
    ("a job that does not exist", lambda q: q.job("nope").info()),
]


def answer(call: Callable[[], Any]) -> tuple[object, ...]:
    """What a call gave: ("returned", value) or ("raised", type, text)."""
    try:
        return ("returned", call())
    except Exception as exc:
        return ("raised", type(exc), str(exc))


async def async_answer(call: Callable[[], Any]) -> tuple[object, ...]:
    """``answer`` of a call that may return a coroutine (awaited) or raise at once."""
    try:
        result = call()
        return ("returned", await result if asyncio.iscoroutine(result) else result)
    except Exception as exc:
        return ("raised", type(exc), str(exc))


def refusal(call: Callable[[], Any]) -> tuple[object, ...]:
    got = answer(call)
    assert got[0] == "raised", f"no error: {got}"
    return got


async def async_refusal(call: Callable[[], Any]) -> tuple[object, ...]:
    got = await async_answer(call)
    assert got[0] == "raised", f"no error: {got}"
    return got


@pytest.mark.parametrize("what, call", BAD, ids=[what for what, _ in BAD])
def test_refusals_match_the_sync_api(
    url: str, queue_name: str, what: str, call: Callable[[Any], Any]
) -> None:
    async def main() -> tuple[type[BaseException], str]:
        async with aio.Queue(queue_name, url) as async_q:
            return await async_refusal(lambda: call(async_q))

    with Queue(queue_name, url) as sync_q:
        assert run(main()) == refusal(lambda: call(sync_q))


def test_sentinel_and_cluster_urls_are_refused_with_the_way_out(queue_name: str) -> None:
    for url in ("redis+sentinel://h:26379/m", "redis+cluster://h:7000"):
        with pytest.raises(ConfigError, match=r"use sandboxq\.Queue"):
            aio.Queue(queue_name, url)
    with pytest.raises(ConfigError, match="unsupported backend URL"):
        aio.Queue(queue_name, "ftp://x")


def test_enqueue_many_of_ten_thousand_yields_to_the_loop(redis_url: str, queue_name: str) -> None:
    async def main() -> float:
        ticker = Ticker(0.001)
        async with aio.Queue(queue_name, redis_url) as q:
            task = asyncio.create_task(ticker.run())
            await asyncio.sleep(0.01)
            jobs = await q.enqueue_many([((i,), {}) for i in range(10_000)])
            task.cancel()
            assert len(jobs) == 10_000
            assert (await q.counts())[JobState.WAITING] == 10_000
        return ticker.late_s

    # the bound is bench/'s job (aio_bench.py); this checks only that the loop kept turning
    assert run(main()) < 5.0


@pytest.mark.timeout(30)
def test_one_round_trip_answering_many_callers_resumes_them_a_slice_at_a_time() -> None:
    """Every caller a round trip answers runs before the loop looks at anything else: a
    thousand woken waiters parsing their records held it for 100 ms. They are resumed
    SLICE at a time, so what else is ready (here: a callback the first one schedules)
    runs long before the last of 200 callers."""

    async def main() -> list[object]:
        order: list[object] = []
        release = asyncio.Event()

        async def send(items: list[int]) -> list[int | BaseException]:
            await release.wait()  # the first send holds until every caller has queued
            return list(items)

        lane: Coalescer[int, int] = Coalescer(send)
        in_flight = asyncio.create_task(lane.add(-1))

        async def caller(i: int) -> None:
            assert await lane.add(i) == i
            if not order:
                asyncio.get_running_loop().call_soon(order.append, "other work")
            order.append(i)

        callers = [asyncio.create_task(caller(i)) for i in range(200)]
        await asyncio.sleep(0)  # each has queued behind the send in flight
        release.set()
        await asyncio.gather(in_flight, *callers)
        return order

    order = run(main())
    assert sorted(i for i in order if isinstance(i, int)) == list(range(200))
    assert order.index("other work") <= 2 * SLICE, order.index("other work")


@pytest.mark.timeout(30)
def test_a_coroutine_waiter_keeps_every_wake_its_wait_did_not_take() -> None:
    """aio_finishes.Waiter: a wake before the wait, or after a wait that timed out (but
    before its coroutine resumed), is taken by the next wait; a wake during a wait ends it;
    a wake after a cancelled wait raises nothing in the listener."""

    async def main() -> None:
        waiter = aio_finishes.Waiter()
        waiter.wake(None)  # no wait under way
        assert await waiter.wait(5.0) is True
        assert await waiter.wait(0.01) is False  # that wake was taken

        waiting = asyncio.ensure_future(waiter.wait(5.0))
        await asyncio.sleep(0)
        waiter.wake(JobState.COMPLETED)
        assert await waiting is True and waiter.told() is JobState.COMPLETED

        timing_out = asyncio.ensure_future(waiter.wait(0.01))
        await asyncio.sleep(0)
        # due just after its timer: runs once that fired, before the coroutine resumes
        asyncio.get_running_loop().call_later(0.01, waiter.wake, None)
        assert await timing_out is False
        assert await waiter.wait(5.0) is True  # the wake that came too late is kept

        cancelled = asyncio.ensure_future(waiter.wait(5.0))
        await asyncio.sleep(0)
        cancelled.cancel()
        waiter.wake(None)  # the listener must not trip on the cancelled wait
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert finishes.parked_count() == 0

    run(main())


def test_concurrent_enqueues_share_script_calls_and_keep_their_answers(
    redis_url: str, raw: Any, queue_name: str
) -> None:
    async def main() -> None:
        async with aio.Queue(queue_name, redis_url) as q:
            await q.enqueue("warm-up")
            before = script_calls(raw)
            jobs = await asyncio.gather(*(q.enqueue(i) for i in range(200)))
            calls = script_calls(raw) - before
            assert len({job.id for job in jobs}) == 200
            assert calls < 50, f"{calls} script calls for 200 concurrent enqueues"
            assert [(await j.info()).state for j in jobs[:3]] == [JobState.WAITING] * 3
            same = q.options(job_id="once")
            dupes = await asyncio.gather(*(same.enqueue(i) for i in range(10)))
            assert {job.id for job in dupes} == {"once"}
            counts = await q.counts()
            assert counts[JobState.WAITING] == 1 + 200 + 1

    run(main())


def test_the_async_redis_backend_reads_and_waits_as_the_sync_one(
    redis_url: str, raw: Any, queue_name: str
) -> None:
    # Imported here, as sandboxq.aio does: a producer on memory:// loads no Redis client.
    from sandboxq.backends.redis import RedisBackend
    from sandboxq.backends.redis.aio import AsyncRedisBackend
    from sandboxq.backends.redis.keys import QueueKeys

    raw.set(QueueKeys(queue_name).job("broken"), "not a hash")  # changed by hand
    calls: list[tuple[str, Callable[[Any], Any]]] = [
        ("a record that is not a hash", lambda b: b.get("broken")),
        ("its result", lambda b: b.get_result("broken")),
        ("a job that does not exist", lambda b: b.get("nope")),
        ("waiting for one", lambda b: b.wait_for_finish("nope", 5.0)),
        ("waiting for the broken one", lambda b: b.wait_for_finish("broken", 5.0)),
    ]

    async def answers() -> list[object]:
        backend = AsyncRedisBackend(redis_url, queue_name)
        try:
            return [await async_answer(partial(call, backend)) for _, call in calls]
        finally:
            await backend.close()

    sync = RedisBackend(redis_url, queue_name)
    try:
        expected = [answer(partial(call, sync)) for _, call in calls]
    finally:
        sync.close()
    started = time.monotonic()
    assert run(answers()) == expected
    assert time.monotonic() - started < 2.0  # a job that does not exist is said so at once


@pytest.mark.timeout(60)
def test_a_long_round_trip_that_keeps_flowing_is_not_taken_for_an_unreachable_redis(
    redis_url: str, raw: Any, queue_name: str
) -> None:
    """The async lane's timeout covered a whole round trip: 200 waiters' reads in one trip,
    parsed while other threads held the GIL, took longer than it and failed as "Redis is
    unreachable" while every reply was arriving. Here a slow link (512 KB/s) carries 1 MB
    of results in 2 s, a piece every 32 ms, against a 1 s timeout."""
    from sandboxq.backends.redis.aio import AsyncRedisBackend
    from sandboxq.backends.redis.keys import QueueKeys
    from tests.support.proxy import TcpProxy

    keys = QueueKeys(queue_name)
    ids = [f"big-{n}" for n in range(16)]
    for job_id in ids:  # completed jobs of 64 KB results, as a worker leaves them
        raw.hset(keys.job(job_id), mapping={"state": "completed", "codec": "json",
                                             "result": '"' + "x" * 65536 + '"'})  # fmt: skip
    port = raw.connection_pool.connection_kwargs["port"]

    async def read_all(url: str) -> list[bytes | None]:
        backend = AsyncRedisBackend(url, queue_name, socket_timeout_s=1.0)
        try:
            return await asyncio.gather(*(backend.get_result(i) for i in ids))
        finally:
            await backend.close()

    with TcpProxy("127.0.0.1", port, rate_bytes_s=512 * 1024) as proxy:
        started = time.monotonic()
        results = run(read_all(proxy.url))
        took = time.monotonic() - started
    assert [len(r or b"") for r in results] == [65538] * 16
    assert took > 1.5, f"{took:.1f} s: the link was not slow, the test proved nothing"
