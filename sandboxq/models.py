"""Data that crosses module boundaries: outcomes, actions, job states, job options, job and
attempt records; and the checks every entry point shares (queue names, job ids, timeouts,
numbers that must really be numbers).

Units: durations are float seconds named ``*_s``; stored timestamps are int milliseconds
named ``*_ms``: a job's (``created_ms``, ``finished_ms``) from the backend's clock, an
attempt's (``started_ms``, ``ended_ms``) from the clock of the worker that ran it. Every
model is frozen and rejects unknown fields, so a misspelt option is an error instead of a
silently ignored setting.
"""

from __future__ import annotations

import functools
import math
import re
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict

from sandboxq.errors import ConfigError
from sandboxq.traceparent import is_traceparent


def now_ms() -> int:
    """This machine's wall clock in integer milliseconds, as timestamps are stored."""
    return time.time_ns() // 1_000_000


#: Priorities are packed with a sequence number into one exact float score in Redis.
MAX_PRIORITY = 1000

#: Deaths of the pool's helpers (fork server) or of the worker, while a job ran, after
#: which it fails as ``poison`` (design invariant 11): one job must not take down a fleet.
DEFAULT_MAX_INFRA_DEATHS = 3


_QUEUE_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,200}")

#: Job ids are any text a user likes (braces and colons included), up to this length.
MAX_JOB_ID = 512

#: The validation context of options read back from a backend (``parse_job_options``).
_STORED = {"stored": True}


def check_queue_name(name: str) -> str:
    """Queue names become part of Redis keys inside a ``{hash tag}``: keep them plain."""
    if not isinstance(name, str) or not _QUEUE_NAME.fullmatch(name):
        raise ConfigError(
            f"queue name {name!r} is invalid: use 1-200 letters, digits, '_', '-', '.' or ':'"
        )
    return name


def check_job_id(job_id: str) -> str:
    """A job id names one job: 1-512 characters of text that UTF-8 can carry."""
    ok = isinstance(job_id, str) and 1 <= len(job_id) <= MAX_JOB_ID
    try:
        ok = ok and bool(job_id.encode())
    except UnicodeEncodeError:  # a lone surrogate
        ok = False
    if not ok:
        raise ConfigError(
            f"job id {job_id!r:.80} is invalid: use 1-{MAX_JOB_ID} characters of text "
            "(anything UTF-8 can carry)"
        )
    return job_id


class Outcome(StrEnum):
    """How one attempt ended."""

    OK = "ok"  # the handler returned
    ERROR = "error"  # the handler raised (or its result could not be encoded)
    SOFT_TIMEOUT = "soft_timeout"  # returned or raised after the soft-timeout signal
    HARD_TIMEOUT = "hard_timeout"  # killed at the hard deadline
    EXIT = "exit"  # the handler ended the child with an exit code
    CRASHED = "crashed"  # killed by a signal we did not send (SIGSEGV, OOM killer...)
    MEMORY_LIMIT = "memory_limit"  # killed for going over max_memory_mb
    CPU_LIMIT = "cpu_limit"  # used up its CPU time (cpu_time_s, RLIMIT_CPU: SIGXCPU)
    LEASE_LOST = "lease_lost"  # killed because the worker no longer owns the job
    CANCELLED = "cancelled"  # killed because a user cancelled the job
    INTERRUPTED = "interrupted"  # stopped by a worker shutdown; requeued, not charged
    #: present at ``max_infra_deaths`` deaths of the pool's helpers or of its worker
    POISON = "poison"
    EXPIRED = "expired"  # not started within max_queue_s of becoming runnable; never ran
    DEADLINE = "deadline"  # the job's deadline_s passed (ended, or never started)
    PROGRESS_TIMEOUT = "progress_timeout"  # no progress() for progress_timeout_s: hung
    #: ended to keep the pool within pool_memory_mb; requeued, not charged (bounded)
    MEMORY_PRESSURE = "memory_pressure"


