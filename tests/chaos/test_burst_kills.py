"""Deadline kills of fork bursts and bombs in a real `sandboxq worker` process: each job
ends as ``hard_timeout``, nothing it started runs on, no zombie is left under the worker,
and the worker keeps serving."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from sandboxq import JobFailed, Queue
from sandboxq.testing.processes import still_running
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers

pytestmark = [pytest.mark.timeout(180), pytest.mark.alone]  # fork bursts

CALL = "sandboxq.testing.handlers:call"
KILLS = 6


def _below(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _zombies(pid: int) -> list[int]:
    found = []
    for proc in _below(pid):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def test_burst_kills_leave_no_process_and_no_zombie(
    containment: str, redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    queue = Queue(queue_name, url=redis_url)
    log = tmp_path / "worker.log"
    with BackgroundWorkers(join_timeout_s=15) as workers:
        worker = workers.spawn(
            queue_name, CALL, "--concurrency", "2", "--containment", containment,
            "--hard-timeout-s", "1", "--retries", "0", url=redis_url, log=log,
        )  # fmt: skip
        try:
            jobs = []
            for n in range(KILLS):
                pid_file = tmp_path / f"pids-{n}"
                if n % 2:
                    jobs.append((pid_file, queue.enqueue("fork_bomb", str(pid_file), 6, "hang")))
                else:
                    jobs.append((pid_file, queue.enqueue("fork_burst", str(pid_file), 200, "hang")))
            for pid_file, job in jobs:
                with pytest.raises(JobFailed) as failed:
                    job.result(timeout_s=60)
                assert failed.value.outcome == "hard_timeout", job.info().error
                started = [int(p) for p in pid_file.read_text().split()]
                assert started and not still_running(started), "a killed job's process ran on"
            wait_for(lambda: not _zombies(worker.pid), 10, "no zombie under the worker")
            assert queue.enqueue("echo", "after").result(timeout_s=30) == "after"
            assert worker.poll() is None, log.read_text()[-3000:]
        finally:
            queue.close()
