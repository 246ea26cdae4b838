"""Reads for the dashboard (``sandboxq.web``): a page of jobs, a job in full, the oldest
wait. Each is one round trip of bounded work, whatever the queue's size:

    job_page          page.lua: ZRANGEBYSCORE from the cursor's score + HMGET per job
    job_detail        one pipeline: HGETALL job + LRANGE history
    summary           summary.lua: a queue's overview line (counts, the oldest job
                      first in line, live workers, the depth history), bounded work
    recent_durations  two pipelines: the newest finished ids, then each one's last record

A cursor is ``<score>:<ties>``: the score of the last job shown and how many jobs at
exactly that score were shown (scores repeat in the finished sets: one per ms).
"""

from __future__ import annotations

import math
from typing import Any

from sandboxq.backends.base import (
    ERROR_CLIP,
    MAX_PAGE,
    PAGE_SCAN,
    PRIORITY_BANDS,
    JobDetail,
    JobPage,
    JobSummary,
    QueueSummary,
)
from sandboxq.backends.index import DEPTH_MINUTES, WORKERS_READ_CAP
from sandboxq.backends.redis import records
from sandboxq.backends.redis.connection import Connections, Lane
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.redis.scripts import Arg, Library, Script
from sandboxq.errors import ConfigError
from sandboxq.models import AttemptRecord, JobInfo, JobState, stored_int

#: The most jobs at one score a cursor may say were shown (scores repeat one per ms).
MAX_TIES = 2**31

# ARGV 1-4 of every script are retention settings; these scripts only read.
_UNUSED: list[Arg] = [0, 0, 0, 0, 0]


def _cursor(cursor: str | None, desc: bool) -> tuple[str, int]:
    if cursor is None:
        return ("+inf" if desc else "-inf"), 0
    score, _, ties = cursor.rpartition(":")
    try:
        # what page.lua can take: a score that is a number, a count Lua holds exactly
        # (a tie count past 2^63 failed the script, and the page said Redis was down)
        if math.isnan(float(score)) or not 0 <= int(ties) <= MAX_TIES:
            raise ValueError(ties)
        return score, int(ties)
    except ValueError:
        raise ConfigError(f"invalid page cursor {cursor!r}") from None


def _int(raw: bytes) -> int | None:
    try:
        return stored_int(raw) if raw else None
    except ValueError:
        return None


class Pages:
    def __init__(self, keys: QueueKeys, lane: Lane, library_use: Library) -> None:
        self.keys = keys
        self._page = Script("page", keys.script_keys, _UNUSED, lane, library_use)
        self._summary = Script("summary", keys.script_keys, _UNUSED, lane, library_use)

    def job_page(
        self, state: JobState, cursor: str | None, limit: int, outcome: str | None
    ) -> JobPage:
        state = JobState(state)
        if limit <= 0:
            return JobPage([], cursor, 0)
        desc = state.finished
        score, ties = _cursor(cursor, desc)
        args: list[Arg] = [
            state.value,
            "desc" if desc else "asc",
            score,
            ties,
            min(limit, MAX_PAGE),
            outcome or "",
            PAGE_SCAN if outcome else min(limit, MAX_PAGE),
            ERROR_CLIP,
        ]
        more, last, shown, scanned, *flat = self._page(args)
        jobs = [
            JobSummary(
                id=records.text(flat[i]),
                state=records.text(flat[i + 1]),
                attempts=_int(flat[i + 2]),
                outcome=records.text(flat[i + 3]) or None,
                error=records.text(flat[i + 4]) or None,
                created_ms=_int(flat[i + 5]),
                finished_ms=_int(flat[i + 6]),
            )
            for i in range(0, len(flat), 7)
        ]
        next_cursor = f"{records.text(last)}:{int(shown)}" if int(more) else None
        return JobPage(jobs, next_cursor, int(scanned))

    def summary(self) -> QueueSummary:
        reply: Any = self._summary([PRIORITY_BANDS, WORKERS_READ_CAP, DEPTH_MINUTES])
        counts = dict(zip(JobState, map(int, reply[:6]), strict=True))
        oldest, live, capped, depth_read, *depth = reply[6:]
        return QueueSummary(
            counts,
            None if oldest is None else int(oldest),
            int(live),
            bool(capped),
            depth_samples(dict(zip(depth[::2], depth[1::2], strict=True))) if depth_read else None,
        )


def job_detail(info: JobInfo, fields: dict[bytes, bytes]) -> JobDetail:
    """A job's page from its record as ``get`` read it and its payload fields."""
    progress: float | None
    try:
        progress = float(fields[b"progress"]) if b"progress" in fields else None
    except ValueError:
        progress = None
    if progress is not None and not math.isfinite(progress):
        progress = None
    message = fields.get(b"progress_message")
    return JobDetail(
        info=info,
        payload=fields.get(b"payload"),
        result=fields.get(b"result") if info.state is JobState.COMPLETED else None,
        progress=progress,
        progress_message=None if message is None else records.text(message),
    )


def depth_samples(fields: dict[Any, Any]) -> list[tuple[int, int]]:
    """depth.lua's hash as (minute start ms, jobs waiting), oldest first; fields that are
    not two integers (changed by hand) are left out."""
    out = []
    for minute, waiting in fields.items():
        m, w = _int(minute), _int(waiting)
        if m is not None and w is not None:
            out.append((m * 60_000, w))
    return sorted(out)[-DEPTH_MINUTES:]


def recent_durations(conns: Connections, keys: QueueKeys, limit: int) -> list[tuple[str, float]]:
    """The last attempt record of up to ``limit`` recently finished jobs, two round
    trips: the newest ids of the completed and failed sets, then for each its history's
    last record and the hash fields that hold a sole attempt (records.sole_attempt)."""
    with conns.errors("read recent durations"):
        pipe = conns.main.pipeline(transaction=False)
        pipe.zrevrange(keys.completed, 0, limit - 1)
        pipe.zrevrange(keys.failed, 0, limit - 1)
        completed, failed = pipe.execute()
        ids = [records.text(i) for i in [*completed, *failed]][:limit]
        pipe = conns.main.pipeline(transaction=False)
        sole_fields = [*records.SOLE_ATTEMPT_FIELDS, "outcome"]
        for job_id in ids:
            pipe.lindex(keys.history(job_id), -1)
            pipe.hmget(keys.job(job_id), sole_fields)
        replies: list[Any] = pipe.execute(raise_on_error=False) if ids else []
    out = []
    for listed, held in zip(replies[::2], replies[1::2], strict=True):
        raw = listed
        if listed is None and isinstance(held, list):
            fields = {n: v for n, v in zip(sole_fields, held, strict=True) if v is not None}
            raw = records.sole_attempt(fields)
        if not isinstance(raw, bytes) or len(raw) > records.MAX_FIELD_BYTES:
            continue
        try:
            record = AttemptRecord.model_validate_json(raw)
        except ValueError:  # a record changed by hand: left out of the chart
            continue
        if record.started_ms is not None and record.ended_ms is not None:
            out.append((record.outcome.value, max(0, record.ended_ms - record.started_ms) / 1000))
    return out
