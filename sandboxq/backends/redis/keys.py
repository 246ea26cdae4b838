"""Key names of one queue. Every key carries the queue name as its hash tag (``{queue}``),
so all of a queue's keys live on one Redis Cluster slot and every Lua script can touch
any of them atomically.

    sq:{q}:job:<id>            HASH   one job (payload, codec, opts, state, attempts, ...)
    sq:{q}:history:<id>        LIST   one AttemptRecord JSON per attempt
    sq:{q}:waiting             ZSET   -priority * 2^40 + seq: highest priority first, FIFO within
    sq:{q}:delayed             ZSET   due time ms (server clock)
    sq:{q}:active              ZSET   lease expiry ms (server clock)
    sq:{q}:completed|failed|cancelled  ZSET  finished ms (retention and listing)
    sq:{q}:seq                 STRING sequence counter for FIFO order
    sq:{q}:events              STREAM job events, capped (MAXLEN ~)
    sq:{q}:wake                LIST   one entry per claimable job; idle workers BLPOP it
    sq:{q}:workers             SET    ids of registered workers
    sq:{q}:worker:<id>         STRING a worker's JSON description, with a TTL
    sq:{q}:cancel              pub/sub channel: "<lease token> <job id>" per cancel
    sq:{q}:batch:<bid>         HASH   one batch: its size, counters per state, then, done_ms
    sq:{q}:bdone:<bid>         STREAM one entry per member that reached a final state
    sq:{q}:batches             ZSET   done batches by expiry ms (done_ms + ttl)
    sq:{q}:batch_index         ZSET   every batch kept, by created ms (listing)
    sq:{q}:expiry              ZSET   finished jobs by when retention removes them (ms)
    sq:{q}:trims               HASH   what retention removed: counts, caps, times
                               (common.lua derives these from the job prefix: its batch and
                               retention blocks)

Job ids are chosen by users and may contain anything, ``:`` included, so a key built
from an id is the id appended to a prefix that no other kind of key starts with. (The
history list was once ``sq:{q}:job:<id>:attempts``, which *is* the hash of a job whose
id is ``<id>:attempts``.) The queue name is safe inside the tag: it cannot hold braces.
"""

from __future__ import annotations

from sandboxq.models import JobState


class QueueKeys:
    """The keys of one queue (see the module docstring for what each holds); ``queue`` was
    checked where it entered (the backend that opened it, ``acl.rules``, the exporter)."""

    def __init__(self, queue: str) -> None:
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
        self.workers = base + "workers"
        self.worker_prefix = base + "worker:"
        self.cancel_channel = base + "cancel"
        self.batch_prefix = base + "batch:"
        self.batch_done_prefix = base + "bdone:"
        self.batches = base + "batches"
        self.batch_index = base + "batch_index"
        self.expiry = base + "expiry"
        self.trims = base + "trims"
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
