"""The contract of the orders, boundaries and limits every backend shares, so code tested
on the memory backend behaves the same on Redis: ties in time broken by job id, when a job
counts as ready again, what retention keeps, what a page holds. Each case here once
differed between the two backends."""

from __future__ import annotations

import time

from sandboxq.backends.base import ERROR_CLIP, MAX_PAGE, Ack, Backend
from sandboxq.errors import ConfigError
from sandboxq.models import JobState
from tests.support.contract.support import (
    LEASE_S,
    PROMPT_S,
    SLACK_S,
    MakeBackend,
    add,
    claim_one,
    finish,
    info,
    new_job,
    record,
)

#: Longest wait a job just made ready again may show (it is claimed at once).
JUST_READY_S = 0.2


class OrderContract:
    # -- ties in time are broken by id -------------------------------------------------------

    def test_delayed_jobs_due_together_go_in_id_order(self, backend: Backend) -> None:
        # one enqueue call reads the clock once: the three are due in the same millisecond
        backend.enqueue([new_job(job_id, delay_s=0.05) for job_id in ("b", "c", "a")])
        assert backend.list_jobs(JobState.DELAYED) == ["a", "b", "c"]
        time.sleep(0.05 + SLACK_S)
        assert [job.id for job in backend.claim("w1", 3, LEASE_S)] == ["a", "b", "c"]

    def test_leases_claimed_together_are_listed_in_id_order(self, backend: Backend) -> None:
        backend.enqueue([new_job("b", priority=1), new_job("a")])
        assert [job.id for job in backend.claim("w1", 2, LEASE_S)] == ["b", "a"]
        # one claim, one expiry: the active set orders them by id
        assert backend.list_jobs(JobState.ACTIVE) == ["a", "b"]

    def test_jobs_finished_together_are_kept_and_listed_by_id(
        self, make_backend: MakeBackend
    ) -> None:
        backend = make_backend(retain_completed=2)
        backend.enqueue([new_job(job_id) for job_id in ("c", "a", "b")])
        claimed = backend.claim("w1", 3, LEASE_S)
        acks = [Ack(job.id, job.token, "complete", record(job)) for job in claimed]
        # one call, one finish time: retention drops the smallest id of the oldest
        assert backend.finish_many("w1", acks)[0] == [True, True, True]
        assert backend.list_jobs(JobState.COMPLETED) == ["c", "b"]
        assert backend.get("a") is None

    def test_a_job_failed_again_after_a_retry_is_kept_by_its_new_finish(
        self, make_backend: MakeBackend
    ) -> None:
        backend = make_backend(retain_failed=2)

        def fail_next() -> None:
            claimed = claim_one(backend)
            assert finish(backend, claimed, "fail", error="boom").accepted
            time.sleep(0.002)  # the next finish falls in a later millisecond

        for job_id in ("a", "b"):
            add(backend, job_id)
            fail_next()
        assert backend.retry_failed("a")
        fail_next()  # a, again: now newer than b
        add(backend, "c")
        fail_next()
        # retention drops the oldest finish, b's, never a by its first failure
        assert backend.list_jobs(JobState.FAILED) == ["c", "a"]
        assert backend.get("b") is None

    def test_expired_leases_are_recovered_earliest_expiry_first(self, backend: Backend) -> None:
        add(backend, "a")
        add(backend, "b")
        claim_one(backend, lease_s=0.2)
        claim_one(backend, lease_s=0.05)  # b's lease runs out before a's
        time.sleep(0.2 + SLACK_S)
        assert backend.recover_stalled() == [("b", "waiting"), ("a", "waiting")]

    # -- when a job is ready again -----------------------------------------------------------

    def test_a_recovered_job_waits_from_its_recovery(self, backend: Backend) -> None:
        add(backend, "a")
        claim_one(backend, lease_s=0.05)
        time.sleep(0.3)
        assert backend.recover_stalled() == [("a", "waiting")]
        again = claim_one(backend)
        assert again.wait_s is not None and again.wait_s < JUST_READY_S

    def test_a_confirmed_fenced_retry_waits_from_the_confirmation(self, backend: Backend) -> None:
        add(backend, "a")
        time.sleep(0.3)  # a wait counted from the enqueue would show this
        claimed = claim_one(backend, lease_s=30.0)
        assert backend.cancel("a") and backend.retry_failed("a")
        assert backend.counts()[JobState.DELAYED] == 1  # fenced until the owner confirms
        assert backend.confirm_dead("w1", [("a", claimed.token)]) == ["a"]
        again = claim_one(backend)
        assert again.wait_s is not None and 0 <= again.wait_s < JUST_READY_S

    # -- boundaries and limits ---------------------------------------------------------------

    def test_a_claim_of_nothing_returns_at_once(self, backend: Backend) -> None:
        add(backend, "a")
        start = time.monotonic()
        assert backend.claim("w1", 0, LEASE_S, wait_s=2.0) == []
        assert time.monotonic() - start < PROMPT_S
        assert backend.counts()[JobState.WAITING] == 1

    def test_retain_s_zero_keeps_no_finished_job(self, make_backend: MakeBackend) -> None:
        backend = make_backend(retain_s=0)
        add(backend, "a")
        assert finish(backend, claim_one(backend)).accepted
        assert backend.get("a") is None

    def test_purge_refuses_active_jobs_named_as_text_too(self, backend: Backend) -> None:
        add(backend, "a")
        claim_one(backend)
        for state in (JobState.ACTIVE, "active"):
            try:
                backend.purge(state)  # type: ignore[arg-type]
            except ConfigError:
                continue
            raise AssertionError(f"purge({state!r}) did not refuse")
        assert backend.counts()[JobState.ACTIVE] == 1

    def test_an_empty_result_is_none(self, backend: Backend) -> None:
        add(backend, "a")
        assert finish(backend, claim_one(backend), result=b"").accepted
        assert info(backend, "a").state is JobState.COMPLETED
        assert backend.get_result("a") is None

    def test_an_empty_progress_message_is_none(self, backend: Backend) -> None:
        add(backend, "a")
        claimed = claim_one(backend)
        assert backend.record_progress("w1", "a", claimed.token, 0.5, "")
        detail = backend.job_detail("a")
        assert detail is not None
        assert (detail.progress, detail.progress_message) == (0.5, None)
        progress = [event for event in backend.events() if event.kind == "progress"]
        assert progress[-1].data == {"fraction": "0.5"}

    def test_progress_belongs_to_one_job_not_to_its_id(self, backend: Backend) -> None:
        add(backend, "a")
        claimed = claim_one(backend)
        assert backend.record_progress("w1", "a", claimed.token, 0.5, "half")
        assert backend.cancel("a") and backend.confirm_dead("w1", [("a", claimed.token)])
        assert backend.purge(JobState.CANCELLED) == 1
        add(backend, "a")  # the same id, a new job
        detail = backend.job_detail("a")
        assert detail is not None and detail.progress is None and detail.progress_message is None

    def test_a_full_last_page_offers_no_next_one(self, backend: Backend) -> None:
        backend.enqueue([new_job(job_id) for job_id in ("a", "b")])
        page = backend.job_page(JobState.WAITING, limit=2)
        assert [job.id for job in page.jobs] == ["a", "b"] and page.next_cursor is None

    def test_a_page_holds_at_most_max_page_jobs(self, backend: Backend) -> None:
        backend.enqueue([new_job() for _ in range(MAX_PAGE + 1)])
        page = backend.job_page(JobState.WAITING, limit=MAX_PAGE + 10)
        assert len(page.jobs) == MAX_PAGE and page.next_cursor is not None

    def test_a_page_clips_errors_to_utf8_bytes(self, backend: Backend) -> None:
        add(backend, "a")
        assert finish(backend, claim_one(backend), "fail", error="é" * ERROR_CLIP).accepted
        (summary,) = backend.job_page(JobState.FAILED).jobs
        assert summary.error == "é" * (ERROR_CLIP // 2)
