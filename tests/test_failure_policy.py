"""Failure policies end to end, on both backends (a real redis-server) and real children:
a job's whole budget (``deadline_s``), the wait allowed before it starts (``max_queue_s``),
the progress watchdog (``progress_timeout_s``), and exit codes retried without charge.

A budget that must run out is waited for on the real clock (that is what is tested); the
handlers really hang, really ignore the soft signal, really exit.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from typing import Any

import pytest

from sandboxq import ConfigError, JobFailed, Queue
from sandboxq.models import Action, JobState, Outcome
from sandboxq.pool.attempt import END_GRACE_S
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers, StartWorker
from sandboxq.worker import SandboxWorker

H = "sandboxq.testing.handlers:"
#: Added to a bound on a loaded machine (2 cores, other work beside).
SLACK_S = 1.0


@pytest.fixture
def start_worker(workers: BackgroundWorkers, url: str, queue_name: str) -> StartWorker:
    """A worker in the process-tree mode: time budgets and the watchdog act the same in
    either mode (the parent decides, and kills through the one kill path); what control
    groups change, the memory limit and its peak, is tested in both modes below."""

    def start(processor: str, **kwargs: Any) -> SandboxWorker:
        defaults = {"lease_s": 5.0, "containment": "process_tree"}
        return workers.start(queue_name, H + processor, url=url, **{**defaults, **kwargs})

    return start


def serving(queue: Queue) -> None:
    """Wait until the worker runs jobs (``call`` processors): a short budget under test
    must not be spent on the pool's start."""
    assert queue.enqueue("succeed_after", 0, 1).result(timeout_s=20) == 1


def failed(job: Any, timeout_s: float = 20) -> JobFailed:
    with pytest.raises(JobFailed) as info:
        job.result(timeout_s=timeout_s)
    return info.value


# -- deadline_s ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_deadline_ends_the_running_attempt_and_schedules_no_retry(
    queue: Queue, start_worker: StartWorker
) -> None:
    start_worker("call", hard_timeout_s=60)
    serving(queue)
    started = time.monotonic()
    job = queue.options(deadline_s=1.0, retries=5, backoff_s=0.01).enqueue("sleep_forever")
    error = failed(job)
    took = time.monotonic() - started
    assert error.outcome == "deadline" and error.attempts == 1
    # the soft signal at the deadline ends sleep_forever: no grace needed, no hard timeout
    assert took < 1.0 + SLACK_S, took
    [attempt] = job.info().history
    assert (attempt.outcome, attempt.action) == (Outcome.DEADLINE, Action.FAIL)
    assert attempt.error is not None, attempt
    assert attempt.error.startswith("deadline: the job's deadline_s ran out"), attempt.error


@pytest.mark.timeout(30)
def test_deadline_kills_a_handler_that_ignores_the_soft_signal_after_the_grace(
    queue: Queue, start_worker: StartWorker
) -> None:
    start_worker("call")
    serving(queue)
    started = time.monotonic()
    job = queue.options(deadline_s=0.5).enqueue("ignore_signals")
    error = failed(job)
    took = time.monotonic() - started
    [attempt] = job.info().history
    assert error.outcome == "deadline" and attempt.signal == 9
    assert 0.5 + END_GRACE_S <= took < 0.5 + END_GRACE_S + SLACK_S, took


@pytest.mark.timeout(30)
def test_deadline_stops_retries_that_each_time_out(queue: Queue, start_worker: StartWorker) -> None:
    start_worker("call", hard_timeout_s=0.3)
    serving(queue)
    started = time.monotonic()
    job = queue.options(deadline_s=1.2, retries=50, backoff_s=0.05).enqueue("sleep_forever")
    error = failed(job)
    took = time.monotonic() - started
    assert took < 1.2 + SLACK_S, took
    history = job.info().history
    # attempts ran until the budget: then the last one ended (or its retry was refused)
    assert 2 <= len(history) < 10
    assert history[-1].action is Action.FAIL
    assert error.outcome in ("deadline", "hard_timeout")


