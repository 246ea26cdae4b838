"""The read side fuzzed: arbitrary values of arbitrary Redis types written into every key
and field sandboxq reads, then every read path driven (the Python API and the CLI's read
verbs, with ``--json`` and without), while a worker serves the same queue.

Each answer must be a value or a clear error (a ``SandboxqError``, a ``TimeoutError`` for
an unfinished job; for the CLI a one-line ``sandboxq:`` message and exit status 1 or 2):
never a traceback, never a hang (pytest-timeout), and the worker must still be running
at the end. Bounded to about half a minute (``max_examples``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxq import Queue
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.errors import SandboxqError
from sandboxq.testing.workers import BackgroundWorkers
from sandboxq.worker import SandboxWorker

from .support import SHARED_ACROSS_EXAMPLES, H, cli

pytestmark = pytest.mark.timeout(180)

#: A log line of the ``sandboxq`` loggers (the CLI's format), not a command's own output.
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ sandboxq")
JOB = "j1"
WORKER = "w1"
BATCH = "b1"  # a done batch of one member, BATCH + ".0", which failed
BATCH_FIELDS = [
    *("total", "enqueued", "sealed", "waiting", "active", "delayed", "completed", "failed"),
    *("cancelled", "created_ms", "done_ms", "ttl_ms", "then", "then_sent", "then_error"),
    *("label", "cancelling"),
]
JOB_FIELDS = [
    *("state", "codec", "attempts", "stalls", "opts", "created_ms", "finished_ms", "outcome"),
    *("error", "payload", "result", "owner", "token", "progress", "seq"),
]
#: One byte over the read cap of a stored field (``records.MAX_FIELD_BYTES``, 1 MiB).
OVER_THE_CAP = b"x" * ((1 << 20) + 1)
QUEUE_KEYS = ["waiting", "delayed", "active", "completed", "failed", "cancelled", "seq",
              "events", "wake", "workers", "batches", "batch_index"]  # fmt: skip

# -- what can be written ---------------------------------------------------------------------

interesting = st.sampled_from(
    [b"", b"\x00", b"nan", b"-1", b"1e400", b"99999999999999999999999", b"{", b"[]", b"null",
     b'{"attempt": "x"}', b"completed", b"pickle", b"\x1b[31m[red]x[/]", b"\xff\xfe",
     OVER_THE_CAP]
)  # fmt: skip
RECORD_NAMES = [
    *("host", "pid", "jobs", "lease_s", "registered_ms", "started_ms", "id", "attempt"),
    *("outcome", "action", "kind", "job", "lease_renewed_s_ago", "concurrency", "worker_id"),
    *("error", "x"),
]
#: JSON of any shape, with the names sandboxq's records use: the damage that parses.
shaped = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "host",
                    "pid",
                    "jobs",
                    "lease_s",
                    "registered_ms",
                    "started_ms",
                    "id",
                    "attempt",
                    "outcome",
                    "action",
                    "kind",
                    "job",
                    "lease_renewed_s_ago",
                    "concurrency",
                    "worker_id",
                    "error",
                    "x",
                ]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=8,
).map(lambda value: json.dumps(value).encode())
blobs = interesting | st.binary(max_size=40) | shaped
small = st.binary(min_size=1, max_size=12) | interesting.filter(lambda b: 0 < len(b) < 100)
values = st.one_of(
    st.tuples(st.just("string"), blobs),
    st.tuples(st.just("list"), st.lists(blobs, min_size=1, max_size=3)),
    st.tuples(st.just("set"), st.lists(small, min_size=1, max_size=3)),
    st.tuples(
        st.just("zset"),
        st.dictionaries(small, st.floats(allow_nan=False), min_size=1, max_size=3),
    ),
    st.tuples(st.just("hash"), st.dictionaries(small, blobs, min_size=1, max_size=3)),
    st.tuples(st.just("stream"), st.dictionaries(small, blobs, min_size=1, max_size=3)),
)
#: Every place sandboxq reads, drawn uniformly so each gets its share of examples.
TARGETS = [
    *(("field", name) for name in JOB_FIELDS),
    *(("batch-field", name) for name in BATCH_FIELDS),
    *(("member-field", name) for name in ("state", "outcome", "batch", "codec", "result")),
    *(
        ("key", which)
        for which in ["job", "history", "worker", "batch", "bdone", "member", *QUEUE_KEYS]
    ),
    ("history-entry", ""),
    ("event", ""),
    ("batch-entry", ""),
]


@st.composite
def damages(draw: st.DrawFn) -> tuple[str, str, Any]:
    kind, where = draw(st.sampled_from(TARGETS))
    if kind == "key":
        return kind, where, draw(values)
    if kind == "event":
        return kind, where, draw(st.dictionaries(small | st.sampled_from([b"kind", b"job"]),
                                                 blobs, min_size=1, max_size=3))  # fmt: skip
    if kind == "batch-entry":
        return kind, where, draw(st.dictionaries(small | st.sampled_from([b"i", b"s"]),
                                                 blobs, min_size=1, max_size=3))  # fmt: skip
    return kind, where, draw(blobs)


def _key(keys: QueueKeys, which: str) -> str:
    special = {"job": keys.job(JOB), "history": keys.history(JOB), "worker": keys.worker(WORKER),
               "batch": keys.batch(BATCH), "bdone": keys.batch_done(BATCH),
               "member": keys.job(f"{BATCH}.0")}  # fmt: skip
    return special.get(which) or getattr(keys, which)


def _write(pipe: Any, key: str, value: tuple[str, Any]) -> None:
    kind, data = value
    pipe.delete(key)
    if kind == "string":
        pipe.set(key, data)
    elif kind == "list":
        pipe.rpush(key, *data)
    elif kind == "set":
        pipe.sadd(key, *data)
    elif kind == "zset":
        pipe.zadd(key, data)
    elif kind == "hash":
        pipe.hset(key, mapping=data)
    else:
        pipe.xadd(key, data)


def _damage(pipe: Any, keys: QueueKeys, damage: tuple[str, Any, Any]) -> None:
    kind, where, what = damage
    if kind == "field":
        pipe.hset(keys.job(JOB), where, what)
    elif kind == "batch-field":
        pipe.hset(keys.batch(BATCH), where, what)
    elif kind == "member-field":
        pipe.hset(keys.job(f"{BATCH}.0"), where, what)
    elif kind == "batch-entry":
        pipe.xadd(keys.batch_done(BATCH), what)
    elif kind == "history-entry":
        pipe.rpush(keys.history(JOB), what)
    elif kind == "event":
        pipe.xadd(keys.events, what)
    else:
        _write(pipe, _key(keys, where), what)


def _rebuild(raw: redis.Redis, keys: QueueKeys) -> None:
    """A completed job with its history, an event and a registered worker, written as
    sandboxq writes them; every other key of the queue removed."""
    now = int(time.time() * 1000)
    old = list(raw.scan_iter(match=f"sq:{{{keys.queue}}}:*", count=1000))
    with raw.pipeline(transaction=True) as pipe:
        if old:
            pipe.delete(*old)
        pipe.hset(keys.job(JOB), mapping={
            "state": "completed", "codec": "json", "payload": '[["x"],{}]', "opts": "{}",
            "attempts": 1, "stalls": 0, "created_ms": now, "finished_ms": now,
            "outcome": "ok", "result": '"x"'})  # fmt: skip
        pipe.zadd(keys.completed, {JOB: now})
        pipe.rpush(keys.history(JOB), json.dumps({"attempt": 1, "outcome": "ok"}))
        pipe.xadd(keys.events, {"kind": "completed", "job": JOB})
        pipe.set(keys.worker(WORKER), json.dumps({"host": "h", "pid": 1, "jobs": []}), px=60_000)
        pipe.sadd(keys.workers, WORKER)
        member = f"{BATCH}.0"
        pipe.hset(keys.job(member), mapping={  # failed: the batch's failures read it
            "state": "failed", "codec": "json", "payload": "[[1],{}]", "opts": "{}",
            "attempts": 1, "created_ms": now, "finished_ms": now, "outcome": "error",
            "error": "boom", "batch": BATCH})  # fmt: skip
        pipe.zadd(keys.failed, {member: now})
        pipe.hset(keys.batch(BATCH), mapping={
            "total": 1, "enqueued": 1, "sealed": 1, "waiting": 0, "delayed": 0, "active": 0,
            "completed": 0, "failed": 1, "cancelled": 0, "created_ms": now, "done_ms": now,
            "ttl_ms": 3_600_000, "then": "", "label": "fuzzed"})  # fmt: skip
        pipe.xadd(keys.batch_done(BATCH), {"i": "0", "s": "f"})
        pipe.zadd(keys.batches, {BATCH: now + 3_600_000})
        pipe.zadd(keys.batch_index, {BATCH: now})
        pipe.execute()


# -- what must hold --------------------------------------------------------------------------


def _python_reads(q: Queue) -> None:
    job = q.job(JOB)
    reads = {
        "info": job.info,
        "state": job.state,
        "result": lambda: job.result(timeout_s=0.05),
        "counts": q.counts,
        "events": lambda: list(q.events()),
        "workers": q.backend.workers,
        "batch": lambda: q.get_batch(BATCH).progress(),
        "batch members": lambda: list(q.get_batch(BATCH).as_completed(timeout_s=0.05)),
        "batch results": lambda: q.get_batch(BATCH).results(timeout_s=0.05),
        "batches": q.backend.list_batches,
    }
    for name, read in reads.items():
        try:
            read()
        except (SandboxqError, TimeoutError) as exc:
            assert str(exc).strip(), f"{name}: an error without a message ({exc!r})"


def _cli_reads(capsys: pytest.CaptureFixture[str], queue: str, url: str) -> None:
    for verb in (["info", queue], ["jobs", queue], ["job", queue, JOB], ["batch", queue, BATCH]):
        for flags in ([], ["--json"]):
            code, out, err = cli(capsys, *verb, "--url", url, *flags)
            assert code in (0, 1, 2), (verb, flags, code, err)
            assert "Traceback" not in out + err, (verb, flags)
            # The worker on its thread logs to the same stderr: leave its lines out.
            said = [line for line in err.splitlines() if not LOG_LINE.match(line)]
            if code:
                assert len(said) == 1 and said[0].startswith("sandboxq: "), (verb, err)
            elif flags:
                json.loads(out)  # --json output is JSON, whatever was read


@pytest.fixture
def served(redis_url: str, queue_name: str) -> Iterator[SandboxWorker]:
    """A worker on the fuzzed queue for every example; it must survive them all."""
    workers = BackgroundWorkers(join_timeout_s=20)
    yield workers.start(queue_name, H + "echo", url=redis_url, concurrency=1, lease_s=2.0,
                        stall_check_s=0.2)  # fmt: skip
    workers.stop_all(died_of="what was written into its queue")


@settings(SHARED_ACROSS_EXAMPLES, max_examples=150)
@given(damage=st.lists(damages(), min_size=1, max_size=3))
def test_every_read_path_survives_anything_written_into_redis(
    raw: redis.Redis,
    redis_url: str,
    queue_name: str,
    served: SandboxWorker,
    capsys: pytest.CaptureFixture[str],
    damage: list[tuple[str, Any, Any]],
) -> None:
    keys = QueueKeys(queue_name)
    _rebuild(raw, keys)
    with raw.pipeline(transaction=True) as pipe:
        for one in damage:
            _damage(pipe, keys, one)
        pipe.execute(raise_on_error=False)
    with Queue(queue_name, url=redis_url) as q:
        _python_reads(q)
    _cli_reads(capsys, queue_name, redis_url)
