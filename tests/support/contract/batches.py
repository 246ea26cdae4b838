"""The contract of batches (design invariant 14): counters exact after every move,
the stream of finished members, the follow-up sent exactly once, members kept past
retention and purge, cancel / retry / forget, and refusals that add nothing."""

from __future__ import annotations

import json
import threading
import time

import pytest

from sandboxq.backends.base import Backend, Claimed, NewJob
from sandboxq.backends.rules import TRIM_BUDGET
from sandboxq.batch_failures import failures
from sandboxq.errors import BatchNotFound, ConfigError
from sandboxq.models import BatchProgress, JobState, Outcome, member_id
from sandboxq.testing.waiting import wait_for
from tests.support.contract.support import (
    LEASE_S,
    SLACK_S,
    MakeBackend,
    add,
    claim_one,
    finish,
    info,
    new_job,
    record,
)


def members(batch_id: str, n: int, **options: object) -> list[NewJob]:
    jobs = [new_job(**options) for _ in range(n)]  # type: ignore[arg-type]
    for i, job in enumerate(jobs):
        job.job_id = member_id(batch_id, i)
    return jobs


def counts(progress: BatchProgress | None) -> dict[str, int]:
    assert progress is not None
    names = ("waiting", "active", "delayed", "completed", "failed", "cancelled")
    return {name: getattr(progress, name) for name in names if getattr(progress, name)}


def follow_ups(backend: Backend, batch_id: str) -> list[str]:
    """The batch's follow-up jobs on its own queue, in any state."""
    ids = [i for state in JobState for i in backend.list_jobs(state, 1000)]
    return [i for i in ids if i == batch_id + ".then"]


