"""One lease, one attempt: the races of a worker's hand-overs, each forced by the test.

Every race here is forced with something the test controls: a handler waiting on a file
(``tests.support.gates``), a backend call held at a barrier (a wrapper on the real
backend instance that waits on an ``Event`` and then calls through), a stalled TCP proxy
in front of a real redis-server. Nothing sleeps to make a race happen.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from sandboxq import Queue
from sandboxq.backends.base import NewJob
from sandboxq.backends.memory import MemoryBackend
from sandboxq.errors import BackendError, SandboxqError
from sandboxq.models import JobState, Outcome
from sandboxq.pool.pool import Pool
from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from sandboxq.worker import SandboxWorker
from tests.support.proxy import TcpProxy

G = "tests.support.gates:"
H = "sandboxq.testing.handlers:"


def start(workers: BackgroundWorkers, queue: str, processor: str, **kw: Any) -> SandboxWorker:
    """A worker on a thread: one child, a lease no test outlives, on memory:// unless told."""
    options = {"concurrency": 1, "lease_s": 30.0, "url": "memory://", **kw}
    return workers.start(queue, processor, **options)


def starts(log: Path) -> list[tuple[int, int]]:
    """(pid, attempt) of every execution that began, from run_then_wait's log."""
    if not log.exists():
        return []
    return [
        (int(pid), int(attempt))
        for kind, pid, attempt, _ in (line.split() for line in log.read_text().splitlines())
        if kind == "start"
    ]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- attempt identity ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_an_old_attempts_outcome_never_lands_on_the_new_lease(
    tmp_path: Path, queue_name: str, workers: BackgroundWorkers
) -> None:
    """Cancel, then retry at once, while the worker has not yet handled the cancelled
    attempt's end: that end must not be applied to the lease of the job's next attempt."""
    backend = MemoryBackend.shared(queue_name)
    # The barrier: the worker's main thread blocks in its first progress call, so the
    # cancelled attempt's outcome waits in its queue while the cancel and retry go on.
    held, entered = threading.Event(), threading.Event()
    real_progress = backend.record_progress

    def progress_at_the_barrier(*args: Any) -> bool:
        entered.set()
        held.wait(30)
        return real_progress(*args)

    backend.record_progress = progress_at_the_barrier  # type: ignore[method-assign]
    log, gate = tmp_path / "log", tmp_path / "gate"
    worker = start(workers, queue_name, G + "run_then_wait")
    queue = Queue(queue_name)
    job = queue.enqueue(str(log), str(gate))
    assert entered.wait(20), "the first attempt never reported progress"
    assert job.cancel()
    assert queue.backend.retry_failed(job.id)
    # Either the job is claimed again and its second execution started (where the old
    # outcome could land on the new lease), or it waits behind the cancelled attempt's fence.
    wait_for(
        lambda: job.state() is JobState.DELAYED or len(starts(log)) == 2,
        20,
        "the retried job to be claimed again or fenced",
    )
    # The gate opens only once the cancel reached the child: opened before, the first
    # execution could finish on its own, a loaded machine's cancel watch still behind it.
    wait_for(lambda: worker.stats["cancelled"] == 1, 20, "the worker to end the cancelled attempt")
    gate.touch()
    held.set()
    assert job.result(timeout_s=20) == 1
    assert [a.outcome for a in job.info().history] == [Outcome.CANCELLED, Outcome.OK]
    # counted once the finish is acknowledged, which can be after the waiter woke
    wait_for(lambda: worker.stats["completed"] == 1, 10, "the second execution counted")
    assert worker.stats["cancelled"] == 1


