"""Retention is a stated contract (README "Retention"): finished jobs
are kept by age (completed a day, failed and cancelled a week, a job's own option winning),
a count cap only a runaway queue meets bounds memory and, when it trims, is logged and
counted; ``JobNotFound`` says what retention removed. Real redis-server, real workers, both
backends; short times to live and conditions, never long sleeps.
"""

from __future__ import annotations

import logging
import math
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import redis

from sandboxq import JobNotFound, Queue
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.errors import ConfigError
from sandboxq.models import JobState
from sandboxq.settings import WorkerSettings, from_env
from sandboxq.testing.workers import BackgroundWorkers

ECHO = "sandboxq.testing.handlers:echo"
EXIT = "sandboxq.testing.handlers:sys_exit"  # exit(3): no exit code mapped, so failed


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
        workers.burst(q, ECHO, concurrency=2)
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
    ttl = {"result_ttl_s": 0.3, "failure_ttl_s": 0.3, "stall_check_s": 0.05}
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
    with pytest.raises(JobNotFound, match=r"2 finished jobs past their time to live"):
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
    worker = workers.start(q, ECHO, retain_completed=4, stall_check_s=0.05, metrics_port=0)
    wait_until(lambda: worker.stats.completed == 10)
    assert q.counts()[JobState.COMPLETED] == 4
    trimmed = [job for job in first if gone(q, job.id)]
    assert len(trimmed) == 6
    wait_until(lambda: "count cap" in caplog.text)
    [line] = [r.getMessage() for r in caplog.records if "count cap" in r.getMessage()]
    assert "6 completed jobs by its count cap of 4 (retain_completed)" in line
    assert worker.metrics_address is not None
    metrics = scrape(worker.metrics_address)
    assert f'sandboxq_jobs_trimmed_total{{queue="{q.name}",reason="cap"}} 6.0' in metrics
    with pytest.raises(JobNotFound) as caught:
        trimmed[0].result(timeout_s=1)
    message = str(caught.value)
    assert "which rule removed it is not known" in message
    assert "6 completed jobs by its count cap of 4 (retain_completed)" in message
    # a second wave is logged once more, later: at most one line a minute (LOG_EVERY_S)
    q.enqueue_many(([i], {}) for i in range(3))
    wait_until(lambda: worker.stats.completed == 13)
    wait_until(lambda: 'reason="cap"} 9.0' in scrape(worker.metrics_address or ("", 0)))
    assert sum("count cap" in r.getMessage() for r in caplog.records) == 1


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
