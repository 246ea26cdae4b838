"""The Redis clients of one backend, its options, and the one place Redis errors become
``BackendError``.

Three clients, each with its own connection pool, so no call queues behind another kind:

    main     enqueue, claim, finish, reads, pub/sub for cancellations
    renew    the heartbeat's renewals only: a big enqueue or a slow read on the main pool
             must never delay a lease renewal (design invariant 5)
    blocking BLPOP and XREAD BLOCK; its socket timeout exceeds the longest block it is
             asked for, so a quiet queue is not mistaken for a dead server

Each client has a ``Lane`` beside it for the scripts (lane.py); where the clients connect,
by URL, and with which TLS options, is urls.py's. The renew and blocking clients are made
at their first use: a producer, the dashboard and the exporter need neither, and on a
Cluster each client costs a discovery of the nodes and the server's command table (about
35 ms here).

A backend per queue on one server (the dashboard's) shares the first one's clients and
lanes (``share=``; on a Cluster, a lane per queue's slot): 200 queues on a Cluster had
cost 200 discoveries before the first overview (8.6 s) and 540 connections.

Secrets never leave this module in clear: every error names the server by its URL as
``sandboxq.redaction.redact_url`` shows it (password and secret query options as ``***``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoPermissionError, RedisClusterException

from sandboxq.backends.redis.lane import ClusterLane, Lane, NodeRoutedLane
from sandboxq.backends.redis.urls import (
    CLUSTER_SCHEMES,
    SENTINEL_SCHEMES,
    Client,
    client_builder,
    retry,
)
from sandboxq.backends.rules import Retention
from sandboxq.errors import BackendError, BackendUnreachable, ConfigError, DamagedRecord
from sandboxq.redaction import redact_url as redact

__all__ = [
    "BLOCK_CAP_S",
    "CLUSTER_SCHEMES",
    "SENTINEL_SCHEMES",
    "Connections",
    "Lane",
    "RedisOptions",
    "redact",
    "redis_errors",
]

#: Longest single blocking read; longer waits are made of several.
BLOCK_CAP_S = 30.0


@dataclass(frozen=True)
class RedisOptions(Retention):
    """A Redis backend's options (the sync and the asyncio client's alike): what every
    backend keeps, and how long a reply may take."""

    socket_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        timeout = self.socket_timeout_s
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ConfigError(f"socket_timeout_s must be positive, got {timeout!r}")


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
    redacted URL), what was being done and, where it can tell, what to do about it
    (``backend_error``) (``Connections.errors``, and the async backend)."""
    try:
        yield
    except (redis.RedisError, RedisClusterException) as exc:
        raise backend_error(where, doing, exc, wrong_types) from exc


def backend_error(
    where: str,
    doing: str,
    exc: redis.RedisError | RedisClusterException,
    wrong_types: Callable[[], str | None] | None = None,
) -> BackendError:
    """The ``BackendError`` for a Redis failure: a TLS failure, an ACL refusal, or a
    queue key of the wrong type (``wrong_types`` names it) say what to do about it."""
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return BackendUnreachable(
            f"Redis at {where} is unreachable ({doing}): {exc}{tls_hint(str(exc))}"
        )
    if isinstance(exc, NoPermissionError):
        return BackendError(
            f"Redis at {where} refused to {doing}: permission denied by the "
            f"server's ACL for this user ({exc}); the rules each role needs are "
            "sandboxq.backends.redis.acl.rules(queue, role), tabled in the README"
        )
    if "WRONGTYPE" in str(exc):  # the server is up: a key of the queue is damaged
        detail = wrong_types() if wrong_types is not None else None
        return DamagedRecord(f"Redis at {where} failed to {doing}: {detail or exc}")
    return BackendError(f"Redis at {where} failed to {doing}: {exc}")


