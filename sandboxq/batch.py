"""``Batch``: many calls under one batch id, and what a producer asks of them as one.

    Queue.batch(calls, then) ── check_batch_calls, member ids ──► Backend.enqueue_batch
    batch.progress()     ── Backend.batch_progress: one O(1) read of counters the scripts keep
    batch.as_completed() ── Backend.batch_finished: the batch's stream of finished members,
                            read from its start by any handle in any process
    batch.results()      ── as_completed until every member is final, then the members'
                            records read in input order (``Backend.get_many``)
    cancel / retry_failed / forget ── Backend.batch_each / forget_batch

A member's id is ``<batch id>.<index>`` (``models.member_id``), so a batch needs no list
of its members and any process can name them. The queue a ``Batch`` belongs to is the sync
``Queue`` (a handle of this module's ``BatchQueue`` shape); the asyncio twin is in aio.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from sandboxq.backends.base import Backend, NewJob
from sandboxq.errors import BatchNotFound, ConfigError, SandboxqError
from sandboxq.finished import check_seconds, finished_value, no_such_job
from sandboxq.models import BatchProgress, check_queue_name, member_id

__all__ = ["Batch", "BatchQueue", "check_batch_calls", "new_batch_id"]

J = TypeVar("J", covariant=True)

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


def new_batch_id() -> str:
    """64 random bits as 16 hex digits: short, because every member's id carries it."""
    return os.urandom(8).hex()


def check_batch_calls(jobs: Sequence[NewJob], then: str | None, job_id_option: str | None) -> None:
    """A batch's calls and ``then`` as they enter: refused whole, before anything is sent."""
    if not jobs:
        raise ConfigError("a batch needs at least one call; got none")
    if job_id_option is not None:
        raise ConfigError("a job_id option names one job; a batch names its members itself")
    if then is not None:
        try:
            check_queue_name(then)
        except ConfigError as exc:
            raise ConfigError(f"then: {exc}") from None


def batch_not_found(queue: str, batch_id: str) -> BatchNotFound:
    return BatchNotFound(
        f"batch {batch_id!r} of queue {queue!r} does not exist "
        "(never made, forgotten, or removed batch_ttl_s after it was done)",
        batch_id=batch_id,
    )


def deadline_of(timeout_s: float | None) -> float | None:
    check_seconds("timeout_s", timeout_s)
    return None if timeout_s is None else time.monotonic() + timeout_s


class Batch(Generic[J]):
    """A handle on one batch; every call asks the backend afresh, so any number of handles,
    in any processes, see the same batch."""

    def __init__(self, queue: BatchQueue[J], batch_id: str, total: int) -> None:
        self.queue = queue
        self.id = batch_id
        self.total = total

    def __repr__(self) -> str:
        return f"Batch({self.queue.name!r}, {self.id!r}, total={self.total})"

    def __len__(self) -> int:
        return self.total

    def jobs(self) -> list[J]:
        """Every member's handle, in input order."""
        return [self.queue.job(member_id(self.id, i)) for i in range(self.total)]

    def progress(self) -> BatchProgress:
        """The counts by state and ``done``: one O(1) read. ``BatchNotFound`` if it is gone."""
        progress = self.queue.backend.batch_progress(self.id)
        if progress is None:
            raise batch_not_found(self.queue.name, self.id)
        return progress

    def as_completed(self, timeout_s: float | None = None) -> Iterator[J]:
        """Each member's job as it reaches a final state (completed, failed, cancelled),
        once each, on whatever worker it ran; from the batch's start, so a second handle
        (another process, after a restart) streams the same members. ``TimeoutError`` when
        ``timeout_s`` passes first, ``BatchNotFound`` if the batch is (or becomes) gone."""
        deadline = deadline_of(timeout_s)
        self.progress()  # BatchNotFound at once, not after a read times out
        seen = bytearray(self.total)
        left_to_see = self.total
        cursor = "0"
        backend = self.queue.backend
        while left_to_see:
            block_s = READ_SLICE_S
            if deadline is not None:
                block_s = min(block_s, deadline - time.monotonic())
                if block_s <= 0:
                    raise TimeoutError(
                        f"batch {self.id!r}: {left_to_see} of {self.total} members not "
                        f"finished within {timeout_s} s"
                    )
            cursor, rows = backend.batch_finished(self.id, cursor, block_s)
            if not rows:
                self.progress()  # still there?
                continue
            for index, _state in rows:
                if 0 <= index < self.total and not seen[index]:
                    seen[index] = 1
                    left_to_see -= 1
                    yield self.queue.job(member_id(self.id, index))

    def wait(self, timeout_s: float | None = None) -> BatchProgress:
        """Block until every member is final; the batch's progress then."""
        for _job in self.as_completed(timeout_s):
            pass
        return self.progress()

    def results(self, timeout_s: float | None = None) -> list[Any]:
        """Every member's result in input order, once all are final: a failed or cancelled
        member's slot holds its ``JobFailed`` (a member gone: its ``JobNotFound``), never
        raised, so one failure does not hide the other results."""
        self.wait(timeout_s)
        backend, allowed = self.queue.backend, self.queue.allowed_codecs
        out: list[Any] = []
        for start in range(0, self.total, RESULTS_CHUNK):
            ids = [
                member_id(self.id, i) for i in range(start, min(self.total, start + RESULTS_CHUNK))
            ]
            for job_id, (info, data) in zip(ids, backend.get_many(ids), strict=True):
                if info is None:
                    out.append(no_such_job(self.queue.name, job_id))
                    continue
                try:
                    out.append(finished_value(job_id, info, data, allowed))
                except SandboxqError as exc:  # JobFailed; CodecRefused
                    out.append(exc)
        return out

    def cancel(self) -> int:
        """Cancel every member not yet final: waiting ones never start, running ones are
        cancelled with the fenced hand-over (``Job.cancel``). Returns how many."""
        acted = self.queue.backend.batch_each(self.id, "cancel")
        if acted is None:
            raise batch_not_found(self.queue.name, self.id)
        return acted

    def retry_failed(self) -> int:
        """Run the failed and cancelled members again (``Job.retry``). Returns how many.
        A batch that was done is not done until they end again; its ``then`` follow-up,
        already sent, is not sent again."""
        acted = self.queue.backend.batch_each(self.id, "retry")
        if acted is None:
            raise batch_not_found(self.queue.name, self.id)
        return acted

    def forget(self) -> None:
        """Delete the batch and its members now (else they go ``batch_ttl_s`` after it is
        done). ``ConfigError`` while a member may still run: cancel the batch first."""
        if not self.queue.backend.forget_batch(self.id):
            raise batch_not_found(self.queue.name, self.id)