@pytest.mark.timeout(60)
def test_a_cancel_that_comes_before_the_worker_learned_the_task_id_still_kills(
    tmp_path: Path, queue_name: str, workers: BackgroundWorkers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool starts an attempt as soon as it is submitted; the thread that submitted it
    may not run again for a while (a loaded machine). A cancel in that moment must kill the
    attempt, not an attempt of id 0: it was lost until the next renewal, 10 s later, which
    then ended it as a lost lease. Forced here: the submitting thread is held until the
    child runs and the cancel has gone out."""
    cancelled = threading.Event()
    real_execute = Pool.execute

    def execute_then_wait(self: Pool, *args: Any, **kwargs: Any) -> int:
        task_id = real_execute(self, *args, **kwargs)
        cancelled.wait(20)
        return task_id

    monkeypatch.setattr(Pool, "execute", execute_then_wait)
    log, gate = tmp_path / "log", tmp_path / "gate"
    worker = start(workers, queue_name, G + "run_then_wait")
    queue = Queue(queue_name)
    job = queue.enqueue(str(log), str(gate))
    wait_for(lambda: len(starts(log)) == 1, 20, "the child to start the job")
    assert job.cancel()
    cancelled.set()
    wait_for(lambda: worker.stats["cancelled"] == 1, 8, "the cancel to end the attempt")
    assert worker.stats["lease_lost"] == 0
    assert [a.outcome for a in job.info().history] == [Outcome.CANCELLED]


@pytest.mark.timeout(60)
def test_a_cancel_that_comes_before_the_attempt_is_submitted_ends_it_unstarted(
    tmp_path: Path, queue_name: str, workers: BackgroundWorkers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claimed job is held (a cancel can find its lease) a moment before its attempt
    goes to the pool. A cancel in that moment was sent for task 0 and lost: the attempt
    ran until its next renewal. Forced here: the thread that starts the job is held
    between the two until the cancel has been handled; the attempt must end cancelled
    without the child ever starting it."""
    from sandboxq.worker import dispatch

    reached, handled, release = threading.Event(), threading.Event(), threading.Event()
    real_task_for, real_on_cancel = dispatch.task_for, SandboxWorker._on_cancel

    def task_for_then_wait(*args: Any, **kwargs: Any) -> Any:
        reached.set()
        release.wait(20)
        return real_task_for(*args, **kwargs)

    def on_cancel(self: SandboxWorker, *args: Any) -> None:
        real_on_cancel(self, *args)
        handled.set()

    monkeypatch.setattr(dispatch, "task_for", task_for_then_wait)
    monkeypatch.setattr(SandboxWorker, "_on_cancel", on_cancel)
    log, gate = tmp_path / "log", tmp_path / "gate"
    worker = start(workers, queue_name, G + "run_then_wait")
    job = Queue(queue_name).enqueue(str(log), str(gate))
    wait_for(reached.is_set, 20, "the worker to hold the job before submitting it")
    assert job.cancel()
    wait_for(handled.is_set, 20, "the worker to handle the cancel")
    release.set()
    wait_for(lambda: worker.stats["cancelled"] == 1, 8, "the cancel to end the attempt")
    assert worker.stats["lease_lost"] == 0
    assert starts(log) == []  # the child never began it
    assert [a.outcome for a in job.info().history] == [Outcome.CANCELLED]


@pytest.mark.timeout(60)
def test_a_cancel_then_retry_never_runs_beside_the_cancelled_attempt(
    tmp_path: Path, queue_name: str, workers: BackgroundWorkers
) -> None:
    """The cancel message is lost (the owner only learns from its next renewal): the retry
    must not start the job again anywhere while the cancelled child still runs."""
    backend = MemoryBackend.shared(queue_name)
    log, gate = tmp_path / "log", tmp_path / "gate"
    worker = start(workers, queue_name, G + "run_then_wait", lease_s=1.5)
    queue = Queue(queue_name)
    job = queue.enqueue(str(log), str(gate))
    [(old_pid, _)] = wait_for(lambda: starts(log), 20, "the first execution")
    with backend._store.cond:
        backend._store.watchers.clear()  # the cancel message is lost
    assert job.cancel() and queue.backend.retry_failed(job.id)
    # Whenever the job is claimed again, the cancelled child must already be dead.
    wait_for(lambda: job.state() is JobState.ACTIVE, 20, "the job to be claimed again")
    assert not alive(old_pid), "the retried job was claimed while the cancelled child ran"
    gate.touch()
    assert job.result(timeout_s=20) == 1
    assert worker.stats["cancelled"] + worker.stats["lease_lost"] == 1


# -- a worker that never hangs and never sits on jobs ------------------------------------------


@pytest.mark.timeout(60)
def test_a_pool_that_breaks_while_idle_stops_the_worker_and_hands_jobs_back(
    queue_name: str, workers: BackgroundWorkers
) -> None:
    backend = MemoryBackend.shared(queue_name)
    worker = start(workers, queue_name, H + "echo", lease_s=3.0)
    wait_for(lambda: worker._pool is not None, 20, "the pool")
    assert worker._pool is not None
    wait_for(backend.workers, 20, "the worker to register")
    worker._pool._supervisor._break("children exit before they are ready (forced)")
    job = Queue(queue_name).enqueue(1)
    assert workers.join(worker, 10), "run() did not return after the pool broke"
    error = workers.error(worker)
    assert isinstance(error, SandboxqError) and "pool" in str(error)
    assert "\n" not in str(error)
    info = job.info()
    assert (info.state, info.attempts) == (JobState.WAITING, 0)  # handed back, not charged
    assert backend.workers() == []  # deregistered


@pytest.mark.timeout(60)
def test_a_dead_heartbeat_stops_the_worker_and_requeues_its_job(
    tmp_path: Path, queue_name: str, workers: BackgroundWorkers
) -> None:
    backend = MemoryBackend.shared(queue_name)

    def renew_breaks(*args: Any) -> list[str]:
        raise RuntimeError("a bug in the renewal")

    backend.renew = renew_breaks  # type: ignore[method-assign]
    log, gate = tmp_path / "log", tmp_path / "gate"
    worker = start(workers, queue_name, G + "run_then_wait", lease_s=6.0)
    job = Queue(queue_name).enqueue(str(log), str(gate))
    assert workers.join(worker, 15), "run() did not return after its heartbeat thread died"
    error = workers.error(worker)
    assert isinstance(error, SandboxqError) and "heartbeat" in str(error)
    info = job.info()
    assert (info.state, info.attempts) == (JobState.WAITING, 0)
    [(pid, _)] = starts(log)
    assert not alive(pid)


@pytest.mark.timeout(60)
def test_burst_mode_survives_a_backend_error_in_the_empty_check(
    queue_name: str, workers: BackgroundWorkers
) -> None:
    backend = MemoryBackend.shared(queue_name)
    real_counts = backend.counts
    failures = [BackendError("the connection dropped")]

    def counts_once_broken() -> dict[JobState, int]:
        if failures:
            raise failures.pop()
        return real_counts()

    backend.counts = counts_once_broken  # type: ignore[method-assign]
    job = Queue(queue_name).enqueue(5)
    worker = start(workers, queue_name, H + "echo", burst=True)
    assert workers.join(worker, 20), "run(burst=True) never returned"
    assert workers.error(worker) is None and not failures
    assert job.result(timeout_s=1) == 5


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[TcpProxy]:
    with TcpProxy("127.0.0.1", redis_server.port) as p:
        yield p


def _in_a_redis_call(thread_name: str) -> bool:
    """Whether the thread named so waits inside redis-py (its socket read)."""
    frames = sys._current_frames()
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1) if thread.name == thread_name else None
        while frame is not None:
            if "/redis/" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
    return False


