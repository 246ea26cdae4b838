"""``AsyncLane``: script calls of many coroutines, sent to Redis together.

    coroutine A ─ run(calls) ─┐
    coroutine B ─ run(calls) ─┼─► pending ──► flusher task: one write, one reply each
    coroutine C ─ run(calls) ─┘                 └─► each caller's future gets its replies

The asyncio twin of ``lane.Lane``, with one difference that makes concurrency pay: calls
made while a round trip is in flight wait for it and then go out together, in one write on
one connection (automatic pipelining, ``Coalescer``; aio.py coalesces single enqueues into
one script call the same way). A hundred coroutines enqueueing at once
cost Redis a few round trips, not a hundred, and the Python side one write and one read
loop per batch. A lone caller pays one round trip, as before.

Replies come back in order, so each caller's slice is its own; an error reply fails only
the call that got it. A big round trip never holds the loop in one piece: it is written
``BIG_WRITE`` bytes at a time, and its replies are read, and its callers resumed,
``SLICE`` at a time, with a turn of the loop between. A connection failure fails the
batch in flight (the scripts may have run: never resent here, as in ``Lane``); the next
batch reconnects.

Measured (bench/aio_bench.py, 2026-11, 7 alternating pairs on 2 cores), against the same
scripts sent with redis.asyncio's ``execute_command`` (a pipeline for several) and nothing
coalesced: ``aio.Queue.enqueue`` awaited one at a time 1.44x (7,900 against 5,500 jobs/s),
100 coroutines enqueueing at once 5.8x (44,700 against 7,700 jobs/s).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import redis.asyncio as aredis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sandboxq.backends.redis.scripts import Calls, settle

T = TypeVar("T")
R = TypeVar("R")

#: A round trip's commands are written this many bytes at a time at most (a bigger command
#: alone), yielding to the event loop between writes: one write of a megabyte (10,000 small
#: jobs) held the loop for milliseconds on loopback, where the kernel delivers the data
#: inside the send call. (A write per command instead cost a system call each: 2,000 reads
#: of woken waiters made 2,000 writes.)
BIG_WRITE = 64 * 1024
#: Replies read, or callers resumed, between two yields to the event loop. Each resumed
#: caller runs before the loop looks at anything else: a thousand waiters woken by one
#: round trip, each parsing its record (~100 us), held the loop for over 100 ms.
SLICE = 32


class Coalescer(Generic[T, R]):
    """Items added while a send is in flight go out together in the next one.

    A lone caller sends its item at once, from its own coroutine (no task). Items added
    meanwhile wait; when the send in flight ends, one flusher task sends them all in one
    call of ``send``, which answers one result per item (an exception as a value fails
    only its own item). A failure of the whole send fails each of its items.
    """

    def __init__(self, send: Callable[[list[T]], Awaitable[list[R | BaseException]]]) -> None:
        self._send = send
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._busy = False  # a send is in flight (its caller's or the flusher's)

    async def add(self, item: T) -> R:
        if not self._busy:  # nothing in flight: send from this coroutine, no task needed
            self._busy = True
            try:
                (result,) = await self._send([item])
            finally:
                self._busy = False
                self._kick()
            if isinstance(result, BaseException):
                raise result
            return result
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        return await future

    def _kick(self) -> None:
        """Send what queued up behind the send that just ended, on a task."""
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

    async def _send_batch(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._send([item for item, _ in batch])
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:  # cancelled: the callers must not wait forever
            for _, future in batch:
                future.cancel()
            raise
        try:
            for i, ((_, future), result) in enumerate(zip(batch, results, strict=True)):
                if i and i % SLICE == 0:  # the callers resumed so far run before the next
                    await asyncio.sleep(0)
                if future.done():  # its caller was cancelled meanwhile
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
        except BaseException:  # cancelled between slices: the rest must not wait forever
            for _, future in batch:
                future.cancel()
            raise

    async def close(self) -> None:
        """Wait for what is queued to be sent."""
        if self._flusher is not None and not self._flusher.done():
            await asyncio.gather(self._flusher, return_exceptions=True)


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
        self._calls: Coalescer[Calls, list[Any]] = Coalescer(self._send_many)

    async def run(self, calls: Calls) -> list[Any]:
        """Send ``calls`` (with any made meanwhile by other coroutines); their replies.
        Calls refused for want of the library or a script are sent again once it is loaded
        (``scripts.settle``); an error reply is raised."""
        return await self._calls.add(calls)

    async def _send_many(self, many: list[Calls]) -> list[list[Any] | BaseException]:
        """Each caller's calls in one round trip; each caller's replies, or its error reply."""
        replies = await self._send([call for calls in many for call in calls])
        results: list[list[Any] | BaseException] = []
        at = 0
        for calls in many:
            mine, at = replies[at : at + len(calls)], at + len(calls)
            error = next((r for r in mine if isinstance(r, ResponseError)), None)
            results.append(mine if error is None else error)
        return results

    async def _send(self, calls: Calls) -> list[Any]:
        replies = await self._round_trip([packed for _, packed in calls])
        settling = settle(calls, replies)
        try:
            trip = next(settling)
            while True:
                trip = settling.send(await self._round_trip(trip))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    async def _round_trip(self, commands: Sequence[bytes]) -> list[Any]:
        """One write, one reply read per command (an error reply returned as its exception)."""
        if self._conn is None:
            self._conn = self._make()
        conn = self._conn
        loop = asyncio.get_running_loop()
        try:
            # A deadline that moves on with every write sent and reply read: the server is
            # silent for timeout_s, as a socket timeout means. A deadline for the whole trip
            # failed a long read that was flowing (many waiters' replies in one trip, parsed
            # while other threads held the GIL) as "Redis unreachable".
            async with asyncio.timeout(self._timeout_s) as deadline:
                writes = list(_writes(commands))
                for i, data in enumerate(writes):
                    if i:
                        await asyncio.sleep(0)
                    await conn.send_packed_command(data, check_health=False)
                    deadline.reschedule(loop.time() + self._timeout_s)
                replies: list[Any] = []
                for i in range(len(commands)):
                    if i and i % SLICE == 0:  # replies already buffered are read without a pause
                        await asyncio.sleep(0)
                    try:
                        replies.append(await conn.read_response())
                    except ResponseError as exc:
                        replies.append(exc)
                    deadline.reschedule(loop.time() + self._timeout_s)
        except TimeoutError:
            self._conn = None
            await conn.disconnect()
            raise RedisTimeoutError(f"no reply for {self._timeout_s:g} s") from None
        except BaseException:
            # failed or cancelled mid-reply: what is left on it is unknown, drop it
            self._conn = None
            await conn.disconnect()
            raise
        return replies

    async def close(self) -> None:
        """Wait for what is queued to be sent, then close the connection."""
        await self._calls.close()
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.disconnect()


def _writes(commands: Sequence[bytes]) -> Iterator[bytes]:
    """``commands`` joined into writes of at most ``BIG_WRITE`` bytes (a bigger command
    alone)."""
    part: list[bytes] = []
    size = 0
    for command in commands:
        if part and size + len(command) > BIG_WRITE:
            yield b"".join(part)
            part, size = [], 0
        part.append(command)
        size += len(command)
    if part:
        yield b"".join(part)
