"""One job's blast radius is one attempt (design invariant 11): a handler that kills its
parent, writes garbage to every descriptor it holds, or closes them all, ends its own
attempt with a named outcome, and the pool and the worker go on serving the others. In
both containment modes, against real processes and a real redis-server."""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path

import pytest
import redis
from multiprocess import resource_tracker

from sandboxq import JobFailed, Pool, Queue
from sandboxq.errors import AttemptFailed
from sandboxq.models import JobState, Outcome
from sandboxq.pool import server
from sandboxq.pool.attempt import AttemptResult
from sandboxq.pool.server import MAX_DEATHS
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers

CALL = "sandboxq.testing.hostile:call"


def run(pool: Pool, *args: object) -> AttemptResult:
    done: Future[AttemptResult] = Future()
    pool.execute(pool.make_task(*args), done.set_result)
    return done.result(timeout=20)


def helpers_alive() -> tuple[int | None, int | None]:
    """The fork server's and the resource tracker's pids, each if it is alive."""
    tracker = resource_tracker._resource_tracker._pid
    pids = server.pid(), tracker
    return tuple(p if p is not None and _alive(p) else None for p in pids)  # type: ignore[return-value]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][:1] != "Z"


@pytest.mark.timeout(30)
def test_a_child_holds_only_its_channel_and_stdio(containment: str) -> None:
    with Pool(CALL, size=1, containment=containment) as pool:
        held = pool.submit("list_descriptors").result(timeout=20)
    beyond_stdio = {int(fd): what for fd, what in held.items() if int(fd) > 2}
    sockets = [what for what in beyond_stdio.values() if what.startswith("socket:")]
    assert len(sockets) == 1, held  # its channel to the parent, nothing else of ours
    others = {
        fd: what
        for fd, what in beyond_stdio.items()
        if not what.startswith("socket:")
        and what != "/dev/null"
        and not what.endswith("/pids.current")  # its own group's counter (cgroup modes)
        and not what.startswith("/memfd:sandboxq-stack")  # its own stack dumps (stacks.py)
        and what not in (held["1"], held["2"])  # its stdout and stderr pipes (output.py)
    }
    assert others == {}, f"the child holds descriptors that are not its own: {held}"


@pytest.mark.timeout(60)
def test_a_scribbler_reaches_nothing_but_its_own_attempt(containment: str, tmp_path: Path) -> None:
    """Garbage written to every descriptor a child holds lands in its own channel (its
    attempt is an error) and in /dev/null: the fork server, the resource tracker and the
    attempt running beside it in another child never see it."""
    log = tmp_path / "log"
    with Pool(CALL, size=2, containment=containment, hard_timeout_s=20) as pool:
        assert pool.submit("echo", 1).result(timeout=20) == 1  # the helpers are up
        before = helpers_alive()
        beside: Future[AttemptResult] = Future()
        pool.execute(pool.make_task("recorded_sleep", str(log), "beside", 1.5), beside.set_result)
        wait_for(log.exists, 20, "the attempt beside it to start")
        scribbled = run(pool, "scribble_descriptors")
        assert scribbled.outcome is Outcome.ERROR, scribbled.cause
        assert "could not be decoded" in scribbled.cause
        ok = beside.result(timeout=20)
        assert ok.outcome is Outcome.OK, ok.cause
        assert helpers_alive() == before
        assert pool.broken is None and pool.helper_restarts == 0
        assert pool.submit("echo", 2).result(timeout=20) == 2


@pytest.mark.timeout(60)
def test_a_descriptor_closer_is_an_error_naming_its_lost_channel(containment: str) -> None:
    """A handler that closes every descriptor above stderr and returns normally cannot send
    its outcome: its attempt is an error that says why (not "exit code 0"), and its child is
    replaced."""
    with Pool(CALL, size=1, containment=containment, hard_timeout_s=20) as pool:
        first = pool.pids
        closed = run(pool, "close_descriptors")
        assert closed.outcome is Outcome.ERROR, closed.cause
        assert "closed or broke the child's channel" in closed.cause
        assert closed.exitcode is None and closed.signal is None
        assert pool.submit("echo", 3).result(timeout=20) == 3
        assert not set(first) & set(pool.pids)
        with pytest.raises(AttemptFailed) as failed:  # the same through the public future
            pool.submit("close_descriptors").result(timeout=20)
        assert failed.value.outcome == "error"


@pytest.mark.timeout(90)
def test_a_parent_killer_is_named_and_the_pool_keeps_serving(containment: str) -> None:
    """A handler that SIGKILLs its parent (the fork server) more often than a pool tolerates
    deaths nobody caused: each attempt is interrupted with the death named and charged to
    it (``infra_death``), and the pool restarts its helpers and goes on."""
    with Pool(CALL, size=1, containment=containment, hard_timeout_s=20) as pool:
        assert pool.submit("echo", 0).result(timeout=20) == 0
        named = set()
        for _ in range(MAX_DEATHS + 1):
            killed = run(pool, "kill_parent")
            assert killed.outcome is Outcome.INTERRUPTED, killed.cause
            assert killed.infra_death is not None and killed.exitcode is None
            assert "fork server (pid " in killed.infra_death
            assert "killed by SIGKILL" in killed.infra_death
            named.add(killed.infra_death)
        assert len(named) == MAX_DEATHS + 1  # a fresh fork server each time
        assert pool.broken is None
        assert pool.submit("echo", 4).result(timeout=20) == 4  # from a fresh fork server
        assert pool.helper_restarts == MAX_DEATHS + 1


