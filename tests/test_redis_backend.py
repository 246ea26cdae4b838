"""Redis-specific behaviour of ``RedisBackend``, against a real redis-server (no mocks).

The backend contract suite covers what every backend shares; these tests look inside
Redis: server-clock leases, the hash-tagged key layout, owner/token fencing in the Lua
scripts, retention, the wake list, pub/sub cancellation and broken records.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from sandboxq import Queue
from sandboxq.backends import rules
from sandboxq.backends.base import Claimed, FinishAction, NewJob
from sandboxq.backends.redis import RedisBackend
from sandboxq.backends.redis.keys import INDEX, QueueKeys
from sandboxq.errors import BackendError, JobFailed
from sandboxq.models import Action, AttemptRecord, JobOptions, JobState, Outcome
from sandboxq.testing.redis_server import RedisServer, free_port
from sandboxq.testing.workers import BackgroundWorkers

PAYLOAD = b"[[1],{}]"
MakeBackend = Callable[..., RedisBackend]


@pytest.fixture
def make_backend(redis_url: str, queue_name: str) -> Iterator[MakeBackend]:
    made: list[RedisBackend] = []

    def make(**options: Any) -> RedisBackend:
        backend = RedisBackend(redis_url, queue_name, **options)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def backend(make_backend: MakeBackend) -> RedisBackend:
    return make_backend()


def job(job_id: str | None = None, **fields: Any) -> NewJob:
    return NewJob(payload=PAYLOAD, job_id=job_id, **fields)


def record(claimed: Claimed, outcome: Outcome = Outcome.OK, **fields: Any) -> AttemptRecord:
    return AttemptRecord(attempt=claimed.attempt, outcome=outcome, worker_id="w1", **fields)


def server_ms(raw: redis.Redis) -> int:
    sec, usec = raw.time()
    return int(sec * 1000 + usec // 1000)


# -- layout and server time -----------------------------------------------------------------


def test_lease_expiry_is_server_time_plus_lease(backend: RedisBackend, raw: redis.Redis) -> None:
    backend.enqueue([job("a")])
    [claimed] = backend.claim("w1", 1, lease_s=30)
    expiry = raw.zscore(backend.keys.active, "a")
    assert expiry is not None
    assert abs(expiry - (server_ms(raw) + 30_000)) < 1000

    assert backend.renew("w1", [("a", claimed.token)], lease_s=60) == []
    expiry = raw.zscore(backend.keys.active, "a")
    assert expiry is not None
    assert abs(expiry - (server_ms(raw) + 60_000)) < 1000


def test_every_key_of_a_queue_shares_one_hash_tag(
    backend: RedisBackend, raw: redis.Redis, queue_name: str
) -> None:
    backend.enqueue([job("a"), job("b", delay_s=60), job("c"), job("d")])
    [claimed] = backend.claim("w1", 1, lease_s=30)
    backend.finish("w1", claimed.id, claimed.token, "complete", record(claimed), result=b"1")
    [failing] = backend.claim("w1", 1, lease_s=30)
    backend.finish("w1", failing.id, failing.token, "fail", record(failing), error="boom")
    backend.cancel("d")
    backend.register_worker("w1", {"host": "here"}, ttl_s=30)

    keys = [k.decode() for k in raw.scan_iter(match=f"*{queue_name}*")]
    assert len(keys) >= 10
    assert all(k.startswith(f"sq:{{{queue_name}}}:") for k in keys)
    # the queue index is one set for the server (sq:queues), or on a Cluster the slot's own
    in_cluster = QueueKeys(queue_name, cluster=True).script_keys
    slots = {key_slot(k.encode()) for k in [*keys, *in_cluster]}
    assert len(slots) == 1
    assert queue_name.encode() in raw.smembers(INDEX)


# -- ownership (design invariant 1) -----------------------------------------------------------


def test_stale_token_or_owner_is_rejected_and_changes_nothing(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    backend.enqueue([job("a")])
    [claimed] = backend.claim("w1", 1, lease_s=30)
    key = backend.keys.job("a")
    before = (raw.hgetall(key), raw.zscore(backend.keys.active, "a"), raw.xlen(backend.keys.events))

    for worker, token in (("w1", "stale-token"), ("w2", claimed.token)):
        result = backend.finish(worker, "a", token, "complete", record(claimed), result=b"x")
        assert not result.accepted
        assert backend.renew(worker, [("a", token)], lease_s=300) == ["a"]
        assert not backend.record_progress(worker, "a", token, 0.5, "half")
    after = (raw.hgetall(key), raw.zscore(backend.keys.active, "a"), raw.xlen(backend.keys.events))
    assert after == before
    assert raw.llen(backend.keys.history("a")) == 0


def test_late_ack_after_recovery_is_rejected(backend: RedisBackend) -> None:
    backend.enqueue([job("a")])
    [first] = backend.claim("w1", 1, lease_s=0.05)
    time.sleep(0.1)  # the subject: the lease runs out on the server's clock
    assert backend.recover_stalled() == [("a", "waiting")]

    assert backend.renew("w1", [("a", first.token)], lease_s=30) == ["a"]
    assert not backend.finish("w1", "a", first.token, "complete", record(first)).accepted
    info = backend.get("a")
    assert info is not None and info.state is JobState.WAITING and info.stalls == 1
    assert info.outcome is Outcome.LEASE_LOST
    assert info.history[-1].outcome is Outcome.LEASE_LOST and info.history[-1].worker_id == "w1"

    [second] = backend.claim("w2", 1, lease_s=30)
    assert second.id == "a" and second.attempt == 2 and second.token != first.token
    assert not backend.finish("w1", "a", first.token, "complete", record(first)).accepted
    assert backend.finish("w2", "a", second.token, "complete", record(second)).accepted


def test_too_many_stalls_fail_the_job_with_a_stated_cause(backend: RedisBackend) -> None:
    backend.enqueue([job("a", options_json='{"max_stalls": 0}')])
    backend.claim("w1", 1, lease_s=0.02)
    time.sleep(0.05)  # the subject: the lease runs out on the server's clock
    assert backend.recover_stalled() == [("a", "failed")]
    info = backend.get("a")
    assert info is not None and info.state is JobState.FAILED
    assert info.outcome is Outcome.LEASE_LOST
    assert info.error is not None and info.error.startswith("stalled 1 times")
    assert [e.kind for e in backend.events() if e.job_id == "a"][-2:] == ["stalled", "failed"]


def test_recovery_of_a_vanished_record_fails_it_with_a_cause(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    backend.enqueue([job("a")])
    [claimed] = backend.claim("w1", 1, lease_s=0.02)
    assert backend.record_progress("w1", "a", claimed.token, 0.25, None)
    raw.delete(backend.keys.job("a"))
    time.sleep(0.05)  # the subject: the lease runs out on the server's clock
    assert backend.recover_stalled() == [("a", "failed")]
    info = backend.get("a")
    assert info is not None and info.state is JobState.FAILED
    assert info.error == "malformed job record: the job hash is missing"


def test_cancel_revokes_the_lease_and_notifies_the_owner_fast(backend: RedisBackend) -> None:
    backend.enqueue([job("a")])
    [claimed] = backend.claim("w1", 1, lease_s=30)
    seen: list[tuple[str, float]] = []
    arrived = threading.Event()

    def on_cancel(job_id: str, token: str | None) -> None:
        seen.append((job_id, time.monotonic()))
        arrived.set()

    stop = backend.watch_cancellations(on_cancel)
    try:
        sent = time.monotonic()
        assert backend.cancel("a")
        assert arrived.wait(2)
    finally:
        stop()
    assert seen[0][0] == "a" and seen[0][1] - sent < 0.1
    assert backend.renew("w1", [("a", claimed.token)], lease_s=30) == ["a"]
    assert not backend.finish("w1", "a", claimed.token, "complete", record(claimed)).accepted
    info = backend.get("a")
    assert info is not None and info.state is JobState.CANCELLED and info.finished_ms
    assert not backend.cancel("a")
    assert not any(t.name.startswith("sandboxq-cancel-watch") for t in threading.enumerate())


# -- order, delays, retries -----------------------------------------------------------------


def test_unique_job_id_returns_the_existing_id(backend: RedisBackend, raw: redis.Redis) -> None:
    assert backend.enqueue([job("a")]) == [("a", True)]
    payload_before = raw.hget(backend.keys.job("a"), "payload")
    other = NewJob(payload=b'[["other"],{}]', job_id="a")
    assert backend.enqueue([other, job("b"), job("b")]) == [("a", False), ("b", True), ("b", False)]
    assert raw.hget(backend.keys.job("a"), "payload") == payload_before
    assert backend.counts()[JobState.WAITING] == 2


def test_higher_priority_first_fifo_within_a_priority(backend: RedisBackend) -> None:
    priorities = {"p0-1": 0, "p5-1": 5, "p0-2": 0, "n3": -3, "p5-2": 5, "p0-3": 0, "top": 1000}
    backend.enqueue([job(i, priority=p) for i, p in priorities.items()])
    order = [c.id for c in backend.claim("w1", 10, lease_s=30)]
    assert order == ["top", "p5-1", "p5-2", "p0-1", "p0-2", "p0-3", "n3"]


def test_delayed_jobs_are_promoted_when_due(backend: RedisBackend, raw: redis.Redis) -> None:
    backend.enqueue([job("later", delay_s=0.3), job("now")])
    due = raw.zscore(backend.keys.delayed, "later")
    assert due is not None and abs(due - (server_ms(raw) + 300)) < 200
    assert [c.id for c in backend.claim("w1", 5, lease_s=30)] == ["now"]
    assert backend.list_jobs(JobState.DELAYED) == ["later"]
    time.sleep(0.35)  # the subject: the delay passes on the server's clock
    assert [c.id for c in backend.claim("w1", 5, lease_s=30)] == ["later"]


def test_retry_with_backoff_goes_to_delayed(backend: RedisBackend, raw: redis.Redis) -> None:
    backend.enqueue([job("a")])
    [first] = backend.claim("w1", 1, lease_s=30)
    done = backend.finish(
        "w1",
        "a",
        first.token,
        "retry",
        record(first, Outcome.ERROR, action=Action.RETRY),
        error="boom",
        retry_delay_s=0.3,
    )
    assert done.accepted
    due = raw.zscore(backend.keys.delayed, "a")
    assert due is not None and abs(due - (server_ms(raw) + 300)) < 200
    info = backend.get("a")
    assert info is not None and info.state is JobState.DELAYED and info.error == "boom"
    assert backend.claim("w1", 1, lease_s=30) == []
    time.sleep(0.35)  # the subject: the backoff passes on the server's clock
    [second] = backend.claim("w1", 1, lease_s=30)
    assert second.attempt == 2

    retried = backend.finish("w1", "a", second.token, "retry", record(second, Outcome.ERROR))
    assert retried.accepted and backend.list_jobs(JobState.WAITING) == ["a"]


def test_requeue_does_not_charge_an_attempt(backend: RedisBackend) -> None:
    backend.enqueue([job("a"), job("b")])
    [first] = backend.claim("w1", 1, lease_s=30)
    assert first.id == "a" and first.attempt == 1
    interrupted = record(first, Outcome.INTERRUPTED)
    assert backend.finish("w1", "a", first.token, "requeue", interrupted).accepted
    info = backend.get("a")
    assert info is not None and info.state is JobState.WAITING and info.attempts == 0
    assert [h.outcome for h in info.history] == [Outcome.INTERRUPTED]
    [again] = backend.claim("w2", 1, lease_s=30)
    assert again.id == "a" and again.attempt == 1  # and it kept its place ahead of "b"
    assert again.number == 2  # the history keeps counting


def test_finish_claims_the_next_job_in_the_same_call(backend: RedisBackend) -> None:
    backend.enqueue([job("a"), job("b")])
    [a] = backend.claim("w1", 1, lease_s=30)
    done = backend.finish("w1", "a", a.token, "complete", record(a), result=b"42", claim=1)
    assert done.accepted and [c.id for c in done.claimed] == ["b"]
    assert backend.get_result("a") == b"42"
    assert backend.get_result("b") is None


# -- retention and events -------------------------------------------------------------------


def test_retention_trims_finished_jobs_by_count_and_deletes_their_keys(
    make_backend: MakeBackend, raw: redis.Redis
) -> None:
    backend = make_backend(retain_completed=3, retain_failed=2)
    ids = [f"j{i}" for i in range(8)]
    backend.enqueue([job(i) for i in ids])
    for i, claimed in enumerate(backend.claim("w1", 8, lease_s=30)):
        action: FinishAction = "complete" if i < 5 else "fail"
        backend.finish("w1", claimed.id, claimed.token, action, record(claimed), result=b"1")
    assert backend.list_jobs(JobState.COMPLETED) == ["j4", "j3", "j2"]
    assert backend.list_jobs(JobState.FAILED) == ["j7", "j6"]
    for trimmed in ("j0", "j1", "j5"):
        assert raw.exists(backend.keys.job(trimmed), backend.keys.history(trimmed)) == 0
        assert backend.get(trimmed) is None
    assert raw.exists(backend.keys.history("j4")) == 1


def sole(claimed: Claimed, **fields: Any) -> AttemptRecord:
    """A record with nothing to say but where and when the attempt ran, as a worker
    reports a handler that returned."""
    return record(
        claimed,
        action=Action.COMPLETE,
        pid=4242,
        started_ms=1_700_000_000_000,
        ended_ms=1_700_000_000_007,
        **fields,
    )


def test_a_completed_jobs_sole_attempt_is_kept_in_its_hash_and_read_back_whole(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    """A history list costs a retained job a key of its own (344 of its 940 bytes): a
    completed job whose first attempt was its only one keeps that record in its hash,
    and every reader gives it back as the worker sent it."""
    backend.enqueue([job("a")])
    [claimed] = backend.claim("w1", 1, lease_s=30)
    sent = sole(claimed)
    assert backend.finish("w1", "a", claimed.token, "complete", sent, result=b"7").accepted
    assert raw.exists(backend.keys.history("a")) == 0
    info = backend.get("a")
    assert info is not None and info.history == [sent] and not info.unreadable
    detail = backend.job_detail("a")
    assert detail is not None and detail.info.history == [sent]
    assert backend.recent_durations(10) == [("ok", 0.007)]
    # what only a job in line or running needs went with it, and the codec and options
    # that held their defaults: read back as those defaults
    gone = ("seq", "ready_ms", "priority", "max_stalls", "codec", "opts")
    assert raw.hmget(backend.keys.job("a"), gone) == [None] * len(gone)
    assert info.codec == "json" and info.options == JobOptions()


def test_a_sole_attempt_under_a_memory_limit_keeps_its_figures_exactly(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    """Under a memory limit the record carries the limit and the peak: kept in the hash
    too, as the worker wrote them (a float printed anew by Lua would lose digits)."""
    backend.enqueue([job("a"), job("b")])
    got = {c.id: c for c in backend.claim("w1", 2, lease_s=30)}
    sent = {
        "a": sole(got["a"], memory_limit_mb=256.0, peak_memory_mb=12.3),
        "b": sole(got["b"], memory_limit_mb=100.12345678901235, peak_memory_mb=1e-05),
    }
    for i in ("a", "b"):
        assert backend.finish("w1", i, got[i].token, "complete", sent[i]).accepted
        assert raw.exists(backend.keys.history(i)) == 0
        info = backend.get(i)
        assert info is not None and info.history == [sent[i]] and not info.unreadable


def test_an_attempt_with_more_to_say_or_after_another_goes_to_the_history_list(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    ids = ["exit", "other", "retried"]
    backend.enqueue([job(i) for i in ids])
    got = {c.id: c for c in backend.claim("w1", 3, lease_s=30)}
    sent = {
        "exit": sole(got["exit"], exitcode=0, peak_memory_mb=12.5),
        # a record naming another worker than the one that ends it is kept as it came
        "other": sole(got["other"]).model_copy(update={"worker_id": "w9"}),
    }
    for i in ("exit", "other"):
        assert backend.finish("w1", i, got[i].token, "complete", sent[i]).accepted
        assert raw.llen(backend.keys.history(i)) == 1
        info = backend.get(i)
        assert info is not None and info.history == [sent[i]]

    first = record(got["retried"], Outcome.ERROR, action=Action.RETRY, error="boom")
    assert backend.finish("w1", "retried", got["retried"].token, "retry", first).accepted
    [again] = backend.claim("w1", 1, lease_s=30)
    second = sole(again)
    assert second.attempt == 2
    assert backend.finish("w1", "retried", again.token, "complete", second).accepted
    info = backend.get("retried")
    assert info is not None and info.history == [first, second]
    assert raw.llen(backend.keys.history("retried")) == 2


def test_a_sole_attempt_after_records_already_listed_reads_after_them(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    """A job whose numbers started again (a repair of its record sets its attempts to 0)
    may complete at "attempt 1" with records already in its list: the record in the hash
    is the newest, read after them."""
    backend.enqueue([job("a")])
    earlier = AttemptRecord(attempt=1, outcome=Outcome.ERROR, action=Action.FAIL, error="x")
    raw.rpush(backend.keys.history("a"), earlier.model_dump_json(exclude_none=True))
    [claimed] = backend.claim("w1", 1, lease_s=30)
    sent = sole(claimed)
    assert backend.finish("w1", "a", claimed.token, "complete", sent).accepted
    info = backend.get("a")
    assert info is not None and info.history == [earlier, sent] and not info.unreadable
    assert raw.llen(backend.keys.history("a")) == 1


def test_a_sole_attempt_changed_by_hand_is_reported_not_trusted(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    backend.enqueue([job("a")])
    [claimed] = backend.claim("w1", 1, lease_s=30)
    assert backend.finish("w1", "a", claimed.token, "complete", sole(claimed)).accepted
    raw.hset(backend.keys.job("a"), mapping={"pid": "12ab", "started_ms": "x" * 70})
    info = backend.get("a")
    assert info is not None and info.history == []
    assert any("attempt record #1" in line for line in info.unreadable), info.unreadable
    assert backend.recent_durations(10) == []


def test_retention_by_age(make_backend: MakeBackend) -> None:
    backend = make_backend(retain_s=0.05)
    backend.enqueue([job("old"), job("new")])
    old, new = backend.claim("w1", 2, lease_s=30)
    backend.finish("w1", "old", old.token, "complete", record(old))
    time.sleep(0.1)  # the subject: "old" outlives its retention on the server's clock
    backend.finish("w1", "new", new.token, "complete", record(new))
    assert backend.list_jobs(JobState.COMPLETED) == ["new"]


def finished(backend: RedisBackend, ids: list[str], worker: str = "w1", **opts: Any) -> None:
    """Enqueue and complete ``ids`` (with job options ``opts``), one finish call each."""
    backend.enqueue([job(i, options_json=json.dumps(opts)) for i in ids])
    for claimed in backend.claim(worker, len(ids), lease_s=30):
        assert backend.finish(
            worker, claimed.id, claimed.token, "complete", record(claimed)
        ).accepted


@pytest.mark.timeout(30)
def test_a_job_kept_for_the_queues_time_has_no_expiry_entry_and_goes_at_that_time(
    make_backend: MakeBackend, raw: redis.Redis
) -> None:
    """The expiry set cost each retained job 134 bytes; most jobs are kept for the queue's
    time, which their finished set's order already tells."""
    backend = make_backend(result_ttl_s=0.3)
    finished(backend, ["plain"])
    finished(backend, ["own"], result_ttl_s=3600)
    assert raw.zscore(backend.keys.expiry, "plain") is None
    assert raw.zscore(backend.keys.expiry, "own") is not None
    time.sleep(0.35)  # the subject: "plain" outlives the queue's time on the server's clock
    backend.recover_stalled()
    assert backend.list_jobs(JobState.COMPLETED) == ["own"]
    assert raw.exists(backend.keys.job("plain")) == 0


