"""Why an attempt failed and where: tracebacks, output, the running attempt and attempt
numbers, end to end (real worker, real children, both backends), as a user reads them:
``JobFailed``, ``job.info()``, ``sandboxq job`` (table and ``--json``), the worker's log
and ``sandboxq run``'s output lines."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandboxq import Queue, text
from sandboxq.cli import main
from sandboxq.errors import JobFailed
from sandboxq.models import JobState, Outcome
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers, child_pid
from sandboxq.worker import SandboxWorker

pytestmark = pytest.mark.timeout(60)

W = "tests.support.why:"
H = "sandboxq.testing.handlers:"
CLI = [sys.executable, "-m", "sandboxq"]

StartWorker = Callable[..., SandboxWorker]


@pytest.fixture
def start_worker(workers: BackgroundWorkers, queue: Queue) -> StartWorker:
    def start(processor: str, **settings: object) -> SandboxWorker:
        return workers.start(queue, processor, **settings)

    return start


def sq(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_raise_two_frames_deep_keeps_its_traceback_everywhere(
    queue: Queue, start_worker: StartWorker, redis_url: str, capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, logger="sandboxq.worker")
    start_worker(W + "outer_frame", concurrency=1)
    job = queue.enqueue("two frames down")
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=30)
    tb = failed.value.traceback
    assert tb is not None
    # both frames, innermost last, and the exception line
    assert tb.index("in outer_frame") < tb.index("in inner_frame")
    assert "RuntimeError: two frames down" in tb
    [record] = job.info().history
    assert record.outcome is Outcome.ERROR and record.traceback == tb

    # the worker's log has it once, under the attempt's line (written once the backend
    # took the ack: the waiter may wake first)
    def logged() -> str:
        return "\n".join(r.getMessage() for r in caplog.records)

    wait_for(lambda: "in inner_frame" in logged(), 10, "the attempt's log line")
    assert logged().count("in inner_frame") == 1
    assert logged().index("attempt 1: error -> fail") < logged().index("in inner_frame")
    if queue.backend.__class__.__name__ != "RedisBackend":
        return
    code, out, _ = sq(capsys, "job", queue.name, job.id, "--url", redis_url)
    assert code == 0
    assert "attempt 1: traceback" in out and "in inner_frame" in out
    code, out, _ = sq(capsys, "job", queue.name, job.id, "--url", redis_url, "--json")
    data = json.loads(out)
    assert data["history"][0]["traceback"] == tb
    assert data["arguments"] == {"args": ["two frames down"], "kwargs": {}}


def test_the_worker_log_shows_hostile_ids_and_errors_without_obeying_them(
    queue: Queue, start_worker: StartWorker, caplog: pytest.LogCaptureFixture
) -> None:
    """A job id and a handler's error are any text: a newline in either forged a log line
    of its own ("... WARNING ... FORGED"), and escape sequences reached the operator's
    terminal raw (a title change, a cleared screen). They are shown escaped, on their line."""
    caplog.set_level(logging.INFO, logger="sandboxq.worker")
    start_worker(W + "outer_frame", concurrency=1)
    hostile_id = "esc\x1b]0;pwned\x07\x1b[2J\nWARNING sandboxq.worker: FORGED ID \u202edi"
    job = queue.options(job_id=hostile_id).enqueue("red\x1b[31m\nWARNING sandboxq.worker: FORGED")
    with pytest.raises(JobFailed):
        job.result(timeout_s=30)

    def logged() -> str:
        return "\n".join(r.getMessage() for r in caplog.records)

    wait_for(lambda: "attempt 1: error -> fail" in logged(), 10, "the attempt's log line")
    assert "\x1b" not in logged() and "\x07" not in logged(), repr(logged())
    assert "\u202e" not in logged() and "FORGED ID \\u202edi" in logged(), repr(logged())
    assert not any(line.startswith("WARNING") for line in logged().splitlines()), logged()
    [line] = [li for li in logged().splitlines() if "attempt 1: error -> fail" in li]
    assert line.startswith("job esc\\x1b]0;pwned\\x07\\x1b[2J\\nWARNING"), line
    assert "red\\x1b[31m\\nWARNING sandboxq.worker: FORGED" in line, line


def test_secrets_in_what_a_handler_says_are_hidden(queue: Queue, start_worker: StartWorker) -> None:
    start_worker(W + "fail_with_url", concurrency=1)
    job = queue.enqueue("redis://app:hunter2-secret@db.internal:6379/0")
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=30)
    [record] = job.info().history
    texts = [failed.value.error, record.error, record.traceback, record.output]
    assert record.traceback and "app:***@db.internal" in record.traceback
    assert all("hunter2" not in (t or "") for t in texts), texts


@pytest.mark.parametrize("progress", [False, True], ids=["raised", "and-progress"])
def test_an_error_naming_an_undecodable_file_fails_its_job_and_no_worker(
    queue: Queue, start_worker: StartWorker, progress: bool
) -> None:
    """A lone surrogate (what os.fsdecode makes of a byte that is not UTF-8) in the error
    could not be written to Redis: the worker died on the job's record, and so did the
    next worker that ran it."""
    start_worker(W + "fail_naming_an_undecodable_file", concurrency=1)
    for _ in range(2):  # the second: the worker lived on
        with pytest.raises(JobFailed) as failed:
            queue.enqueue(progress).result(timeout_s=30)
        assert failed.value.outcome == "error"
        assert "cannot thumbnail /uploads/\\udcff.png" in (failed.value.error or "")
        assert "opening /uploads/" in (failed.value.output or "")


def test_output_of_the_attempt_is_kept_with_it(queue: Queue, start_worker: StartWorker) -> None:
    start_worker(W + "print_then_fail", concurrency=1)
    job = queue.enqueue(3)
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=30)
    out = failed.value.output
    assert out is not None
    assert "stdout line 2" in out and "stderr line 2" in out


def test_attempt_numbers_keep_counting_across_retry_requeue_and_cancel(
    queue: Queue, start_worker: StartWorker, workers: BackgroundWorkers
) -> None:
    worker = start_worker(W + "outer_frame", concurrency=1, retries=1, lease_s=1.5)
    job = queue.options(backoff_s=0).enqueue("x")
    with pytest.raises(JobFailed):
        job.result(timeout_s=30)
    assert [h.attempt for h in job.info().history] == [1, 2]
    assert job.info().attempts == 2
    assert job.retry()
    with pytest.raises(JobFailed):
        job.result(timeout_s=30)
    info = job.info()
    assert [h.attempt for h in info.history] == [1, 2, 3, 4]  # not 1, 2, 1, 2
    assert info.attempts == 2  # the retry budget started again
    workers.stop(worker)

    # a cancelled attempt keeps its number, its child's pid and when it started
    start_worker(H + "sleep_forever", concurrency=1, lease_s=1.5)
    hang = queue.enqueue()
    wait_for(lambda: _running_pid(queue, hang.id) is not None, 20, "the child's pid")
    pid = _running_pid(queue, hang.id)
    assert hang.cancel()
    [cancelled] = hang.info().history
    assert cancelled.outcome is Outcome.CANCELLED and cancelled.attempt == 1
    assert cancelled.pid == pid and cancelled.started_ms is not None
    assert cancelled.started_ms <= (cancelled.ended_ms or 0)


def _sleeping_worker(
    workers: BackgroundWorkers, queue_name: str, url: str, tmp_path: Path, prefetch: int
) -> subprocess.Popen[bytes]:
    """A ``sandboxq worker`` of one child whose jobs sleep, in a session of its own (a
    ``killpg`` takes it whole), holding ``prefetch`` jobs ahead with 3 s leases."""
    return workers.spawn(
        queue_name,
        H + "sleep_forever",
        *("--concurrency", "1", "--lease-s", "3", "--prefetch", str(prefetch)),
        url=url,
        log=tmp_path / "worker.log",
        new_session=True,
    )


def _running_pid(queue: Queue, job_id: str) -> int | None:
    info = queue.backend.get(job_id)
    running = info.running if info is not None else None
    return running.pid if running is not None else None


# -- a lost lease keeps its attempt's child pid and start (README: "A cancelled or lease-lost
# attempt keeps its child's pid and its start time.") ----------------------------------------


@pytest.mark.timeout(90)
def test_a_lease_lost_attempt_keeps_its_childs_pid_after_its_worker_is_killed(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path
) -> None:
    """``kill -9`` of a worker's process group while its job runs: its registry record
    expires with its lease, and the lease_lost attempt the next worker's reaper records
    still names the child that ran it and when it started (the pid was lost with the
    record)."""
    queue = Queue(queue_name, url=redis_url)
    job = queue.enqueue()
    proc = _sleeping_worker(workers, queue_name, redis_url, tmp_path, prefetch=0)
    pid = wait_for(lambda: _running_pid(queue, job.id), 30, "the child's pid")
    running = job.info().running
    assert running is not None and running.started_ms is not None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    # The second worker comes once the dead one's record is gone, as a user's would: then
    # nothing but the job itself can say which child ran it.
    wait_for(lambda: child_pid(queue, job.id) is None, 20, "the dead worker's record to expire")
    workers.start(queue, H + "sleep_forever", concurrency=1, lease_s=3.0)
    [lost] = wait_for(lambda: job.info().history, 30, "the lost lease to be recovered")
    assert (lost.attempt, lost.outcome) == (1, Outcome.LEASE_LOST)
    assert lost.worker_id == running.worker_id
    assert (lost.pid, lost.started_ms) == (pid, running.started_ms)
    queue.close()


@pytest.mark.timeout(90)
def test_a_lease_lost_attempt_claimed_ahead_and_never_started_has_no_start(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """A job the killed worker had claimed ahead (``prefetch``) waited there for its one
    child, busy with the job before it: recovered, its lease_lost attempt says it never
    started (no start, no pid), where the job before it keeps both, and ``sandboxq job``
    shows its start as not known."""
    queue = Queue(queue_name, url=redis_url)
    first, ahead = queue.enqueue(), queue.enqueue()
    proc = _sleeping_worker(workers, queue_name, redis_url, tmp_path, prefetch=1)
    pid = wait_for(lambda: _running_pid(queue, first.id), 30, "the first job's child")
    held = ahead.info().running  # claimed, waiting in the worker for that child
    assert held is not None and held.pid is None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    wait_for(lambda: child_pid(queue, first.id) is None, 20, "the dead worker's record to expire")
    # a reaper only: the recovered jobs stay waiting, their histories as recovered
    queue.backend.recover_stalled()
    [ran] = wait_for(lambda: first.info().history, 30, "the first job to be recovered")
    [waited] = wait_for(lambda: ahead.info().history, 30, "the job ahead to be recovered")
    assert (ran.outcome, ran.pid) == (Outcome.LEASE_LOST, pid) and ran.started_ms is not None
    assert (waited.outcome, waited.worker_id) == (Outcome.LEASE_LOST, held.worker_id)
    assert (waited.pid, waited.started_ms) == (None, None)
    code, out, _ = sq(capsys, "job", queue_name, ahead.id, "--url", redis_url)
    assert code == 0 and text.START_UNKNOWN in out, out
    queue.close()


@pytest.mark.timeout(60)
def test_a_lease_lost_attempt_keeps_its_childs_pid_on_memory(
    queue_name: str, workers: BackgroundWorkers
) -> None:
    """memory:// lives in this process, so its worker cannot be killed alone: one whose
    renewals hang (held on the real backend) loses its lease as a dead one does. Its fence
    kills the child, its record stops listing the job, and the lease_lost attempt still
    names the child and its start."""
    queue = Queue(queue_name, url="memory://")
    backend = queue.backend
    hang, over = threading.Event(), threading.Event()
    real_renew = backend.renew

    def renew_unless_hung(*args: Any) -> list[str]:
        if hang.is_set():
            over.wait(30)
        return real_renew(*args)

    backend.renew = renew_unless_hung  # type: ignore[method-assign]
    try:
        # its own reaper waits: the test recovers the job once the record forgot it
        worker = workers.start(
            queue, H + "sleep_forever", concurrency=1, lease_s=1.5, stall_check_s=60.0
        )
        job = queue.enqueue()
        pid = wait_for(lambda: _running_pid(queue, job.id), 20, "the child's pid")
        running = job.info().running
        assert running is not None and running.started_ms is not None
        hang.set()
        wait_for(lambda: worker.stats["lease_lost"] == 1, 20, "the fence to end the attempt")
        wait_for(lambda: child_pid(queue, job.id) is None, 20, "the record to forget the job")
        wait_for(backend.recover_stalled, 20, "the lease to run out")
        [lost] = job.info().history
        assert (lost.attempt, lost.outcome) == (1, Outcome.LEASE_LOST)
        assert (lost.pid, lost.started_ms) == (pid, running.started_ms)
    finally:
        over.set()
    queue.close()


def test_the_running_attempt_is_in_the_story(
    queue: Queue, start_worker: StartWorker, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    worker = start_worker(H + "sleep_forever", concurrency=1, lease_s=1.5)
    job = queue.enqueue()
    wait_for(lambda: _running_pid(queue, job.id) is not None, 20, "the child's pid")
    info = job.info()
    assert info.state is JobState.ACTIVE and info.history == []
    running = info.running
    assert running is not None and running.attempt == 1
    assert running.worker_id == worker.id and running.started_ms is not None
    assert running.lease_expires_ms is not None and running.lease_expires_ms > running.started_ms
    if queue.backend.__class__.__name__ == "RedisBackend":
        code, out, _ = sq(capsys, "job", queue.name, job.id, "--url", redis_url)
        assert code == 0 and "running" in out and str(running.pid) in out
        assert "lease left" in out
        code, out, _ = sq(capsys, "job", queue.name, job.id, "--url", redis_url, "--json")
        assert json.loads(out)["running"]["pid"] == running.pid
    detail = queue.backend.job_detail(job.id)
    assert detail is not None and detail.info.running is not None
    # the same attempt (its lease may have been renewed in between)
    same = {"lease_expires_ms"}
    assert detail.info.running.model_dump(exclude=same) == running.model_dump(exclude=same)
    job.cancel()


def test_sandboxq_job_shows_long_arguments_bounded(
    redis_url: str, queue_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    q = Queue(queue_name, url=redis_url)
    try:
        job = q.enqueue("x" * 10_000, n=1)
    finally:
        q.close()
    code, out, _ = sq(capsys, "job", queue_name, job.id, "--url", redis_url, "--json")
    data = json.loads(out)
    assert code == 0 and "arguments" not in data
    assert len(data["arguments_preview"]) == 2000 and data["arguments_chars"] > 10_000
    code, out, _ = sq(capsys, "job", queue_name, job.id, "--url", redis_url)
    assert "(the first 2000 of" in out


@pytest.mark.timeout(120)
def test_sandboxq_run_lines_carry_the_traceback_and_stay_parseable(tmp_path: Path) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text('{"args": ["ok"]}\n{"args": ["boom"]}\n')
    handler = tmp_path / "runjob.py"
    handler.write_text(
        "def handle(word):\n"
        "    print('chatter on stdout')\n"
        "    if word == 'boom':\n"
        "        deeper(word)\n"
        "    return word\n\n"
        "def deeper(word):\n"
        "    raise ValueError(word)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(
        [*CLI, "run", "runjob:handle", str(data), "--retries", "0"],
        capture_output=True, text=True, timeout=100, cwd=tmp_path, env=env,
    )  # fmt: skip
    lines = [json.loads(line) for line in proc.stdout.splitlines()]  # every line is JSON
    by_line = {r["line"]: r for r in lines}
    assert by_line[1]["outcome"] == "ok" and by_line[1]["result"] == "ok"
    failed = by_line[2]
    assert failed["outcome"] == "error"
    assert "in deeper" in failed["traceback"] and "ValueError: boom" in failed["traceback"]
    assert "chatter on stdout" in proc.stderr  # the handlers' stdout went to stderr
