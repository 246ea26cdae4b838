"""``Batch`` and ``AsyncBatch``: many calls under one batch id, and what a producer asks of
them as one.

    Queue.batch(calls, then) ── check_batch_calls, member ids ──► Backend.enqueue_batch
    batch.progress()     ── Backend.batch_progress: one O(1) read of counters the scripts keep
    batch.as_completed() ── Backend.batch_finished: the batch's stream of finished members,
                            read from its start by any handle in any process (StreamReader
                            decides what is new and how long to wait)
    batch.results()      ── as_completed until every member is final, then the members'
                            results read in input order (``Backend.completed_results``: a
                            light read each), and the records of those not completed
                            (``Backend.get_many``: what a JobFailed says), member_values
    cancel / retry_failed / forget ── Backend.batch_each / forget_batch

The waits (as_completed, wait, results) ride out an unreachable backend as ``Job.result``
does: each read is tried again (``finished.patiently``) while its ``Outage`` allows, and the
stream's cursor is kept across it. Every other call raises ``BackendUnreachable`` at once.

A member's id is ``<batch id>.<index>`` (``models.member_id``), so a batch needs no list
of its members and any process can name them. ``Batch`` belongs to the sync ``Queue``
(client.py), ``AsyncBatch`` to ``sandboxq.aio.Queue``: the same steps, the one awaiting
each backend call; what they decide (which rows are new, when to give up, what a member's
slot holds) is decided here once, for both.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Collection, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from sandboxq.backends.base import Backend, BatchAction, NewJob
from sandboxq.backends.rules import MAX_BATCH_MEMBERS, MAX_LABEL_BYTES
from sandboxq.errors import (
    BatchNotFound,
    ConfigError,
    DamagedRecord,
    SandboxqError,
)
from sandboxq.finished import (
    Outage,
    check_seconds,
    finished_value,
    no_such_job,
    patiently,
    patiently_async,
    result_value,
)
from sandboxq.models import BatchProgress, JobInfo, JobState, check_queue_name, member_id

__all__ = [
    "AsyncBatch",
    "AsyncBatchBackend",
    "Batch",
    "BatchQueue",
    "check_batch_calls",
    "new_batch_id",
]

J = TypeVar("J", covariant=True)
T = TypeVar("T")

#: How long one blocking read of a batch's stream waits before the batch is looked at
#: again (it may have been forgotten meanwhile).
READ_SLICE_S = 1.0
#: Members' records read per round trip by ``results``.
RESULTS_CHUNK = 500


class BatchQueue(Protocol[J]):
    """What a ``Batch`` needs of its queue."""

    @property
    def name(self) -> str: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def allowed_codecs(self) -> Collection[str]: ...

    def job(self, job_id: str) -> J: ...


class AsyncBatchBackend(Protocol):
    """``Backend``'s batch calls (base.py states each contract), awaited."""

    async def get_many(
        self, job_ids: Sequence[str]
    ) -> list[tuple[JobInfo | None, bytes | None]]: ...
    async def completed_results(
        self, job_ids: Sequence[str]
    ) -> list[tuple[str, bytes | None] | None]: ...
    async def enqueue_batch(
        self,
        batch_id: str,
        jobs: Sequence[NewJob],
        *,
        then: str | None = None,
        first: int = 0,
        label: str | None = None,
    ) -> int: ...
    async def batch_progress(self, batch_id: str) -> BatchProgress | None: ...
    async def batch_finished(
        self, batch_id: str, after: str, block_s: float | None = None
    ) -> tuple[str, list[tuple[int, JobState]]]: ...
    async def batch_each(self, batch_id: str, action: BatchAction) -> int | None: ...
    async def forget_batch(self, batch_id: str) -> bool: ...


class AsyncBatchQueue(Protocol[J]):
    """What an ``AsyncBatch`` needs of its queue."""

    @property
    def name(self) -> str: ...
    @property
    def backend(self) -> AsyncBatchBackend: ...
    @property
    def allowed_codecs(self) -> Collection[str]: ...

    def job(self, job_id: str) -> J: ...


def new_batch_id() -> str:
    """64 random bits as 16 hex digits: short, because every member's id carries it."""
    return os.urandom(8).hex()


