"""The contract of inspection and administration: counts, listing, manual retry, purge,
retention and the worker registry."""

from __future__ import annotations

import time

from sandboxq.backends.base import (
    Ack,
    Backend,
)
from sandboxq.models import JobState, Outcome
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


class AdminContract:
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

    def test_completed_results_reads_each_completed_jobs_codec_and_result(
        self, backend: Backend
    ) -> None:
        valued, empty, failed = add(backend), add(backend), add(backend)
        finish(backend, claim_one(backend), result=b"[1, 2]")
        finish(backend, claim_one(backend))
        finish(backend, claim_one(backend), "fail", error="boom")
        waiting = add(backend)
        assert backend.completed_results([valued, "nope", empty, failed, waiting]) == [
            ("json", b"[1, 2]"),
            None,
            ("json", None),
            None,
            None,
        ]
        assert backend.completed_results([]) == []

    def test_outcomes_reads_each_jobs_state_outcome_and_attempts_in_order(
        self, backend: Backend
    ) -> None:
        completed, failed, cancelled = add(backend), add(backend), add(backend)
        finish(backend, claim_one(backend))
        finish(backend, claim_one(backend), "fail", error="boom")
        backend.cancel(cancelled)
        waiting = add(backend)
        assert backend.outcomes([waiting, "nope", failed, cancelled, completed]) == [
            (JobState.WAITING, None, 0, None),
            None,
            (JobState.FAILED, Outcome.ERROR, 1, "other"),  # "boom" names no type
            (JobState.CANCELLED, Outcome.CANCELLED, 0, None),
            (JobState.COMPLETED, Outcome.OK, 1, None),
        ]
        assert backend.outcomes([]) == []

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

    def test_retention_by_count_when_one_call_finishes_many_jobs(
        self, make_backend: MakeBackend
    ) -> None:
        """Redis trims once per finished set for all of a call's acks (finish.lua): the
        caps hold as they do when each job finishes on its own."""
        backend = make_backend(retain_completed=3, retain_failed=2)
        backend.enqueue([new_job(f"j{i}") for i in range(10)])
        held = backend.claim("w1", 10, 60.0)
        assert len(held) == 10
        acks = [
            Ack(c.id, c.token, "complete", record(c), result=b"1")
            if i < 7
            else Ack(c.id, c.token, "fail", record(c, Outcome.ERROR, error="boom"), error="boom")
            for i, c in enumerate(held)
        ]
        accepted, _ = backend.finish_many("w1", acks)
        assert accepted == [True] * 10
        counts = backend.counts()
        assert (counts[JobState.COMPLETED], counts[JobState.FAILED]) == (3, 2)
        kept = [j for j in (f"j{i}" for i in range(10)) if backend.get(j) is not None]
        assert len(kept) == 5
        assert sorted(backend.list_jobs(JobState.COMPLETED)) == sorted(kept[:3])

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
        registry = backend.worker_registry()  # the same workers, and no cap hit
        assert ([w["worker_id"] for w in registry.live], registry.note()) == (["w2"], "")
        backend.register_worker("w2", {"host": "h2-new"}, 5.0)
        assert [w["host"] for w in backend.workers()] == ["h2-new"]
        backend.unregister_worker("w2")
        backend.unregister_worker("never-registered")
        assert backend.workers() == []
