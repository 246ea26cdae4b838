"""A queue key changed by hand (the waiting set turned into a string) stops every call
that changes the queue before it writes anything, naming the key.

A script's error undoes none of the writes before it: a claim that popped a job from
``waiting`` and then met a damaged ``active`` left the job in no set, where neither a
worker nor stall recovery would find it again. So each case damages one key, runs one
call that changes the queue, and checks that the call was refused naming the key and
that every key of the queue is byte for byte as it was; then the key is repaired and the
same call goes through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis

from sandboxq.backends.base import Ack, FinishAction, NewJob
from sandboxq.backends.redis import RedisBackend, records
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.errors import BackendError
from sandboxq.models import AttemptRecord, JobState, Outcome, member_id

pytestmark = pytest.mark.timeout(60)

WORKER = "w-damaged-keys"


@dataclass
class Scene:
    backend: RedisBackend
    keys: QueueKeys
    leases: list[tuple[str, str]]  # claimed, not finished: (job id, token)
    failed_id: str
    batch_id: str


@pytest.fixture
def scene(redis_url: str, queue_name: str) -> Iterator[Scene]:
    backend = RedisBackend(redis_url, queue_name)
    try:
        backend.enqueue([NewJob(b"[[],{}]", job_id=f"j{n}") for n in range(6)])
        claimed = backend.claim(WORKER, 3, lease_s=60)
        failed = claimed.pop()
        backend.finish(WORKER, failed.id, failed.token, "fail", _attempt(), error="x")
        backend.enqueue_batch("b1", [NewJob(b"[[],{}]", job_id=member_id("b1", 0))], label="x")
        leases = [(c.id, c.token) for c in claimed]
        yield Scene(backend, QueueKeys(queue_name), leases, failed.id, "b1")
    finally:
        backend.close()


def _attempt() -> AttemptRecord:
    return AttemptRecord(attempt=1, outcome=Outcome.OK, worker_id=WORKER)


def _finish(s: Scene, action: FinishAction) -> object:
    job_id, token = s.leases[0]
    return s.backend.finish_many(WORKER, [Ack(job_id, token, action, _attempt())], claim=1)


#: Every call that changes a queue, as a worker, a producer or an operator makes it.
CALLS: dict[str, Callable[[Scene], object]] = {
    "enqueue": lambda s: s.backend.enqueue([NewJob(b"[[],{}]", job_id="new")]),
    "enqueue_delayed": lambda s: s.backend.enqueue([NewJob(b"[[],{}]", delay_s=60)]),
    "enqueue_batch": lambda s: s.backend.enqueue_batch(
        "b2", [NewJob(b"[[],{}]", job_id=member_id("b2", 0))]
    ),
    "claim": lambda s: s.backend.claim(WORKER, 2, lease_s=60),
    "complete": lambda s: _finish(s, "complete"),
    "retry": lambda s: _finish(s, "retry"),
    "fail": lambda s: _finish(s, "fail"),
    "requeue": lambda s: _finish(s, "requeue"),
    "renew": lambda s: s.backend.renew(WORKER, s.leases, lease_s=60),
    "release": lambda s: s.backend.release(WORKER, s.leases),
    "cancel_waiting": lambda s: s.backend.cancel("j5"),
    "cancel_running": lambda s: s.backend.cancel(s.leases[0][0]),
    "retry_failed": lambda s: s.backend.retry_failed(s.failed_id),
    "recover_stalled": lambda s: s.backend.recover_stalled(),
    "confirm_dead": lambda s: s.backend.confirm_dead(WORKER, s.leases),
    "purge": lambda s: s.backend.purge(JobState.WAITING),
    "batch_cancel": lambda s: s.backend.batch_each(s.batch_id, "cancel"),
}


def _damageable(keys: QueueKeys) -> list[str]:
    """The queue's keys the scripts write (the worker registry is written by workers
    alone, outside the scripts: its damage is test_sizes_and_types.py's)."""
    return [key for key in records.queue_key_types(keys) if key != keys.workers]


def _snapshot(raw: redis.Redis, keys: QueueKeys) -> dict[bytes, bytes | None]:
    names = sorted(raw.scan_iter(match=f"sq:{{{keys.queue}}}:*", count=1000))
    return {name: raw.dump(name) for name in names}


def _key_names() -> list[str]:
    return [key.rsplit(":", 1)[1] for key in _damageable(QueueKeys("q"))]


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("key_name", _key_names())
def test_a_damaged_queue_key_stops_a_change_before_it_writes_anything(
    raw: redis.Redis, scene: Scene, key_name: str, call: str
) -> None:
    key = next(k for k in _damageable(scene.keys) if k.rsplit(":", 1)[1] == key_name)
    kept = raw.dump(key)
    raw.delete(key)
    raw.set(key, "changed by hand")
    before = _snapshot(raw, scene.keys)
    with pytest.raises(BackendError) as refused:
        CALLS[call](scene)
    assert key in str(refused.value), str(refused.value)
    assert _snapshot(raw, scene.keys) == before, f"{call} wrote before it met {key}"
    raw.delete(key)
    if kept is not None:
        raw.restore(key, 0, kept)
    CALLS[call](scene)  # repaired: the same call goes through