def check_batch_calls(
    jobs: Sequence[NewJob],
    then: str | None,
    job_id_option: str | None,
    label: str | None = None,
) -> None:
    """A batch's calls, ``then`` and ``label`` as they enter: refused whole, before
    anything is sent."""
    if label is not None and not _label_fits(label):
        raise ConfigError(
            f"label must be text UTF-8 can carry, of at most {MAX_LABEL_BYTES:,} bytes, "
            f"got {label!r:.80}"
        )
    if not jobs:
        raise ConfigError("a batch needs at least one call; got none")
    if len(jobs) > MAX_BATCH_MEMBERS:
        raise ConfigError(
            f"a batch holds at most {MAX_BATCH_MEMBERS:,} calls, got {len(jobs):,}: "
            "send them as several batches"
        )
    if job_id_option is not None:
        raise ConfigError("a job_id option names one job; a batch names its members itself")
    if then is not None:
        try:
            check_queue_name(then)
        except ConfigError as exc:
            raise ConfigError(f"then: {exc}") from None


def batch_total(queue: str, batch_id: str, progress: BatchProgress | None) -> int:
    """How many members the batch read back as ``progress`` has, for a handle on it:
    ``BatchNotFound`` for None, ``BackendError`` for a count no batch can have (a forged
    record: a handle keeps a byte per member)."""
    if progress is None:
        raise batch_not_found(queue, batch_id)
    if progress.total > MAX_BATCH_MEMBERS:
        raise DamagedRecord(
            f"batch {batch_id!r} of queue {queue!r}: its record is damaged (it says "
            f"{progress.total:,} members; a batch has {MAX_BATCH_MEMBERS:,} at most)"
        )
    return progress.total


def batch_not_found(queue: str, batch_id: str) -> BatchNotFound:
    return BatchNotFound(
        f"batch {batch_id!r} of queue {queue!r} does not exist "
        "(never made, forgotten, or removed batch_ttl_s after it was done)",
        batch_id=batch_id,
    )


def _label_fits(label: object) -> bool:
    try:
        return isinstance(label, str) and len(label.encode()) <= MAX_LABEL_BYTES
    except UnicodeEncodeError:  # a lone surrogate
        return False


def deadline_of(timeout_s: float | None) -> float | None:
    check_seconds("timeout_s", timeout_s)
    return None if timeout_s is None else time.monotonic() + timeout_s


def found(queue: str, batch_id: str, answer: T | None) -> T:
    """A batch call's answer, or ``BatchNotFound`` for its None (no such batch)."""
    if answer is None:
        raise batch_not_found(queue, batch_id)
    return answer


class StreamReader:
    """One pass of ``as_completed`` over a batch's stream of finished members: the cursor,
    which members were yielded (each once, though a retried member appears again), and
    how long the next read may block."""

    def __init__(self, batch_id: str, total: int, timeout_s: float | None) -> None:
        self.batch_id = batch_id
        self.total = total
        self.timeout_s = timeout_s
        self.deadline = deadline_of(timeout_s)
        self.cursor = "0"
        self.left = total
        self._seen = bytearray(total)

    def block_s(self) -> float | None:
        """How long the next read may wait; None once the deadline passed: that read takes
        what the stream holds and waits for nothing (a batch already done is read whole
        whatever the timeout), and one that brings nothing ends the pass (``timed_out``).
        None too once every member read is final: the stream may hold more after that
        read (members retried since), and only a read that brings nothing more ends the
        pass (``done``)."""
        if not self.left:
            return None
        if self.deadline is None:
            return READ_SLICE_S
        left_s = self.deadline - time.monotonic()
        return None if left_s <= 0 else min(READ_SLICE_S, left_s)

    def done(self, rows: list[tuple[int, JobState]]) -> bool:
        """Whether the pass ends with the read that brought ``rows``: every member final,
        and nothing in the stream after it. (A read ending where every member was final
        ended it before: a batch of 1,000, one read's worth, retried after it was done,
        was taken as done by the first read, before its reopenings.)"""
        return not rows and not self.left

    def timed_out(self) -> TimeoutError:
        return TimeoutError(
            f"batch {self.batch_id!r}: {self.left} of {self.total} members not "
            f"finished within {self.timeout_s} s"
        )

    def took(self, cursor: str, rows: list[tuple[int, JobState]]) -> list[str]:
        """The ids of the members ``rows`` (the read that ended at ``cursor``) show final
        and not yielded yet. A member shown leaving its final state (retried) is waited
        for again: yielded again when it ends again, so the pass ends only when every
        member is final at once, which is when the batch is done."""
        self.cursor = cursor
        seen = self._seen
        new: dict[int, None] = {}  # this read's newly final members, in stream order
        for index, state in rows:
            if not 0 <= index < self.total or bool(seen[index]) == state.finished:
                continue
            seen[index] = state.finished
            self.left += -1 if state.finished else 1
            if state.finished:
                new[index] = None
            else:
                new.pop(index, None)  # final and reopened within this read: not yet
        return [member_id(self.batch_id, index) for index in new]


