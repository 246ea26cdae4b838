"""Queue-level numbers read straight from Redis, for the exporter (``sandboxq exporter``).

    read_index ── SCARD + SSCAN of the queue index (keys.py: INDEX; on a Cluster one
                  set per slot, their sizes asked of each node at once: index_sizes.lua)
                  ──► pruned: EXISTS seq/workers per name read (on a Cluster each node's
                  in one write), SREM of the entries read that no queue is behind
                  ──► QueueIndex: well-formed names, at most a cap read
    read_stats(queues) ── one server: stats.lua per 250 queues, all in one round trip
                          (counts, head's ready time, workers read up to a cap and
                          their liveness, whether the queue was ever used)
                      ── Cluster: the same per node, for the queues its slots hold,
                          one write per node (Connections.on_nodes); a queue whose
                          slot moved meanwhile: pipeline 1: TIME; per queue 6 ZCARD,
                          the head of waiting, the worker set (SSCAN, capped), its
                          SCARD, EXISTS seq ──► pipeline 2: the head's ready time, one
                          EXISTS per registered worker read ──► QueueStats per queue

Every scrape is a few round trips whatever the number of jobs or keys: no job key is
ever listed, no keyspace is scanned, and the per-queue commands are a fixed handful
(plus one EXISTS per registered worker, at most WORKERS_READ_CAP).
A queue whose keys were changed by hand (a waiting set turned into a string) comes back
``damaged``, with the error: it costs only its own numbers, never the whole scrape.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS

from sandboxq.backends.index import (
    QUEUES_READ_CAP,
    WORKERS_READ_CAP,
    QueueIndex,
    valid_names,
)
from sandboxq.backends.redis import records
from sandboxq.backends.redis.connection import Connections
from sandboxq.backends.redis.keys import INDEX, QueueKeys, cluster_index, slot_tags
from sandboxq.backends.redis.scripts import pack_command, raise_errors
from sandboxq.errors import DamagedRecord
from sandboxq.models import JobState, stored_int
from sandboxq.text import clip

log = logging.getLogger(__name__)

SCAN_COUNT = 1000
#: Queues per stats.lua call: a call holds the server for its length (about 2 ms here).
STATS_CHUNK = 250
_STATS_LUA = (resources.files("sandboxq.backends.redis") / "lua" / "stats.lua").read_text(
    encoding="utf-8"
)
_INDEX_SIZES_LUA = (
    resources.files("sandboxq.backends.redis") / "lua" / "index_sizes.lua"
).read_text(encoding="utf-8")


@dataclass(slots=True)
class QueueStats:
    queue: str
    jobs: dict[JobState, int] = field(default_factory=dict)
    #: Age of the job at the head of the waiting line (None: nothing waits).
    oldest_waiting_age_s: float | None = None
    workers: int = 0
    #: More workers are registered than one look reads (WORKERS_READ_CAP).
    workers_capped: bool = False
    #: The queue was ever used: its sequence counter or its worker registry exists (an
    #: index entry someone added by hand has neither).
    exists: bool = True
    #: Why this queue's numbers could not be read (its keys hold the wrong types), or None.
    damaged: str | None = None


def read_index(conns: Connections, limit: int = QUEUES_READ_CAP, prune: bool = True) -> QueueIndex:
    """The queues in the index (keys.py: ``INDEX``, one set per slot on a Cluster), at
    most ``limit`` entries read. A few round trips whatever the keyspace holds.

    ``prune``: a name is kept only when its queue has a sequence counter or a worker
    registry, and entries that are neither queue names nor backed are removed from the
    index (on a Cluster, from the slot's set they were read from) where this client may
    write it: names added by hand cannot keep filling the cap (the exporter checks the
    same inside stats.lua and skips this while the index holds no more than one look
    reads)."""
    with conns.errors("read the queue index"):
        if conns.cluster:
            return _read_cluster_index(conns, limit, prune)
        try:
            total = int(conns.main.scard(INDEX))
        except redis.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            kind = conns.main.type(INDEX)
            raise DamagedRecord(
                f"the queue index {INDEX} holds a {records.text(kind)}, not a set (changed by "
                "hand?): delete it; every enqueue and every worker's registration adds its "
                "queue back"
            ) from None
        entries: list[bytes | str] = []
        cursor = 0
        while True:
            cursor, found = conns.main.sscan(INDEX, cursor, count=min(limit, SCAN_COUNT))
            entries += found
            if not cursor or len(entries) >= limit:
                break
        names, ignored = valid_names(entries[:limit])
        if not prune:
            return QueueIndex(names, total, ignored)
        pipe = conns.main.pipeline(transaction=False)
        for name in names:
            keys = QueueKeys(name)
            pipe.exists(keys.seq, keys.workers)
        backed = [name for name, n in zip(names, pipe.execute(), strict=True) if int(n)]
    refused = _forget(conns, {INDEX: entries[:limit]}, set(backed))
    return QueueIndex(backed, total, ignored, len(names) - len(backed), True, refused)


def _forget(conns: Connections, read: dict[str, Sequence[bytes | str]], keep: set[str]) -> str:
    """Remove the index entries read (by the index set each was read from) that are not
    ``keep``'s; best effort: a reader whose ACL may not write the index leaves them (and
    still ignores them), and gets why ("" when they were removed). On a Cluster each
    slot's set is its node's: one SREM per set, each node's in one write (a refused one,
    or one whose slot moved, is left for the next look)."""
    junk = {key: gone for key, found in read.items() if (gone := _junk(found, keep))}
    if not junk:
        return ""
    problem: Exception | None = None
    try:
        if conns.cluster:
            cluster: Any = conns.main
            commands = [
                (cluster.get_node_from_key(key), pack_command("SREM", key, *gone))
                for key, gone in junk.items()
            ]
            replies = conns.on_nodes(commands)
            problem = next((r for r in replies if isinstance(r, Exception)), None)
        else:
            conns.main.srem(INDEX, *junk[INDEX])
    except redis.RedisError as exc:
        problem = exc
    if problem is None:
        return ""
    n = sum(map(len, junk.values()))
    log.debug("could not remove %d junk entries from the queue index: %s", n, problem)
    return clip(str(problem), 120)


def _junk(entries: Sequence[bytes | str], keep: set[str]) -> list[bytes | str]:
    return [e for e in entries if records.text(e) not in keep]


def _read_cluster_index(conns: Connections, limit: int, prune: bool) -> QueueIndex:
    """The size of every slot's index set (index_sizes.lua, one call per node), then one
    bounded SSCAN of each non-empty one, until ``limit`` entries are covered; pruned as on
    one server (``read_index``). The slots are read in order, so without pruning a flood
    of names no queue is behind in the first slots filled every look and hid the queues
    of the later ones for good: each look now removes those it read."""
    sizes = _cluster_index_sizes(conns)
    total, wanted, budget = sum(sizes.values()), [], limit
    for slot, size in sorted(sizes.items()):
        if size and budget > 0:
            wanted.append((slot, min(size, budget)))
            budget -= size
    pipe = conns.main.pipeline()
    for slot, count in wanted:
        pipe.sscan(cluster_index(slot), 0, count=2 * count + 16)  # COUNT is a hint
    read: dict[str, Sequence[bytes | str]] = {}
    left = limit
    for (slot, _), (_, found) in zip(wanted, pipe.execute(), strict=True):
        taken = found[:left]  # entries beyond the look's limit are neither listed nor pruned
        read[cluster_index(slot)], left = taken, left - len(taken)
    names, ignored = valid_names(entry for found in read.values() for entry in found)
    if not prune:
        return QueueIndex(names, total, ignored)
    backed = _cluster_backed(conns, names)
    refused = _forget(conns, read, set(backed))
    return QueueIndex(backed, total, ignored, len(names) - len(backed), True, refused)


def _cluster_backed(conns: Connections, names: Sequence[str]) -> list[str]:
    """The names among ``names`` whose queue has a sequence counter or a worker registry:
    one EXISTS each (both keys share the queue's slot), each node's in one write
    (``Connections.on_nodes``: 2,000 took 12 ms of CPU, 79 ms through the client's
    pipeline, as much as the rest of the look). A name whose slot moved since the slot
    map was read is asked again through the client, which follows it; one still
    unanswered is kept (a name is never removed on a doubt)."""
    cluster: Any = conns.main
    asks = [_backing(name) for name in names]
    replies = conns.on_nodes([(cluster.get_node_from_key(seq), ask) for seq, _, ask in asks])
    again = [i for i, reply in enumerate(replies) if isinstance(reply, Exception)]
    if again:
        pipe = cluster.pipeline()
        for seq, workers, _ in (asks[i] for i in again):
            pipe.exists(seq, workers)
        for i, reply in zip(again, pipe.execute(raise_on_error=False), strict=True):
            replies[i] = reply
    return [
        name
        for name, reply in zip(names, replies, strict=True)
        if isinstance(reply, Exception) or int(reply)
    ]


def _cluster_index_sizes(conns: Connections) -> dict[int, int]:
    """Slot to the size of its index set, for the slots whose set is not empty: each
    primary node is asked for all of its slots at once; a slot that moved meanwhile is
    then read by key (a pipelined SCARD each, routed by the client)."""
    cluster: Any = conns.main
    sizes, moved = {}, []
    by_node = _slots_by_node(cluster.nodes_manager.slots_cache)
    replies = raise_errors(conns.on_nodes([(node, command) for node, _, command in by_node]))
    for (_, slots, _), reply in zip(by_node, replies, strict=True):
        for position, size in zip(reply[::2], reply[1::2], strict=False):
            if position > 0:
                sizes[slots[position - 1]] = int(size)
        moved += [slots[-position - 1] for position in reply if position < 0]
    served = cluster.nodes_manager.slots_cache
    unread = set(moved) | (set(range(REDIS_CLUSTER_HASH_SLOTS)) - served.keys())
    if unread:
        # The slot map changed under the grouping (redis-py patches it in place on a
        # MOVED, so its identity did not say so: every read after a move fell back to
        # 16,384 SCARDs): group again at the next read.
        global _by_node
        _by_node = (None, [])
        pipe = cluster.pipeline()
        for slot in sorted(unread):
            pipe.scard(cluster_index(slot))
        for slot, n in zip(sorted(unread), pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(n, Exception):  # a forged key costs its slot alone
                sizes[slot] = int(n)
    return {slot: size for slot, size in sizes.items() if size}


_by_node: tuple[object, list[tuple[Any, list[int], bytes]]] = (None, [])


def _slots_by_node(slots_cache: dict[int, list[Any]]) -> list[tuple[Any, list[int], bytes]]:
    """Each primary node, its slots and the index_sizes.lua call for them, packed; worked
    out again only when the client's slot map is replaced (a refresh makes a new one):
    grouping the slots and packing 5,500 arguments was most of a read's CPU (23 ms)."""
    global _by_node
    known, found = _by_node
    if known is slots_cache:
        return found
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for slot, nodes in slots_cache.items():
        by_node.setdefault(nodes[0].name, (nodes[0], []))[1].append(slot)
    tags = slot_tags()
    found = [
        (
            node,
            slots,
            pack_command("EVAL", _INDEX_SIZES_LUA, 0, f"{INDEX}:", *map(tags.__getitem__, slots)),
        )
        for node, slots in by_node.values()
    ]
    _by_node = (slots_cache, found)
    return found


@functools.lru_cache(maxsize=2 * QUEUES_READ_CAP)
def _backing(queue: str) -> tuple[str, str, bytes]:
    """A queue's sequence counter and worker registry, and their EXISTS packed (kept:
    every look asks again; making them anew took 2,000 names' check from 12 to 27 ms)."""
    k = QueueKeys(queue)
    return k.seq, k.workers, pack_command("EXISTS", k.seq, k.workers)


def read_stats(conns: Connections, queues: Sequence[str]) -> list[QueueStats]:
    """The numbers of ``queues``: one stats.lua call per STATS_CHUNK queues (on a Cluster,
    of one node's queues), all in one round trip per server."""
    if not conns.cluster:
        return _read_stats_script(conns, queues)
    return _read_stats_on_nodes(conns, queues)


def _read_stats_pipelined(conns: Connections, queues: Sequence[str]) -> list[QueueStats]:
    """TIME, then two pipelined round trips of commands the client routes by key: the
    queues whose slot moved while ``_read_stats_on_nodes`` read them."""
    keys = [QueueKeys(q) for q in queues]
    n_states = len(JobState)
    with conns.errors("read queue statistics"):
        # a Cluster pipeline refuses TIME: asked of one node on its own
        cluster: Any = conns.main  # only a Cluster takes this path
        now_reply = cluster.execute_command("TIME", target_nodes=cluster.get_random_node())
        pipe = conns.main.pipeline(transaction=False)
        for k in keys:
            for state in JobState:
                pipe.zcard(k.state_set(state))
            pipe.zrange(k.waiting, 0, 0)
            # at most WORKERS_READ_CAP of them: a registry padded with 200,000 names made
            # one scrape take 3.7 s (SMEMBERS, then an EXISTS each)
            pipe.sscan(k.workers, 0, count=WORKERS_READ_CAP)
            pipe.scard(k.workers)
            pipe.exists(k.seq)
        # raise_on_error=False: a queue whose keys were damaged by hand answers errors in
        # its own rows, and the other queues are still read
        first: list[Any] = [now_reply, *pipe.execute(raise_on_error=False)]
        seconds, micros = first[0]
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        per = n_states + 4
        rows = [first[1 + i * per : 1 + (i + 1) * per] for i in range(len(keys))]
        out: list[QueueStats] = []
        listed: list[list[str]] = []
        pipe = conns.main.pipeline(transaction=False)
        for k, row in zip(keys, rows, strict=True):
            if problem := next((v for v in row if isinstance(v, Exception)), None):
                out.append(QueueStats(k.queue, damaged=str(problem)))
                listed.append([])
                continue
            head, (_, members), registered, used = row[n_states:]
            stats = QueueStats(k.queue, dict(zip(JobState, map(int, row[:n_states]), strict=True)))
            stats.exists = bool(int(used)) or bool(int(registered))
            workers = sorted({records.text(w) for w in members})[:WORKERS_READ_CAP]
            stats.workers_capped = int(registered) > len(workers)
            if head:
                pipe.hmget(k.job(records.text(head[0])), ["ready_ms", "created_ms"])
            for worker in workers:
                pipe.exists(k.worker(worker))
            out.append(stats)
            listed.append(workers)
        second: list[Any] = pipe.execute(raise_on_error=False) if len(pipe) else []
    pos = 0
    for stats, row, workers in zip(out, rows, listed, strict=True):
        if stats.damaged is not None:
            continue
        if row[n_states]:
            head = second[pos]
            pos += 1
            # a head job whose record is not a hash: its age is unknown, not the scrape's end
            ready, created = (None, None) if isinstance(head, Exception) else head
            since = _int(ready) or _int(created)
            if since is not None:
                stats.oldest_waiting_age_s = max(0, now_ms - since) / 1000
            else:
                stats.oldest_waiting_age_s = 0.0
        else:
            stats.oldest_waiting_age_s = 0.0
        live = second[pos : pos + len(workers)]
        pos += len(workers)
        stats.workers = sum(1 for flag in live if not isinstance(flag, Exception) and int(flag))
    return out


@functools.lru_cache(maxsize=2 * QUEUES_READ_CAP)
def _stats_keys(queue: str) -> tuple[str, ...]:
    """A queue's KEYS for stats.lua, in its order (kept: every scrape asks again)."""
    k = QueueKeys(queue)
    states = [k.state_set(state) for state in JobState]
    return (*states, k.workers, k.seq, k.job_prefix, k.worker_prefix)


def _read_stats_script(conns: Connections, queues: Sequence[str]) -> list[QueueStats]:
    """stats.lua over ``queues`` in chunks, all chunks in one round trip. Sending ints
    back from one script instead of ten commands per queue is what keeps a scrape of
    1,000 queues cheap: redis-py's per-command packing and parsing was most of it."""
    n_keys = len(JobState) + 4
    script = conns.main.register_script(_STATS_LUA)
    chunks = [queues[i : i + STATS_CHUNK] for i in range(0, len(queues), STATS_CHUNK)]
    with conns.errors("read queue statistics"):
        pipe = conns.main.pipeline(transaction=False)
        for chunk in chunks or [[]]:
            script(keys=_chunk_keys(chunk), args=[n_keys, WORKERS_READ_CAP], client=pipe)
        replies: list[Any] = pipe.execute()
    return [s for chunk, reply in zip(chunks, replies, strict=False) for s in _rows(chunk, reply)]


def _read_stats_on_nodes(conns: Connections, queues: Sequence[str]) -> list[QueueStats]:
    """stats.lua on each Cluster node for the queues its slots hold, their keys in ARGV
    (declared, keys of several slots are refused; a script without a shebang may read
    every slot its node serves), all nodes' calls in one write each. A queue whose slot
    moved since the slot map was read is read again the pipelined way. 1,000 queues
    took 0.53 s of a scrape through the client's pipeline."""
    cluster: Any = conns.main
    by_node: dict[str, tuple[Any, list[str]]] = {}
    for queue in queues:
        node = cluster.get_node_from_key(f"sq:{{{queue}}}:x")
        by_node.setdefault(node.name, (node, []))[1].append(queue)
    n_keys = len(JobState) + 4
    calls: list[tuple[Any, list[str]]] = [
        (node, held[i : i + STATS_CHUNK])
        for node, held in by_node.values()
        for i in range(0, len(held), STATS_CHUNK)
    ]
    commands = [
        (node, pack_command("EVAL", _STATS_LUA, 0, n_keys, WORKERS_READ_CAP, *_chunk_keys(chunk)))
        for node, chunk in calls
    ]
    with conns.errors("read queue statistics"):
        replies = raise_errors(conns.on_nodes(commands))
    found = {
        s.queue: s for (_, chunk), r in zip(calls, replies, strict=True) for s in _rows(chunk, r)
    }
    moved = [q for q, s in found.items() if s.damaged is not None and _NOT_LOCAL in s.damaged]
    if moved:
        found.update((s.queue, s) for s in _read_stats_pipelined(conns, moved))
    return [found[queue] for queue in queues]


#: A script's read of a slot its node does not serve fails with this.
_NOT_LOCAL = "non local key"


def _chunk_keys(chunk: Sequence[str]) -> list[str]:
    return [key for queue in chunk for key in _stats_keys(queue)]


def _rows(chunk: Sequence[str], reply: list[Any]) -> list[QueueStats]:
    """stats.lua's reply for the queues of ``chunk``, as their ``QueueStats``."""
    out: list[QueueStats] = []
    n_states = len(JobState)
    now_ms, pos = int(reply[0]), 1
    for queue in chunk:
        if isinstance(reply[pos], bytes):  # that queue's keys hold the wrong types
            out.append(QueueStats(queue, damaged=records.text(reply[pos])))
            pos += 1
            continue
        row = [int(v) for v in reply[pos : pos + n_states + 4]]
        pos += n_states + 4
        ready, registered, live, used = row[n_states:]
        stats = QueueStats(queue, dict(zip(JobState, row[:n_states], strict=True)))
        stats.oldest_waiting_age_s = max(0, now_ms - ready) / 1000 if ready > 0 else 0.0
        stats.workers = live
        stats.workers_capped = registered > WORKERS_READ_CAP
        stats.exists = bool(used)
        out.append(stats)
    return out


def _int(value: Any) -> int | None:
    try:
        return stored_int(value) if value is not None else None
    except ValueError:
        return None
