"""Random SIGKILL of children while hundreds of jobs flow through three workers."""

from __future__ import annotations

import time

import pytest
from harness import ChildKiller, Scene

from sandboxq.testing.waiting import wait_for

pytestmark = pytest.mark.timeout(240)

JOBS = 300


def test_random_child_kills_lose_nothing_and_never_run_a_job_twice_at_once(scene: Scene) -> None:
    """A child is SIGKILLed every 100-300 ms, mid-job or idle, while 300 jobs flow through 3
    workers of 2 children each: every job completes exactly once (or fails with a cause),
    none is lost, none runs in two children at once, and no process is left behind."""
    fleet = scene.fleet("--concurrency", "2", "--lease-s", "2")
    workers = fleet.start(3, children=2)
    killer = ChildKiller(fleet, 0.1, 0.3, seed=1)
    started = time.monotonic()
    producer = scene.producer(
        JOBS, batch=25, pause_s=0.05, seconds=lambda rng: rng.uniform(0.05, 0.2)
    )
    killer.start()
    try:
        result = scene.finish(producer, timeout_s=150)
    finally:
        killer.stop()
    took = time.monotonic() - started
    print(f"\n{len(killer.killed)} children killed in {took:.1f} s; {result.line()}")
    assert len(producer.accepted) == JOBS and not producer.errors
    assert all(w.proc.poll() is None for w in workers), fleet.errors()
    # The kills really hit running jobs, and those attempts are on record as crashes.
    assert len(killer.killed) >= 20
    assert result.outcomes["crashed"] >= 5, result.line()
    for job_id, cause in result.failed.items():
        assert "SIGKILL" in cause, (job_id, cause)
    assert result.completed >= JOBS - 5, result.line()
    for worker in workers:  # every kill's processes reaped: no Z left under any worker
        wait_for(lambda w=worker: not w.zombies(), 10, f"no zombie under {worker.name}")
    assert not fleet.errors()
