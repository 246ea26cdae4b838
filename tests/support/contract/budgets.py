"""The contract of a job's time budgets at claim: a job past its ``deadline_s`` (from
enqueue) or its ``max_queue_s`` (since it became runnable) is failed by the claim that
pops it, with outcome ``deadline`` / ``expired`` and a record that says it never ran;
the claim goes on to the next job, and a claimed job says how old it is (``age_s``).

Time is real: a test waits for the clock to pass a budget (``outwait``), never mocks it.
"""

from __future__ import annotations

import time

from sandboxq.backends import rules
from sandboxq.backends.base import Backend
from sandboxq.models import Action, JobState, Outcome, member_id
from tests.support.contract.support import LEASE_S, add, claim_one, finish, info, new_job

#: The budget the tests give a job that must run out, and one that never does here.
SHORT_S = 0.05
LONG_S = 600.0


def outwait(seconds: float) -> None:
    """Let the real clock pass ``seconds`` and then some (a budget is strictly over)."""
    time.sleep(seconds + 0.02)


class BudgetContract:
    def test_a_job_not_started_within_max_queue_s_fails_expired_at_claim(
        self, backend: Backend
    ) -> None:
        late = add(backend, "late", max_queue_s=SHORT_S)
        fresh = add(backend, "fresh", max_queue_s=LONG_S)
        outwait(SHORT_S)
        claimed = backend.claim("w1", 1, LEASE_S)
        # the expired job cost the claim nothing: the job behind it was claimed instead
        assert [c.id for c in claimed] == [fresh]
        job = info(backend, late)
        assert (job.state, job.outcome, job.attempts) == (JobState.FAILED, Outcome.EXPIRED, 1)
        assert job.error is not None and "max_queue_s (50 ms)" in job.error
        [record] = job.history
        assert (record.outcome, record.action, record.worker_id) == (
            Outcome.EXPIRED,
            Action.FAIL,
            "w1",
        )
        assert record.started_ms is None and record.pid is None  # it never ran
        assert [e.data["outcome"] for e in backend.events() if e.kind == "failed"] == ["expired"]

    def test_max_queue_s_counts_from_when_the_job_became_runnable(self, backend: Backend) -> None:
        job_id = add(backend, "j", max_queue_s=SHORT_S * 4)
        claimed = claim_one(backend)
        outwait(SHORT_S * 4)  # longer than max_queue_s since enqueue, but it ran
        assert finish(backend, claimed, "retry").accepted  # runnable again: a fresh wait
        again = claim_one(backend)
        assert (again.id, again.attempt) == (job_id, 2)

    def test_a_job_past_its_deadline_s_fails_deadline_at_claim(self, backend: Backend) -> None:
        job_id = add(backend, "d", deadline_s=SHORT_S * 4)
        claimed = claim_one(backend)
        assert claimed.age_s < SHORT_S * 4
        outwait(SHORT_S * 4)
        assert finish(backend, claimed, "retry").accepted  # a retry: due at once
        assert backend.claim("w1", 1, LEASE_S) == []
        job = info(backend, job_id)
        assert (job.state, job.outcome, job.attempts) == (JobState.FAILED, Outcome.DEADLINE, 2)
        assert job.error == rules.DEADLINE_TEXT % (rules.ms(SHORT_S * 4), 2)
        assert [h.outcome for h in job.history] == [Outcome.ERROR, Outcome.DEADLINE]

    def test_a_claimed_job_says_how_old_it_is(self, backend: Backend) -> None:
        add(backend, "old")
        outwait(SHORT_S)
        claimed = claim_one(backend)
        assert SHORT_S <= claimed.age_s < SHORT_S + 5.0

    def test_a_batch_member_that_expires_is_counted_failed(self, backend: Backend) -> None:
        jobs = [new_job(member_id("b1", 0), max_queue_s=SHORT_S), new_job(member_id("b1", 1))]
        assert backend.enqueue_batch("b1", jobs) == 2
        outwait(SHORT_S)
        [claimed] = backend.claim("w1", 2, LEASE_S)
        assert claimed.id == "b1.1"
        progress = backend.batch_progress("b1")
        assert progress is not None
        assert (progress.failed, progress.active, progress.waiting) == (1, 1, 0)