class Action(StrEnum):
    """What the exit policy does with an outcome."""

    COMPLETE = "complete"
    RETRY = "retry"
    FAIL = "fail"
    #: retry without spending an attempt (an ``exit_codes`` value; Kubernetes' ``Ignore``)
    RETRY_UNCHARGED = "retry_uncharged"


class JobState(StrEnum):
    WAITING = "waiting"
    DELAYED = "delayed"
    ACTIVE = "active"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


def _number_only(value: Any) -> Any:
    """Pydantic would read ``True`` as 1 and ``"5"`` as 5.0: a flag passed in the wrong
    place, or a string nobody converted, would quietly become a timeout or a count."""
    if isinstance(value, bool | str | bytes | bytearray):
        raise ValueError(f"expected a number, got {type(value).__name__} {value!r:.40}")
    return value


#: Put on every numeric setting and option: numbers only (see ``_number_only``).
NUMBER_ONLY = BeforeValidator(_number_only)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


#: The largest magnitude of a number in a stored record (a count, a pid, a time in ms):
#: exact as a float, so no date or duration arithmetic on it overflows. A forged
#: 4,000-digit "timestamp" is refused where the record is read, as any unparsable field is.
LARGEST_STORED = 2**53

#: An integer field of a stored record (``LARGEST_STORED`` at most, either way).
StoredInt = Annotated[int, Field(ge=-LARGEST_STORED, le=LARGEST_STORED)]


def stored_int(raw: bytes | str) -> int:
    """An integer field read from the backend as ``StoredInt`` holds it (``ValueError``
    otherwise)."""
    value = int(raw)
    if abs(value) > LARGEST_STORED:
        raise ValueError(f"out of range (over {LARGEST_STORED:,} either way)")
    return value


def _positive_within_bounds(name: str, value: float | None) -> float | None:
    """A positive duration (or, for a ``_mb`` name, size), at most what a setting may be."""
    if value is None:
        return None
    unit, most = ("MB", MAX_MB) if name.endswith("_mb") else ("seconds", MAX_SECONDS)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive, finite number of {unit}, got {value!r}")
    if value > most:
        raise ValueError(f"{name} must be at most {most:.0f} {unit}, got {value!r}")
    return float(value)


def check_timeouts(soft_timeout_s: float | None, hard_timeout_s: float | None) -> None:
    """The one cross-check of a timeout pair, shared by job options and settings."""
    if (
        soft_timeout_s is not None
        and hard_timeout_s is not None
        and soft_timeout_s >= hard_timeout_s
    ):
        raise ConfigError(
            f"soft_timeout_s ({soft_timeout_s}) must be less than hard_timeout_s ({hard_timeout_s})"
        )


def check_budgets(
    max_queue_s: float | None,
    deadline_s: float | None,
    progress_timeout_s: float | None,
    hard_timeout_s: float | None,
) -> None:
    """The cross-checks of a job's time budgets, shared by job options and settings: a
    deadline shorter than the wait allowed before the start, or a progress watchdog longer
    than the hard timeout, is a setting that can never act as written."""
    if max_queue_s is not None and deadline_s is not None and deadline_s < max_queue_s:
        raise ConfigError(
            f"deadline_s ({deadline_s:g}) must not be shorter than max_queue_s "
            f"({max_queue_s:g}): the job would pass its deadline while still allowed to wait"
        )
    if (
        progress_timeout_s is not None
        and hard_timeout_s is not None
        and progress_timeout_s > hard_timeout_s
    ):
        raise ConfigError(
            f"progress_timeout_s ({progress_timeout_s:g}) must not be longer than "
            f"hard_timeout_s ({hard_timeout_s:g}): the hard timeout would always come first"
        )


def setting_field(default: Any, description: str, *, none: str | None = None, **bounds: Any) -> Any:
    """A setting's field: its default, bounds and one-line help; ``none`` says what None
    means where None is allowed (shown as the default in the CLI help and the README)."""
    extra: JsonDict | None = {"none": none} if none is not None else None
    return Field(default, description=description, json_schema_extra=extra, **bounds)


