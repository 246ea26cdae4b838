"""SandboxWorker and the producer API, end to end on both backends (real redis-server)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from sandboxq import ConfigError, JobFailed, ProcessorError, Queue, SerializationError
from sandboxq.models import JobState, Outcome
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers, StartWorker, child_pid
from sandboxq.worker import SandboxWorker, fetcher

H = "sandboxq.testing.handlers:"


@pytest.fixture
def start_worker(workers: BackgroundWorkers, url: str, queue_name: str) -> StartWorker:
    """Start a worker of ``H + processor`` for the test's queue, on a thread."""

    def start(processor: str, **kwargs: Any) -> SandboxWorker:
        return workers.start(queue_name, H + processor, url=url, **{"lease_s": 5.0, **kwargs})

    return start


@pytest.mark.timeout(30)
def test_results_and_attempt_history(queue: Queue, start_worker: StartWorker) -> None:
    start_worker("echo")
    jobs = [queue.enqueue(i, tag="x") for i in range(20)]
    assert [j.result(timeout_s=15) for j in jobs] == [[[i], {"tag": "x"}] for i in range(20)]
    info = jobs[0].info()
    assert info.state is JobState.COMPLETED and info.attempts == 1
    (attempt,) = info.history
    assert attempt.outcome is Outcome.OK and attempt.pid and attempt.worker_id
    assert attempt.started_ms and attempt.ended_ms and attempt.ended_ms >= attempt.started_ms
    assert queue.counts()[JobState.COMPLETED] == 20


@pytest.mark.timeout(30)
def test_hard_timeout_retries_then_fails_with_the_cause(
    queue: Queue, start_worker: StartWorker
) -> None:
    start_worker("sleep_forever", hard_timeout_s=0.3)
    job = queue.options(retries=2, backoff_s=0.05).enqueue()
    with pytest.raises(JobFailed) as info:
        job.result(timeout_s=20)
    assert info.value.outcome == "hard_timeout"
    assert info.value.attempts == 3
    history = job.info().history
    assert [a.outcome for a in history] == [Outcome.HARD_TIMEOUT] * 3
    assert [a.action for a in history][-1] == "fail"
    assert all(a.signal == 9 for a in history)


@pytest.mark.timeout(30)
def test_exit_code_map_and_soft_timeout(queue: Queue, start_worker: StartWorker) -> None:
    start_worker("sys_exit", exit_codes={10: "complete", 11: "fail"})
    assert queue.enqueue(10).result(timeout_s=10) is None
    with pytest.raises(JobFailed) as info:
        queue.options(retries=3).enqueue(11).result(timeout_s=10)
    assert info.value.outcome == "exit" and info.value.attempts == 1
    with pytest.raises(JobFailed, match="exited with code 12"):
        queue.enqueue(12).result(timeout_s=10)


@pytest.mark.timeout(30)
def test_per_job_options_override_worker_defaults(queue: Queue, start_worker: StartWorker) -> None:
    start_worker("succeed_after", hard_timeout_s=10)
    assert queue.enqueue(0.2, "ok").result(timeout_s=10) == "ok"
    job = queue.options(soft_timeout_s=0.2, hard_timeout_s=1.0).enqueue(5, "late")
    with pytest.raises(JobFailed) as info:
        job.result(timeout_s=10)
    assert info.value.outcome == "soft_timeout"


@pytest.mark.timeout(30)
def test_progress_events_and_priorities(queue: Queue, start_worker: StartWorker) -> None:
    low = queue.options(priority=-5).enqueue(2)
    high = queue.options(priority=5).enqueue(2)
    start_worker("progress_steps", concurrency=1, prefetch=0)
    assert low.result(timeout_s=10) == 2 and high.result(timeout_s=10) == 2
    assert high.info().history[0].started_ms <= low.info().history[0].started_ms  # type: ignore[operator]
    kinds = [(e.kind, e.job_id) for e in queue.events()]
    assert ("progress", high.id) in kinds
    assert kinds.index(("completed", high.id)) < kinds.index(("completed", low.id))


