"""Batch records in Redis corrupted by hand, under a real worker on a real redis-server.

A batch's hash (its counters, time to live, follow-up queue), its stream of finished
members and its key are the batch's bookkeeping, never its members' fate: whatever is
done to them, every member ends completed, the job beside them completes and the worker
goes on. The scripts move a member first and its batch's counters after, in one call;
Redis keeps what a failing script wrote before its error, so a forged field that failed
the bookkeeping left members claimed by no one, out of line, or finished with their acks
refused (and a claim that failed so failed for every job of the queue, every time).

Extends tests/bad_input/test_bad_records.py (a job's own record) to its batch's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from sandboxq import Queue
from sandboxq.backends.base import NewJob
from sandboxq.backends.redis import RedisBackend
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.rules import MAX_BATCH_MEMBERS
from sandboxq.batch import Batch, check_batch_calls
from sandboxq.errors import BackendError, ConfigError, DamagedRecord
from sandboxq.models import JobState
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from tests.support.contract.support import claim_one, finish

from .support import H

pytestmark = pytest.mark.timeout(60)

Corrupt = Callable[[redis.Redis, QueueKeys, str], object]  # (client, keys, batch id)


def _retype(raw: redis.Redis, key: str) -> None:
    raw.delete(key)
    raw.set(key, "not what it should be")


#: What is done to the batch, and whether it can still tell it is done (None: it cannot
#: be read, a damaged record: a count that is none costs the batch its counts).
CORRUPTIONS: dict[str, tuple[Corrupt, bool | None]] = {
    "a counter holds no integer": (lambda r, k, b: r.hset(k.batch(b), "waiting", "many"), None),
    "a counter HINCRBY cannot take": (
        lambda r, k, b: r.hset(k.batch(b), "completed", "1e3"),
        None,
    ),
    "the batch key is a string": (lambda r, k, b: _retype(r, k.batch(b)), None),
    "its stream key is a string": (lambda r, k, b: _retype(r, k.batch_done(b)), True),
    "its time to live is no count": (lambda r, k, b: r.hset(k.batch(b), "ttl_ms", "soon"), True),
    "its follow-up queue is no name": (
        lambda r, k, b: r.hset(k.batch(b), "then", "no {such}!"),
        True,
    ),
}


@pytest.fixture
def url(redis_url: str) -> str:
    """The suite's ``queue`` on Redis alone: the records damaged here are Redis's."""
    return redis_url


def run_members(queue: Queue, batch: Batch) -> None:
    """A worker runs the batch and a job beside it; each ends completed, and the worker is
    still running when it is stopped (``stop_all`` fails the test otherwise)."""
    workers = BackgroundWorkers(join_timeout_s=20)
    workers.start(queue, H + "echo", concurrency=2, lease_s=2.0)
    try:
        beside = queue.enqueue("beside")
        assert beside.result(timeout_s=20) == "beside"
        for i, member in enumerate(batch.jobs()):
            assert member.result(timeout_s=20) == i, member.info()
    finally:
        workers.stop_all(died_of="a corrupt batch record")


@pytest.mark.parametrize("case", CORRUPTIONS.keys())
def test_a_corrupt_batch_record_costs_its_members_nothing(
    queue: Queue, raw: redis.Redis, case: str
) -> None:
    corrupt, done = CORRUPTIONS[case]
    batch = queue.batch([([i], {}) for i in range(6)], then=queue.name + "-then")
    backend = queue.backend
    assert isinstance(backend, RedisBackend)
    corrupt(raw, backend.keys, batch.id)
    run_members(queue, batch)
    assert queue.counts()[JobState.WAITING] == 0
    if done is not None:  # the last member's finish looked at the batch, and said so
        assert batch.progress().done is done
    else:
        with pytest.raises(DamagedRecord):
            batch.progress()


def test_a_batch_whose_time_to_live_is_forged_is_kept_as_long_as_any(
    queue: Queue, raw: redis.Redis
) -> None:
    """A time to live that is not a count read as none: the batch expired the moment it was
    done, and the retention run of the next finish removed its members and results."""
    batch = queue.batch([([i], {}) for i in range(3)])
    backend = queue.backend
    assert isinstance(backend, RedisBackend)
    raw.hset(backend.keys.batch(batch.id), "ttl_ms", "soon")
    run_members(queue, batch)  # its job beside, finished after the batch was done, sweeps
    run_members(queue, batch)  # and once more
    assert [m.state() for m in batch.jobs()] == [JobState.COMPLETED] * 3
    assert batch.progress().done


def test_a_follow_up_to_a_forged_queue_name_is_not_sent_and_says_why(
    queue: Queue, raw: redis.Redis
) -> None:
    """The follow-up's keys are made from the batch's ``then``: a name no queue can have
    (checked when the batch was made) wrote a job under keys outside every queue's."""
    batch = queue.batch([([i], {}) for i in range(2)], then=queue.name + "-then")
    backend = queue.backend
    assert isinstance(backend, RedisBackend)
    raw.hset(backend.keys.batch(batch.id), "then", "no {such}!")
    run_members(queue, batch)
    progress = batch.progress()
    assert progress.done and not progress.then_sent
    assert progress.then_error is not None and "not a queue name" in progress.then_error
    assert raw.keys("*such*") == []