@pytest.mark.timeout(30)
def test_a_retry_whose_backoff_ends_past_the_deadline_is_not_scheduled(
    queue: Queue, start_worker: StartWorker
) -> None:
    start_worker("os_exit", exit_codes={3: "retry"})
    job = queue.options(deadline_s=5.0, retries=3, backoff_s=10.0).enqueue(3)
    error = failed(job, timeout_s=4)  # long before the backoff would have ended
    assert error.outcome == "exit" and error.attempts == 1
    assert "not retried: its backoff of 10 s would end past the job's deadline_s" in str(error)


@pytest.mark.timeout(30)
def test_the_worker_deadline_applies_to_jobs_without_one(
    queue: Queue, start_worker: StartWorker
) -> None:
    start_worker("sleep_forever", deadline_s=0.5)
    assert failed(queue.enqueue()).outcome == "deadline"


# -- max_queue_s --------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_job_that_waited_past_max_queue_s_never_starts(
    queue: Queue, start_worker: StartWorker
) -> None:
    expired = queue.options(max_queue_s=0.2).enqueue()
    by_default = queue.enqueue()
    fresh = queue.options(max_queue_s=600).enqueue()
    time.sleep(0.3)  # the budget under test runs out on the real clock; no worker yet
    start_worker("echo", max_queue_s=0.25)
    assert fresh.result(timeout_s=10) == [[], {}]
    for job in (expired, by_default):  # the job's own budget, then the worker's
        error = failed(job, timeout_s=10)
        assert error.outcome == "expired" and error.attempts == 1
        [attempt] = job.info().history
        assert attempt.outcome is Outcome.EXPIRED and attempt.pid is None  # never ran
        assert attempt.started_ms is None
    assert job.info().state is JobState.FAILED


@pytest.mark.timeout(30)
def test_a_job_claimed_ahead_that_waits_past_max_queue_s_never_starts(
    queue: Queue, start_worker: StartWorker
) -> None:
    """The claim checks max_queue_s, but a worker claims jobs ahead (its prefetch) and
    they wait in it for a child: one that waited past its max_queue_s there ran anyway,
    seconds late. It ends expired, never run, as one still waiting in the queue does; and
    at that moment, not once the busy child is free."""
    start_worker("call", concurrency=1, hard_timeout_s=30)  # the default prefetch
    serving(queue)
    busy = queue.enqueue("succeed_after", 3, "busy")
    started = time.monotonic()
    wait_for(lambda: busy.info().state is JobState.ACTIVE, 10, "the busy job claimed")  # type: ignore[union-attr]
    job = queue.options(max_queue_s=0.5).enqueue("succeed_after", 0, "late")
    error = failed(job, timeout_s=10)
    assert error.outcome == "expired" and error.attempts == 1, error
    assert time.monotonic() - started < 3, "it expired only once the busy child was free"
    [attempt] = job.info().history  # type: ignore[union-attr]
    assert attempt.outcome is Outcome.EXPIRED and attempt.pid is None  # never ran
    assert attempt.started_ms is None
    assert busy.result(timeout_s=10) == "busy"


# -- the progress watchdog ----------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_handler_that_stops_reporting_progress_is_ended_and_retried(
    queue: Queue, start_worker: StartWorker
) -> None:
    start_worker("progress_then_hang", hard_timeout_s=60, progress_timeout_s=0.4)
    job = queue.options(retries=1, backoff_s=0.01).enqueue(3, 0.05)
    error = failed(job)
    assert error.outcome == "progress_timeout" and error.attempts == 2
    history = job.info().history
    assert [a.outcome for a in history] == [Outcome.PROGRESS_TIMEOUT] * 2
    assert [a.action for a in history] == [Action.RETRY, Action.FAIL]
    for attempt in history:  # three reports 0.05 s apart (the last at 0.1 s), 0.4 s of silence
        assert attempt.error is not None, attempt
        # the watchdog, with its value: not the soft timeout, which was not set
        assert attempt.error.startswith("progress_timeout: no progress() for 0.4 s"), attempt.error
        assert "SoftTimeout" in attempt.error and "soft timeout" not in attempt.error
        assert attempt.started_ms is not None and attempt.ended_ms is not None
        assert 490 <= attempt.ended_ms - attempt.started_ms < 500 + SLACK_S * 1000