# -- through a worker, on Redis --------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_parent_killer_fails_as_poison_and_the_worker_keeps_serving(
    containment: str, redis_url: str, queue_name: str, workers: BackgroundWorkers
) -> None:
    queue = Queue(queue_name, url=redis_url)
    try:
        poison = queue.enqueue("kill_parent")
        plain = [queue.enqueue("echo", i) for i in range(6)]
        worker = workers.start(
            queue, CALL, containment=containment, concurrency=1, hard_timeout_s=20
        )
        with pytest.raises(JobFailed) as failed:
            poison.result(timeout_s=60)
        assert failed.value.outcome == "poison"
        assert "died 3 times" in str(failed.value) and "fork server" in str(failed.value)
        info = poison.info()
        assert info.state is JobState.FAILED and info.infra_deaths == 3
        outcomes = [h.outcome for h in info.history]
        assert outcomes == [Outcome.INTERRUPTED, Outcome.INTERRUPTED, Outcome.POISON]
        assert [j.result(timeout_s=30) for j in plain] == list(range(6))
        late = queue.enqueue("echo", "after")
        assert late.result(timeout_s=30) == "after"  # still serving
        assert not workers.not_running()
        # The worker knew its verdict: it read the count with its claim.
        assert worker.stats["failed"] == 1 and worker.stats["requeued"] == 2
    finally:
        queue.close()


@pytest.mark.timeout(120)
def test_a_job_running_beside_a_parent_killer_is_charged_once_at_most(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path
) -> None:
    """Two children: an ordinary 2 s job runs beside the parent-killer when it strikes
    first, and both are charged. From then on the suspect runs alone, so the ordinary job
    is never charged again: it completes, and only the parent-killer is poison."""
    queue = Queue(queue_name, url=redis_url)
    try:
        plain = queue.enqueue("recorded_sleep", str(tmp_path / "log"), "plain", 2.0)
        worker = workers.start(queue, CALL, concurrency=2, hard_timeout_s=20)
        wait_for(lambda: (tmp_path / "log").exists(), 30, "the ordinary job to start")
        poison = queue.enqueue("kill_parent")
        with pytest.raises(JobFailed) as failed:
            poison.result(timeout_s=60)
        assert failed.value.outcome == "poison"
        assert plain.result(timeout_s=60) == "plain"
        assert plain.info().infra_deaths <= 1
        # counted once the finish is acknowledged, which can be after the waiter woke
        wait_for(lambda: worker.stats["completed"] == 1, 10, "the job to be counted")
    finally:
        queue.close()


@pytest.mark.timeout(120)
def test_the_count_of_deaths_outlives_the_worker_that_saw_them(
    redis_url: str, queue_name: str, raw: redis.Redis, workers: BackgroundWorkers
) -> None:
    """The deaths a job caused are counted in Redis against its id: a worker started after
    the first one stopped carries on from its count."""
    queue = Queue(queue_name, url=redis_url)
    try:
        poison = queue.enqueue("kill_parent")
        key = f"sq:{{{queue_name}}}:job:{poison.id}"
        first = workers.start(queue, CALL, concurrency=1, hard_timeout_s=20)
        wait_for(lambda: int(raw.hget(key, "infra_deaths") or 0) >= 1, 30, "a first death")
        workers.stop(first, now=True)
        counted = int(raw.hget(key, "infra_deaths") or 0)
        assert 1 <= counted < 3
        second = workers.start(queue, CALL, concurrency=1, hard_timeout_s=20)
        with pytest.raises(JobFailed) as failed:
            poison.result(timeout_s=60)
        assert failed.value.outcome == "poison"
        info = poison.info()
        assert info.infra_deaths == 3
        # The first worker's attempts ended interrupted, or, when its stop-now passed its
        # 0.6 s bound while its pool restarted the fork server (a loaded machine), with
        # the job left to its lease: lease_lost, a death counted too. Deciding is the
        # second's alone.
        left = (Outcome.INTERRUPTED, Outcome.LEASE_LOST)
        by = {h.worker_id for h in info.history if h.outcome not in left}
        assert by == {second.id}
        assert info.history[-1].worker_id == second.id
        seen = {h.worker_id for h in info.history}
        assert first.id in seen and second.id in seen
    finally:
        queue.close()


@pytest.mark.timeout(60)
def test_a_worker_death_holding_a_job_is_counted_against_it(url: str, queue_name: str) -> None:
    """The reaper's recovery of an expired lease (its worker died holding the job) counts
    as a death, on both backends: at ``max_infra_deaths`` the job is poison."""
    queue = Queue(queue_name, url=url)
    try:
        job = queue.options(max_stalls=10).enqueue("x")
        backend = queue.backend
        for expected in (1, 2):
            assert [c.id for c in backend.claim("gone", 1, lease_s=0.05)] == [job.id]
            recovered = wait_for(
                lambda: backend.recover_stalled(max_infra_deaths=2), 10, "the lease to expire"
            )
            info = backend.get(job.id)
            assert info is not None and info.infra_deaths == expected
        assert recovered == [(job.id, "failed")]
        assert info.outcome is Outcome.POISON
        assert info.error is not None and "died 2 times" in info.error
        assert "worker holding its lease" in info.error
        assert [h.outcome for h in info.history][-1] is Outcome.POISON
        assert backend.retry_failed(job.id)
        again = backend.get(job.id)
        assert again is not None and again.infra_deaths == 0
    finally:
        queue.close()
