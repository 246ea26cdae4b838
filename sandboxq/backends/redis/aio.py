"""``AsyncRedisBackend``: the producer's half of ``RedisBackend`` on ``redis.asyncio``.

    sandboxq.aio.Queue ── enqueue / cancel / retry ──► the same Lua scripts (scripts.py),
                          packed once; concurrent calls sent together (aio_lane.py), and
                          single enqueues of many coroutines joined into one script call
                       ── get / results ──► read_job.lua, read_result.lua (bounded)
                       ── counts ──► redis.asyncio commands (pipelined)
                       ── batches ──► batch_*.lua, the batch hash, its stream (what each
                          reply means: batches.py's functions, shared with the sync side)
                       ── wait_for_finish, batch_finished ──► the loop's finish listener of
                          the queue (aio_finishes.py): one connection for every waiter
                       ── events ──► XREAD BLOCK on a client of its own

Nothing here blocks the event loop: every wait is an awaited socket read. The scripts,
their packing, the job framing, the options, the record parsing and what a waiter decides
are the synchronous backend's own (``scripts.py``, ``enqueue.py``, ``connection.RedisOptions``,
``records.py``, ``follow.py``), so both write the same keys the same way and wait the same
way. Plain ``redis://``, ``rediss://`` and ``unix://`` URLs only: Sentinel and Cluster
producers use the synchronous ``Queue``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ResponseError

from sandboxq.backends import rules
from sandboxq.backends.base import BatchAction, Event, NewJob
from sandboxq.backends.redis import aio_finishes, batches, follow, reads, records
from sandboxq.backends.redis.aio_lane import AsyncLane, Coalescer
from sandboxq.backends.redis.connection import (
    BLOCK_CAP_S,
    CLUSTER_SCHEMES,
    SENTINEL_SCHEMES,
    RedisOptions,
    redis_errors,
)
from sandboxq.backends.redis.enqueue import (
    ENQUEUE_CHUNK,
    created_flags,
    enqueue_calls,
    enqueued,
    frame_jobs,
    pack_enqueue,
)
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.redis.scripts import Script, Scripts, script_settings
from sandboxq.backends.redis.urls import check_plain
from sandboxq.backends.rules import lease_ms
from sandboxq.errors import BackendError, ConfigError
from sandboxq.finished import Trims
from sandboxq.models import BatchProgress, JobInfo, JobState, check_queue_name
from sandboxq.redaction import redact_url


class AsyncRedisBackend:
    """Options: those of ``connection.RedisOptions``, as ``RedisBackend`` takes them."""

    def __init__(self, url: str, queue: str, **options: Any) -> None:
        self.queue = check_queue_name(queue)
        settings = RedisOptions(**options)
        scheme = url.partition("://")[0].lower()
        if scheme in SENTINEL_SCHEMES + CLUSTER_SCHEMES:
            raise ConfigError(
                f"sandboxq.aio supports redis://, rediss:// and unix:// URLs, not {scheme}://; "
                "use sandboxq.Queue there"
            )
        self.url = url
        self.where = redact_url(url)
        self.keys = QueueKeys(queue)
        self._batch_ttl_ms = rules.ms(settings.batch_ttl_s)
        timeout = self._timeout_s = float(settings.socket_timeout_s)
        try:
            check_plain(url)
            self._main = aredis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=min(2.0, timeout)
            )
            self._blocking = aredis.Redis.from_url(
                url, socket_timeout=BLOCK_CAP_S + timeout, socket_connect_timeout=2.0
            )
        except ValueError as exc:
            raise ConfigError(f"invalid Redis URL {self.where!r}: {exc}") from None
        self._scripts = Scripts(
            self.keys.script_keys, script_settings(settings, self.keys.index), None
        )
        self._lane = AsyncLane(self._main, timeout)
        # Jobs enqueued one per call by many coroutines at once go out in shared script
        # calls: a lone caller sends its job at once, jobs enqueued meanwhile are added
        # together by the next call (enqueue.lua takes a batch, and on Redis a script call
        # costs far more than a job inside one). Each job is framed, and refused if it must
        # be, by its own caller before it joins.
        self._singles: Coalescer[bytes, bool] = Coalescer(self._add_frames)

    def __repr__(self) -> str:
        return f"AsyncRedisBackend({self.where!r}, {self.queue!r})"

    # -- scripts ------------------------------------------------------------------------

    async def _run(self, calls: Sequence[tuple[Script | None, bytes]]) -> list[Any]:
        return await self._lane.run(calls)

    async def _script(self, script: Script, args: Sequence[Any]) -> Any:
        return (await self._run([(script, script.pack(args))]))[0]

    # -- producing and managing --------------------------------------------------------

    async def enqueue(self, jobs: Sequence[NewJob]) -> list[tuple[str, bool]]:
        if len(jobs) == 1:
            ((job_id,), (frame,)) = frame_jobs(jobs)  # a bad job fails its own caller only
            with redis_errors(self.where, "enqueue"):
                return [(job_id, await self._singles.add(frame))]
        # Framed one chunk at a time, yielding between: framing 10,000 jobs at once would
        # hold the event loop for tens of milliseconds.
        ids: list[str] = []
        calls: list[tuple[Script | None, bytes]] = []
        for start in range(0, len(jobs), ENQUEUE_CHUNK):
            chunk_ids, chunk_calls = enqueue_calls(
                self._scripts.enqueue, jobs[start : start + ENQUEUE_CHUNK]
            )
            ids += chunk_ids
            calls += chunk_calls
            if len(jobs) > ENQUEUE_CHUNK:
                await asyncio.sleep(0)
        if not calls:
            return []
        with redis_errors(self.where, "enqueue"):
            replies = await self._run(calls)
        return enqueued(ids, replies)

    async def cancel(self, job_id: str) -> bool:
        with redis_errors(self.where, f"cancel job {job_id!r}"):
            args = [job_id, self.keys.cancel_channel]
            return bool(await self._script(self._scripts.cancel, args) == 1)

    async def retry_failed(self, job_id: str) -> bool:
        with redis_errors(self.where, f"retry job {job_id!r}"):
            return bool(await self._script(self._scripts.retry_failed, [job_id]) == 1)

    # -- reading ------------------------------------------------------------------------

    async def retention_trims(self) -> Trims:
        """As ``RedisBackend.retention_trims``."""
        with redis_errors(self.where, "read what retention removed"):
            raw = await self._main.hmget(self.keys.trims, Trims.FIELDS)
        return reads.trims_from_reply(raw)

    async def get(self, job_id: str) -> JobInfo | None:
        """As ``RedisBackend.get``: read_job.lua, bounded (design invariant 13)."""
        with redis_errors(self.where, f"read job {job_id!r}"):
            reply = await self._script(self._scripts.read_job, reads.read_job_args(job_id))
        return reads.job_from_reply(self.queue, self.keys, job_id, reply)

    async def get_result(self, job_id: str) -> bytes | None:
        """As ``RedisBackend.get_result``: read_result.lua, bounded."""
        with redis_errors(self.where, f"read the result of job {job_id!r}"):
            args = reads.read_result_args(job_id)
            reply = await self._script(self._scripts.read_result, args)
        return reads.result_from_reply(job_id, reply)

    async def get_many(self, job_ids: Sequence[str]) -> list[tuple[JobInfo | None, bytes | None]]:
        """As ``RedisBackend.get_many``: both scripts per job, in one round trip."""
        read_job, read_result = self._scripts.read_job, self._scripts.read_result
        calls: list[tuple[Script | None, bytes]] = []
        for job_id in job_ids:
            calls.append((read_job, read_job.pack(reads.read_job_args(job_id))))
            calls.append((read_result, read_result.pack(reads.read_result_args(job_id))))
        with redis_errors(self.where, f"read {len(job_ids)} jobs"):
            replies = await self._run(calls) if calls else []
        return [
            (
                reads.job_from_reply(self.queue, self.keys, job_id, replies[2 * i]),
                reads.result_from_reply(job_id, replies[2 * i + 1]),
            )
            for i, job_id in enumerate(job_ids)
        ]

    async def completed_results(
        self, job_ids: Sequence[str]
    ) -> list[tuple[str, bytes | None] | None]:
        """As ``RedisBackend.completed_results``: read_result.lua per job, one round trip."""
        read_result = self._scripts.read_result
        calls: list[tuple[Script | None, bytes]] = [
            (read_result, read_result.pack(reads.read_result_args(job_id))) for job_id in job_ids
        ]
        with redis_errors(self.where, f"read the results of {len(job_ids)} jobs"):
            replies = await self._run(calls) if calls else []
        return [
            reads.completed_from_reply(job_id, reply)
            for job_id, reply in zip(job_ids, replies, strict=True)
        ]

    async def counts(self) -> dict[JobState, int]:
        with redis_errors(self.where, "count jobs"):
            pipe = self._main.pipeline(transaction=False)
            for state in JobState:
                pipe.zcard(self.keys.state_set(state))
            sizes = await pipe.execute()
        return {state: int(n) for state, n in zip(JobState, sizes, strict=True)}

    # -- waiting ------------------------------------------------------------------------

    async def _read_events(self, after: str, block_s: float | None) -> follow.Entries:
        reply: Any
        if block_s is None:
            reply = await self._main.xread({self.keys.events: after}, count=1000)
        else:
            block_ms = lease_ms(min(block_s, BLOCK_CAP_S))
            reply = await self._blocking.xread(
                {self.keys.events: after}, count=1000, block=block_ms
            )
        return list(reply[0][1]) if reply else []

    async def wait_for_finish(self, job_id: str, timeout_s: float) -> JobState | None:
        """Woken by the loop's finish listener of this queue (aio_finishes.py): one
        connection however many coroutines wait."""
        with redis_errors(self.where, f"wait for job {job_id!r}"):
            return await aio_finishes.wait_for_finish(
                self.url, self.keys, self._timeout_s, job_id, timeout_s, self._read_state
            )

    async def _read_state(self, job_id: str) -> Any:
        """The job's state, bounded (read_state.lua)."""
        return await self._script(self._scripts.read_state, [job_id, records.MAX_STATE_BYTES])

    async def events(self, since: str | None, block_s: float | None) -> AsyncIterator[Event]:
        """As ``listen.events``: the retained events after ``since``; then, with
        ``block_s``, new ones until ``block_s`` passes without any (``follow.EventCursor``)."""
        cursor = follow.EventCursor(since, block_s)
        while (read := cursor.next_read()) is not None:
            with redis_errors(self.where, read.doing):
                entries = await self._read_events(read.after, read.block_s)
            for event in cursor.took(entries):
                yield event

    # -- batches (as batches.Batches; the replies read by the same functions) -----------

    async def enqueue_batch(
        self,
        batch_id: str,
        jobs: Sequence[NewJob],
        *,
        then: str | None = None,
        first: int = 0,
        label: str | None = None,
    ) -> int:
        if then:
            batches.check_then(then, self.queue, cluster=False)
        total = first + len(jobs)
        calls = batches.enqueue_batch_calls(
            self._scripts.batch_enqueue,
            batch_id,
            jobs,
            then,
            self._batch_ttl_ms,
            first,
            total,
            label,
        )
        replies: list[Any] = []
        try:
            with redis_errors(self.where, f"enqueue batch {batch_id!r}"):
                # The first chunk makes the batch: it goes alone, then the rest a round trip
                # of CHUNKS_PER_TRIP at a time (batches.trips). gather keeps each chunk's own
                # reply (an error reply included), so the count of members that exist is
                # exact (enqueue_outcome).
                for part in batches.trips(calls):
                    sent = [self._run([call]) for call in part]
                    replies += await asyncio.gather(*sent, return_exceptions=True)
                    for reply in replies:  # a lost connection, not an error reply
                        if isinstance(reply, BaseException) and not isinstance(
                            reply, ResponseError
                        ):
                            raise reply
                    if any(isinstance(r, ResponseError) for r in replies):
                        break
        except BackendError as exc:
            done = [r if isinstance(r, ResponseError) else r[0] for r in replies]
            raise batches.incomplete(batch_id, total, done, exc) from exc
        return batches.enqueue_outcome(
            batch_id, total, [r if isinstance(r, ResponseError) else r[0] for r in replies]
        )

    async def batch_progress(self, batch_id: str) -> BatchProgress | None:
        # on the lane (one connection, coalesced): any number of streams check at once
        args = batches.progress_args(batch_id)
        with redis_errors(self.where, f"read batch {batch_id!r}"):
            reply = await self._script(self._scripts.batch_read, args)
        values = batches.kept(self.queue, batch_id, reply)
        return batches.progress_from(batch_id, self.queue, values)

    async def batch_finished(
        self, batch_id: str, after: str, block_s: float | None = None
    ) -> tuple[str, list[tuple[int, JobState]]]:
        key = self.keys.batch_done(batch_id)
        args = batches.finished_args(batch_id, after)

        async def read() -> tuple[str, list[tuple[int, JobState]]]:
            # on the lane, as batch_progress; a raw reply: each entry's fields a flat list
            reply = await self._script(self._scripts.batch_read, args)
            entries = batches.kept(self.queue, batch_id, reply)
            return batches.finished_from(after, follow.entries_of(entries), key)

        with redis_errors(self.where, f"read the finished members of batch {batch_id!r}"):
            if block_s is None:
                return await read()
            return await aio_finishes.wait_for_batch(
                self.url, self.keys, self._timeout_s, batch_id, block_s, read
            )

    async def batch_each(self, batch_id: str, action: BatchAction) -> int | None:
        acted, start, last = 0, 0, 1
        with redis_errors(self.where, f"{action} batch {batch_id!r}"):
            while start < last:
                args = [batch_id, action, start, rules.BATCH_CHUNK, self.keys.cancel_channel]
                reply = await self._script(self._scripts.batch_each, args)
                done, count = batches.each_answer(self.queue, batch_id, reply)
                if count < 0:
                    return None
                acted, last = acted + done, count
                start += rules.BATCH_CHUNK
        return acted

    async def forget_batch(self, batch_id: str) -> bool:
        with redis_errors(self.where, f"forget batch {batch_id!r}"):
            while True:
                args = [batch_id, rules.BATCH_CHUNK]
                reply = await self._script(self._scripts.batch_forget, args)
                answer, wait_s = batches.forget_answer(batch_id, reply)
                if answer is not None:
                    return answer
                await asyncio.sleep(wait_s)

    async def _add_frames(self, frames: list[bytes]) -> list[bool | BaseException]:
        """Framed jobs added in shared script calls; whether each was created."""
        replies = await self._lane.run(pack_enqueue(self._scripts.enqueue, frames))
        return list(created_flags(replies))

    async def close(self) -> None:
        await self._singles.close()
        await self._lane.close()
        await self._main.aclose()
        await self._blocking.aclose()