@pytest.mark.timeout(30)
def test_a_handler_that_keeps_reporting_outlives_its_watchdog(
    queue: Queue, start_worker: StartWorker
) -> None:
    start_worker("progress_every", progress_timeout_s=0.5)
    # ten reports 0.1 s apart: busy twice as long as the watchdog, never silent for it
    assert queue.enqueue(10, 0.1).result(timeout_s=15) == 10


@pytest.mark.timeout(30)
def test_the_watchdog_kills_a_handler_deaf_to_the_soft_signal(
    queue: Queue, start_worker: StartWorker
) -> None:
    start_worker("ignore_signals", progress_timeout_s=0.3, soft_timeout_s=20, hard_timeout_s=20.5)
    job = queue.enqueue()
    error = failed(job)
    [attempt] = job.info().history
    assert error.outcome == "progress_timeout" and attempt.signal == 9
    assert attempt.error is not None and "grace of 0.5 s" in attempt.error


# -- exit codes retried without charge ----------------------------------------------------


@pytest.mark.timeout(30)
def test_an_exit_code_mapped_to_retry_uncharged_costs_no_attempt(
    queue: Queue, start_worker: StartWorker, tmp_path: Any
) -> None:
    start_worker("exit_once", exit_codes={3: "retry_uncharged"})
    marker = str(tmp_path / "exited")
    job = queue.options(retries=0).enqueue(marker, 3)
    assert job.result(timeout_s=15) == "ok"
    assert os.path.exists(marker)
    info = job.info()
    assert info.attempts == 1  # the exit was not charged: no retry was allowed
    assert [(a.outcome, a.action) for a in info.history] == [
        (Outcome.EXIT, Action.RETRY_UNCHARGED),
        (Outcome.OK, Action.COMPLETE),
    ]


# -- bad input ----------------------------------------------------------------------------


def test_budgets_that_cannot_act_as_written_are_refused_naming_both(
    queue: Queue, queue_name: str
) -> None:
    with pytest.raises(ConfigError, match=r"deadline_s \(1\).*max_queue_s \(5\)"):
        queue.options(max_queue_s=5, deadline_s=1).enqueue()
    with pytest.raises(ConfigError, match=r"progress_timeout_s \(9\).*hard_timeout_s \(3\)"):
        queue.options(progress_timeout_s=9, hard_timeout_s=3).enqueue()
    for bad in (0, -1, float("inf"), "5"):
        with pytest.raises((ConfigError, ValueError), match="deadline_s"):
            queue.options(deadline_s=bad).enqueue()
    with pytest.raises(ConfigError, match=r"deadline_s \(1\).*max_queue_s \(2\)"):
        SandboxWorker(queue_name, H + "echo", "memory://", max_queue_s=2, deadline_s=1)
    with pytest.raises(ConfigError, match=r"progress_timeout_s \(9\).*hard_timeout_s \(3\)"):
        SandboxWorker(queue_name, H + "echo", "memory://", progress_timeout_s=9, hard_timeout_s=3)
    with pytest.raises(ConfigError, match="exit_codes"):
        SandboxWorker(queue_name, H + "echo", "memory://", exit_codes={3: "ignore"})


# -- metrics ------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_metrics_count_the_new_outcomes(
    workers: BackgroundWorkers, redis_url: str, queue_name: str
) -> None:
    with Queue(queue_name, redis_url) as q:
        expired = q.enqueue()  # the worker's max_queue_s: failed by the worker, unstarted
        time.sleep(0.3)  # the budget under test runs out on the real clock; no worker yet
        worker = workers.start(
            q, H + "progress_then_hang", max_queue_s=0.2, progress_timeout_s=0.3, metrics_port=0
        )
        assert failed(expired).outcome == "expired"
        hung = q.options(deadline_s=60).enqueue(1, 0.01)
        assert failed(hung).outcome == "progress_timeout"
        assert worker.metrics_address is not None
        url = "http://{}:{}/metrics".format(*worker.metrics_address)
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        for outcome in ("expired", "progress_timeout"):
            line = f'sandboxq_attempts_total{{outcome="{outcome}",queue="{queue_name}"}} 1.0'
            assert line in text, text
        # ended by the soft signal: no kill, so no kill lateness either
        assert 'reason="progress_timeout"' not in text


