"""The Redis clients of one backend, and the one place Redis errors become ``BackendError``.

Three clients, each with its own connection pool, so no call queues behind another kind:

    main     enqueue, claim, finish, reads, pub/sub for cancellations
    renew    the heartbeat's renewals only: a big enqueue or a slow read on the main pool
             must never delay a lease renewal (design invariant 5)
    blocking BLPOP and XREAD BLOCK; its socket timeout exceeds the longest block it is
             asked for, so a quiet queue is not mistaken for a dead server

Where they connect, by URL:

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

Secrets never leave this module in clear: every error names the server by its URL as
``sandboxq.redaction.redact_url`` shows it (password and secret query options as ``***``).

The scripts (every state change) do not go through redis-py's per-command machinery: a
``Lane`` sends commands packed once on connections it keeps itself (see its docstring).
Every key of a queue shares the ``{queue}`` hash tag, so on a Cluster all of one queue's
scripts run on the node that serves that slot: its ``ClusterLane`` talks to that node and
follows the slot if it moves. The redis-py clients route everything else by key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any, TypeAlias
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.exceptions import MovedError, NoPermissionError, RedisClusterException
from redis.retry import Retry
from redis.sentinel import Sentinel

from sandboxq.errors import BackendError, ConfigError
from sandboxq.redaction import redact_url as redact

#: Longest single blocking read; longer waits are made of several.
BLOCK_CAP_S = 30.0

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


def _retry() -> Retry:
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


def tls_hint(error: str) -> str:
    """What to do about a TLS failure in ``error`` (empty if it is none)."""
    if "CERTIFICATE_VERIFY_FAILED" in error or "certificate verify failed" in error:
        return (
            " (TLS: the server's certificate was refused; if it is signed by your own CA, "
            "name it with ?ssl_ca_certs=/path/to/ca.pem)"
        )
    if "SSL" in error or "TLS" in error:
        return (
            " (TLS handshake failed: check the server's TLS port, and ssl_certfile and "
            "ssl_keyfile if it requires client certificates)"
        )
    return ""


@contextmanager
def redis_errors(
    where: str, doing: str, wrong_types: Callable[[], str | None] | None = None
) -> Iterator[None]:
    """Any Redis failure inside the block as a ``BackendError`` naming ``where`` (the
    redacted URL), what was being done and, where it can tell, what to do about it: a TLS
    failure, an ACL refusal, or a queue key of the wrong type (``wrong_types`` names it)
    (``Connections.errors``, and the async backend)."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise BackendError(
            f"Redis at {where} is unreachable ({doing}): {exc}{tls_hint(str(exc))}"
        ) from exc
    except NoPermissionError as exc:
        raise BackendError(
            f"Redis at {where} refused to {doing}: permission denied by the "
            f"server's ACL for this user ({exc}); the rules each role needs are "
            "sandboxq.backends.redis.acl.rules(queue, role), tabled in the README"
        ) from exc
    except (redis.RedisError, RedisClusterException) as exc:
        detail = wrong_types() if wrong_types is not None and "WRONGTYPE" in str(exc) else None
        raise BackendError(f"Redis at {where} failed to {doing}: {detail or exc}") from exc


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