def goes_in_one_read(backend: RedisBackend, raw: redis.Redis, job_id: str) -> None:
    """A plain job finished now is gone after one read past its time (0.3 s): the kept
    jobs before it are not read again."""
    finished(backend, [job_id])
    time.sleep(0.35)
    backend.recover_stalled()
    assert raw.zscore(backend.keys.completed, job_id) is None


@pytest.mark.timeout(30)
def test_jobs_kept_longer_than_the_queues_time_do_not_hold_back_those_that_are_due(
    make_backend: MakeBackend, raw: redis.Redis
) -> None:
    """More jobs with a longer time of their own than one call may read (TRIM_BUDGET)
    finish first: the read passes them over once, and the plain jobs behind them go."""
    backend = make_backend(result_ttl_s=0.3)
    kept = [f"k{i:03}" for i in range(rules.TRIM_BUDGET + 30)]
    finished(backend, kept, result_ttl_s=3600)
    finished(backend, ["p1", "p2"])
    time.sleep(0.35)
    for _ in range(3):
        backend.recover_stalled()
    assert raw.zscore(backend.keys.completed, "p1") is None
    assert raw.zscore(backend.keys.completed, "p2") is None
    assert raw.zcard(backend.keys.completed) == len(kept)
    goes_in_one_read(backend, raw, "p3")


