"""The Redis backend's batches: one hash of counters per batch, kept by the scripts that
move its members, and one stream of the members that reached a final state.

    enqueue_batch ── batch_enqueue.lua (ENQUEUE_CHUNK members a call, all in one round
                     trip) ──► sq:{q}:batch:<bid> (counters, sealed by the last chunk)
    every script that moves a member ── common.lua batch_move ──► counters; a final state
                     also XADDs to sq:{q}:bdone:<bid>, and the last one sends ``then``
    batch_progress ── batch_read.lua: HMGET of the batch hash (O(1), whatever its size)
    batch_finished ── batch_read.lua: XREAD of sq:{q}:bdone:<bid> from a cursor ("0": from
                     the start)
    (both refuse a batch past its batch_ttl_s, in the same call: ``kept``)
    batch_each / forget_batch ── batch_each.lua / batch_forget.lua, BATCH_CHUNK members a call

What a reply means (``progress_from``, ``finished_from``, ``enqueue_error``) is shared with
the asyncio client (aio.py), which only carries the same calls out differently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from redis.crc import key_slot
from redis.exceptions import ResponseError

from sandboxq.backends import rules
from sandboxq.backends.base import BatchAction, NewJob
from sandboxq.backends.redis import finish_listener, follow, records
from sandboxq.backends.redis.connection import Connections
from sandboxq.backends.redis.enqueue import ENQUEUE_CHUNK, frame_jobs
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.redis.scripts import (
    Arg,
    Script,
    Scripts,
    raise_errors,
    run,
    send,
)
from sandboxq.errors import (
    BackendError,
    BatchIncomplete,
    BatchNotFound,
    ConfigError,
    DamagedRecord,
)
from sandboxq.models import BatchProgress, JobState, stored_int

log = logging.getLogger(__name__)

#: The batch hash's fields, in the order ``progress_from`` reads them.
PROGRESS_FIELDS = (
    "total",
    "enqueued",
    "sealed",
    "waiting",
    "active",
    "delayed",
    "completed",
    "failed",
    "cancelled",
    "then",
    "then_sent",
    "created_ms",
    "done_ms",
    "then_error",
    "label",
)

#: A stream entry's state code: a final state, or ``r``: the member left its final state
#: (retried), read as WAITING (``Backend.batch_finished``).
_FINAL = {
    b"c": JobState.COMPLETED,
    b"f": JobState.FAILED,
    b"x": JobState.CANCELLED,
    b"r": JobState.WAITING,
}

#: Stream entries one read of a batch's finished members returns at most.
FINISHED_READ = 1000
#: Chunks (of ENQUEUE_CHUNK members) sent per round trip. The server runs them as they
#: arrive, so one write of a million members (2,000 chunks, some 20 s of scripts) outlasted
#: the socket timeout; 20 chunks (10,000 members) take a fraction of a second.
CHUNKS_PER_TRIP = 20


def enqueue_batch_calls(
    script: Script,
    batch_id: str,
    jobs: Sequence[NewJob],
    then: str | None,
    ttl_ms: int,
    first: int,
    total: int,
    label: str | None = None,
) -> list[tuple[Script | None, bytes]]:
    """The batch_enqueue.lua calls that add ``jobs`` (ENQUEUE_CHUNK a call)."""
    _ids, frames = frame_jobs(jobs)
    calls: list[tuple[Script | None, bytes]] = []
    for start in range(0, len(frames), ENQUEUE_CHUNK):
        chunk = frames[start : start + ENQUEUE_CHUNK]
        args: list[Arg] = [
            batch_id,
            total,
            first + start,
            then or "",
            ttl_ms,
            len(chunk),
            b"".join(chunk),
            "" if label is None else "=" + label,  # '=': a label, even an empty one
        ]
        calls.append((script, script.pack(args)))
    return calls


def trips(calls: list[Any]) -> list[list[Any]]:
    """The calls, ``CHUNKS_PER_TRIP`` a round trip; the first alone (it makes the batch)."""
    if not calls:
        return []
    return [calls[:1]] + [
        calls[i : i + CHUNKS_PER_TRIP] for i in range(1, len(calls), CHUNKS_PER_TRIP)
    ]


def incomplete(batch_id: str, total: int, replies: Sequence[Any], exc: Exception) -> Exception:
    """What a connection lost part-way means: the members the answered calls added exist,
    those of the call in flight may."""
    try:
        enqueued = enqueue_outcome(batch_id, total, replies) if replies else 0
    except (ConfigError, BatchIncomplete) as refused:
        return refused
    return BatchIncomplete(
        f"batch {batch_id!r}: the enqueue failed after {enqueued} of {total} members ({exc}); "
        f"those of the call in flight may exist too: Queue.get_batch({batch_id!r}).progress() "
        "tells how many",
        batch_id=batch_id,
        enqueued=enqueued,
        total=total,
    )


def damaged_queue(reply: Any) -> bool:
    """Whether a script's error ``reply`` is a queue key of the wrong type (common.lua's
    guard_queue_keys refused the call before it wrote anything)."""
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


def enqueue_outcome(batch_id: str, total: int, replies: Sequence[Any]) -> int:
    """How many members the batch has, from the chunks' replies; raises when a chunk failed:
    ``ConfigError`` when nothing was added (``BackendError`` when the queue is damaged),
    else ``BatchIncomplete`` naming how many were."""
    enqueued = 0
    for reply in replies:
        if isinstance(reply, ResponseError):
            cause = str(reply).removeprefix("BATCH ")
            if enqueued == 0 and damaged_queue(reply):
                raise BackendError(f"batch {batch_id!r} was not enqueued: {cause}")
            if enqueued == 0:
                raise ConfigError(f"batch {batch_id!r} was not enqueued: {cause}")
            raise BatchIncomplete(
                f"batch {batch_id!r}: only {enqueued} of {total} members were enqueued "
                f"({cause}); they exist and will run, and the batch is never done: "
                f"Queue.get_batch({batch_id!r}).cancel() stops them",
                batch_id=batch_id,
                enqueued=enqueued,
                total=total,
            )
        enqueued = int(reply)
    return enqueued


def progress_args(batch_id: str) -> list[Arg]:
    """batch_read.lua's arguments for the batch's ``PROGRESS_FIELDS``."""
    return [batch_id, "progress", *PROGRESS_FIELDS]


def finished_args(batch_id: str, after: str) -> list[Arg]:
    """batch_read.lua's arguments for the batch's finished members after ``after``."""
    return [batch_id, "finished", after, FINISHED_READ]


def kept(queue: str, batch_id: str, reply: Sequence[Any]) -> Any:
    """What batch_read.lua read of a batch; ``BatchNotFound`` saying when it expired when
    it is past its ``batch_ttl_s``, whatever retention has deleted of it yet (a
    half-deleted batch was read as done with every count, its results short of members)."""
    expired_ms, read = reply
    if expired_ms is not None:
        raise rules.batch_expired(queue, batch_id, int(expired_ms), int(read))
    return read


def each_answer(queue: str, batch_id: str, reply: Sequence[Any]) -> tuple[int, int]:
    """batch_each.lua's members acted on and the batch's member count (negative: no such
    batch); ``BatchNotFound`` for an expired one, which no call may reopen."""
    if int(reply[1]) == -4:
        raise rules.batch_expired(queue, batch_id, int(reply[2]), int(reply[3]))
    return int(reply[0]), int(reply[1])


def progress_from(
    batch_id: str, queue: str, values: Sequence[bytes | str | None]
) -> BatchProgress | None:
    """A ``BatchProgress`` from the batch hash's ``PROGRESS_FIELDS`` (None: no batch);
    ``DamagedRecord`` naming the field when a count is none (changed by hand): a total
    of -5 read as 0 made the batch look empty and done, its members never followed; when
    more members ended than the batch has; and when members it counts do not exist
    (``members_missing``)."""
    if values[0] is None:
        return None
    f = dict(zip(PROGRESS_FIELDS, values, strict=True))

    def count(name: str, least: int = 0) -> int:
        raw = f[name]
        try:
            value = stored_int(raw) if raw is not None else 0
        except ValueError:
            value = least - 1
        if value < least:
            raise DamagedRecord(
                f"batch {batch_id!r} of queue {queue!r}: its record is damaged ({name} "
                f"is {records.text(raw or b'')[:40]!r}, not a count"
                f"{' of members' if least else ''})"
            )
        return value

    total = count("total", least=1)
    counts = {s: count(s) for s in ("waiting", "active", "delayed")}
    finals = {s: count(s) for s in ("completed", "failed", "cancelled")}
    if sum(finals.values()) > total:  # a member ends once: forged ("failed 99999" of 12)
        shown = ", ".join(f"{s} {n}" for s, n in finals.items())
        raise DamagedRecord(
            f"batch {batch_id!r} of queue {queue!r}: its record is damaged ({shown}: more "
            f"members ended than its {total})"
        )
    enqueued = count("enqueued")
    missing = members_missing(total, enqueued, f["sealed"] is not None, counts, finals)
    if missing:
        raise DamagedRecord(
            f"batch {batch_id!r} of queue {queue!r}: its record is damaged ({missing})"
        )
    then = records.text(f["then"]) if f["then"] else None
    return BatchProgress(
        batch_id=batch_id,
        queue=queue,
        total=total,
        enqueued=enqueued,
        **counts,
        **finals,
        done=f["done_ms"] is not None,
        then=then,
        then_sent=None if then is None else f["then_sent"] is not None and not f["then_error"],
        then_error=records.text(f["then_error"]) if f["then_error"] else None,
        label=records.text(f["label"]) if f["label"] is not None else None,
        created_ms=count("created_ms") or None,
        done_ms=count("done_ms") or None,
    )


def members_missing(
    total: int, enqueued: int, sealed: bool, counts: dict[str, int], finals: dict[str, int]
) -> str | None:
    """Why the batch's counters say members it counts in ``total`` do not exist (a forged
    total: "20" on a batch of 12, whose waits then waited for 8 members that never end),
    or None. The chunk that brings ``enqueued`` to the total seals the batch, and every
    member is counted in one state from its enqueue on, so a sealed batch has ``enqueued``
    and its counts summed equal to its total. An unsealed one (its enqueue under way, or
    stopped part-way: ``BatchIncomplete``) cannot be told from a forged one: not judged."""
    if enqueued > total:
        return f"{enqueued} members enqueued: more than its {total}"
    if not sealed:
        return None
    if enqueued != total:
        return f"sealed with {enqueued} of its {total} members enqueued: sealed means all were"
    counted = sum(counts.values()) + sum(finals.values())
    if counted != total:
        return (
            f"{counted} members counted in any state ("
            + ", ".join(f"{s} {n}" for s, n in {**counts, **finals}.items())
            + f") of its {total}"
        )
    return None


def finished_from(
    after: str, reply: Any, batch_done_key: str
) -> tuple[str, list[tuple[int, JobState]]]:
    """The new cursor and (index, state) pairs from an XREAD reply."""
    if not reply:
        return after, []
    entries = (
        reply[0][1] if isinstance(reply, list) else reply.get(batch_done_key.encode(), [[]])[0]
    )
    out: list[tuple[int, JobState]] = []
    cursor = after
    for entry_id, fields in entries:
        cursor = records.text(entry_id)
        state = _FINAL.get(fields.get(b"s", b""))
        try:
            index = int(fields.get(b"i", b""))
        except ValueError:
            continue  # not one of ours: skip it rather than stop the stream
        if state is not None:
            out.append((index, state))
    return cursor, out


def check_then(then: str, queue: str, cluster: bool) -> None:
    """On a Cluster a script reaches only its own slot: the follow-up's queue must share it."""
    if cluster and key_slot(f"{{{then}}}".encode()) != key_slot(f"{{{queue}}}".encode()):
        raise ConfigError(
            f"then queue {then!r} is on another Redis Cluster hash slot than queue {queue!r}: "
            "the follow-up is enqueued inside the finish script, which reaches one slot only"
        )


