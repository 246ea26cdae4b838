"""The contract of leases over time: renewal, stalled recovery, cancellation and the fence
a cancelled attempt leaves (design invariant 12), and a finish sent again after a lost reply."""

from __future__ import annotations

import queue
import time

from sandboxq.backends.base import (
    Ack,
    Backend,
)
from sandboxq.models import JobState
from sandboxq.testing.waiting import wait_for
from tests.support.contract.support import (
    LEASE_S,
    SLACK_S,
    add,
    claim_one,
    finish,
    info,
    record,
)


class RecoveryContract:
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
            # No lease was revoked: no worker has anything to stop, so none is told (a
            # cancel of an active job after them is the first thing the watch hears).
            active = add(backend)
            claimed = claim_one(backend)
            assert claimed.id == active and backend.cancel(active)
            assert seen.get(timeout=1.0) == (active, claimed.token)
        finally:
            stop()
        assert {info(backend, waiting).state, info(backend, delayed).state} == {"cancelled"}
        counts = backend.counts()
        assert (counts[JobState.CANCELLED], counts[JobState.WAITING], counts[JobState.DELAYED]) == (
            3,
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
