"""What an ended attempt means to the queue: the exit policy, the ack, and what the backend
answered.

    AttemptResult ── interrupted, memory_pressure ► requeue, recorded as retry_uncharged
                     (the attempt is not charged; a helper of the pool died under it:
                     + infra_death, which the backend counts against the job; at
                     max_infra_deaths: fail, outcome poison)
                  ── any other outcome ─► ExitPolicy ─► complete (result stored)
                                                      ─► retry (backoff into delayed)
                                                      ─► fail (with the cause)
    a job that cannot run (tasks.refusal)   ────────────────► fail (refusal_ack)
    finish_many ─► (acks, accepted) ─► count_acks ─┬─► stats (completed, failed, retried...)
                                                   ├─► one INFO record, a line per job
                                                   └─► rejected: Unacked ─► confirm_dead

The policy's defaults are the outcome table of docs/design.md (and of the README):

    outcome ──► actions (DEFAULT_ACTIONS) ──► complete / retry / fail
       exit(N) ──► the exit_codes map; unmapped codes fail; retry_uncharged: requeued,
                   the attempt not counted (bounded only by the job's deadline_s)
    retry, once the attempt number is past ``retries`` ──► fail
    retry ──► backoff_s(base, attempt): base, 2 x base, 4 x base... capped at MAX_BACKOFF_S
    retry whose backoff would end past the job's deadline_s ──► fail (past_deadline)

A worker builds its policy from ``exit_codes`` alone (``SandboxWorker(exit_codes=...)``,
``--exit-code``); every other outcome keeps its default action. ``lease_lost`` and
``cancelled`` never reach the policy (a worker that lost its lease does not ack, a
cancelled job is already final), and ``interrupted`` is requeued without charge.

A rejected ack means the lease was lost (or, when the acks were sent again after a call
that got no answer, that it may have been applied already): either way the attempt's
child has ended, which ``confirm_dead`` tells the backend.
"""

from __future__ import annotations

import logging
import textwrap
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from sandboxq.backends import rules
from sandboxq.backends.base import Ack, Claimed, FinishAction
from sandboxq.models import DEFAULT_MAX_INFRA_DEATHS, Action, AttemptRecord, Outcome, now_ms
from sandboxq.pool.attempt import AttemptResult
from sandboxq.redaction import redact_text
from sandboxq.settings import WorkerSettings
from sandboxq.text import guarded_logger, visible
from sandboxq.worker.memory_retry import AT_CAP_TEXT, at_cap

log = guarded_logger("sandboxq.worker")

DEFAULT_ACTIONS: dict[Outcome, Action] = {
    Outcome.OK: Action.COMPLETE,
    Outcome.ERROR: Action.RETRY,
    Outcome.SOFT_TIMEOUT: Action.RETRY,
    Outcome.HARD_TIMEOUT: Action.RETRY,
    Outcome.EXIT: Action.FAIL,  # unless the exit code is mapped
    Outcome.CRASHED: Action.RETRY,
    Outcome.MEMORY_LIMIT: Action.FAIL,
    Outcome.CPU_LIMIT: Action.FAIL,
    Outcome.POISON: Action.FAIL,  # decided by the backend, from its count of deaths
    Outcome.EXPIRED: Action.FAIL,  # never ran: decided at claim
    Outcome.DEADLINE: Action.FAIL,  # the job's whole budget is spent
    Outcome.PROGRESS_TIMEOUT: Action.RETRY,  # hung: as a hard timeout
}

#: What ``finish`` does for each action: ``retry_uncharged`` puts the job back in line
#: with its attempt not counted, as an interrupted attempt is (Kubernetes' ``Ignore``).
FINISH_OF: Final[Mapping[Action, FinishAction]] = {
    Action.COMPLETE: "complete",
    Action.RETRY: "retry",
    Action.FAIL: "fail",
    Action.RETRY_UNCHARGED: "requeue",
}

#: Longest wait between two attempts, whatever the backoff and attempt number.
MAX_BACKOFF_S = 3600.0


class ExitPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    actions: dict[Outcome, Action] = Field(default_factory=lambda: dict(DEFAULT_ACTIONS))
    exit_codes: dict[int, Action] = Field(default_factory=dict)
    #: memory_retry_max_mb: a memory_limit attempt that ran at it is not retried
    memory_cap_mb: float | None = None

    @classmethod
    def of(cls, settings: WorkerSettings) -> ExitPolicy:
        """A worker's policy: its ``exit_codes``; with ``memory_retry_factor``, memory_limit
        is retried (memory_retry.py) up to ``memory_retry_max_mb``."""
        actions = dict(DEFAULT_ACTIONS)
        if settings.memory_retry_factor is not None:
            actions[Outcome.MEMORY_LIMIT] = Action.RETRY
        return cls(
            actions=actions,
            exit_codes=settings.exit_codes,
            memory_cap_mb=settings.memory_retry_max_mb,
        )

    def decide(self, outcome: Outcome, exitcode: int | None, attempt: int, retries: int) -> Action:
        """The action for ``attempt`` (1-based) of a job allowed ``retries`` retries."""
        if outcome is Outcome.EXIT:
            action = (
                self.exit_codes.get(exitcode, Action.FAIL) if exitcode is not None else Action.FAIL
            )
        else:
            action = self.actions.get(outcome, Action.FAIL)
        if action is Action.RETRY and attempt > retries:
            return Action.FAIL
        return action