#: The most any setting in seconds may be (ten years; README "Settings"): beyond it is a
#: typo, and every place a duration goes takes it: a thread's wait (``threading.TIMEOUT_MAX``,
#: about 292 years on Linux), a wall-clock time (``time_t``), milliseconds in Redis.
MAX_SECONDS = 10 * 365 * 24 * 3600.0
#: The longest a finished job may be kept: the bound of every duration.
MAX_TTL_S = MAX_SECONDS
#: The most any setting in MB may be (a pebibyte; README "Settings"): more memory or file
#: than a machine has, and in bytes (2**50) it fits where a limit goes: an rlimit (a C
#: long), a control group's memory file.
MAX_MB = float(2**30)
#: How long a finished job is kept by default (README "Retention"): a completed one a day,
#: a failed or cancelled one a week (time to look into why).
RESULT_TTL_S = 24 * 3600.0
FAILURE_TTL_S = 7 * 24 * 3600.0
#: The count caps, per queue: met only by a runaway queue, so Redis memory stays bounded
#: (README "Retention" gives the bytes per job). A failed job holds more (its error, and
#: an attempt's traceback and output), and a queue failing in bulk is itself the runaway:
#: failed and cancelled jobs are capped at a tenth as many, each.
RETAIN_COMPLETED = 1_000_000
RETAIN_FAILED = 100_000


class JobOptions(_Frozen):
    """Per-job options; ``None`` means "use the worker's default"."""

    job_id: str | None = setting_field(
        None,
        "a unique id: a job with this id is not added twice",
        none="a new one",
        min_length=1,
        max_length=MAX_JOB_ID,
    )
    soft_timeout_s: Annotated[float | None, NUMBER_ONLY] = setting_field(
        None, "this job's soft timeout", none="the worker's"
    )
    hard_timeout_s: Annotated[float | None, NUMBER_ONLY] = setting_field(
        None, "this job's hard timeout", none="the worker's"
    )
    retries: Annotated[int | None, NUMBER_ONLY] = setting_field(
        None, "retries after a failed attempt", none="the worker's", ge=0, le=1000
    )
    backoff_s: Annotated[float, NUMBER_ONLY] = setting_field(
        1.0,
        "the first retry's delay, doubled for each one after it",
        ge=0,
        le=7 * 24 * 3600,
        allow_inf_nan=False,
    )
    priority: Annotated[int, NUMBER_ONLY] = setting_field(
        0,
        f"higher runs first ({-MAX_PRIORITY}..{MAX_PRIORITY})",
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
    )
    delay_s: Annotated[float, NUMBER_ONLY] = setting_field(
        0.0, "run no sooner than this from now", ge=0, le=365 * 24 * 3600, allow_inf_nan=False
    )
    max_memory_mb: Annotated[float | None, NUMBER_ONLY] = setting_field(
        None, "this job's memory limit", none="the worker's"
    )
    max_stalls: Annotated[int, NUMBER_ONLY] = setting_field(
        1, "stalls (expired leases) before the job fails", ge=0, le=1000
    )
    # Retention (README "Retention"): how long this job is kept once finished.
    result_ttl_s: Annotated[float | None, NUMBER_ONLY] = setting_field(
        None,
        "keep this job this long once completed",
        none="the queue's",
        ge=0,
        le=MAX_TTL_S,
        allow_inf_nan=False,
    )
    failure_ttl_s: Annotated[float | None, NUMBER_ONLY] = setting_field(
        None,
        "keep this job this long once failed or cancelled",
        none="the queue's",
        ge=0,
        le=MAX_TTL_S,
        allow_inf_nan=False,
    )
    max_queue_s: Annotated[float | None, NUMBER_ONLY] = setting_field(
        None,
        "never start this job after it waited this long to be claimed: outcome expired",
        none="the worker's",
    )
    deadline_s: Annotated[float | None, NUMBER_ONLY] = setting_field(
        None,
        "this job's whole budget from enqueue, every attempt and backoff: outcome deadline",
        none="the worker's",
    )
    progress_timeout_s: Annotated[float | None, NUMBER_ONLY] = setting_field(
        None,
        "end an attempt that did not call progress() for this long: outcome progress_timeout",
        none="the worker's",
    )
    traceparent: str | None = setting_field(
        None,
        "the W3C trace context its attempts continue (set at enqueue while tracing is on)",
        none="none",
    )

    @field_validator("traceparent", mode="before")
    @classmethod
    def _traceparent(cls, value: object, info: ValidationInfo) -> object:
        if value is None or is_traceparent(value):
            return value
        if info.context is _STORED:
            return None  # a forged or damaged record: the job runs untraced, never fails
        raise ValueError(
            f"must be a W3C traceparent ('00-<32 hex>-<16 hex>-<2 hex>'), got {value!r:.80}"
        )

    @field_validator(
        "soft_timeout_s",
        "hard_timeout_s",
        "max_memory_mb",
        "max_queue_s",
        "deadline_s",
        "progress_timeout_s",
    )
    @classmethod
    def _positive(cls, value: float | None, info: Any) -> float | None:
        return _positive_within_bounds(info.field_name, value)

    @model_validator(mode="after")
    def _soft_before_hard(self) -> JobOptions:
        check_timeouts(self.soft_timeout_s, self.hard_timeout_s)
        check_budgets(
            self.max_queue_s, self.deadline_s, self.progress_timeout_s, self.hard_timeout_s
        )
        return self


