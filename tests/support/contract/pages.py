"""The contract of the dashboard's reads: pages by cursor, summaries, outcome filters,
a job in full, the oldest wait."""

from __future__ import annotations

import time

from sandboxq.backends.base import (
    ERROR_CLIP,
    Backend,
    FinishAction,
)
from sandboxq.models import JobState, Outcome
from tests.support.contract.support import (
    add,
    claim_one,
    finish,
    info,
    record,
)


class PageContract:
    # -- reads for the dashboard ---------------------------------------------------------------

    def test_job_page_walks_every_job_once_by_cursor(self, backend: Backend) -> None:
        ids = [add(backend, f"w{i}", priority=i % 2) for i in range(7)]
        pages, cursor = [], None
        for _ in range(10):
            page = backend.job_page(JobState.WAITING, cursor, limit=3)
            pages.append([job.id for job in page.jobs])
            cursor = page.next_cursor
            if cursor is None:
                break
        walked = [job_id for page in pages for job_id in page]
        assert walked == backend.list_jobs(JobState.WAITING) and sorted(walked) == sorted(ids)
        assert pages[0] == walked[:3]
        # A job leaving the state between pages does not shift the next page.
        first = backend.job_page(JobState.WAITING, None, limit=2)
        assert claim_one(backend).id == first.jobs[0].id
        second = backend.job_page(JobState.WAITING, first.next_cursor, limit=2)
        assert [j.id for j in second.jobs] == walked[2:4]

    def test_job_page_of_finished_jobs_newest_first_with_summaries(self, backend: Backend) -> None:
        for i in range(5):
            add(backend, f"f{i}")
            action: FinishAction = "fail" if i % 2 else "complete"
            finish(backend, claim_one(backend), action, error="boom " * 100 if i % 2 else None)
        walked, cursor = [], None
        while True:
            page = backend.job_page(JobState.COMPLETED, cursor, limit=2)
            walked += page.jobs
            if (cursor := page.next_cursor) is None:
                break
        assert sorted(j.id for j in walked) == ["f0", "f2", "f4"]
        finished = [j.finished_ms or 0 for j in walked]
        assert finished == sorted(finished, reverse=True)
        (failed, *_) = backend.job_page(JobState.FAILED, None, limit=1).jobs
        assert (failed.state, failed.attempts, failed.outcome) == ("failed", 1, "error")
        assert failed.error is not None and len(failed.error) == ERROR_CLIP
        assert failed.created_ms is not None and failed.finished_ms is not None

    def test_job_page_filters_by_outcome(self, backend: Backend) -> None:
        for i in range(6):
            add(backend, f"r{i}", retries=1)
            claimed = claim_one(backend)
            if i % 3 == 0:
                attempt = record(claimed, Outcome.CRASHED, error="SIGSEGV")
                backend.finish("w1", claimed.id, claimed.token, "fail", attempt, error="SIGSEGV")
            else:
                finish(backend, claimed, "fail", error="boom")
        page = backend.job_page(JobState.FAILED, None, limit=50, outcome="crashed")
        assert sorted(j.id for j in page.jobs) == ["r0", "r3"] and page.next_cursor is None
        assert page.scanned == 6
        assert backend.job_page(JobState.FAILED, None, outcome="ok").jobs == []

    def test_job_detail_has_payload_result_and_progress(self, backend: Backend) -> None:
        assert backend.job_detail("no-such-job") is None
        job_id = add(backend)
        claimed = claim_one(backend)
        detail = backend.job_detail(job_id)
        assert detail is not None
        assert (detail.payload, detail.result, detail.progress) == (b"[[1],{}]", None, None)
        assert backend.record_progress("w1", job_id, claimed.token, 0.25, "a quarter")
        detail = backend.job_detail(job_id)
        assert detail is not None and detail.info.state == "active"
        assert (detail.progress, detail.progress_message) == (0.25, "a quarter")
        finish(backend, claimed, result=b'{"ok":1}')
        detail = backend.job_detail(job_id)
        assert detail is not None and detail.result == b'{"ok":1}'
        assert [a.outcome for a in detail.info.history] == ["ok"]

    def test_summary_is_the_overview_line(self, backend: Backend) -> None:
        empty = backend.summary()
        assert set(empty.counts.values()) == {0} and len(empty.counts) == len(JobState)
        assert (empty.oldest_waiting_ms, empty.workers, empty.workers_capped) == (None, 0, False)
        assert empty.depth == []
        before = time.time_ns() // 1_000_000
        old = add(backend, priority=0)
        time.sleep(0.02)
        add(backend, priority=5)  # first in line, but younger
        finish(backend, claim_one(backend), "fail")
        add(backend)
        backend.register_worker("w-live", {}, 5.0)  # samples the waiting depth too
        summary = backend.summary()
        assert summary.counts[JobState.WAITING] == 2 and summary.counts[JobState.FAILED] == 1
        oldest = summary.oldest_waiting_ms
        assert oldest is not None and before - 1000 <= oldest <= before + 1000
        assert oldest == info(backend, old).created_ms
        assert (summary.workers, summary.workers_capped) == (1, False)
        assert summary.depth is not None and summary.depth[-1][1] == 2
