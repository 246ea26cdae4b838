"""The contract of waiting: a waiting claim wakes promptly and never misses a job,
``wait_for_finish`` returns when a job finishes, ``events`` blocks for new ones,
``new_events`` reads several queues at once."""

from __future__ import annotations

import threading
import time

from sandboxq.backends.base import (
    Backend,
    Claimed,
    Event,
    FinishAction,
)
from sandboxq.errors import BackendError
from sandboxq.models import JobState
from tests.support.contract.support import (
    LEASE_S,
    PROMPT_S,
    SLACK_S,
    add,
    claim_one,
    finish,
    in_thread,
)


class WaitingContract:
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

    def test_stop_waiting_ends_that_workers_waiting_claim_once(self, backend: Backend) -> None:
        # Each wait is far longer than the checks allow: only stop_waiting can end it.
        stopper = in_thread(0.3, lambda: backend.stop_waiting("w1"))
        start = time.monotonic()
        assert backend.claim("w1", 1, LEASE_S, wait_s=20.0) == []
        stopper.join(timeout=5.0)
        assert time.monotonic() - start < 0.3 + PROMPT_S
        # Asked before a claim: that claim does not wait; the next one waits again.
        backend.stop_waiting("w1")
        start = time.monotonic()
        assert backend.claim("w1", 1, LEASE_S, wait_s=20.0) == []
        assert time.monotonic() - start < PROMPT_S
        start = time.monotonic()
        assert backend.claim("w1", 1, LEASE_S, wait_s=0.4) == []
        assert time.monotonic() - start >= 0.3
        # Another worker's wait is not ended by it.
        stopper = in_thread(0.1, lambda: backend.stop_waiting("w1"))
        start = time.monotonic()
        assert backend.claim("w2", 1, LEASE_S, wait_s=0.4) == []
        stopper.join(timeout=5.0)
        assert time.monotonic() - start >= 0.3
        # A job that is there is still claimed: only the wait is given up.
        job_id = add(backend)
        assert [c.id for c in backend.claim("w1", 1, LEASE_S, wait_s=20.0)] == [job_id]

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

    def test_new_events_of_several_queues_in_one_read(self, backend: Backend) -> None:
        """What the dashboard's one reader does for hundreds of queues: each queue's
        events after its own cursor, at most ``count`` each, through siblings' shared
        connections."""
        siblings = [backend.sibling(f"{backend.queue}-sib{i}") for i in range(2)]
        names = [backend.queue, *(s.queue for s in siblings)]
        try:
            mine, theirs = add(backend), [add(siblings[0]), add(siblings[0])]
            read = backend.new_events(dict.fromkeys(names), 10)
            assert [(e.kind, e.job_id) for e in _events(read[names[0]])] == [("added", mine)]
            first, second = _events(read[names[1]])
            assert [first.job_id, second.job_id] == theirs and read[names[2]] == []
            after = backend.new_events({names[1]: first.id, names[2]: None}, 10)
            assert [e.job_id for e in _events(after[names[1]])] == theirs[1:]
            assert _events(backend.new_events({names[1]: None}, 1)[names[1]]) == [first]
            assert siblings[0].counts()[JobState.WAITING] == 2
        finally:
            for sibling in siblings:
                sibling.close()
        assert backend.counts()[JobState.WAITING] == 1  # its connections outlive siblings'

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


def _events(read: list[Event] | BackendError) -> list[Event]:
    assert not isinstance(read, BackendError), read
    return read