@functools.lru_cache(maxsize=1024)
def parse_job_options(options_json: str) -> JobOptions:
    """Validated job options from their stored JSON; cached because most jobs of a queue
    share one options string. Raises ``pydantic.ValidationError`` (a ``ValueError``)."""
    return JobOptions.model_validate_json(options_json, context=_STORED)


class AttemptRecord(_Frozen):
    """One execution of a job: the answer to "why did my job die", and where.

    ``attempt`` is the attempt's number in the job's history: it counts every attempt
    started, across requeues and manual retries (the retry budget counts separately).
    ``traceback``: the handler's traceback when it raised, or the stack the child was in
    when it was stopped at a timeout or crashed (bounded: the innermost frames are kept,
    and a line says how much was cut). ``output``: the last bytes of what the child wrote
    to stdout and stderr during the attempt (``capture_output``).
    """

    attempt: StoredInt
    outcome: Outcome
    action: Action | None = None
    worker_id: str | None = None
    pid: StoredInt | None = None
    exitcode: StoredInt | None = None
    signal: StoredInt | None = None
    started_ms: StoredInt | None = None
    ended_ms: StoredInt | None = None
    error: str | None = None
    traceback: str | None = None
    output: str | None = None
    #: The memory limit the attempt ran under, and the most its process tree grew (from
    #: its control group where it had one, else the sampled tree RSS), MB.
    memory_limit_mb: float | None = None
    peak_memory_mb: float | None = None

    @classmethod
    def refused(
        cls, attempt: int, worker_id: str, cause: str, ended_ms: int | None = None
    ) -> AttemptRecord:
        """A job that could not run at all (a malformed record, options or codec this
        worker cannot take): the attempt fails with ``cause`` at ``ended_ms``, nothing was
        started (no ``started_ms``)."""
        return cls(
            attempt=attempt,
            outcome=Outcome.ERROR,
            action=Action.FAIL,
            worker_id=worker_id,
            ended_ms=ended_ms,
            error=cause,
        )


class WorkerJobRecord(_Frozen):
    """A job a worker holds, as its registry record shows it."""

    id: str
    attempt: int
    pid: int | None  # the child running it (None: not started yet)
    started_ms: int | None = None  # when that child took it (a job claimed ahead waits)
    rss_mb: float | None  # the child's process tree, for the dashboard's workers page
    lease_renewed_s_ago: float  # counted from the record's ``registered_ms``


