"""The memory backend's readers: a job's record, counts, ids per state, and the
dashboard's pages. They change nothing.

The dashboard's memory:// queues live in its own process and are small: these walk the
state's jobs in Python, with the Redis backend's order (``Job.order``), page size, error
clipping and cursor rule (a page starts right after the last job of the page before).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sandboxq.backends import rules
from sandboxq.backends.base import (
    ERROR_CLIP,
    MAX_PAGE,
    PAGE_SCAN,
    PRIORITY_BANDS,
    Event,
    JobDetail,
    JobPage,
    JobStanding,
    JobSummary,
)
from sandboxq.backends.memory.store import ACTIVE, COMPLETED, WAITING, Job, Store
from sandboxq.errors import ConfigError
from sandboxq.finished import Trims
from sandboxq.models import JobInfo, JobState, Outcome, RunningAttempt


class Reads:
    queue: str
    _store: Store

    if TYPE_CHECKING:

        def running_child(  # backend
            self, job_id: str, worker_id: str | None
        ) -> rules.RunningChild: ...

    def get(self, job_id: str) -> JobInfo | None:
        with self._store.cond:
            job = self._store.jobs.get(job_id)
            return None if job is None else self._info(job)

    def _info(self, job: Job) -> JobInfo:
        return JobInfo(
            id=job.id,
            queue=self.queue,
            state=job.state,
            codec=job.new.codec,
            attempts=job.attempts - job.uncharged,
            stalls=job.stalls,
            infra_deaths=job.infra_deaths,
            options=job.options,
            created_ms=job.created_ms,
            finished_ms=job.finished_ms,
            outcome=job.outcome,
            error=job.error,
            history=list(job.history),
            running=self._running(job),
        )

    def _running(self, job: Job) -> RunningAttempt | None:
        if job.state is not ACTIVE:
            return None
        child = self.running_child(job.id, job.owner)
        return RunningAttempt(
            attempt=job.attempts,
            worker_id=job.owner,
            pid=child.pid,
            started_ms=child.started_ms if child.started_ms is not None else job.claimed_ms,
            lease_expires_ms=job.lease_ms,
        )

    def get_arguments(self, job_id: str) -> bytes | None:
        with self._store.cond:
            job = self._store.jobs.get(job_id)
            return None if job is None else job.new.payload

    def get_result(self, job_id: str) -> bytes | None:
        with self._store.cond:
            job = self._store.jobs.get(job_id)
            if job is None or job.state is not COMPLETED:
                return None
            return job.result or None  # an empty result is none (read_result.lua)

    def get_many(self, job_ids: Sequence[str]) -> list[tuple[JobInfo | None, bytes | None]]:
        return [(self.get(job_id), self.get_result(job_id)) for job_id in job_ids]

    def completed_results(self, job_ids: Sequence[str]) -> list[tuple[str, bytes | None] | None]:
        with self._store.cond:
            found = [self._store.jobs.get(job_id) for job_id in job_ids]
            return [
                (job.new.codec, job.result or None)  # an empty result is none, as get_result
                if job is not None and job.state is COMPLETED
                else None
                for job in found
            ]

    def outcomes(self, job_ids: Sequence[str]) -> list[JobStanding | None]:
        with self._store.cond:
            found = [self._store.jobs.get(job_id) for job_id in job_ids]
            return [
                None
                if job is None
                else JobStanding(
                    job.state,
                    job.outcome,
                    job.attempts - job.uncharged,
                    rules.error_kind(job.error) if job.outcome is Outcome.ERROR else None,
                )
                for job in found
            ]

    def counts(self) -> dict[JobState, int]:
        with self._store.cond:
            return {state: len(ids) for state, ids in self._store.by_state.items()}

    def list_jobs(self, state: JobState, limit: int = 100) -> list[str]:
        state = JobState(state)
        with self._store.cond:
            ordered = self._store.ordered(state)
            if state.finished:  # newest first
                ordered.reverse()
            return [job.id for job in ordered[: max(0, limit)]]

    # -- reads for the dashboard -------------------------------------------------------------

    def job_page(
        self,
        state: JobState,
        cursor: str | None = None,
        limit: int = 50,
        outcome: str | None = None,
    ) -> JobPage:
        state = JobState(state)
        if limit <= 0:
            return JobPage([], cursor, 0)
        after = _cursor(cursor, state)
        desc = state.finished
        limit = min(limit, MAX_PAGE)
        budget = PAGE_SCAN if outcome else limit
        jobs: list[JobSummary] = []
        scanned, last, more = 0, after, False
        with self._store.cond:
            ordered = self._store.ordered(state)
            for job in reversed(ordered) if desc else ordered:
                key = job.order()
                if after is not None and (key >= after if desc else key <= after):
                    continue
                if len(jobs) >= limit or scanned >= budget:
                    more = True
                    break
                scanned, last = scanned + 1, key
                if outcome and (job.outcome is None or job.outcome.value != outcome):
                    continue
                jobs.append(_summary(job))
        next_cursor = json.dumps(list(last)) if more and last is not None else None
        return JobPage(jobs, next_cursor, scanned)

    def job_detail(self, job_id: str) -> JobDetail | None:
        with self._store.cond:
            job = self._store.jobs.get(job_id)
            if job is None:
                return None
            progress: Event | None = None
            # Progress is an event only here: the newest one for this job since it was
            # added, or last put back by hand (as retry_failed clears the stored progress
            # in Redis); an older job of the same id (purged, trimmed) had its own.
            for event in reversed(self._store.events):
                if event.job_id != job_id:
                    continue
                if event.kind == "progress":
                    progress = event
                    break
                if event.kind == "added" or (event.kind == "retried" and event.data.get("manual")):
                    break
            return JobDetail(
                info=self._info(job),
                payload=job.new.payload,
                result=job.result if job.state is COMPLETED else None,
                progress=float(progress.data["fraction"]) if progress else None,
                progress_message=progress.data.get("message") if progress else None,
            )

    def retention_trims(self) -> Trims:
        with self._store.cond:
            return Trims.from_fields(dict(self._store.trims))

    def _oldest_waiting_ms(self) -> int | None:
        """``QueueSummary.oldest_waiting_ms``."""
        with self._store.cond:
            heads: dict[int, Job] = {}
            for job in self._store.ordered(WAITING):  # in line: the first seen is the head
                heads.setdefault(job.new.priority, job)
            first = sorted(heads.items(), reverse=True)[:PRIORITY_BANDS]
            return min((job.created_ms for _, job in first), default=None)


def _cursor(cursor: str | None, state: JobState) -> tuple[int, int | str] | None:
    """A page cursor: the ``Job.order`` of the last job of the page before."""
    if cursor is None:
        return None
    try:
        first, second = json.loads(cursor)
        return int(first), int(second) if state is WAITING else str(second)
    except (ValueError, TypeError):
        raise ConfigError(f"invalid page cursor {cursor!r}") from None


def _summary(job: Job) -> JobSummary:
    return JobSummary(
        id=job.id,
        state=job.state.value,
        attempts=job.attempts - job.uncharged,
        outcome=job.outcome.value if job.outcome else None,
        error=rules.clip_error(job.error, ERROR_CLIP) if job.error else None,
        created_ms=job.created_ms,
        finished_ms=job.finished_ms,
    )
