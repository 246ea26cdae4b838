"""``AsyncLane``: script calls of many coroutines, sent to Redis together.

    coroutine A ─ run(calls) ─┐
    coroutine B ─ run(calls) ─┼─► pending ──► flusher task: one write, one reply each
    coroutine C ─ run(calls) ─┘                 └─► each caller's future gets its replies

The asyncio twin of ``connection.Lane``, with one difference that makes concurrency pay:
calls made while a round trip is in flight wait for it and then go out together, in one
write on one connection (automatic pipelining). A hundred coroutines enqueueing at once
cost Redis a few round trips, not a hundred, and the Python side one write and one read
loop per batch. A lone caller pays one round trip, as before.

Replies come back in order, so each caller's slice is its own; an error reply fails only
the call that got it. A connection failure fails the batch in flight (the scripts may
have run: never resent here, as in ``Lane``); the next batch reconnects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sandboxq.backends.redis.scripts import Script, unknown_scripts

Calls = Sequence[tuple[Script | None, bytes]]

#: Above this many bytes a round trip's commands are written one at a time, yielding to
#: the event loop between them: one write of a megabyte (10,000 small jobs) held the loop
#: for milliseconds on loopback, where the kernel delivers the data inside the send call.
BIG_WRITE = 64 * 1024


class AsyncLane:
    def __init__(self, client: aredis.Redis, timeout_s: float) -> None:
        pool = client.connection_pool
        # No socket timeout on the connection itself: redis.asyncio turns it into a task
        # per write (asyncio.wait_for), a third of a lone enqueue's cost. One deadline
        # covers the whole round trip instead (_round_trip).
        kwargs = {**pool.connection_kwargs, "socket_timeout": None}
        self._make: Any = lambda: pool.connection_class(**kwargs)
        self._timeout_s = timeout_s
        self._conn: Any = None  # a redis.asyncio connection (untyped)
        self._pending: list[tuple[Calls, asyncio.Future[list[Any]]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._busy = False  # a round trip is in flight (its sender or the flusher)

    async def run(self, calls: Calls) -> list[Any]:
        """Send ``calls`` (with any made meanwhile by other coroutines); their replies.
        Scripts the server does not know are loaded and sent again; an error reply is
        raised."""
        if not self._busy:  # nothing in flight: send from this coroutine, no task needed
            self._busy = True
            try:
                replies = await self._send(calls)
            finally:
                self._busy = False
                self._kick()
            return _checked(replies)
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._pending.append((calls, future))
        return await future

    def _kick(self) -> None:
        """Send what queued up behind the round trip that just ended, on a task."""
        if self._pending and not self._busy:
            self._busy = True
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                await self._send_batch(batch)
        finally:
            self._busy = False

    async def _send_batch(self, batch: list[tuple[Calls, asyncio.Future[list[Any]]]]) -> None:
        flat = [call for calls, _ in batch for call in calls]
        try:
            replies = await self._send(flat)
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:  # cancelled: the callers must not wait forever
            for _, future in batch:
                future.cancel()
            raise
        at = 0
        for calls, future in batch:
            mine, at = replies[at : at + len(calls)], at + len(calls)
            if future.done():  # its caller was cancelled meanwhile
                continue
            try:
                future.set_result(_checked(mine))
            except ResponseError as exc:
                future.set_exception(exc)

    async def _send(self, calls: Calls) -> list[Any]:
        replies = await self._round_trip([packed for _, packed in calls])
        missing, loads = unknown_scripts(calls, replies)
        if missing:
            await self._round_trip(loads)
            again = await self._round_trip([calls[i][1] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    async def _round_trip(self, commands: Sequence[bytes]) -> list[Any]:
        """One write, one reply read per command (an error reply returned as its exception)."""
        if self._conn is None:
            self._conn = self._make()
        conn = self._conn
        try:
            async with asyncio.timeout(self._timeout_s):
                if sum(map(len, commands)) <= BIG_WRITE:
                    await conn.send_packed_command(b"".join(commands), check_health=False)
                else:  # a big enqueue_many: a write per command, yielding between
                    for command in commands:
                        await conn.send_packed_command(command, check_health=False)
                        await asyncio.sleep(0)
                replies: list[Any] = []
                for _ in commands:
                    try:
                        replies.append(await conn.read_response())
                    except ResponseError as exc:
                        replies.append(exc)
        except TimeoutError:
            self._conn = None
            await conn.disconnect()
            raise RedisTimeoutError(f"no reply within {self._timeout_s:g} s") from None
        except BaseException:
            # failed or cancelled mid-reply: what is left on it is unknown, drop it
            self._conn = None
            await conn.disconnect()
            raise
        return replies

    async def close(self) -> None:
        """Wait for what is queued to be sent, then close the connection."""
        if self._flusher is not None and not self._flusher.done():
            await asyncio.gather(self._flusher, return_exceptions=True)
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.disconnect()


def _checked(replies: list[Any]) -> list[Any]:
    """``replies``, unless one is an error reply: then that is raised."""
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    return replies
