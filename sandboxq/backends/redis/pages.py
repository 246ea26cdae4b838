"""Reads for the dashboard (``sandboxq.web``): a page of jobs, a job in full, the oldest
wait. Each is one round trip of bounded work, whatever the queue's size:

    job_page          page.lua: ZRANGEBYSCORE from the cursor's score + HMGET per job
    job_detail        one pipeline: HGETALL job + LRANGE history
    oldest_waiting_ms oldest_waiting.lua: the head of each priority, O(log N) each
    queue_names       SCAN for events streams: a background thread's job, time-boxed

A cursor is ``<score>:<ties>``: the score of the last job shown and how many jobs at
exactly that score were shown (scores repeat in the finished sets: one per ms).
"""

from __future__ import annotations

import math
import time
from typing import Any

from sandboxq.backends.base import (
    ERROR_CLIP,
    MAX_PAGE,
    PAGE_SCAN,
    PRIORITY_BANDS,
    JobDetail,
    JobPage,
    JobSummary,
)
from sandboxq.backends.redis import records
from sandboxq.backends.redis.connection import Connections, Lane
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.redis.scripts import Arg, Library, Script
from sandboxq.errors import ConfigError
from sandboxq.models import JobInfo, JobState, stored_int

# ARGV 1-4 of every script are retention settings; these scripts only read.
_UNUSED: list[Arg] = [0, 0, 0, 0, 0]


def _cursor(cursor: str | None, desc: bool) -> tuple[str, int]:
    if cursor is None:
        return ("+inf" if desc else "-inf"), 0
    score, _, ties = cursor.rpartition(":")
    try:
        float(score)
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
        self._oldest = Script("oldest_waiting", keys.script_keys, _UNUSED, lane, library_use)

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

    def oldest_waiting_ms(self) -> int | None:
        reply: Any = self._oldest([PRIORITY_BANDS])
        return None if reply is None else int(reply)


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


def queue_names(conns: Connections, budget_s: float) -> list[str]:
    """Names of the queues on this Redis, found by their events streams (``SCAN ... TYPE
    stream``). The SCAN walks the whole keyspace, so it is for a background thread, with a
    time budget; what it found by then is returned."""
    deadline = time.monotonic() + budget_s
    found: set[str] = set()
    client: Any = conns.main
    for key in client.scan_iter(match="sq:{*}:events", count=5000, _type="stream"):
        name = records.text(key)[len("sq:") : -len(":events")]
        if name.startswith("{") and name.endswith("}"):
            found.add(name[1:-1])
        if time.monotonic() > deadline:
            break
    return sorted(found)