def _patience(batch_id: str, total: int, timeout_s: float | None) -> tuple[StreamReader, Outage]:
    """A wait's reader of the batch's stream, and its patience with an unreachable backend
    (until the same deadline), shared by the reads that follow it (``results``)."""
    reader = StreamReader(batch_id, total, timeout_s)
    return reader, Outage(f"batch {batch_id!r}", reader.deadline)


def result_chunks(batch_id: str, total: int) -> Iterator[list[str]]:
    """The members' ids in input order, ``RESULTS_CHUNK`` a read."""
    for start in range(0, total, RESULTS_CHUNK):
        yield [member_id(batch_id, i) for i in range(start, min(total, start + RESULTS_CHUNK))]


def not_completed(ids: list[str], completed: list[tuple[str, bytes | None] | None]) -> list[str]:
    """The members of ``ids`` that ``completed`` (``Backend.completed_results``) shows were
    not completed: their whole records are read, for the error each slot holds."""
    return [job_id for job_id, done in zip(ids, completed, strict=True) if done is None]


#: A member's record as ``results`` reads it: ``Backend.get_many``'s answer, or the
#: ``DamagedRecord`` its own read raised.
Record = tuple[JobInfo | None, bytes | None] | DamagedRecord


def member_records(backend: Backend, ids: list[str]) -> dict[str, Record]:
    """The records of ``ids`` (``Backend.get_many``); when one is damaged, each is read
    alone, so it costs its own slot (its ``DamagedRecord``), not the whole results."""
    if not ids:
        return {}
    try:
        return dict(zip(ids, backend.get_many(ids), strict=True))
    except DamagedRecord:
        out: dict[str, Record] = {}
        for job_id in ids:
            try:
                (out[job_id],) = backend.get_many([job_id])
            except DamagedRecord as exc:
                out[job_id] = exc
        return out


def member_values(
    queue: str,
    ids: list[str],
    completed: list[tuple[str, bytes | None] | None],
    others: dict[str, Record],
    allowed: Collection[str],
) -> list[Any]:
    """Each member's slot in ``results``: its value (``completed``: its codec and result),
    else the error it would raise (``others``: the records of those not completed)."""
    out: list[Any] = []
    for job_id, done in zip(ids, completed, strict=True):
        try:
            if done is not None:
                out.append(result_value(job_id, *done, allowed))
                continue
            record = others[job_id]
            if isinstance(record, DamagedRecord):
                out.append(record)
                continue
            info, data = record
            if info is None:
                out.append(no_such_job(queue, job_id))
                continue
            out.append(finished_value(job_id, info, data, allowed))
        except SandboxqError as exc:  # JobFailed; CodecRefused
            out.append(exc)
    return out


class _Handle(Generic[J]):
    def __init__(self, queue: Any, batch_id: str, total: int) -> None:
        self.queue = queue
        self.id = batch_id
        self.total = total

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.queue.name!r}, {self.id!r}, total={self.total})"

    def __len__(self) -> int:
        return self.total

    def jobs(self) -> list[J]:
        """Every member's handle, in input order."""
        return [self.queue.job(member_id(self.id, i)) for i in range(self.total)]


