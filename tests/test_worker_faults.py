"""Invariants under real faults: worker processes SIGKILLed and SIGSTOPped, Redis stopped
and restarted, every core saturated by GIL-holding children. Real redis-server, real
processes; nothing mocked."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from sandboxq import Job, JobFailed, Queue
from sandboxq.models import JobState, Outcome
from sandboxq.pool.kill import ended
from sandboxq.testing.processes import frozen_order
from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from sandboxq.worker import SandboxWorker

H = "sandboxq.testing.handlers:"


def executions(log_file: Path) -> dict[str, list[tuple[str, int, float]]]:
    runs: dict[str, list[tuple[str, int, float]]] = {}
    for line in log_file.read_text().splitlines() if log_file.exists() else []:
        kind, pid, key, at = line.split()
        runs.setdefault(key, []).append((kind, int(pid), float(at)))
    return runs


def assert_never_concurrent(log_file: Path) -> None:
    """No two children ever ran the same job at the same time (design invariant 1)."""
    for key, events in executions(log_file).items():
        open_runs: set[int] = set()
        for kind, pid, _at in sorted(events, key=lambda e: e[2]):
            if kind == "start":
                assert not open_runs or all(not psutil.pid_exists(p) for p in open_runs), (
                    f"job {key} started in {pid} while {open_runs} still ran it"
                )
                open_runs = {pid}
            else:
                open_runs.discard(pid)


def worker_a(
    workers: BackgroundWorkers, url: str, queue: str, lease: float, log: Path
) -> subprocess.Popen[bytes]:
    """The worker a fault hits: a ``sandboxq worker`` process of one child."""
    args = ("--lease-s", str(lease), "--concurrency", "1")
    return workers.spawn(queue, H + "recorded_sleep", *args, url=url, log=log)


def worker_b(
    workers: BackgroundWorkers, url: str, queue: str, lease: float, stall_check_s: float
) -> SandboxWorker:
    """The worker that takes A's job over: one child, on a thread, checking for stalled
    jobs every ``stall_check_s``."""
    return workers.start(
        queue,
        H + "recorded_sleep",
        url=url,
        concurrency=1,
        lease_s=lease,
        stall_check_s=stall_check_s,
    )


@pytest.fixture
def url(redis_url: str) -> str:
    """Faults of real processes and a real network: the suite's ``queue`` is on Redis alone."""
    return redis_url


@pytest.mark.timeout(60)
def test_sigkill_of_a_worker_parent_recovers_its_job(
    redis_url: str, queue: Queue, queue_name: str, tmp_path: Path, workers: BackgroundWorkers
) -> None:
    """Design invariants 3 and 4: the dead worker's children die with it, and its job completes on
    another worker about one lease after the kill."""
    runs = tmp_path / "runs"
    lease = 1.5
    a = worker_a(workers, redis_url, queue_name, lease, tmp_path / "a.log")
    job = queue.enqueue(str(runs), "job", 1.0)
    wait_for(lambda: "job" in executions(runs), 20, "worker A to start the job")
    children = [p.pid for p in psutil.Process(a.pid).children(recursive=True)]
    a.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    a.wait()
    wait_for(
        lambda: (
            not any(
                psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in children
            )
        ),
        5,
        "worker A's children to die",
    )
    b = worker_b(workers, redis_url, queue_name, lease, stall_check_s=0.25)
    assert job.result(timeout_s=20) == "job"
    recovered_after = time.monotonic() - killed_at
    workers.stop(b)
    info = job.info()
    assert info.stalls == 1 and info.state is JobState.COMPLETED
    # The stalled attempt is on record too: the answer to "what happened to my job".
    assert [h.outcome for h in info.history] == [Outcome.LEASE_LOST, Outcome.OK]
    assert recovered_after < lease + 0.25 + 1.0 + 1.0  # lease + check interval + the job itself
    assert_never_concurrent(runs)