@pytest.mark.timeout(30)
def test_kept_and_plain_jobs_finishing_in_turn_all_go_at_their_times(
    make_backend: MakeBackend, raw: redis.Redis
) -> None:
    """Kept and plain jobs interleaved, more than one read's budget of each: every read
    passes some kept jobs and removes some plain ones, and the position it leaves lets the
    next read go on, never back over the kept ones."""
    backend = make_backend(result_ttl_s=0.3)
    n = rules.TRIM_BUDGET + 20
    for i in range(n):
        finished(backend, [f"k{i:03}"], result_ttl_s=3600)
        finished(backend, [f"p{i:03}"])
    time.sleep(0.35)
    for _ in range(4):  # 2n jobs to read, 100 a call
        backend.recover_stalled()
    left = {i.decode() for i in raw.zrange(backend.keys.completed, 0, -1)}
    assert left == {f"k{i:03}" for i in range(n)}
    goes_in_one_read(backend, raw, "last")


@pytest.mark.timeout(30)
def test_workers_set_differently_keep_each_job_for_its_finishers_time(
    make_backend: MakeBackend, raw: redis.Redis, queue_name: str
) -> None:
    """README: a queue's time to live applies to the jobs that worker finishes. The time
    in force is the first finisher's; another's jobs get an expiry entry each, until the
    jobs kept for the time in force are gone: then the newer time is in force."""
    short = make_backend(result_ttl_s=0.3)
    long = make_backend(result_ttl_s=3600)
    finished(short, ["s1"])
    finished(long, ["l1"], worker="w2")
    assert raw.zscore(long.keys.expiry, "s1") is None
    assert raw.zscore(long.keys.expiry, "l1") is not None
    time.sleep(0.35)
    long.recover_stalled()  # read by the long-lived one: "s1" goes at its own finisher's time
    assert long.list_jobs(JobState.COMPLETED) == ["l1"]
    finished(long, ["l2"], worker="w2")  # every job kept for 0.3 s is gone: 3600 s in force
    assert raw.zscore(long.keys.expiry, "l2") is None
    assert raw.hget(long.keys.trims, "completed_ttl").split()[0] == b"3600000"
    finished(short, ["s2"])
    assert raw.zscore(long.keys.expiry, "s2") is not None


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "aged",
    [
        b"9999999999999 0 0 ",
        b"garbage",
        b"1 1 0 someone-else",
        b"1 5000 0 x",
        b"1 0 9999999999999 ",
    ],
    ids=[
        "ahead-of-the-clock",
        "garbage",
        "a-job-that-moved",
        "more-kept-than-there-are",
        "next-due-past-any-time-to-live",
    ],
)
def test_a_read_position_changed_by_hand_passes_no_job_over(
    make_backend: MakeBackend, raw: redis.Redis, aged: bytes
) -> None:
    backend = make_backend(result_ttl_s=0.3)
    finished(backend, ["a", "b"])
    raw.hset(backend.keys.trims, "completed_aged", aged)
    time.sleep(0.35)
    backend.recover_stalled()
    assert backend.list_jobs(JobState.COMPLETED) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("in_force", [b"garbage", b"300", b"-1 0", b"300 x"])
