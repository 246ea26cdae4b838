"""``sandboxq.aio``'s finish listener: one task and one connection per (event loop, URL,
queue), shared by every ``AsyncJob.result()`` and ``AsyncBatch.as_completed()`` waiting on
that queue in that loop (finishes.py says how it works; finish_listener.py is the thread
the synchronous API uses).

    coroutine ── listener_for(), then register on its Board (no await in between, so it
                 cannot stop for want of waiters meanwhile) ── await ready(listener)
              ── read the state / the batch's stream ── await a wake (its own timeout)
    listener task ── XRANGE - + COUNT 1 (gap check), XREAD BLOCK ── wakes, a slice at a time
                  ── no waiter left after a read: leave the table, close the connection

A cancelled waiter leaves the board in its ``finally``; nothing else holds it. The task
is cancelled with its loop (``asyncio.run`` cancels what is left) and closes its
connection then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from sandboxq.backends import rules
from sandboxq.backends.redis import finishes
from sandboxq.backends.redis.aio_lane import SLICE
from sandboxq.backends.redis.finishes import Board
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.models import JobState
from sandboxq.redaction import redact_url

log = logging.getLogger(__name__)


class Waiter(finishes.Waiter):
    """One waiting coroutine: woken by the listener task (on the same loop).

    A future per wait and a timer, not an ``asyncio.Event`` under ``asyncio.timeout``: a
    parked waiter holds about half as many objects that way, and with 10,000 of them the
    garbage collector's full collections, which walk every one, are the event loop's
    longest pauses (bench/waiters_bench.py)."""

    __slots__ = ("_future", "_pending")

    def __init__(self) -> None:
        super().__init__()
        self._future: asyncio.Future[bool] | None = None
        self._pending = False  # a wake that came while no wait was under way

    def _signal(self) -> None:
        future = self._future
        if future is not None and not future.done():
            future.set_result(True)
        elif future is None or future.cancelled() or not future.result():
            # no wait under way, or one that ended without a wake: the next wait takes it
            self._pending = True

    async def wait(self, timeout_s: float) -> bool:
        """Whether a wake came within ``timeout_s`` (it is consumed)."""
        if self._pending:
            self._pending = False
            return True
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        self._future = future
        timer = loop.call_later(timeout_s, _time_out, future)
        try:
            with finishes.parked():
                return await future
        finally:
            timer.cancel()
            self._future = None


def _time_out(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(False)


T = TypeVar("T")


async def again_once(read: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``read(*args)``, sent again once if the connection it went out on was dead: after a
    Redis restart the listener wakes every waiter, and each one's read would otherwise
    meet the lane's connection the old server closed. Safe: a read changes nothing."""
    try:
        return await read(*args)
    except RedisConnectionError:
        return await read(*args)


#: Stream entries one read takes at most: fewer than the thread's (finishes.LISTEN_COUNT).
#: A read names at most ~85 jobs (three events per job), whose waiters are woken a slice
#: at a time (``_wake_in_slices``); the loop turns again while the next read is out.
READ_COUNT = 256

Table = dict[tuple[str, str], "Listener"]
_tables: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Table] = weakref.WeakKeyDictionary()


class Listener:
    def __init__(self, table: Table, key: tuple[str, str], keys: QueueKeys, timeout_s: float):
        url, _queue = key
        self._table, self._key = table, key
        self._where = redact_url(url)
        self._stream = keys.events
        self.board: Board[Waiter] = Board()
        self._client = aredis.Redis.from_url(
            url,
            socket_timeout=finishes.LISTEN_BLOCK_S + timeout_s,
            socket_connect_timeout=min(2.0, timeout_s),
            client_name=finishes.CLIENT_NAME,
        )
        self._cursor = "0-0"
        loop = asyncio.get_running_loop()
        #: Done once the listener has its cursor (or failed to get one): joiners await it.
        self.started: asyncio.Future[None] = loop.create_future()
        # One task from the first read to the close, so its ``finally`` covers every moment
        # the connection is open. (The listening loop was a second task started by the
        # first: cancelled by asyncio.run's end before its first step, it never entered
        # its ``finally`` and left the connection open.)
        self._task = loop.create_task(self._main())
        self._task.add_done_callback(self._ended)

    def _ended(self, _task: asyncio.Task[None]) -> None:
        """The task ended, even one cancelled before its first step (nothing was opened
        then): joiners still waiting for the start are told, and the table forgets it."""
        if not self.started.done():
            self.started.cancel()
        self._leave()

    async def _main(self) -> None:
        try:
            try:
                newest = await self._client.xrevrange(self._stream, count=1)
            except asyncio.CancelledError:
                self.started.cancel()
                raise
            except BaseException as exc:
                self.started.set_exception(exc)
                raise
            self._cursor = finishes.start_cursor(newest)
            self.started.set_result(None)
            await self._listen()
        finally:
            self._leave()
            await _close(self._client)

    async def _listen(self) -> None:
        broken = False
        block_ms = rules.lease_ms(finishes.LISTEN_BLOCK_S)
        while True:
            try:
                oldest = await self._client.xrange(self._stream, count=1)
                reply: Any = await self._client.xread(
                    {self._stream: self._cursor}, count=READ_COUNT, block=block_ms
                )
            except (RedisError, OSError) as exc:
                if self.board.empty():
                    return
                if not broken:
                    log.warning("finish listener on %s: %s; retrying", self._where, exc)
                broken = True
                await asyncio.sleep(finishes.RETRY_S)
                continue
            self._cursor, woken = finishes.took_read(
                self.board, self._cursor, reply, oldest, broken, self._where
            )
            await _wake_in_slices(woken)
            broken = False
            if self.board.empty():
                return

    def _leave(self) -> None:
        if self._table.get(self._key) is self:
            del self._table[self._key]


