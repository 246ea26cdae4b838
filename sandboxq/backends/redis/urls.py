"""Redis clients from a URL: which kind, where, as whom, over what TLS; every option checked.

    redis://[[user]:password@]host:port/db, rediss://..., unix:///path?db=N   one server
    redis+sentinel://[[user]:password@]h1:26379,h2:26379/service[/db]          the master
        Sentinel names for ``service`` (rediss+sentinel:// for TLS to the data nodes);
        after a failover each client reconnects to the new master by itself
    redis+cluster://[[user]:password@]h1:port[,h2:port...]                     a Cluster
        (rediss+cluster:// for TLS); any reachable node will do, the rest are discovered

TLS (every ``rediss`` scheme) verifies the server's certificate and host name by default,
against the system's CAs. URL query options, as redis-py names them, change that:
``ssl_ca_certs=/path/ca.pem`` (the CA that signed the server's certificate),
``ssl_certfile=...&ssl_keyfile=...`` (a client certificate, for mutual TLS),
``ssl_cert_reqs=none`` (no verification: say so explicitly). An unknown query option is a
``ConfigError`` naming it, not a silently ignored typo.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeAlias
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.retry import Retry
from redis.sentinel import Sentinel

from sandboxq.errors import ConfigError

Client: TypeAlias = "redis.Redis | RedisCluster"

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


#: TLS options a URL may carry (redis-py's names), on every scheme that speaks TLS.
TLS_OPTIONS = (
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_cert_reqs",
    "ssl_check_hostname",
    "ssl_min_version",
)


def _query_options(query: str, allowed: Sequence[str], scheme: str) -> dict[str, str]:
    """The query options of a URL, each checked against ``allowed``."""
    found: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in allowed:
            tls = ", ".join(TLS_OPTIONS)
            if scheme in SENTINEL_SCHEMES + CLUSTER_SCHEMES:
                raise ConfigError(
                    f"{scheme}:// URLs take no query options but TLS ones ({tls}), got {name!r}"
                )
            raise ConfigError(f"unknown option {name!r} in a {scheme}:// URL (TLS options: {tls})")
        if name.startswith("ssl_") and not scheme.startswith("rediss"):
            raise ConfigError(f"{name} is a TLS option: use rediss:// (not {scheme}://)")
        found[name] = value
    return found


def _database(text: str) -> int:
    """The database a URL's path names: a number (none: 0). redis-py reads a path it
    cannot parse as database 0, so a typo would use another queue's keys in silence."""
    if not text:
        return 0
    if not (text.isascii() and text.isdecimal()):
        raise ConfigError(f"the database must be a number, e.g. /0, got {text!r}")
    return int(text)


def check_plain(url: str) -> None:
    """What redis-py does not check of a redis://, rediss:// or unix:// URL: that each
    query option is one it knows (it passes others on to the connection class, where a
    typo such as ssl_ca_cert= fails only at the first command, as a TypeError), and that
    the path of a server's URL is a database number."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    _query_options(parts.query, [*URL_QUERY_ARGUMENT_PARSERS, *TLS_OPTIONS], scheme)
    if scheme != "unix":  # there the path is the socket's
        _database(parts.path.strip("/"))


def retry() -> Retry:
    # One immediate retry covers a pooled connection that died (Redis restarted); more
    # retries with backoff would turn "Redis is down" into a long hang.
    return Retry(NoBackoff(), 1)


def _nodes(netloc: str, default_port: int) -> list[tuple[str, int]]:
    """``h1:p1,h2:p2`` (after any ``user:password@``; ``[v6]:port`` too) as (host, port)."""
    nodes = []
    for item in netloc.rpartition("@")[2].split(","):
        item = item.strip()
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port = rest.removeprefix(":")
        else:
            host, _, port = item.partition(":")
        if not host:
            raise ConfigError(f"missing host in {item!r}")
        try:
            nodes.append((host, int(port) if port else default_port))
        except ValueError:
            raise ConfigError(f"bad port in {item!r}") from None
    return nodes


def _credentials(netloc: str) -> dict[str, Any]:
    userinfo, at, _ = netloc.rpartition("@")
    if not at:
        return {}
    user, colon, password = userinfo.partition(":")
    found: dict[str, Any] = {}
    if user:
        found["username"] = unquote(user)
    if colon:
        found["password"] = unquote(password)
    return found


def _tls_values(options: dict[str, str]) -> dict[str, Any]:
    """TLS query options as the client constructors take them."""
    values: dict[str, Any] = dict(options)
    if "ssl_check_hostname" in values:
        values["ssl_check_hostname"] = values["ssl_check_hostname"].lower() in ("1", "true", "yes")
    return values


def client_builder(
    url: str, closers: list[Callable[[], None]]
) -> tuple[Callable[..., Client], bool]:
    """A client constructor for ``url`` that takes the socket and retry options, and
    whether it makes Cluster clients. What must be closed with the clients (a Sentinel
    manager) is added to ``closers``."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SENTINEL_SCHEMES + CLUSTER_SCHEMES:
        check_plain(url)
        return partial(redis.Redis.from_url, url, decode_responses=False), False
    tls = _query_options(parts.query, TLS_OPTIONS, scheme)
    options: dict[str, Any] = {"decode_responses": False, **_credentials(parts.netloc)}
    if scheme.startswith("rediss"):
        options["ssl"] = True
        options.update(_tls_values(tls))
    if scheme in CLUSTER_SCHEMES:
        return _cluster(parts.netloc, parts.path, options), True
    return _sentinel(parts.netloc, parts.path, options, closers), False


def _cluster(netloc: str, path: str, options: dict[str, Any]) -> Callable[..., Client]:
    if path.strip("/") not in ("", "0"):
        raise ConfigError(f"a Redis Cluster has only database 0, got {path!r}")
    nodes = [
        ClusterNode(host, port)  # type: ignore[no-untyped-call]  # untyped in redis-py
        for host, port in _nodes(netloc, 6379)
    ]
    return partial(RedisCluster, startup_nodes=nodes, **options)


def _sentinel(
    netloc: str, path: str, options: dict[str, Any], closers: list[Callable[[], None]]
) -> Callable[..., Client]:
    service, _, db = path.strip("/").partition("/")
    if not service:
        raise ConfigError("a Sentinel URL names the master: host:port,.../service[/db]")
    options["db"] = _database(db)
    # One Sentinel manager (one connection per sentinel) serves all three clients; it
    # is only asked where the master is, so short timeouts suit it whatever they wait
    # for. Its own retry too: redis-py's default backs off for seconds on a dead
    # sentinel, when the next sentinel on the list could answer at once.
    sockets = {"socket_connect_timeout": 2.0, "socket_timeout": 2.0, "retry": retry()}
    manager = Sentinel(  # type: ignore[no-untyped-call]  # untyped in redis-py
        _nodes(netloc, 26379), sentinel_kwargs=sockets
    )
    closers.append(manager.close)
    return partial(manager.master_for, unquote(service), **options)
