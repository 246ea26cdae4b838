"""``Queue.batch``: a batch run by real workers, streamed and collected from any handle;
its follow-up sent exactly once when the last two members race on two workers and when a
worker is SIGKILLed during its finish; bad input refused whole.

Real redis-server, real sandboxed children; races forced with a file barrier
(tests/support/gates.py), never with a sleep."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from sandboxq import JobFailed, JobState, Queue
from sandboxq.backends import rules
from sandboxq.backends.base import NewJob
from sandboxq.backends.redis.backend import RedisBackend
from sandboxq.backends.redis.keys import INDEX
from sandboxq.errors import BatchIncomplete, BatchNotFound, ConfigError, SerializationError
from sandboxq.models import member_id
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from tests.support.contract.support import claim_one, finish
from tests.support.server_stats import SCRIPT_COMMANDS

H = "sandboxq.testing.handlers:"
GATES = "tests.support.gates:"


@pytest.fixture
def opened() -> Iterator[Callable[..., Queue]]:
    """``Queue(...)`` for a test, every one closed at its end."""
    made: list[Queue] = []

    def open_queue(*args: Any, **kwargs: Any) -> Queue:
        made.append(Queue(*args, **kwargs))
        return made[-1]

    yield open_queue
    for queue in made:
        queue.close()


def follow_up_args(queue: Queue, batch_id: str) -> list[Any]:
    """The argument lists of the batch's follow-up jobs on ``queue``, in any state."""
    found = []
    for state in JobState:
        for job_id in queue.backend.list_jobs(state, 1000):
            if job_id != batch_id + ".then":
                continue
            detail = queue.backend.job_detail(job_id)
            assert detail is not None and detail.payload is not None
            found.append(json.loads(detail.payload)[0])
    return found


@pytest.mark.timeout(90)
def test_a_batch_runs_streams_and_collects_from_any_handle(
    url: str, queue_name: str, workers: BackgroundWorkers, opened: Callable[..., Queue]
) -> None:
    # retention of one finished job: every member must still be readable (design invariant 14)
    q = opened(queue_name, url, retain_completed=1, retain_failed=1)
    then = opened(queue_name + "-then", url)
    calls: list[tuple[list[Any], dict[str, Any]]] = [([0, i], {}) for i in range(6)]
    calls[3] = (["soon"], {})  # raises TypeError: failed, no retries
    batch = q.batch(calls, then=then.name)
    assert len(batch) == 6 and [j.id for j in batch.jobs()] == [
        member_id(batch.id, i) for i in range(6)
    ]
    workers.start(q, H + "succeed_after", concurrency=2)
    again = opened(queue_name, url).get_batch(batch.id)  # a second handle
    streamed = {job.id for job in again.as_completed(timeout_s=60)}
    assert streamed == {member_id(batch.id, i) for i in range(6)}
    results = batch.results(timeout_s=30)
    assert [r for i, r in enumerate(results) if i != 3] == [0, 1, 2, 4, 5]
    assert isinstance(results[3], JobFailed) and "TypeError" in str(results[3].error)
    progress = batch.progress()
    assert (progress.completed, progress.failed, progress.done) == (5, 1, True)
    summary = {
        "batch_id": batch.id,
        "queue": q.name,
        "total": 6,
        "completed": 5,
        "failed": 1,
        "cancelled": 0,
    }
    assert follow_up_args(then, batch.id) == [[summary]]
    # the failed member again: the batch is not done, then done; no second follow-up
    assert batch.retry_failed() == 1
    again_results = batch.results(timeout_s=30)  # waits for the retried member's new end
    assert isinstance(again_results[3], JobFailed)
    assert len(batch.jobs()[3].info().history) == 2
    assert batch.progress().done
    assert len(follow_up_args(then, batch.id)) == 1


