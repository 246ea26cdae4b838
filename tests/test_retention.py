"""Retention is a stated contract (README "Retention"): finished jobs
are kept by age (completed a day, failed and cancelled a week, a job's own option winning),
a count cap only a runaway queue meets bounds memory and, when it trims, is logged and
counted; ``JobNotFound`` says what retention removed. Real redis-server, real workers, both
backends; short times to live and conditions, never long sleeps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import redis

from sandboxq import JobNotFound, Queue
from sandboxq.backends.base import Ack
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.errors import ConfigError
from sandboxq.models import AttemptRecord, JobState, Outcome
from sandboxq.settings import WorkerSettings, from_env
from sandboxq.testing.workers import CLI, BackgroundWorkers

ECHO = "sandboxq.testing.handlers:echo"
EXIT = "sandboxq.testing.handlers:sys_exit"  # exit(3): no exit code mapped, so failed
#: What is kept is tested here, not how children are contained: the process tree mode
#: runs the same on every machine (whatever else manages its control groups).
TREE = {"containment": "process_tree"}


@pytest.fixture
def opened(url: str, queue_name: str) -> Iterator[Callable[..., Queue]]:
    made: list[Queue] = []

    def open_queue(**options: object) -> Queue:
        q = Queue(queue_name, url=url, **options)
        made.append(q)
        return q

    yield open_queue
    for q in made:
        q.close()


def wait_until(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def gone(q: Queue, job_id: str) -> bool:
    return q.backend.get(job_id) is None


# -- what is kept by default ---------------------------------------------------------------


@pytest.mark.timeout(240)
def test_1500_completed_results_are_all_readable_with_default_settings(
    redis_url: str, queue_name: str, workers: BackgroundWorkers
) -> None:
    """The old default kept the newest 1,000 completed jobs: 500 of these were gone."""
    q = Queue(queue_name, url=redis_url)
    try:
        jobs = q.enqueue_many(([i], {}) for i in range(1500))
        workers.burst(q, ECHO, concurrency=2, **TREE)
        assert q.counts()[JobState.COMPLETED] == 1500
        records = q.backend.get_many([job.id for job in jobs])
        assert all(info is not None for info, _ in records)
        assert [job.result(timeout_s=5) for job in jobs] == list(range(1500))
    finally:
        q.close()


# -- age -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_job_past_its_time_to_live_is_gone_and_its_own_option_wins(
    opened: Callable[..., Queue], url: str, workers: BackgroundWorkers, raw: redis.Redis
) -> None:
    q = opened()
    # the queue's own times to live are the worker's settings; its reaper (every 0.05 s)
    # lets finished jobs go even when nothing else finishes
    ttl = {"result_ttl_s": 0.3, "failure_ttl_s": 0.3, "stall_check_s": 0.05, **TREE}
    short = q.enqueue(1)
    kept = q.options(result_ttl_s=3600).enqueue(2)
    echo = workers.start(q, ECHO, **ttl)
    wait_until(lambda: echo.stats.completed == 2)
    workers.stop_all()
    failed = q.enqueue(3)
    failed_kept = q.options(failure_ttl_s=3600).enqueue(3)
    exits = workers.start(q, EXIT, **ttl)
    wait_until(lambda: exits.stats.failed == 2)
    wait_until(lambda: gone(q, short.id) and gone(q, failed.id))
    assert kept.result(timeout_s=1) == 2
    assert failed_kept.state() is JobState.FAILED
    if url.startswith("redis"):  # really gone: hash, history, every index
        keys = QueueKeys(q.name)
        for job_id in (short.id, failed.id):
            assert raw.exists(keys.job_prefix + job_id, keys.history_prefix + job_id) == 0
            for index in (keys.completed, keys.failed, keys.expiry):
                assert raw.zscore(index, job_id) is None
        assert raw.zscore(keys.expiry, kept.id) is not None
    with pytest.raises(JobNotFound, match=r"time to live, the only retention rule.*2 finished"):
        short.result(timeout_s=1)


# -- the count cap -------------------------------------------------------------------------


def scrape(address: tuple[str, int]) -> str:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=5) as r:
        return str(r.read().decode())


@pytest.mark.timeout(60)
def test_the_count_cap_trims_the_oldest_and_logs_and_counts_it(
    opened: Callable[..., Queue],
    workers: BackgroundWorkers,
    caplog: pytest.LogCaptureFixture,
) -> None:
    q = opened()
    first = q.enqueue_many(([i], {}) for i in range(10))
    caplog.set_level(logging.WARNING, logger="sandboxq.retention")
    worker = workers.start(q, ECHO, retain_completed=4, stall_check_s=0.05, metrics_port=0, **TREE)
    wait_until(lambda: worker.stats.completed == 10)
    assert q.counts()[JobState.COMPLETED] == 4
    trimmed = [job for job in first if gone(q, job.id)]
    assert len(trimmed) == 6
    assert worker.metrics_address is not None
    address = worker.metrics_address
    counted = f'sandboxq_jobs_trimmed_total{{queue="{q.name}",reason="cap"}}'
    wait_until(lambda: f"{counted} 6.0" in scrape(address))
    # one line (the reaper may have seen only the first trims of the run: the rest wait
    # for the next line, a minute later at the soonest)
    [line] = [r.getMessage() for r in caplog.records if "count cap" in r.getMessage()]
    logged = re.search(r"(\d+) completed jobs by its count cap of 4 \(retain_completed\)", line)
    assert logged is not None and 1 <= int(logged[1]) <= 6, line
    with pytest.raises(JobNotFound) as caught:
        trimmed[0].result(timeout_s=1)
    message = str(caught.value)
    assert "trimmed by the count cap, the only retention rule that has removed" in message
    assert "6 completed jobs by its count cap of 4 (retain_completed)" in message
    # a second wave is logged once more, later: at most one line a minute (LOG_EVERY_S)
    q.enqueue_many(([i], {}) for i in range(3))
    wait_until(lambda: worker.stats.completed == 13)
    wait_until(lambda: f"{counted} 9.0" in scrape(address))
    assert sum("count cap" in r.getMessage() for r in caplog.records) == 1


class _HeldLine(logging.Handler):
    """Holds the first count-cap line in its logger's own handler (before the root's, where
    caplog reads) until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived, self.let_go = threading.Event(), threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "count cap" in record.getMessage() and not self.arrived.is_set():
            self.arrived.set()
            self.let_go.wait(20)