def test_a_time_in_force_changed_by_hand_reads_as_none_and_keeps_no_job(
    make_backend: MakeBackend, raw: redis.Redis, in_force: bytes
) -> None:
    """A damaged record of the time in force reads as absent: the next finisher's time
    comes in force, and the jobs finished before go at it (the same time here)."""
    backend = make_backend(result_ttl_s=0.3)
    finished(backend, ["a"])
    raw.hset(backend.keys.trims, "completed_ttl", in_force)
    finished(backend, ["b"])
    assert raw.zscore(backend.keys.expiry, "b") is None
    time.sleep(0.35)
    backend.recover_stalled()
    assert backend.list_jobs(JobState.COMPLETED) == []


def test_events_stream_is_capped_by_length(make_backend: MakeBackend, raw: redis.Redis) -> None:
    backend = make_backend(max_events=50)
    backend.enqueue([job() for _ in range(1500)])
    # MAXLEN ~ trims whole stream nodes (100 entries each by default): near, never far over
    assert 50 <= raw.xlen(backend.keys.events) <= 250


def test_events_parse_and_block(backend: RedisBackend) -> None:
    backend.enqueue([job("a")])
    [added] = list(backend.events())
    assert added.kind == "added" and added.job_id == "a"
    timer = threading.Timer(0.1, lambda: backend.claim("w1", 1, lease_s=30))
    timer.start()
    started = time.monotonic()
    [active] = list(backend.events(since=added.id, block_s=0.5))
    timer.join()
    assert active.kind == "active" and active.data == {"worker": "w1", "attempt": "1"}
    assert time.monotonic() - started < 1.5


