"""The pool's memory budget (``pool_memory_mb``) in a real control group: children that
grow together past it lose their newest attempt to the pool, never a process to the
kernel's OOM killer, and the pool serves again at once. Skipped where no writable control
group exists (the process-tree mode samples instead; its test runs everywhere)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sandboxq import JobFailed, Pool, Queue
from sandboxq.models import Action, JobState, Outcome
from sandboxq.pool.attempt import AttemptResult, Task
from sandboxq.testing.workers import BackgroundWorkers
from tests.conftest import MODE, WHY

H = "sandboxq.testing.handlers:"
needs_cgroups = pytest.mark.skipif(
    MODE == "process_tree", reason=f"no writable control groups: {WHY}"
)


def run_all(pool: Pool, payloads: list[bytes], timeout_s: float = 30) -> list[AttemptResult]:
    results: list[AttemptResult] = []
    lock = threading.Lock()
    done = threading.Event()

    def settled(result: AttemptResult) -> None:
        with lock:
            results.append(result)
            if len(results) == len(payloads):
                done.set()

    for payload in payloads:
        pool.execute(Task(payload, "json"), settled)
    assert done.wait(timeout_s), results
    return results


@pytest.mark.parametrize(
    "containment", [pytest.param("cgroup", marks=needs_cgroups), "process_tree"]
)
@pytest.mark.timeout(60)
def test_children_outgrowing_the_budget_lose_their_newest_attempt(containment: str) -> None:
    with Pool(H + "call", size=4, pool_memory_mb=400, containment=containment) as pool:
        # warm: four children ready, so the four attempts start together
        run_all(pool, [b'[["succeed_after", 0.2], {}]'] * 4)
        oom_before = pool._containment.pool_oom_kills()
        # together 600 MB, growing 250 MB/s each
        results = run_all(pool, [b'[["grow_to", 150], {}]'] * 4)
        outcomes = sorted(r.outcome for r in results)
        pressed = [r for r in results if r.outcome is Outcome.MEMORY_PRESSURE]
        kept = [r for r in results if r.outcome is Outcome.OK]
        assert pressed and kept and len(pressed) + len(kept) == 4, outcomes
        assert pool._containment.pool_oom_kills() == oom_before  # the kernel picked none
        # the newest attempts were the ones ended
        assert min(r.started_ms or 0 for r in pressed) >= min(r.started_ms or 0 for r in kept)
        for r in pressed:
            assert r.infra_death is not None and "pool_memory_mb 400" in r.infra_death
        # and the pool serves again
        t0 = time.monotonic()
        [again] = run_all(pool, [b'[["succeed_after", 0, 7], {}]'])
        assert again.outcome is Outcome.OK and time.monotonic() - t0 < 10


@needs_cgroups
@pytest.mark.timeout(90)
def test_a_worker_requeues_memory_pressure_uncharged(
    workers: BackgroundWorkers, redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    # The pool starts each attempt once a child is ready and its job claimed: on a loaded
    # machine that can be far enough apart for one attempt to end before the last starts,
    # and the budget is never short. So all four wait for each other before growing.
    together = str(tmp_path / "together")
    with Queue(queue_name, redis_url) as q:
        workers.start(q, H + "grow_to", concurrency=4, pool_memory_mb=400, containment="cgroup")
        jobs = [q.options(retries=0).enqueue(150, 5, 0.02, 0.3, together, 4) for _ in range(4)]
        assert [j.result(timeout_s=60) for j in jobs] == [150] * 4
        infos = [j.info() for j in jobs]
        assert all(i.state is JobState.COMPLETED and i.attempts == 1 for i in infos)
        pressed = [a for i in infos for a in i.history if a.outcome is Outcome.MEMORY_PRESSURE]
        assert pressed, [i.history for i in infos]
        assert all(a.action is Action.RETRY_UNCHARGED for a in pressed)  # not charged


def test_pool_memory_mb_is_a_setting_of_both(queue_name: str) -> Any:
    from sandboxq import ConfigError
    from sandboxq.worker import SandboxWorker

    with pytest.raises(ConfigError, match="pool_memory_mb"):
        SandboxWorker(queue_name, H + "echo", "memory://", pool_memory_mb=-5)


@pytest.mark.timeout(60)
def test_a_job_that_alone_outgrows_the_budget_every_time_is_stopped_as_poison(
    workers: BackgroundWorkers, url: str, queue_name: str
) -> None:
    with Queue(queue_name, url) as q:
        workers.start(
            q, H + "grow_to", url=url, concurrency=1, pool_memory_mb=200,
            containment="process_tree", max_infra_deaths=2,
        )  # fmt: skip
        job = q.options(retries=5).enqueue(400, 5, 0.02, 0.1)
        with pytest.raises(JobFailed) as info:
            job.result(timeout_s=40)
        assert info.value.outcome == "poison"
        history = job.info().history
        assert [a.outcome for a in history] == [Outcome.MEMORY_PRESSURE, Outcome.POISON]
        assert "pool_memory_mb 200" in (info.value.error or "")