@pytest.mark.timeout(60)
def test_a_cap_trim_is_counted_only_once_its_line_is_logged(
    opened: Callable[..., Queue], workers: BackgroundWorkers
) -> None:
    """The count came before the line: a scrape read 6 trims and the log had no line yet
    (the test above failed so in a full run). Held inside the logging call, the reaper has
    counted nothing."""
    q = opened()
    q.enqueue_many(([i], {}) for i in range(10))
    held = _HeldLine()
    retention_log = logging.getLogger("sandboxq.retention")
    retention_log.addHandler(held)
    try:
        worker = workers.start(
            q, ECHO, retain_completed=4, stall_check_s=0.05, metrics_port=0, **TREE
        )
        assert held.arrived.wait(20), "no count-cap line"
        assert worker.metrics_address is not None
        counted = f'sandboxq_jobs_trimmed_total{{queue="{q.name}",reason="cap"}}'
        scraped = scrape(worker.metrics_address)
        assert f"{counted} 0.0" in scraped or counted not in scraped, scraped
        held.let_go.set()
        wait_until(lambda: f"{counted} 6.0" in scrape(worker.metrics_address))
    finally:
        held.let_go.set()
        retention_log.removeHandler(held)


def test_job_not_found_says_when_retention_removed_nothing(
    opened: Callable[..., Queue],
) -> None:
    q = opened()
    with pytest.raises(JobNotFound) as caught:
        q.job("never-enqueued").result(timeout_s=1)
    assert "retention has removed no finished job of this queue" in str(caught.value)
    assert caught.value.job_id == "never-enqueued"


# -- bad values ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["result_ttl_s", "failure_ttl_s"])
@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, True, "60"])
def test_a_bad_job_time_to_live_is_refused_naming_it(
    opened: Callable[..., Queue], name: str, bad: object
) -> None:
    with pytest.raises(ConfigError, match=name):
        opened().options(**{name: bad})


@pytest.mark.parametrize(
    "name", ["result_ttl_s", "failure_ttl_s", "retain_completed", "retain_failed"]
)
@pytest.mark.parametrize("bad", [-1, math.nan, True])
def test_a_bad_retention_setting_is_refused_naming_it(name: str, bad: object) -> None:
    from sandboxq import SandboxWorker

    with pytest.raises(ConfigError, match=name):
        SandboxWorker("q", ECHO, url="memory://", **{name: bad})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["result_ttl_s", "failure_ttl_s", "retain_completed"])
def test_a_bad_retention_variable_is_refused_naming_it(name: str) -> None:
    var = "SANDBOXQ_" + name.upper()
    with pytest.raises(ConfigError, match=var):
        from_env(WorkerSettings, {var: "-5"}, queue="q", processor=ECHO)