@pytest.mark.timeout(30)
def test_cancel_kills_the_running_child(queue: Queue, start_worker: StartWorker) -> None:
    worker = start_worker("sleep_forever", concurrency=1)
    job = queue.options(retries=5).enqueue()
    wait_for(lambda: child_pid(queue, job.id), 10, "the job's child")
    t0 = time.monotonic()
    assert job.cancel()
    wait_for(lambda: worker.stats["cancelled"], 5, "the child to be killed")
    assert worker.stats["cancelled"] == 1
    assert time.monotonic() - t0 < 1.0
    assert job.state() is JobState.CANCELLED
    with pytest.raises(JobFailed):
        job.result(timeout_s=1)
    assert queue.enqueue().cancel()  # a waiting job, taken by the worker or not
    assert not job.cancel()  # already finished


@pytest.mark.timeout(60)
def test_a_cancelled_attempt_starts_when_its_child_took_it_not_at_its_claim(
    queue: Queue, start_worker: StartWorker, tmp_path: Path
) -> None:
    """A job claimed ahead (``prefetch``) waits in its worker for a child. Cancelled once
    it ran, its attempt's start was its claim: ``sandboxq run`` wrote ``ran_s`` 2.7 for a
    line that had run 1.2 s, the rest spent waiting behind another job."""
    log = str(tmp_path / "log")
    start_worker("recorded_sleep", concurrency=1, prefetch=1)
    first = queue.enqueue(log, "first", 1.5)
    second = queue.enqueue(log, "second", 3600)  # claimed with the first, run after it
    assert first.result(timeout_s=30) == "first"
    wait_for(lambda: child_pid(queue, second.id), 20, "the second job's child published")
    assert second.cancel()
    [attempt] = second.info().history
    ended = first.info().history[-1].ended_ms
    assert attempt.started_ms is not None and ended is not None
    # the clocks: both the worker's; its child took the second job once the first ended
    assert attempt.started_ms >= ended - 50, (attempt.started_ms, ended)


@pytest.mark.timeout(30)
def test_unique_job_ids_and_delay(queue: Queue, start_worker: StartWorker) -> None:
    a = queue.options(job_id="same").enqueue(1)
    b = queue.options(job_id="same").enqueue(2)
    assert a.id == b.id == "same"
    assert (a.created, b.created, queue.job("same").created) == (True, False, None)
    many = queue.enqueue_many([((4,), {})])
    assert many[0].created is True
    delayed = queue.options(delay_s=0.5).enqueue(3)
    assert delayed.state() is JobState.DELAYED
    t0 = time.monotonic()
    start_worker("echo")
    assert a.result(timeout_s=10) == 1
    assert delayed.result(timeout_s=10) == 3
    assert time.monotonic() - t0 >= 0.4


@pytest.mark.timeout(30)
def test_burst_returns_when_the_queue_is_empty(
    url: str, queue: Queue, queue_name: str, workers: BackgroundWorkers
) -> None:
    jobs = queue.enqueue_many([((i,), {}) for i in range(50)])
    worker = workers.burst(queue_name, H + "echo", url=url, concurrency=2, lease_s=5)
    assert worker.stats["completed"] == 50
    assert [j.result(timeout_s=1) for j in jobs] == list(range(50))


