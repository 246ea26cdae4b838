"""What a finished job means to a reader: its decoded result, or ``JobFailed``; and the
checks of a wait's arguments. No I/O: the sync and asyncio clients and ``Batch`` share them.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from sandboxq import codec as codecs
from sandboxq.errors import ConfigError, JobFailed, JobNotFound
from sandboxq.models import JobInfo, JobState


def decode_result(info: JobInfo, data: bytes | None, allowed: Collection[str]) -> Any:
    """A completed job's stored result ``data`` decoded (None if it stored none), only with
    a codec in ``allowed`` (see ``codec.decode_stored``): every reader's one way to it."""
    if data is None:
        return None
    return codecs.decode_stored(data, info.codec, allowed=allowed, job_id=info.id)


def no_such_job(queue: str, job_id: str) -> JobNotFound:
    return JobNotFound(
        f"job {job_id!r} of queue {queue!r} does not exist "
        "(never enqueued, removed by retention, or purged)",
        job_id=job_id,
    )


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
