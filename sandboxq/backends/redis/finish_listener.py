"""The synchronous API's finish listener: one daemon thread and one connection per
(process, URL, queue), shared by every ``Job.result()`` and ``Batch.as_completed()``
waiting on that queue, in any number of threads (finishes.py says how it works).

    waiter thread ── join(): register on the Board (under the registry lock) ──┐
                  ── read the state / the batch's stream ── wait for a wake    │
    listener thread ── XRANGE - + COUNT 1 (gap check), XREAD BLOCK ── deliver ◄┘
                    ── no waiter left after a read: leave the registry, close, end

A waiter that found no listener starts one: it connects and takes the stream's newest
entry as the cursor before the waiter reads anything, so every finish after that read is
an entry the listener will see. A broken connection (Redis restarted) is retried every
``finishes.RETRY_S`` with one log line per outage; when it works again every waiter looks
again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from sandboxq.backends import rules
from sandboxq.backends.redis import finishes
from sandboxq.backends.redis.finishes import Board
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.redis.urls import Client, client_builder, retry
from sandboxq.models import JobState
from sandboxq.redaction import redact_url

log = logging.getLogger(__name__)


class Waiter(finishes.Waiter):
    """One waiting thread."""

    __slots__ = ("_woken",)

    def __init__(self) -> None:
        super().__init__()
        self._woken = threading.Event()

    def _signal(self) -> None:
        self._woken.set()

    def wait(self, timeout_s: float) -> bool:
        """Whether a wake came within ``timeout_s`` (it is consumed)."""
        with finishes.parked():
            woken = self._woken.wait(timeout_s)
        self._woken.clear()
        return woken


class Listener:
    def __init__(self, key: tuple[str, str], keys: QueueKeys, socket_timeout_s: float) -> None:
        url, _queue = key
        self._key = key
        self._where = redact_url(url)
        self._stream = keys.events
        self.board: Board[Waiter] = Board()
        self._closers: list[Callable[[], None]] = []
        build, _cluster = client_builder(url, self._closers)
        self._client: Client = build(
            socket_connect_timeout=min(2.0, socket_timeout_s),
            socket_timeout=finishes.LISTEN_BLOCK_S + socket_timeout_s,
            retry=retry(),
            client_name=finishes.CLIENT_NAME,
        )
        self._closers.append(self._client.close)
        try:
            newest = self._client.xrevrange(self._stream, count=1)
        except BaseException:
            self._close()
            raise
        self._cursor = finishes.start_cursor(newest)
        self._thread = threading.Thread(
            target=self._run, name=f"sandboxq-finishes-{keys.queue}", daemon=True
        )

    def _run(self) -> None:
        broken = False
        block_ms = rules.lease_ms(finishes.LISTEN_BLOCK_S)
        while True:
            finishes.hook_before_listen_read()
            try:
                oldest = self._client.xrange(self._stream, count=1)
                reply: Any = self._client.xread(
                    {self._stream: self._cursor}, count=finishes.LISTEN_COUNT, block=block_ms
                )
            except (redis.RedisError, OSError) as exc:
                if self._stop_if_idle():
                    return
                if not broken:
                    log.warning("finish listener on %s: %s; retrying", self._where, exc)
                broken = True
                time.sleep(finishes.RETRY_S)
                continue
            self._cursor, woken = finishes.took_read(
                self.board, self._cursor, reply, oldest, broken, self._where
            )
            finishes.wake(woken)
            broken = False
            if self._stop_if_idle():
                return

    def _stop_if_idle(self) -> bool:
        with _registry_lock:
            if not self.board.empty():
                return False
            if _registry.get(self._key) is self:
                del _registry[self._key]
        self._close()
        return True

    def _close(self) -> None:
        for close in reversed(self._closers):
            close()
        self._closers.clear()


_registry: dict[tuple[str, str], Listener] = {}
_registry_lock = threading.Lock()


def _forget_after_fork() -> None:
    # a forked child has none of its parent's listener threads, only their records
    global _registry_lock
    _registry.clear()
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def join(
    url: str, keys: QueueKeys, socket_timeout_s: float, add: Callable[[Board[Waiter]], None]
) -> Listener:
    """The listener of (``url``, the queue), started if there is none, with ``add`` called
    on its board under the registry lock, so the listener cannot stop in between."""
    key = (url, keys.queue)
    with _registry_lock:
        listener = _registry.get(key)
        if listener is None:
            listener = Listener(key, keys, socket_timeout_s)
            _registry[key] = listener
            add(listener.board)
            listener._thread.start()
        else:
            add(listener.board)
    return listener


def wait_for_finish(
    url: str,
    keys: QueueKeys,
    socket_timeout_s: float,
    job_id: str,
    timeout_s: float,
    read_state: Callable[[], Any],
) -> JobState | None:
    """The job's final state once it has one, None after ``timeout_s``; ``JobNotFound``
    if it does not exist. Registered before the first read (finishes.py)."""
    deadline = time.monotonic() + timeout_s
    waiter = Waiter()
    listener = join(url, keys, socket_timeout_s, lambda board: board.add_job(job_id, waiter))
    try:
        raw = read_state()
        first = True
        while True:
            if raw is None:  # never enqueued, trimmed or purged
                raise rules.job_not_found(keys.queue, job_id)
            if (state := finishes.finished_state(raw)) is not None:
                return state
            if first:
                finishes.hook_after_first_read(job_id)
                first = False
            left_s = deadline - time.monotonic()
            if left_s <= 0 or not waiter.wait(left_s):
                return None
            if (told := waiter.told()) is not None:
                return told  # result() reads the record, and waits on if it is not final
            raw = read_state()
    finally:
        listener.board.remove_job(job_id, waiter)


def wait_for_batch(
    url: str,
    keys: QueueKeys,
    socket_timeout_s: float,
    batch_id: str,
    block_s: float,
    read: Callable[[], tuple[str, list[tuple[int, JobState]]]],
) -> tuple[str, list[tuple[int, JobState]]]:
    """``read()`` (a read of the batch's finished-members stream that does not block)
    until it finds rows or ``block_s`` passes; a member's finish wakes it."""
    deadline = time.monotonic() + block_s
    waiter = Waiter()
    listener = join(url, keys, socket_timeout_s, lambda board: board.add_batch(batch_id, waiter))
    try:
        while True:
            cursor, rows = read()
            left_s = deadline - time.monotonic()
            if rows or left_s <= 0 or not waiter.wait(left_s):
                return cursor, rows
    finally:
        listener.board.remove_batch(batch_id, waiter)