@pytest.mark.alone  # a bound of 1 s on the stop
@pytest.mark.timeout(60)
@pytest.mark.parametrize("second_signal", [False, True])
def test_stop_returns_in_time_while_redis_hangs(
    tmp_path: Path,
    proxy: TcpProxy,
    queue_name: str,
    workers: BackgroundWorkers,
    second_signal: bool,
) -> None:
    stop_timeout_s = 1.0
    worker = start(
        workers,
        queue_name,
        G + "run_then_wait",
        url=proxy.url,
        lease_s=1.5,  # a renewal and a registry refresh every 0.5 s
        stop_timeout_s=stop_timeout_s,
    )
    log, gate = tmp_path / "log", tmp_path / "gate"
    Queue(queue_name, url=proxy.url).enqueue(str(log), str(gate))
    wait_for(lambda: starts(log), 20, "the job to start")
    proxy.stall()
    try:
        # Each of these threads waits inside a Redis call when the stop comes: none of
        # their joins may add to the bound.
        for name in ("sandboxq-heartbeat", "sandboxq-registry"):
            wait_for(lambda name=name: _in_a_redis_call(name), 10, f"{name} to wait on Redis")
        began = time.monotonic()
        worker.stop()
        if second_signal:
            worker.stop(now=True)
        # stop_timeout_s + 1 s is the promise (1 s after a second signal)
        limit = 1.0 if second_signal else stop_timeout_s + 1.0
        if not workers.join(worker, limit + 1.5):  # say where it hangs
            faulthandler.dump_traceback(sys.stderr)
        assert workers.join(worker, 0), "run() still running with Redis hung"
        took = time.monotonic() - began
    finally:
        proxy.resume()
    assert took < limit, f"run() returned {took:.3f} s after the stop, over {limit} s"
    [(pid, _)] = starts(log)
    assert not alive(pid)
    # A claim left behind in the hung connection ends once Redis answers again.
    dispatcher = worker._dispatcher
    assert dispatcher is not None and dispatcher.fetcher is not None
    wait_for(lambda: not dispatcher.fetcher.is_alive(), 15, "the fetcher to end")  # type: ignore[union-attr]