def test_bad_input_is_refused_whole(
    url: str, queue_name: str, opened: Callable[..., Queue]
) -> None:
    q = opened(queue_name, url)
    with pytest.raises(ConfigError, match="at least one call"):
        q.batch([])
    with pytest.raises(ConfigError, match="then: queue name 'no way'"):
        q.batch([([1], {})], then="no way")
    with pytest.raises(SerializationError, match="batch: call #1"):
        q.batch([([1], {}), "not a call"])  # type: ignore[list-item]
    with pytest.raises(SerializationError, match=r"batch: call #2: .*args\[0\] is a set"):
        q.batch([([1], {}), ([2], {}), ([{3}], {})])  # among thousands: which one it was
    with pytest.raises(SerializationError, match="enqueue_many: call #1: "):
        q.enqueue_many([([1], {}), ([object()], {})])
    with pytest.raises(ConfigError, match="job_id"):
        q.options(job_id="x").batch([([1], {})])
    started = time.monotonic()
    with pytest.raises(BatchNotFound, match="does not exist"):
        q.get_batch("0123456789abcdef")
    assert time.monotonic() - started < 1
    with pytest.raises(ConfigError, match="batch id"):
        q.get_batch("a.b")
    assert sum(q.counts().values()) == 0


@pytest.mark.timeout(30)
def test_an_enqueue_stopped_part_way_names_the_members_that_exist(
    redis_url: str, queue_name: str, opened: Callable[..., Queue]
) -> None:
    q = opened(queue_name, redis_url)
    q.options(job_id=member_id("bx", 600)).enqueue(1)  # takes an id of the second chunk
    jobs = [NewJob(b"[[1],{}]", job_id=member_id("bx", i)) for i in range(1000)]
    with pytest.raises(BatchIncomplete, match="only 500 of 1000") as stopped:
        q.backend.enqueue_batch("bx", jobs, then=q.name)
    assert (stopped.value.enqueued, stopped.value.total) == (500, 1000)
    progress = q.get_batch("bx").progress()
    assert (progress.enqueued, progress.waiting, progress.total) == (500, 500, 1000)
    # every member that exists finishes: the batch is not sealed, so never done
    assert q.get_batch("bx").cancel() == 500
    progress = q.get_batch("bx").progress()
    assert progress.cancelled == 500 and not progress.done and not progress.then_sent


@pytest.mark.timeout(30)
def test_a_label_utf8_cannot_carry_is_refused_before_anything_is_sent(
    url: str, queue_name: str, opened: Callable[..., Queue]
) -> None:
    q = opened(queue_name, url)
    with pytest.raises(ConfigError, match="label must be text UTF-8 can carry"):
        q.batch([([1], {})], label="\ud800x")
    assert q.counts()[JobState.WAITING] == 0


@pytest.mark.timeout(60)
def test_a_done_batch_is_read_whole_whatever_the_timeout(
    url: str, queue_name: str, opened: Callable[..., Queue]
) -> None:
    """A timeout bounds the wait for members to finish, not the reading of those that
    have: past it, what the stream holds is still read (here more than one read's worth)."""
    q = opened(queue_name, url)
    batch = q.batch([([i], {}) for i in range(2500)])
    with pytest.raises(TimeoutError, match="2500 of 2500 members not finished within 0 s"):
        batch.wait(timeout_s=0)
    assert batch.cancel() == 2500  # every member final: the batch is done
    for timeout_s in (0, 0.001, -1):
        assert batch.wait(timeout_s=timeout_s).done
        assert len(list(batch.as_completed(timeout_s=timeout_s))) == 2500
        results = batch.results(timeout_s=timeout_s)
        assert len(results) == 2500 and all(isinstance(r, JobFailed) for r in results)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1000, 1001])
def test_wait_after_a_retry_waits_for_the_retried_members(
    url: str, queue_name: str, opened: Callable[..., Queue], size: int
) -> None:
    """The stream holds every member's end, then every retried member's reopening. A
    reader whose read ended between the two (a read holds 1,000 entries: a batch of 1,000)
    saw every member final and took the batch as done: wait() returned at once after
    retry_failed(), and results() read members that were waiting."""
    q = opened(queue_name, url)
    batch = q.batch([([i], {}) for i in range(size)])
    assert batch.cancel() == size and batch.wait(timeout_s=0).done
    assert batch.retry_failed() == size  # nothing runs them: no worker here
    with pytest.raises(TimeoutError, match=f"{size} of {size} members not finished"):
        batch.wait(timeout_s=0.2)
    with pytest.raises(TimeoutError, match=f"{size} of {size} members not finished"):
        batch.results(timeout_s=0)


