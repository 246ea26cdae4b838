"""Job records in Redis corrupted by hand, served to a real worker on a real redis-server:
whatever is done to one job's record (bad JSON, missing fields, wrong types, numbers
that are not counts, an unknown state, a key of the wrong type, garbage in or instead of
its history list), that job ends completed or failed with a stated cause, ``job.info()``
can read why, the worker keeps running, and the job beside it completes untouched.

Extends tests/test_worker_faults.py (three corruptions of a waiting job) and
tests/test_redis_backend.py (claim-time checks, one script at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxq import JobFailed, Queue
from sandboxq.backends.redis import RedisBackend
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.models import JobState, Outcome
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from sandboxq.worker import SandboxWorker

from .support import SHARED_ACROSS_EXAMPLES, H

pytestmark = pytest.mark.timeout(120)

Corrupt = Callable[[Any, QueueKeys, str], None]  # (pipeline, keys, job id)


@pytest.fixture
def rqueue(redis_url: str, queue_name: str) -> Iterator[Queue]:
    q = Queue(queue_name, url=redis_url)
    yield q
    q.close()


def _surviving(
    queue_name: str, url: str, processor: str, **options: Any
) -> Iterator[SandboxWorker]:
    """A worker on a thread, for a fixture; at teardown it must still be running."""
    workers = BackgroundWorkers(join_timeout_s=20)
    yield workers.start(queue_name, H + processor, url=url, **options)
    workers.stop_all(died_of="a corrupt record")


@pytest.fixture
def worker(redis_url: str, queue_name: str) -> Iterator[SandboxWorker]:
    """One worker for every example of a test; it must still be running at the end."""
    yield from _surviving(
        queue_name, redis_url, "echo", concurrency=2, lease_s=1.0, stall_check_s=0.1, retries=1
    )


# -- what can be done to a record ------------------------------------------------------------

FIELDS = [
    "payload",
    "codec",
    "opts",
    "state",
    "attempts",
    "stalls",
    "priority",
    "max_stalls",
    "seq",
    "created_ms",
    "finished_ms",
    "outcome",
    "error",
    "owner",
    "token",
    "result",
    "progress",
]
NUMBERS_THAT_ARE_NOT_COUNTS = ["inf", "-inf", "nan", "1e400", "1e21", "-5", "2.5", "0x10", ""]
values = (
    st.sampled_from(NUMBERS_THAT_ARE_NOT_COUNTS)
    | st.sampled_from(["{", "[]", "null", '{"retries": -1}', '{"hard_timeout_s": "soon"}'])
    | st.sampled_from(["waiting", "active", "completed", "sideways", "pickle", "yaml", "json"])
    | st.binary(max_size=40)
    | st.text(max_size=40)
)


@st.composite
def corruptions(draw: st.DrawFn) -> tuple[str, Corrupt]:
    """A description (for failure reports) and a function that applies it."""
    kind = draw(
        st.sampled_from(["set", "set", "set", "delete_field", "retype", "delete", "history"])
    )
    if kind == "set":
        field = draw(st.sampled_from(FIELDS) | st.text(min_size=1, max_size=10))
        value = draw(values)
        return f"set {field}={value!r}", lambda p, k, i: p.hset(k.job(i), field, value)
    if kind == "delete_field":
        field = draw(st.sampled_from(FIELDS))
        return f"delete {field}", lambda p, k, i: p.hdel(k.job(i), field)
    if kind == "retype":
        how = draw(st.sampled_from(["string", "list", "set", "zset"]))
        return f"job key becomes a {how}", lambda p, k, i: _retype(p, k.job(i), how)
    if kind == "delete":
        return "job key deleted", lambda p, k, i: p.delete(k.job(i))
    garbage = draw(st.lists(st.binary(max_size=30), min_size=1, max_size=3))
    if draw(st.booleans()):
        return f"history gets {garbage!r}", lambda p, k, i: p.rpush(k.history(i), *garbage)
    how = draw(st.sampled_from(["string", "set", "zset"]))
    return f"history key is a {how}", lambda p, k, i: _retype(p, k.history(i), how)


def _retype(pipe: Any, key: str, how: str) -> None:
    pipe.delete(key)
    if how == "string":
        pipe.set(key, "not what it should be")
    elif how == "list":
        pipe.rpush(key, "not", "a", "hash")
    elif how == "set":
        pipe.sadd(key, "x")
    else:
        pipe.zadd(key, {"x": 1})


def settle(job: Any) -> tuple[JobState, str | None]:
    """Wait for ``job`` to finish; its final state and, if it failed, the stated cause."""
    try:
        job.result(timeout_s=30)
    except JobFailed as exc:
        assert exc.error, f"job {job.id} failed without a stated cause"
        return JobState.FAILED, exc.error
    return JobState.COMPLETED, None


# -- a waiting job ---------------------------------------------------------------------------


@settings(SHARED_ACROSS_EXAMPLES, max_examples=40)
@given(corruption=corruptions())
def test_a_corrupt_waiting_job_fails_alone_and_the_worker_goes_on(
    raw: redis.Redis, rqueue: Queue, worker: SandboxWorker, corruption: tuple[str, Corrupt]
) -> None:
    what, corrupt = corruption
    keys = QueueKeys(rqueue.name)
    # Enqueued delayed so no worker can take it yet; then, in one transaction (atomic
    # against the worker's scripts), made waiting the way promotion does it, and damaged.
    victim = rqueue.options(delay_s=3600).enqueue("victim")
    beside = rqueue.enqueue("beside")
    with raw.pipeline(transaction=True) as pipe:
        pipe.zrem(keys.delayed, victim.id)
        pipe.hset(keys.job(victim.id), "state", "waiting")
        pipe.zadd(keys.waiting, {victim.id: 0})
        corrupt(pipe, keys, victim.id)
        pipe.lpush(keys.wake, "1")
        pipe.execute()

    assert settle(beside) == (JobState.COMPLETED, None), what
    assert beside.result(timeout_s=1) == "beside"
    state, cause = settle(victim)
    info = victim.info()  # readable, whatever was done to the record
    assert info.state is state, what
    if state is JobState.FAILED:
        assert cause and info.error == cause, what
    assert rqueue.counts()[JobState.ACTIVE] == 0, what  # nothing left behind


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("opts", "said"),
    [
        ('{"hard_timeout_s": "soon"}', "hard_timeout_s: Value error, expected a number"),
        ('{"retries": -1}', "retries: Input should be greater than or equal to 0 (got -1)"),
        ('{"soft_timeout_s": 5, "hard_timeout_s": 1}', "must be less than hard_timeout_s"),
    ],
)
def test_options_that_do_not_validate_fail_their_job_naming_the_option_in_one_line(
    raw: redis.Redis, rqueue: Queue, worker: SandboxWorker, opts: str, said: str
) -> None:
    victim = rqueue.options(delay_s=3600).enqueue("victim")
    keys = QueueKeys(rqueue.name)
    with raw.pipeline(transaction=True) as pipe:
        pipe.zrem(keys.delayed, victim.id)
        pipe.hset(keys.job(victim.id), mapping={"state": "waiting", "opts": opts})
        pipe.zadd(keys.waiting, {victim.id: 0})
        pipe.lpush(keys.wake, "1")
        pipe.execute()
    state, cause = settle(victim)
    assert state is JobState.FAILED and cause is not None
    assert "the opts field does not validate: invalid JobOptions: " in cause, cause
    assert said in cause, cause
    assert "pydantic" not in cause and "\n" not in cause, cause


# -- a running job ---------------------------------------------------------------------------

RUNNING_CORRUPTIONS: list[tuple[str, Corrupt, str | None]] = [
    # (what, corruption, the cause a failed job must state; None: it completes after all)
    ("state unknown", lambda p, k, i: p.hset(k.job(i), "state", "sideways"), "state is sideways"),
    ("state waiting", lambda p, k, i: p.hset(k.job(i), "state", "waiting"), "state is waiting"),
    ("state missing", lambda p, k, i: p.hdel(k.job(i), "state"), "state is (missing)"),
    ("key deleted", lambda p, k, i: p.delete(k.job(i)), "the job hash is missing"),
    ("key a string", lambda p, k, i: _retype(p, k.job(i), "string"), "not a hash"),
    ("owner changed", lambda p, k, i: p.hset(k.job(i), "owner", "someone else"), None),
    ("history a string", lambda p, k, i: _retype(p, k.history(i), "string"), None),
    ("history garbage", lambda p, k, i: p.rpush(k.history(i), b"\xff{"), None),
]


@pytest.fixture
def slow_worker(redis_url: str, queue_name: str) -> Iterator[SandboxWorker]:
    yield from _surviving(
        queue_name, redis_url, "succeed_after", concurrency=2, lease_s=1.0, stall_check_s=0.1
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("what", "corrupt", "cause"), RUNNING_CORRUPTIONS, ids=[c[0] for c in RUNNING_CORRUPTIONS]
)
def test_a_record_corrupted_while_its_job_runs_is_never_lost(
    raw: redis.Redis,
    rqueue: Queue,
    slow_worker: SandboxWorker,
    what: str,
    corrupt: Corrupt,
    cause: str | None,
) -> None:
    """Regression (state unknown/waiting/missing): recovery dropped an expired lease whose
    job was not 'active' as "a stale entry", so the job stayed in no set at all and
    ``result()`` waited forever. (history a string): finish failed half-way, after the
    job had left the active set, with the same end."""
    keys = QueueKeys(rqueue.name)
    # long enough that the corruption lands while it runs, even on a loaded machine
    victim = rqueue.enqueue(1.5, "victim")
    beside = rqueue.enqueue(1.5, "beside")
    wait_for(lambda: victim.state() is JobState.ACTIVE, 20, "the victim to start")
    with raw.pipeline(transaction=True) as pipe:
        corrupt(pipe, keys, victim.id)
        pipe.execute()
    assert beside.result(timeout_s=30) == "beside"
    state, stated = settle(victim)
    info = victim.info()
    if cause is None:
        assert state is JobState.COMPLETED and victim.result(timeout_s=1) == "victim", stated
    else:
        assert state is JobState.FAILED and stated is not None
        assert stated.startswith("malformed job record: ") and cause in stated, stated
        assert info.outcome is Outcome.ERROR
    assert rqueue.counts()[JobState.ACTIVE] == 0


# -- what info() shows of a damaged record ---------------------------------------------------


def test_info_reads_a_record_around_its_unreadable_fields(
    redis_url: str, queue_name: str, raw: redis.Redis
) -> None:
    backend = RedisBackend(redis_url, queue_name)
    try:
        q = Queue(queue_name, url=redis_url)
        job = q.enqueue("x")
        raw.hset(backend.keys.job(job.id), mapping={"created_ms": "yesterday", "stalls": "-1"})
        raw.rpush(
            backend.keys.history(job.id),
            b'{"attempt": 1, "outcome": "ok"}',
            b"\xff{",
            b'{"attempt": 3, "outcome": "ok", "started_ms": 1e400}',
        )
        info = job.info()
        assert info.state is JobState.WAITING and info.created_ms is None and info.stalls == 0
        assert [h.outcome for h in info.history] == [Outcome.OK]
        assert len(info.unreadable) == 4
        # each problem named with its value, without pydantic's link to its own pages
        assert any(
            u.endswith("started_ms: Input should be a finite number (got inf)")
            for u in info.unreadable
        ), info.unreadable
        assert not any("errors.pydantic.dev" in u for u in info.unreadable), info.unreadable
        assert any(u.startswith("created_ms (b'yesterday')") for u in info.unreadable)
        assert any(u.startswith("stalls (b'-1')") for u in info.unreadable)
        assert any(u.startswith("attempt record #2 (b'\\xff{')") for u in info.unreadable)
        q.close()
    finally:
        backend.close()
