"""Waiting without polling: idle workers, result waiters, event readers, cancellation.

    enqueue / retry / recovery ── LPUSH wake ──► BLPOP ──► an idle worker claims again
    every state change ── XADD events ──► XREAD BLOCK ──► events() (finish waits: the
                                          process's finish listener, finish_listener.py)
    cancel ── PUBLISH sq:{q}:cancel ──► pub/sub thread ──► watch_cancellations callback

Each wait is one blocking command on the blocking client (or the pub/sub connection), so
an idle worker costs Redis one parked connection and nothing else. What a waiter on the
events stream reads next, and what a reply means, is decided in follow.py (shared with the
asyncio client); here the reads are blocking calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import redis
from redis.exceptions import AskError, MovedError

from sandboxq.backends import rules
from sandboxq.backends.base import Event
from sandboxq.backends.redis import follow, records
from sandboxq.backends.redis.connection import BLOCK_CAP_S, Connections
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.redis.scripts import pack_command, run
from sandboxq.errors import BackendError, DamagedRecord

log = logging.getLogger(__name__)

WATCH_TICK_S = 0.1  # how often the cancellation thread checks whether it should stop


#: An unblock entry nobody popped (the wait it was for had just ended) is gone after this.
UNBLOCK_TTL_MS = 5000


def wait_for_wake(conns: Connections, keys: QueueKeys, timeout_s: float, unblock: str) -> bool:
    """BLPOP one wake entry, or an entry of the waiter's own ``unblock`` list (``unblock``
    pushes one: a stopping worker), for at most ``timeout_s``; True when unblocked.

    The claim that follows is a separate round trip on purpose: pipelined behind the BLPOP
    it would run on the server the moment a token arrives even if this process were frozen
    (SIGSTOP, swapped out), leasing jobs to a worker that cannot run them.
    """
    # BLPOP's timeout 0 means "forever": never let rounding produce it
    timeout_s = max(0.001, min(timeout_s, BLOCK_CAP_S))
    command = pack_command("BLPOP", keys.wake, unblock, f"{timeout_s:.3f}")
    reply = run(conns.blocking_lane, [(None, command)])[0]
    return reply is not None and records.text(reply[0]) == unblock


def unblock(conns: Connections, key: str) -> None:
    """End the BLPOP of ``wait_for_wake`` that waits on ``key`` (or the next one)."""
    push = pack_command("LPUSH", key, "1")
    run(conns.main_lane, [(None, push), (None, pack_command("PEXPIRE", key, UNBLOCK_TTL_MS))])


def read_events(
    conns: Connections, keys: QueueKeys, after: str, block_s: float | None
) -> follow.Entries:
    """Stream entries after ``after``; with ``block_s``, waits up to that long for one."""
    reply: Any
    if block_s is None:
        reply = conns.main.xread({keys.events: after}, count=1000)
    else:
        block_ms = rules.lease_ms(min(block_s, BLOCK_CAP_S))
        reply = conns.blocking.xread({keys.events: after}, count=1000, block=block_ms)
    return list(reply[0][1]) if reply else []


def new_events(
    conns: Connections, after: Mapping[str, str | None], count: int
) -> dict[str, list[Event] | BackendError]:
    """The events after each queue's id, at most ``count`` of each (``Backend.new_events``).

    One XREAD names every stream on one server. A Cluster's streams are in as many slots
    as queues, so there each has an XREAD of its own, each node's sent in one write
    (``_xread_on_nodes``). A stream of the wrong type fails a whole XREAD: then each is
    read alone, so that queue alone gets the error. Measured (2026-11, 200 queues, 2
    cores): a round of one XREAD per queue through the client took 26 ms of CPU on a
    Cluster, 1.8 ms this way."""
    queues = list(after)
    streams = {QueueKeys(q).events: after[q] or "0-0" for q in queues}
    client: Any = conns.main  # redis-py's xread is typed for one key type at a time
    replies: list[Any]
    if not queues:
        return {}
    try:
        with conns.errors("read events"):
            if conns.cluster:
                replies = _xread_on_nodes(conns, streams, count)
            else:
                found = {records.text(k): v for k, v in client.xread(streams, count=count)}
                replies = [[[k, found[k]]] if k in found else [] for k in streams]
    except DamagedRecord:  # one stream is not a stream: read each alone
        replies = []
        for stream, last in streams.items():
            try:
                with conns.errors("read events"):
                    replies.append(client.xread({stream: last}, count=count))
            except BackendError as exc:
                replies.append(exc)
    out: dict[str, list[Event] | BackendError] = {}
    for queue, reply in zip(queues, replies, strict=True):
        if isinstance(reply, BackendError):
            out[queue] = reply
        elif isinstance(reply, redis.RedisError):
            out[queue] = conns.error("read events", reply)
        else:
            entries = reply[0][1] if reply else []
            out[queue] = [records.event(entry_id, fields) for entry_id, fields in entries]
    return out


def _xread_on_nodes(conns: Connections, streams: dict[str, str], count: int) -> list[Any]:
    """An XREAD per stream, each node's in one write (``Connections.on_nodes``); a stream
    whose slot moved is read again through the client, which follows it. Replies as
    XREAD's, or a ``redis.ResponseError`` for a stream that cannot be read."""
    cluster: Any = conns.main
    commands = [
        (
            cluster.get_node_from_key(stream),
            pack_command("XREAD", "COUNT", count, "STREAMS", stream, last),
        )
        for stream, last in streams.items()
    ]
    replies = [
        reply if isinstance(reply, Exception) else follow.entries_of(reply)
        for reply in conns.on_nodes(commands)
    ]
    for position, (stream, last) in enumerate(streams.items()):
        if isinstance(replies[position], MovedError | AskError):
            try:
                replies[position] = cluster.xread({stream: last}, count=count)
            except redis.ResponseError as exc:
                replies[position] = exc
    return replies


