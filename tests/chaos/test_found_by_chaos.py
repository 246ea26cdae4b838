"""Bugs the chaos tests found, each pinned down by a small test that does not depend on luck."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future

import pytest

from sandboxq import Pool
from sandboxq.models import Outcome
from sandboxq.pool.attempt import AttemptResult

pytestmark = pytest.mark.timeout(60)

H = "sandboxq.testing.handlers:"


def test_a_kill_racing_a_childs_death_does_not_crash_the_supervisor() -> None:
    """Found thawing a SIGSTOPped worker: its fence killed a child while the heartbeat, whose
    renewal had just been rejected, asked for the same kill. The supervisor read the dead
    child's channel on the kill command (closing it), then handled the channel's own
    readiness from the same select batch and crashed on the closed descriptor, taking the
    whole worker down.

    Made deterministic here: while the supervisor thread is held in one attempt's callback,
    another attempt is ordered killed (the wake pipe is ready first) and its child dies
    (its channel is ready next), so both arrive in one batch, in that order."""
    pool = Pool(H + "succeed_after", 2)
    try:
        victim: Future[AttemptResult] = Future()
        quick: Future[AttemptResult] = Future()
        slow_token = pool.execute(pool.make_task(60, "slow"), victim.set_result)

        def on_quick_done(result: AttemptResult) -> None:  # runs on the supervisor thread
            pid = pool.running_pids()[slow_token]
            pool.kill(slow_token, Outcome.LEASE_LOST, "the lease renewal was rejected")
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)  # the child dies; its channel and sentinel become readable
            quick.set_result(result)

        time.sleep(0.5)  # the slow attempt is running
        pool.execute(pool.make_task(0.01, "quick"), on_quick_done)
        assert quick.result(timeout=20).outcome is Outcome.OK
        assert victim.result(timeout=20).outcome is Outcome.LEASE_LOST
        # The pool survived, replaced the child and goes on serving.
        assert pool.submit(0.01, "after").result(timeout=20) == "after"
    finally:
        pool.shutdown(cancel=True)
