"""The least a Redis ACL user needs to work one queue, as a worker or as a producer.

    rules("thumbs", "worker")    ->  ["resetkeys", "resetchannels", "-@all", "~sq:{thumbs}:*", ...]
    ACL SETUSER thumbs-worker on >password <the rules>

The README's table is checked against this module, so the documented rules and the
tested ones are the same. Every state change is a Lua script, run here with ``EVALSHA``
(and ``SCRIPT LOAD`` when the server's script cache is empty); since Redis 7 the commands a
script calls are checked against the caller's ACL too, so both roles need them. Neither
role gets ``fcall`` or ``function|load``: a function runs with its caller's rights, so a
user who may load one could replace the scripts' library and act as every queue's worker
(scripts.py falls back to ``EVALSHA`` for such users).

What separates the roles is what only a worker does outside the scripts: it registers
itself (``SET``/``SADD``/``SREM`` on the worker registry), blocks on the wake list and
its own unblock list (``BLPOP``; a stop pushes to the latter with ``LPUSH``/``PEXPIRE``,
which the scripts need anyway) and subscribes to cancellations. A producer-only user
lacks those, so a worker started with its credentials fails at once with Redis's
``NOPERM`` naming the command.
Both add to the queue index (a set of names shared by every queue on the server, or by
the queues of one Cluster slot), through an ACL selector that allows ``SADD`` there and
nothing else: a user of one queue can add names to it, which is why its readers ignore
malformed entries, cap what they read, and say so, but cannot delete or replace it.
The scripts of a batch member's moves also touch the batch's keys (``batch:*``,
``bdone:*``, ``batches``, ``batch_index``), a finish or a cancel those of retention
(``expiry``, ``trims``), and a batch's follow-up is written by the
finish that ends its last member, on the ``then`` queue: a worker whose rules do not
reach that queue finishes the member anyway, and the batch records why the follow-up
was not sent (``then_error``).
ACLs cannot tell one script from another: a producer user can still run the claim
script by hand. They keep a client to its own queue's keys; they do not make a
producer's credentials safe to hand to someone hostile.
"""

from __future__ import annotations

from typing import Literal

from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.models import check_queue_name

Role = Literal["worker", "producer"]
ROLES: tuple[Role, ...] = ("worker", "producer")

#: What the Lua scripts call (lua/*.lua), for either role.
SCRIPT_COMMANDS = (
    "del",
    "exists",
    "get",  # the guard: the seq counter (common.lua: guard_queue_keys)
    "hdel",
    "hexists",
    "hget",
    "hincrby",
    "hkeys",
    "hlen",
    "hmget",
    "hset",
    "incr",
    "incrby",
    "llen",
    "lpush",
    "ltrim",
    "pexpire",
    "publish",
    "rpush",
    "sadd",  # the queue index (enqueue.lua, batch_enqueue.lua)
    "time",
    "type",
    "xadd",
    "xlen",
    "zadd",
    "zcard",
    "zinter",
    "zmscore",
    "zpopmin",
    "zrange",
    "zrangebyscore",
    "zrem",
    "zremrangebyrank",
    "zrevrangebyscore",
    "zscore",
)

#: Running the scripts.
SCRIPTING = ("evalsha", "script|load")

#: Reading a queue: job records, results, counts, listings, events, the worker registry.
READ_COMMANDS = (
    "hgetall",
    "hstrlen",
    "llen",
    "lrange",
    "zrevrange",
    "xrange",
    "xread",
    "xrevrange",
    "smembers",
    "sscan",
    "pttl",  # a worker record's age by the server's clock
    "mget",
    "strlen",
    "select",
    "ping",
    # the finish listener names its connection (sandboxq-finishes in CLIENT LIST)
    "client|setname",
)

#: Only a worker: its registry entry, the wake list, cancellations.
WORKER_COMMANDS = ("set", "sadd", "srem", "blpop", "subscribe", "unsubscribe")

#: A Redis Cluster client also reads the slot map and the command table (not tested here).
CLUSTER_COMMANDS = ("cluster|slots", "cluster|shards", "command")


def commands(role: Role, *, cluster: bool = False) -> list[str]:
    """The commands ``role`` needs, sorted."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
    needed = {*SCRIPT_COMMANDS, *SCRIPTING, *READ_COMMANDS}
    if role == "worker":
        needed.update(WORKER_COMMANDS)
    if cluster:
        needed.update(CLUSTER_COMMANDS)
    return sorted(needed)


def key_patterns(queue: str, role: Role, *, cluster: bool = False) -> list[str]:
    """ACL key patterns: a worker reads and writes every key of its queue (one hash tag);
    a producer every key but the worker registry, which it may only read. The queue index
    (``sq:queues``; on a Cluster the queue's slot's), where enqueue and registration add
    the queue's name, is ``index_selector``'s."""
    keys = QueueKeys(check_queue_name(queue), cluster=cluster)
    if role == "worker":
        return [f"~sq:{{{keys.queue}}}:*"]
    writable = [
        keys.job_prefix + "*",
        keys.history_prefix + "*",
        keys.waiting,
        keys.delayed,
        keys.active,
        keys.completed,
        keys.failed,
        keys.cancelled,
        keys.seq,
        keys.events,
        keys.wake,
        keys.batch_prefix + "*",
        keys.batch_done_prefix + "*",
        keys.batches,
        keys.batch_index,
        keys.expiry,
        keys.trims,
    ]
    readable = [keys.workers, keys.worker_prefix + "*", keys.guard]
    return [f"~{key}" for key in writable] + [f"%R~{key}" for key in readable]


def index_selector(queue: str, *, cluster: bool = False) -> str:
    """The queue index is shared by every queue on the server (or Cluster slot): a queue's
    user may only add to it. Given as a key pattern beside the queue's own, it could delete
    the index or put a list in its place, which stopped every other queue's enqueues and
    workers. So it is reached through an ACL selector (Redis 7) that allows ``SADD`` there
    and nothing else; the scripts get its name as an argument, not a key (common.lua), as
    a call's keys must all be allowed by one set of rights."""
    return f"(~{QueueKeys(check_queue_name(queue), cluster=cluster).index} +sadd)"


def rules(queue: str, role: Role, *, cluster: bool = False) -> list[str]:
    """The ``ACL SETUSER`` rules (after ``on`` and the password) for ``role`` on ``queue``."""
    keys = QueueKeys(check_queue_name(queue))
    return [
        "resetkeys",
        "resetchannels",
        "-@all",
        *key_patterns(queue, role, cluster=cluster),
        f"&{keys.cancel_channel}",
        *(f"+{command}" for command in commands(role, cluster=cluster)),
        index_selector(queue, cluster=cluster),
    ]