@pytest.mark.timeout(90)
def test_a_batch_cancelled_under_a_busy_worker_costs_its_log_a_line_per_ack_batch(
    url: str,
    queue_name: str,
    opened: Callable[..., Queue],
    workers: BackgroundWorkers,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker holds hundreds of members ahead while they are short; a cancel revokes
    their leases, and their acks are rejected. That was a warning per job (1,159 lines for
    one cancel of 20,000 members); it is one per batch of acks, with the count."""
    q = opened(queue_name, url)
    # Enough that the cancel lands with thousands left: 3,000 no-op members all ran
    # before it once (a worker runs some 10,000 a second, the wait below looks every 10 ms)
    batch = q.batch([([i], {}) for i in range(20_000)])
    worker = workers.start(q, H + "echo", concurrency=2)
    wait_for(lambda: batch.progress().completed >= 500, 60, "the worker to get going")
    with caplog.at_level(logging.WARNING, logger="sandboxq"):
        batch.cancel()
        assert batch.wait(timeout_s=30).done
        workers.stop_all()
    rejected = worker.stats["rejected_acks"]
    said = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    counted = [int(m.split()[0]) if m[0].isdigit() else 1 for m in said]
    print(f"\n{rejected} acks rejected, in {len(said)} lines")
    assert sum(counted) == rejected
    assert rejected >= 10, "the cancel found no member held ahead: the test proved nothing"
    assert len(said) < rejected


@pytest.mark.timeout(60)
def test_members_a_batch_cancel_has_not_reached_yet_are_never_claimed(
    redis_url: str, queue_name: str, opened: Callable[..., Queue]
) -> None:
    """A cancel goes 1,000 members a call; a worker claiming between two calls leased the
    next members, ran them, and lost their results to the next call. Held here after its
    first call, the cancel's later members come back cancelled from a claim, never leased;
    once the cancel is over, a retry makes them claimable again."""
    q = opened(queue_name, redis_url)
    batch = q.batch([([i], {}) for i in range(2500)])
    backend = q.backend
    assert isinstance(backend, RedisBackend)
    first_call = [batch.id, "cancel", 0, rules.BATCH_CHUNK, backend.keys.cancel_channel]
    assert backend._scripts.batch_each(first_call)[0] == 1000
    assert backend.claim("w1", 5, 30.0) == []  # 100 of them cancelled at most, at once
    cancelled = batch.progress().cancelled
    assert 1000 < cancelled <= 1000 + 100 + 5
    # the rest of the cancel counts what the claim cancelled for it
    assert batch.cancel() == 2500 - 1000 and batch.wait(timeout_s=0).done
    assert batch.retry_failed() == 2500
    assert len(backend.claim("w1", 5, 30.0)) == 5


@pytest.mark.parametrize("mark", ["many", "99999999999999999999"])
def test_a_forged_cancel_mark_costs_no_claim_and_loses_no_job(
    redis_url: str, queue_name: str, opened: Callable[..., Queue], mark: str
) -> None:
    """A batch's cancelling mark is a count the claim adds to; one that is not (forged by
    hand, or past what HINCRBY takes) failed the claim script after it had popped the
    queue's next jobs, so those were out of line for good and every later claim failed
    too. The member is still cancelled, and the jobs beside it are claimed."""
    q = opened(queue_name, redis_url)
    batch = q.batch([([i], {}) for i in range(3)])
    others = [q.enqueue("echo", i) for i in range(3)]
    backend = q.backend
    assert isinstance(backend, RedisBackend)
    redis.Redis.from_url(redis_url).hset(backend.keys.batch(batch.id), "cancelling", mark)
    claimed = backend.claim("w1", 10, 30.0)
    assert sorted(c.id for c in claimed) == sorted(job.id for job in others)
    assert all(job.state() is JobState.CANCELLED for job in batch.jobs())


@pytest.mark.timeout(60)
def test_the_then_queue_is_in_the_queue_index_once_its_follow_up_is_sent(
    redis_url: str, queue_name: str, opened: Callable[..., Queue]
) -> None:
    """``sandboxq queues``, the dashboard and the exporter find queues in the index: the
    queue a follow-up lands on must be there, as any enqueue's queue is."""
    q = opened(queue_name, redis_url)
    then = queue_name + "-then"
    raw = redis.Redis.from_url(redis_url)
    batch = q.batch([([1], {}), ([2], {})], then=then)
    assert not raw.sismember(INDEX, then)
    for _ in range(2):
        finish(q.backend, claim_one(q.backend))
    assert len(follow_up_args(opened(then, redis_url), batch.id)) == 1
    assert raw.sismember(INDEX, then)


