"""The contract of enqueue, claim, finish, retry and release, and of ownership
(design invariant 1): who may end an attempt, and what each action leaves behind."""

from __future__ import annotations

import threading
import time

from sandboxq.backends.base import (
    Ack,
    Backend,
    Claimed,
    FinishAction,
    FinishResult,
    NewJob,
)
from sandboxq.errors import JobNotFound
from sandboxq.models import JobOptions, JobState, Outcome
from tests.support.contract.support import (
    LEASE_S,
    OUTCOMES,
    SLACK_S,
    add,
    claim_one,
    finish,
    info,
    new_job,
    record,
)


class LeaseContract:
    # -- enqueue, claim, finish --------------------------------------------------------------

    def test_enqueue_claim_complete_round_trip(self, backend: Backend) -> None:
        options = JobOptions(retries=2, soft_timeout_s=1.0, hard_timeout_s=2.0)
        payload = b'[["a.png"],{"size":256}]'
        new = NewJob(payload, "json", options.model_dump_json(exclude_defaults=True))
        ((job_id, created),) = backend.enqueue([new])
        assert created and job_id
        waiting = info(backend, job_id)
        assert (waiting.id, waiting.queue, waiting.state) == (job_id, backend.queue, "waiting")
        assert (waiting.attempts, waiting.options, waiting.history) == (0, options, [])
        assert isinstance(waiting.created_ms, int) and waiting.finished_ms is None

        claimed = claim_one(backend)
        assert (claimed.id, claimed.payload, claimed.codec) == (job_id, payload, "json")
        assert claimed.options == options
        assert claimed.attempt == 1 and claimed.token
        assert (info(backend, job_id).state, info(backend, job_id).attempts) == ("active", 1)
        assert backend.get_result(job_id) is None

        attempt = record(claimed)
        done = backend.finish("w1", job_id, claimed.token, "complete", attempt, result=b'"ok"')
        assert done == FinishResult(accepted=True, claimed=[])
        completed = info(backend, job_id)
        assert (completed.state, completed.outcome, completed.error) == ("completed", "ok", None)
        assert completed.history == [attempt] and completed.attempts == 1
        assert isinstance(completed.finished_ms, int)
        assert backend.get_result(job_id) == b'"ok"'
        assert backend.counts()[JobState.COMPLETED] == 1

    def test_unknown_ids(self, backend: Backend) -> None:
        assert backend.get("no-such-job") is None
        assert backend.get_result("no-such-job") is None
        try:
            backend.wait_for_finish("no-such-job", 10.0)
        except JobNotFound as exc:  # at once: nothing to wait for
            assert exc.job_id == "no-such-job"
        else:
            raise AssertionError("wait_for_finish of an unknown job did not raise JobNotFound")

    def test_auto_ids_are_unique(self, backend: Backend) -> None:
        added = backend.enqueue([new_job(), new_job(), new_job()])
        assert all(created for _, created in added)
        assert len({job_id for job_id, _ in added}) == 3 and all(job_id for job_id, _ in added)

    def test_unique_job_id_is_added_once(self, backend: Backend) -> None:
        assert backend.enqueue([new_job("j1")]) == [("j1", True)]
        assert backend.enqueue([new_job("j1", priority=9)]) == [("j1", False)]
        assert backend.counts()[JobState.WAITING] == 1
        finish(backend, claim_one(backend))
        # Still retained once finished: not added again.
        assert backend.enqueue([new_job("j1")]) == [("j1", False)]
        assert info(backend, "j1").state == "completed"
        assert backend.enqueue([new_job("j2"), new_job("j2")]) == [("j2", True), ("j2", False)]

    def test_priority_first_then_fifo(self, backend: Backend) -> None:
        ids = [add(backend, priority=p) for p in (0, 5, 0, -1)]
        ids += [job_id for job_id, _ in backend.enqueue([new_job(priority=5), new_job()])]
        claimed = [c.id for c in backend.claim("w1", 10, LEASE_S)]
        assert claimed == [ids[1], ids[4], ids[0], ids[2], ids[5], ids[3]]

    def test_claim_takes_at_most_count_and_never_twice(self, backend: Backend) -> None:
        ids = {job_id for job_id, _ in backend.enqueue([new_job() for _ in range(40)])}
        assert len(backend.claim("w0", 3, 5.0)) == 3
        got: dict[str, list[str]] = {f"w{i}": [] for i in range(1, 5)}

        def claim_all(worker_id: str) -> None:
            while batch := backend.claim(worker_id, 2, 5.0):
                got[worker_id].extend(c.id for c in batch)

        threads = [threading.Thread(target=claim_all, args=(w,)) for w in got]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        taken = [job_id for ids_ in got.values() for job_id in ids_]
        assert len(taken) == len(set(taken)) == 37 and set(taken) < ids
        assert backend.counts()[JobState.ACTIVE] == 40

    def test_finish_claims_the_next_jobs_in_the_same_call(self, backend: Backend) -> None:
        ids = [add(backend) for _ in range(3)]
        first = claim_one(backend)
        result = finish(backend, first, claim=2, lease_s=LEASE_S)
        assert result.accepted and [c.id for c in result.claimed] == ids[1:]
        assert all(c.attempt == 1 and c.token for c in result.claimed)
        assert backend.renew("w1", [(c.id, c.token) for c in result.claimed], LEASE_S) == []
        assert {info(backend, c.id).state for c in result.claimed} == {"active"}
        assert finish(backend, result.claimed[0], claim=5) == FinishResult(True, [])

    # -- delays, retries, failures -----------------------------------------------------------

    def test_finish_many_applies_each_ack_on_its_own(self, backend: Backend) -> None:
        ids = [add(backend) for _ in range(5)]
        first, second, third = backend.claim("w1", 3, LEASE_S)
        acks = [
            Ack(first.id, first.token, "complete", record(first), b"1"),
            Ack(second.id, "not-the-token", "complete", record(second), b"2"),
            Ack(third.id, third.token, "fail", record(third, Outcome.ERROR), error="boom"),
        ]
        accepted, claimed = backend.finish_many("w1", acks, claim=5, lease_s=LEASE_S)
        assert accepted == [True, False, True]
        assert sorted(c.id for c in claimed) == sorted(ids[3:])
        assert info(backend, first.id).state is JobState.COMPLETED
        assert backend.get_result(first.id) == b"1"
        rejected = info(backend, second.id)  # the rejected ack changed nothing
        assert rejected.state is JobState.ACTIVE and rejected.history == []
        failed = info(backend, third.id)
        assert failed.state is JobState.FAILED and failed.error == "boom"

    def test_delayed_job_is_claimable_only_once_due(self, backend: Backend) -> None:
        job_id = add(backend, delay_s=0.4)
        assert info(backend, job_id).state == "delayed"
        assert backend.counts()[JobState.DELAYED] == 1
        assert backend.list_jobs(JobState.DELAYED) == [job_id]
        assert backend.claim("w1", 1, LEASE_S) == []
        time.sleep(0.4 + SLACK_S)
        claimed = claim_one(backend)
        assert (claimed.id, claimed.attempt) == (job_id, 1)

    def test_retry_with_delay_then_without(self, backend: Backend) -> None:
        job_id = add(backend, retries=5)
        first = claim_one(backend)
        assert finish(backend, first, "retry", error="boom", retry_delay_s=0.4).accepted
        retried = info(backend, job_id)
        assert (retried.state, retried.attempts) == ("delayed", 1)
        assert (retried.outcome, retried.error, len(retried.history)) == ("error", "boom", 1)
        assert backend.claim("w1", 1, LEASE_S) == []
        time.sleep(0.4 + SLACK_S)

        second = claim_one(backend)
        assert second.attempt == 2 and second.token != first.token
        assert not finish(backend, first).accepted  # the first attempt's token is dead
        assert finish(backend, second, "retry", error="again").accepted
        assert info(backend, job_id).state == "waiting"  # no delay: claimable at once
        third = claim_one(backend)
        assert third.attempt == 3
        assert finish(backend, third, result=b"3").accepted
        history = info(backend, job_id).history
        assert [(a.attempt, a.outcome) for a in history] == [(1, "error"), (2, "error"), (3, "ok")]

    def test_requeue_does_not_charge_an_attempt(self, backend: Backend) -> None:
        job_id = add(backend)
        first = claim_one(backend)
        assert finish(backend, first, "requeue").accepted
        requeued = info(backend, job_id)
        assert (requeued.state, requeued.attempts) == ("waiting", 0)
        assert [a.outcome for a in requeued.history] == ["interrupted"]
        again = claim_one(backend)
        assert again.attempt == 1 and again.token != first.token

    def test_release_hands_back_unstarted_jobs_uncharged_and_unrecorded(
        self, backend: Backend
    ) -> None:
        first, second = add(backend), add(backend)
        a, b = backend.claim("w1", 2, LEASE_S)
        assert backend.release("w2", [(a.id, a.token)]) == [a.id]  # not the owner
        assert backend.release("w1", [(a.id, a.token), (b.id, "stale")]) == [b.id]
        released = info(backend, first)
        assert released.state == "waiting" and released.attempts == 0
        assert released.history == [] and released.outcome is None
        assert finish(backend, a, "complete").accepted is False  # the old lease is gone
        again = claim_one(backend)
        assert (again.id, again.attempt) == (first, 1)  # its old place in line, uncharged
        assert info(backend, second).state == "active"

    def test_fail_stores_outcome_and_error(self, backend: Backend) -> None:
        job_id = add(backend)
        claimed = claim_one(backend)
        cause = "killed at the hard deadline"
        attempt = record(claimed, Outcome.HARD_TIMEOUT, error=cause)
        assert backend.finish("w1", job_id, claimed.token, "fail", attempt, error=cause).accepted
        failed = info(backend, job_id)
        assert (failed.state, failed.outcome, failed.error) == ("failed", "hard_timeout", cause)
        assert failed.history == [attempt] and isinstance(failed.finished_ms, int)
        assert backend.get_result(job_id) is None
        assert backend.list_jobs(JobState.FAILED) == [job_id]

    # -- ownership (design invariant 1) ------------------------------------------------------

    def test_wrong_token_or_worker_is_rejected_and_changes_nothing(self, backend: Backend) -> None:
        job_id = add(backend)
        claimed = claim_one(backend)
        before, counts = info(backend, job_id), backend.counts()
        actions: tuple[FinishAction, ...] = ("complete", "fail", "retry", "requeue")
        for worker_id, token in (("w1", "not-the-token"), ("w2", claimed.token)):
            for action in actions:
                attempt = record(claimed, OUTCOMES[action], worker_id, "late")
                result = backend.finish(
                    worker_id, job_id, token, action, attempt, result=b"1", error="late"
                )
                assert not result.accepted, (worker_id, action)
                assert info(backend, job_id) == before, (worker_id, action)
            assert backend.renew(worker_id, [(job_id, token)], 60.0) == [job_id]
            assert not backend.record_progress(worker_id, job_id, token, 0.5, "late")
        assert info(backend, job_id) == before and backend.counts() == counts
        assert backend.get_result(job_id) is None
        # The rejected 60 s renewals did not extend the lease: it still lapses on time.
        time.sleep(LEASE_S + SLACK_S)
        assert backend.recover_stalled() == [(job_id, "waiting")]

    def test_finish_is_accepted_once(self, backend: Backend) -> None:
        job_id = add(backend)
        claimed = claim_one(backend)
        assert finish(backend, claimed, result=b"1").accepted
        done = info(backend, job_id)
        assert not finish(backend, claimed, "fail", error="late").accepted
        assert info(backend, job_id) == done and backend.get_result(job_id) == b"1"

    def test_renew_returns_the_leases_it_could_not_renew(self, backend: Backend) -> None:
        owned, finished, other = (add(backend) for _ in range(3))
        mine, done = claim_one(backend), claim_one(backend)
        theirs = claim_one(backend, "w2")
        finish(backend, done)
        leases = [(mine.id, mine.token), (done.id, done.token), ("no-such-job", "t")]
        lost = backend.renew("w1", [*leases, (theirs.id, theirs.token)], LEASE_S)
        assert sorted(lost) == sorted([finished, "no-such-job", other])
        assert mine.id == owned

    def test_a_renewal_of_thousands_of_leases_names_exactly_the_lost_ones(
        self, backend: Backend
    ) -> None:
        """Redis renews the active set a thousand leases at a time (renew.lua): the leases
        lost at and around each boundary are named, the others extended."""
        backend.enqueue([new_job(f"j{i:04}") for i in range(2500)])
        held: list[Claimed] = []
        while len(held) < 2500:
            got = backend.claim("w1", 2500 - len(held), 60.0)
            assert got, "the queue ran dry before every job was claimed"
            held += got
        gone = [held[i] for i in (0, 998, 999, 1000, 1999, 2000, 2499)]
        for claimed in gone:
            assert finish(backend, claimed).accepted
        leases = [(c.id, c.token) for c in held]
        lost = backend.renew("w1", leases, 60.0)
        assert sorted(lost) == sorted(c.id for c in gone)
        assert sorted(backend.renew("w1", leases, 60.0)) == sorted(lost)
        assert backend.counts()[JobState.ACTIVE] == 2500 - len(gone)

    def test_record_progress_is_owner_checked(self, backend: Backend) -> None:
        job_id = add(backend)
        claimed = claim_one(backend)
        assert backend.record_progress("w1", job_id, claimed.token, 0.5, "half way")
        assert not backend.record_progress("w1", job_id, "not-the-token", 0.7, None)
        assert not backend.record_progress("w2", job_id, claimed.token, 0.7, None)
        progress = [e for e in backend.events() if e.kind == "progress"]
        assert [e.job_id for e in progress] == [job_id]
        finish(backend, claimed)
        assert not backend.record_progress("w1", job_id, claimed.token, 1.0, None)
