"""From a claimed job to the pool's ``Task``: whether it can run here, and with what limits.

    Claimed ─► refusal ─┬─► cause ─► failed at once (outcomes.refusal_ack)
                        └─► None ─► unstarted ─┬─► past the worker's deadline_s or
                                               │   max_queue_s: failed, never run
                                               └─► None ─► task_for ─► Task ─► Pool.execute
                                                   (still waiting for a child when either
                                                   runs out: ended by the pool, never run)

The claim already carries the job's parsed options (a job whose stored options do not
validate never reaches the worker: the backend fails it with the cause). A job's own
options override the worker's defaults, resolved once, here.
"""

from __future__ import annotations

from collections.abc import Callable

from sandboxq.backends import rules
from sandboxq.backends.base import Claimed
from sandboxq.models import Outcome
from sandboxq.pool.attempt import END_GRACE_S, Task
from sandboxq.settings import WorkerSettings
from sandboxq.worker.heartbeat import fence_margin_s


def refusal(job: Claimed, allow_pickle: bool) -> str | None:
    """Why ``job`` cannot run on this worker (design invariant 8), or None: it can."""
    if job.codec == "pickle" and not allow_pickle:
        return "pickle payloads are refused by this worker (allow_pickle=False)"
    if job.codec not in ("json", "pickle"):
        return f"unknown payload codec {job.codec!r}"
    return None


def unstarted(job: Claimed, settings: WorkerSettings) -> tuple[Outcome, str] | None:
    """Why ``job`` must not start under this worker's own ``deadline_s`` / ``max_queue_s``
    (the backend's claim applied the job's own: ``rules.budget_passed``), or None."""
    s, o = settings, job.options
    if (s.deadline_s is None or o.deadline_s is not None) and (
        s.max_queue_s is None or o.max_queue_s is not None
    ):
        return None
    resolved = o.model_copy(
        update={
            "deadline_s": o.deadline_s or s.deadline_s,
            "max_queue_s": o.max_queue_s or s.max_queue_s,
        }
    )
    # On the claim's own clock: enqueued age_s ago, runnable wait_s ago, now 0.
    age_ms, wait_ms = round(job.age_s * 1000), round((job.wait_s or 0.0) * 1000)
    return rules.budget_passed(resolved, -age_ms, -wait_ms, 0, job.attempt)


def deadline_at(job: Claimed, settings: WorkerSettings) -> float | None:
    """``time.monotonic()`` at which ``job``'s ``deadline_s`` (its own, else the worker's)
    runs out: counted from its enqueue, which the claim dates (``age_s``) on the backend's
    clock; ``claimed_at`` is no later than the claim, so this never falls late."""
    deadline = job.options.deadline_s or settings.deadline_s
    return None if deadline is None else job.claimed_at + deadline - job.age_s


def start_by(job: Claimed, settings: WorkerSettings) -> float | None:
    """``time.monotonic()`` by which ``job`` must start under its ``max_queue_s`` (its own,
    else the worker's), counted from when it became runnable (``wait_s`` before its claim):
    a job claimed ahead (prefetch) waits in the worker, and waiting there counts too."""
    max_queue = job.options.max_queue_s or settings.max_queue_s
    return None if max_queue is None else job.claimed_at + max_queue - (job.wait_s or 0.0)


def task_for(
    job: Claimed,
    settings: WorkerSettings,
    on_progress: Callable[[float, str | None], None],
    memory_mb: float | None = None,
) -> Task:
    """The attempt the pool runs for ``job``, under its lease's fence (``memory_mb``: a
    memory limit raised for a retry, memory_retry.py)."""
    s, options = settings, job.options
    soft = options.soft_timeout_s or s.soft_timeout_s
    hard = options.hard_timeout_s or s.hard_timeout_s
    if soft is not None and hard is not None and soft >= hard:
        soft = None  # a job's own hard timeout below the worker's soft one wins
    return Task(
        job.payload,
        job.codec,  # type: ignore[arg-type]
        soft_timeout_s=soft,
        hard_timeout_s=hard,
        max_memory_mb=memory_mb or options.max_memory_mb or s.max_memory_mb,
        job_id=job.id,
        attempt=job.attempt,
        on_progress=on_progress,
        # The lease began no earlier than claimed_at: this falls before it can expire.
        fence_deadline=job.claimed_at + s.lease_s - fence_margin_s(s.lease_s),
        # Under a helper that died before: if it is the job that kills them, the next
        # death must not be charged to jobs that only ran beside it.
        alone=job.infra_deaths > 0,
        deadline_at=deadline_at(job, s),
        start_by=start_by(job, s),
        progress_timeout_s=options.progress_timeout_s or s.progress_timeout_s,
        # a policy's end leaves the handler the gap it has between its soft and hard timeout
        end_grace_s=hard - soft if soft is not None and hard is not None else END_GRACE_S,
    )