# -- memory-aware retries -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_job_out_of_memory_is_retried_with_a_raised_limit(
    workers: BackgroundWorkers, url: str, queue_name: str, containment: str
) -> None:
    with Queue(queue_name, url) as q:
        workers.start(
            q,
            H + "use_memory",
            url=url,
            containment=containment,
            max_memory_mb=60,
            memory_retry_factor=2.0,
            memory_retry_max_mb=500,
        )
        job = q.options(retries=3, backoff_s=0.01).enqueue(100)
        assert job.result(timeout_s=40) == 100
        first, second = job.info().history
        assert (first.outcome, first.action, first.memory_limit_mb) == (
            Outcome.MEMORY_LIMIT,
            Action.RETRY,
            60,
        )
        assert (second.outcome, second.memory_limit_mb) == (Outcome.OK, 120)
        # what it ran with is kept: its peak (the group's high-water mark, or sampled RSS)
        assert first.peak_memory_mb is not None and first.peak_memory_mb >= 50
        # past the first limit (it could not have run under it), within the raised one;
        # sampled RSS can miss part of a 0.3 s hold, so no closer to 100 than that
        assert second.peak_memory_mb is not None and 60 < second.peak_memory_mb <= 120


@pytest.mark.timeout(60)
def test_memory_retries_stop_at_the_cap(
    workers: BackgroundWorkers, url: str, queue_name: str
) -> None:
    with Queue(queue_name, url) as q:
        workers.start(
            q, H + "use_memory", url=url, max_memory_mb=40, memory_retry_factor=1.5,
            memory_retry_max_mb=70,
        )  # fmt: skip
        job = q.options(retries=5, backoff_s=0.01).enqueue(150)
        error = failed(job, timeout_s=40)
        assert error.outcome == "memory_limit"
        history = job.info().history
        assert [a.memory_limit_mb for a in history] == [40, 60, 70]  # 40, x1.5, capped
        assert "not retried: it ran at memory_retry_max_mb (70 MB) already" in str(error)


def test_memory_retry_settings_are_checked_at_worker_start(queue_name: str) -> None:
    with pytest.raises(ConfigError, match=r"memory_retry_factor \(1\) must be above 1"):
        SandboxWorker(queue_name, H + "echo", "memory://", memory_retry_factor=1)
    with pytest.raises(ConfigError, match=r"memory_retry_max_mb \(50\).*max_memory_mb \(100\)"):
        SandboxWorker(
            queue_name, H + "echo", "memory://", max_memory_mb=100, memory_retry_max_mb=50
        )


# -- the other doors: CLI flags, SANDBOXQ_* variables ------------------------------------


