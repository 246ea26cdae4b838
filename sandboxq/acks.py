"""From an ended attempt to what the backend is told: the exit policy, applied.

    AttemptResult ── interrupted ──────────────► requeue (the attempt is not charged)
                  ── any other outcome ─► ExitPolicy ─► complete (result stored)
                                                      ─► retry (backoff into delayed)
                                                      ─► fail (with the cause)
    a job that cannot run (tasks.CannotRun) ────────────────► fail (with the cause)

``lease_lost`` and ``cancelled`` never get here: the worker no longer owns those jobs.
"""

from __future__ import annotations

import time

from sandboxq.backends.base import Ack, Claimed, FinishAction
from sandboxq.models import Action, AttemptRecord, JobOptions, Outcome
from sandboxq.outcomes import ExitPolicy, backoff_s
from sandboxq.pool.attempt import AttemptResult


def ack_for(
    job: Claimed,
    options: JobOptions,
    attempt: AttemptResult,
    policy: ExitPolicy,
    default_retries: int,
    worker_id: str,
) -> Ack:
    """The ack for ``job``'s attempt that ended as ``attempt`` says, with its record."""
    error = None if attempt.outcome is Outcome.OK else attempt.cause
    action: FinishAction
    decided: Action | None
    if attempt.outcome is Outcome.INTERRUPTED:
        action, decided, delay = "requeue", None, 0.0
    else:
        retries = options.retries if options.retries is not None else default_retries
        decided = policy.decide(attempt.outcome, attempt.exitcode, job.attempt, retries)
        action = decided.value
        delay = backoff_s(options.backoff_s, job.attempt) if decided is Action.RETRY else 0.0
    # Validated construction on purpose: it runs in pydantic's compiled core and measured
    # twice as fast as model_construct, which is plain Python.
    record = AttemptRecord(
        attempt=job.attempt,
        outcome=attempt.outcome,
        action=decided,
        worker_id=worker_id,
        pid=attempt.pid,
        exitcode=attempt.exitcode,
        signal=attempt.signal,
        started_ms=attempt.started_ms,
        ended_ms=attempt.ended_ms,
        error=error,
    )
    result = attempt.result if action == "complete" else None
    return Ack(job.id, job.token, action, record, result, error, delay)


def refusal_ack(job: Claimed, cause: str, worker_id: str) -> Ack:
    """The ack that fails ``job``, which never ran: it cannot run on this worker."""
    record = AttemptRecord.refused(job.attempt, worker_id, cause, int(time.time() * 1000))
    return Ack(job.id, job.token, "fail", record, error=cause)
