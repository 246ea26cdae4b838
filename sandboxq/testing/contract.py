"""The backend contract: one suite every ``Backend`` must pass, checking each promise the
docstrings of ``sandboxq.backends.base`` make.

Use it from a pytest module by subclassing ``BackendContract`` and providing two fixtures:
``make_backend``, a factory ``make_backend(**options) -> Backend`` that returns a backend
for a fresh queue no other test uses (``options`` are the backend's retention keywords:
``retain_completed``, ``retain_failed``, ``retain_s``) and closes what it made at teardown;
and ``backend``, which is ``make_backend()``::

    @pytest.fixture
    def backend(make_backend):
        return make_backend()

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def make_backend(self, queue_name): ...

Everything runs on real time: short leases, real sleeps and real waits across threads, no
mocked clock and no stand-in for the backend, so a backend that computes expiry wrongly or
misses a wake-up fails here. Every test takes well under three seconds. Importing this
module does not import pytest.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from sandboxq.backends.base import (
    ERROR_CLIP,
    Ack,
    Backend,
    Claimed,
    FinishAction,
    FinishResult,
    NewJob,
)
from sandboxq.errors import JobNotFound
from sandboxq.models import AttemptRecord, JobInfo, JobOptions, JobState, Outcome
from sandboxq.testing.waiting import wait_for

MakeBackend = Callable[..., Backend]

#: The lease the tests claim with: long enough to act inside it, short enough to outwait.
LEASE_S = 0.3
#: Added to every wait that must outlast a deadline, for a loaded CI machine.
SLACK_S = 0.15
#: How late a wake-up may be and still count as prompt.
PROMPT_S = 0.5

_OUTCOMES: dict[FinishAction, Outcome] = {
    "complete": Outcome.OK,
    "fail": Outcome.ERROR,
    "retry": Outcome.ERROR,
    "requeue": Outcome.INTERRUPTED,
}


def new_job(
    job_id: str | None = None, *, priority: int = 0, delay_s: float = 0.0, **options: Any
) -> NewJob:
    options_json = JobOptions(**options).model_dump_json(exclude_defaults=True)
    return NewJob(b"[[1],{}]", "json", options_json, job_id, priority, delay_s)


def add(backend: Backend, job_id: str | None = None, **kwargs: Any) -> str:
    ((added_id, created),) = backend.enqueue([new_job(job_id, **kwargs)])
    assert created
    return added_id


def claim_one(backend: Backend, worker_id: str = "w1", lease_s: float = LEASE_S) -> Claimed:
    claimed = backend.claim(worker_id, 1, lease_s)
    assert len(claimed) == 1, claimed
    return claimed[0]


def record(
    claimed: Claimed, outcome: Outcome = Outcome.OK, worker_id: str = "w1", error: str | None = None
) -> AttemptRecord:
    now_ms = time.time_ns() // 1_000_000
    return AttemptRecord(
        attempt=claimed.attempt,
        outcome=outcome,
        worker_id=worker_id,
        pid=4242,
        started_ms=now_ms - 5,
        ended_ms=now_ms,
        error=error,
    )


def finish(
    backend: Backend,
    claimed: Claimed,
    action: FinishAction = "complete",
    worker_id: str = "w1",
    **kwargs: Any,
) -> FinishResult:
    attempt = record(claimed, _OUTCOMES[action], worker_id, kwargs.get("error"))
    return backend.finish(worker_id, claimed.id, claimed.token, action, attempt, **kwargs)


def info(backend: Backend, job_id: str) -> JobInfo:
    found = backend.get(job_id)
    assert found is not None, f"job {job_id} is unknown"
    return found


def in_thread(delay_s: float, fn: Callable[[], object]) -> threading.Thread:
    """Run ``fn`` on another thread after ``delay_s``; the caller joins it."""

    def run() -> None:
        time.sleep(delay_s)
        fn()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


class BackendContract:
    """The tests; subclass it and provide the ``make_backend`` and ``backend`` fixtures."""

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
        assert JobOptions.model_validate_json(claimed.options_json) == options
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

        def drain(worker_id: str) -> None:
            while batch := backend.claim(worker_id, 2, 5.0):
                got[worker_id].extend(c.id for c in batch)

        threads = [threading.Thread(target=drain, args=(w,)) for w in got]
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
                attempt = record(claimed, _OUTCOMES[action], worker_id, "late")
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

    # -- leases and stalled recovery ---------------------------------------------------------

    def test_expired_lease_is_recovered_and_the_old_owner_fenced(self, backend: Backend) -> None:
        job_id = add(backend)
        old = claim_one(backend, "w1")
        assert backend.recover_stalled() == []
        time.sleep(LEASE_S + SLACK_S)
        assert backend.recover_stalled() == [(job_id, "waiting")]
        assert backend.recover_stalled() == []
        recovered = info(backend, job_id)
        assert (recovered.state, recovered.stalls, recovered.attempts) == ("waiting", 1, 1)
        assert backend.renew("w1", [(job_id, old.token)], 30.0) == [job_id]
        assert not finish(backend, old).accepted
        assert info(backend, job_id) == recovered

        new = claim_one(backend, "w2")
        assert new.attempt == 2 and new.token != old.token
        assert not finish(backend, old).accepted  # the late ack cannot take the new lease
        assert backend.renew("w2", [(job_id, new.token)], LEASE_S) == []
        assert finish(backend, new, worker_id="w2").accepted
        assert "stalled" in [e.kind for e in backend.events()]

    def test_too_many_stalls_fail_the_job_with_a_cause(self, backend: Backend) -> None:
        once = add(backend, max_stalls=1)
        never = add(backend, max_stalls=0)
        assert len(backend.claim("w1", 2, 0.2)) == 2
        time.sleep(0.2 + SLACK_S)
        assert sorted(backend.recover_stalled()) == sorted([(once, "waiting"), (never, "failed")])
        claim_one(backend, lease_s=0.2)
        time.sleep(0.2 + SLACK_S)
        assert backend.recover_stalled() == [(once, "failed")]
        for job_id, stalls in ((once, 2), (never, 1)):
            failed = info(backend, job_id)
            assert (failed.state, failed.stalls) == ("failed", stalls)
            assert failed.error and isinstance(failed.finished_ms, int)
        assert backend.counts()[JobState.FAILED] == 2

    def test_renew_extends_the_lease(self, backend: Backend) -> None:
        job_id = add(backend)
        claimed = claim_one(backend)
        time.sleep(LEASE_S / 2)
        assert backend.renew("w1", [(job_id, claimed.token)], LEASE_S * 4) == []
        time.sleep(LEASE_S / 2 + SLACK_S)  # past the first lease's expiry
        assert backend.recover_stalled() == []
        assert info(backend, job_id).state == "active"
        assert backend.renew("w1", [(job_id, claimed.token)], LEASE_S) == []
        assert finish(backend, claimed).accepted

    # -- cancellation ------------------------------------------------------------------------

    def test_cancel_waiting_and_delayed_jobs(self, backend: Backend) -> None:
        seen: queue.Queue[tuple[str, str | None]] = queue.Queue()
        stop = backend.watch_cancellations(lambda job_id, token: seen.put((job_id, token)))
        try:
            waiting, delayed = add(backend), add(backend, delay_s=30.0)
            assert backend.cancel(waiting) and backend.cancel(delayed)
            got = {seen.get(timeout=1.0), seen.get(timeout=1.0)}
            assert got == {(waiting, None), (delayed, None)}  # no lease was revoked
        finally:
            stop()
        assert {info(backend, waiting).state, info(backend, delayed).state} == {"cancelled"}
        counts = backend.counts()
        assert (counts[JobState.CANCELLED], counts[JobState.WAITING], counts[JobState.DELAYED]) == (
            2,
            0,
            0,
        )
        assert backend.claim("w1", 5, LEASE_S) == []
        assert not backend.cancel(waiting)  # already finished
        assert not backend.cancel("no-such-job")

    def test_cancel_active_job_revokes_the_lease_and_tells_the_owner(
        self, backend: Backend
    ) -> None:
        seen: queue.Queue[tuple[str, str | None]] = queue.Queue()
        stop = backend.watch_cancellations(lambda job_id, token: seen.put((job_id, token)))
        try:
            job_id = add(backend)
            claimed = claim_one(backend)
            assert backend.cancel(job_id)
            # the revoked lease is named, so the owner kills that attempt and no later one
            assert seen.get(timeout=1.0) == (job_id, claimed.token)
        finally:
            stop()
        cancelled = info(backend, job_id)
        assert cancelled.state == "cancelled" and isinstance(cancelled.finished_ms, int)
        assert backend.renew("w1", [(job_id, claimed.token)], LEASE_S) == [job_id]
        assert not finish(backend, claimed).accepted
        assert not backend.record_progress("w1", job_id, claimed.token, 0.5, None)
        assert info(backend, job_id) == cancelled and backend.get_result(job_id) is None
        # Once stopped, the callback hears nothing more.
        other = add(backend)
        claim_one(backend)
        assert backend.cancel(other)
        time.sleep(0.3)
        assert seen.empty()

    def test_a_cancelled_attempt_is_in_the_history(self, backend: Backend) -> None:
        job_id = add(backend)
        claimed = claim_one(backend, lease_s=30.0)
        assert backend.cancel(job_id)
        [attempt] = info(backend, job_id).history
        assert (attempt.attempt, attempt.outcome, attempt.worker_id) == (1, "cancelled", "w1")
        assert attempt.error == "cancelled while active" and attempt.ended_ms is not None
        assert claimed.attempt == 1

    def test_a_retry_of_a_cancelled_active_job_waits_for_the_owner(self, backend: Backend) -> None:
        # Fenced hand-over: the cancelled attempt may still run until its owner kills it.
        job_id = add(backend)
        claimed = claim_one(backend, lease_s=30.0)
        assert backend.cancel(job_id) and backend.retry_failed(job_id)
        assert info(backend, job_id).state == "delayed"
        assert backend.claim("w2", 5, LEASE_S) == []
        # Only the revoked lease's owner, with its token, lifts the fence.
        assert backend.confirm_dead("w2", [(job_id, claimed.token)]) == []
        assert backend.confirm_dead("w1", [(job_id, "not-the-token")]) == []
        assert backend.claim("w2", 5, LEASE_S) == []
        assert backend.confirm_dead("w1", [(job_id, claimed.token)]) == [job_id]
        assert info(backend, job_id).state == "waiting"
        again = claim_one(backend, "w2")
        assert (again.id, again.attempt) == (job_id, 1)
        assert backend.confirm_dead("w1", [(job_id, claimed.token)]) == []  # once

    def test_a_confirmed_cancel_retries_at_once(self, backend: Backend) -> None:
        job_id = add(backend)
        claimed = claim_one(backend, lease_s=30.0)
        assert backend.cancel(job_id)
        assert backend.confirm_dead("w1", [(job_id, claimed.token)]) == [job_id]
        assert backend.retry_failed(job_id)
        assert info(backend, job_id).state == "waiting"

    def test_purge_keeps_a_fenced_job_until_its_owner_confirms(self, backend: Backend) -> None:
        # A purged id can be enqueued afresh: it must not run beside the cancelled child.
        job_id, other = add(backend), add(backend)
        claimed = claim_one(backend, lease_s=30.0)
        assert claimed.id == job_id
        assert backend.cancel(job_id) and backend.cancel(other)
        assert backend.purge(JobState.CANCELLED) == 1  # the unfenced one goes
        assert info(backend, job_id).state == "cancelled"
        assert backend.get(other) is None
        assert backend.confirm_dead("w1", [(job_id, claimed.token)]) == [job_id]
        assert backend.purge(JobState.CANCELLED) == 1
        assert backend.get(job_id) is None

    def test_a_fence_lifts_when_the_old_lease_runs_out(self, backend: Backend) -> None:
        job_id = add(backend)
        claim_one(backend)  # LEASE_S, and the owner never confirms
        assert backend.cancel(job_id) and backend.retry_failed(job_id)
        assert backend.claim("w2", 5, LEASE_S) == []
        # a waiting claim may wake early (spurious): ask until the fence is over
        again = wait_for(
            lambda: backend.claim("w2", 5, LEASE_S, wait_s=0.2), LEASE_S + 2.0, "the fence"
        )
        assert [job.id for job in again] == [job_id]

    def test_a_finish_sent_again_after_a_lost_reply_gets_its_claimed_jobs_back(
        self, backend: Backend
    ) -> None:
        first, second, third = add(backend), add(backend), add(backend)
        [done] = backend.claim("w1", 1, 30.0)
        assert done.id == first
        ack = Ack(done.id, done.token, "complete", record(done), b"1")
        # The call runs, but its reply is lost: the caller never learns of the claim.
        accepted, lost = backend.finish_many("w1", [ack], claim=1, token_base="base1")
        assert accepted == [True] and [j.id for j in lost] == [second]
        assert lost[0].token.startswith("base1.")
        # Sent again: the ack is rejected now (it was applied), the claimed job comes back.
        accepted, again = backend.finish_many(
            "w1", [ack], claim=2, token_base="base1.r1", replay_of="base1"
        )
        assert accepted == [False]
        assert [(j.id, j.token, j.attempt) for j in again][:1] == [(second, lost[0].token, 1)]
        # A single rejected ack claims nothing new, but the replayed job still comes back.
        assert [j.id for j in again] == [second]
        assert info(backend, third).state == "waiting"
        # Another worker never gets another's jobs replayed.
        assert backend.finish_many("w2", [], claim=0, replay_of="base1") == ([], [])

    def test_cancel_of_a_finished_job_returns_false(self, backend: Backend) -> None:
        completed, failed = add(backend), add(backend)
        finish(backend, claim_one(backend), result=b"1")
        finish(backend, claim_one(backend), "fail", error="boom")
        assert not backend.cancel(completed) and not backend.cancel(failed)
        assert info(backend, completed).state == "completed"
        assert backend.get_result(completed) == b"1"
        assert info(backend, failed).state == "failed"

    # -- waiting -----------------------------------------------------------------------------

    def test_a_waiting_claim_wakes_promptly_on_enqueue(self, backend: Backend) -> None:
        added_at: list[float] = []

        def produce() -> None:
            added_at.append(time.monotonic())
            add(backend)

        self._assert_wakes(backend, in_thread(0.3, produce), added_at)

    def test_a_waiting_claim_wakes_on_retry_requeue_and_recovery(self, backend: Backend) -> None:
        add(backend)
        claimed = claim_one(backend, lease_s=5.0)
        actions: tuple[FinishAction, ...] = ("retry", "requeue")
        for action in actions:
            given_back_at: list[float] = []

            def give_back(
                claimed: Claimed = claimed,
                action: FinishAction = action,
                at: list[float] = given_back_at,
            ) -> None:
                at.append(time.monotonic())
                assert finish(backend, claimed, action).accepted

            claimed = self._assert_wakes(backend, in_thread(0.3, give_back), given_back_at)
        assert finish(backend, claimed, "requeue").accepted
        claim_one(backend, lease_s=0.2)
        recovered_at: list[float] = []

        def recover() -> None:
            recovered_at.append(time.monotonic())
            assert [state for _, state in backend.recover_stalled()] == ["waiting"]

        self._assert_wakes(backend, in_thread(0.2 + SLACK_S, recover), recovered_at)

    def test_a_waiting_claim_takes_a_job_added_just_before_it(self, backend: Backend) -> None:
        assert backend.claim("w1", 1, LEASE_S) == []
        add(backend)  # between a worker's empty claim and its wait: the race to lose
        start = time.monotonic()
        assert len(backend.claim("w1", 1, LEASE_S, wait_s=3.0)) == 1
        assert time.monotonic() - start < PROMPT_S

    def _assert_wakes(
        self, backend: Backend, thread: threading.Thread, when: list[float]
    ) -> Claimed:
        """Claim with a wait while ``thread`` makes a job claimable; the claim must return
        it within ``PROMPT_S`` of the moment recorded in ``when``. Returns the job."""
        deadline = time.monotonic() + 3.0
        claimed: list[Claimed] = []
        try:
            # Spurious returns are allowed, so wait until a claim succeeds.
            while not claimed and time.monotonic() < deadline:
                claimed = backend.claim("w1", 1, 5.0, wait_s=deadline - time.monotonic())
                woke = time.monotonic()
        finally:
            thread.join(timeout=5.0)
        assert claimed and when, "the job never became claimable"
        assert woke - when[0] < PROMPT_S, f"woke {woke - when[0]:.3f} s after the job arrived"
        return claimed[0]

    def test_a_waiting_claim_takes_a_delayed_job_when_it_falls_due(self, backend: Backend) -> None:
        job_id = add(backend, delay_s=0.4)
        start = time.monotonic()
        claimed: list[Claimed] = []
        while not claimed and time.monotonic() - start < 3.0:
            claimed = backend.claim("w1", 1, LEASE_S, wait_s=3.0)
        waited = time.monotonic() - start
        assert [c.id for c in claimed] == [job_id]
        assert 0.3 <= waited < 0.4 + PROMPT_S, f"claimed after {waited:.3f} s"

    def test_a_waiting_claim_waits_its_timeout_when_idle(self, backend: Backend) -> None:
        start = time.monotonic()
        assert backend.claim("w1", 1, LEASE_S, wait_s=0.4) == []
        assert 0.3 <= time.monotonic() - start < 0.4 + PROMPT_S
        # A job due long after the timeout does not end the wait early either (once any
        # wake-up its enqueue left behind has been taken).
        add(backend, delay_s=30.0)
        backend.claim("w1", 1, LEASE_S, wait_s=0.05)
        start = time.monotonic()
        assert backend.claim("w1", 1, LEASE_S, wait_s=0.4) == []
        assert 0.3 <= time.monotonic() - start < 0.4 + PROMPT_S

    def test_wait_for_finish(self, backend: Backend) -> None:
        job_id = add(backend)
        claimed = claim_one(backend, lease_s=5.0)
        start = time.monotonic()
        assert backend.wait_for_finish(job_id, 0.3) is None
        assert time.monotonic() - start >= 0.25
        thread = in_thread(0.3, lambda: finish(backend, claimed, "fail", error="boom"))
        try:
            start = time.monotonic()
            assert backend.wait_for_finish(job_id, 3.0) == JobState.FAILED
            assert time.monotonic() - start < 0.3 + PROMPT_S
        finally:
            thread.join(timeout=5.0)
        assert backend.wait_for_finish(job_id, 0.1) == JobState.FAILED  # already finished

    # -- events ------------------------------------------------------------------------------

    def test_events_of_a_job_in_order(self, backend: Backend) -> None:
        job_id = add(backend)
        finish(backend, claim_one(backend))
        events = [e for e in backend.events() if e.job_id == job_id]
        assert [e.kind for e in events] == ["added", "active", "completed"]
        after_added = [e.kind for e in backend.events(since=events[0].id)]
        assert after_added == ["active", "completed"]
        assert list(backend.events(since=events[-1].id)) == []

    def test_events_block_for_new_ones(self, backend: Backend) -> None:
        start = time.monotonic()
        assert list(backend.events(block_s=0.3)) == []
        assert 0.25 <= time.monotonic() - start < 0.3 + PROMPT_S
        added: list[str] = []
        thread = in_thread(0.2, lambda: added.append(add(backend)))
        stream = backend.events(block_s=3.0)
        try:
            start = time.monotonic()
            event = next(stream)
            assert time.monotonic() - start < 0.2 + PROMPT_S
        finally:
            getattr(stream, "close", lambda: None)()  # a generator: end its blocking read
            thread.join(timeout=5.0)
        assert (event.kind, event.job_id) == ("added", added[0])

    # -- inspection and administration -------------------------------------------------------

    def test_counts_has_every_state(self, backend: Backend) -> None:
        assert backend.counts() == {state: 0 for state in JobState}
        completed, failed, cancelled = add(backend), add(backend), add(backend)
        finish(backend, claim_one(backend))
        finish(backend, claim_one(backend), "fail", error="boom")
        backend.cancel(cancelled)
        active, waiting, delayed = add(backend), add(backend), add(backend, delay_s=30.0)
        assert claim_one(backend).id == active
        assert backend.counts() == {state: 1 for state in JobState}
        assert [backend.list_jobs(s) for s in JobState] == [
            [waiting],
            [delayed],
            [active],
            [completed],
            [failed],
            [cancelled],
        ]

    def test_list_jobs_finished_newest_first(self, backend: Backend) -> None:
        done = []
        for _ in range(3):
            done.append(add(backend))
            finish(backend, claim_one(backend))
            time.sleep(0.005)  # distinct finish times
        assert backend.list_jobs(JobState.COMPLETED) == done[::-1]
        assert backend.list_jobs(JobState.COMPLETED, limit=2) == done[:0:-1]
        waiting = {add(backend), add(backend)}
        assert set(backend.list_jobs(JobState.WAITING)) == waiting
        assert backend.list_jobs(JobState.FAILED) == []

    def test_retry_failed(self, backend: Backend) -> None:
        failed = add(backend)
        finish(backend, claim_one(backend), "fail", error="boom")
        assert backend.retry_failed(failed)
        assert (info(backend, failed).state, info(backend, failed).attempts) == ("waiting", 0)
        again = claim_one(backend)
        assert (again.id, again.attempt) == (failed, 1)
        finish(backend, again)
        assert not backend.retry_failed(failed)  # completed
        cancelled = add(backend)
        backend.cancel(cancelled)
        assert backend.retry_failed(cancelled)
        assert info(backend, cancelled).state == "waiting"
        assert not backend.retry_failed(cancelled)  # waiting
        assert not backend.retry_failed("no-such-job")

    def test_purge(self, backend: Backend) -> None:
        completed = [add(backend), add(backend)]
        for _ in completed:
            finish(backend, claim_one(backend))
        add(backend)
        finish(backend, claim_one(backend), "fail", error="boom")
        backend.enqueue([new_job(), new_job()])
        assert backend.purge(JobState.COMPLETED) == 2
        assert [backend.get(j) for j in completed] == [None, None]
        assert backend.purge(JobState.WAITING) == 2
        assert backend.claim("w1", 5, LEASE_S) == []
        counts = backend.counts()
        assert (counts[JobState.COMPLETED], counts[JobState.WAITING], counts[JobState.FAILED]) == (
            0,
            0,
            1,
        )
        assert backend.purge(JobState.FAILED) == 1
        assert backend.purge(JobState.FAILED) == 0

    def test_retention_by_count(self, make_backend: MakeBackend) -> None:
        backend = make_backend(retain_completed=2, retain_failed=1)
        done = []
        for i in range(4):
            done.append(add(backend, f"done-{i}"))
            finish(backend, claim_one(backend), result=b"1")
            time.sleep(0.005)
        assert backend.counts()[JobState.COMPLETED] == 2
        assert [backend.get(j) for j in done[:2]] == [None, None]
        assert backend.get_result(done[0]) is None and backend.get_result(done[3]) == b"1"
        assert backend.list_jobs(JobState.COMPLETED) == [done[3], done[2]]
        failed = [add(backend), add(backend)]
        for _ in failed:
            finish(backend, claim_one(backend), "fail", error="boom")
            time.sleep(0.005)
        assert backend.get(failed[0]) is None and info(backend, failed[1]).state == "failed"
        # A trimmed id is free again.
        assert backend.enqueue([new_job("done-0")]) == [("done-0", True)]

    def test_retention_by_age(self, make_backend: MakeBackend) -> None:
        backend = make_backend(retain_s=0.5)
        old = add(backend)
        finish(backend, claim_one(backend))
        time.sleep(0.5 + SLACK_S)
        young = add(backend)
        finish(backend, claim_one(backend))
        assert backend.get(old) is None
        assert info(backend, young).state == "completed"

    def test_workers_register_refresh_and_expire(self, backend: Backend) -> None:
        backend.register_worker("w1", {"host": "h1", "pid": 123}, 0.3)
        backend.register_worker("w2", {"host": "h2"}, 5.0)
        live = {w["worker_id"]: w for w in backend.workers()}
        assert set(live) == {"w1", "w2"}
        assert (live["w1"]["host"], live["w1"]["pid"]) == ("h1", 123)
        time.sleep(0.3 + SLACK_S)
        assert [w["worker_id"] for w in backend.workers()] == ["w2"]
        backend.register_worker("w2", {"host": "h2-new"}, 5.0)
        assert [w["host"] for w in backend.workers()] == ["h2-new"]
        backend.unregister_worker("w2")
        backend.unregister_worker("never-registered")
        assert backend.workers() == []

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

    def test_oldest_waiting_is_the_oldest_first_in_line(self, backend: Backend) -> None:
        assert backend.oldest_waiting_ms() is None
        before = time.time_ns() // 1_000_000
        old = add(backend, priority=0)
        time.sleep(0.02)
        add(backend, priority=5)  # first in line, but younger
        oldest = backend.oldest_waiting_ms()
        assert oldest is not None and before - 1000 <= oldest <= before + 1000
        assert oldest == info(backend, old).created_ms
