"""Cancel-then-retry storms: running jobs are cancelled and retried at once, again and
again, while jobs flow through three workers. A retried job must never start anywhere
while its cancelled execution still runs (the fence), and every job still ends with one
completion and every execution in its history (the audit)."""

from __future__ import annotations

import random
import threading

import pytest
from audit import audit
from harness import Fleet, Scene

from sandboxq import Queue
from sandboxq.errors import BackendError
from sandboxq.models import JobState
from sandboxq.testing.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

LEASE_S = 2.0


class CancelRetryStorm(threading.Thread):
    """Every ``pause_s``, cancels one running job and retries it at once.

    A retry whose call failed (a timeout on a loaded machine) is tried again until it is
    answered, even after ``stop``: a job left cancelled would never end and the test would
    wait for it in vain. A retry *refused* right after the cancel is kept in ``refused``:
    a cancelled job must always be retryable."""

    def __init__(self, scene: Scene, pause_s: float = 0.05, seed: int = 0) -> None:
        super().__init__(name="chaos-cancel-retry", daemon=True)
        self.backend = scene.queue.backend
        self.pause_s = pause_s
        self.rng = random.Random(seed)
        self.hits: list[str] = []
        self.refused: list[str] = []
        self._unretried: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.pause_s):
            self._retry_pending()
            try:
                active = self.backend.list_jobs(JobState.ACTIVE, limit=20)
                if not active:
                    continue
                victim = self.rng.choice(active)
                if self.backend.cancel(victim):
                    self._unretried.append(victim)
            except BackendError:
                continue
            self._retry_pending()
        while self._unretried:
            self._retry_pending()

    def _retry_pending(self) -> None:
        while self._unretried:
            victim = self._unretried[0]
            try:
                retried = self.backend.retry_failed(victim)
            except BackendError:
                return  # asked again on the next turn
            self._unretried.pop(0)
            (self.hits if retried else self.refused).append(victim)

    @property
    def unretried(self) -> list[str]:
        return list(self._unretried)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


def unended(queue: Queue, ids: list[str], storm: CancelRetryStorm, fleet: Fleet) -> str:
    """What a job that never ended was left as, and what the storm and the workers did."""
    lines = []
    for job_id in ids:
        info = queue.backend.get(job_id)
        if info is None or info.state not in (JobState.COMPLETED, JobState.FAILED):
            history = (
                [
                    (h.attempt, h.outcome.value, h.action and h.action.value, h.worker_id)
                    for h in info.history
                ]
                if info
                else []
            )
            lines.append(f"{job_id}: {info.state.value if info else 'lost'}, history {history}")
    lines.append(f"retries refused {storm.refused}, never sent {storm.unretried}")
    for worker in fleet.workers:
        alive = "running" if worker in fleet.running() else "ended"
        lines.append(f"--- {worker.name} ({alive}) ---\n{fleet.tail(worker, 15)}")
    return "\n".join(lines)


def test_cancel_then_retry_storm_never_runs_a_job_twice_at_once(scene: Scene) -> None:
    fleet = scene.fleet("--concurrency", "2", "--lease-s", str(LEASE_S))
    fleet.start(3, children=2)
    producer = scene.producer(150, batch=15, seconds=lambda rng: rng.uniform(0.1, 0.3))
    storm = CancelRetryStorm(scene)
    storm.start()
    producer.join(60)
    queue = scene.queue

    def done(at_least: int) -> bool:
        counts = queue.counts()
        return counts[JobState.COMPLETED] + counts[JobState.FAILED] >= at_least

    wait_for(lambda: done(100), 90, "most jobs to complete under the storm")
    storm.stop()
    try:
        wait_for(lambda: done(len(producer.accepted)), 90, "every job to end")
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{unended(queue, producer.accepted, storm, fleet)}") from None
    result = audit(queue, producer.accepted, scene.tally, scene.ledger)
    print(f"\n{len(storm.hits)} cancel-then-retries; {result.line()}")
    assert len(storm.hits) >= 10, "the storm hit too few running jobs to prove anything"
    assert not storm.refused, f"cancelled jobs that could not be retried: {storm.refused}"
    assert result.overlaps == 0 and not result.failed
    assert result.outcomes["cancelled"] >= len(storm.hits) // 2  # some were still waiting
    assert not fleet.errors()
