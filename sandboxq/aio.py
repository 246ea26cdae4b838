"""The asyncio producer API: ``Queue`` and ``AsyncJob``, with the names of ``sandboxq.Queue``.

    async with sandboxq.aio.Queue("thumbs", url) as q:
        job = await q.options(hard_timeout_s=30).enqueue("a.png")
        value = await job.result(timeout_s=60)

    Queue(client.Producer) ── JobMaker (the same checks, options and NewJob as the sync API)
          ── AsyncRedisBackend (backends/redis/aio.py: redis.asyncio, the same Lua scripts;
             redis://, rediss://, unix:// only: Sentinel and Cluster producers use the
             synchronous Queue)
          ── or memory://: the process's MemoryBackend; its blocking waits run in threads

Validation, errors and the meaning of every argument are the synchronous API's, by
sharing its base class and calling its functions (``client.py``), so the two cannot drift
apart. Nothing here blocks the event loop on Redis: a wait for a result is an awaited
``XREAD BLOCK``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any, Protocol

from sandboxq import tracing
from sandboxq.backends import REDIS_SCHEMES, resolve_url
from sandboxq.backends.base import BatchAction, Event, NewJob
from sandboxq.batch import (
    AsyncBatch,
    AsyncBatchBackend,
    batch_total,
    check_batch_calls,
    new_batch_id,
)
from sandboxq.client import Call, Producer, call_pair, check_since
from sandboxq.errors import ConfigError, JobNotFound, SandboxqError
from sandboxq.finished import (
    Outage,
    Trims,
    check_seconds,
    finished_value,
    no_such_job,
    patiently_async,
    result_value,
)
from sandboxq.models import BatchProgress, JobInfo, JobState, check_batch_id, check_job_id

__all__ = ["AsyncBatch", "AsyncJob", "Queue"]

#: memory:// waits run in a thread, in slices this long, so a cancelled wait frees its
#: thread soon after.
MEMORY_WAIT_SLICE_S = 1.0
#: ``enqueue_many`` yields to the event loop after encoding this many calls (under 1 ms).
YIELD_EVERY = 100


class AsyncBackend(AsyncBatchBackend, Protocol):
    """The producer's calls of ``Backend`` (base.py, which states each contract), awaited."""

    async def enqueue(self, jobs: Sequence[NewJob]) -> list[tuple[str, bool]]: ...
    async def get(self, job_id: str) -> JobInfo | None: ...
    async def get_result(self, job_id: str) -> bytes | None: ...
    async def counts(self) -> dict[JobState, int]: ...
    async def retention_trims(self) -> Trims: ...
    async def cancel(self, job_id: str) -> bool: ...
    async def retry_failed(self, job_id: str) -> bool: ...
    async def wait_for_finish(self, job_id: str, timeout_s: float) -> JobState | None: ...
    def events(self, since: str | None, block_s: float | None) -> AsyncIterator[Event]: ...
    async def close(self) -> None: ...


class _AsyncMemory:
    """memory:// for asyncio: quick calls run inline (they only take a lock held for
    microseconds); the blocking waits run in a thread."""

    def __init__(self, queue: str, **options: Any) -> None:
        from sandboxq.backends.memory import MemoryBackend

        self._b = MemoryBackend.shared(queue, **options)

    async def enqueue(self, jobs: Sequence[NewJob]) -> list[tuple[str, bool]]:
        return self._b.enqueue(jobs)

    async def get(self, job_id: str) -> JobInfo | None:
        return self._b.get(job_id)

    async def get_result(self, job_id: str) -> bytes | None:
        return self._b.get_result(job_id)

    async def get_many(self, job_ids: Sequence[str]) -> list[tuple[JobInfo | None, bytes | None]]:
        return self._b.get_many(job_ids)

    async def completed_results(
        self, job_ids: Sequence[str]
    ) -> list[tuple[str, bytes | None] | None]:
        return self._b.completed_results(job_ids)

    async def enqueue_batch(
        self,
        batch_id: str,
        jobs: Sequence[NewJob],
        *,
        then: str | None = None,
        first: int = 0,
        label: str | None = None,
    ) -> int:
        return self._b.enqueue_batch(batch_id, jobs, then=then, first=first, label=label)

    async def batch_progress(self, batch_id: str) -> BatchProgress | None:
        return self._b.batch_progress(batch_id)

    async def batch_finished(
        self, batch_id: str, after: str, block_s: float | None = None
    ) -> tuple[str, list[tuple[int, JobState]]]:
        if block_s is None:
            return self._b.batch_finished(batch_id, after)
        return await asyncio.to_thread(self._b.batch_finished, batch_id, after, block_s)

    async def batch_each(self, batch_id: str, action: BatchAction) -> int | None:
        return self._b.batch_each(batch_id, action)

    async def forget_batch(self, batch_id: str) -> bool:
        return self._b.forget_batch(batch_id)

    async def counts(self) -> dict[JobState, int]:
        return self._b.counts()

    async def retention_trims(self) -> Trims:
        return self._b.retention_trims()

    async def cancel(self, job_id: str) -> bool:
        return self._b.cancel(job_id)

    async def retry_failed(self, job_id: str) -> bool:
        return self._b.retry_failed(job_id)

    async def wait_for_finish(self, job_id: str, timeout_s: float) -> JobState | None:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            wait = min(left, MEMORY_WAIT_SLICE_S)
            state = await asyncio.to_thread(self._b.wait_for_finish, job_id, wait)
            if state is not None:
                return state
        return None

    async def events(self, since: str | None, block_s: float | None) -> AsyncIterator[Event]:
        events: Iterator[Event] = self._b.events(since, block_s)
        done = object()
        while (event := await asyncio.to_thread(next, events, done)) is not done:
            assert isinstance(event, Event)
            yield event

    async def close(self) -> None:
        self._b.close()