# -- waking ---------------------------------------------------------------------------------


def test_an_idle_claim_gets_a_new_job_within_milliseconds(make_backend: MakeBackend) -> None:
    worker, producer = make_backend(), make_backend()
    assert worker.claim("w1", 1, lease_s=30) == []  # clears any wake entry
    enqueued_at: list[float] = []

    def produce() -> None:
        time.sleep(0.2)  # the subject: the job comes while the claim is already waiting
        enqueued_at.append(time.monotonic())
        producer.enqueue([job("a")])

    thread = threading.Thread(target=produce)
    thread.start()
    claimed = worker.claim("w1", 1, lease_s=30, wait_s=5)
    woke_at = time.monotonic()
    thread.join()
    assert [c.id for c in claimed] == ["a"]
    assert enqueued_at and woke_at - enqueued_at[0] < 0.05


def test_idle_wait_blocks_instead_of_spinning(backend: RedisBackend) -> None:
    # a busy period leaves wake entries behind; once the queue is empty they must not make
    # idle workers spin
    backend.enqueue([job() for _ in range(50)])
    [current] = backend.claim("w1", 1, lease_s=30)
    while True:
        done = backend.finish("w1", current.id, current.token, "complete", record(current), claim=1)
        if not done.claimed:
            break
        [current] = done.claimed
    started = time.monotonic()
    for _ in range(3):
        assert backend.claim("w1", 1, lease_s=30, wait_s=0.15) == []
    assert time.monotonic() - started >= 0.4


