"""Key names of one queue. Every key carries the queue name as its hash tag (``{queue}``),
so all of a queue's keys live on one Redis Cluster slot and every Lua script can touch
any of them atomically.

    sq:{q}:job:<id>            HASH   one job (payload, codec, opts, state, attempts, ...,
                               child_pid, child_started_ms while active: child_pids.lua);
                               a completed job's sole attempt as worker_id, pid,
                               started_ms, ended_ms and its memory figures
                               (common.lua: sole_attempt)
    sq:{q}:history:<id>        LIST   one AttemptRecord JSON per attempt (any other)
    sq:{q}:waiting             ZSET   -priority * 2^40 + seq: highest priority first, FIFO within
    sq:{q}:delayed             ZSET   due time ms (server clock)
    sq:{q}:active              ZSET   lease expiry ms (server clock)
    sq:{q}:completed|failed|cancelled  ZSET  finished ms (retention and listing)
    sq:{q}:seq                 STRING sequence counter for FIFO order
    sq:{q}:events              STREAM job events, capped (MAXLEN ~)
    sq:{q}:wake                LIST   one entry per claimable job; idle workers BLPOP it
    sq:{q}:unblock:<worker id> LIST   a stopping worker's own entry, ending its BLPOP at
                               once (a few seconds' TTL, popped at once as a rule)
    sq:{q}:workers             SET    ids of registered workers
    sq:{q}:worker:<id>         STRING a worker's JSON description, with a TTL
    sq:{q}:cancel              pub/sub channel: "<lease token> <job id>" per cancel
    sq:{q}:batch:<bid>         HASH   one batch: its size, counters per state, then, done_ms
    sq:{q}:bdone:<bid>         STREAM one entry per member that reached a final state
    sq:{q}:batches             ZSET   done batches by expiry ms (done_ms + ttl)
    sq:{q}:batch_index         ZSET   every batch kept, by created ms (listing)
    sq:{q}:expiry              ZSET   finished jobs not kept for the queue's time to live in
                               force, by when retention removes them (ms)
    sq:{q}:trims               HASH   what retention removed: counts, caps, times; per
                               finished set, the time in force and where the read by
                               age stopped (common.lua: retention)
                               (common.lua derives these from the job prefix: its batch and
                               retention blocks)
    sq:{q}:depth               HASH   minute -> jobs waiting, the last DEPTH_MINUTES
                               (depth.lua, run by each worker's registry refresh)
    sq:queues                  SET    the index of queue names: added by enqueue.lua,
                               batch_enqueue.lua and a worker's registration; readers
                               (dashboard, exporter, ``sandboxq queues``) read it, never SCAN
    sq:queues:{<tag>}          SET    the same on a Cluster, one per hash slot (see below)

Job ids are chosen by users and may contain anything, ``:`` included, so a key built
from an id is the id appended to a prefix that no other kind of key starts with. (The
history list was once ``sq:{q}:job:<id>:attempts``, which *is* the hash of a job whose
id is ``<id>:attempts``.) The queue name is safe inside the tag: it cannot hold braces.

The index and Cluster: a script may touch only keys of its own slot, so one index set
for the whole Cluster could not be written by enqueue.lua. Each slot has an index of its
own instead, ``sq:queues:{<tag>}``, where ``<tag>`` is a short string that hashes to that
slot (``slot_tags``: the first hex number that does, 0.14 s to find all 16,384 once).
A queue's index is its slot's; a reader pipelines one SCARD per slot, then reads the
non-empty ones: no SCAN, and no queue needs naming.
"""

from __future__ import annotations

import functools

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from sandboxq.models import JobState

#: The index of queue names on one Redis server (not a Cluster).
INDEX = "sq:queues"


@functools.cache
def slot_tags() -> tuple[str, ...]:
    """For each Cluster hash slot, a short tag that hashes to it (index ``slot``)."""
    tags: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    left, n = REDIS_CLUSTER_HASH_SLOTS, 0
    while left:
        tag = f"{n:x}"
        slot = key_slot(tag.encode())
        if tags[slot] is None:
            tags[slot] = tag
            left -= 1
        n += 1
    return tuple(t for t in tags if t is not None)


def cluster_index(slot: int) -> str:
    """The index set of one Cluster hash slot."""
    return f"{INDEX}:{{{slot_tags()[slot]}}}"


def index_key(queue: str, cluster: bool) -> str:
    """The index set ``queue`` is registered in: the server's, or on a Cluster its slot's."""
    return cluster_index(key_slot(queue.encode())) if cluster else INDEX


class QueueKeys:
    """The keys of one queue (see the module docstring for what each holds); ``queue`` was
    checked where it entered (the backend that opened it, ``acl.rules``, the exporter).
    ``cluster``: the queue lives on a Redis Cluster (its index is its slot's)."""

    def __init__(self, queue: str, cluster: bool = False) -> None:
        self.queue = queue
        base = f"sq:{{{queue}}}:"
        self.job_prefix = base + "job:"
        self.history_prefix = base + "history:"
        self.waiting = base + "waiting"
        self.delayed = base + "delayed"
        self.active = base + "active"
        self.completed = base + "completed"
        self.failed = base + "failed"
        self.cancelled = base + "cancelled"
        self.seq = base + "seq"
        self.events = base + "events"
        self.wake = base + "wake"
        self.unblock_prefix = base + "unblock:"
        self.workers = base + "workers"
        self.worker_prefix = base + "worker:"
        self.cancel_channel = base + "cancel"
        self.batch_prefix = base + "batch:"
        self.batch_done_prefix = base + "bdone:"
        self.batches = base + "batches"
        self.batch_index = base + "batch_index"
        self.expiry = base + "expiry"
        self.trims = base + "trims"
        self.guard = base + "guard"  # never written (common.lua: guard_queue_keys)
        self.index = index_key(queue, cluster)
        self.depth = base + "depth"  # depth.lua derives it from the job prefix
        #: The KEYS every script receives, in the order common.lua expects.
        self.script_keys: list[str] = [
            self.job_prefix,
            self.waiting,
            self.delayed,
            self.active,
            self.completed,
            self.failed,
            self.cancelled,
            self.seq,
            self.events,
            self.wake,
            self.history_prefix,
        ]
        self._by_state = {
            JobState.WAITING: self.waiting,
            JobState.DELAYED: self.delayed,
            JobState.ACTIVE: self.active,
            JobState.COMPLETED: self.completed,
            JobState.FAILED: self.failed,
            JobState.CANCELLED: self.cancelled,
        }

    def job(self, job_id: str) -> str:
        return self.job_prefix + job_id

    def history(self, job_id: str) -> str:
        return self.history_prefix + job_id

    def batch(self, batch_id: str) -> str:
        return self.batch_prefix + batch_id

    def batch_done(self, batch_id: str) -> str:
        return self.batch_done_prefix + batch_id

    def worker(self, worker_id: str) -> str:
        return self.worker_prefix + worker_id

    def state_set(self, state: JobState) -> str:
        """The ZSET that indexes the jobs in ``state``."""
        return self._by_state[state]
