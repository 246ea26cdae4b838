"""Bugs the chaos tests found, each pinned down by a small test that does not depend on luck."""

from __future__ import annotations

import os
import signal
from concurrent.futures import Future

import pytest

from sandboxq import Pool, Queue
from sandboxq.models import Outcome
from sandboxq.pool.attempt import AttemptResult
from sandboxq.testing.processes import still_running
from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from sandboxq.worker.heartbeat import fence_margin_s
from tests.support.proxy import TcpProxy

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
        slow_task_id = pool.execute(pool.make_task(60, "slow"), victim.set_result)

        def on_quick_done(result: AttemptResult) -> None:  # runs on the supervisor thread
            pid = pool.running_pids()[slow_task_id]
            pool.kill(slow_task_id, Outcome.LEASE_LOST, "the lease renewal was rejected")
            os.kill(pid, signal.SIGKILL)
            # the child dies (unreaped: this thread reaps): its channel and sentinel are
            # readable before the supervisor gets to look again
            wait_for(lambda: not still_running([pid]), 10, "the slow attempt's child to die")
            quick.set_result(result)

        wait_for(pool.running_pids, 10, "the slow attempt to run in a child")
        pool.execute(pool.make_task(0.01, "quick"), on_quick_done)
        assert quick.result(timeout=20).outcome is Outcome.OK
        assert victim.result(timeout=20).outcome is Outcome.LEASE_LOST
        # The pool survived, replaced the child and goes on serving.
        assert pool.submit(0.01, "after").result(timeout=20) == "after"
    finally:
        pool.shutdown(cancel=True)


@pytest.mark.alone  # the heartbeat's largest gap
def test_a_worker_behind_a_slow_link_keeps_its_leases(
    redis_server: RedisServer, queue_name: str, workers: BackgroundWorkers
) -> None:
    """Found with the network chaos test: behind a link with 150 ms of latency each way, a
    worker with a 1.5 s lease fenced its own healthy jobs over and over. Its heartbeat
    waited a full renewal interval *after* each renewal and then refreshed the worker
    registry, on the same thread, over the main connection: one cycle took interval +
    two round trips, so the lease was renewed too late. Renewals now keep a fixed schedule
    and the registry refresh has its own thread."""
    lease = 1.5
    with (
        TcpProxy("127.0.0.1", redis_server.port) as proxy,
        Queue(queue_name, url=redis_server.url) as queue,
    ):
        worker = workers.start(
            queue_name, H + "succeed_after", url=proxy.url, concurrency=2, lease_s=lease
        )
        # Warm up every connection on a fast link: the test is about the steady state.
        assert queue.enqueue(1.0, "warm").result(timeout_s=20) == "warm"
        proxy.delay_s = 0.15
        jobs = [queue.enqueue(3 * lease, i) for i in range(2)]
        assert [job.result(timeout_s=60) for job in jobs] == [0, 1]
        workers.stop(worker)
        print(f"\nlongest gap between renewals: {worker.heartbeat.max_gap_s:.2f} s")
        assert worker.stats["lease_lost"] == 0, worker.stats
        assert all(job.info().stalls == 0 for job in jobs)
        assert worker.heartbeat.max_gap_s < lease - fence_margin_s(lease)