def backoff_s(base_s: float, attempt: int) -> float:
    """Exponential backoff before attempt ``attempt + 1``: base, 2 x base, 4 x base... capped."""
    if base_s <= 0:
        return 0.0
    return float(min(MAX_BACKOFF_S, base_s * 2 ** min(attempt - 1, 30)))


# -- the ack ---------------------------------------------------------------------------


def ack_for(
    job: Claimed,
    attempt: AttemptResult,
    policy: ExitPolicy,
    default_retries: int,
    worker_id: str,
    max_infra_deaths: int = DEFAULT_MAX_INFRA_DEATHS,
    deadline_at: float | None = None,
) -> Ack:
    """The ack for ``job``'s attempt that ended as ``attempt`` says, with its record."""
    outcome = attempt.outcome
    error = None if outcome is Outcome.OK else attempt.cause
    action: FinishAction
    decided: Action
    deaths = job.infra_deaths + (attempt.infra_death is not None)
    if attempt.infra_death is not None and rules.poisoned(deaths, max_infra_deaths):
        # The claim said how often this job was under a helper that died; the backend
        # counts this one with the ack (design invariant 11).
        outcome, action, decided, delay = Outcome.POISON, "fail", Action.FAIL, 0.0
        error = rules.POISON_TEXT % (deaths, attempt.infra_death)
    elif outcome is Outcome.INTERRUPTED or outcome is Outcome.MEMORY_PRESSURE:
        # not charged (memory_pressure: counted as infra_death, bounded as poison is)
        action, decided, delay = "requeue", Action.RETRY_UNCHARGED, 0.0
    else:
        options = job.options
        retries = options.retries if options.retries is not None else default_retries
        decided = policy.decide(outcome, attempt.exitcode, job.attempt, retries)
        action = FINISH_OF[decided]
        delay = backoff_s(options.backoff_s, job.attempt) if decided is Action.RETRY else 0.0
        if (
            outcome is Outcome.MEMORY_LIMIT
            and decided is Action.RETRY
            and at_cap(attempt.memory_limit_mb, policy.memory_cap_mb)
        ):
            decided, action = Action.FAIL, "fail"
            error = f"{error}; {AT_CAP_TEXT % (policy.memory_cap_mb or 0)}"
        if decided is Action.RETRY and past_deadline(deadline_at, delay):
            # deadline_s: no retry whose backoff would end after the job's budget
            decided, action = Action.FAIL, "fail"
            error = f"{error}; not retried: {NO_RETRY_TEXT % delay}"
    # Validated construction on purpose: it runs in pydantic's compiled core and measured
    # twice as fast as model_construct, which is plain Python.
    if error is not None:
        error = redact_text(error)
    record = AttemptRecord(
        attempt=job.number or job.attempt,
        outcome=outcome,
        action=decided,
        worker_id=worker_id,
        pid=attempt.pid,
        exitcode=attempt.exitcode,
        signal=attempt.signal,
        started_ms=attempt.started_ms,
        ended_ms=attempt.ended_ms,
        error=error,
        # what the handler wrote of itself: bounded by the pool, its secrets hidden here
        traceback=redact_text(attempt.traceback) if attempt.traceback else None,
        output=redact_text(attempt.output) if attempt.output else None,
        memory_limit_mb=attempt.memory_limit_mb,
        peak_memory_mb=attempt.peak_memory_mb,
    )
    result = attempt.result if action == "complete" else None
    return Ack(job.id, job.token, action, record, result, error, delay, attempt.infra_death)


#: Why a retry was not scheduled (``%g``: its backoff, seconds).
NO_RETRY_TEXT = "its backoff of %g s would end past the job's deadline_s"


def past_deadline(deadline_at: float | None, delay_s: float) -> bool:
    """Whether a retry ``delay_s`` from now would start at or after ``deadline_at``
    (``time.monotonic()``; None: no deadline)."""
    return deadline_at is not None and time.monotonic() + delay_s >= deadline_at


def unstarted_ack(job: Claimed, outcome: Outcome, cause: str, worker_id: str) -> Ack:
    """The ack that fails ``job`` unstarted: past the worker's deadline_s or max_queue_s
    (``tasks.unstarted``; outcome deadline or expired)."""
    record = AttemptRecord(
        attempt=job.number or job.attempt,
        outcome=outcome,
        action=Action.FAIL,
        worker_id=worker_id,
        ended_ms=now_ms(),
        error=cause,
    )
    return Ack(job.id, job.token, "fail", record, error=cause)


