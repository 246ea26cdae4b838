"""The Redis clients of one backend, and the one place Redis errors become ``BackendError``.

Three clients, each with its own connections, so no call queues behind another kind:

    main     enqueue, claim, finish, reads, pub/sub for cancellations
    renew    the heartbeat's renewals only: a big enqueue or a slow read on the main pool
             must never delay a lease renewal (invariant 5)
    blocking BLPOP and XREAD BLOCK; its socket timeout exceeds the longest block it is
             asked for, so a quiet queue is not mistaken for a dead server

The scripts (every state change) do not go through redis-py's per-command machinery: a
``Lane`` sends commands packed once on connections it keeps itself (see its docstring).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sandboxq.errors import BackendError, ConfigError

#: Longest single blocking read; longer waits are made of several.
BLOCK_CAP_S = 30.0


def redact(url: str) -> str:
    """The URL without its password, for error messages."""
    try:
        parts = urlsplit(url)
        password, port = parts.password, parts.port
    except ValueError:  # malformed (a bad port...): hide what sits between "user:" and "@"
        return re.sub(r"^(\w+://[^/@:]*):[^/@]*@", r"\1:***@", url)
    if password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}"
    if port:
        netloc += f":{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def connect(url: str, socket_timeout_s: float) -> redis.Redis:
    # One immediate retry covers a pooled connection that died (Redis restarted); more
    # retries with backoff would turn "Redis is down" into a long hang.
    return redis.Redis.from_url(
        url,
        decode_responses=False,
        socket_connect_timeout=min(2.0, socket_timeout_s),
        socket_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 1),
    )


class Lane:
    """Round trips on connections of ``client``'s kind, with as little Python as possible.

    Why: redis-py's per-command path (pool checkout, retry wrapper, event dispatch,
    metrics) costs about 100 µs of CPU per command on a 2-core VM, more than the Lua script
    it runs, and a job costs one or two scripts. A lane takes an idle connection (one per
    concurrent caller, so the heartbeat never waits behind a claim), writes commands that
    were packed once, reads the replies with redis-py's parser and puts the connection back.

    A connection that sat idle is checked before use: if the server closed it (a restart),
    it is reconnected *before* anything is sent. A failure after sending is never retried
    here, because the script may have run: the caller decides (see the worker's ``_finish``).
    """

    def __init__(self, client: redis.Redis) -> None:
        pool = client.connection_pool
        self._make: Any = lambda: pool.connection_class(**pool.connection_kwargs)
        self._idle: list[Any] = []  # redis-py connections (untyped)
        self._lock = threading.Lock()
        self._closed = False

    def round_trip(self, commands: Sequence[bytes]) -> list[Any]:
        """Send packed ``commands`` in one write, then read one reply each (a reply that is
        an error is returned as its exception, so one failed command does not hide the
        others' replies). Raises redis errors for the connection itself."""
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

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()


class Connections:
    def __init__(self, url: str, socket_timeout_s: float) -> None:
        self.where = redact(url)
        try:
            self.main = connect(url, socket_timeout_s)
        except ValueError as exc:  # a bad port, IPv6 address or query option
            raise ConfigError(f"invalid Redis URL {self.where!r}: {exc}") from None
        self.renew = connect(url, socket_timeout_s)
        self.blocking = connect(url, BLOCK_CAP_S + socket_timeout_s)
        self.main_lane = Lane(self.main)
        self.renew_lane = Lane(self.renew)
        self.blocking_lane = Lane(self.blocking)

    @contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        """Turn any Redis failure inside the block into a ``BackendError`` naming the server
        and what was being done."""
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise BackendError(f"Redis at {self.where} is unreachable ({doing}): {exc}") from exc
        except redis.RedisError as exc:
            raise BackendError(f"Redis at {self.where} failed to {doing}: {exc}") from exc

    def close(self) -> None:
        for lane in (self.main_lane, self.renew_lane, self.blocking_lane):
            lane.close()
        for client in (self.main, self.renew, self.blocking):
            client.close()
