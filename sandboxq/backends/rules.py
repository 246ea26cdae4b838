"""The numbers, words and boundaries both backends must agree on, defined once: what
they keep (``Retention``, the options every backend takes), the limits of one call, the
texts they store, and how they read time.

    rules.py ──► memory/        imports them
             ├─► redis/*.py      imports them (arguments, checks, replies)
             └─► redis/scripts.py generates ``lua_constants()`` in front of every script

The model-based test (tests/test_backend_model.py) drives both backends with the same
calls and compares every answer: any rule that lived in two places drifted (the stall
failure text, ``<=`` against ``<`` at lease expiry, rounding seconds to milliseconds), so
each lives here and nowhere else. A Lua script that applies one of these rules says which
(``rules.lease_expired`` and so on) next to the comparison.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple, get_args

from sandboxq.backends.base import FinishAction, NewJob
from sandboxq.errors import BatchNotFound, ConfigError, JobNotFound
from sandboxq.models import (
    FAILURE_TTL_S,
    MAX_PRIORITY,
    RESULT_TTL_S,
    RETAIN_COMPLETED,
    RETAIN_FAILED,
    JobOptions,
    JobState,
    Outcome,
    parse_job_options,
)

#: Attempt records kept per job.
#: Largest stored text a reader takes in (records.py), and the scripts that read another
#: process's record (a worker's registry record) as well.
MAX_FIELD_BYTES = 1 << 20

#: Entries per claimed job in a claim or finish reply (common.lua's claim_jobs): id, token,
#: payload, codec, opts, charged attempt, wait ms, infra deaths, history number, age ms.
CLAIM_ROW = 10

HISTORY_CAP = 1000
#: A job's ``max_stalls`` when its record has none: the option's own default.
DEFAULT_MAX_STALLS: int = JobOptions.model_fields["max_stalls"].default
#: What ``finish`` may do with an attempt.
FINISH_ACTIONS: tuple[FinishAction, ...] = get_args(FinishAction)

# Work done per call, so one call (one Lua script on Redis) stays short; what is left is
# taken by the next call of the same kind.
#: Due delayed jobs moved to waiting per claim.
PROMOTE_LIMIT = 200
#: Finished jobs deleted by retention each time a job enters a finished state.
TRIM_BUDGET = 100
#: Expired leases handled per ``recover_stalled``.
RECOVER_LIMIT = 500
#: Members of one batch a batch call (cancel, retry, forget) handles per script call.
BATCH_CHUNK = 1000
#: The longest label a batch may carry (``Queue.batch(label=...)``), in UTF-8 bytes.
MAX_LABEL_BYTES = 256 * 1024
#: The most members a batch may have: about 10 GB of Redis at a kilobyte a member. A
#: batch read back with more is a damaged record (a reader keeps a byte per member).
MAX_BATCH_MEMBERS = 10_000_000
#: The id of a batch's follow-up job on its ``then`` queue: "<batch id>.then".
FOLLOW_UP_SUFFIX = ".then"

#: The error of an attempt whose lease expired, when the job goes back to waiting
#: (``%d`` stalls so far, ``%d`` allowed) and when it fails for stalling too often.
STALL_RETRY_TEXT = (
    "lease expired (stall %d of at most %d): the worker holding it stopped renewing it"
)
STALL_FAIL_TEXT = "stalled %d times: the worker holding its lease stopped renewing it"
#: The error of a job that fails as ``poison``: ``%d`` deaths of the pool's helpers or of
#: its worker while it ran (``DEFAULT_MAX_INFRA_DEATHS`` unless the worker says otherwise),
#: ``%s`` the last one, in words.
POISON_TEXT = (
    "the pool's helpers or its worker died %d times while this job ran (last: %s); "
    "it is not run again unless retried"
)
#: What died, for ``POISON_TEXT``, when a worker's lease on the job expired.
WORKER_DEATH_TEXT = "the worker holding its lease died or stopped renewing it"
#: The error of a job cancelled while in state ``%s``.
CANCELLED_TEXT = "cancelled while %s"
#: The error of a job whose record is too broken to run (``%s``: what is wrong).
MALFORMED_TEXT = "malformed job record: %s"
#: The error of a job not started within its ``max_queue_s`` (``%d``: that in ms) of
#: becoming runnable; it never ran (outcome expired).
EXPIRED_TEXT = "not started within max_queue_s (%d ms) of becoming runnable"
#: The error of a job whose ``deadline_s`` (``%d`` ms from enqueue) passed before attempt
#: ``%d`` could start (outcome deadline).
DEADLINE_TEXT = "its deadline_s (%d ms from enqueue) passed before attempt %d could start"


# -- what a backend keeps ------------------------------------------------------------------


def check_limits(**limits: object) -> None:
    """Retention and size limits of a backend: non-negative, finite numbers (not bools)."""
    for name, value in limits.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise ConfigError(f"{name} must be a non-negative number, got {value!r}")


#: How long a done batch is kept by default (``Retention.batch_ttl_s``); also what a
#: batch whose stored time to live is not a count (forged) gets.
BATCH_TTL_S = 7 * 24 * 3600


@dataclass(frozen=True)
class Retention:
    """What a backend keeps, the same options and defaults for every backend: finished
    jobs by age (``result_ttl_s`` for completed ones, ``failure_ttl_s`` for failed and
    cancelled ones; a job's own option of the same name wins) and, as a bound, by count
    (``retain_completed``; ``retain_failed`` for failed and for cancelled ones, each);
    and the newest ``max_events`` events. ``retain_s``, the older single age, sets both
    ages where they are not given."""

    retain_completed: int = RETAIN_COMPLETED
    retain_failed: int = RETAIN_FAILED
    retain_s: float | None = None
    max_events: int = 10_000
    #: A batch, and every member of it, is kept until this long after it is done (or
    #: ``Batch.forget()``); retention by count and age never removes a member before.
    batch_ttl_s: float = BATCH_TTL_S
    result_ttl_s: float | None = None
    failure_ttl_s: float | None = None

    def __post_init__(self) -> None:
        check_limits(
            retain_completed=self.retain_completed,
            retain_failed=self.retain_failed,
            max_events=self.max_events,
            batch_ttl_s=self.batch_ttl_s,
            **{
                name: value
                for name in ("retain_s", "result_ttl_s", "failure_ttl_s")
                if (value := getattr(self, name)) is not None
            },
        )

    @property
    def completed_ttl_ms(self) -> int:
        """How long a completed job is kept, unless it says otherwise."""
        return ms(_first(self.result_ttl_s, self.retain_s, RESULT_TTL_S))

    @property
    def failed_ttl_ms(self) -> int:
        """How long a failed or cancelled job is kept, unless it says otherwise."""
        return ms(_first(self.failure_ttl_s, self.retain_s, FAILURE_TTL_S))

    def ttl_ms(self, state: JobState, options: JobOptions) -> int:
        """How long a job entering finished ``state`` is kept: its own option, else the
        queue's (common.lua's ``ttl_ms``)."""
        if state is JobState.COMPLETED:
            own = options.result_ttl_s
            return self.completed_ttl_ms if own is None else ms(own)
        own = options.failure_ttl_s
        return self.failed_ttl_ms if own is None else ms(own)


def _first(*values: float | None) -> float:
    return next(v for v in values if v is not None)


# -- time -------------------------------------------------------------------------------


def ms(seconds: float) -> int:
    """Seconds to whole milliseconds, rounded up (a delay never ends early)."""
    return max(0, math.ceil(seconds * 1000))


def lease_ms(seconds: float) -> int:
    """A lease's (or any time-to-live's) length in milliseconds: at least one."""
    return max(1, ms(seconds))


def lease_expired(expiry_ms: int, now_ms: int) -> bool:
    """A lease that expires at ``expiry_ms`` has run out at ``now_ms``: strictly after it
    (recover_stalled.lua's ``ZRANGEBYSCORE -inf (now``). A worker's registration expires
    the same way (Redis keeps a key with a TTL up to and including its expiry ms)."""
    return expiry_ms < now_ms


def fence_lifted(fenced_until_ms: int, now_ms: int) -> bool:
    """A fence lasts up to and including ``fenced_until_ms`` (the old lease's expiry), and
    lifts when the lease would have been recovered: the same boundary as ``lease_expired``."""
    return lease_expired(fenced_until_ms, now_ms)


def retention_over(expires_ms: int, now_ms: int) -> bool:
    """A finished job kept until ``expires_ms`` (when it finished plus its time to live) is
    gone at ``now_ms``: at or after it (common.lua's ``ZRANGEBYSCORE expiry -inf now``), so
    a time to live of 0 keeps no finished job."""
    return expires_ms <= now_ms


def poisoned(infra_deaths: int, max_infra_deaths: int) -> bool:
    """A job counted ``infra_deaths`` times is stopped (finish.lua, recover_stalled.lua)."""
    return infra_deaths >= max_infra_deaths


def budget_passed(
    options: JobOptions, created_ms: int, ready_ms: int, now_ms: int, attempt: int
) -> tuple[Outcome, str] | None:
    """Whether a job popped by a claim must not start (claim_jobs in common.lua): its
    ``deadline_s`` from ``created_ms`` has passed (outcome deadline), or it waited longer
    than its ``max_queue_s`` since ``ready_ms`` (outcome expired); strictly after, as for
    leases. None: it may start. ``attempt`` is the one that would have run."""
    if options.deadline_s is not None:
        deadline_ms = ms(options.deadline_s)
        if now_ms - created_ms > deadline_ms:
            return Outcome.DEADLINE, DEADLINE_TEXT % (deadline_ms, attempt)
    if options.max_queue_s is not None:
        max_ms = ms(options.max_queue_s)
        if now_ms - ready_ms > max_ms:
            return Outcome.EXPIRED, EXPIRED_TEXT % max_ms
    return None


def child_pids(info: dict[str, Any]) -> list[tuple[str, int, int, int | None]]:
    """(job id, attempt number, child pid, when the child took it or None) of each job a
    worker's registry record says a child runs: what ``register_worker`` notes on those
    jobs (child_pids.lua), so an attempt that ends without its worker keeps its pid and
    start after the record is gone."""
    return [
        (held["id"], held["attempt"], held["pid"], running_child(info, held["id"]).started_ms)
        for held in info.get("jobs") or ()
        if isinstance(held, dict)
        and isinstance(held.get("id"), str)
        and isinstance(held.get("attempt"), int)
        and isinstance(held.get("pid"), int)
    ]


class RunningChild(NamedTuple):
    """The child running a job's attempt, as its worker's registry record says: its pid,
    and when it took the job (None where the record does not say)."""

    pid: int | None
    started_ms: int | None = None


def running_child(info: dict[str, Any], job_id: str) -> RunningChild:
    """The child a worker's registry record (``info``) says runs ``job_id``."""
    for held in info.get("jobs") or ():
        if isinstance(held, dict) and held.get("id") == job_id:
            pid, started = held.get("pid"), held.get("started_ms")
            return RunningChild(
                pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                started if isinstance(started, int) and not isinstance(started, bool) else None,
            )
    return RunningChild(None)


def attempt_start(claimed_ms: int | None, child: RunningChild) -> int | None:
    """When an attempt that ends without its worker (cancelled, lease lost) started: when
    its child took it, once a child ran it (its pid is known); its claim where the record
    does not say when; else None. A job claimed ahead (``prefetch``) waits in its worker
    for a child it may never get: its claim was no start, and its wait no run
    (common.lua's running_attempt)."""
    if child.pid is None:
        return None
    return child.started_ms if child.started_ms is not None else claimed_ms


# -- checks and texts ---------------------------------------------------------------------


def job_options(job_id: str, new: NewJob) -> JobOptions:
    """A new job's options and priority, checked at enqueue, so a stored job can always be
    claimed and read."""
    try:
        options = parse_job_options(new.options_json)
    except ValueError as exc:
        raise ConfigError(f"job {job_id!r}: invalid options: {brief(exc)}") from exc
    if not -MAX_PRIORITY <= new.priority <= MAX_PRIORITY:
        raise ConfigError(f"job {job_id!r}: priority {new.priority} is outside ±{MAX_PRIORITY}")
    return options


def check_actions(actions: Iterable[str]) -> None:
    """Raise ``ConfigError`` for an action ``finish`` does not know (before anything runs)."""
    for action in actions:
        if action not in FINISH_ACTIONS:
            raise ConfigError(f"unknown finish action {action!r}; expected one of {FINISH_ACTIONS}")


def purgeable(state: JobState | str) -> JobState:
    """``state`` as a ``JobState`` that ``purge`` may empty (every one but active)."""
    state = JobState(state)
    if state is JobState.ACTIVE:
        raise ConfigError("active jobs cannot be purged: their workers hold leases; cancel them")
    return state


def job_not_found(queue: str, job_id: str) -> JobNotFound:
    """What a waiter gets for a job that is not there (never enqueued, trimmed, purged)."""
    return JobNotFound(f"job {job_id!r} of queue {queue!r} does not exist", job_id=job_id)


def batch_expired(queue: str, batch_id: str, expired_ms: int, ttl_ms: int) -> BatchNotFound:
    """What every reader of a batch past its ``batch_ttl_s`` gets, whatever retention has
    deleted of it yet (it goes a few members per finish on the queue)."""
    try:
        at = datetime.fromtimestamp(expired_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, ValueError, OSError):  # a stored number no clock reaches
        at = f"{expired_ms} ms"
    return BatchNotFound(
        f"batch {batch_id!r} of queue {queue!r} does not exist any more: it expired at {at} "
        f"(batch_ttl_s {ttl_ms / 1000:g} s after it was done), and retention deletes "
        "what is left of it",
        batch_id=batch_id,
        expired_ms=expired_ms,
    )


def clip_error(error: str, limit: int) -> str:
    """The first ``limit`` bytes of an error's UTF-8, as page.lua's ``string.sub`` cuts it
    (a character cut in two reads as U+FFFD, as the Redis backend decodes it)."""
    return error.encode()[:limit].decode("utf-8", errors="replace")


#: A failed attempt's error is ``<module>.<qualname>: <message>`` (pool/attempt.py), its
#: message at most 16 KiB (text.MAX_TRACEBACK_BYTES): an error over this many bytes was
#: written by hand, and its kind is ``OTHER_KIND`` without reading it.
ERROR_KIND_READ_CAP = 32 * 1024
#: The bytes of an error its kind is read from.
ERROR_KIND_HEAD = 200
#: The kind of an error whose first ``ERROR_KIND_HEAD`` bytes name no type.
OTHER_KIND = "other"
_KIND = re.compile(rb"([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*):")


def error_kind(error: str | None) -> str:
    """The kind of an error an attempt that raised left: the type it names before its first
    ``:``, ``ValueError`` for ``builtins.ValueError: bad size``, ``pkg.mod.Bad`` for
    ``pkg.mod.Bad: ...``; ``OTHER_KIND`` unless its first ``ERROR_KIND_HEAD`` bytes start
    with a dotted name of ASCII identifiers and a colon, or when it is over
    ``ERROR_KIND_READ_CAP`` bytes. read_outcome.lua does the same, where the error is:
    the record is anyone's to write, so the work is bounded and the answer is a name."""
    if not error or len(error) > ERROR_KIND_READ_CAP:
        return OTHER_KIND
    if len(error) * 4 > ERROR_KIND_READ_CAP and len(error.encode(errors="replace")) > (
        ERROR_KIND_READ_CAP
    ):
        return OTHER_KIND
    found = _KIND.match(error[:ERROR_KIND_HEAD].encode(errors="replace")[:ERROR_KIND_HEAD])
    if found is None:
        return OTHER_KIND
    return found.group(1).decode("ascii").removeprefix("builtins.")


def brief(exc: BaseException, limit: int = 300) -> str:
    """One line of an exception's text, short enough for an error field or event."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def token_base() -> str:
    """A random base for the lease tokens of one claim; each job's token adds ``.<n>``."""
    return os.urandom(8).hex()


# -- the scripts' copy ------------------------------------------------------------------


def _lua(value: object) -> str:
    # JSON string escapes are valid Lua string escapes for the texts used here
    return json.dumps(value) if isinstance(value, str) else str(value)


def lua_constants() -> str:
    """The rules above as Lua locals, put in front of common.lua by scripts.py."""
    values = {
        "HISTORY_CAP": HISTORY_CAP,
        "CLAIM_ROW": CLAIM_ROW,
        "MAX_FIELD_BYTES": MAX_FIELD_BYTES,
        "MAX_PRIORITY": MAX_PRIORITY,
        "DEFAULT_MAX_STALLS": DEFAULT_MAX_STALLS,
        "PROMOTE_LIMIT": PROMOTE_LIMIT,
        "TRIM_BUDGET": TRIM_BUDGET,
        "BATCH_TTL_MS": BATCH_TTL_S * 1000,
        "FOLLOW_UP_SUFFIX": FOLLOW_UP_SUFFIX,
        "STALL_RETRY_TEXT": STALL_RETRY_TEXT,
        "STALL_FAIL_TEXT": STALL_FAIL_TEXT,
        "CANCELLED_TEXT": CANCELLED_TEXT,
        "MALFORMED_TEXT": MALFORMED_TEXT,
        "POISON_TEXT": POISON_TEXT,
        "WORKER_DEATH_TEXT": WORKER_DEATH_TEXT,
        "EXPIRED_TEXT": EXPIRED_TEXT,
        "DEADLINE_TEXT": DEADLINE_TEXT,
        "ERROR_KIND_READ_CAP": ERROR_KIND_READ_CAP,
        "ERROR_KIND_HEAD": ERROR_KIND_HEAD,
        "OTHER_KIND": OTHER_KIND,
    }
    lines = ["-- generated from sandboxq/backends/rules.py: do not edit here"]
    lines += [f"local {name} = {_lua(value)}" for name, value in values.items()]
    return "\n".join(lines) + "\n"