@pytest.mark.timeout(60)
def test_a_worker_stopped_past_its_lease_is_fenced_when_it_resumes(
    redis_url: str, queue: Queue, queue_name: str, tmp_path: Path, workers: BackgroundWorkers
) -> None:
    """Design invariants 1 and 2: worker A is frozen (parent and children) past its lease; B
    recovers and completes the job. When A resumes, its child is killed and it does not
    ack: the job completes exactly once, by B."""
    runs = tmp_path / "runs"
    lease = 1.0
    a = worker_a(workers, redis_url, queue_name, lease, tmp_path / "a.log")
    job = queue.enqueue(str(runs), "job", 3.0)
    wait_for(lambda: "job" in executions(runs), 20, "worker A to start the job")
    family = frozen_order(a.pid)
    a_child = executions(runs)["job"][0][1]
    for pid in family:
        os.kill(pid, signal.SIGSTOP)
    try:
        b = worker_b(workers, redis_url, queue_name, lease, stall_check_s=0.2)
        wait_for(lambda: len(executions(runs)["job"]) >= 2, 20, "worker B to start the job")
    finally:
        # A wakes up (parent first) while B still runs the job. Woken, A kills its fenced
        # child's tree at once: a process of the list may be gone before its SIGCONT.
        for pid in [a.pid, *(p for p in family if p != a.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    wait_for(
        lambda: ended(a_child),  # gone or a zombie: one read, no window between two
        5,
        "A's child to be killed",
    )
    assert job.result(timeout_s=20) == "job"
    a.kill()
    a.wait(10)
    workers.stop(b)
    info = job.info()
    assert info.state is JobState.COMPLETED and info.stalls == 1
    # The stall is recorded by the recovery; A never acked.
    assert [h.outcome for h in info.history] == [Outcome.LEASE_LOST, Outcome.OK]
    assert all(h.worker_id != b.id for h in info.history[:1])
    ends = [e for e in executions(runs)["job"] if e[0] == "end"]
    assert len(ends) == 1 and ends[0][1] != a_child  # only B's execution finished
    assert_never_concurrent(runs)


@pytest.mark.timeout(90)
def test_redis_down_longer_than_a_lease_then_back(queue_name: str, tmp_path: Path) -> None:
    """Design invariants 2 and 3: the worker fences its running jobs, survives, reconnects, and
    every job ends completed (or failed with a cause); nothing is lost."""
    runs = tmp_path / "runs"
    with (
        RedisServer(appendonly=True) as server,
        Queue(queue_name, url=server.url) as q,
        BackgroundWorkers() as workers,  # the worker is killed before Redis stops for good
    ):
        jobs = [q.enqueue(str(runs), f"j{i}", 0.3) for i in range(12)]
        worker = workers.spawn(
            queue_name,
            H + "recorded_sleep",
            *("--lease-s", "1.0", "--concurrency", "2", "--retries", "3"),
            url=server.url,
            log=tmp_path / "w.log",
        )
        wait_for(lambda: len(executions(runs)) >= 2, 20, "jobs to start")
        server.stop()
        time.sleep(2.5)  # the subject: Redis stays down for longer than the lease
        assert worker.poll() is None, "the worker died while Redis was down"
        server.start()
        for job in jobs:
            job.result(timeout_s=40)
        assert worker.poll() is None
    assert set(executions(runs)) == {f"j{i}" for i in range(12)}
    assert_never_concurrent(runs)


@pytest.mark.alone  # holds every core
@pytest.mark.timeout(60)
def test_leases_are_renewed_while_every_core_is_held_by_gil_holding_children(
    redis_url: str, queue: Queue, queue_name: str, workers: BackgroundWorkers
) -> None:
    """Design invariant 5: jobs 5x longer than the lease, in children that hold the GIL inside C
    calls on every core, run once and complete once; no lease lapses."""
    lease = 1.0
    cores = os.cpu_count() or 2
    worker = workers.start(
        queue_name,
        H + "spin_gil_for",
        url=redis_url,
        concurrency=cores,
        lease_s=lease,
        stall_check_s=0.2,
        prefetch=0,
    )
    jobs = [queue.enqueue(5 * lease) for _ in range(cores)]
    for job in jobs:
        assert job.result(timeout_s=40) is True
    workers.stop(worker)
    for job in jobs:
        info = job.info()
        assert info.attempts == 1 and info.stalls == 0
        assert [h.outcome for h in info.history] == [Outcome.OK]
    assert worker.stats["lease_lost"] == 0 and worker.stats["rejected_acks"] == 0
    assert worker.heartbeat.max_gap_s < lease - 0.1, worker.heartbeat.max_gap_s


@pytest.mark.timeout(60)
def test_corrupt_records_fail_that_job_with_a_cause_and_the_worker_goes_on(
    redis_url: str, queue: Queue, queue_name: str, workers: BackgroundWorkers
) -> None:
    """Design invariant 7: records corrupted by hand in Redis fail their own job, with a stated
    cause; the worker keeps serving everything else."""
    import redis

    r = redis.Redis.from_url(redis_url)
    key = f"sq:{{{queue_name}}}:job:"
    bad_payload, bad_options, bad_type = (queue.enqueue(i) for i in range(3))
    r.hset(key + bad_payload.id, "payload", b"\xff{not json")
    r.hset(key + bad_options.id, "opts", b'{"hard_timeout_s": "soon"}')
    r.delete(key + bad_type.id)
    r.set(key + bad_type.id, b"a string where a hash belongs")
    good = queue.enqueue("still fine")
    worker = workers.start(queue_name, H + "echo", url=redis_url, concurrency=2, lease_s=5)
    assert good.result(timeout_s=20) == "still fine"
    causes = {}
    for job in (bad_payload, bad_options):
        with pytest.raises(JobFailed) as info:
            job.result(timeout_s=20)
        causes[job.id] = str(info.value)
    wait_for(
        lambda: r.zscore(f"sq:{{{queue_name}}}:failed", bad_type.id) is not None,
        20,
        "the record of the wrong type to be failed",
    )
    # The worker is still serving.
    assert queue.enqueue("after").result(timeout_s=20) == "after"
    workers.stop(worker)  # raises if it would not stop, or its run() had raised
    assert "arguments cannot be decoded" in causes[bad_payload.id]
    assert "malformed job record: the opts field does not validate" in causes[bad_options.id]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
def test_sigterm_or_sighup_drains_and_a_second_signal_stops_now(
    redis_url: str,
    queue: Queue,
    queue_name: str,
    tmp_path: Path,
    workers: BackgroundWorkers,
    sig: signal.Signals,
) -> None:
    """Design invariant 9 through a real process and real signals: SIGTERM lets a running job
    finish and exits 0; on a long job, a second SIGTERM requeues it uncharged at once.
    SIGHUP the same, sent as a closed terminal sends it: to the worker's whole process
    group, its fork server and resource tracker too (it ended the worker at once)."""
    runs = tmp_path / "runs"

    def send(proc: subprocess.Popen[bytes]) -> None:
        if sig is signal.SIGHUP:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)

    def running(key: str, seconds: float) -> tuple[subprocess.Popen[bytes], Path, Job]:
        """A new worker process (and its log), once it runs job ``key``, ``seconds`` long."""
        log = tmp_path / f"{key}.log"
        proc = workers.spawn(
            queue_name,
            H + "recorded_sleep",
            *("--concurrency", "1", "--lease-s", "5", "--stop-timeout-s", "30"),
            url=redis_url,
            log=log,
            new_session=True,  # it leads its process group, as when started from a shell
        )
        job = queue.enqueue(str(runs), key, seconds)
        wait_for(lambda: key in executions(runs), 20, f"the {key} job to start")
        return proc, log, job

    w, _, short = running("short", 1.0)
    send(w)
    assert w.wait(20) == 0
    assert short.state() is JobState.COMPLETED
    w, log, long = running("long", 60.0)
    send(w)
    wait_for(lambda: f"received {sig.name}: draining" in log.read_text(), 10, "the drain")
    time.sleep(0.5)  # the subject: a while into the drain, the worker must still be up
    assert w.poll() is None  # still draining: the job may take its 30 s
    t0 = time.monotonic()
    send(w)
    assert w.wait(10) == 0
    assert time.monotonic() - t0 < 5
    info = long.info()
    assert info.state is JobState.WAITING and info.attempts == 0  # requeued, not charged


@pytest.mark.timeout(30)
def test_workers_register_with_their_current_jobs(
    redis_url: str, queue: Queue, queue_name: str, workers: BackgroundWorkers
) -> None:
    worker = workers.start(
        queue_name, H + "sleep_forever", url=redis_url, concurrency=1, lease_s=1.5
    )
    job = queue.enqueue()
    wait_for(
        lambda: any(w["jobs"] for w in queue.backend.workers()),
        10,
        "the worker to show its job",
    )
    (info,) = queue.backend.workers()
    assert info["worker_id"] == worker.id and info["pid"] == os.getpid()
    (current,) = info["jobs"]
    assert current["id"] == job.id and psutil.pid_exists(current["pid"])
    workers.stop(worker, now=True)
    assert queue.backend.workers() == []
