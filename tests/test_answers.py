"""Answers, not waits: a job that does not exist says so at once; ``job.retry()``.

Both backends (the ``url`` fixture): the embedded one and a real redis-server.
"""

from __future__ import annotations

import threading
import time

import pytest

from sandboxq import JobNotFound, Queue, SandboxqError
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


@pytest.mark.timeout(30)
def test_result_of_a_job_removed_by_retention_raises(url: str, queue_name: str) -> None:
    queue = Queue(queue_name, url=url, retain_completed=0)
    waited_for, got = queue.enqueue(1), queue.enqueue(2)
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            waited_for.result(timeout_s=20)
        except BaseException as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    for claimed in queue.backend.claim("w1", 2, 30.0):
        assert finish(queue, claimed, result=b"1")  # completed, then trimmed at once
    waiter.join(10)
    assert not waiter.is_alive(), "result() kept waiting for a job retention removed"
    assert len(raised) == 1 and isinstance(raised[0], JobNotFound)
    with pytest.raises(JobNotFound):
        got.result(timeout_s=20)
    queue.close()


@pytest.mark.timeout(30)
def test_result_of_a_purged_job_raises(queue: Queue) -> None:
    job = queue.options(delay_s=600).enqueue(1)
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            job.result(timeout_s=20)
        except BaseException as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert queue.backend.purge(JobState.DELAYED) == 1
    waiter.join(10)
    assert not waiter.is_alive(), "result() kept waiting for a purged job"
    assert len(raised) == 1 and isinstance(raised[0], JobNotFound)


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
