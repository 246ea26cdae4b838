"""What a finished job means to a reader: its decoded result, or ``JobFailed``; the checks
of a wait's arguments, and its patience with an unreachable backend (``Outage``, which
logs one line an outage; ``patiently``, which tries a read again while it allows). No
backend I/O of its own: the sync and asyncio clients and ``Batch`` share them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, TypeVar

from sandboxq import codec as codecs
from sandboxq.errors import BackendUnreachable, ConfigError, JobFailed, JobNotFound
from sandboxq.models import JobInfo, JobState


def result_value(job_id: str, codec: str, data: bytes | None, allowed: Collection[str]) -> Any:
    """A completed job's stored result ``data`` decoded (None if it stored none), only with
    a codec in ``allowed`` (see ``codec.decode_stored``): every reader's one way to it."""
    if data is None:
        return None
    return codecs.decode_stored(data, codec, allowed=allowed, job_id=job_id)


def decode_result(info: JobInfo, data: bytes | None, allowed: Collection[str]) -> Any:
    """``result_value`` of the completed job ``info``."""
    return result_value(info.id, info.codec, data, allowed)


log = logging.getLogger(__name__)
T = TypeVar("T")

#: How long a wait with no timeout goes on while the backend stays unreachable, in a row.
UNREACHABLE_WAIT_S = 60.0
#: Between its tries (a Sentinel failover takes a few seconds; a restart, about one).
UNREACHABLE_RETRY_S = 0.2


class Outage:
    """A wait's patience with an unreachable backend: a failover ("no master found" for a
    moment), a restart. The wait tries again until its deadline, or, without one, until
    ``UNREACHABLE_WAIT_S`` in a row have passed; then the last error is raised. ``waited``
    names what is waited for in the log line ("job 'x'", "batch 'y'")."""

    __slots__ = ("_deadline", "_since", "_waited")

    def __init__(self, waited: str, deadline: float | None) -> None:
        self._waited, self._deadline = waited, deadline
        self._since: float | None = None

    def pause_s(self, error: BackendUnreachable) -> float:
        """How long to wait before the next try; raises ``error`` once the time is up."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
            log.info("waiting for %s: %s; trying again until the wait ends", self._waited, error)
        end = self._deadline if self._deadline is not None else self._since + UNREACHABLE_WAIT_S
        if now + UNREACHABLE_RETRY_S >= end:
            raise error
        return UNREACHABLE_RETRY_S

    def over(self) -> None:
        """The backend answered again."""
        self._since = None


def patiently(outage: Outage, read: Callable[[], T]) -> T:
    """``read()``, tried again while the backend is unreachable, for as long as ``outage``
    allows. ``read`` must change nothing it would not change again on its next try."""
    while True:
        try:
            answer = read()
        except BackendUnreachable as exc:
            time.sleep(outage.pause_s(exc))
            continue
        outage.over()
        return answer


async def patiently_async(outage: Outage, read: Callable[[], Awaitable[T]]) -> T:
    """As ``patiently``, awaited."""
    while True:
        try:
            answer = await read()
        except BackendUnreachable as exc:
            await asyncio.sleep(outage.pause_s(exc))
            continue
        outage.over()
        return answer


#: The finished states retention trims, by the names of their fields in ``Trims``.
TRIMMED_STATES = ("completed", "failed", "cancelled")


@dataclass(frozen=True)
class Trims:
    """What retention has removed from a queue so far (common.lua's ``trims`` hash; the
    memory backend keeps the same fields): per finished state, the jobs the count cap took
    (``capped``), the cap then (``caps``) and when the newest of them had finished
    (``capped_newest_ms``); and the jobs that went past their time to live (``expired``),
    the last time any did (``expired_upto_ms``). No record of a removed job is kept."""

    capped: dict[str, int] = field(default_factory=dict)
    caps: dict[str, int] = field(default_factory=dict)
    capped_newest_ms: dict[str, int] = field(default_factory=dict)
    expired: int = 0
    expired_upto_ms: int | None = None

    #: The stored field names, in the order ``from_fields`` reads them.
    FIELDS: ClassVar[tuple[str, ...]] = (
        *(f"{s}_{what}" for s in TRIMMED_STATES for what in ("capped", "cap", "capped_newest_ms")),
        "expired",
        "expired_upto_ms",
    )

    @classmethod
    def from_fields(cls, fields: Mapping[str, int | None]) -> Trims:
        """From the stored fields (a missing one: nothing of that kind was trimmed)."""

        def per_state(what: str) -> dict[str, int]:
            found = {s: fields.get(f"{s}_{what}") for s in TRIMMED_STATES}
            return {s: n for s, n in found.items() if n is not None}

        return cls(
            capped=per_state("capped"),
            caps=per_state("cap"),
            capped_newest_ms=per_state("capped_newest_ms"),
            expired=fields.get("expired") or 0,
            expired_upto_ms=fields.get("expired_upto_ms"),
        )

    def describe(self) -> str:
        """The trims in words, for ``JobNotFound``."""
        parts = []
        for state, n in self.capped.items():
            newest = self.capped_newest_ms.get(state)
            when = f", the newest of them finished at {_utc(newest)}" if newest else ""
            cap = self.caps.get(state)
            setting = "retain_completed" if state == "completed" else "retain_failed"
            limit = f" of {cap:,} ({setting})" if cap is not None else ""
            parts.append(f"{_jobs(n, state)} by its count cap{limit}{when}")
        if self.expired:
            parts.append(
                f"{_jobs(self.expired, 'finished')} past their time to live "
                f"(result_ttl_s / failure_ttl_s), the last at {_utc(self.expired_upto_ms)}"
            )
        return "; ".join(parts) if parts else "none yet"


def why_missing(trims: Trims | None) -> str:
    """Why a job is not there, as far as the queue's ``trims`` (None: unknown) tell."""
    if trims is None:
        return "(never enqueued, removed by retention, or purged)"
    if not trims.capped and not trims.expired:
        return (
            "(never enqueued, purged, or removed with its batch: retention has removed"
            " no finished job of this queue)"
        )
    if not trims.expired:
        rule = "or trimmed by the count cap, the only retention rule that has removed jobs here"
    elif not trims.capped:
        rule = "or past its time to live, the only retention rule that has removed jobs here"
    else:
        rule = (
            "or removed by retention; which rule removed it is not known (no record of a"
            " removed job is kept)"
        )
    return (
        f"(never enqueued, purged, {rule}); retention has removed from this queue:"
        f" {trims.describe()}"
    )