def refusal_ack(job: Claimed, cause: str, worker_id: str) -> Ack:
    """The ack that fails ``job``, which never ran: it cannot run on this worker."""
    record = AttemptRecord.refused(job.number or job.attempt, worker_id, cause, now_ms())
    return Ack(job.id, job.token, "fail", record, error=cause)


# -- what the backend answered ----------------------------------------------------------


@dataclass(slots=True)
class WorkerStats:
    """What a worker counted since it started (``SandboxWorker.stats``). Read by name too,
    ``stats["completed"]``, as the logs and the metrics name them."""

    completed: int = 0
    failed: int = 0
    retried: int = 0
    requeued: int = 0
    #: acks the backend refused: the lease had been lost
    rejected_acks: int = 0
    lease_lost: int = 0
    cancelled: int = 0
    #: claimed jobs that could not run here (failed at once)
    malformed: int = 0
    #: outcomes of a lease no longer held, dropped
    stale_outcomes: int = 0
    #: ended attempts reported with ``confirm_dead``
    confirmed_dead: int = 0

    def __getitem__(self, name: str) -> int:
        if name not in self.__dataclass_fields__:
            raise KeyError(name)
        return int(getattr(self, name))

    def count(self, name: str, n: int = 1) -> None:
        setattr(self, name, self[name] + n)


#: The ``stats`` entry an accepted ack counts in.
STAT_OF: Final[Mapping[FinishAction, str]] = {
    "complete": "completed",
    "fail": "failed",
    "retry": "retried",
    "requeue": "requeued",
}


class Unacked(NamedTuple):
    """An attempt that ended without an ack (lease lost, cancelled, ack rejected): its
    job's fence lifts once the backend is told (``Backend.confirm_dead``)."""

    job_id: str
    token: str  # the lease token


def count_acks(
    acks: list[tuple[Claimed, Ack]],
    accepted: list[bool],
    stats: WorkerStats,
    maybe_applied: bool = False,
) -> list[Unacked]:
    """Count and log what the backend answered; returns the attempts it did not ack
    (``maybe_applied``: the acks were sent again after a call without an answer, so a
    rejection may be of an applied ack).

    The lines of one batch go out as one record: under load a batch holds many jobs,
    and a record per job (format, write, flush) was a third of this thread's time.
    The command line's formatter puts its prefix in front of every line. An attempt with
    a traceback (it raised, or was stopped or crashed where the stack says) has it under
    its line, indented: the one place a worker's log shows it.
    """
    unacked: list[Unacked] = []
    lines: list[str] | None = [] if log.isEnabledFor(logging.INFO) else None
    for (job, ack), ok in zip(acks, accepted, strict=True):
        if not ok and maybe_applied:
            log.warning("job %s: ack rejected when sent again: it may have been applied", job.id)
            unacked.append(Unacked(job.id, job.token))
            continue
        if not ok:
            stats.rejected_acks += 1
            unacked.append(Unacked(job.id, job.token))  # its child has ended all the same
            continue
        stats.count(STAT_OF[ack.action])
        if lines is not None:
            # What a handler raised and a job's id: shown, not obeyed (text.visible)
            cause = f" ({visible(ack.error)})" if ack.error else ""
            outcome = ack.attempt.outcome.value
            number = ack.attempt.attempt
            lines.append(
                f"job {visible(job.id)} attempt {number}: {outcome} -> {ack.action}{cause}"
            )
            if ack.attempt.traceback:  # once, here: where it raised, hung or crashed
                tb = visible(ack.attempt.traceback.rstrip("\n"), one_line=False)
                lines.append(textwrap.indent(tb, "    "))
    if lines:
        log.info("\n".join(lines))  # its own lines (no arguments for the filter to flatten)
    if not maybe_applied and unacked:
        _log_rejected([u.job_id for u in unacked])
    return unacked


#: Job ids a rejected-acks line names at most.
REJECTED_NAMED = 5


def _log_rejected(job_ids: list[str]) -> None:
    """The acks of one call that the backend rejected, in one line (a batch cancelled
    while a worker held hundreds of its members had a line per job)."""
    why = "its lease was revoked (the job was cancelled, or the lease expired)"
    if len(job_ids) == 1:
        log.warning("job %s: ack rejected, %s; result discarded", job_ids[0], why)
        return
    named = ", ".join(job_ids[:REJECTED_NAMED])
    more = len(job_ids) - REJECTED_NAMED
    if more > 0:
        named += f" and {more} more"
    log.warning(
        "%d acks rejected, each job's lease revoked (cancelled, or expired); results "
        "discarded: jobs %s",
        len(job_ids),
        named,
    )