class Connections:
    def __init__(
        self,
        url: str,
        socket_timeout_s: float,
        slot_key: str,
        key_types: dict[str, str] | None = None,
    ) -> None:
        """Clients for ``url``; ``slot_key`` is any key of the queue (on a Cluster, the
        lanes go to the node that serves its slot). ``key_types`` maps the queue's own
        keys to the type each must hold: a WRONGTYPE error then names the damaged key."""
        self.where = redact(url)
        self._key_types = dict(key_types or {})
        #: A Cluster: scripts go to the slot's node; every other command routes by key.
        self.cluster = False
        self._closers: list[Callable[[], None]] = []
        try:
            connect = self._factory(url)
            with self.errors("connect"):
                self.main: Client = connect(socket_timeout_s)
                self.renew: Client = connect(socket_timeout_s)
                self.blocking: Client = connect(BLOCK_CAP_S + socket_timeout_s)
                self.main_lane = self._lane(self.main, slot_key)
                self.renew_lane = self._lane(self.renew, slot_key)
                self.blocking_lane = self._lane(self.blocking, slot_key)
        except ValueError as exc:  # a bad port, IPv6 address, query option, path...
            self.close()
            raise ConfigError(f"invalid Redis URL {self.where!r}: {exc}") from None
        except BaseException:
            self.close()
            raise

    def _lane(self, client: Client, slot_key: str) -> Lane:
        lane = ClusterLane(client, slot_key) if isinstance(client, RedisCluster) else Lane(client)
        self._closers.append(lane.close)
        return lane

    def _factory(self, url: str) -> Callable[[float], Client]:
        """A function from socket timeout to a new client for ``url``."""
        build = self._builder(url)

        def connect(timeout_s: float) -> Client:
            client = build(
                socket_connect_timeout=min(2.0, timeout_s),
                socket_timeout=timeout_s,
                retry=_retry(),
            )
            self._closers.append(client.close)
            return client

        return connect

    def _builder(self, url: str) -> Callable[..., Client]:
        """A client constructor for ``url`` that takes the socket and retry options."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in SENTINEL_SCHEMES + CLUSTER_SCHEMES:
            # redis-py passes unknown query options on to the connection class, where a
            # typo (ssl_ca_cert=) fails only at the first command, as a TypeError.
            _query_options(parts.query, [*URL_QUERY_ARGUMENT_PARSERS, *TLS_OPTIONS], scheme)
            return partial(redis.Redis.from_url, url, decode_responses=False)
        tls = _query_options(parts.query, TLS_OPTIONS, scheme)
        options: dict[str, Any] = {"decode_responses": False, **_credentials(parts.netloc)}
        if scheme.startswith("rediss"):
            options["ssl"] = True
            options.update(_tls_values(tls))
        if scheme in CLUSTER_SCHEMES:
            return self._cluster(parts.netloc, parts.path, options)
        return self._sentinel(parts.netloc, parts.path, options)

    def _cluster(self, netloc: str, path: str, options: dict[str, Any]) -> Callable[..., Client]:
        if path.strip("/") not in ("", "0"):
            raise ConfigError(f"a Redis Cluster has only database 0, got {path!r}")
        nodes = [
            ClusterNode(host, port)  # type: ignore[no-untyped-call]  # untyped in redis-py
            for host, port in _nodes(netloc, 6379)
        ]
        self.cluster = True
        return partial(RedisCluster, startup_nodes=nodes, **options)

    def _sentinel(self, netloc: str, path: str, options: dict[str, Any]) -> Callable[..., Client]:
        service, _, db = path.strip("/").partition("/")
        if not service:
            raise ConfigError("a Sentinel URL names the master: host:port,.../service[/db]")
        try:
            options["db"] = int(db or 0)
        except ValueError:
            raise ConfigError(f"bad database {db!r}") from None
        # One Sentinel manager (one connection per sentinel) serves all three clients; it
        # is only asked where the master is, so short timeouts suit it whatever they wait
        # for. Its own retry too: redis-py's default backs off for seconds on a dead
        # sentinel, when the next sentinel on the list could answer at once.
        sockets = {"socket_connect_timeout": 2.0, "socket_timeout": 2.0, "retry": _retry()}
        manager = Sentinel(  # type: ignore[no-untyped-call]  # untyped in redis-py
            _nodes(netloc, 26379), sentinel_kwargs=sockets
        )
        self._closers.append(manager.close)
        return partial(manager.master_for, unquote(service), **options)

    def errors(self, doing: str) -> AbstractContextManager[None]:
        """Turn any Redis failure inside the block into a ``BackendError`` naming the server
        and what was being done."""
        return redis_errors(self.where, doing, self._wrong_types)

    def _wrong_types(self) -> str | None:
        """Which of the queue's keys holds the wrong kind of value (changed by hand), for a
        WRONGTYPE error; None if none does (a single job's record was damaged, which the
        caller reports for that job alone)."""
        try:
            pipe = self.main.pipeline(transaction=False)
            for key in self._key_types:
                pipe.type(key)
            found = pipe.execute()
        except (redis.RedisError, RedisClusterException):
            return None
        wrong = [
            f"{key} holds a {kind.decode(errors='replace')}, not a {expected}"
            for (key, expected), kind in zip(self._key_types.items(), found, strict=True)
            if kind not in (expected.encode(), b"none")
        ]
        if not wrong:
            return None
        return (
            f"the queue's key {'; '.join(wrong)} (changed by hand?): this queue cannot work "
            "until that key is repaired or deleted"
        )

    def close(self) -> None:
        for close in reversed(self._closers):
            close()
        self._closers.clear()
