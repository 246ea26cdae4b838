"""From a claimed job to the pool's ``Task``: whether it can run here, and with what limits.

    Claimed ─► refusal ─┬─► cause ─► failed at once (outcomes.refusal_ack)
                        └─► None ─► task_for ─► Task ─► Pool.execute

The claim already carries the job's parsed options (a job whose stored options do not
validate never reaches the worker: the backend fails it with the cause). A job's own
options override the worker's defaults, resolved once, here.
"""

from __future__ import annotations

from collections.abc import Callable

from sandboxq.backends.base import Claimed
from sandboxq.pool.attempt import Task
from sandboxq.settings import WorkerSettings
from sandboxq.worker.heartbeat import fence_margin_s


def refusal(job: Claimed, allow_pickle: bool) -> str | None:
    """Why ``job`` cannot run on this worker (design invariant 8), or None: it can."""
    if job.codec == "pickle" and not allow_pickle:
        return "pickle payloads are refused by this worker (allow_pickle=False)"
    if job.codec not in ("json", "pickle"):
        return f"unknown payload codec {job.codec!r}"
    return None


def task_for(
    job: Claimed,
    settings: WorkerSettings,
    on_progress: Callable[[float, str | None], None],
) -> Task:
    """The attempt the pool runs for ``job``, under its lease's fence."""
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
        max_memory_mb=options.max_memory_mb or s.max_memory_mb,
        job_id=job.id,
        attempt=job.attempt,
        on_progress=on_progress,
        # The lease began no earlier than claimed_at: this falls before it can expire.
        fence_deadline=job.claimed_at + s.lease_s - fence_margin_s(s.lease_s),
        # Under a helper that died before: if it is the job that kills them, the next
        # death must not be charged to jobs that only ran beside it.
        alone=job.infra_deaths > 0,
    )
