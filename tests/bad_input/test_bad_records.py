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
from hypothesis import strategies as st

from sandboxq import Queue
from sandboxq.backends.redis import RedisBackend
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.models import JobState, Outcome

pytestmark = pytest.mark.timeout(120)

Corrupt = Callable[[Any, QueueKeys, str], None]  # (pipeline, keys, job id)


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


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


# -- a waiting job ---------------------------------------------------------------------------


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


# -- what info() shows of a damaged record ---------------------------------------------------


def test_info_reads_a_record_around_its_unreadable_fields(
    redis_url: str, queue_name: str, raw: redis.Redis
) -> None:
    backend = RedisBackend(redis_url, queue_name)
    try:
        q = Queue(queue_name, url=redis_url)
        job = q.enqueue("x")
        raw.hset(backend.keys.job(job.id), mapping={"created_ms": "yesterday", "stalls": "-1"})
        raw.rpush(backend.keys.history(job.id), b'{"attempt": 1, "outcome": "ok"}', b"\xff{")
        info = job.info()
        assert info.state is JobState.WAITING and info.created_ms is None and info.stalls == 0
        assert [h.outcome for h in info.history] == [Outcome.OK]
        assert len(info.unreadable) == 3
        assert any(u.startswith("created_ms (b'yesterday')") for u in info.unreadable)
        assert any(u.startswith("stalls (b'-1')") for u in info.unreadable)
        assert any(u.startswith("attempt record #2 (b'\\xff{')") for u in info.unreadable)
        q.close()
    finally:
        backend.close()