class Batch(_Handle[J]):
    """A handle on one batch; every call asks the backend afresh, so any number of handles,
    in any processes, see the same batch."""

    queue: BatchQueue[J]

    def __init__(self, queue: BatchQueue[J], batch_id: str, total: int) -> None:
        super().__init__(queue, batch_id, total)

    def progress(self) -> BatchProgress:
        """The counts by state and ``done``: one O(1) read. ``BatchNotFound`` if it is gone."""
        return found(self.queue.name, self.id, self.queue.backend.batch_progress(self.id))

    def as_completed(self, timeout_s: float | None = None) -> Iterator[J]:
        """Each member's job as it reaches a final state (completed, failed, cancelled),
        once each, on whatever worker it ran; from the batch's start, so a second handle
        (another process, after a restart) streams the same members. A member retried
        meanwhile (``retry_failed``) is yielded when it ends again; the iteration ends when
        every member is final, that is when the batch is done. ``TimeoutError`` when
        ``timeout_s`` passes first, ``BatchNotFound`` if the batch is (or becomes) gone.
        While the backend is unreachable (a restart, a Sentinel failover) the wait goes on
        as ``Job.result``'s does (``finished.Outage``), from where the stream was read:
        no member is yielded twice or skipped; ``BackendUnreachable`` if it still is when
        ``timeout_s`` passes (without one, after 60 s in a row)."""
        reader = StreamReader(self.id, self.total, timeout_s)
        yield from self._members(reader, Outage(f"batch {self.id!r}", reader.deadline))

    def _members(self, reader: StreamReader, outage: Outage) -> Iterator[J]:
        """``as_completed`` with its reader and its patience with the backend."""
        patiently(outage, self.progress)  # BatchNotFound at once, not after a read times out
        backend, job = self.queue.backend, self.queue.job

        def read() -> tuple[float | None, str, list[tuple[int, JobState]]]:
            block_s = reader.block_s()
            cursor, rows = backend.batch_finished(self.id, reader.cursor, block_s)
            if not rows and block_s is not None:
                self.progress()  # still there?
            return block_s, cursor, rows

        while True:
            block_s, cursor, rows = patiently(outage, read)
            if reader.done(rows):
                return
            if not rows and block_s is None:
                raise reader.timed_out()
            for job_id in reader.took(cursor, rows):
                yield job(job_id)

    def wait(self, timeout_s: float | None = None) -> BatchProgress:
        """Block until every member is final; the batch's progress then. While the backend
        is unreachable, as ``as_completed``."""
        return self._wait(*_patience(self.id, self.total, timeout_s))

    def _wait(self, reader: StreamReader, outage: Outage) -> BatchProgress:
        for _job in self._members(reader, outage):
            pass
        return patiently(outage, self.progress)

    def results(self, timeout_s: float | None = None) -> list[Any]:
        """Every member's result in input order, once all are final: a failed or cancelled
        member's slot holds its ``JobFailed`` (a member whose record is gone: its
        ``JobNotFound``; damaged: its ``DamagedRecord``), never raised, so one failure does
        not hide the other results. ``BatchNotFound`` if the
        batch is gone or expires (past ``batch_ttl_s``) before the last member is read.
        While the backend is unreachable, the wait and the reads go on as ``as_completed``
        (``BackendUnreachable`` once ``timeout_s`` has passed)."""
        reader, outage = _patience(self.id, self.total, timeout_s)
        self._wait(reader, outage)
        q = self.queue
        out: list[Any] = []
        for ids in result_chunks(self.id, self.total):

            def chunk(ids: list[str] = ids) -> list[Any]:
                completed = q.backend.completed_results(ids)
                others = member_records(q.backend, not_completed(ids, completed))
                return member_values(q.name, ids, completed, others, q.allowed_codecs)

            out += patiently(outage, chunk)
        # Still kept after the reads, so none of them raced retention's sweep: an expired
        # batch is deleted a few members at a time, and its slots would be JobNotFound.
        patiently(outage, self.progress)
        return out

    def cancel(self, *, running: bool = True) -> int:
        """Cancel every member not yet final: waiting ones never start, running ones are
        cancelled with the fenced hand-over (``Job.cancel``); with ``running=False`` the
        running ones go on to their end. Returns how many were cancelled."""
        action: BatchAction = "cancel" if running else "cancel_unstarted"
        acted = self.queue.backend.batch_each(self.id, action)
        return found(self.queue.name, self.id, acted)

    def retry_failed(self) -> int:
        """Run the failed and cancelled members again (``Job.retry``). Returns how many.
        A batch that was done is not done until they end again; its ``then`` follow-up,
        already sent, is not sent again."""
        acted = self.queue.backend.batch_each(self.id, "retry")
        return found(self.queue.name, self.id, acted)

    def forget(self) -> None:
        """Delete the batch and its members now (else they go ``batch_ttl_s`` after it is
        done). ``ConfigError`` while a member may still run: cancel the batch first."""
        if not self.queue.backend.forget_batch(self.id):
            raise batch_not_found(self.queue.name, self.id)


