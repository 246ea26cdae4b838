"""The memory and Redis backends, driven with the same calls, against a small model.

A Hypothesis state machine enqueues, claims (with long leases, or leases that have run
out before the next step), renews, records progress, finishes with current and stale
tokens, cancels, retries, confirms ended attempts, recovers stalled jobs, releases and
purges, on both backends at once (a real redis-server). Every answer of one backend must
equal the other's, and the model's where the model predicts it; after every step every
job's record and progress, the counts, the lists and the first page of each state must
agree too.

Time is never mocked: a lease is either long (never runs out in a test) or one
millisecond, and after claiming with one the machine waits until the clock has moved
past its expiry, so "stall recovery with time moved on" is the same on both backends.
Finished jobs finish in distinct milliseconds, so that the model knows which one
retention trims (the backends break ties by id, which the model does not follow).

``make test`` runs a bounded number of examples; ``make soak`` sets
``SANDBOXQ_MODEL_EXAMPLES`` for many more.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from sandboxq.backends import rules as backend_rules
from sandboxq.backends.base import Ack, Backend, Claimed, NewJob
from sandboxq.backends.memory import MemoryBackend
from sandboxq.backends.redis import RedisBackend
from sandboxq.backends.redis.scripts import eval_source, library
from sandboxq.models import AttemptRecord, JobInfo, JobState, Outcome

IDS = ["a", "b", "c", "d", "e"]
WORKERS = ["w1", "w2"]
LONG_S = 120.0
SHORT_S = 0.001
RETAIN = 2  # finished jobs kept per finished state: retention runs often
RARE = 3  # cancel and purge act once in this many draws
EXAMPLES = int(os.environ.get("SANDBOXQ_MODEL_EXAMPLES", "60"))  # about 10 s
STEPS = int(os.environ.get("SANDBOXQ_MODEL_STEPS", "40"))

FINISHED = (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def next_ms() -> None:
    """Wait for the clock to move to a new millisecond (about a millisecond at most)."""
    start = now_ms()
    while now_ms() <= start:
        pass


@dataclass
class Lease:
    job_id: str
    worker: str
    tokens: tuple[str, str]  # (memory, redis)
    short: bool
    attempt: int  # charged: what the retry budget counts
    number: int  # its place in the history


@dataclass
class MJob:
    """What the model knows of one job."""

    state: JobState
    attempts: int = 0  # started: the numbers of its history, never reset
    uncharged: int = 0  # started but not counted by the retry budget
    stalls: int = 0
    lease: Lease | None = None  # the current lease, while active
    fence: Lease | None = None  # a cancelled active lease not yet confirmed
    history: list[Outcome] = field(default_factory=list)
    ttl0: bool = False  # its own time to live is 0: retention takes it as it finishes
    #: What the next claim that pops it makes of it while waiting: a budget that runs out
    #: at once (max_queue_s or deadline_s of a millisecond) fails it unstarted.
    late: Outcome | None = None

    @property
    def fenced(self) -> bool:
        """Cancelled while running, its lease long: the fence stands through the test."""
        return self.fence is not None and not self.fence.short


def comparable(info: JobInfo | None) -> object:
    """A job record without what legitimately differs (times, pids)."""
    if info is None:
        return None
    return (
        info.state,
        info.attempts,
        info.stalls,
        info.outcome,
        info.error,
        [(h.attempt, h.outcome, h.action, h.worker_id, h.error) for h in info.history],
    )


class BackendsAgree(RuleBasedStateMachine):
    redis_url = ""

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        queue = f"m-{uuid.uuid4().hex[:10]}"
        limits = {"retain_completed": RETAIN, "retain_failed": RETAIN}
        self.memory: Backend = MemoryBackend(queue, **limits)
        self.redis: Backend = RedisBackend(self.redis_url, queue, **limits)
        self.jobs: dict[str, MJob] = {}
        self.finished_order: dict[JobState, list[str]] = {state: [] for state in FINISHED}

    def teardown(self) -> None:
        self.redis.close()

    # -- helpers -------------------------------------------------------------------------

    def both(self, call: str, *args: object, **kwargs: object) -> object:
        mem = getattr(self.memory, call)(*args, **kwargs)
        red = getattr(self.redis, call)(*args, **kwargs)
        assert mem == red, f"{call}{args}: memory {mem!r} but redis {red!r}"
        return mem

    def finished(self, job_id: str, state: JobState) -> None:
        """The model's side of a job finishing: it may push the oldest one out."""
        job = self.jobs[job_id]
        job.state, job.lease = state, None
        order = self.finished_order[state]
        order.append(job_id)
        # the count cap first, the oldest first; a job still fenced stays
        for oldest in order[: max(0, len(order) - RETAIN)]:
            if not self.jobs[oldest].fenced:
                order.remove(oldest)
                del self.jobs[oldest]
        fenced = job.fenced
        # then the age rule: this one's time is up, unless a fence keeps it (its lease
        # is long: it stays till that lease's expiry, beyond the test)
        if job.ttl0 and job_id in order and not fenced:
            order.remove(job_id)
            del self.jobs[job_id]
            event(f"retention: {state} with a time to live of 0 taken as it finished")
        next_ms()  # the next finish lands in a later millisecond

    def unfinish(self, job_id: str) -> None:
        for order in self.finished_order.values():
            if job_id in order:
                order.remove(job_id)

    # -- rules ---------------------------------------------------------------------------

    @initialize(ttl0=st.lists(st.booleans(), min_size=3, max_size=3))
    def some_jobs(self, ttl0: list[bool]) -> None:
        for job_id, zero in zip(IDS[:3], ttl0, strict=True):
            self.enqueue(job_id, 0, False, None, zero)

    @rule(
        job_id=st.sampled_from(IDS),
        priority=st.integers(-1, 1),
        delayed=st.sampled_from([False, False, False, True]),
        budget=st.sampled_from([None, None, "roomy", "max_queue_s", "deadline_s"]),
        ttl0=st.sampled_from([False, False, True]),
    )
    def enqueue(
        self, job_id: str, priority: int, delayed: bool, budget: str | None, ttl0: bool = False
    ) -> None:
        chosen: dict[str, float] = {"result_ttl_s": 0, "failure_ttl_s": 0} if ttl0 else {}
        late = None
        if budget == "roomy":  # budgets that never run out here
            chosen.update(max_queue_s=600, deadline_s=600)
        elif budget is not None and not any(job.late for job in self.jobs.values()):
            # One such job at a time, first in line (it fails in a millisecond of its own,
            # so retention's choice stays the model's), its budget one millisecond.
            chosen[budget], priority = 0.001, 2
            late = Outcome.EXPIRED if budget == "max_queue_s" else Outcome.DEADLINE
        options = json.dumps(chosen)
        new = NewJob(
            b"[[], {}]",
            options_json=options,
            job_id=job_id,
            priority=priority,
            delay_s=600 if delayed else 0,
        )
        [(_, created)] = self.both("enqueue", [new])  # type: ignore[misc]
        assert created == (job_id not in self.jobs)
        if created:
            state = JobState.DELAYED if delayed else JobState.WAITING
            self.jobs[job_id] = MJob(state, ttl0=ttl0, late=late)

    @rule(
        target=leases,
        worker=st.sampled_from(WORKERS),
        count=st.integers(1, 3),
        short=st.booleans(),
    )
    def claim(self, worker: str, count: int, short: bool) -> object:
        lease_s = SHORT_S if short else LONG_S
        late = [i for i, job in self.jobs.items() if job.state is JobState.WAITING and job.late]
        if late:  # its budget of one millisecond is over on both backends' clocks
            end = now_ms() + 2
            while now_ms() <= end:
                pass
        mem = self.memory.claim(worker, count, lease_s)
        red = self.redis.claim(worker, count, lease_s)
        pairs: list[tuple[Claimed, Claimed]] = list(zip(mem, red, strict=True))
        assert [(m.id, m.attempt, m.number) for m, _ in pairs] == [
            (r.id, r.attempt, r.number) for _, r in pairs
        ]
        for job_id in late:  # popped first (priority 2), failed unstarted
            job = self.jobs[job_id]
            job.attempts += 1
            assert job.late is not None
            job.history.append(job.late)
            event(f"claim: {job.late}")
            self.finished(job_id, JobState.FAILED)
        waiting = [i for i, job in self.jobs.items() if job.state is JobState.WAITING]
        assert len(pairs) == min(count, len(waiting))
        claimed = []
        for m, r in pairs:
            job = self.jobs[m.id]
            assert job.state is JobState.WAITING
            job.state, job.attempts = JobState.ACTIVE, job.attempts + 1
            assert (m.attempt, m.number) == (job.attempts - job.uncharged, job.attempts)
            job.lease = Lease(m.id, worker, (m.token, r.token), short, m.attempt, m.number)
            claimed.append(job.lease)
        if short:  # both clocks past the expiry: the lease has run out on either backend
            end = now_ms() + 2
            while now_ms() <= end:
                pass
        from hypothesis.stateful import multiple

        return multiple(*claimed)

    def current(self, lease: Lease) -> bool:
        job = self.jobs.get(lease.job_id)
        return job is not None and job.state is JobState.ACTIVE and job.lease is lease

    @rule(lease=leases)
    def renew(self, lease: Lease) -> None:
        mem = self.memory.renew(lease.worker, [(lease.job_id, lease.tokens[0])], LONG_S)
        red = self.redis.renew(lease.worker, [(lease.job_id, lease.tokens[1])], LONG_S)
        assert mem == red
        assert mem == ([] if self.current(lease) else [lease.job_id])
        if self.current(lease):
            lease.short = False  # renewed for a long lease

    @rule(
        lease=leases,
        action=st.sampled_from(["complete", "fail", "retry", "requeue"]),
        delay=st.sampled_from([0.0, 600.0]),
    )
    def finish(self, lease: Lease, action: str, delay: float) -> None:
        outcome = Outcome.OK if action == "complete" else Outcome.ERROR
        if action == "requeue":
            outcome = Outcome.INTERRUPTED
        record = AttemptRecord(attempt=lease.number, outcome=outcome, worker_id=lease.worker)
        error = None if action == "complete" else "boom"
        answers = []
        for backend, token in ((self.memory, lease.tokens[0]), (self.redis, lease.tokens[1])):
            ack = Ack(lease.job_id, token, action, record, b"1", error, delay)  # type: ignore[arg-type]
            answers.append(backend.finish_many(lease.worker, [ack])[0])
        assert answers[0] == answers[1]
        current = self.current(lease)
        assert answers[0] == [current]
        event(f"finish {action}: {'accepted' if current else 'rejected'}")
        if not current:
            return
        job = self.jobs[lease.job_id]
        job.history.append(outcome)
        if action == "complete":
            self.finished(lease.job_id, JobState.COMPLETED)
        elif action == "fail":
            self.finished(lease.job_id, JobState.FAILED)
        else:
            if action == "requeue":  # not charged, but its number is used: it has a record
                job.uncharged += 1
            delayed = action == "retry" and delay > 0
            job.state, job.lease = (JobState.DELAYED if delayed else JobState.WAITING), None

    @rule(lease=leases, message=st.sampled_from([None, "", "half"]))
    def progress(self, lease: Lease, message: str | None) -> None:
        mem = self.memory.record_progress(lease.worker, lease.job_id, lease.tokens[0], 0.5, message)
        red = self.redis.record_progress(lease.worker, lease.job_id, lease.tokens[1], 0.5, message)
        assert mem == red == self.current(lease)

    @rule(lease=leases)
    def release(self, lease: Lease) -> None:
        mem = self.memory.release(lease.worker, [(lease.job_id, lease.tokens[0])])
        red = self.redis.release(lease.worker, [(lease.job_id, lease.tokens[1])])
        assert mem == red
        current = self.current(lease)
        assert mem == ([] if current else [lease.job_id])
        if current:
            job = self.jobs[lease.job_id]
            job.state, job.lease, job.attempts = JobState.WAITING, None, job.attempts - 1

    # Drawn as often as any rule, but acting one time in RARE: otherwise jobs are cancelled
    # and purged faster than they get far enough to stall twice or be retried.
    @rule(job_id=st.sampled_from(IDS), draw=st.integers(1, RARE))
    def cancel(self, job_id: str, draw: int) -> None:
        if draw != 1:
            return
        done = self.both("cancel", job_id)
        job = self.jobs.get(job_id)
        expected = job is not None and not job.state.finished
        assert done == expected
        if not expected or job is None:
            return
        if job.state is JobState.ACTIVE:
            job.fence = job.lease
            job.history.append(Outcome.CANCELLED)
        self.finished(job_id, JobState.CANCELLED)

    @rule(job_id=st.sampled_from(IDS))
    def retry(self, job_id: str) -> None:
        done = self.both("retry_failed", job_id)
        job = self.jobs.get(job_id)
        expected = job is not None and job.state in (JobState.FAILED, JobState.CANCELLED)
        assert done == expected
        if not expected or job is None:
            return
        self.unfinish(job_id)
        job.uncharged, job.stalls = job.attempts, 0  # the budget starts again; numbers go on
        fenced = job.fence is not None and not job.fence.short
        if not fenced:
            job.fence = None
        job.state = JobState.DELAYED if fenced else JobState.WAITING
        event(f"retry: {'fenced' if fenced else 'waiting'}")

    @rule(lease=leases)
    def confirm_dead(self, lease: Lease) -> None:
        mem = self.memory.confirm_dead(lease.worker, [(lease.job_id, lease.tokens[0])])
        red = self.redis.confirm_dead(lease.worker, [(lease.job_id, lease.tokens[1])])
        assert mem == red
        job = self.jobs.get(lease.job_id)
        lifted = job is not None and job.fence is lease
        assert mem == ([lease.job_id] if lifted else [])
        event(f"confirm_dead: {'lifted' if lifted else 'no fence'}")
        if lifted and job is not None:
            job.fence = None
            if job.state is JobState.DELAYED:
                job.state = JobState.WAITING

    @rule()
    def recover_stalled(self) -> None:
        # in the same order too: the earliest expiry first, ties (one claim) by id
        mem = self.memory.recover_stalled()
        red = self.redis.recover_stalled()
        assert mem == red
        expected = []
        for job_id, job in sorted(self.jobs.items()):
            if job.state is JobState.ACTIVE and job.lease is not None and job.lease.short:
                job.stalls += 1
                failed = job.stalls > backend_rules.DEFAULT_MAX_STALLS
                expected.append((job_id, "failed" if failed else "waiting"))
                job.history.append(Outcome.LEASE_LOST)
        assert sorted(mem) == expected
        for job_id, state in expected:
            event(f"recover_stalled: {state}")
            if state == "failed":
                self.finished(job_id, JobState.FAILED)
            else:
                self.jobs[job_id].state, self.jobs[job_id].lease = JobState.WAITING, None

    @rule(
        state=st.sampled_from([s for s in JobState if s is not JobState.ACTIVE]),
        draw=st.integers(1, RARE),
    )
    def purge(self, state: JobState, draw: int) -> None:
        if draw != 1:
            return
        purged = self.both("purge", state)
        # a job cancelled while running keeps its fence, and purge keeps the job
        gone = [
            i
            for i, job in self.jobs.items()
            if job.state is state and (job.fence is None or job.fence.short)
        ]
        assert purged == len(gone)
        event(f"purge: {'some' if gone else 'none'}")
        for job_id in gone:
            del self.jobs[job_id]
            self.unfinish(job_id)

    # -- what must agree after every step ------------------------------------------------

    @invariant()
    def records_agree(self) -> None:
        # what retention removed: the same counts (not the times: each backend reads the
        # clock at its own moment)
        trims = [backend.retention_trims() for backend in (self.memory, self.redis)]
        kept = [(t.capped, t.caps, t.expired) for t in trims]
        assert kept[0] == kept[1], f"trims: memory {kept[0]} but redis {kept[1]}"
        counts = self.both("counts")
        expected = {state: 0 for state in JobState}
        for job in self.jobs.values():
            expected[job.state] += 1
        assert counts == expected
        for job_id in IDS:
            mem, red = self.memory.get(job_id), self.redis.get(job_id)
            assert comparable(mem) == comparable(red), job_id
            job = self.jobs.get(job_id)
            if job is None:
                assert mem is None
                continue
            assert mem is not None
            charged = job.attempts - job.uncharged
            assert (mem.state, mem.attempts, mem.stalls) == (job.state, charged, job.stalls)
            assert [h.outcome for h in mem.history] == job.history
            numbers = [h.attempt for h in mem.history]  # they keep counting: never repeated
            assert numbers == sorted(set(numbers)), numbers
        # Orders and pages agree where the two backends' clocks cannot make them differ:
        # waiting is ordered by sequence, and jobs finish in distinct milliseconds. (Ties
        # in due time or lease expiry are the contract's: tests.support.contract.order.)
        for state in (JobState.WAITING, *FINISHED):
            self.both("list_jobs", state)
            pages = [backend.job_page(state, limit=2) for backend in (self.memory, self.redis)]
            shown = [([job.id for job in page.jobs], page.next_cursor is None) for page in pages]
            assert shown[0] == shown[1], f"{state}: memory {shown[0]} but redis {shown[1]}"
        for job_id in IDS:
            details = [self.memory.job_detail(job_id), self.redis.job_detail(job_id)]
            progress = [None if d is None else (d.progress, d.progress_message) for d in details]
            assert progress[0] == progress[1], (
                f"{job_id}: memory {progress[0]} but redis {progress[1]}"
            )


@pytest.mark.timeout(60 + EXAMPLES * STEPS // 100)
def test_memory_and_redis_backends_agree(redis_url: str) -> None:
    BackendsAgree.redis_url = redis_url
    run_state_machine_as_test(
        BackendsAgree,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_the_lua_scripts_get_their_rules_from_python() -> None:
    """One place for the constants and texts: the scripts are generated with them, as the
    function library and as the EVALSHA fallback alike."""
    for text in (library()[1], eval_source("recover_stalled")):
        assert f"local HISTORY_CAP = {backend_rules.HISTORY_CAP}" in text
        assert f"local DEFAULT_MAX_STALLS = {backend_rules.DEFAULT_MAX_STALLS}" in text
        assert backend_rules.STALL_FAIL_TEXT in text and backend_rules.STALL_RETRY_TEXT in text
    assert backend_rules.ms(0.0011) == 2 and backend_rules.lease_ms(0) == 1
    assert backend_rules.lease_expired(10, 11) and not backend_rules.lease_expired(10, 10)
