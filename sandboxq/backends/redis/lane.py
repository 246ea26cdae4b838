"""``Lane``: round trips to Redis with as little Python as possible; ``ClusterLane``: the
same to the Cluster node that serves a queue's hash slot.

The scripts (every state change) do not go through redis-py's per-command machinery: a
lane sends commands packed once (scripts.py) on connections it keeps itself. Every key of a
queue shares the ``{queue}`` hash tag, so on a Cluster all of one queue's scripts run on
the node that serves that slot: its ``ClusterLane`` talks to that node and follows the
slot if it moves. (aio_lane.py is the asyncio twin.)

Measured (bench/queue_bench.py, 2026-11, 9 alternating pairs on 2 cores), against the same
EVALSHA sent through redis-py's ``execute_command`` (a pipeline for several): enqueue one by
one 1.41x (11,000 against 7,800 jobs/s, about 38 µs less per command; the enqueue script
itself runs 28 µs in Redis). ``enqueue_many`` and a worker's no-op throughput are the same
either way (within 5 %), the worker process spending 11 % less CPU per job (61 against 69 µs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import MovedError

#: Connections one lane holds at most; a caller beyond waits for one to come back. Any
#: number of threads (a web server's, result() waiters woken together) then share a
#: bounded set instead of opening one each (500 waiting threads held 500).
MAX_CONNECTIONS = 16


class Lane:
    """Round trips on connections of ``client``'s kind, with as little Python as possible.

    Why: redis-py's per-command path (pool checkout, retry wrapper, event dispatch,
    metrics) costs about 40 µs per command on a 2-core VM (measured: see above), more than
    the Lua script it runs, and a job costs one or two scripts. A lane takes an idle
    connection (one per concurrent caller, up to ``MAX_CONNECTIONS``; the heartbeat has a
    lane of its own, so it never waits behind a claim),
    writes commands that were packed once, reads the replies with redis-py's parser and
    puts the connection back.

    A connection that sat idle is checked before use: if the server closed it (a restart),
    it is reconnected *before* anything is sent. A failure after sending is never retried
    here, because the script may have run: the caller decides (see ``Dispatcher._finish``).
    """

    def __init__(self, client: redis.Redis) -> None:
        pool = client.connection_pool
        self._make: Any = lambda: pool.connection_class(**pool.connection_kwargs)
        self._idle: list[Any] = []  # redis-py connections (untyped)
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False
        self._sent = threading.local()  # per calling thread: when its last write began

    def round_trip(self, commands: Sequence[bytes]) -> list[Any]:
        """Send packed ``commands`` in one write, then read one reply each (a reply that is
        an error is returned as its exception, so one failed command does not hide the
        others' replies). Raises redis errors for the connection itself."""
        with self._slots:
            return self._round_trip(commands)

    def _round_trip(self, commands: Sequence[bytes]) -> list[Any]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._make()
        try:
            stale = conn.can_read(timeout=0)  # a reply nobody read, or data after a hang-up
        except redis.ConnectionError:  # the server closed it (restart): reconnect below
            stale = True
        try:
            if stale:
                conn.disconnect()
            conn.connect()  # (nothing to do when connected) so the write's moment is known
            self._sent.at = time.monotonic()
            conn.send_packed_command([b"".join(commands)], check_health=False)
            replies = []
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            conn.disconnect()
            raise
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return replies
        conn.disconnect()
        return replies

    def sent_at(self) -> float:
        """When this thread's last round trip began to write, its connection already made
        (``time.monotonic()``): nothing it sent can have run on the server before this. A
        claim's lease is counted from here: a connection made through a slow link first
        took a lease's worth of it once, and the claimed jobs were fenced unstarted."""
        at: float = self._sent.at
        return at

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()


class ClusterLane(Lane):
    """A ``Lane`` to the Redis Cluster node that serves one hash slot (a queue's), following
    the slot when it moves. A command answered MOVED did not run, so once the slot map is
    refreshed it is sent again to the new owner; after a connection failure the map is
    refreshed before the next call (a failover may have promoted a replica)."""

    def __init__(self, cluster: RedisCluster, key: str) -> None:
        self._cluster = cluster
        self._key = key
        self._stale = False
        super().__init__(self._owner())

    def _owner(self) -> redis.Redis:
        node = self._cluster.get_node_from_key(self._key)  # type: ignore[no-untyped-call]
        client: redis.Redis = self._cluster.get_redis_connection(node)
        return client

    def _follow(self) -> None:
        """Refresh the slot map and send what comes next to the slot's owner now."""
        self._cluster.nodes_manager.initialize()
        pool = self._owner().connection_pool
        with self._lock:
            self._make = lambda: pool.connection_class(**pool.connection_kwargs)
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()

    def round_trip(self, commands: Sequence[bytes]) -> list[Any]:
        if self._stale:
            self._follow()
            self._stale = False
        try:
            replies = super().round_trip(commands)
            if replies and all(isinstance(reply, MovedError) for reply in replies):
                self._follow()
                replies = super().round_trip(commands)
        except (redis.ConnectionError, redis.TimeoutError):
            self._stale = True
            raise
        return replies


class NodeRoutedLane(ClusterLane):
    """A ``ClusterLane`` with no connections of its own: each round trip goes on the lane
    of the node that serves the slot now (``lanes(node)``, shared by every queue of that
    node), and follows the slot as a ``ClusterLane`` does. A dashboard's hundreds of
    queues on a Cluster then hold a connection per node, not one each."""

    def __init__(self, cluster: RedisCluster, key: str, lanes: Callable[[Any], Lane]) -> None:
        super().__init__(cluster, key)
        self._lanes = lanes
        self._via = threading.local()  # per calling thread: the node lane it last used

    def _round_trip(self, commands: Sequence[bytes]) -> list[Any]:
        node = self._cluster.get_node_from_key(self._key)  # type: ignore[no-untyped-call]
        self._via.lane = lane = self._lanes(node)
        return lane.round_trip(commands)

    def sent_at(self) -> float:
        lane: Lane = self._via.lane
        return lane.sent_at()