class AsyncBatch(_Handle[J]):
    """``Batch`` for asyncio (``sandboxq.aio.Queue.batch``): the same names and answers,
    awaitable; ``as_completed`` is an async iterator (``async for job in ...``)."""

    queue: AsyncBatchQueue[J]

    def __init__(self, queue: AsyncBatchQueue[J], batch_id: str, total: int) -> None:
        super().__init__(queue, batch_id, total)

    async def progress(self) -> BatchProgress:
        """As ``Batch.progress``."""
        return found(self.queue.name, self.id, await self.queue.backend.batch_progress(self.id))

    async def as_completed(self, timeout_s: float | None = None) -> AsyncIterator[J]:
        """As ``Batch.as_completed``; each read is an awaited blocking read, so the event
        loop runs on while the batch does."""
        reader = StreamReader(self.id, self.total, timeout_s)
        async for job in self._members(reader, Outage(f"batch {self.id!r}", reader.deadline)):
            yield job

    async def _members(self, reader: StreamReader, outage: Outage) -> AsyncIterator[J]:
        """As ``Batch._members``."""
        await patiently_async(outage, self.progress)
        backend, job = self.queue.backend, self.queue.job

        async def read() -> tuple[float | None, str, list[tuple[int, JobState]]]:
            block_s = reader.block_s()
            cursor, rows = await backend.batch_finished(self.id, reader.cursor, block_s)
            if not rows and block_s is not None:
                await self.progress()
            return block_s, cursor, rows

        while True:
            block_s, cursor, rows = await patiently_async(outage, read)
            if reader.done(rows):
                return
            if not rows and block_s is None:
                raise reader.timed_out()
            for job_id in reader.took(cursor, rows):
                yield job(job_id)

    async def wait(self, timeout_s: float | None = None) -> BatchProgress:
        """As ``Batch.wait``."""
        return await self._wait(*_patience(self.id, self.total, timeout_s))

    async def _wait(self, reader: StreamReader, outage: Outage) -> BatchProgress:
        async for _job in self._members(reader, outage):
            pass
        return await patiently_async(outage, self.progress)

    async def results(self, timeout_s: float | None = None) -> list[Any]:
        """As ``Batch.results``."""
        reader, outage = _patience(self.id, self.total, timeout_s)
        await self._wait(reader, outage)
        q = self.queue
        out: list[Any] = []
        for ids in result_chunks(self.id, self.total):

            async def chunk(ids: list[str] = ids) -> list[Any]:
                completed = await q.backend.completed_results(ids)
                others = await self._records(not_completed(ids, completed))
                return member_values(q.name, ids, completed, others, q.allowed_codecs)

            out += await patiently_async(outage, chunk)
        await patiently_async(outage, self.progress)  # as in Batch.results: still kept
        return out

    async def _records(self, ids: list[str]) -> dict[str, Record]:
        """As ``member_records``, awaited."""
        backend = self.queue.backend
        if not ids:
            return {}
        try:
            return dict(zip(ids, await backend.get_many(ids), strict=True))
        except DamagedRecord:
            out: dict[str, Record] = {}
            for job_id in ids:
                try:
                    (out[job_id],) = await backend.get_many([job_id])
                except DamagedRecord as exc:
                    out[job_id] = exc
            return out

    async def cancel(self, *, running: bool = True) -> int:
        """As ``Batch.cancel``."""
        action: BatchAction = "cancel" if running else "cancel_unstarted"
        acted = await self.queue.backend.batch_each(self.id, action)
        return found(self.queue.name, self.id, acted)

    async def retry_failed(self) -> int:
        """As ``Batch.retry_failed``."""
        acted = await self.queue.backend.batch_each(self.id, "retry")
        return found(self.queue.name, self.id, acted)

    async def forget(self) -> None:
        """As ``Batch.forget``."""
        if not await self.queue.backend.forget_batch(self.id):
            raise batch_not_found(self.queue.name, self.id)
