"""The ``sandboxq`` command line against a real redis-server.

In-process (``main([...])`` with capsys) where only the output matters; as a real
subprocess where the process does (exit status, one-line errors, signals, SIGKILL)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from sandboxq import Queue
from sandboxq.backends.index import WORKERS_READ_CAP
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.cli import main
from sandboxq.errors import BackendError
from sandboxq.models import JobState, now_ms
from sandboxq.pool.containment import probe
from sandboxq.testing.redis_server import free_port
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from sandboxq.worker import SandboxWorker

H = "sandboxq.testing.handlers:"

CLI = [sys.executable, "-m", "sandboxq"]


def _family() -> set[int]:
    """Every live process below this one, shared helpers (fork server...) included."""
    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()}


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def sq(capsys: pytest.CaptureFixture[str]) -> Run:
    """``sq("info", queue)`` or ``sq(f"info {queue}")``: run the CLI in this process;
    returns (status, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(words(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def words(argv: tuple[str, ...]) -> list[str]:
    """One string is a command line (split as a shell would); several are the words."""
    return shlex.split(argv[0]) if len(argv) == 1 else list(argv)


def cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 30) -> Any:
    """Run the CLI as a real process and wait for it."""
    return subprocess.run(
        [*CLI, *words(argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(proc: Any, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("sandboxq: error: "), lines[0]
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def at(redis_url: str, queue_name: str) -> str:
    """The queue and its URL, as they follow a verb: ``sq(f"info {at}")``."""
    return f"{queue_name} --url {redis_url}"


@pytest.fixture
def url(redis_url: str) -> str:
    """The command line serves Redis only: the suite's ``queue`` is on it alone here."""
    return redis_url


@pytest.fixture
def start_worker(workers: BackgroundWorkers, queue: Queue) -> Callable[..., SandboxWorker]:
    """Start a worker of ``H + processor`` for ``queue`` on a thread (one child unless told)."""

    def start(processor: str, **options: Any) -> SandboxWorker:
        return workers.start(queue, H + processor, **{"concurrency": 1, **options})

    return start


# -- worker: start-up errors --------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_worker_fails_fast_and_starts_nothing_when_its_backend_is_unreachable(
    queue_name: str,
) -> None:
    """A wrong URL is a startup error: no pool, no fork server, a BackendError at once."""
    before = _family()
    worker = SandboxWorker(
        queue_name, H + "echo", url=f"redis://127.0.0.1:{free_port()}/0", concurrency=2
    )
    started = time.monotonic()
    with pytest.raises(BackendError, match="unreachable"):
        worker.run()
    assert time.monotonic() - started < 10
    assert _family() <= before


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "needles"),
    [
        ((H + "no_such_handler",), ("no_such_handler",)),
        (("no.such.module:fn",), ("cannot import its module", "No module named 'no'")),
        (("not-a-path",), ("package.module:function",)),
        ((H + "echo", "--concurrency", "0"), ("concurrency",)),
        ((H + "echo", "--soft-timeout-s", "5", "--hard-timeout-s", "2"), ("soft_timeout_s",)),
        ((H + "echo", "--lease-s", "0.01"), ("lease_s",)),
        ((H + "echo", "--exit-code", "3retry"), ("--exit-code", "N=ACTION")),
    ],
    ids=["no-attribute", "no-module", "not-a-path", "concurrency", "soft>hard", "lease", "exit"],
)
def test_worker_start_errors_are_one_line_without_traceback(
    redis_url: str, queue_name: str, args: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    proc = cli("worker", queue_name, *args, "--url", redis_url)
    assert_one_line_error(proc, *needles)


@pytest.mark.timeout(30)
def test_worker_with_unreachable_redis_is_one_line(queue_name: str) -> None:
    port = free_port()  # nothing listens there
    proc = cli(f"worker {queue_name} {H}echo --url redis://127.0.0.1:{port}/0 --concurrency 1")
    assert_one_line_error(proc, "unreachable", f"127.0.0.1:{port}")


@pytest.mark.timeout(30)
def test_every_redis_verb_refuses_a_memory_url(queue_name: str) -> None:
    """memory:// is in-process: a second command would look at an empty queue forever."""
    proc = cli("info", queue_name, env={"SANDBOXQ_URL": "memory://"})
    assert_one_line_error(proc, "no Redis URL", "sandboxq run")
    proc = cli(f"worker {queue_name} {H}echo", env={"SANDBOXQ_URL": ""})
    assert_one_line_error(proc, "no Redis URL")


# -- worker: running and stopping ---------------------------------------------------------


@pytest.fixture
def spawn_worker(
    workers: BackgroundWorkers, redis_url: str, queue_name: str
) -> Callable[..., subprocess.Popen[bytes]]:
    """``spawn_worker(log, *flags)``: a ``sandboxq worker`` process of ``recorded_sleep`` for
    the test's queue, logging to ``log``; SIGKILLed at teardown if still running."""

    def spawn(log: Path, *flags: str) -> subprocess.Popen[bytes]:
        return workers.spawn(queue_name, H + "recorded_sleep", *flags, url=redis_url, log=log)

    return spawn


@pytest.mark.timeout(60)
def test_worker_logs_each_outcome_and_sigterm_drains_to_a_clean_exit(
    queue: Queue, spawn_worker: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    runs, log = tmp_path / "runs", tmp_path / "worker.log"
    proc = spawn_worker(log, "--concurrency", "1")
    job = queue.enqueue(str(runs), "job", 1.5)
    wait_for(lambda: runs.exists() and "start" in runs.read_text(), 20, "the job to start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    # The drain let the running job finish: it completed, it was not interrupted.
    assert job.info().state is JobState.COMPLETED
    text = log.read_text()
    assert f"job {job.id} attempt 1: ok -> complete" in text
    assert "received SIGTERM: draining" in text
    assert "Traceback" not in text


@pytest.mark.timeout(60)
def test_a_sigterm_while_the_worker_starts_drains_to_a_clean_exit(
    queue: Queue, spawn_worker: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """The handlers came after the pool started: a SIGTERM in between (read the moment
    the start is logged) killed the worker with no word (-15), its registration left
    to expire and its control groups to the next pool."""
    log = tmp_path / "worker.log"
    proc = spawn_worker(log)
    wait_for(lambda: log.exists() and "started on queue" in log.read_text(), 20, "the start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0, log.read_text()
    text = log.read_text()
    assert "received SIGTERM: draining" in text and "stopped" in text, text
    assert queue.backend.workers() == [], "its registration was left behind"


@pytest.mark.timeout(60)
def test_every_outcome_gets_its_own_prefixed_line_when_jobs_end_together(
    queue: Queue, spawn_worker: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """Outcomes acked in one batch are logged as one record; each still reads as a line
    of its own, with time, level and logger in front."""
    runs, log = tmp_path / "runs", tmp_path / "worker.log"
    jobs = queue.enqueue_many([((str(runs), f"k{i}", 0), {}) for i in range(40)])
    proc = spawn_worker(log, "--concurrency", "2", "--burst")
    assert proc.wait(30) == 0
    lines = [line for line in log.read_text().splitlines() if "attempt 1: ok -> complete" in line]
    assert sorted(line.split(" job ")[1].split()[0] for line in lines) == sorted(
        job.id for job in jobs
    )
    assert all(
        re.match(r"\d{4}-\d\d-\d\d [\d:,]+ INFO sandboxq\.worker: job ", line) for line in lines
    )


@pytest.mark.timeout(60)
def test_worker_burst_in_process_runs_the_queue_and_returns_0(
    sq: Run, at: str, queue: Queue
) -> None:
    jobs = [queue.enqueue(i) for i in range(3)]
    code, _, err = sq(f"worker {at} {H}echo --burst --concurrency 1")
    assert code == 0, err
    assert [j.result(timeout_s=1) for j in jobs] == [0, 1, 2]


# -- settings from the environment (their parsing: test_settings_env.py) --------------------


@pytest.mark.timeout(60)
def test_worker_settings_come_from_the_environment(
    sq: Run, monkeypatch: pytest.MonkeyPatch, redis_url: str, queue: Queue, queue_name: str
) -> None:
    monkeypatch.setenv("SANDBOXQ_URL", redis_url)
    monkeypatch.setenv("SANDBOXQ_HARD_TIMEOUT_S", "0.5")
    monkeypatch.setenv("SANDBOXQ_CONCURRENCY", "1")
    job = queue.enqueue()
    code, _, err = sq(f"worker {queue_name} {H}sleep_forever --burst")
    assert code == 0, err
    info = job.info()
    assert info.state is JobState.FAILED and info.outcome == "hard_timeout"
    assert "0.5 s" in (info.error or "")


@pytest.mark.timeout(30)
def test_worker_setting_errors_from_the_environment_name_the_variable(at: str) -> None:
    proc = cli(f"worker {at} {H}echo", env={"SANDBOXQ_LEASE_S": "soon"})
    assert_one_line_error(proc, "SANDBOXQ_LEASE_S='soon'")
    # A flag wins over its variable, even over a bad one.
    proc = cli(f"worker {at} {H}echo --burst --concurrency 1", env={"SANDBOXQ_CONCURRENCY": "x"})
    assert proc.returncode == 0, proc.stderr


# -- enqueue ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_enqueue_prints_the_id_and_passes_args_kwargs_and_options(
    sq: Run, at: str, queue: Queue
) -> None:
    options = "--job-id j1 --priority 5 --hard-timeout-s 9 --retries 2 --delay-s 60"
    code, out, err = sq(f"""enqueue {at} --args '[1, "two"]' --kwargs '{{"n": 3}}' {options}""")
    assert (code, out, err) == (0, "j1\n", "")
    info = queue.job("j1").info()
    assert info.state is JobState.DELAYED
    opts = info.options
    assert (opts.priority, opts.hard_timeout_s, opts.retries, opts.delay_s) == (5, 9.0, 2, 60.0)
    code, out, _ = sq(f"enqueue {at} --json")
    assert code == 0 and queue.job(json.loads(out)["id"]).state() is JobState.WAITING
    # the same id again: the job is not added twice, and the new arguments are not used,
    # which the command says (they used to be dropped without a word)
    code, out, err = sq(f"enqueue {at} --args '[99]' --job-id j1")
    assert (code, out) == (0, "j1\n")
    assert err == (
        "sandboxq: job j1 already exists: nothing was added, and these arguments and "
        "options were not used\n"
    )
    assert queue.backend.get_arguments("j1") == b'[[1,"two"],{"n":3}]'


@pytest.mark.timeout(60)
def test_enqueue_wait_prints_the_result_or_fails_with_the_cause(
    sq: Run, at: str, start_worker: Callable[..., SandboxWorker]
) -> None:
    start_worker("succeed_after", hard_timeout_s=1.0)
    code, out, err = sq(f"""enqueue {at} --args '[0, {{"a": [1]}}]' --wait --timeout-s 20""")
    job_id, result = out.splitlines()
    assert code == 0 and json.loads(result) == {"a": [1]}, err
    assert len(job_id) == 32  # the id comes first, at once
    code, out, err = sq(f"enqueue {at} --args [60] --wait --timeout-s 20")
    assert code == 1
    assert err.startswith(f"sandboxq: job {out.strip()} failed after 1 attempt(s): hard_timeout")
    code, out, err = sq(f"enqueue {at} --args [60] --wait --timeout-s 20 --json")
    data = json.loads(out)
    assert code == 1
    assert (data["state"], data["outcome"], data["attempts"]) == ("failed", "hard_timeout", 1)
    code, out, err = sq(f"enqueue {at} --args [0.2,7] --wait --timeout-s 0.05")
    assert code == 3 and "did not finish within 0.05 s" in err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ("--args '[1,'", "--args is not valid JSON"),
        ("""--args '{"a": 1}'""", "--args must be a JSON array, got object"),
        ("--kwargs [1]", "--kwargs must be a JSON object, got array"),
        ("--soft-timeout-s 3 --hard-timeout-s 1", "must be less than hard_timeout_s"),
        ("--priority 5000", "priority"),
        ("--wait --result-ttl-s 0", "--result-ttl-s 0 removes the job as it completes"),
        ("--timeout-s 5", "give --wait too"),
    ],
)
def test_enqueue_refuses_bad_input_in_one_line(
    sq: Run, at: str, queue: Queue, flags: str, needle: str
) -> None:
    code, out, err = sq(f"enqueue {at} {flags}")
    assert code == 2 and out == ""
    assert err.startswith("sandboxq: error: ") and needle in err and err.count("\n") == 1
    assert sum(queue.counts().values()) == 0


@pytest.mark.timeout(30)
def test_enqueue_given_bare_words_says_where_arguments_go(sq: Run, at: str, queue: Queue) -> None:
    code, out, err = sq(f"enqueue {at} photo.png 128")
    assert code == 2 and out == "" and err.count("\n") == 1  # one line, no usage before it
    assert "unrecognized arguments: photo.png 128 (a job's arguments go in --args" in err
    assert """--args '["photo.png", "128"]'""" in err
    code, _, err = sq(f"enqueue {at} photo.png --bogus")  # an option too: no guess
    assert code == 2 and "--args" not in err
    assert sum(queue.counts().values()) == 0


# -- info, jobs, job ----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_info_shows_a_new_workers_containment_before_its_first_refresh(
    sq: Run, at: str, start_worker: Callable[..., SandboxWorker]
) -> None:
    """The registry entry is refreshed every lease_s / 3 (40 s here): the containment the
    pool chose is in it from the start, not from the first refresh."""
    worker = start_worker("echo", lease_s=120.0)

    def shown() -> Any:
        workers = json.loads(sq(f"info {at} --json")[1])["workers"]
        return workers if workers and workers[0]["containment"] else None

    (w,) = wait_for(shown, 20, "info to show the new worker's containment")
    assert w["containment"] == probe()[0]
    assert w["protections"] == ", ".join(worker._pool.protections)  # type: ignore[union-attr]


@pytest.mark.timeout(30)
def test_info_reads_a_lease_by_the_servers_clock_not_the_workers(
    sq: Run, at: str, queue: Queue
) -> None:
    """A worker on a machine whose clock is two minutes behind writes its record with
    that clock: read against the reader's, its healthy lease looked expired for two
    minutes, "the worker stopped renewing", and a healthy worker could be killed for it."""
    two_minutes_behind = now_ms() - 120_000
    job = {"id": "j", "attempt": 1, "pid": 2, "lease_renewed_s_ago": 0.5}
    record = {"host": "skewed", "lease_s": 10.0, "registered_ms": two_minutes_behind, "jobs": [job]}
    queue.backend.register_worker("skewed:1:abc", record, ttl_s=30)
    (worker,) = json.loads(sq(f"info {at} --json")[1])["workers"]
    (shown,) = worker["jobs"]
    assert 8.5 <= shown["lease_left_s"] <= 9.5, shown


@pytest.mark.timeout(60)
def test_info_shows_counts_workers_their_jobs_child_pids_and_lease_left(
    sq: Run, at: str, queue: Queue, queue_name: str, start_worker: Callable[..., SandboxWorker]
) -> None:
    worker = start_worker("sleep_forever", lease_s=6.0, prefetch=0)
    job = queue.enqueue()
    queue.enqueue()  # waits: the worker has one child

    def running() -> Any:
        data = json.loads(sq(f"info {at} --json")[1])
        jobs = [j for w in data["workers"] for j in w["jobs"] if j["pid"]]
        return (data, jobs[0]) if jobs else None

    data, running_job = wait_for(running, 20, "info to show the running job with its pid")
    counts = {"waiting": 1, "delayed": 0, "active": 1, "completed": 0, "failed": 0}
    assert data["counts"] == {**counts, "cancelled": 0}
    (w,) = data["workers"]
    assert (w["worker_id"], w["pid"], w["concurrency"]) == (worker.id, os.getpid(), 1)
    assert w["containment"] == probe()[0]  # the mode in force, from the registry entry
    assert w["protections"] == ", ".join(worker._pool.protections)  # type: ignore[union-attr]
    assert running_job["id"] == job.id and running_job["attempt"] == 1
    assert psutil.Process(running_job["pid"]).ppid() != 0  # a real, live child
    assert 0 < running_job["lease_left_s"] <= 6.0
    code, out, err = sq(f"info {at}")
    assert code == 0, err
    assert f"queue {queue_name}" in out and "live workers (1)" in out and worker.id in out
    assert "jobs held by workers (1)" in out and job.id in out
    assert str(running_job["pid"]) in out
    assert f" {w['containment']} " in out


@pytest.mark.timeout(60)
def test_info_shows_a_job_with_its_pid_soon_after_it_starts_and_not_after_it_ends(
    sq: Run, at: str, queue: Queue, start_worker: Callable[..., SandboxWorker]
) -> None:
    """The periodic refresh is every lease_s / 3 (40 s here); a change of the jobs held is
    published about a second after it."""
    start_worker("sleep_forever", lease_s=120.0, prefetch=0)
    job = queue.enqueue()

    def held() -> list[Any]:
        data = json.loads(sq(f"info {at} --json")[1])
        return [j for w in data["workers"] for j in w["jobs"]]

    (shown,) = wait_for(lambda: [j for j in held() if j["pid"]], 10, "the job with its pid")
    assert shown["id"] == job.id
    job.cancel()
    wait_for(lambda: not held(), 10, "the cancelled job to leave the worker's record")


@pytest.mark.timeout(30)
def test_info_on_an_idle_queue(sq: Run, at: str) -> None:
    code, out, _ = sq(f"info {at}")
    assert code == 0 and "no live workers" in out
    code, out, _ = sq(f"info {at} --json")
    assert json.loads(out)["workers"] == [] and code == 0


@pytest.mark.timeout(60)
def test_info_finds_the_live_worker_of_a_registry_padded_by_hand(
    sq: Run, at: str, queue: Queue, raw: redis.Redis
) -> None:
    """100,000 names added to the registry, no record behind any: info read one SSCAN's
    thousand, showed "no live workers" while one ran, and did not say it stopped there."""
    workers = QueueKeys(queue.name).workers
    for start in range(0, 100_000, 10_000):
        raw.sadd(workers, *[f"junk-{i}" for i in range(start, start + 10_000)])
    queue.backend.register_worker("live:1:abc", {"host": "here", "lease_s": 10.0}, ttl_s=30)
    started = time.monotonic()
    code, out, err = sq(f"info {at}")
    assert code == 0, err
    assert "live workers (1)" in out and "live:1:abc" in out, out
    assert time.monotonic() - started < 10  # bounded: one pass over the registry at most
    # the dead names were forgotten as they were read: the next look reads one member
    assert raw.smembers(workers) == {b"live:1:abc"}
    (shown,) = json.loads(sq(f"info {at} --json")[1])["workers"]
    assert shown["worker_id"] == "live:1:abc"


@pytest.mark.timeout(60)
def test_info_says_when_more_workers_are_registered_than_one_look_reads(
    sq: Run, at: str, queue: Queue, raw: redis.Redis
) -> None:
    keys = QueueKeys(queue.name)
    pipe = raw.pipeline(transaction=False)
    for i in range(WORKERS_READ_CAP + 200):
        pipe.set(keys.worker(f"w{i}"), json.dumps({"worker_id": f"w{i}", "host": "h"}), ex=60)
        pipe.sadd(keys.workers, f"w{i}")
    pipe.execute()
    code, out, err = sq(f"info {at}")
    assert code == 0, err
    assert f"the first {WORKERS_READ_CAP} registered workers were read" in out, out
    data = json.loads(sq(f"info {at} --json")[1])
    assert len(data["workers"]) == WORKERS_READ_CAP
    assert f"the first {WORKERS_READ_CAP} registered workers" in data["workers_note"]


@pytest.fixture
def finished_jobs(queue: Queue, start_worker: Callable[..., SandboxWorker]) -> tuple[str, str, str]:
    """One completed job, one failed by hard timeout after a retry, one failed by error."""
    start_worker("succeed_after", hard_timeout_s=0.5)
    ok = queue.enqueue(0, "fine")
    slow = queue.options(retries=1, backoff_s=0.01).enqueue(30)
    bad = queue.enqueue("not a number")
    for job in (ok, slow, bad):
        job.queue.backend.wait_for_finish(job.id, 30)
    return ok.id, slow.id, bad.id


@pytest.mark.timeout(60)
def test_jobs_lists_outcome_and_error_by_state(
    sq: Run, at: str, finished_jobs: tuple[str, str, str]
) -> None:
    ok, slow, bad = finished_jobs
    code, out, _ = sq(f"jobs {at} --state failed --json")
    rows = {r["id"]: r for r in json.loads(out)}
    assert code == 0 and set(rows) == {slow, bad}
    assert (rows[slow]["outcome"], rows[slow]["attempts"]) == ("hard_timeout", 2)
    assert "killed at the hard deadline" in rows[slow]["error"]
    assert rows[bad]["outcome"] == "error" and "TypeError" in rows[bad]["error"]
    code, out, _ = sq(f"jobs {at} --state failed")
    assert code == 0 and slow in out and bad in out and ok not in out
    assert "hard_timeout" in out and "TypeError" in out
    code, out, _ = sq(f"jobs {at} --json")  # every state
    assert {r["id"] for r in json.loads(out)} == {ok, slow, bad}
    code, out, _ = sq(f"jobs {at} --state waiting")
    assert code == 0 and "no waiting jobs" in out


@pytest.mark.timeout(30)
def test_jobs_keeps_an_id_with_a_newline_on_its_own_row_escaped(
    sq: Run, at: str, queue: Queue
) -> None:
    queue.options(job_id="a\nb").enqueue()
    code, out, _ = sq(f"jobs {at}")
    rows = [line.split() for line in out.splitlines() if "waiting" in line]
    assert code == 0 and rows == [["a\\nb", "waiting", "0"]], out


@pytest.mark.timeout(60)
def test_job_shows_the_full_attempt_history_and_the_result(
    sq: Run, at: str, finished_jobs: tuple[str, str, str]
) -> None:
    ok, slow, _ = finished_jobs
    code, out, _ = sq(f"job {at} {slow} --json")
    data = json.loads(out)
    assert code == 0 and data["state"] == "failed" and data["options"]["retries"] == 1
    first, second = data["history"]
    assert (first["outcome"], first["action"], first["signal"]) == ("hard_timeout", "retry", 9)
    assert (second["outcome"], second["action"]) == ("hard_timeout", "fail")
    assert first["pid"] and first["pid"] != second["pid"]  # the killed child was replaced
    code, out, _ = sq(f"job {at} {slow}")
    assert code == 0 and "2 (stalls: 0)" in out and "SIGKILL" in out and "retry" in out
    assert str(first["pid"]) in out and "killed at the hard deadline" in out
    code, out, _ = sq(f"job {at} {ok} --json")
    assert json.loads(out)["result"] == "fine"
    code, out, _ = sq(f"job {at} {ok}")
    assert '"fine"' in out
    code, out, err = sq(f"job {at} nope")
    assert code == 1 and "no job 'nope'" in err and out == ""


# -- retry, cancel, purge -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_retry_one_or_all_failed(
    sq: Run, at: str, queue: Queue, finished_jobs: tuple[str, str, str]
) -> None:
    ok, slow, bad = finished_jobs
    code, out, err = sq(f"retry {at} {ok}")
    assert code == 1 and "is completed: only failed or cancelled jobs" in err
    code, out, _ = sq(f"retry {at} {bad}")
    assert code == 0 and out.strip() == f"retried job {bad}"
    queue.backend.wait_for_finish(bad, 30)  # it fails again: still not a number
    code, out, _ = sq(f"job {at} {bad}")  # the retry began the budget's count again
    assert code == 0 and "1 charged, 2 in all (stalls: 0)" in out
    code, out, _ = sq(f"retry {at} --all-failed --json")
    assert code == 0 and sorted(json.loads(out)["retried"]) == sorted([slow, bad])
    code, out, _ = sq(f"retry {at.replace(' ', '-none ', 1)} --all-failed")  # none failed
    assert code == 1 and out.strip().startswith("retried 0 failed job(s)"), (code, out)
    for neither_or_both in (f"retry {at}", f"retry {at} {ok} --all-failed"):
        code, out, err = sq(neither_or_both)
        assert code == 2 and "retry takes a job id or --all-failed" in err
    code, out, err = sq(f"retry {at} {ok} extra")
    assert code == 2 and "unrecognized arguments:" in err and "extra" in err


@pytest.mark.timeout(30)
def test_cancel_and_purge(sq: Run, at: str, queue: Queue, queue_name: str) -> None:
    job = queue.enqueue()
    code, out, _ = sq(f"cancel {at} {job.id}")
    assert code == 0 and out.strip() == f"cancelled job {job.id}"
    assert job.state() is JobState.CANCELLED
    code, _, err = sq(f"cancel {at} {job.id}")
    assert code == 1 and "is cancelled: only unfinished jobs" in err
    queue.enqueue()
    queue.enqueue()
    code, out, _ = sq(f"purge {at} --state waiting --state cancelled --json")
    assert json.loads(out) == {"purged": {"waiting": 2, "cancelled": 1}} and code == 0
    assert sum(queue.counts().values()) == 0
    queue.enqueue()
    code, out, err = sq(f"purge {at} --state waiting --state active")
    assert code == 2 and "active jobs cannot be purged" in err
    assert queue.counts()[JobState.WAITING] == 1  # refused before anything was deleted
    code, out, _ = sq(f"purge {at} --state waiting")
    assert out.strip() == f"purged 1 waiting job(s) from queue {queue_name}"


@pytest.mark.timeout(30)
def test_a_read_verb_with_redis_down_is_one_line(queue_name: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    for verb in ("info", "jobs", "job"):
        id_ = " x" if verb == "job" else ""
        assert_one_line_error(cli(f"{verb} {queue_name}{id_} --url {url}"), "unreachable")


# -- the newcomer's walk-through: two workers, one SIGKILLed, the job recovered ------------


@pytest.mark.timeout(90)
def test_a_sigkilled_workers_job_is_recovered_and_info_shows_it(
    sq: Run, at: str, spawn_worker: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    flags = ("--lease-s", "1", "--concurrency", "1")
    procs = [spawn_worker(tmp_path / f"{n}.log", *flags) for n in "ab"]

    def info() -> dict[str, Any]:
        code, out, err = sq(f"info {at} --json")
        assert code == 0, err
        return dict(json.loads(out))

    def holder() -> Any:
        for w in info()["workers"]:
            if any(j["id"] == job_id and j["pid"] for j in w["jobs"]):
                return w
        return None

    wait_for(lambda: len(info()["workers"]) == 2, 30, "both workers to register")
    proc = cli(f"enqueue {at} --args '{json.dumps([str(runs), 'job', 2.0])}'")
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    first = wait_for(holder, 20, "a worker to run the job")
    victim = next(p for p in procs if p.pid == first["pid"])
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    wait_for(
        lambda: (w := holder()) is not None and w["pid"] != first["pid"],
        30,
        "info to show the job running on the other worker",
    )
    survivor = next(p for p in procs if p is not victim)
    wait_for(
        lambda: [w["pid"] for w in info()["workers"]] == [survivor.pid],
        10,
        "the dead worker's registration to expire with its lease",
    )
    code, out, _ = sq(f"enqueue {at} --wait --timeout-s 30 --job-id {job_id}")
    assert code == 0 and out.splitlines() == [job_id, '"job"']
    data = json.loads(sq(f"job {at} {job_id} --json")[1])
    assert (data["state"], data["stalls"]) == ("completed", 1)
    assert [a["outcome"] for a in data["history"]] == ["lease_lost", "ok"]


@pytest.mark.timeout(30)
def test_the_installed_script_and_python_m_both_answer() -> None:
    script = Path(sys.executable).with_name("sandboxq")
    for command in ([str(script)], CLI):
        proc = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=20)
        assert proc.returncode == 0 and "enqueue" in proc.stdout and "exit status" in proc.stdout


@pytest.mark.timeout(30)
def test_a_producer_never_loads_rich() -> None:
    """rich is the command line's: a program that enqueues (or runs a worker) pays nothing."""
    code = (
        "import sys, sandboxq.client, sandboxq.worker\n"
        "from sandboxq import Queue, SandboxWorker\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'rich'], 'rich was loaded'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