def test_an_idle_claim_takes_a_delayed_job_when_it_falls_due(backend: RedisBackend) -> None:
    backend.enqueue([job("a", delay_s=0.3)])
    backend.claim("w1", 1, lease_s=30, wait_s=0.01)  # consumes the enqueue's wake entry
    started = time.monotonic()
    claimed = backend.claim("w1", 1, lease_s=30, wait_s=5)
    assert 0.15 < time.monotonic() - started < 1.0
    assert [c.id for c in claimed] == ["a"]


def test_wait_for_finish_returns_soon_after_the_job_finishes(backend: RedisBackend) -> None:
    backend.enqueue([job("a")])
    [claimed] = backend.claim("w1", 1, lease_s=30)
    assert backend.wait_for_finish("a", 0.1) is None

    def complete() -> None:
        time.sleep(0.15)  # the subject: the job finishes while wait_for_finish waits
        backend.finish("w1", "a", claimed.token, "complete", record(claimed))

    thread = threading.Thread(target=complete)
    thread.start()
    started = time.monotonic()
    assert backend.wait_for_finish("a", 5) is JobState.COMPLETED
    thread.join()
    assert time.monotonic() - started < 0.4


# -- broken records (design invariant 7) ----------------------------------------------------


def _break_payload(raw: redis.Redis, key: str) -> None:
    raw.hdel(key, "payload")