def test_a_done_batch_retyped_before_its_sweep_stops_no_finish(
    queue: Queue, raw: redis.Redis
) -> None:
    """Retention sweeps a batch past its time to live in the finish script of any job: a
    batch key of another type there failed every finish of the queue after its ack."""
    batch = queue.batch([([i], {}) for i in range(2)])
    backend = queue.backend
    assert isinstance(backend, RedisBackend)
    keys = backend.keys
    run_members(queue, batch)
    wait_for(lambda: raw.zscore(keys.batches, batch.id) is not None, 10, "the batch to be done")
    raw.zadd(keys.batches, {batch.id: 0})  # due now
    _retype(raw, keys.batch(batch.id))
    workers = BackgroundWorkers(join_timeout_s=20)
    workers.start(queue, H + "echo", concurrency=1, lease_s=2.0)
    try:
        assert queue.enqueue("after").result(timeout_s=20) == "after"
    finally:
        workers.stop_all(died_of="a corrupt batch record")
    assert raw.zscore(keys.batches, batch.id) is None


def test_a_batch_key_of_another_type_costs_the_batch_list_only_its_row(
    queue: Queue, raw: redis.Redis
) -> None:
    """The dashboard lists a queue's batches in one pipeline: one forged key failed the
    whole list, and the queue's page with it."""
    forged, kept = (queue.batch([([i], {}) for i in range(2)]) for _ in range(2))
    backend = queue.backend
    assert isinstance(backend, RedisBackend)
    _retype(raw, backend.keys.batch(forged.id))
    assert [p.batch_id for p in backend.list_batches()] == [kept.id]


@pytest.mark.parametrize("total", ["99999999999999999999999", "4000000000"])
def test_a_forged_member_count_is_a_damaged_record_not_an_allocation(
    queue: Queue, raw: redis.Redis, total: str
) -> None:
    """A handle keeps a byte per member while it streams them: a forged count made
    ``as_completed`` raise OverflowError, or allocate gigabytes. The handle is refused,
    naming the damage; so is the progress: the batch was sealed with its one member
    enqueued, which no total but 1 allows."""
    batch = queue.batch([([1], {})])
    backend = queue.backend
    assert isinstance(backend, RedisBackend)
    raw.hset(backend.keys.batch(batch.id), "total", total)
    if int(total) < 2**53:  # a count: the progress names it
        with pytest.raises(DamagedRecord, match=f"1 of its {total} members enqueued"):
            batch.progress()
    with pytest.raises(BackendError, match="its record is damaged"):
        queue.get_batch(batch.id)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("total", "-5"),
        ("total", "abc"),
        ("total", "0"),
        ("completed", "999999999999999999999999"),
        ("waiting", "-1"),
    ],
)
def test_a_count_that_is_none_is_a_damaged_record_not_a_zero(
    queue: Queue, raw: redis.Redis, field: str, value: str
) -> None:
    """A total of -5 or abc read as 0: the batch looked empty and done, its results []
    at once, though its members ran on; a count past 2^53 was shown as read."""
    batch = queue.batch([([i], {}) for i in range(3)])
    backend = queue.backend
    assert isinstance(backend, RedisBackend)
    raw.hset(backend.keys.batch(batch.id), field, value)
    damaged = f"its record is damaged \\({field} is "
    with pytest.raises(DamagedRecord, match=damaged):
        batch.progress()
    with pytest.raises(DamagedRecord, match=damaged):
        queue.get_batch(batch.id)
    assert backend.list_batches() == []  # the list loses that row, nothing else


def test_a_batch_over_the_member_limit_is_refused_before_anything_is_sent() -> None:
    class Calls(list[NewJob]):  # as many calls as the limit allows, and one more
        def __len__(self) -> int:
            return MAX_BATCH_MEMBERS + 1

    with pytest.raises(ConfigError, match="at most 10,000,000 calls"):
        check_batch_calls(Calls([NewJob(b"[[], {}]")]), None, None)


def test_counts_past_the_batch_s_total_are_a_damaged_record(queue: Queue, raw: redis.Redis) -> None:
    """A forged 'failed 99999' on a batch of 12 was shown as it was, by ``progress()``,
    ``sandboxq batch`` and ``--json``: no count of members that ended can pass the total."""
    batch = queue.batch([([i], {}) for i in range(12)])
    backend = queue.backend
    assert isinstance(backend, RedisBackend)
    raw.hset(backend.keys.batch(batch.id), "failed", 99999)
    with pytest.raises(DamagedRecord, match="failed") as damaged:
        batch.progress()
    assert "12" in str(damaged.value), damaged.value


@pytest.mark.parametrize(
    ("forged", "named"),
    [
        ({"total": 20}, "12 of its 20"),
        ({"total": 20, "enqueued": 20}, "12 members counted"),
        ({"enqueued": 13}, "13 members enqueued: more than its 12"),
    ],
    ids=["its total", "its total and enqueued", "enqueued past its total"],
)
def test_a_total_past_the_batch_s_members_is_a_damaged_record_not_a_timeout(
    queue: Queue, raw: redis.Redis, forged: dict[str, int], named: str
) -> None:
    """A forged total of 20 on a batch of 12 ended members: ``results()`` waited for 8
    members that never end, until its timeout (``TimeoutError``, or never without one).
    A sealed batch has every member of its total enqueued and counted in some state, so
    such counters are a ``DamagedRecord`` naming them, from every read of the batch."""
    batch = queue.batch([([i], {}) for i in range(12)])
    backend = queue.backend
    assert isinstance(backend, RedisBackend)
    for _ in range(12):
        finish(backend, claim_one(backend), result=b"0")
    raw.hset(backend.keys.batch(batch.id), mapping=forged)
    reads: list[Callable[[], object]] = [  # a handle made now, and the maker's of 12
        lambda: queue.get_batch(batch.id).results(timeout_s=3),
        lambda: batch.results(timeout_s=3),
        lambda: batch.wait(timeout_s=3),
        batch.progress,
    ]
    for read in reads:
        with pytest.raises(DamagedRecord, match="damaged") as damaged:
            read()
        assert named in str(damaged.value), damaged.value
