"""The Redis backend's readers: a job's record and result, counts, ids per state, and the
dashboard's reads (pages.py). Each is one round trip and changes nothing.

    get         read_job.lua: a field or attempt record over the read cap is never sent,
                only its size (design invariant 13: readers trust nothing in Redis)
    get_result  read_result.lua: the same for a result
                (the asyncio client sends the same scripts and reads their replies with
                the same functions: read_job_args, job_from_reply, ...)
    counts, list_jobs   ZCARD per state (one pipeline), ZRANGE / ZREVRANGE
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sandboxq.backends.base import JobDetail, JobPage, JobStanding, QueueSummary
from sandboxq.backends.redis import pages, records
from sandboxq.backends.redis.connection import Connections
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.redis.scripts import Arg, Script, Scripts, run, send
from sandboxq.codec import DEFAULT_MAX_BYTES as MAX_RESULT_BYTES
from sandboxq.errors import DamagedRecord, SerializationError
from sandboxq.finished import Trims
from sandboxq.models import JobInfo, JobState

#: Jobs whose outcome one read_outcome.lua call reads: a call a job made the grouping of
#: 100,000 cancelled members take 4.6 s instead of 3.4 through HMGETs; a call holds the
#: server a millisecond or so for these.
OUTCOMES_PER_CALL = 250


class Reads:
    queue: str
    keys: QueueKeys
    _conns: Connections
    _scripts: Scripts

    def get(self, job_id: str) -> JobInfo | None:
        with self._conns.errors(f"read job {job_id!r}"):
            reply = self._scripts.read_job(read_job_args(job_id))
        return job_from_reply(self.queue, self.keys, job_id, reply)

    def get_result(self, job_id: str) -> bytes | None:
        with self._conns.errors(f"read the result of job {job_id!r}"):
            reply = self._scripts.read_result(read_result_args(job_id))
        return result_from_reply(job_id, reply)

    def get_arguments(self, job_id: str) -> bytes | None:
        # Two plain reads any reader may run (acl.py): the size first, so a payload over
        # the cap, written by hand, is never read.
        key = self.keys.job(job_id)
        with self._conns.errors(f"read the arguments of job {job_id!r}"):
            size = self._conns.main.hstrlen(key, "payload")
            if size > records.MAX_PAYLOAD_BYTES:
                raise SerializationError(
                    f"job {job_id!r}: the arguments are "
                    f"{records.over_cap(size, records.MAX_PAYLOAD_BYTES)}; they were not read"
                )
            [payload] = self._conns.main.hmget(key, ["payload"])
        return payload if isinstance(payload, bytes) else None

    def get_many(self, job_ids: Sequence[str]) -> list[tuple[JobInfo | None, bytes | None]]:
        calls: list[tuple[Script | None, bytes]] = []
        read_job, read_result = self._scripts.read_job, self._scripts.read_result
        for job_id in job_ids:
            calls.append((read_job, read_job.pack(read_job_args(job_id))))
            calls.append((read_result, read_result.pack(read_result_args(job_id))))
        with self._conns.errors(f"read {len(job_ids)} jobs"):
            replies = run(self._conns.main_lane, calls) if calls else []
        return [
            (
                job_from_reply(self.queue, self.keys, job_id, replies[2 * i]),
                result_from_reply(job_id, replies[2 * i + 1]),
            )
            for i, job_id in enumerate(job_ids)
        ]

    def completed_results(self, job_ids: Sequence[str]) -> list[tuple[str, bytes | None] | None]:
        read_result = self._scripts.read_result
        calls: list[tuple[Script | None, bytes]] = [
            (read_result, read_result.pack(read_result_args(job_id))) for job_id in job_ids
        ]
        with self._conns.errors(f"read the results of {len(job_ids)} jobs"):
            replies = run(self._conns.main_lane, calls) if calls else []
        return [completed_from_reply(job_id, r) for job_id, r in zip(job_ids, replies, strict=True)]

    def outcomes(self, job_ids: Sequence[str]) -> list[JobStanding | None]:
        read_outcome = self._scripts.read_outcome
        chunks = [
            job_ids[i : i + OUTCOMES_PER_CALL] for i in range(0, len(job_ids), OUTCOMES_PER_CALL)
        ]
        calls: list[tuple[Script | None, bytes]] = [
            (read_outcome, read_outcome.pack(list(chunk))) for chunk in chunks
        ]
        with self._conns.errors(f"read the outcomes of {len(job_ids)} jobs"):
            # an error reply costs its chunk's jobs their answers alone (the script reads
            # no key of another type: a job key written as one reads as no job)
            replies = send(self._conns.main_lane, calls) if calls else []
        standings: list[JobStanding | None] = []
        for chunk, reply in zip(chunks, replies, strict=True):
            rows = reply if isinstance(reply, list) and len(reply) == len(chunk) else []
            standings += [records.standing(row) for row in rows] or [None] * len(chunk)
        return standings

    def counts(self) -> dict[JobState, int]:
        with self._conns.errors("count jobs"):
            pipe = self._conns.main.pipeline(transaction=False)
            for state in JobState:
                pipe.zcard(self.keys.state_set(state))
            sizes = pipe.execute()
        return {state: int(n) for state, n in zip(JobState, sizes, strict=True)}

    def list_jobs(self, state: JobState, limit: int = 100) -> list[str]:
        state = JobState(state)
        if limit <= 0:
            return []
        key = self.keys.state_set(state)
        ids: Any
        with self._conns.errors(f"list {state.value} jobs"):
            if state.finished:
                ids = self._conns.main.zrevrange(key, 0, limit - 1)
            else:
                ids = self._conns.main.zrange(key, 0, limit - 1)
        return [records.text(job_id) for job_id in ids]

    # -- reads for the dashboard (pages.py) ---------------------------------------------------

    @functools.cached_property
    def _pages(self) -> pages.Pages:
        return pages.Pages(self.keys, self._conns.main_lane, self._scripts.library)

    def job_page(
        self,
        state: JobState,
        cursor: str | None = None,
        limit: int = 50,
        outcome: str | None = None,
    ) -> JobPage:
        with self._conns.errors(f"read a page of {JobState(state).value} jobs"):
            return self._pages.job_page(state, cursor, limit, outcome)

    def job_detail(self, job_id: str) -> JobDetail | None:
        # The record and its history as every reader takes them in (read_job.lua: each
        # field and attempt record capped, the newest HISTORY_CAP records, damage listed),
        # then the payloads, each read only when its size is within its cap.
        info = self.get(job_id)
        if info is None:
            return None
        key, caps = self.keys.job(job_id), _DETAIL_CAPS
        with self._conns.errors(f"read job {job_id!r}"):
            pipe = self._conns.main.pipeline(transaction=False)
            for name in caps:
                pipe.hstrlen(key, name)
            sizes = pipe.execute(raise_on_error=False)
            wanted = [
                name
                for name, size in zip(caps, sizes, strict=True)
                if isinstance(size, int) and 0 < size <= caps[name]
            ]
            values = self._conns.main.hmget(key, wanted) if wanted else []
        found = {
            name.encode(): v for name, v in zip(wanted, values, strict=True) if isinstance(v, bytes)
        }
        unread = [
            f"{name}: {records.over_cap(size, caps[name])}"
            for name, size in zip(caps, sizes, strict=True)
            if isinstance(size, int) and size > caps[name]
        ]
        if unread:
            info = info.model_copy(update={"unreadable": [*info.unreadable, *unread]})
        return pages.job_detail(info, found)

    def summary(self) -> QueueSummary:
        with self._conns.errors("read the queue's summary"):
            return self._pages.summary()

    def retention_trims(self) -> Trims:
        with self._conns.errors("read what retention removed"):
            raw = self._conns.main.hmget(self.keys.trims, Trims.FIELDS)
        return trims_from_reply(raw)


# -- one job, for the sync and the asyncio client alike --------------------------------------


#: A job page's fields beyond those ``get`` reads, and the most of each it takes in.
_DETAIL_CAPS = {
    "payload": records.MAX_PAYLOAD_BYTES,
    "result": MAX_RESULT_BYTES,
    "progress": records.MAX_FIELD_BYTES,
    "progress_message": records.MAX_FIELD_BYTES,
}


def trims_from_reply(raw: Sequence[Any]) -> Trims:
    """The trims hash's fields (HMGET of ``Trims.FIELDS``); one that is not a count (a
    hand-written value) reads as missing: readers trust nothing in Redis."""
    fields: dict[str, int | None] = {}
    for name, value in zip(Trims.FIELDS, raw, strict=True):
        try:
            fields[name] = int(value) if value is not None else None
        except ValueError:
            fields[name] = None
    return Trims.from_fields(fields)


def read_job_args(job_id: str) -> list[Arg]:
    """read_job.lua's arguments: the job, the read caps, the fields ``JobInfo`` needs."""
    return [job_id, records.MAX_FIELD_BYTES, records.MAX_HISTORY, *records.INFO_FIELDS]