#: How often a forget asks again while a member cancelled as it ran is still fenced: the
#: fence ends when its worker confirms the child dead (milliseconds, as a rule) or when its
#: old lease runs out, whichever comes first.
FENCE_POLL_S = 0.05


def forget_answer(batch_id: str, reply: Sequence[Any]) -> tuple[bool | None, float]:
    """What batch_forget.lua answered: ``True`` gone, ``None`` call again, ``False`` no such
    batch; and how long to wait before calling again (a member's fence still stands).
    Raises when refused."""
    code, until_ms, now_ms = (int(x) for x in reply)
    if code == -2:
        raise ConfigError(
            f"batch {batch_id!r} still has members waiting, delayed or active: cancel it first"
        )
    if code == -1:
        return False, 0.0
    if code == -3:
        return None, min(FENCE_POLL_S, max(0.0, until_ms - now_ms + 1) / 1000)
    return (True if code == 1 else None), 0.0


class Batches:
    """``Backend``'s batch calls on Redis (mixed into ``RedisBackend``)."""

    queue: str
    url: str
    socket_timeout_s: float
    keys: QueueKeys
    _conns: Connections
    _scripts: Scripts
    _batch_ttl_ms: int

    def enqueue_batch(
        self,
        batch_id: str,
        jobs: Sequence[NewJob],
        *,
        then: str | None = None,
        first: int = 0,
        label: str | None = None,
    ) -> int:
        if then:
            check_then(then, self.queue, self._conns.cluster)
        total = first + len(jobs)
        calls = enqueue_batch_calls(
            self._scripts.batch_enqueue,
            batch_id,
            jobs,
            then,
            self._batch_ttl_ms,
            first,
            total,
            label,
        )
        lane = self._conns.main_lane
        replies: list[Any] = []
        try:
            with self._conns.errors(f"enqueue batch {batch_id!r}"):
                for trip in trips(calls):
                    got = send(lane, trip)
                    replies += got
                    if any(isinstance(reply, ResponseError) for reply in got):
                        break
        except BackendError as exc:
            raise incomplete(batch_id, total, replies, exc) from exc
        if replies and damaged_queue(replies[0]):  # refused before it wrote: name the key
            with self._conns.errors(f"enqueue batch {batch_id!r}"):
                raise replies[0]
        return enqueue_outcome(batch_id, total, replies)

    def batch_progress(self, batch_id: str) -> BatchProgress | None:
        script = self._scripts.batch_read
        with self._conns.errors(f"read batch {batch_id!r}"):
            (reply,) = run(self._conns.main_lane, [(script, script.pack(progress_args(batch_id)))])
        return progress_from(batch_id, self.queue, kept(self.queue, batch_id, reply))

    def batch_finished(
        self, batch_id: str, after: str, block_s: float | None = None
    ) -> tuple[str, list[tuple[int, JobState]]]:
        key = self.keys.batch_done(batch_id)
        script = self._scripts.batch_read
        command = script.pack(finished_args(batch_id, after))

        def read() -> tuple[str, list[tuple[int, JobState]]]:
            # on the lane, whose connections are bounded, whatever the number of threads
            (reply,) = run(self._conns.main_lane, [(script, command)])
            entries = kept(self.queue, batch_id, reply)
            return finished_from(after, follow.entries_of(entries), key)

        with self._conns.errors(f"read the finished members of batch {batch_id!r}"):
            if block_s is None:
                return read()
            # woken by the process's finish listener of the queue (finish_listener.py),
            # not a blocking read per waiter
            return finish_listener.wait_for_batch(
                self.url, self.keys, self.socket_timeout_s, batch_id, block_s, read
            )

    def batch_each(self, batch_id: str, action: BatchAction) -> int | None:
        acted, start, last = 0, 0, 1
        with self._conns.errors(f"{action} batch {batch_id!r}"):
            while start < last:
                args: list[Arg] = [
                    batch_id,
                    action,
                    start,
                    rules.BATCH_CHUNK,
                    self.keys.cancel_channel,
                ]
                reply = raise_errors([self._scripts.batch_each(args)])[0]
                done, count = each_answer(self.queue, batch_id, reply)
                if count < 0:
                    return None
                acted, last = acted + done, count
                start += rules.BATCH_CHUNK
        return acted

    def list_batches(self, limit: int = 50) -> list[BatchProgress]:
        with self._conns.errors("list batches"):
            raw_ids = self._conns.main.zrevrange(self.keys.batch_index, 0, max(0, limit) - 1)
            ids = [records.text(raw) for raw in raw_ids if isinstance(raw, bytes | str)]
            script = self._scripts.batch_read
            calls = [(script, script.pack(progress_args(batch_id))) for batch_id in ids]
            # a key of another type in a batch's place (forged) costs the list that one row
            rows = send(self._conns.main_lane, calls) if ids else []
        found = []
        for batch_id, reply in zip(ids, rows, strict=True):
            if isinstance(reply, ResponseError):
                continue
            try:
                found.append(progress_from(batch_id, self.queue, kept(self.queue, batch_id, reply)))
            except (DamagedRecord, BatchNotFound) as exc:  # that row alone; expired: gone
                log.debug("%s", exc)
        return [p for p in found if p is not None]

    def forget_batch(self, batch_id: str) -> bool:
        with self._conns.errors(f"forget batch {batch_id!r}"):
            while True:
                reply = self._scripts.batch_forget([batch_id, rules.BATCH_CHUNK])
                answer, wait_s = forget_answer(batch_id, reply)
                if answer is not None:
                    return answer
                time.sleep(wait_s)