def open_async_backend(url: str | None, queue: str, **options: Any) -> AsyncBackend:
    """As ``sandboxq.backends.open_backend``, for asyncio."""
    url = resolve_url(url)
    # the queue's name is checked by the backend that opens it
    if url.startswith("memory://"):
        return _AsyncMemory(queue, **options)
    if url.startswith(REDIS_SCHEMES):
        from sandboxq.backends.redis.aio import AsyncRedisBackend

        return AsyncRedisBackend(url, queue, **options)
    raise ConfigError(f"unsupported backend URL {url!r}: use memory:// or redis://host:port/db")


class AsyncJob:
    """A handle on one job; every call asks the backend afresh. ``created`` as
    ``Job.created``: whether the enqueue that made it added the job."""

    def __init__(self, queue: Queue, job_id: str, created: bool | None = None) -> None:
        self.queue = queue
        self.id = job_id
        self.created = created

    def __repr__(self) -> str:
        return f"AsyncJob({self.queue.name!r}, {self.id!r})"

    async def info(self) -> JobInfo:
        info = await self.queue.backend.get(self.id)
        if info is None:
            raise await self.not_found()
        return info

    async def state(self) -> JobState:
        return (await self.info()).state

    async def not_found(self) -> JobNotFound:
        """As ``Job.not_found``."""
        try:
            trims = await self.queue.backend.retention_trims()
        except SandboxqError:
            trims = None
        return no_such_job(self.queue.name, self.id, trims)

    async def result(self, timeout_s: float | None = None) -> Any:
        """The job's return value once it completes; ``JobFailed`` if it failed or was
        cancelled, ``TimeoutError`` if it is not finished within ``timeout_s``.

        On Redis, any number of concurrent waits on this queue in one event loop use two
        connections in all: the loop's finish listener (``backends/redis/aio_finishes.py``)
        and the queue's script connection, which their reads share. Cancelling a wait
        leaves nothing behind. While Redis is unreachable (a restart, a Sentinel
        failover) the wait goes on until ``timeout_s`` (``finished.Outage``)."""
        check_seconds("timeout_s", timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outage = Outage(f"job {self.id!r}", deadline)

        async def one_wait() -> tuple[bool, Any]:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job {self.id!r} did not finish within {timeout_s} s")
            return await self._finished(min(left, 3600.0))

        while True:
            finished, value = await patiently_async(outage, one_wait)
            if finished:
                return value

    async def _finished(self, wait_s: float) -> tuple[bool, Any]:
        """One wait of at most ``wait_s``, then a read: (True, its value) once the job has
        finished (``JobFailed`` raised for a failed one), else (False, None)."""
        backend = self.queue.backend
        try:
            state = await backend.wait_for_finish(self.id, wait_s)
        except JobNotFound:
            raise await self.not_found() from None
        if state is None:
            return False, None
        if state is JobState.COMPLETED:  # its codec and result: one light read
            (done,) = await backend.completed_results([self.id])
            if done is not None:
                return True, result_value(self.id, *done, self.queue.allowed_codecs)
        # the record and the result in one round trip: a woken waiter returns sooner
        ((info, data),) = await backend.get_many([self.id])
        if info is None:
            raise await self.not_found()
        if not info.state.finished:  # woken by a finish older than the wait: wait on
            return False, None
        data = data if info.state is JobState.COMPLETED else None
        return True, finished_value(self.id, info, data, self.queue.allowed_codecs)

    async def cancel(self) -> bool:
        """Cancel the job; a running job's child is killed. False if it had already finished."""
        return await self.queue.backend.cancel(self.id)

    async def retry(self) -> bool:
        """Put a failed or cancelled job back in the queue; False if it was neither."""
        return await self.queue.backend.retry_failed(self.id)


class Queue(Producer):
    """``sandboxq.Queue`` for asyncio: the same arguments, names and errors; awaitable calls."""

    def __init__(
        self,
        name: str,
        url: str | None = None,
        *,
        codec: str = "json",
        allow_pickle: bool = False,
        **backend_options: Any,
    ) -> None:
        super().__init__(name, codec, allow_pickle)
        self.backend: AsyncBackend = open_async_backend(url, name, **backend_options)

    async def enqueue(self, /, *args: Any, **kwargs: Any) -> AsyncJob:
        """Enqueue ``processor(*args, **kwargs)``; returns its AsyncJob."""
        jobs = [self._maker.new_job(args, kwargs)]
        with tracing.enqueue_span(self.name, jobs) as span:
            ((job_id, created),) = await self.backend.enqueue(jobs)
            span.added([job_id])
        return AsyncJob(self, job_id, created)

    async def enqueue_many(self, calls: Iterable[Call]) -> list[AsyncJob]:
        """Enqueue many calls in one round trip; ``calls`` are ``(args, kwargs)`` pairs.

        Encoding a big batch takes a while: it yields to the event loop every
        ``YIELD_EVERY`` calls, so other tasks keep running meanwhile."""
        jobs: list[NewJob] = []
        for n, call in enumerate(calls):
            jobs.append(self._maker.new_job(*call_pair(n, call)))
            if n % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
        jobs = self._maker.check_batch(jobs)
        with tracing.enqueue_span(self.name, jobs):
            added = await self.backend.enqueue(jobs)
        handles: list[AsyncJob] = []
        for start in range(0, len(added), YIELD_EVERY * 5):
            if start:
                await asyncio.sleep(0)
            handles += [
                AsyncJob(self, job_id, created)
                for job_id, created in added[start : start + YIELD_EVERY * 5]
            ]
        return handles

    def job(self, job_id: str) -> AsyncJob:
        """A handle on the job ``job_id`` (whether or not it exists)."""
        return AsyncJob(self, check_job_id(job_id))

    async def batch(
        self, calls: Iterable[Call], then: str | None = None, *, label: str | None = None
    ) -> AsyncBatch[AsyncJob]:
        """As ``sandboxq.Queue.batch``: every call checked and encoded (yielding to the
        event loop every ``YIELD_EVERY``) before anything is sent."""
        batch_id = new_batch_id()
        jobs: list[NewJob] = []
        for n, call in enumerate(calls):
            jobs.append(self._maker.batch_job(batch_id, n, call))
            if n % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
        check_batch_calls(jobs, then, self._maker.options.job_id, label)
        with tracing.enqueue_span(self.name, jobs, batch_id):
            await self.backend.enqueue_batch(batch_id, jobs, then=then, label=label)
        return AsyncBatch(self, batch_id, len(jobs))

    async def get_batch(self, batch_id: str) -> AsyncBatch[AsyncJob]:
        """As ``sandboxq.Queue.get_batch``: ``BatchNotFound`` at once if it does not exist."""
        progress = await self.backend.batch_progress(check_batch_id(batch_id))
        return AsyncBatch(self, batch_id, batch_total(self.name, batch_id, progress))

    async def counts(self) -> dict[JobState, int]:
        return await self.backend.counts()

    def events(
        self, since: str | None = None, block_s: float | None = None
    ) -> AsyncIterator[Event]:
        """``async for event in q.events(...)``: as ``sandboxq.Queue.events``."""
        check_seconds("block_s", block_s)
        check_since(since)
        return self.backend.events(since, block_s)

    async def close(self) -> None:
        await self.backend.close()

    async def __aenter__(self) -> Queue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