@pytest.mark.timeout(120)
def test_the_last_two_members_racing_on_two_workers_send_one_follow_up(
    redis_url: str,
    queue_name: str,
    workers: BackgroundWorkers,
    tmp_path: Path,
    opened: Callable[..., Queue],
) -> None:
    q = opened(queue_name, redis_url)
    then = opened(queue_name + "-then", redis_url)
    for attempt in range(3):  # three rounds: each a fresh race of the last two
        folder = tmp_path / f"round{attempt}"
        folder.mkdir()
        batch = q.batch([([str(folder), 2, i], {}) for i in range(2)], then=then.name)
        if attempt == 0:
            for _ in range(2):  # one child each and nothing prefetched: one member each
                workers.start(q, GATES + "meet", concurrency=1, prefetch=0)
        assert batch.results(timeout_s=60) == [0, 1]
        owners = {job.info().history[-1].worker_id for job in batch.jobs()}
        assert len(owners) == 2, "both members ran on one worker: no race was forced"
        assert len(follow_up_args(then, batch.id)) == 1
    assert len([1 for s in JobState for _ in then.backend.list_jobs(s, 100)]) == 3


def blocked_finish(raw: redis.Redis) -> bool:
    """A client is held by CLIENT PAUSE in a script call carrying an attempt record (a
    finish: a renewal's arguments are a few dozen bytes)."""
    return any(
        client.get("cmd") in SCRIPT_COMMANDS
        and "b" in client.get("flags", "")
        and int(client.get("argv-mem", 0)) > 150
        for client in raw.client_list()
    )


@pytest.mark.timeout(120)
def test_a_worker_killed_during_its_finish_leaves_one_follow_up(
    request: pytest.FixtureRequest,
    redis_url: str,
    queue_name: str,
    workers: BackgroundWorkers,
    tmp_path: Path,
    opened: Callable[..., Queue],
) -> None:
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    request.addfinalizer(raw.close)
    q = opened(queue_name, redis_url)
    then = opened(queue_name + "-then", redis_url)
    log, gate = tmp_path / "log", tmp_path / "gate"
    batch = q.batch([([str(log), str(gate)], {})], then=then.name)
    victim = workers.spawn(
        queue_name,
        GATES + "run_then_wait",
        "--concurrency",
        "1",
        "--lease-s",
        "2",
        url=redis_url,
        new_session=True,
    )
    member = batch.jobs()[0]
    wait_for(lambda: log.exists() and "start" in log.read_text(), 30, "the member to start")
    raw.client_pause(30_000, all=False)  # writes wait; reads go on
    try:
        gate.touch()
        wait_for(lambda: "end" in log.read_text(), 10, "the member to return")
        wait_for(lambda: blocked_finish(raw), 10, "the worker's finish to be sent")
        os.killpg(victim.pid, signal.SIGKILL)  # the worker, its fork server, its child
        victim.wait(10)
    finally:
        raw.client_unpause()
    workers.start(q, GATES + "run_then_wait", concurrency=1, lease_s=2)
    assert batch.wait(timeout_s=60).done
    assert member.result(timeout_s=5) in (1, 2)
    assert len(follow_up_args(then, batch.id)) == 1
    outcomes = [a.outcome for a in member.info().history]
    print(f"\nthe member's attempts: {outcomes}")


@pytest.mark.timeout(120)
def test_a_big_batch_goes_in_round_trips_each_within_the_socket_timeout(
    redis_url: str, queue_name: str, opened: Callable[..., Queue]
) -> None:
    """100,000 members with a 0.5 s socket timeout: sent as one write, the client was still
    writing while the server ran their scripts, and the write timed out (BatchIncomplete,
    after some 1.6 s); sent in round trips of 10,000 members, each answers in time, and so
    do the cancel's and the forget's calls over them."""
    n = 100_000
    q = opened(queue_name, redis_url, socket_timeout_s=0.5)
    batch = q.batch([([i], {}) for i in range(n)])
    progress = batch.progress()
    assert (progress.total, progress.enqueued, progress.waiting) == (n, n, n)
    assert batch.cancel() == n
    batch.forget()