def _break_opts(raw: redis.Redis, key: str) -> None:
    raw.hset(key, "opts", "\x00garbage{")


def _break_attempts(raw: redis.Redis, key: str) -> None:
    raw.hset(key, "attempts", "many")


def _break_type(raw: redis.Redis, key: str) -> None:
    raw.delete(key)
    raw.set(key, "not a hash")


def _break_missing(raw: redis.Redis, key: str) -> None:
    raw.delete(key)


def _break_options_schema(raw: redis.Redis, key: str) -> None:
    raw.hset(key, "opts", '{"retries": -5}')


@pytest.mark.parametrize(
    ("corrupt", "cause"),
    [
        (_break_payload, "payload field is missing"),
        (_break_opts, "opts field is not a JSON object"),
        (_break_attempts, "attempts field is not a count"),
        (_break_type, "not a hash"),
        (_break_missing, "job hash is missing"),
        (_break_options_schema, "opts field does not validate"),
    ],
)
def test_a_corrupt_record_fails_that_job_on_claim(
    backend: RedisBackend,
    raw: redis.Redis,
    corrupt: Callable[[redis.Redis, str], None],
    cause: str,
) -> None:
    backend.enqueue([job("bad"), job("good")])
    corrupt(raw, backend.keys.job("bad"))
    assert [c.id for c in backend.claim("w1", 2, lease_s=30)] == ["good"]
    info = backend.get("bad")
    assert info is not None and info.state is JobState.FAILED
    assert info.outcome is Outcome.ERROR
    assert info.error is not None and info.error.startswith("malformed job record: ")
    assert cause in info.error
    assert backend.list_jobs(JobState.FAILED) == ["bad"]
    assert backend.counts()[JobState.ACTIVE] == 1


def test_get_of_an_unreadable_state_names_the_job(backend: RedisBackend, raw: redis.Redis) -> None:
    backend.enqueue([job("broken-1")])
    raw.hset(backend.keys.job("broken-1"), "state", "sideways")
    with pytest.raises(BackendError, match=r"broken-1.*state"):
        backend.get("broken-1")


@pytest.mark.parametrize(
    ("field", "value"), [("opts", "{not json"), ("attempts", "x"), ("outcome", "meh")]
)
def test_get_shows_a_job_around_an_unparseable_field_and_names_it(
    backend: RedisBackend, raw: redis.Redis, field: str, value: str
) -> None:
    backend.enqueue([job("broken-1")])
    raw.hset(backend.keys.job("broken-1"), field, value)
    info = backend.get("broken-1")
    assert info is not None and info.state is JobState.WAITING
    assert [u.split(" ")[0] for u in info.unreadable] == [field]


def test_get_of_unparseable_history_or_wrong_type_names_the_job(
    backend: RedisBackend, raw: redis.Redis
) -> None:
    backend.enqueue([job("h"), job("t")])
    raw.rpush(backend.keys.history("h"), "{oops")
    info = backend.get("h")
    assert info is not None and info.history == []
    assert info.unreadable[0].startswith("attempt record #1 (b'{oops')")
    raw.delete(backend.keys.job("t"))
    raw.sadd(backend.keys.job("t"), "x")
    with pytest.raises(BackendError, match="'t'"):
        backend.get("t")