@pytest.mark.timeout(60)
def test_burst_ends_when_its_last_job_does_not_a_claim_wait_later(
    url: str,
    queue: Queue,
    queue_name: str,
    workers: BackgroundWorkers,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A claim wait long enough that waiting one out cannot pass for not waiting.
    monkeypatch.setattr(fetcher, "IDLE_WAIT_S", 10.0)
    # Jobs of a second: the fetcher, holding them all, finds the queue empty while they run.
    jobs = queue.enqueue_many([((1.0, i), {}) for i in range(3)])
    began = time.monotonic()
    worker = workers.burst(queue_name, H + "succeed_after", url=url, concurrency=2, lease_s=30)
    assert time.monotonic() - began < 8.0  # 2 s of jobs, not 10 s more of a claim's wait
    assert worker.stats["completed"] == 3
    assert [j.result(timeout_s=1) for j in jobs] == [0, 1, 2]


@pytest.mark.timeout(60)
def test_stop_of_an_idle_worker_ends_its_claim_wait_at_once(
    url: str,
    queue: Queue,
    queue_name: str,
    workers: BackgroundWorkers,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A claim wait of 30 s: a stop that waited it out could not pass for one that ended it.
    monkeypatch.setattr(fetcher, "IDLE_WAIT_S", 30.0)
    worker = workers.start(queue_name, H + "echo", url=url, concurrency=1, lease_s=5)
    assert queue.enqueue(1).result(timeout_s=10) == 1  # the fetcher then waits for more
    for now in (True, False):
        began = time.monotonic()
        worker.stop(now=now)
        assert workers.join(worker, 10.0), f"stop(now={now}) waited out the claim's wait"
        assert time.monotonic() - began < 5.0
        assert queue.enqueue(2).state() is JobState.WAITING  # nothing claims after a stop
        worker = workers.start(queue_name, H + "echo", url=url, concurrency=1, lease_s=5)
        assert queue.enqueue(3).result(timeout_s=10) == 3


@pytest.mark.timeout(30)
def test_pickle_payloads_need_an_explicit_opt_in(
    url: str, queue_name: str, workers: BackgroundWorkers
) -> None:
    producer = Queue(queue_name, url=url, codec="pickle")
    job = producer.enqueue({1, 2})  # a set: JSON cannot carry it
    workers.burst(queue_name, H + "echo", url=url, concurrency=1, lease_s=5)
    with pytest.raises(JobFailed, match="allow_pickle"):
        job.result(timeout_s=5)
    again = producer.enqueue({3})
    workers.burst(queue_name, H + "echo", url=url, concurrency=1, lease_s=5, allow_pickle=True)
    assert again.result(timeout_s=5) == {3}
    producer.close()


def test_bad_input_fails_early_with_a_clear_error(url: str, queue: Queue, queue_name: str) -> None:
    with pytest.raises(SerializationError, match="cannot be encoded as json"):
        queue.enqueue({1, 2})
    with pytest.raises(ConfigError, match="soft_timeout_s"):
        queue.options(soft_timeout_s=5, hard_timeout_s=1)
    with pytest.raises(ConfigError, match="unknown_option"):
        queue.options(unknown_option=1)
    with pytest.raises(ProcessorError, match="No module named"):
        SandboxWorker(queue_name, "nope.nope:fn", url=url)
    with pytest.raises(ConfigError, match="queue name"):
        Queue("bad{name}", url=url)


@pytest.mark.timeout(30)
def test_graceful_stop_requeues_interrupted_jobs_without_charge(
    queue: Queue, start_worker: StartWorker, workers: BackgroundWorkers
) -> None:
    worker = start_worker("sleep_forever", concurrency=1, stop_timeout_s=0.3)
    job = queue.enqueue()

    def running_in_a_child() -> bool:
        # claimed (ACTIVE) is not enough: a job stopped before its child started it is
        # handed back unstarted, not interrupted; the worker publishes the child's pid once
        # the attempt started
        running = job.info().running
        return running is not None and running.pid is not None

    wait_for(running_in_a_child, 10, "the job's child to start it")
    worker.stop()
    assert workers.join(worker, 10)
    info = job.info()
    assert info.state is JobState.WAITING
    assert info.attempts == 0  # the interrupted attempt was not charged
    assert worker.stats["requeued"] == 1


@pytest.mark.timeout(30)
def test_a_job_claimed_after_a_long_idle_wait_gets_its_whole_lease(
    queue: Queue, start_worker: StartWorker
) -> None:
    """The fence counts from the claim that took the job, not from the start of the idle
    wait before it: a wait longer than the lease must not fence the job on arrival."""
    worker = start_worker("succeed_after", lease_s=0.6)
    # The subject, not a settling wait: the worker idles, its fetcher blocked in claims,
    # for longer than the lease before the job arrives.
    time.sleep(1.5)
    job = queue.enqueue(0.3, "done")
    assert job.result(timeout_s=10) == "done"
    assert [h.outcome for h in job.info().history] == [Outcome.OK]
    assert worker.stats["lease_lost"] == 0


@pytest.mark.timeout(30)
def test_an_unreachable_backend_fails_run_at_once(queue_name: str) -> None:
    from sandboxq.errors import BackendError
    from sandboxq.testing.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    worker = SandboxWorker(queue_name, H + "echo", url=url, concurrency=1)
    started = time.monotonic()
    with pytest.raises(BackendError, match="unreachable"):
        worker.run()
    assert time.monotonic() - started < 5
