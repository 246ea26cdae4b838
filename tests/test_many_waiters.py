"""Any number of waiters: ``Job.result()`` and ``batch.as_completed()`` (sync and
``sandboxq.aio``) share one finish listener per process and queue, whatever the number of
waiters, against a real redis-server and real workers finishing the jobs.

A waiter that held a blocking connection of its own made 200 coroutines awaiting
``job.result()`` fail with "Too many connections" (redis-py's asyncio pool holds 100)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from sandboxq import Queue, aio
from sandboxq.backends.redis import aio_finishes, finishes, lane
from sandboxq.backends.redis.aio_lane import SLICE
from sandboxq.models import JobState
from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers

H = "sandboxq.testing.handlers:"


class Server:
    """The session's redis-server as one test sees it: only connections opened since the
    test began count (the one before may still be closing its listener: a listener
    leaves after its read returns, up to ``finishes.LISTEN_BLOCK_S`` later)."""

    def __init__(self, raw: redis.Redis) -> None:
        self.raw = raw
        self.since = max(int(c["id"]) for c in raw.client_list())

    def _ours(self) -> list[dict[str, Any]]:
        return [c for c in self.raw.client_list() if int(c["id"]) > self.since]

    def listeners(self) -> int:
        """Connections the server holds for finish listeners (they name themselves)."""
        return sum(1 for c in self._ours() if c.get("name") == finishes.CLIENT_NAME)

    def clients(self) -> int:
        return len(self._ours())

    def blocked(self) -> int:
        """Connections parked in a blocking command (XREAD BLOCK, BLPOP)."""
        return sum(1 for c in self._ours() if "b" in c.get("flags", ""))


@pytest.fixture
def server(raw: redis.Redis) -> Server:
    return Server(raw)


async def wait_all(jobs: list[aio.AsyncJob], timeout_s: float) -> list[Any]:
    return await asyncio.gather(*(job.result(timeout_s=timeout_s) for job in jobs))


async def until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.01)


def many_waiters(
    n: int, redis_url: str, server: Server, queue_name: str, workers: BackgroundWorkers
) -> None:
    async def main() -> None:
        async with aio.Queue(queue_name, redis_url) as q:
            jobs = await q.enqueue_many([((i,), {}) for i in range(n)])
            before = server.clients()
            waiting = asyncio.ensure_future(wait_all(jobs, timeout_s=120))
            # every waiter registered and parked before any job can finish
            await until(
                lambda: finishes.parked_count() >= n and server.listeners(), 60, f"{n} waiters"
            )
            during = server.clients()
            assert server.listeners() == 1
            # every result is kept until read (retention keeps 1,000 completed by default)
            keep = {"retain_completed": n}
            workers.start(
                queue_name, H + "echo", url=redis_url, concurrency=2, backend_options=keep
            )
            assert await waiting == list(range(n))
            # the queue's own connections (main, lane) plus the one listener
            assert during - before <= 3, (before, during)
        await until(lambda: server.listeners() == 0, 10, "the listener to stop")

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_200_coroutines_await_results_on_one_connection(
    redis_url: str, server: Server, queue_name: str, workers: BackgroundWorkers
) -> None:
    many_waiters(200, redis_url, server, queue_name, workers)


@pytest.mark.alone  # holds a core
@pytest.mark.timeout(300)
def test_10000_coroutines_await_results_on_one_connection(
    redis_url: str, server: Server, queue_name: str, workers: BackgroundWorkers
) -> None:
    many_waiters(10_000, redis_url, server, queue_name, workers)


@pytest.mark.timeout(60)
def test_the_listener_wakes_its_coroutines_a_slice_at_a_time(
    redis_url: str, raw: redis.Redis, queue_name: str
) -> None:
    """Each coroutine a wake resumes runs before the loop looks at anything else, and
    after a reconnect the listener wakes every waiter at once: 10,000 of them held the
    loop for up to a quarter of a second. One read naming 200 finished jobs resumes
    their waiters SLICE at a time, so what else is ready (here: a callback the first one
    schedules) runs long before the last of them."""

    async def main() -> list[object]:
        order: list[object] = []
        async with aio.Queue(queue_name, redis_url) as q:
            keys = q.backend.keys  # type: ignore[union-attr]
            listener = aio_finishes.listener_for(redis_url, keys, 5.0)
            waiters = [aio_finishes.Waiter() for _ in range(200)]
            for i, waiter in enumerate(waiters):
                listener.board.add_job(f"job-{i}", waiter)
            await aio_finishes.ready(listener)

            async def wait(i: int) -> None:
                assert await waiters[i].wait(20.0)
                if not order:
                    asyncio.get_running_loop().call_soon(order.append, "other work")
                order.append(i)

            waiting = [asyncio.create_task(wait(i)) for i in range(200)]
            await until(lambda: finishes.parked_count() >= 200, 10, "200 waits")
            with raw.pipeline(transaction=True) as pipe:  # one read takes all 200
                for i in range(200):
                    pipe.xadd(keys.events, {"kind": "completed", "job": f"job-{i}"})
                pipe.execute()
            await asyncio.gather(*waiting)
            for i, waiter in enumerate(waiters):
                listener.board.remove_job(f"job-{i}", waiter)
        return order

    order = asyncio.run(main())
    assert sorted(i for i in order if isinstance(i, int)) == list(range(200))
    assert order.index("other work") <= 2 * SLICE, order.index("other work")


@pytest.mark.timeout(120)
def test_200_threads_wait_for_results_on_one_connection(
    redis_url: str, server: Server, queue_name: str, workers: BackgroundWorkers
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
        before = server.clients()
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while finishes.parked_count() < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finishes.parked_count() == n
        during = server.clients()
        # the listener is parked in XREAD but for a moment after each read
        blocked_during = wait_for(lambda: server.blocked() or None, 10, "the listener to block")
        assert server.listeners() == 1
        workers.start(queue_name, H + "echo", url=redis_url, concurrency=2)
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        assert results == list(range(n))
        # One blocked connection, the listener's, where each waiter's own blocking read
        # held 200; the reads share the queue's lane, whose connections are bounded.
        assert blocked_during == 1, (before, during)
        assert during - before <= lane.MAX_CONNECTIONS + 1, (before, during)
    deadline = time.monotonic() + 10
    while server.listeners() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.listeners() == 0


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


@pytest.mark.timeout(60)
def test_cancelled_waiters_leave_nothing_behind_and_the_listener_stops(
    redis_url: str, server: Server, queue_name: str
) -> None:
    async def main() -> None:
        async with aio.Queue(queue_name, redis_url) as q:
            jobs = await q.enqueue_many([((i,), {}) for i in range(500)])
            tasks = [asyncio.ensure_future(job.result(timeout_s=60)) for job in jobs]
            await until(
                lambda: finishes.parked_count() >= 500 and server.listeners(), 30, "waiters"
            )
            # half are cancelled while parked, the other half as soon as they start
            for task in tasks[:250]:
                task.cancel()
            await asyncio.sleep(0)
            late = [asyncio.ensure_future(job.result(timeout_s=60)) for job in jobs[:50]]
            for task in tasks[250:] + late:
                task.cancel()
            done = await asyncio.gather(*tasks, *late, return_exceptions=True)
            assert all(isinstance(d, asyncio.CancelledError) for d in done)
            assert finishes.waiting_count() == finishes.parked_count() == 0
            # nothing of the listener runs on: only this coroutine's own task is left (its
            # task ends a loop turn after its connection closes: looked for, not assumed)
            await until(
                lambda: server.listeners() == 0 and asyncio.all_tasks() == {asyncio.current_task()},
                5,
                "the listener to stop",
            )
            # and a new waiter starts a new one
            waiting = asyncio.ensure_future(jobs[0].result(timeout_s=0.3))
            with pytest.raises(TimeoutError):
                await waiting
            assert finishes.waiting_count() == 0

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_listener_cancelled_while_it_closes_still_closes_its_connection(
    redis_url: str, server: Server, queue_name: str
) -> None:
    """The end of ``asyncio.run`` cancels every task left, the listener's possibly while
    it closes its connection (it stops once its read returns with nobody waiting): the
    close is finished anyway. Forced: its close is held a moment, and cancelled there."""

    async def main() -> None:
        async with aio.Queue(queue_name, redis_url) as q:
            job = await q.enqueue()
            with pytest.raises(TimeoutError):
                await job.result(timeout_s=0.05)  # a listener, left with nobody to wake
            (listener,) = aio_finishes._tables[asyncio.get_running_loop()].values()
            closing = asyncio.Event()
            close = listener._client.aclose

            async def close_after_a_moment() -> None:
                closing.set()
                await asyncio.sleep(0.05)  # the cancel lands here
                await close()

            listener._client.aclose = close_after_a_moment  # type: ignore[method-assign]
            await until(closing.is_set, 5, "the listener to start closing")
            listener._task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await listener._task
            # (the server drops a closed connection a moment after its end: looked for)
            await until(lambda: server.listeners() == 0, 2, "its connection to be closed")

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_each_waiter_keeps_its_own_timeout(
    redis_url: str, queue_name: str, workers: BackgroundWorkers
) -> None:
    """Short waits end at their own timeout while longer ones on the same listener go on
    to their results; a job that never runs (another queue's worker) times out alone."""

    async def main() -> None:
        async with aio.Queue(queue_name, redis_url) as q:
            jobs = await q.enqueue_many([((i,), {}) for i in range(100)])

            async def timed(job: aio.AsyncJob, timeout_s: float) -> tuple[str, float]:
                started = time.monotonic()
                try:
                    await job.result(timeout_s=timeout_s)
                    return "result", time.monotonic() - started
                except TimeoutError:
                    return "timeout", time.monotonic() - started

            short = [asyncio.ensure_future(timed(job, 0.3)) for job in jobs[:50]]
            long = [asyncio.ensure_future(timed(job, 60)) for job in jobs]
            for kind, took_s in await asyncio.gather(*short):
                assert kind == "timeout" and 0.3 <= took_s < 2.0, (kind, took_s)
            workers.start(queue_name, H + "echo", url=redis_url, concurrency=2)
            assert {kind for kind, _ in await asyncio.gather(*long)} == {"result"}

    asyncio.run(main())
    with Queue(queue_name + "-idle", redis_url) as q:  # no worker serves it
        job = q.enqueue(1)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            q.job(job.id).result(timeout_s=0.3)
        assert 0.3 <= time.monotonic() - started < 2.0


@pytest.mark.timeout(120)
def test_many_batch_streams_share_the_listener(
    redis_url: str, server: Server, queue_name: str, workers: BackgroundWorkers
) -> None:
    """150 coroutines stream 3 batches (50 each) with ``as_completed`` and 20 threads
    stream one batch: every stream sees every member, on one listener per event loop
    (the sync one for the threads)."""

    async def main() -> None:
        async with aio.Queue(queue_name, redis_url) as q:
            batches = [await q.batch([((i,), {}) for i in range(20)]) for _ in range(3)]

            async def stream(batch: Any) -> list[str]:
                return sorted([job.id async for job in batch.as_completed(timeout_s=60)])

            streams = [asyncio.ensure_future(stream(b)) for b in batches for _ in range(50)]
            sync_queue = Queue(queue_name, redis_url)
            sync_batch = sync_queue.batch([((i,), {}) for i in range(20)])
            seen: list[list[str]] = []

            def sync_stream() -> None:
                seen.append(sorted(j.id for j in sync_batch.as_completed(timeout_s=60)))

            threads = [threading.Thread(target=sync_stream) for _ in range(20)]
            for t in threads:
                t.start()
            # (a stream leaves the board for a moment between its reads, which wait up to
            # batch.READ_SLICE_S each)
            await until(
                lambda: finishes.waiting_count() >= 100 and server.listeners() == 2,
                30,
                "the streams to wait on two listeners: this loop's and the threads'",
            )
            # Both parked in XREAD at once (each is between reads for a moment after every
            # read), and never more: 170 waiters, two blocked connections.
            await until(lambda: server.blocked() == 2, 10, "both listeners to block")
            assert server.blocked() <= 2
            workers.start(queue_name, H + "echo", url=redis_url, concurrency=2)
            got = await asyncio.gather(*streams)
            for n, ids in enumerate(got):
                assert ids == sorted(j.id for j in batches[n // 50].jobs())
            for t in threads:
                await asyncio.to_thread(t.join, 60)
            assert seen == [sorted(j.id for j in sync_batch.jobs())] * 20
            sync_queue.close()

    asyncio.run(main())


class HeldListener:
    """Holds the sync listener's thread before its next read of the stream, so that it
    reads late: what happens meanwhile is read only once ``release()`` is called."""

    def __init__(self) -> None:
        self.holding = threading.Event()
        self.held = threading.Event()
        self.released = threading.Event()
        finishes.before_listen_read = self._hook

    def _hook(self) -> None:
        if self.holding.is_set() and not self.released.is_set():
            self.held.set()
            self.released.wait(30)

    def hold(self, q: Queue) -> None:
        """Hold it at its next read: a new job's "added" event ends the read in flight."""
        self.holding.set()
        q.enqueue("nudge")
        assert self.held.wait(10), "the listener never came back to read"

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def held() -> Iterator[HeldListener]:
    holder = HeldListener()
    yield holder
    holder.release()
    finishes.before_listen_read = None


def wait_in_thread(job: Any, timeout_s: float) -> tuple[threading.Thread, list[Any]]:
    """``job.result(timeout_s)`` on a thread; what it returned or raised, once it ended."""
    out: list[Any] = []

    def wait() -> None:
        try:
            out.append(job.result(timeout_s=timeout_s))
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, out


def parked(n: int) -> None:
    deadline = time.monotonic() + 10
    while finishes.parked_count() < n:
        assert time.monotonic() < deadline, f"fewer than {n} waiters parked"
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_a_finish_trimmed_from_the_stream_before_the_listener_read_it_still_wakes(
    redis_url: str, raw: redis.Redis, queue_name: str, workers: BackgroundWorkers, held: Any
) -> None:
    """The listener reads late and the job's "completed" entry has been trimmed from the
    events stream meanwhile (as ``max_events`` trims it under a burst): the listener sees
    the stream's oldest entry past its cursor and wakes every waiter to look again."""
    with Queue(queue_name, redis_url) as q:
        job = q.enqueue(5)
        thread, out = wait_in_thread(job, 20)
        parked(1)
        held.hold(q)
        workers.burst(queue_name, H + "echo", url=redis_url)  # the job (and the nudge) end
        assert q.backend.get(job.id).state is JobState.COMPLETED  # type: ignore[union-attr]
        events = f"sq:{{{queue_name}}}:events"
        raw.xtrim(events, maxlen=0)  # its entry is gone...
        raw.xadd(events, {"kind": "progress", "job": "other"})  # ...newer ones remain
        started = time.monotonic()
        held.release()
        thread.join(15)
        assert out == [5]
        assert time.monotonic() - started < 5  # woken by the gap, not its timeout


@pytest.mark.timeout(60)
def test_a_stale_finish_read_late_does_not_end_a_wait_for_the_jobs_next_run(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, held: Any
) -> None:
    """The job is cancelled and retried while the listener is held; its waiter starts on
    the retried job. The listener then reads the old "cancelled" finish: the waiter must
    not answer JobFailed(cancelled) but go on waiting for the run that follows."""
    with Queue(queue_name, redis_url) as q:
        keeper = q.enqueue("keeper")  # a waiter that keeps the listener running
        keeping, _ = wait_in_thread(keeper, 30)
        parked(1)
        job = q.enqueue(6)
        held.hold(q)
        assert job.cancel() and job.retry()
        assert job.state() is JobState.WAITING
        thread, out = wait_in_thread(job, 20)
        parked(2)
        held.release()
        # the stale finish is read and dismissed; the job then really runs
        workers.burst(queue_name, H + "echo", url=redis_url)
        thread.join(15)
        assert out == [6]
        keeping.join(15)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("side", ["threads", "asyncio"])
def test_a_wait_goes_on_while_redis_is_unreachable(
    side: str, queue_name: str, workers: BackgroundWorkers, caplog: pytest.LogCaptureFixture
) -> None:
    """A Sentinel failover ("no master found" for a moment) or a restart while a producer
    waits: the wait's first read failed with BackendError at once, although ``result``
    promises to wait until its timeout. Forced: the server is stopped (SIGSTOP) before the
    wait begins, and continued once the wait has found it unreachable."""
    caplog.set_level(logging.INFO, logger="sandboxq.finished")
    with RedisServer() as server:
        assert server.process is not None
        with Queue(queue_name, url=server.url, socket_timeout_s=0.5) as q:
            job = q.enqueue("back")
            got: list[Any] = []

            def wait() -> None:
                try:
                    if side == "threads":
                        got.append(job.result(timeout_s=30))
                    else:

                        async def main() -> Any:
                            async with aio.Queue(
                                queue_name, server.url, socket_timeout_s=0.5
                            ) as aq:
                                return await aq.job(job.id).result(timeout_s=30)

                        got.append(asyncio.run(main()))
                except Exception as exc:  # the failure the old code had, for the assert
                    got.append(exc)

            os.kill(server.process.pid, signal.SIGSTOP)
            waiter = threading.Thread(target=wait)
            try:
                waiter.start()
                wait_for(lambda: "unreachable" in caplog.text or got, 20, "the wait to meet it")
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            worker = workers.start(q, H + "echo", concurrency=1)
            waiter.join(30)
            assert got == ["back"], got
            workers.stop(worker)
