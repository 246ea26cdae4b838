"""Reading a queue's worker registry: who is live, within a bound, whatever it holds.

    sq:{q}:workers (SET of worker ids) ── SSCAN, a cap's worth a round ──► ids
    sq:{q}:worker:<id> (a record with a TTL) ── MGET ──► live (a record) or dead (none)
        live ── PTTL ──► the record's age by the server's clock (records.worker_record)
        dead ── SREM ──► forgotten (where this reader may write; fine where it may not)

A worker adds its id when it registers and removes it when it stops; one that died leaves
its id behind until a reader forgets it. Anyone with a worker's rights may add names, so a
look walks the set round after round until it ends, ``WORKERS_READ_CAP`` live workers
were found, or ``WORKERS_SCAN_CAP`` entries were examined: a live worker among 100,000
names added by hand is found (one round of one SSCAN read the first thousand, and showed
none), and a look that stopped short says so (``WorkerRegistry.capped``).
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from sandboxq.backends.index import WORKERS_READ_CAP, WORKERS_SCAN_CAP, WorkerRegistry
from sandboxq.backends.redis import records
from sandboxq.backends.redis.connection import Connections
from sandboxq.backends.redis.keys import QueueKeys

log = logging.getLogger(__name__)


def read_workers(conns: Connections, keys: QueueKeys) -> WorkerRegistry:
    """The live workers' records (sorted by id, at most ``WORKERS_READ_CAP``), the dead
    names read forgotten where this reader may write."""
    main = conns.main
    live: dict[str, dict[str, Any]] = {}
    cursor, examined, may_forget = 0, 0, True
    with conns.errors("list workers"):
        while True:
            cursor, members = main.sscan(keys.workers, cursor, count=WORKERS_READ_CAP)
            examined += len(members)
            # SSCAN may return a member twice: a worker already read is not read again
            ids = sorted({records.text(m) for m in members} - live.keys())
            gone = _read_round(main, keys, ids, live)
            if gone and may_forget:
                may_forget = _forget(main, keys, gone)
            if cursor == 0 or len(live) >= WORKERS_READ_CAP or examined >= WORKERS_SCAN_CAP:
                break
    chosen = sorted(live)[:WORKERS_READ_CAP]
    return WorkerRegistry([live[w] for w in chosen], capped=cursor != 0)


def _read_round(main: Any, keys: QueueKeys, ids: list[str], live: dict[str, Any]) -> list[str]:
    """Read the records of ``ids`` into ``live``; returns the ids with none (dead)."""
    if not ids:
        return []
    values = main.mget([keys.worker(w) for w in ids])
    found = [(w, v) for w, v in zip(ids, values, strict=True) if v is not None]
    pipe = main.pipeline(transaction=False)
    for w, _ in found:  # each record's age, by the server's clock: its time to live left
        pipe.pttl(keys.worker(w))
    ttls_left = pipe.execute() if found else []
    for (w, value), ttl_left in zip(found, ttls_left, strict=True):
        live[w] = records.worker_record(w, value, ttl_left)
    return [w for w, v in zip(ids, values, strict=True) if v is None]


def _forget(main: Any, keys: QueueKeys, gone: list[str]) -> bool:
    """Remove dead ids from the registry; False when this reader may not (a read-only ACL
    user), so the rest of the look does not ask again."""
    try:
        main.srem(keys.workers, *gone)
    except redis.RedisError as exc:
        log.debug("could not forget dead workers of %r: %s", keys.queue, exc)
        return False
    return True
