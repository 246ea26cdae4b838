"""What the contract's tests share: the lease they claim with, how long a wake-up may
take, and helpers that enqueue, claim and finish one job."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from sandboxq.backends.base import (
    Backend,
    Claimed,
    FinishAction,
    FinishResult,
    NewJob,
)
from sandboxq.models import AttemptRecord, JobInfo, JobOptions, Outcome

__all__ = [
    "LEASE_S",
    "OUTCOMES",
    "PROMPT_S",
    "SLACK_S",
    "MakeBackend",
    "add",
    "claim_one",
    "finish",
    "in_thread",
    "info",
    "new_job",
    "record",
]

MakeBackend = Callable[..., Backend]

#: The lease the tests claim with: long enough to act inside it, short enough to outwait.
LEASE_S = 0.3
#: Added to every wait that must outlast a deadline, for a loaded CI machine.
SLACK_S = 0.15
#: How late a wake-up may be and still count as prompt.
PROMPT_S = 0.5

#: The outcome a test's attempt record gives for each finish action.
OUTCOMES: dict[FinishAction, Outcome] = {
    "complete": Outcome.OK,
    "fail": Outcome.ERROR,
    "retry": Outcome.ERROR,
    "requeue": Outcome.INTERRUPTED,
}


def new_job(
    job_id: str | None = None, *, priority: int = 0, delay_s: float = 0.0, **options: Any
) -> NewJob:
    options_json = JobOptions(**options).model_dump_json(exclude_defaults=True)
    return NewJob(b"[[1],{}]", "json", options_json, job_id, priority, delay_s)


def add(backend: Backend, job_id: str | None = None, **kwargs: Any) -> str:
    ((added_id, created),) = backend.enqueue([new_job(job_id, **kwargs)])
    assert created
    return added_id


def claim_one(backend: Backend, worker_id: str = "w1", lease_s: float = LEASE_S) -> Claimed:
    claimed = backend.claim(worker_id, 1, lease_s)
    assert len(claimed) == 1, claimed
    return claimed[0]


def record(
    claimed: Claimed, outcome: Outcome = Outcome.OK, worker_id: str = "w1", error: str | None = None
) -> AttemptRecord:
    now_ms = time.time_ns() // 1_000_000
    return AttemptRecord(
        attempt=claimed.attempt,
        outcome=outcome,
        worker_id=worker_id,
        pid=4242,
        started_ms=now_ms - 5,
        ended_ms=now_ms,
        error=error,
    )


def finish(
    backend: Backend,
    claimed: Claimed,
    action: FinishAction = "complete",
    worker_id: str = "w1",
    **kwargs: Any,
) -> FinishResult:
    attempt = record(claimed, OUTCOMES[action], worker_id, kwargs.get("error"))
    return backend.finish(worker_id, claimed.id, claimed.token, action, attempt, **kwargs)


def info(backend: Backend, job_id: str) -> JobInfo:
    found = backend.get(job_id)
    assert found is not None, f"job {job_id} is unknown"
    return found


def in_thread(delay_s: float, fn: Callable[[], object]) -> threading.Thread:
    """Run ``fn`` on another thread after ``delay_s``; the caller joins it."""

    def run() -> None:
        time.sleep(delay_s)
        fn()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
