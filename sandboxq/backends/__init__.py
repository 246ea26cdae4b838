"""Backends: where jobs live, chosen by URL and imported lazily.

memory://            in-process (the embedded default; shared by every Queue and worker
                     of this process that names the same queue)
redis://host:port/db, rediss://..., unix:///path/to/socket
                     Redis, for production (see backends/redis/)
redis+sentinel://h1:26379,h2:26379/service[/db]
                     the master Redis Sentinel names for ``service``, followed over failovers
redis+cluster://h1:port[,h2:port...]
                     Redis Cluster (all of a queue's keys share one hash slot)
"""

from __future__ import annotations

import os
from typing import Any

from sandboxq.backends.base import Backend
from sandboxq.errors import ConfigError
from sandboxq.redaction import redact_url

URL_ENV = "SANDBOXQ_URL"
DEFAULT_URL = "memory://"
REDIS_SCHEMES = (
    "redis://",
    "rediss://",
    "unix://",
    "redis+sentinel://",
    "rediss+sentinel://",
    "redis+cluster://",
    "rediss+cluster://",
)


def resolve_url(url: str | None) -> str:
    """``url``, else ``$SANDBOXQ_URL``, else ``memory://``."""
    if url is not None and not isinstance(url, str):
        raise ConfigError(f"a backend URL is a string such as redis://host:6379/0, got {url!r}")
    return url or os.environ.get(URL_ENV) or DEFAULT_URL


def open_backend(url: str | None, queue: str, **options: Any) -> Backend:
    url = resolve_url(url)
    # the queue's name is checked by the backend that opens it
    if url.startswith("memory://"):
        from sandboxq.backends.memory import MemoryBackend

        return MemoryBackend.shared(queue, **options)
    if url.startswith(REDIS_SCHEMES):
        from sandboxq.backends.redis.backend import RedisBackend

        return RedisBackend(url, queue, **options)
    raise ConfigError(
        f"unsupported backend URL {redact_url(url)!r}: use memory://, redis://host:port/db, "
        "redis+sentinel://host:port/service or redis+cluster://host:port"
    )
