"""``AsyncRedisBackend``: the producer's half of ``RedisBackend`` on ``redis.asyncio``.

    sandboxq.aio.Queue ── enqueue / cancel / retry ──► the same Lua scripts (scripts.py),
                          packed once; concurrent calls sent together (aio_lane.py)
                       ── get / counts / results ──► redis.asyncio commands (pipelined)
                       ── wait_for_finish / events ──► XREAD BLOCK on a client of its own

Nothing here blocks the event loop: every wait is an awaited socket read. The scripts,
their packing, the job framing and the record parsing are the synchronous backend's own
(``scripts.py``, ``backend.enqueue_calls``, ``records.py``), so both write the same keys the
same way. Plain ``redis://``, ``rediss://`` and ``unix://`` URLs only: Sentinel and
Cluster producers use the synchronous ``Queue``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis.asyncio as aredis

from sandboxq.backends.base import Event, NewJob
from sandboxq.backends.redis import records
from sandboxq.backends.redis.aio_lane import AsyncLane
from sandboxq.backends.redis.backend import (
    ENQUEUE_CHUNK,
    check_options,
    enqueue_calls,
    enqueued,
    frame_jobs,
    pack_enqueue,
)
from sandboxq.backends.redis.connection import (
    BLOCK_CAP_S,
    CLUSTER_SCHEMES,
    SENTINEL_SCHEMES,
    redis_errors,
)
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.redis.listen import FINISH_POLL_S
from sandboxq.backends.redis.scripts import Script, Scripts, script_settings
from sandboxq.errors import ConfigError
from sandboxq.models import JobInfo, JobState
from sandboxq.redaction import redact_url

_FINISHED = {s.value.encode(): s for s in JobState if s.finished}


class AsyncRedisBackend:
    def __init__(
        self,
        url: str,
        queue: str,
        *,
        retain_completed: int = 1000,
        retain_failed: int = 10_000,
        retain_s: float = 7 * 24 * 3600,
        max_events: int = 10_000,
        socket_timeout_s: float = 5.0,
    ) -> None:
        self.queue = check_options(
            queue, retain_completed, retain_failed, retain_s, max_events, socket_timeout_s
        )
        scheme = url.partition("://")[0].lower()
        if scheme in SENTINEL_SCHEMES + CLUSTER_SCHEMES:
            raise ConfigError(
                f"sandboxq.aio supports redis://, rediss:// and unix:// URLs, not {scheme}://; "
                "use sandboxq.Queue there"
            )
        self.url = url
        self.where = redact_url(url)
        self.keys = QueueKeys(queue)
        timeout = float(socket_timeout_s)
        try:
            self._main = aredis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=min(2.0, timeout)
            )
            self._blocking = aredis.Redis.from_url(
                url, socket_timeout=BLOCK_CAP_S + timeout, socket_connect_timeout=2.0
            )
        except ValueError as exc:
            raise ConfigError(f"invalid Redis URL {self.where!r}: {exc}") from None
        settings = script_settings(max_events, retain_completed, retain_failed, retain_s)
        self._scripts = Scripts(self.keys.script_keys, settings, None)
        self._lane = AsyncLane(self._main, timeout)
        self._singles = _Singles(self._lane, self._scripts.enqueue)

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

    async def get(self, job_id: str) -> JobInfo | None:
        with redis_errors(self.where, f"read job {job_id!r}"):
            pipe = self._main.pipeline(transaction=False)
            pipe.hgetall(self.keys.job(job_id))
            pipe.lrange(self.keys.history(job_id), 0, -1)
            fields, history = await pipe.execute()
        if not fields:
            return None
        return records.job_info(self.queue, job_id, fields, history)

    async def get_result(self, job_id: str) -> bytes | None:
        with redis_errors(self.where, f"read the result of job {job_id!r}"):
            state, result = await self._main.hmget(self.keys.job(job_id), ["state", "result"])
        if state != b"completed" or result is None:
            return None
        return result if isinstance(result, bytes) else result.encode()

    async def counts(self) -> dict[JobState, int]:
        with redis_errors(self.where, "count jobs"):
            pipe = self._main.pipeline(transaction=False)
            for state in JobState:
                pipe.zcard(self.keys.state_set(state))
            sizes = await pipe.execute()
        return {state: int(n) for state, n in zip(JobState, sizes, strict=True)}

    # -- waiting ------------------------------------------------------------------------

    async def _read_events(
        self, after: str, block_s: float | None
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        reply: Any
        if block_s is None:
            reply = await self._main.xread({self.keys.events: after}, count=1000)
        else:
            block_ms = max(1, round(min(block_s, BLOCK_CAP_S) * 1000))
            reply = await self._blocking.xread(
                {self.keys.events: after}, count=1000, block=block_ms
            )
        return list(reply[0][1]) if reply else []

    async def wait_for_finish(self, job_id: str, timeout_s: float) -> JobState | None:
        """As ``listen.wait_for_finish``: follow the events from "now", re-read the state
        when one names the job (or every FINISH_POLL_S, in case it was trimmed)."""
        deadline = time.monotonic() + timeout_s
        key, wanted = self.keys.job(job_id), job_id.encode()
        with redis_errors(self.where, f"wait for job {job_id!r}"):
            newest: Any = await self._main.xrevrange(self.keys.events, count=1)
            after = records.text(newest[0][0]) if newest else "0-0"
            check, checked_at = True, 0.0
            while True:
                if check or time.monotonic() - checked_at >= FINISH_POLL_S:
                    raw: Any = await self._main.hget(key, "state")
                    state = _FINISHED.get(raw or b"")
                    checked_at = time.monotonic()
                    if state is not None:
                        return state
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                entries = await self._read_events(after, min(remaining, FINISH_POLL_S))
                if entries:
                    after = records.text(entries[-1][0])
                check = any(fields.get(b"job") == wanted for _, fields in entries)

    async def events(self, since: str | None, block_s: float | None) -> AsyncIterator[Event]:
        """As ``listen.events``: the retained events after ``since``; then, with
        ``block_s``, new ones until ``block_s`` passes without any."""
        after = since or "0-0"
        while True:
            with redis_errors(self.where, "read events"):
                entries = await self._read_events(after, None)
            if not entries:
                break
            for entry_id, fields in entries:
                after = records.text(entry_id)
                yield records.event(entry_id, fields)
        if block_s is None or block_s <= 0:
            return
        while True:
            deadline = time.monotonic() + block_s
            entries = []
            while not entries and (remaining := deadline - time.monotonic()) > 0:
                with redis_errors(self.where, "wait for events"):
                    entries = await self._read_events(after, remaining)
            if not entries:
                return
            for entry_id, fields in entries:
                after = records.text(entry_id)
                yield records.event(entry_id, fields)

    async def close(self) -> None:
        await self._singles.close()
        await self._lane.close()
        await self._main.aclose()
        await self._blocking.aclose()


class _Singles:
    """Jobs enqueued one per call by many coroutines at once, added by shared script calls.

    A lone caller sends its job at once. Jobs enqueued while that call is in flight are
    added together by the next one: enqueue.lua takes a batch, and on Redis a script call
    costs far more than a job inside one, so a hundred coroutines enqueueing cost a few
    script calls instead of a hundred. Each job is framed (and refused, if it must be) by
    its own caller before it joins; a failure of the shared call fails each of its jobs.
    """

    def __init__(self, lane: AsyncLane, script: Script) -> None:
        self._lane = lane
        self._script = script
        self._waiting: list[tuple[bytes, asyncio.Future[bool]]] = []
        self._busy = False
        self._flusher: asyncio.Task[None] | None = None

    async def add(self, frame: bytes) -> bool:
        """Add one framed job; True if it was created (False: its id already existed)."""
        if not self._busy:
            self._busy = True
            try:
                (created,) = await self._send([frame])
            finally:
                self._busy = False
                self._kick()
            return created
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append((frame, future))
        return await future

    def _kick(self) -> None:
        if self._waiting and not self._busy:
            self._busy = True
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                try:
                    created = await self._send([frame for frame, _ in batch])
                except Exception as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                except BaseException:  # cancelled: the callers must not wait forever
                    for _, future in batch:
                        future.cancel()
                    raise
                for (_, future), flag in zip(batch, created, strict=True):
                    if not future.done():
                        future.set_result(flag)
        finally:
            self._busy = False

    async def _send(self, frames: list[bytes]) -> list[bool]:
        replies = await self._lane.run(pack_enqueue(self._script, frames))
        return [flag == 1 for reply in replies for flag in reply]

    async def close(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            await asyncio.gather(self._flusher, return_exceptions=True)