def job_from_reply(queue: str, keys: QueueKeys, job_id: str, reply: Any) -> JobInfo | None:
    """``JobInfo`` from read_job.lua's reply: None when there is no such job, a
    ``BackendError`` when its key is not a hash, the oversized or damaged parts listed."""
    fields = records.INFO_FIELDS
    kind, history_kind = records.text(reply[0]), records.text(reply[1])
    if kind == "none":
        return None
    if kind != "hash":
        raise DamagedRecord(
            f"job {job_id!r} in queue {queue!r}: its record "
            f"{keys.job(job_id)} holds a {kind}, not a hash (changed by hand?)"
        )
    total, sizes, values, history = reply[2:6]
    oversized = {
        name: int(size)
        for name, size in zip(fields, sizes, strict=True)
        if size > records.MAX_FIELD_BYTES
    }
    found = {
        name.encode(): value
        for name, value in zip(fields, values, strict=True)
        if value is not None and name not in oversized
    }
    damaged = []
    if history_kind not in ("list", "none"):
        damaged.append(f"history: {keys.history(job_id)} holds a {history_kind}, not a list")
    running = None
    if len(reply) > 6 and reply[6]:
        expiry, owner_record = reply[6]
        running = records.running_attempt(
            job_id, found, float(expiry) if expiry else None, owner_record or None
        )
    return records.job_info(
        queue,
        job_id,
        found,
        history,
        oversized=oversized,
        damaged=damaged,
        history_total=int(total),
        running=running,
    )