@pytest.mark.parametrize(
    ("option", "bad"),
    [("result_ttl_s", -1), ("failure_ttl_s", math.nan), ("retain_s", True)],
)
def test_a_bad_backend_retention_option_is_refused_naming_it(
    opened: Callable[..., Queue], option: str, bad: object
) -> None:
    with pytest.raises(ConfigError, match=option):
        opened(**{option: bad})


def test_settings_and_variables_reach_the_backend(queue_name: str) -> None:
    s = from_env(
        WorkerSettings,
        {"SANDBOXQ_RESULT_TTL_S": "60", "SANDBOXQ_RETAIN_FAILED": "7"},
        queue=queue_name,
        processor=ECHO,
        failure_ttl_s=120,
    )
    assert s.retention == {
        "result_ttl_s": 60.0,
        "failure_ttl_s": 120.0,
        "retain_completed": 1_000_000,
        "retain_failed": 7,
    }


# -- the command line ----------------------------------------------------------------------


def sandboxq(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.timeout(90)
def test_the_command_line_sets_a_jobs_and_a_workers_retention(
    redis_url: str, queue_name: str
) -> None:
    added = sandboxq(
        "enqueue", queue_name, "--args", "[1]", "--result-ttl-s", "3600", "--url", redis_url
    )
    assert added.returncode == 0, added.stderr
    kept_id = added.stdout.strip()
    short_id = sandboxq("enqueue", queue_name, "--args", "[2]", "--url", redis_url)
    short_id_text = short_id.stdout.strip()
    # the worker's flag and variable: completed jobs go after 0.2 s unless they say otherwise
    worker = sandboxq(
        "worker", queue_name, ECHO, "--url", redis_url, "--retain-failed", "5",
        "--containment", "process_tree", "--burst",
        env={"SANDBOXQ_RESULT_TTL_S": "0.2", "SANDBOXQ_STALL_CHECK_S": "0.05"},
    )  # fmt: skip
    assert worker.returncode == 0, worker.stderr
    q = Queue(queue_name, url=redis_url)
    try:
        assert q.job(kept_id).info().options.result_ttl_s == 3600
        # the burst worker is gone: the next finish (or check) applies the age rule
        wait_until(lambda: gone_after_tick(q, short_id_text))
        assert q.job(kept_id).result(timeout_s=1) == 1
    finally:
        q.close()
    missing = sandboxq("job", queue_name, short_id_text, "--url", redis_url)
    assert missing.returncode == 1, missing.stderr
    assert "1 finished job past their time to live" in missing.stderr, missing.stderr
    bad = sandboxq("enqueue", queue_name, "--failure-ttl-s", "-1", "--url", redis_url)
    assert bad.returncode == 2 and "failure_ttl_s" in bad.stderr, bad.stderr
    bad = sandboxq("worker", queue_name, ECHO, "--url", redis_url, "--retain-completed", "-1")
    assert bad.returncode == 2 and "retain_completed" in bad.stderr, bad.stderr


def gone_after_tick(q: Queue, job_id: str) -> bool:
    """Whether ``job_id`` is gone once the queue's stalled-job check (which applies the age
    rule, with the queue's default settings here) has run."""
    q.backend.recover_stalled()
    return gone(q, job_id)


@pytest.mark.timeout(60)
def test_batch_members_take_the_option_and_stay_while_their_batch_is_kept(
    opened: Callable[..., Queue], workers: BackgroundWorkers
) -> None:
    """A batch made through a view with ``result_ttl_s=0`` gives its members that option,
    and the batch rule still holds: they stay readable while the batch is kept; a lone
    job with the same option is gone as it completes."""
    q = opened()
    view = q.options(result_ttl_s=0)
    batch = view.batch(([i], {}) for i in range(3))
    lone = view.enqueue(9)
    worker = workers.start(q, ECHO, stall_check_s=0.05, **TREE)
    assert batch.results(timeout_s=20) == [0, 1, 2]
    wait_until(lambda: worker.stats.completed == 4)
    wait_until(lambda: gone(q, lone.id))
    for job in batch.jobs():
        assert job.info().options.result_ttl_s == 0
        assert job.result(timeout_s=1) in (0, 1, 2)


def test_a_job_cancelled_while_running_outlives_its_time_to_live_while_fenced(
    opened: Callable[..., Queue],
) -> None:
    """Design invariant 12: its old owner may still run it until it confirms the child
    dead or the lease runs out, so the id must not be enqueued afresh before; retention
    keeps it (as purge does) and lets it go once the lease would have run out."""
    q = opened()
    job = q.options(failure_ttl_s=0, job_id="fenced").enqueue(1)
    [claimed] = q.backend.claim("w1", 1, lease_s=0.5)
    assert job.cancel()
    q.backend.recover_stalled()  # applies the age rule
    assert job.state() is JobState.CANCELLED
    assert q.options(job_id="fenced").enqueue(2).info().attempts == 1  # not added again
    wait_until(lambda: gone_after_tick(q, job.id), timeout_s=10)
    assert claimed.id == job.id


def test_the_asyncio_client_says_the_same(url: str, queue_name: str) -> None:
    """A count-capped queue, read with ``sandboxq.aio``: its JobNotFound quotes the trims."""
    from sandboxq import aio

    sync = Queue(queue_name, url=url, retain_completed=1)
    try:
        # ids in finishing order: jobs finishing in one millisecond are ordered by id
        jobs = [sync.options(job_id=f"j{i}").enqueue(i) for i in range(3)]
        for job in jobs:  # finished by hand, oldest first: the cap keeps the newest one
            [claimed] = sync.backend.claim("w1", 1, lease_s=30)
            record = AttemptRecord(attempt=claimed.attempt, outcome=Outcome.OK)
            ack = Ack(claimed.id, claimed.token, "complete", record, result=b"1")
            sync.backend.finish_many("w1", [ack])
            assert claimed.id == job.id
            # each in a millisecond of its own: a tie is broken by id, not by age
            after = time.time_ns() // 1_000_000 + 1
            while time.time_ns() // 1_000_000 <= after:
                pass
    finally:
        sync.close()

    async def main() -> str:
        q = aio.Queue(queue_name, url=url)
        try:
            with pytest.raises(JobNotFound) as caught:
                await q.job(jobs[0].id).result(timeout_s=1)
            return str(caught.value)
        finally:
            await q.close()

    message = asyncio.run(main())
    assert "2 completed jobs by its count cap of 1 (retain_completed)" in message


def test_the_count_cap_passes_over_a_job_whose_fence_stands(opened: Callable[..., Queue]) -> None:
    """Design invariant 12 again, for the cap: the cancelled running job stays (the set
    holds one over its cap meanwhile) until its old owner confirms the child dead."""
    q = opened(retain_failed=1)
    running = q.options(job_id="running").enqueue(1)
    [claimed] = q.backend.claim("w1", 1, lease_s=30)
    assert running.cancel()
    # over the cap: the oldest is fenced, so it stays (ids in finishing order: jobs
    # finishing in one millisecond are ordered by id)
    assert q.options(job_id="s2").enqueue(2).cancel()
    assert q.counts()[JobState.CANCELLED] == 2
    assert running.state() is JobState.CANCELLED
    assert q.backend.retention_trims().capped == {}
    assert q.backend.confirm_dead("w1", [(claimed.id, claimed.token)]) == [claimed.id]
    assert q.options(job_id="s3").enqueue(3).cancel()
    assert q.counts()[JobState.CANCELLED] == 1
    assert gone(q, running.id)
    assert q.backend.retention_trims().capped == {"cancelled": 2}


def finish_by_hand(q: Queue, job_id: str) -> None:
    [claimed] = q.backend.claim("w1", 1, lease_s=30)
    assert claimed.id == job_id
    record = AttemptRecord(attempt=claimed.attempt, outcome=Outcome.OK)
    q.backend.finish_many("w1", [Ack(claimed.id, claimed.token, "complete", record)])


def test_job_not_found_says_plainly_when_which_rule_is_not_known(
    opened: Callable[..., Queue],
) -> None:
    q = opened(retain_completed=1)
    # ids in finishing order: jobs finishing in one millisecond are ordered by id
    first, second = q.options(job_id="a1").enqueue(1), q.options(job_id="a2").enqueue(2)
    finish_by_hand(q, first.id)
    finish_by_hand(q, second.id)  # the cap takes the first
    brief = q.options(result_ttl_s=0, job_id="a3").enqueue(3)
    finish_by_hand(q, brief.id)  # the cap takes the second, its time to live this one
    assert q.counts()[JobState.COMPLETED] == 0
    with pytest.raises(JobNotFound) as caught:
        first.result(timeout_s=1)
    message = str(caught.value)
    assert "which rule removed it is not known (no record of a removed job is kept)" in message
    assert "2 completed jobs by its count cap of 1 (retain_completed)" in message
    assert "1 finished job past their time to live" in message
