"""The Redis clients of one backend, and the one place Redis errors become ``BackendError``.

Three clients, each with its own connection pool, so no call queues behind another kind:

    main     enqueue, claim, finish, reads, pub/sub for cancellations
    renew    the heartbeat's renewals only: a big enqueue or a slow read on the main pool
             must never delay a lease renewal (invariant 5)
    blocking BLPOP and XREAD BLOCK; its socket timeout exceeds the longest block it is
             asked for, so a quiet queue is not mistaken for a dead server
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
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


class Connections:
    def __init__(self, url: str, socket_timeout_s: float) -> None:
        self.where = redact(url)
        try:
            self.main = connect(url, socket_timeout_s)
        except ValueError as exc:  # a bad port, IPv6 address or query option
            raise ConfigError(f"invalid Redis URL {self.where!r}: {exc}") from None
        self.renew = connect(url, socket_timeout_s)
        self.blocking = connect(url, BLOCK_CAP_S + socket_timeout_s)

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
        for client in (self.main, self.renew, self.blocking):
            client.close()