def test_unreachable_redis_raises_backend_error_promptly(queue_name: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    backend = RedisBackend(url, queue_name)
    try:
        for call in (
            lambda: backend.enqueue([job()]),
            lambda: backend.claim("w1", 1, lease_s=30),
            lambda: backend.renew("w1", [("a", "t")], lease_s=30),
            lambda: backend.claim("w1", 1, lease_s=30, wait_s=1),
            lambda: backend.get("a"),
        ):
            started = time.monotonic()
            with pytest.raises(BackendError, match=url.replace(".", r"\.")):
                call()
            assert time.monotonic() - started < 2
    finally:
        backend.close()


# -- bulk and management --------------------------------------------------------------------


def test_bulk_enqueue_spans_several_script_calls(backend: RedisBackend) -> None:
    jobs = [job(f"j{i}") for i in range(1234)] + [job("j7")]
    created = backend.enqueue(jobs)
    assert [c for _, c in created] == [True] * 1234 + [False]
    assert backend.counts()[JobState.WAITING] == 1234
    assert [c.id for c in backend.claim("w1", 3, lease_s=30)] == ["j0", "j1", "j2"]


def test_retry_failed_purge_and_workers(backend: RedisBackend, raw: redis.Redis) -> None:
    backend.enqueue([job("a"), job("b")])
    for claimed in backend.claim("w1", 2, lease_s=30):
        backend.finish("w1", claimed.id, claimed.token, "fail", record(claimed), error="no")
    assert backend.retry_failed("a") and not backend.retry_failed("a")
    info = backend.get("a")
    assert info is not None and info.state is JobState.WAITING and info.attempts == 0
    assert backend.purge(JobState.FAILED) == 1
    assert raw.exists(backend.keys.job("b"), backend.keys.history("b")) == 0
    assert backend.counts() == {s: int(s is JobState.WAITING) for s in JobState}

    backend.register_worker("w1", {"pid": 1}, ttl_s=30)
    backend.register_worker("w2", {"pid": 2}, ttl_s=0.05)
    time.sleep(0.1)  # the subject: w2's registration expires on the server's clock
    [registered] = backend.workers()
    assert {k: registered[k] for k in ("pid", "worker_id", "ttl_ms")} == {
        "pid": 1, "worker_id": "w1", "ttl_ms": 30_000,
    }  # fmt: skip
    assert 0 <= registered["age_ms"] < 5_000  # by the server's clock: its time to live left
    backend.unregister_worker("w1")
    assert backend.workers() == []


@pytest.mark.timeout(60)
def test_a_server_without_functions_runs_every_script_with_evalsha(
    queue_name: str, workers: BackgroundWorkers
) -> None:
    """A server with no FCALL or FUNCTION (one older than Redis 7, or one that renamed
    them away): the first call is refused as an unknown command, and from then on the
    backend sends EVALSHA; a worker runs jobs end to end, batches and retries included."""
    no_functions = ["--rename-command", "FCALL", "", "--rename-command", "FUNCTION", ""]
    with RedisServer(extra_args=no_functions) as server, Queue(queue_name, server.url) as q:
        jobs = q.enqueue_many([((0, i), {}) for i in range(5)])
        batch = q.batch([([0, i], {}) for i in range(3)])
        broken = q.options(retries=1, backoff_s=0.1).enqueue("not a number")
        workers.burst(queue_name, "sandboxq.testing.handlers:succeed_after", url=server.url)
        assert [job.result(timeout_s=10) for job in jobs] == list(range(5))
        assert batch.results(timeout_s=10) == [0, 1, 2]
        with pytest.raises(JobFailed) as failed:
            broken.result(timeout_s=10)
        assert failed.value.attempts == 2
        stats = redis.Redis.from_url(server.url).info("commandstats")
        assert "cmdstat_fcall" not in stats and int(stats["cmdstat_evalsha"]["calls"]) > 5


@pytest.mark.timeout(30)
def test_the_first_calls_after_a_redis_restart_succeed(queue_name: str) -> None:
    """Pooled connections the restarted server closed are replaced before anything is
    sent, and the scripts' library it lost is loaded again: no call fails once Redis is
    back."""
    with RedisServer() as server:
        backend = RedisBackend(server.url, queue_name)
        try:
            backend.enqueue([job("a")])
            [claimed] = backend.claim("w1", 1, lease_s=30)
            server.stop()
            server.start()  # same port, no persistence: an empty server
            assert backend.enqueue([job("b")]) == [("b", True)]
            assert backend.renew("w1", [(claimed.id, claimed.token)], lease_s=30) == ["a"]
            assert [c.id for c in backend.claim("w1", 1, lease_s=30)] == ["b"]
        finally:
            backend.close()


@pytest.mark.timeout(60)
def test_a_claim_counts_its_lease_from_its_write_not_from_making_its_connection(
    redis_server: RedisServer, queue_name: str
) -> None:
    """Behind a slow link, making a connection takes round trips of its own before the
    claim is written. The lease was counted from before them, so a claim on a fresh
    connection arrived with its lease nearly spent locally, and the worker fenced the jobs
    unstarted. It counts from the write now: never more than one round trip old."""
    from tests.support.proxy import TcpProxy

    with TcpProxy("127.0.0.1", redis_server.port, delay_s=0.25) as proxy:
        producer = RedisBackend(redis_server.url, queue_name)
        backend = RedisBackend(proxy.url, queue_name)
        try:
            producer.enqueue([NewJob(b"[[], {}]")])
            began = time.monotonic()
            (claimed,) = backend.claim("w1", 1, lease_s=30)  # on a connection made now
            took = time.monotonic() - began
            assert took > 0.9, f"the claim took {took:.2f} s: the connection was not new"
            assert claimed.claimed_at - began > took - 0.75, (claimed.claimed_at - began, took)
        finally:
            backend.close()
            producer.close()