class WorkerRecord(_Frozen):
    """What a live worker publishes about itself (``sandboxq info``, the dashboard); it
    is refreshed on the heartbeat's schedule and gone ``lease_s`` after the last refresh.
    Readers take it as another process's word: ``records.worker_record`` checks each field.
    """

    host: str
    pid: int
    queue: str
    concurrency: int
    started_ms: int
    lease_s: float
    registered_ms: int
    jobs: list[WorkerJobRecord]
    containment: str | None
    #: What keeps a handler from lifting its limits, comma-separated (pool/privileges.py).
    protections: str | None = None


class RunningAttempt(_Frozen):
    """The attempt of an active job, as far as the backend knows it: the history only
    holds attempts that ended. ``pid`` is the child's, from its worker's registry record
    (None until the worker's next heartbeat publishes it); ``started_ms`` is when it was
    claimed and ``lease_expires_ms`` when its lease runs out unless renewed (both on the
    backend's clock)."""

    attempt: StoredInt
    worker_id: str | None = None
    pid: StoredInt | None = None
    started_ms: StoredInt | None = None
    lease_expires_ms: StoredInt | None = None


class JobInfo(_Frozen):
    """A job as a user sees it (``job.info()``). ``attempts`` counts the attempts its
    retry budget charged (a requeued attempt is not charged, and a manual retry starts
    the count again, while the numbers of its ``history`` keep counting); ``running`` is
    the attempt of an active job."""

    id: str
    queue: str
    state: JobState
    codec: str = "json"
    attempts: StoredInt = 0
    stalls: StoredInt = 0
    #: Deaths of the pool's helpers or of a worker while it ran (``poison`` at the limit).
    infra_deaths: StoredInt = 0
    options: JobOptions = JobOptions()
    created_ms: StoredInt | None = None
    finished_ms: StoredInt | None = None
    outcome: Outcome | None = None
    error: str | None = None
    history: list[AttemptRecord] = []
    running: RunningAttempt | None = None
    #: Parts of the stored record that could not be read (a record edited by hand), each
    #: naming the field and what it held; those fields show their defaults instead.
    unreadable: list[str] = []


# -- batches ------------------------------------------------------------------------------

#: A batch id: letters, digits, '_' and '-' (no '.': a member's id is "<batch id>.<index>").
_BATCH_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_batch_id(batch_id: str) -> str:
    if not isinstance(batch_id, str) or not _BATCH_ID.fullmatch(batch_id):
        raise ConfigError(
            f"batch id {batch_id!r:.80} is invalid: use 1-64 letters, digits, '_' or '-'"
        )
    return batch_id


def member_id(batch_id: str, index: int) -> str:
    """The job id of a batch's member ``index`` (0-based, input order): members need no
    list of their own, and a job's id names its batch and place."""
    return f"{batch_id}.{index}"


@dataclass(frozen=True, slots=True)
class BatchProgress:
    """A batch's counts, read in one O(1) call: kept by the scripts that move its members.

    ``total`` is the number of members the batch was made with; ``enqueued`` how many of
    them exist (less than ``total`` only while, or after a failed, enqueue). ``done``: every
    member is completed, failed or cancelled. ``then_sent``: its follow-up job was
    enqueued (``None`` when it has no ``then`` queue); ``then_error``: why it could not be
    (the ``then`` queue out of the finishing worker's ACL, a key of it of the wrong type).
    """

    batch_id: str
    queue: str
    total: int
    enqueued: int
    waiting: int
    active: int
    delayed: int
    completed: int
    failed: int
    cancelled: int
    done: bool
    then: str | None = None
    then_sent: bool | None = None
    created_ms: int | None = None
    done_ms: int | None = None
    then_error: str | None = None
    #: What the batch's maker said of it (``Queue.batch(label=...)``), e.g. ``sandboxq run``'s
    #: input file and line numbers.
    label: str | None = None

    @property
    def finished(self) -> int:
        return self.completed + self.failed + self.cancelled

    def summary(self) -> dict[str, Any]:
        """The follow-up job's single argument (also ``sandboxq batch --json``'s core)."""
        return {
            "batch_id": self.batch_id,
            "queue": self.queue,
            "total": self.total,
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
        }