def _jobs(n: int, state: str) -> str:
    return f"{n:,} {state} job{'' if n == 1 else 's'}"


def _utc(ms: int | None) -> str:
    if ms is None:
        return "an unknown time"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def no_such_job(queue: str, job_id: str, trims: Trims | None = None) -> JobNotFound:
    """``JobNotFound`` for ``job_id``; with the queue's ``trims``, it says what retention
    has removed there, and plainly that which rule removed this job is not known."""
    text = f"job {job_id!r} of queue {queue!r} does not exist {why_missing(trims)}"
    return JobNotFound(text, job_id=job_id)


def finished_value(job_id: str, info: JobInfo, data: bytes | None, allowed: Collection[str]) -> Any:
    """A finished job's return value (``data``: its stored result, decoded only with a codec
    in ``allowed``), or ``JobFailed``."""
    if info.state is JobState.COMPLETED:
        return decode_result(info, data, allowed)
    last = info.history[-1] if info.history else None
    raise JobFailed(
        f"job {job_id!r} {info.state}: {info.error or info.outcome or 'no cause recorded'}",
        job_id=job_id,
        outcome=str(info.outcome) if info.outcome else None,
        attempts=info.attempts,
        error=info.error,
        traceback=last.traceback if last else None,
        output=last.output if last else None,
    )


def check_seconds(name: str, value: float | None) -> None:
    """A wait in seconds, or None. NaN compares false with everything: it would never end."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value)
    ):
        raise ConfigError(f"{name} must be a number of seconds or None, got {value!r}")