def read_result_args(job_id: str) -> list[Arg]:
    """read_result.lua's arguments: the job and the largest result a reader takes in."""
    return [job_id, MAX_RESULT_BYTES]


def result_from_reply(job_id: str, reply: Any) -> bytes | None:
    """A completed job's encoded result from read_result.lua's reply (None: not completed,
    or none stored); ``SerializationError`` when it is over the cap."""
    state, size, result = reply[:3]
    if state != b"completed" or not size:
        return None
    if size > MAX_RESULT_BYTES:
        raise SerializationError(
            f"job {job_id!r}: the result is {records.over_cap(size, MAX_RESULT_BYTES)}"
            "; it was not read"
        )
    return None if result is None else bytes(result)


def completed_from_reply(job_id: str, reply: Any) -> tuple[str, bytes | None] | None:
    """A completed job's codec and encoded result from read_result.lua's reply (None: the
    job is not completed, or there is no such job); ``SerializationError`` for a result
    over the cap. A codec over its cap is named by its size, which no reader allows."""
    data = result_from_reply(job_id, reply)
    if reply[0] != b"completed":
        return None
    codec = reply[3]
    if codec is None:
        return "json", data  # a completed job's default codec is not kept (finish.lua)
    if isinstance(codec, int):
        return f"<{records.over_cap(codec)}>", data
    return records.text(codec), data