class BatchContract:
    def test_counters_follow_every_move(self, backend: Backend) -> None:
        jobs = members("b1", 5)
        jobs[4].delay_s = 30.0
        assert backend.enqueue_batch("b1", jobs) == 5
        assert counts(backend.batch_progress("b1")) == {"waiting": 4, "delayed": 1}
        first, second, third = (claim_one(backend) for _ in range(3))
        assert counts(backend.batch_progress("b1")) == {"waiting": 1, "active": 3, "delayed": 1}
        finish(backend, first)
        finish(backend, second, "fail", error="boom")
        finish(backend, third, "retry", retry_delay_s=30.0)
        progress = backend.batch_progress("b1")
        assert counts(progress) == {"waiting": 1, "delayed": 2, "completed": 1, "failed": 1}
        assert progress is not None and not progress.done and progress.total == 5
        backend.cancel(member_id("b1", 4))
        fourth = claim_one(backend)
        backend.release("w1", [(fourth.id, fourth.token)])
        assert counts(backend.batch_progress("b1")) == {
            "waiting": 1,
            "delayed": 1,
            "completed": 1,
            "failed": 1,
            "cancelled": 1,
        }
        assert backend.batch_progress("nope") is None

    def test_stalled_recovery_moves_the_counters(self, backend: Backend) -> None:
        backend.enqueue_batch("b1", members("b1", 1, max_stalls=0))
        claim_one(backend, lease_s=LEASE_S)
        time.sleep(LEASE_S + SLACK_S)
        assert backend.recover_stalled() == [(member_id("b1", 0), "failed")]
        progress = backend.batch_progress("b1")
        assert counts(progress) == {"failed": 1} and progress is not None and progress.done

    def test_batches_are_listed_newest_first_until_forgotten(self, backend: Backend) -> None:
        for bid in ("b1", "b2", "b3"):
            backend.enqueue_batch(bid, members(bid, 1))
        assert [p.batch_id for p in backend.list_batches()] == ["b3", "b2", "b1"]
        assert [p.batch_id for p in backend.list_batches(2)] == ["b3", "b2"]
        assert backend.batch_each("b2", "cancel") == 1
        assert backend.forget_batch("b2")
        listed = backend.list_batches()
        assert [(p.batch_id, p.total) for p in listed] == [("b3", 1), ("b1", 1)]

    def test_a_label_is_kept_with_the_batch(self, backend: Backend) -> None:
        label = '{"run": "in.jsonl", "lines": "1-3"} é <b>'
        backend.enqueue_batch("b1", members("b1", 2), label=label)
        backend.enqueue_batch("b2", members("b2", 1), label="")
        backend.enqueue_batch("b3", members("b3", 1))
        labels = [backend.batch_progress(b) for b in ("b1", "b2", "b3")]
        assert [p.label if p else "gone" for p in labels] == [label, "", None]

    def test_finished_members_stream_from_the_start_for_any_reader(self, backend: Backend) -> None:
        backend.enqueue_batch("b1", members("b1", 3))
        claimed = [claim_one(backend) for _ in range(3)]
        finish(backend, claimed[2])
        finish(backend, claimed[0], "fail", error="boom")
        cursor, rows = backend.batch_finished("b1", "0")
        assert rows == [(2, JobState.COMPLETED), (0, JobState.FAILED)]
        assert backend.batch_finished("b1", cursor) == (cursor, [])
        started = time.monotonic()
        threading.Timer(0.2, lambda: finish(backend, claimed[1])).start()
        _later, more = backend.batch_finished("b1", cursor, block_s=5.0)
        assert more == [(1, JobState.COMPLETED)] and time.monotonic() - started < 4
        # a second reader from the start sees the same sequence
        assert backend.batch_finished("b1", "0")[1] == rows + more

    def test_the_follow_up_is_sent_once_and_not_again_after_a_retry(self, backend: Backend) -> None:
        then = backend.queue  # on its own queue: both backends reach it from the script
        backend.enqueue_batch("b1", members("b1", 2), then=then)
        one, two = claim_one(backend), claim_one(backend)
        finish(backend, one)
        assert follow_ups(backend, "b1") == []
        finish(backend, two, "fail", error="boom")
        progress = backend.batch_progress("b1")
        assert progress is not None and progress.done and progress.then_sent
        assert follow_ups(backend, "b1") == ["b1.then"]
        detail = backend.job_detail("b1.then")
        assert detail is not None and detail.payload is not None
        args, kwargs = json.loads(detail.payload)
        assert kwargs == {}
        assert args == [
            {
                "batch_id": "b1",
                "queue": backend.queue,
                "total": 2,
                "completed": 1,
                "failed": 1,
                "cancelled": 0,
            }
        ]
        # the failed member runs again: the batch is not done; done again, nothing is sent
        assert backend.batch_each("b1", "retry") == 1
        progress = backend.batch_progress("b1")
        assert progress is not None and not progress.done and progress.waiting == 1
        again = next(c for c in backend.claim("w1", 5, LEASE_S) if c.id == member_id("b1", 1))
        finish(backend, again)
        progress = backend.batch_progress("b1")
        assert progress is not None and progress.done and progress.completed == 2
        assert len(follow_ups(backend, "b1")) == 1
        assert backend.get("b1.then") is not None
        # the stream tells a reader the member left its final state, then ended again
        assert backend.batch_finished("b1", "0")[1] == [
            (0, JobState.COMPLETED),
            (1, JobState.FAILED),
            (1, JobState.WAITING),
            (1, JobState.COMPLETED),
        ]

    def test_the_last_two_finishing_at_once_send_one_follow_up(self, backend: Backend) -> None:
        then = backend.queue
        backend.enqueue_batch("b1", members("b1", 2), then=then)
        claimed = [claim_one(backend, "w1"), claim_one(backend, "w2")]
        barrier = threading.Barrier(2)
        answers: list[bool] = []

        def end(job: Claimed, worker: str) -> None:
            barrier.wait()
            answers.append(finish(backend, job, worker_id=worker).accepted)

        threads = [
            threading.Thread(target=end, args=(job, worker))
            for job, worker in zip(claimed, ("w1", "w2"), strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(5)
        assert answers == [True, True]
        assert follow_ups(backend, "b1") == ["b1.then"]

    def test_members_outlive_retention_and_purge_until_forgotten(
        self, make_backend: MakeBackend
    ) -> None:
        backend = make_backend(retain_completed=1, retain_failed=1, retain_s=0)
        backend.enqueue_batch("b1", members("b1", 4))
        for _ in range(3):
            finish(backend, claim_one(backend))
        finish(backend, claim_one(backend), "fail", error="boom")
        others = [add(backend) for _ in range(3)]  # plain jobs trimmed as ever
        for _ in others:
            finish(backend, claim_one(backend))
        assert backend.purge(JobState.COMPLETED) >= 0
        for i in range(4):
            assert info(backend, member_id("b1", i)).state in (
                JobState.COMPLETED,
                JobState.FAILED,
            )
        assert sum(backend.get(job_id) is not None for job_id in others) <= 1
        assert backend.forget_batch("b1") is True
        assert backend.batch_progress("b1") is None
        assert all(backend.get(member_id("b1", i)) is None for i in range(4))
        assert backend.forget_batch("b1") is False

    def test_retention_counts_what_it_removed_not_the_members_it_kept(
        self, make_backend: MakeBackend
    ) -> None:
        """Members left the completed index under the cap, and were counted as removed
        (JobNotFound said 95 jobs trimmed by the cap, every one of them still kept)."""
        backend = make_backend(retain_completed=1, retain_s=0)
        backend.enqueue_batch("b1", members("b1", 5))
        for _ in range(5):
            finish(backend, claim_one(backend))
        time.sleep(0.01)  # past their time to live too: kept all the same
        others = [add(backend) for _ in range(3)]
        for _ in others:
            finish(backend, claim_one(backend))
        assert all(backend.get(member_id("b1", i)) is not None for i in range(5))
        trims = backend.retention_trims()
        removed = sum(backend.get(job_id) is None for job_id in others)
        assert trims.capped.get("completed", 0) + trims.expired == removed, trims

    def test_a_done_batch_goes_batch_ttl_s_later(self, make_backend: MakeBackend) -> None:
        backend = make_backend(batch_ttl_s=0)
        backend.enqueue_batch("b1", members("b1", 2))
        finish(backend, claim_one(backend))
        finish(backend, claim_one(backend))
        time.sleep(0.01)
        add(backend)
        finish(backend, claim_one(backend))  # entering a finished state sweeps
        assert backend.batch_progress("b1") is None
        assert backend.get(member_id("b1", 0)) is None

    def test_an_expired_batch_is_gone_for_every_reader_at_once(
        self, make_backend: MakeBackend
    ) -> None:
        """Past its batch_ttl_s a batch is deleted TRIM_BUDGET members per finish on the
        queue, and a quiet queue leaves it half-deleted for a long time: it was read as done
        with every count, its whole stream, and a retry reopened it. Expired, it is gone for
        every reader, before the sweep, half-way through it and after it."""
        backend = make_backend(batch_ttl_s=0.3)
        total = TRIM_BUDGET + 50  # one sweep round leaves 50 members behind on Redis
        backend.enqueue_batch("b1", members("b1", total))
        for _ in range(total):
            finish(backend, claim_one(backend), "fail", error="boom")
        done = backend.batch_progress("b1")
        assert done is not None and done.done and done.failed == total
        time.sleep(0.3 + SLACK_S)
        for reader in (
            lambda: backend.batch_progress("b1"),
            lambda: backend.batch_finished("b1", "0"),
            lambda: backend.batch_each("b1", "retry"),
        ):
            with pytest.raises(BatchNotFound, match=r"expired at .*batch_ttl_s 0\.3 s"):
                reader()
        assert [p.batch_id for p in backend.list_batches()] == []
        add(backend)
        finish(backend, claim_one(backend))  # entering a finished state sweeps one round
        for reader in (
            lambda: backend.batch_progress("b1"),
            lambda: backend.batch_finished("b1", "0")[1] or None,
            lambda: backend.batch_each("b1", "retry"),
        ):
            try:
                answer = reader()
            except BatchNotFound as exc:
                assert "expired" in str(exc)
            else:
                assert answer is None, "a half-deleted batch was read"
        assert [p.batch_id for p in backend.list_batches()] == []
        backend.forget_batch("b1")  # what is left of it goes at once (memory: gone already)
        assert backend.batch_progress("b1") is None
        assert all(backend.get(member_id("b1", i)) is None for i in range(total))

    def test_forget_is_refused_while_a_member_may_run(self, backend: Backend) -> None:
        backend.enqueue_batch("b1", members("b1", 2))
        claim_one(backend)
        with pytest.raises(ConfigError, match="cancel it first"):
            backend.forget_batch("b1")
        assert backend.batch_each("b1", "cancel") == 2
        assert backend.forget_batch("b1") is True

    def test_forget_waits_while_a_cancelled_members_child_may_still_run(
        self, backend: Backend
    ) -> None:
        """Design invariant 12: a member cancelled while it ran keeps its id taken until
        its worker confirms the child dead (or the old lease runs out); forgotten before
        that, its id could be enqueued afresh and run beside the child."""
        backend.enqueue_batch("b1", members("b1", 2))
        running = claim_one(backend, lease_s=30.0)
        assert backend.batch_each("b1", "cancel") == 2
        forgot: list[bool] = []
        forgetting = threading.Thread(target=lambda: forgot.append(backend.forget_batch("b1")))
        forgetting.start()
        forgetting.join(0.5)
        assert forgetting.is_alive() and not forgot, "forget did not wait for the fence"
        assert backend.get(running.id) is not None
        assert backend.confirm_dead("w1", [(running.id, running.token)]) == [running.id]
        forgetting.join(10)
        assert forgot == [True]
        assert backend.get(running.id) is None and backend.batch_progress("b1") is None

    def test_a_done_batch_waits_out_a_members_fence_before_it_goes(
        self, make_backend: MakeBackend
    ) -> None:
        backend = make_backend(batch_ttl_s=0)
        backend.enqueue_batch("b1", members("b1", 1))
        running = claim_one(backend, lease_s=30.0)
        assert backend.batch_each("b1", "cancel") == 1  # done, at once past its ttl
        add(backend)
        finish(backend, claim_one(backend))  # entering a finished state sweeps
        assert backend.get(running.id) is not None  # its child may still run
        assert backend.confirm_dead("w1", [(running.id, running.token)]) == [running.id]

        def swept() -> bool:
            add(backend)
            finish(backend, claim_one(backend))
            return backend.get(running.id) is None

        wait_for(swept, 10, "the batch to go once the fence is lifted")

    def test_cancel_stops_waiting_members_and_revokes_running_ones(self, backend: Backend) -> None:
        backend.enqueue_batch("b1", members("b1", 3))
        running = claim_one(backend)
        assert backend.batch_each("b1", "cancel") == 3
        assert backend.claim("w1", 5, LEASE_S) == []
        assert not finish(backend, running).accepted  # its lease was revoked
        progress = backend.batch_progress("b1")
        assert counts(progress) == {"cancelled": 3} and progress is not None and progress.done
        assert backend.batch_each("b1", "cancel") == 0
        assert backend.batch_each("nope", "cancel") is None

    def test_no_member_is_claimed_between_a_cancels_members(self, backend: Backend) -> None:
        """A cancel tells a running member's owner as it revokes its lease. A claim made
        right then (the owner's fetcher refilling the slot) took the next members, which
        the same cancel then cancelled while they ran: children killed, work lost. Members
        the cancel has not reached yet (it goes 1,000 a step) are cancelled by the claim
        that meets them, and counted for the cancel."""
        n = 2500
        backend.enqueue_batch("b4", members("b4", n))
        running = claim_one(backend)
        claimed_when_told: list[list[Claimed]] = []

        def told(job_id: str, token: str | None) -> None:
            if job_id == running.id:
                claimed_when_told.append(backend.claim("w2", 5, LEASE_S))

        stop = backend.watch_cancellations(told)
        try:
            assert backend.batch_each("b4", "cancel") == n
            wait_for(lambda: claimed_when_told, 10, "the running member's owner to be told")
        finally:
            stop()
        assert claimed_when_told == [[]]
        assert counts(backend.batch_progress("b4")) == {"cancelled": n}

    def test_cancel_unstarted_leaves_running_members_to_their_end(self, backend: Backend) -> None:
        backend.enqueue_batch("b3", members("b3", 3))
        running = claim_one(backend)
        assert backend.batch_each("b3", "cancel_unstarted") == 2
        assert backend.claim("w1", 5, LEASE_S) == []
        assert finish(backend, running).accepted  # its lease still holds
        progress = backend.batch_progress("b3")
        assert counts(progress) == {"cancelled": 2, "completed": 1}
        assert progress is not None and progress.done

    def test_refusals_add_nothing(self, backend: Backend) -> None:
        add(backend, member_id("b2", 1))
        with pytest.raises(ConfigError, match="taken"):
            backend.enqueue_batch("b2", members("b2", 3))
        assert backend.batch_progress("b2") is None
        assert backend.get(member_id("b2", 0)) is None

    def test_failures_group_each_outcome_by_the_kind_of_error(self, backend: Backend) -> None:
        """An outcome alone put ValueError, KeyError and a SerializationError in one "error"
        group: the type an ``error`` record names is its kind, read from the error's first
        ``ERROR_KIND_HEAD`` bytes, ``OTHER`` when they name none (or the error is over
        ``ERROR_KIND_READ_CAP``: not read); any other outcome is its own kind."""
        errors = [
            "builtins.ValueError: bad size",
            "builtins.ValueError: bad size: 3",
            "builtins.KeyError: 'k'",
            "sandboxq.errors.SerializationError: cannot encode the result",
            "builtins.ValueError: " + "x" * (1 << 17),  # over the read cap: not read
            "A" * 250 + ": a name past the first 200 bytes",
            "no type named here",
            "1abc: not an identifier",
            "a..b: not a dotted name",
            "ValueÉrror: not ASCII",
            "builtins.KeyError:",
        ]
        n = len(errors) + 3
        backend.enqueue_batch("b5", members("b5", n))
        kind_of: dict[str, str] = {}
        for error in errors:
            claimed = claim_one(backend)
            finish(backend, claimed, "fail", error=error)
            kind_of[claimed.id] = error
        killed = claim_one(backend)
        attempt = record(killed, Outcome.HARD_TIMEOUT, error="builtins.ValueError: cleanup")
        backend.finish("w1", killed.id, killed.token, "fail", attempt, error=attempt.error)
        finish(backend, claim_one(backend))
        cancelled = member_id("b5", n - 1)
        assert backend.cancel(cancelled)
        standings = backend.outcomes([*kind_of, killed.id, cancelled])
        assert [s.error_kind if s else "?" for s in standings] == [
            "ValueError",
            "ValueError",
            "KeyError",
            "sandboxq.errors.SerializationError",
            *["other"] * 6,
            "KeyError",
            None,  # not an error: its kind is its outcome
            None,
        ]
        found = failures(backend, "b5", examples=2)
        assert [(g.outcome, g.count) for g in found.groups] == [
            ("error", len(errors)),
            ("cancelled", 1),
            ("hard_timeout", 1),
        ]
        error, cancel, timeout = found.groups
        assert [(k.kind, k.count) for k in error.kinds] == [
            ("other", 6),
            ("KeyError", 2),
            ("ValueError", 2),
            ("sandboxq.errors.SerializationError", 1),
        ]
        assert sum(k.count for k in error.kinds) == error.count
        ids = list(kind_of)
        assert error.kinds[2].job_ids == ids[:2] and error.kinds[1].job_ids == [ids[2], ids[10]]
        assert error.kinds[0].job_ids == ids[4:6]  # examples=2
        assert [(k.kind, k.count, k.job_ids) for k in cancel.kinds] == [
            ("cancelled", 1, [cancelled])
        ]
        assert [(k.kind, k.count, k.job_ids) for k in timeout.kinds] == [
            ("hard_timeout", 1, [killed.id])
        ]
        few = failures(backend, "b5", kinds=2)  # the rest fold into other
        assert [(k.kind, k.count) for k in few.groups[0].kinds] == [
            ("other", 9),
            ("KeyError", 2),
        ]
