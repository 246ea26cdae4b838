"""From a claimed job to the pool's ``Task``: whether it can run here, and with what limits.

    Claimed ─► options_of ─┬─► CannotRun(cause) ─► failed at once (acks.refusal_ack)
                           └─► JobOptions ─► task_for ─► Task ─► Pool.execute

A job's own options override the worker's defaults, resolved once, when it is claimed.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from sandboxq.backends.base import Claimed
from sandboxq.models import JobOptions, parse_job_options
from sandboxq.pool.attempt import Task
from sandboxq.settings import WorkerSettings
from sandboxq.worker.heartbeat import fence_margin_s


class CannotRun(ValueError):
    """Why a claimed job cannot run on this worker (the dispatcher fails it, nothing runs)."""


def options_of(job: Claimed, allow_pickle: bool) -> JobOptions:
    """The job's options, checked; raises ``CannotRun`` when it cannot run here."""
    try:
        options = parse_job_options(job.options_json)
    except ValidationError as exc:
        raise CannotRun(f"malformed job options: {exc.errors()[0]['msg']}") from None
    if job.codec == "pickle" and not allow_pickle:
        raise CannotRun("pickle payloads are refused by this worker (allow_pickle=False)")
    if job.codec not in ("json", "pickle"):
        raise CannotRun(f"unknown payload codec {job.codec!r}")
    return options


def task_for(
    job: Claimed,
    options: JobOptions,
    settings: WorkerSettings,
    on_progress: Callable[[float, str | None], None],
) -> Task:
    """The attempt the pool runs for ``job``, under its lease's fence."""
    s = settings
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
    )
