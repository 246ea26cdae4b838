"""Answers, not waits: a job that does not exist says so at once; ``job.retry()``.

Both backends (the ``url`` fixture): the embedded one and a real redis-server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from sandboxq import Job, JobNotFound, Queue, SandboxqError
from sandboxq.backends.base import Ack, Claimed
from sandboxq.models import AttemptRecord, JobState, Outcome


def finish(queue: Queue, job: Claimed, action: str = "complete", **kw: object) -> bool:
    record = AttemptRecord(attempt=job.attempt, outcome=Outcome.OK, worker_id="w1")
    ack = Ack(job.id, job.token, action, record, **kw)  # type: ignore[arg-type]
    accepted, _ = queue.backend.finish_many("w1", [ack])
    return accepted[0]


@pytest.mark.timeout(30)
def test_result_of_a_job_that_never_existed_raises_at_once(queue: Queue) -> None:
    began = time.monotonic()
    with pytest.raises(JobNotFound) as raised:
        queue.job("no-such-job").result()
    assert time.monotonic() - began < 2.0
    assert raised.value.job_id == "no-such-job" and isinstance(raised.value, SandboxqError)
    with pytest.raises(JobNotFound):
        queue.job("no-such-job").info()


def raised_while_waiting(job: Job, meanwhile: Callable[[], None], what: str) -> BaseException:
    """What ``job.result()``, waiting on a thread while ``meanwhile()`` runs, raised."""
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            job.result(timeout_s=20)
        except BaseException as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    meanwhile()
    waiter.join(10)
    assert not waiter.is_alive(), f"result() kept waiting for {what}"
    assert len(raised) == 1, raised
    return raised[0]


@pytest.mark.timeout(30)
def test_result_of_a_job_removed_by_retention_raises(url: str, queue_name: str) -> None:
    queue = Queue(queue_name, url=url, retain_completed=0)
    waited_for, got = queue.enqueue(1), queue.enqueue(2)

    def complete_both() -> None:
        for claimed in queue.backend.claim("w1", 2, 30.0):
            assert finish(queue, claimed, result=b"1")  # completed, then trimmed at once

    raised = raised_while_waiting(waited_for, complete_both, "a job retention removed")
    assert isinstance(raised, JobNotFound)
    with pytest.raises(JobNotFound):
        got.result(timeout_s=20)
    queue.close()


@pytest.mark.timeout(30)
def test_result_of_a_purged_job_raises(queue: Queue) -> None:
    job = queue.options(delay_s=600).enqueue(1)

    def purge() -> None:
        assert queue.backend.purge(JobState.DELAYED) == 1

    assert isinstance(raised_while_waiting(job, purge, "a purged job"), JobNotFound)


@pytest.mark.timeout(30)
def test_job_retry(queue: Queue) -> None:
    job = queue.enqueue(1)
    [claimed] = queue.backend.claim("w1", 1, 30.0)
    assert not job.retry()  # active
    assert finish(queue, claimed, "fail", error="boom")
    assert job.retry()
    info = job.info()
    assert (info.state, info.attempts, info.error) == (JobState.WAITING, 0, None)
    assert [a.attempt for a in info.history] == [1]  # the history stays
    assert not job.retry()  # waiting
    with pytest.raises(JobNotFound):
        queue.job("no-such-job").retry()


@pytest.mark.timeout(30)
def test_job_retry_of_a_cancelled_running_job_is_fenced(queue: Queue) -> None:
    job = queue.enqueue(1)
    [claimed] = queue.backend.claim("w1", 1, 30.0)
    assert job.cancel() and job.retry()
    assert job.state() is JobState.DELAYED  # until the owner confirms the child dead
    assert queue.backend.claim("w2", 1, 30.0) == []
    assert queue.backend.confirm_dead("w1", [(job.id, claimed.token)]) == [job.id]
    [again] = queue.backend.claim("w2", 1, 30.0)
    assert again.id == job.id
    outcomes = [a.outcome for a in job.info().history]
    assert outcomes == [Outcome.CANCELLED]


@pytest.mark.timeout(30)
def test_a_waiter_registered_before_the_purge_is_told_at_once(queue: Queue) -> None:
    """The purge comes after the waiter's first read (a hook in the waiter says when, on
    Redis; the memory backend's waiters hold its lock): only an event can tell it, well
    before its 20 s timeout."""
    from sandboxq.backends.redis import finishes

    job = queue.options(delay_s=600).enqueue(1)
    first_read = threading.Event()

    def purge_once_it_waits() -> None:
        if queue.backend.__class__.__name__ == "RedisBackend":
            assert first_read.wait(10), "the waiter never read the job"
        assert queue.backend.purge(JobState.DELAYED) == 1

    finishes.after_first_read = lambda job_id: first_read.set()
    try:
        raised = raised_while_waiting(job, purge_once_it_waits, "a job purged as it waited")
    finally:
        finishes.after_first_read = None
    assert isinstance(raised, JobNotFound)