def events(
    conns: Connections, keys: QueueKeys, since: str | None, block_s: float | None
) -> Iterator[Event]:
    """The retained events after ``since``; then, with ``block_s``, new ones as they come,
    ending once ``block_s`` passes without any (``follow.EventCursor``)."""
    cursor = follow.EventCursor(since, block_s)
    while (read := cursor.next_read()) is not None:
        with conns.errors(read.doing):
            entries = read_events(conns, keys, read.after, read.block_s)
        yield from cursor.took(entries)


class CancellationWatch:
    """A daemon thread reading the queue's cancel channel; ``stop()`` ends it and closes
    the pub/sub connection. Subscribed before the constructor returns, so a cancel sent
    after ``watch_cancellations`` returned is never missed."""

    def __init__(
        self, conns: Connections, keys: QueueKeys, callback: Callable[[str, str | None], None]
    ) -> None:
        self._where = conns.where
        self._callback = callback
        self._pubsub = conns.main.pubsub()  # type: ignore[no-untyped-call]  # untyped in redis-py
        try:
            with conns.errors("watch cancellations"):
                self._subscribe(keys.cancel_channel)
        except BaseException:
            self._pubsub.close()
            raise
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"sandboxq-cancel-watch-{keys.queue}", daemon=True
        )
        self._thread.start()

    def _subscribe(self, channel: str) -> None:
        self._pubsub.subscribe(channel)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            message = self._pubsub.get_message(timeout=0.5)
            if message is not None and message["type"] == "subscribe":
                return
        raise BackendError(f"Redis at {self._where} did not confirm SUBSCRIBE {channel}")

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                message = self._pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=WATCH_TICK_S
                )
            except (redis.RedisError, TypeError, OSError) as exc:
                # redis-py reconnects and resubscribes on the next read. A cancel sent
                # meanwhile still revoked the lease, so the owner's next renew fences it.
                # (A connection closed under the read surfaces as TypeError or OSError.)
                if self._stopping.is_set():
                    return
                log.warning("cancellation watch on %s: %s", self._where, exc)
                self._stopping.wait(0.5)
                continue
            if message is None or message["type"] != "message":
                continue
            try:
                # "<lease token> <job id>" (cancel.lua; an empty token, as older versions
                # sent for a job that held no lease, is no attempt's). Ids may hold
                # spaces, tokens never do.
                token, _, job_id = records.text(message["data"]).partition(" ")
                self._callback(job_id, token or None)
            except Exception:
                log.exception("cancellation callback failed")

    def stop(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._pubsub.close()
