"""Memory-aware retries: a job that ran out of memory is retried with more of it.

    attempt n ends memory_limit ─► exit policy: retry (memory_retry_factor set), unless
                                   its limit was already memory_retry_max_mb: fail
    attempt n + 1 claimed ─► its history (one read, retried jobs only) ─► limit_for:
        the last recorded limit x memory_retry_factor after a memory_limit, capped at
        memory_retry_max_mb; the last recorded limit after any other outcome
        ─► Task.max_memory_mb

An image or a model batch that ran out of memory fails again with the same limit; the
limit an attempt ran under and its peak are kept in its record (``AttemptRecord``
``memory_limit_mb`` / ``peak_memory_mb``), which is where the next attempt reads it
from, on whichever worker claims it. A retry spends an attempt like any other: the
job's ``retries`` bound it.
"""

from __future__ import annotations

from collections.abc import Sequence

from sandboxq.backends.base import Backend, Claimed
from sandboxq.errors import BackendError
from sandboxq.models import AttemptRecord, Outcome
from sandboxq.settings import WorkerSettings
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.worker")

#: The error added to a memory_limit attempt not retried because its limit was the cap.
AT_CAP_TEXT = "not retried: it ran at memory_retry_max_mb (%g MB) already"


def limit_for(
    history: Sequence[AttemptRecord], base_mb: float | None, factor: float, cap_mb: float | None
) -> float | None:
    """The memory limit of a job's next attempt, MB, from the records of its earlier ones
    (``base_mb``: its limit without any raise)."""
    for record in reversed(history):
        if record.memory_limit_mb is None:
            continue
        if record.outcome is not Outcome.MEMORY_LIMIT:
            return record.memory_limit_mb
        raised = record.memory_limit_mb * factor
        return raised if cap_mb is None else max(record.memory_limit_mb, min(raised, cap_mb))
    return base_mb


def retry_memory_mb(backend: Backend, job: Claimed, settings: WorkerSettings) -> float | None:
    """The raised memory limit of ``job``'s attempt, or None: its own or the worker's
    applies (a first attempt, memory retries off, no limit to raise). Reads the job's
    history: one backend call, for retried jobs only; if it fails, the base limit."""
    factor = settings.memory_retry_factor
    base = job.options.max_memory_mb or settings.max_memory_mb
    if factor is None or base is None or job.attempt <= 1:
        return None
    try:
        info = backend.get(job.id)
    except BackendError as exc:
        log.warning("job %s: its history could not be read (%s); base memory limit", job.id, exc)
        return None
    if info is None:
        return None
    return limit_for(info.history, base, factor, settings.memory_retry_max_mb)


def at_cap(limit_mb: float | None, cap_mb: float | None) -> bool:
    """Whether an attempt that ran under ``limit_mb`` cannot get more (None: no limit)."""
    return limit_mb is not None and cap_mb is not None and limit_mb >= cap_mb