@pytest.mark.timeout(60)
def test_jobs_claimed_by_a_finish_whose_reply_was_lost_run_at_once(
    queue_name: str, workers: BackgroundWorkers
) -> None:
    """The finish-and-claim call runs, but its reply never arrives: the job it claimed
    must not sit leased to nobody for a whole lease."""
    backend = MemoryBackend.shared(queue_name)
    real_finish = backend.finish_many
    lost: list[str] = []

    def reply_lost(*args: Any, **kwargs: Any) -> Any:
        accepted, claimed = real_finish(*args, **kwargs)
        if claimed and not lost:
            lost.extend(job.id for job in claimed)
            raise BackendError("connection reset before the reply arrived")
        return accepted, claimed

    backend.finish_many = reply_lost  # type: ignore[method-assign]
    queue = Queue(queue_name)
    first, second = queue.enqueue(1), queue.enqueue(2)
    worker = start(workers, queue_name, H + "echo", prefetch=0, lease_s=30.0)
    assert first.result(timeout_s=20) == 1
    assert second.result(timeout_s=10) == 2  # long before its 30 s lease could run out
    assert lost == [second.id]
    assert second.info().stalls == 0 and len(second.info().history) == 1
    assert len(first.info().history) == 1
    # the second (the first ack's answer was lost), counted once its finish is acknowledged
    wait_for(lambda: worker.stats["completed"] == 1, 10, "the second to be counted")


@pytest.mark.timeout(60)
def test_a_finish_refills_a_slot_whose_claimer_is_still_starting_its_jobs(
    queue_name: str, workers: BackgroundWorkers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fetcher has started its job but not yet released its claim's reservation when
    that job ends and the main thread's finish reserves: the slot is held, not reserved
    too, so the finish claims the next job (it once counted the slot twice and claimed
    nothing). The hook holds the fetcher right after it started the first job, until the
    finish has reserved."""
    from sandboxq.pool.pool import Pool
    from sandboxq.worker.inflight import InFlight

    finish_reserved = threading.Event()
    real_reserve, real_execute = InFlight.reserve, Pool.execute

    def reserve(self: InFlight, finishing: int = 0) -> int:
        free = real_reserve(self, finishing)
        if finishing:
            finish_reserved.set()
        return free

    def execute(self: Pool, task: Any, on_done: Any, **kwargs: Any) -> int:
        task_id = real_execute(self, task, on_done, **kwargs)
        if threading.current_thread().name.endswith("fetcher") and task.job_id == first.id:
            finish_reserved.wait(10)  # the fetcher, between its start and its unreserve
        return task_id

    monkeypatch.setattr(InFlight, "reserve", reserve)
    monkeypatch.setattr(Pool, "execute", execute)
    backend = MemoryBackend.shared(queue_name)
    real_finish = backend.finish_many
    refilled: list[str] = []

    def finish_many(*args: Any, **kwargs: Any) -> Any:
        accepted, claimed = real_finish(*args, **kwargs)
        refilled.extend(job.id for job in claimed)
        return accepted, claimed

    backend.finish_many = finish_many  # type: ignore[method-assign]
    queue = Queue(queue_name)
    first, second = queue.enqueue(1), queue.enqueue(2)
    start(workers, queue_name, H + "echo", prefetch=0)
    assert first.result(timeout_s=20) == 1 and second.result(timeout_s=20) == 2
    assert finish_reserved.is_set()
    assert refilled == [second.id]


def test_two_leases_of_one_job_are_held_apart(queue_name: str) -> None:
    """A worker may hold a job again while its earlier attempt is still being killed (its
    own stall recovery after a freeze): each lease keeps its own entry, the heartbeat
    renews each on its own, and the rejected old one condemns only itself."""
    from sandboxq.worker.heartbeat import Heartbeat
    from sandboxq.worker.heartbeat import Lease as HeldLease
    from sandboxq.worker.inflight import Held, InFlight

    backend = MemoryBackend(queue_name)
    backend.enqueue([NewJob(b"[[], {}]", job_id="j")])
    [old] = backend.claim("w1", 1, 0.001)
    wait_for(lambda: backend.recover_stalled(), 5, "the old lease to be recovered")
    [new] = backend.claim("w1", 1, 30.0)
    inflight = InFlight(2, 0, threading.Event())
    for claimed in (old, new):
        lease = HeldLease(claimed.id, claimed.token, 0, time.monotonic())
        inflight.add(Held(claimed, lease))
    held_old, held_new = inflight.get(old.token), inflight.get(new.token)
    assert held_old is not None and held_new is not None and held_old is not held_new
    lost: list[str] = []
    heartbeat = Heartbeat(
        backend,
        "w1",
        30.0,
        10.0,
        inflight.leases,
        lambda *_: None,
        lambda x, _: lost.append(x.lease_token),
    )
    assert heartbeat.renew_now()
    assert lost == [old.token]  # the new lease was renewed, not condemned with the old
    inflight.discard([old.token])
    assert inflight.get(new.token) is held_new and len(inflight) == 1