def test_the_cli_and_the_environment_take_the_new_settings(
    redis_url: str, queue_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from sandboxq.cli import main
    from sandboxq.settings import WorkerSettings, from_env

    code = main(["enqueue", queue_name, "--url", redis_url, "--deadline-s", "2",
                 "--max-queue-s", "3"])  # fmt: skip
    assert code == 2
    assert "deadline_s (2)" in capsys.readouterr().err
    main(["enqueue", queue_name, "--url", redis_url, "--deadline-s", "60",
          "--max-queue-s", "3", "--progress-timeout-s", "1"])  # fmt: skip
    job_id = capsys.readouterr().out.strip()
    with Queue(queue_name, redis_url) as q:
        options = q.job(job_id).info().options
        batch = q.options(deadline_s=60, max_queue_s=3).batch([((1,), {}), ((2,), {})])
        member = q.job(f"{batch.id}.1").info().options
    assert (options.deadline_s, options.max_queue_s, options.progress_timeout_s) == (60, 3, 1)
    assert (member.deadline_s, member.max_queue_s) == (60, 3)  # the batch API too
    env = {
        "SANDBOXQ_DEADLINE_S": "30",
        "SANDBOXQ_MEMORY_RETRY_FACTOR": "1.5",
        "SANDBOXQ_POOL_MEMORY_MB": "512",
    }
    s = from_env(WorkerSettings, env, defaults={"concurrency": 1}, queue="q", processor="a.b:c")
    assert (s.deadline_s, s.memory_retry_factor, s.pool_memory_mb) == (30, 1.5, 512)
    with pytest.raises(ConfigError, match=r"progress_timeout_s.*hard_timeout_s.*SANDBOXQ_"):
        from_env(
            WorkerSettings,
            {"SANDBOXQ_PROGRESS_TIMEOUT_S": "9", "SANDBOXQ_HARD_TIMEOUT_S": "3"},
            defaults={"concurrency": 1},
            queue="q",
            processor="a.b:c",
        )


# -- the pool: a deadline already past when the attempt starts ----------------------------


@pytest.mark.timeout(30)
def test_an_attempt_starting_past_its_deadline_ends_at_once_not_after_the_grace() -> None:
    """The soft signal lands before the handler is armed (it was due at once): the child
    still raises SoftTimeout as the handler begins, instead of losing the signal and
    running until the kill a whole grace later."""
    from sandboxq import Pool
    from sandboxq.pool.attempt import AttemptResult, Task

    with Pool(H + "sleep_forever", size=1, containment="process_tree") as pool:
        for _ in range(5):
            ended: list[AttemptResult] = []
            done = threading.Event()
            task = Task(
                b"[[], {}]",
                "json",
                deadline_at=time.monotonic() - 1.0,
                end_grace_s=20.0,
            )
            t0 = time.monotonic()
            pool.execute(task, lambda r, e=ended, d=done: (e.append(r), d.set()))
            assert done.wait(10), "the attempt ran on into its grace"
            assert ended[0].outcome is Outcome.DEADLINE
            assert time.monotonic() - t0 < 5


@pytest.mark.timeout(30)
def test_an_attempt_whose_deadline_passes_while_it_waits_for_a_child_never_starts() -> None:
    from sandboxq import Pool
    from sandboxq.pool.attempt import AttemptResult, Task

    with Pool(H + "call", size=1, containment="process_tree") as pool:
        ended: dict[str, AttemptResult] = {}
        both = threading.Event()

        def record(name: str) -> Any:
            def on_done(result: AttemptResult) -> None:  # on the supervisor's thread
                ended[name] = result
                if len(ended) == 2:
                    both.set()

            return on_done

        # the only child is busy until its hard timeout; the second waits for it, and
        # its budget runs out meanwhile
        pool.execute(Task(b'[["sleep_forever"], {}]', "json", hard_timeout_s=0.8), record("busy"))
        waiting = Task(b'[["succeed_after", 0, 1], {}]', "json", deadline_at=time.monotonic() + 0.3)
        pool.execute(waiting, record("waiting"))
        assert both.wait(20), ended
        assert ended["busy"].outcome is Outcome.HARD_TIMEOUT
        late = ended["waiting"]
        assert late.outcome is Outcome.DEADLINE and late.started_ms is None and late.pid is None


@pytest.mark.timeout(60)
def test_sandboxq_run_takes_the_watchdog_and_the_deadline(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from sandboxq.cli import main

    source = tmp_path / "in.jsonl"
    source.write_text(
        '{"args": ["progress_then_hang", 1, 0.01]}\n'  # 1 hung after one report
        '{"args": ["progress_every", 8, 0.1]}\n'  # 2 busy 0.8 s, reporting every 0.1 s
        '{"args": ["sleep_forever"]}\n'  # 3 reports nothing, ends at the deadline
    )
    code = main(["run", H + "call", str(source), "--concurrency", "3",
                 "--progress-timeout-s", "0.4", "--deadline-s", "0.3"])  # fmt: skip
    assert code == 1
    rows = {row["line"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    # line 3: the deadline (0.3 s) comes before its watchdog (0.4 s); line 1 too, but
    # its report reset the watchdog: the deadline ends it first as well
    assert rows[3]["outcome"] == "deadline" and rows[1]["outcome"] == "deadline"
    assert rows[2]["outcome"] == "deadline"  # 0.8 s of work in a 0.3 s budget
    code = main(["run", H + "call", str(source), "--concurrency", "3",
                 "--progress-timeout-s", "0.4"])  # fmt: skip
    rows = {row["line"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    assert {n: rows[n]["outcome"] for n in rows} == {
        1: "progress_timeout",
        2: "ok",
        3: "progress_timeout",
    }
