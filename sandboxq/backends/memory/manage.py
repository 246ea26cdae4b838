"""The memory backend's changes that do not come from a job's own worker: stalled
recovery, cancel (and the fence it leaves), manual retry, the old owner's confirmation that
a cancelled attempt ended, and purge. Each mirrors its Lua script step by step
(recover_stalled.lua, cancel.lua, retry_failed.lua, confirm_dead.lua, purge.lua).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sandboxq.backends import rules
from sandboxq.backends.memory.batches import sweep_batches
from sandboxq.backends.memory.store import (
    ACTIVE,
    CANCELLED,
    DELAYED,
    FAILED,
    WAITING,
    Job,
    Store,
)
from sandboxq.models import (
    DEFAULT_MAX_INFRA_DEATHS,
    Action,
    AttemptRecord,
    JobState,
    Outcome,
    now_ms,
)

log = logging.getLogger("sandboxq.backends.memory")


class Management:
    _store: Store

    if TYPE_CHECKING:

        def send_follow_ups(self) -> None: ...  # Batches'

        def attempt_child(self, job: Job) -> rules.RunningChild: ...  # backend

    def recover_stalled(
        self, max_infra_deaths: int = DEFAULT_MAX_INFRA_DEATHS
    ) -> list[tuple[str, str]]:
        recovered: list[tuple[str, str]] = []
        store = self._store
        with store.cond:
            now = now_ms()
            # in lease order (the oldest expiry first), as recover_stalled.lua takes them
            active = store.ordered(ACTIVE)
            expired = [job for job in active if rules.lease_expired(job.lease_ms, now)]
            for job in expired[: rules.RECOVER_LIMIT]:
                state = self._stalled(job, now, max_infra_deaths)
                recovered.append((job.id, state.value))
            store.expire_due(now)  # an idle queue's finished jobs go at their time too
            sweep_batches(store, now)
        if store.outbox:  # a batch this finished is done: its follow-up (batches.py)
            self.send_follow_ups()
        return recovered

    def _stalled(self, job: Job, now: int, max_infra_deaths: int) -> JobState:
        store = self._store
        job.stalls += 1
        job.infra_deaths += 1  # its worker died, or stopped renewing, while holding it
        limit = job.options.max_stalls
        outcome = Outcome.LEASE_LOST
        state = FAILED if job.stalls > limit else WAITING
        if state is FAILED:
            cause = rules.STALL_FAIL_TEXT % job.stalls
        elif rules.poisoned(job.infra_deaths, max_infra_deaths):
            state, outcome = FAILED, Outcome.POISON
            cause = rules.POISON_TEXT % (job.infra_deaths, rules.WORKER_DEATH_TEXT)
        else:
            cause = rules.STALL_RETRY_TEXT % (job.stalls, limit)
        # The owner is gone and its late finish will be rejected: this is the only
        # record of the attempt, so "why did my job die" still has an answer.
        child = self.attempt_child(job)
        attempt = AttemptRecord(
            attempt=job.attempts,
            outcome=outcome,
            action=Action.FAIL if state is FAILED else Action.RETRY,
            worker_id=job.owner,
            pid=child.pid,
            started_ms=rules.attempt_start(job.claimed_ms, child),
            ended_ms=now,
            error=cause,
        )
        store.record(job, attempt, cause)
        store.move(job, state, now, keep_place=True)  # it was first in line once
        if state is WAITING:
            job.ready_ms = now  # ready again from now, as a retried job is
        store.emit("stalled", job.id, state=state.value, stalls=str(job.stalls))
        if state is FAILED:
            store.emit("failed", job.id, outcome=outcome.value, error=cause)
        return state

    def cancel(self, job_id: str) -> bool:
        return self.cancel_jobs([job_id]) == 1

    def cancel_jobs(self, job_ids: Sequence[str], *, running: bool = True) -> int:
        """Cancel ``job_ids`` (``running=False``: a running one goes on) in one hold of
        the lock, as one script call does on Redis: no claim comes between a look at a
        job's state and its cancel, nor between two of them. The revoked leases' owners
        are told after. Returns how many were cancelled."""
        store = self._store
        revoked: list[tuple[str, str]] = []
        cancelled = 0
        with store.cond:
            now = now_ms()
            for job_id in job_ids:
                job = store.jobs.get(job_id)
                if job is None or job.state.finished or (not running and job.state is ACTIVE):
                    continue
                child = self.attempt_child(job) if job.state is ACTIVE else None
                token = store.cancel(job, now, child)
                cancelled += 1
                if token is not None:
                    revoked.append((job_id, token))
            # Only a lease's owner has an attempt to stop (as cancel.lua tells no one else).
            watchers = list(store.watchers) if revoked else []
        # Outside the lock: a callback that calls back into the backend must not deadlock.
        if store.outbox:  # a batch this finished is done: its follow-up (batches.py)
            self.send_follow_ups()
        for job_id, token in revoked:
            for callback in watchers:
                try:
                    callback(job_id, token)
                except Exception:
                    log.exception("cancellation callback %r failed for job %s", callback, job_id)
        return cancelled

    def retry_failed(self, job_id: str) -> bool:
        store = self._store
        with store.cond:
            job = store.jobs.get(job_id)
            if job is None or job.state not in (FAILED, CANCELLED):
                return False
            # Stalls restart too: a job failed for stalling would otherwise fail again at
            # its very next stall. The history stays; the last attempt's verdict goes.
            # The retry budget starts again; the history's numbers go on.
            job.uncharged, job.stalls, job.infra_deaths = job.attempts, 0, 0
            job.result = job.outcome = job.error = None
            now = now_ms()
            if job.fenced(now):
                job.due_ms = job.fenced_until_ms + 1  # the first millisecond it is lifted
                store.move(job, DELAYED, now)
                store.emit("retried", job_id, manual="1", fenced_until_ms=str(job.fenced_until_ms))
                return True
            job.fence_owner = job.fence_token = None
            store.move(job, WAITING, now)
            store.emit("retried", job_id, manual="1")
            return True

    def confirm_dead(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        store = self._store

        def lift(job_id: str, token: str, now: int) -> bool:
            job = store.jobs.get(job_id)
            if job is None or (job.fence_owner, job.fence_token) != (worker_id, token):
                return False
            job.fence_owner = job.fence_token = None
            if job.state is DELAYED:  # a fenced retry: claimable from now, not when due
                store.move(job, WAITING, now)
                job.ready_ms = now
            store.emit("unfenced", job_id)
            return True

        return store.per_lease(leases, lift)[0]

    def purge(self, state: JobState) -> int:
        state = rules.purgeable(state)
        store = self._store
        with store.cond:
            now = now_ms()
            # a job cancelled while running keeps its fence: see Backend.purge
            # and a member of a batch stays while its batch is kept (design invariant 14)
            ids = [
                i
                for i in store.by_state[state]
                if not store.jobs[i].fenced(now) and store.jobs[i].batch is None
            ]
            for job_id in ids:
                store.delete(job_id)
                store.emit("purged", job_id)  # as purge.lua: its waiters find it gone
            # the heaps skip deleted entries lazily; emptied at once when nothing was kept
            if state is WAITING and not store.by_state[state]:
                store.waiting.clear()
            elif state is DELAYED and not store.by_state[state]:
                store.delayed.clear()
            store.cond.notify_all()  # wait_for_finish on a purged job returns now
            return len(ids)