class Connections:
    def __init__(
        self,
        url: str,
        socket_timeout_s: float,
        slot_key: str,
        key_types: dict[str, str] | None = None,
        *,
        share: Connections | None = None,
    ) -> None:
        """Clients for ``url``; ``slot_key`` is any key of the queue (on a Cluster, the
        lanes go to the node that serves its slot). ``key_types`` maps the queue's own
        keys to the type each must hold: a WRONGTYPE error then names the damaged key.
        With ``share`` (Connections for the same ``url``, that outlive these), its
        clients and lanes are used, and on a Cluster lanes of this slot's own."""
        self.where = redact(url)
        self._key_types = dict(key_types or {})
        #: A Cluster: scripts go to the slot's node; every other command routes by key.
        self.cluster = False
        self._closers: list[Callable[[], None]] = []
        self._slot_key = slot_key
        self._timeout_s = socket_timeout_s
        self._share = share
        self._more: dict[str, tuple[Client, Lane]] = {}  # renew and blocking, once made
        self._more_lock = threading.Lock()
        self._node_lanes: dict[str, Lane] = {}
        try:
            if share is None:
                self._connect = self._connector(url)
            else:
                self.cluster = share.cluster
            with self.errors("connect"):
                if share is None:
                    self.main: Client = self._connect(socket_timeout_s)
                    self.main_lane = self._lane(self.main, slot_key)
                else:
                    self.main, self.main_lane = self._shared(share.main, share.main_lane, True)
        except ValueError as exc:  # a bad port, IPv6 address, query option, path...
            self.close()
            raise ConfigError(f"invalid Redis URL {self.where!r}: {exc}") from None
        except BaseException:
            self.close()
            raise

    @property
    def renew(self) -> Client:
        return self._client("renew", self._timeout_s)[0]

    @property
    def renew_lane(self) -> Lane:
        return self._client("renew", self._timeout_s)[1]

    @property
    def blocking(self) -> Client:
        return self._client("blocking", BLOCK_CAP_S + self._timeout_s)[0]

    @property
    def blocking_lane(self) -> Lane:
        return self._client("blocking", BLOCK_CAP_S + self._timeout_s)[1]

    def _client(self, role: str, timeout_s: float) -> tuple[Client, Lane]:
        """The ``role`` client and its lane, made at the first call (``BackendError`` when
        that fails). Used after ``close``, it connects again, as the main client does."""
        made = self._more.get(role)
        if made is not None:
            return made
        with self._more_lock:
            made = self._more.get(role)
            if made is None:
                with self.errors("connect"):
                    if self._share is not None:
                        made = self._shared(*self._share._client(role, timeout_s))
                    else:
                        client = self._connect(timeout_s)
                        made = (client, self._lane(client, self._slot_key))
                    self._more[role] = made
        return made

    def on_nodes(self, commands: Sequence[tuple[Any, bytes]]) -> list[Any]:
        """Packed ``(node, command)`` pairs sent to those Cluster nodes, one write per node
        on a lane of its own, kept until ``close``: replies in order, an error reply as
        its exception (``MovedError`` for a slot that left that node since the slot map
        was read). Many reads of many slots cost a round trip per node, not the client's
        per-command work each. A connection failure refreshes the slot map, then raises
        (a failover: the next call goes to the new primary)."""
        if self._share is not None:  # a node's lane serves every queue of that node
            return self._share.on_nodes(commands)
        by_node: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for position, (node, _) in enumerate(commands):
            by_node.setdefault(node.name, []).append(position)
            nodes[node.name] = node
        replies: list[Any] = [None] * len(commands)
        for name, positions in by_node.items():
            try:
                got = self.node_lane(nodes[name]).round_trip([commands[i][1] for i in positions])
            except (redis.ConnectionError, redis.TimeoutError):
                cluster: Any = self.main
                cluster.nodes_manager.initialize()
                raise
            for position, reply in zip(positions, got, strict=True):
                replies[position] = reply
        return replies

    def node_lane(self, node: Any) -> Lane:
        """The lane to one Cluster node (the main client's kind), made at first use and
        kept until ``close``; a sibling's are its share's."""
        if self._share is not None:
            return self._share.node_lane(node)
        with self._more_lock:
            lane = self._node_lanes.get(node.name)
            if lane is None:
                cluster: Any = self.main
                lane = self._node_lanes[node.name] = Lane(cluster.get_redis_connection(node))
                self._closers.append(lane.close)
        return lane

    def _shared(self, client: Client, lane: Lane, main: bool = False) -> tuple[Client, Lane]:
        """A shared client, and its lane where every queue's scripts go to one server; on
        a Cluster a lane of this queue's own, that follows its slot: the main one on the
        node lanes every queue shares (200 queues held a connection each)."""
        if not self.cluster:
            return client, lane
        if main and isinstance(client, RedisCluster):
            routed = NodeRoutedLane(client, self._slot_key, self.node_lane)
            self._closers.append(routed.close)
            return client, routed
        return client, self._lane(client, self._slot_key)

    def _lane(self, client: Client, slot_key: str) -> Lane:
        lane = ClusterLane(client, slot_key) if isinstance(client, RedisCluster) else Lane(client)
        self._closers.append(lane.close)
        return lane

    def _connector(self, url: str) -> Callable[[float], Client]:
        """A function from socket timeout to a new client for ``url``."""
        build, self.cluster = client_builder(url, self._closers)

        def connect(timeout_s: float) -> Client:
            client = build(
                socket_connect_timeout=min(2.0, timeout_s),
                socket_timeout=timeout_s,
                retry=retry(),
            )
            self._closers.append(client.close)
            return client

        return connect

    def errors(self, doing: str) -> AbstractContextManager[None]:
        """Turn any Redis failure inside the block into a ``BackendError`` naming the server
        and what was being done."""
        return redis_errors(self.where, doing, self._wrong_types)

    def error(self, doing: str, exc: redis.RedisError | RedisClusterException) -> BackendError:
        """A Redis failure (a pipeline's reply) as the ``BackendError`` ``errors`` raises."""
        return backend_error(self.where, doing, exc, self._wrong_types)

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
        self._node_lanes.clear()
