"""Queue-level numbers read straight from Redis, for the exporter (``sandboxq exporter``).

    discover_queues ── SCAN MATCH sq:{*}:seq / sq:{*}:workers ──► queue names (cached by
                       the caller: it walks the keyspace, so it is not run per scrape)
    read_stats(queues) ── pipeline 1: TIME; per queue 6 ZCARD, the head of waiting,
                          the worker set ──► pipeline 2: the head's ready time, one
                          EXISTS per registered worker ──► QueueStats per queue

Every scrape is two round trips whatever the number of jobs: no job key is ever listed,
and the per-queue commands are a fixed handful (plus one EXISTS per registered worker).
A queue whose keys were changed by hand (a waiting set turned into a string) comes back
``damaged``, with the error: it costs only its own numbers, never the whole scrape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sandboxq.backends.redis import records
from sandboxq.backends.redis.connection import Connections
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.errors import ConfigError
from sandboxq.models import JobState, check_queue_name

#: Keys every queue that was ever used has one of (see keys.py).
_QUEUE_KEYS = ("seq", "workers")
SCAN_COUNT = 1000


@dataclass(slots=True)
class QueueStats:
    queue: str
    jobs: dict[JobState, int] = field(default_factory=dict)
    #: Age of the job at the head of the waiting line (None: nothing waits).
    oldest_waiting_age_s: float | None = None
    workers: int = 0
    #: Why this queue's numbers could not be read (its keys hold the wrong types), or None.
    damaged: str | None = None


def discover_queues(conns: Connections) -> list[str]:
    """Names of the queues on this server, from their queue-level keys (never a job key's
    name is returned: SCAN's MATCH filters on the server)."""
    if conns.cluster:
        raise ConfigError("on a Redis Cluster, name the queues to export (--queue)")
    found: set[str] = set()
    with conns.errors("discover queues"):
        for suffix in _QUEUE_KEYS:
            for key in conns.main.scan_iter(match=f"sq:{{*}}:{suffix}", count=SCAN_COUNT):
                name = records.text(key)[len("sq:{") : -len("}:" + suffix)]
                try:
                    found.add(check_queue_name(name))
                except (ConfigError, ValueError):  # a job id that merely ends like one
                    continue
    return sorted(found)


def read_stats(conns: Connections, queues: Sequence[str]) -> list[QueueStats]:
    """The numbers of ``queues``, in two pipelined round trips."""
    keys = [QueueKeys(q) for q in queues]
    with conns.errors("read queue statistics"):
        pipe = conns.main.pipeline(transaction=False)
        pipe.time()
        for k in keys:
            for state in JobState:
                pipe.zcard(k.state_set(state))
            pipe.zrange(k.waiting, 0, 0)
            pipe.smembers(k.workers)
        # raise_on_error=False: a queue whose keys were damaged by hand answers errors in
        # its own rows, and the other queues are still read
        first: list[Any] = pipe.execute(raise_on_error=False)
        if isinstance(first[0], Exception):
            raise first[0]
        seconds, micros = first[0]
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        per = len(JobState) + 2
        out: list[QueueStats] = []
        pipe = conns.main.pipeline(transaction=False)
        for i, k in enumerate(keys):
            row = first[1 + i * per : 1 + (i + 1) * per]
            if problem := next((v for v in row if isinstance(v, Exception)), None):
                out.append(QueueStats(k.queue, damaged=str(problem)))
                continue
            stats = QueueStats(k.queue, dict(zip(JobState, map(int, row), strict=False)))
            head, workers = row[-2], sorted(row[-1])
            if head:
                pipe.hmget(k.job(records.text(head[0])), ["ready_ms", "created_ms"])
            for worker in workers:
                pipe.exists(k.worker(records.text(worker)))
            out.append(stats)
        second: list[Any] = pipe.execute(raise_on_error=False) if len(pipe) else []
    pos = 0
    for i, stats in enumerate(out):
        if stats.damaged is not None:
            continue
        row = first[1 + i * per : 1 + (i + 1) * per]
        if row[-2]:
            head = second[pos]
            pos += 1
            # a head job whose record is not a hash: its age is unknown, not the scrape's end
            ready, created = (None, None) if isinstance(head, Exception) else head
            since = _int(ready) or _int(created)
            if since is not None:
                stats.oldest_waiting_age_s = max(0, now_ms - since) / 1000
            else:
                stats.oldest_waiting_age_s = 0.0
        else:
            stats.oldest_waiting_age_s = 0.0
        live = second[pos : pos + len(row[-1])]
        pos += len(row[-1])
        stats.workers = sum(1 for flag in live if not isinstance(flag, Exception) and int(flag))
    return out


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
