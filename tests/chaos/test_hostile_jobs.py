"""Hostile jobs in a real `sandboxq worker` process: a parent-killer, a descriptor
scribbler and a descriptor closer among ordinary jobs. Each ends its own attempt with the
outcome the catalogue names (``sandboxq.testing.cases.HOSTILE``), every ordinary job
completes, and afterwards the worker is still alive and serving (design invariant 11)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxq import JobFailed, Queue
from sandboxq.testing.cases import HOSTILE
from sandboxq.testing.workers import BackgroundWorkers

pytestmark = pytest.mark.timeout(180)

CALL = "sandboxq.testing.hostile:call"
ORDINARY = 20


def test_hostile_jobs_end_their_own_attempts_and_the_worker_keeps_serving(
    containment: str, redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    queue = Queue(queue_name, url=redis_url)
    # One child: a fork server death under two running attempts counts against both jobs,
    # and this test asserts exact outcomes for every job.
    with BackgroundWorkers(join_timeout_s=15) as workers:
        worker = workers.spawn(
            queue_name,
            CALL,
            "--concurrency",
            "1",
            "--containment",
            containment,
            "--hard-timeout-s",
            "20",
            url=redis_url,
            log=tmp_path / "worker.log",
        )
        try:
            hostile = [(case, queue.enqueue(case.handler, *case.args)) for case in HOSTILE]
            plain = [queue.enqueue("echo", i) for i in range(ORDINARY)]
            for case, job in hostile:
                with pytest.raises(JobFailed) as failed:
                    job.result(timeout_s=90)
                info = job.info()
                case.check(info.history[-1])
                assert failed.value.outcome == case.outcome.value, case.id
            assert [job.result(timeout_s=60) for job in plain] == list(range(ORDINARY))
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            assert queue.enqueue("echo", "after").result(timeout_s=30) == "after"
        finally:
            queue.close()