async def _wake_in_slices(woken: list[tuple[Waiter, JobState | None]]) -> None:
    """Wake ``woken`` SLICE at a time, yielding to the loop in between: every coroutine a
    wake resumes runs before the loop looks at anything else, and after a reconnect the
    listener wakes every waiter (10,000 parked waiters woken at once held the loop for
    90-265 ms in 3 runs, 10-70 ms a slice at a time; bench/waiters_bench.py's outage is
    the same path)."""
    for start in range(0, len(woken), SLICE):
        if start:
            await asyncio.sleep(0)
        finishes.wake(woken[start : start + SLICE])


async def _close(client: aredis.Redis) -> None:
    """Close ``client``'s connections, to the end even if cancelled meanwhile: the end of
    ``asyncio.run`` cancels every task left, a listener's possibly inside this close, which
    would leave its connection open. A task is cancelled once; the close done again is
    not, and then the cancellation goes on."""
    try:
        await client.aclose()
    except asyncio.CancelledError:
        # Its own failure (a connection already broken) must not replace the cancellation.
        with contextlib.suppress(RedisError, OSError):
            await client.aclose()
        raise


def listener_for(url: str, keys: QueueKeys, timeout_s: float) -> Listener:
    """The loop's listener of (``url``, the queue), started if there is none. Nothing is
    awaited: a waiter registers on its board before the listener can stop for want of
    waiters, then awaits ``ready``."""
    table = _tables.setdefault(asyncio.get_running_loop(), {})
    key = (url, keys.queue)
    listener = table.get(key)
    if listener is None:
        listener = table[key] = Listener(table, key, keys, timeout_s)
    return listener


async def ready(listener: Listener) -> None:
    """Once ``listener`` has its cursor; raises what its start failed with."""
    if not listener.started.done():
        # shielded: one waiter cancelled during the start must not end it for the others
        await asyncio.shield(listener.started)
    else:
        listener.started.result()


async def wait_for_finish(
    url: str,
    keys: QueueKeys,
    timeout_s: float,
    job_id: str,
    wait_s: float,
    read_state: Callable[[str], Awaitable[Any]],
) -> JobState | None:
    """As ``finish_listener.wait_for_finish``, awaited (``read_state(job_id)`` reads the
    job's state)."""
    deadline = time.monotonic() + wait_s
    waiter = Waiter()
    listener = listener_for(url, keys, timeout_s)
    board = listener.board
    board.add_job(job_id, waiter)
    try:
        await ready(listener)
        raw = await again_once(read_state, job_id)
        first = True
        while True:
            if raw is None:
                raise rules.job_not_found(keys.queue, job_id)
            if (state := finishes.finished_state(raw)) is not None:
                return state
            if first:
                finishes.hook_after_first_read(job_id)
                first = False
            left_s = deadline - time.monotonic()
            if left_s <= 0 or not await waiter.wait(left_s):
                return None
            if (told := waiter.told()) is not None:
                return told  # result() reads the record, and waits on if it is not final
            raw = await again_once(read_state, job_id)
    finally:
        board.remove_job(job_id, waiter)


async def wait_for_batch(
    url: str,
    keys: QueueKeys,
    timeout_s: float,
    batch_id: str,
    block_s: float,
    read: Callable[[], Awaitable[tuple[str, list[tuple[int, JobState]]]]],
) -> tuple[str, list[tuple[int, JobState]]]:
    """As ``finish_listener.wait_for_batch``, awaited."""
    deadline = time.monotonic() + block_s
    waiter = Waiter()
    listener = listener_for(url, keys, timeout_s)
    listener.board.add_batch(batch_id, waiter)
    try:
        await ready(listener)
        while True:
            cursor, rows = await again_once(read)
            left_s = deadline - time.monotonic()
            if rows or left_s <= 0 or not await waiter.wait(left_s):
                return cursor, rows
    finally:
        listener.board.remove_batch(batch_id, waiter)
