"""``RedisBackend``: the production backend. Every state change is one Lua script.

    producer ── enqueue.lua ──► waiting / delayed ── wake LIST ──► idle workers' claims
    worker   ── claim.lua, finish.lua (complete-and-claim-next) ──► active: lease = TIME + lease_s
    heartbeat ── renew.lua, on its own connection ──► active
    reaper   ── recover_stalled.lua ──► waiting, or failed after max_stalls
    user     ── cancel.lua ──► cancelled + PUBLISH ──► the owner's watch_cancellations
    every script ── XADD ──► events STREAM ──► events(), wait_for_finish()
    reader   ── read_job.lua, read_result.lua, read_state.lua ──► get(), get_result(),
                wait_for_finish(): bounded, one round trip each

The scripts (``lua/*.lua``) hold the rules; this class turns arguments into script
arguments and replies into sandboxq types (``records.py``), and every Redis failure into
``BackendError`` (``connection.py``). Blocking waits live in ``listen.py``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis

from sandboxq.backends import rules
from sandboxq.backends.base import (
    Ack,
    Claimed,
    Event,
    FinishAction,
    FinishResult,
    JobDetail,
    JobPage,
    NewJob,
    check_limits,
)
from sandboxq.backends.redis import listen, pages, records
from sandboxq.backends.redis.connection import Connections
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.redis.scripts import Arg, Script, Scripts, run, script_settings
from sandboxq.codec import DEFAULT_MAX_BYTES as MAX_RESULT_BYTES
from sandboxq.errors import BackendError, ConfigError, SerializationError
from sandboxq.models import Action, AttemptRecord, JobInfo, JobState, Outcome, check_queue_name

log = logging.getLogger(__name__)

ENQUEUE_CHUNK = 500  # jobs per enqueue script call; all chunks go in one pipeline
RECOVER_LIMIT = 500  # expired leases handled per recover_stalled call
PURGE_CHUNK = 1000  # jobs deleted per purge script call
ACTIONS = ("complete", "retry", "fail", "requeue")


_ms = rules.ms
_lease_ms = rules.lease_ms


def enqueue_calls(
    script: Script, jobs: Sequence[NewJob]
) -> tuple[list[str], list[tuple[Script | None, bytes]]]:
    """The ids of ``jobs`` and the packed enqueue calls that add them (one per chunk)."""
    ids, frames = frame_jobs(jobs)
    return ids, pack_enqueue(script, frames)


def frame_jobs(jobs: Sequence[NewJob]) -> tuple[list[str], list[bytes]]:
    """The ids of ``jobs`` (a new one where none was chosen) and each job framed for
    enqueue.lua; raises for a job whose options cannot be stored."""
    # 128 random bits each, like uuid4().hex, from one urandom call for the whole batch
    # (a call per job was most of the cost of framing a big batch on a loaded machine)
    rand = os.urandom(16 * len(jobs)).hex()
    ids = [job.job_id or rand[32 * i : 32 * i + 32] for i, job in enumerate(jobs)]
    return ids, [records.frame_job(job_id, job) for job_id, job in zip(ids, jobs, strict=True)]


def pack_enqueue(script: Script, frames: Sequence[bytes]) -> list[tuple[Script | None, bytes]]:
    """Enqueue calls for framed jobs, ``ENQUEUE_CHUNK`` jobs per call."""
    chunks = [frames[i : i + ENQUEUE_CHUNK] for i in range(0, len(frames), ENQUEUE_CHUNK)]
    return [(script, script.pack([len(chunk), b"".join(chunk)])) for chunk in chunks]


def enqueued(ids: list[str], replies: Sequence[Any]) -> list[tuple[str, bool]]:
    """(id, created) per job from the enqueue calls' replies."""
    created = [flag == 1 for reply in replies for flag in reply]
    return list(zip(ids, created, strict=True))


def _token() -> str:
    """A random base for lease tokens; the scripts add a per-job suffix."""
    return os.urandom(8).hex()


def check_options(
    queue: str,
    retain_completed: int,
    retain_failed: int,
    retain_s: float,
    max_events: int,
    socket_timeout_s: float,
) -> str:
    """A Redis backend's options, checked once for the sync and the async client: returns
    the queue name, or raises ``ConfigError`` naming what is wrong."""
    name = check_queue_name(queue)
    check_limits(
        retain_completed=retain_completed,
        retain_failed=retain_failed,
        max_events=max_events,
        retain_s=retain_s,
    )
    if not (isinstance(socket_timeout_s, int | float) and socket_timeout_s > 0):
        raise ConfigError(f"socket_timeout_s must be positive, got {socket_timeout_s!r}")
    return name


class RedisBackend:
    """One queue on one Redis server (or Cluster slot: every key shares the ``{queue}`` tag)."""

    def __init__(
        self,
        url: str,
        queue: str,
        *,
        retain_completed: int = 1000,
        retain_failed: int = 10_000,
        retain_s: float = 7 * 24 * 3600,
        max_events: int = 10_000,
        socket_timeout_s: float = 5.0,
    ) -> None:
        self.queue = check_options(
            queue, retain_completed, retain_failed, retain_s, max_events, socket_timeout_s
        )
        self.url = url
        self.keys = QueueKeys(queue)
        self._conns = Connections(
            url, float(socket_timeout_s), self.keys.waiting, records.queue_key_types(self.keys)
        )
        self._errors = self._conns.errors
        settings = script_settings(max_events, retain_completed, retain_failed, retain_s)
        self._scripts = Scripts(self.keys.script_keys, settings, self._conns.main_lane)
        self._watches: list[listen.CancellationWatch] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RedisBackend({self._conns.where!r}, {self.queue!r})"

    # -- producing ------------------------------------------------------------------------

    def enqueue(self, jobs: Sequence[NewJob]) -> list[tuple[str, bool]]:
        ids, calls = enqueue_calls(self._scripts.enqueue, jobs)
        if not calls:
            return []
        with self._errors("enqueue"):
            replies = run(self._conns.main_lane, calls)
        return enqueued(ids, replies)

    # -- leases ---------------------------------------------------------------------------

    def claim(
        self, worker_id: str, count: int, lease_s: float, wait_s: float = 0.0
    ) -> list[Claimed]:
        if count <= 0:
            return []
        args: list[Arg] = [worker_id, count, _lease_ms(lease_s), _token()]
        with self._errors("claim jobs"):
            sent = time.monotonic()
            wait_ms, *flat = self._scripts.claim(args)
            if not flat and wait_s > 0 and wait_ms != 0:
                if wait_ms > 0:  # a delayed job falls due before wait_s: claim it then
                    wait_s = min(wait_s, wait_ms / 1000)
                listen.wait_for_wake(self._conns, self.keys, wait_s)
                sent = time.monotonic()
                wait_ms, *flat = self._scripts.claim(args)
        return self._usable(worker_id, flat, sent)

    def _usable(self, worker_id: str, flat: Sequence[Any], sent: float) -> list[Claimed]:
        """The claimed jobs whose options validate; each other one is failed with the cause
        (design invariant 7: one bad record fails one job, never the claim)."""
        usable: list[Claimed] = []
        for job, problem in records.claimed_rows(flat, sent):
            if problem is None:
                usable.append(job)
                continue
            record = AttemptRecord(
                attempt=job.attempt,
                outcome=Outcome.ERROR,
                action=Action.FAIL,
                worker_id=worker_id,
                error=f"malformed job record: {problem}",
            )
            args: list[Arg] = [
                worker_id,
                job.id,
                job.token,
                problem,
                record.model_dump_json(exclude_none=True),
            ]
            with self._errors(f"fail malformed job {job.id!r}"):
                self._scripts.fail_malformed(args)
            log.warning(
                "job %r of queue %r failed: malformed job record: %s", job.id, self.queue, problem
            )
        return usable

    def renew(self, worker_id: str, leases: Sequence[tuple[str, str]], lease_s: float) -> list[str]:
        if not leases:
            return []
        args: list[Arg] = [worker_id, _lease_ms(lease_s)]
        for job_id, token in leases:
            args += (job_id, token)
        with self._errors("renew leases"):
            lost = self._scripts.renew(args, self._conns.renew_lane)
        return [records.text(job_id) for job_id in lost]

    def confirm_dead(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        if not leases:
            return []
        args: list[Arg] = [worker_id]
        for job_id, token in leases:
            args += (job_id, token)
        with self._errors("confirm attempts ended"):
            lifted = self._scripts.confirm_dead(args)
        return [records.text(job_id) for job_id in lifted]

    def release(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        if not leases:
            return []
        args: list[Arg] = [worker_id]
        for job_id, token in leases:
            args += (job_id, token)
        with self._errors("release jobs"):
            kept = self._scripts.release(args)
        return [records.text(job_id) for job_id in kept]

    def finish(
        self,
        worker_id: str,
        job_id: str,
        token: str,
        action: FinishAction,
        attempt: AttemptRecord,
        *,
        result: bytes | None = None,
        error: str | None = None,
        retry_delay_s: float = 0.0,
        claim: int = 0,
        lease_s: float = 30.0,
    ) -> FinishResult:
        ack = Ack(job_id, token, action, attempt, result, error, retry_delay_s)
        accepted, claimed = self.finish_many(worker_id, [ack], claim=claim, lease_s=lease_s)
        return FinishResult(accepted=accepted[0], claimed=claimed)

    def finish_many(
        self,
        worker_id: str,
        acks: Sequence[Ack],
        *,
        claim: int = 0,
        lease_s: float = 30.0,
        token_base: str | None = None,
        replay_of: str | None = None,
    ) -> tuple[list[bool], list[Claimed]]:
        args: list[Arg] = [
            worker_id,
            max(0, claim),
            _lease_ms(lease_s),
            token_base or _token(),
            len(acks),
        ]
        for ack in acks:
            if ack.action not in ACTIONS:
                raise ConfigError(
                    f"unknown finish action {ack.action!r}; expected one of {ACTIONS}"
                )
            args += (
                ack.job_id,
                ack.token,
                ack.action,
                ack.attempt.model_dump_json(exclude_none=True),
                ack.attempt.outcome.value,
                ack.error or "",
                "0" if ack.result is None else "1",
                ack.result or b"",
                _ms(ack.retry_delay_s),
            )
        args.append(replay_of or "")
        what = f"finish job {acks[0].job_id!r}" if len(acks) == 1 else f"finish {len(acks)} jobs"
        with self._errors(what):
            sent = time.monotonic()
            reply = self._scripts.finish(args)
        n = int(reply[0])
        accepted = [int(x) == 1 for x in reply[1 : n + 1]]
        return accepted, self._usable(worker_id, reply[n + 1 :], sent)

    def record_progress(
        self, worker_id: str, job_id: str, token: str, fraction: float, message: str | None
    ) -> bool:
        args: list[Arg] = [worker_id, job_id, token, repr(float(fraction)), message or ""]
        with self._errors(f"record progress of job {job_id!r}"):
            return bool(self._scripts.progress(args) == 1)

    def recover_stalled(self) -> list[tuple[str, str]]:
        with self._errors("recover stalled jobs"):
            flat = self._scripts.recover_stalled([RECOVER_LIMIT])
        return [(records.text(flat[i]), records.text(flat[i + 1])) for i in range(0, len(flat), 2)]

    # -- managing -------------------------------------------------------------------------

    def cancel(self, job_id: str) -> bool:
        with self._errors(f"cancel job {job_id!r}"):
            return bool(self._scripts.cancel([job_id, self.keys.cancel_channel]) == 1)

    def retry_failed(self, job_id: str) -> bool:
        with self._errors(f"retry job {job_id!r}"):
            return bool(self._scripts.retry_failed([job_id]) == 1)

    def purge(self, state: JobState) -> int:
        state = JobState(state)
        if state is JobState.ACTIVE:
            raise ConfigError("active jobs cannot be purged: their workers still hold leases")
        total = kept = 0
        with self._errors(f"purge {state.value} jobs"):
            # bounded by the count at the start, so a steady stream of new jobs cannot
            # keep it going forever
            initial = int(self._conns.main.zcard(self.keys.state_set(state)))
            while total + kept < initial:
                reply: Any = self._scripts.purge([state.value, PURGE_CHUNK, kept])
                deleted, left = int(reply[0]), int(reply[1])
                total, kept = total + deleted, kept + left
                if deleted + left < PURGE_CHUNK:
                    break
        return total

    # -- reading --------------------------------------------------------------------------

    def get(self, job_id: str) -> JobInfo | None:
        """One script (lua/read_job.lua): a field or attempt record over the read cap is
        never sent here, only its size (see ``records``)."""
        fields = records.INFO_FIELDS
        args: list[Arg] = [job_id, records.MAX_FIELD_BYTES, records.MAX_HISTORY, *fields]
        with self._errors(f"read job {job_id!r}"):
            reply = self._scripts.read_job(args)
        kind, history_kind = records.text(reply[0]), records.text(reply[1])
        if kind == "none":
            return None
        if kind != "hash":
            raise BackendError(
                f"job {job_id!r} in queue {self.queue!r}: its record "
                f"{self.keys.job(job_id)} holds a {kind}, not a hash (changed by hand?)"
            )
        total, sizes, values, history = reply[2:]
        oversized = {
            name: int(size)
            for name, size in zip(fields, sizes, strict=True)
            if size > records.MAX_FIELD_BYTES
        }
        found = {
            name.encode(): value
            for name, value in zip(fields, values, strict=True)
            if value is not None and name not in oversized
        }
        damaged = []
        if history_kind not in ("list", "none"):
            history_key = self.keys.history(job_id)
            damaged.append(f"history: {history_key} holds a {history_kind}, not a list")
        return records.job_info(
            self.queue,
            job_id,
            found,
            history,
            oversized=oversized,
            damaged=damaged,
            history_total=int(total),
        )

    def get_result(self, job_id: str) -> bytes | None:
        with self._errors(f"read the result of job {job_id!r}"):
            state, size, result = self._scripts.read_result([job_id, MAX_RESULT_BYTES])
        if state != b"completed" or not size:
            return None
        if size > MAX_RESULT_BYTES:
            raise SerializationError(
                f"job {job_id!r}: the result is {records.over_cap(size, MAX_RESULT_BYTES)}"
                "; it was not read"
            )
        return None if result is None else bytes(result)

    def counts(self) -> dict[JobState, int]:
        with self._errors("count jobs"):
            pipe = self._conns.main.pipeline(transaction=False)
            for state in JobState:
                pipe.zcard(self.keys.state_set(state))
            sizes = pipe.execute()
        return {state: int(n) for state, n in zip(JobState, sizes, strict=True)}

    def list_jobs(self, state: JobState, limit: int = 100) -> list[str]:
        state = JobState(state)
        if limit <= 0:
            return []
        key = self.keys.state_set(state)
        ids: Any
        with self._errors(f"list {state.value} jobs"):
            if state.finished:
                ids = self._conns.main.zrevrange(key, 0, limit - 1)
            else:
                ids = self._conns.main.zrange(key, 0, limit - 1)
        return [records.text(job_id) for job_id in ids]

    # -- waiting (listen.py) ----------------------------------------------------------------

    def wait_for_finish(self, job_id: str, timeout_s: float) -> JobState | None:
        def read_state() -> Any:
            return self._scripts.read_state([job_id, records.MAX_STATE_BYTES])

        return listen.wait_for_finish(self._conns, self.keys, job_id, timeout_s, read_state)

    def events(self, since: str | None = None, block_s: float | None = None) -> Iterator[Event]:
        return listen.events(self._conns, self.keys, since, block_s)

    def watch_cancellations(
        self, callback: Callable[[str, str | None], None]
    ) -> Callable[[], None]:
        watch = listen.CancellationWatch(self._conns, self.keys, callback)
        with self._lock:
            self._watches.append(watch)

        def stop() -> None:
            with self._lock:
                if watch in self._watches:
                    self._watches.remove(watch)
            watch.stop()

        return stop

    # -- workers --------------------------------------------------------------------------

    def register_worker(self, worker_id: str, info: dict[str, Any], ttl_s: float) -> None:
        data = json.dumps({**info, "worker_id": worker_id}, default=str)
        with self._errors(f"register worker {worker_id!r}"):
            pipe = self._conns.main.pipeline(transaction=False)
            pipe.set(self.keys.worker(worker_id), data, px=_lease_ms(ttl_s))
            pipe.sadd(self.keys.workers, worker_id)
            pipe.execute()

    def unregister_worker(self, worker_id: str) -> None:
        with self._errors(f"unregister worker {worker_id!r}"):
            pipe = self._conns.main.pipeline(transaction=False)
            pipe.delete(self.keys.worker(worker_id))
            pipe.srem(self.keys.workers, worker_id)
            pipe.execute()

    def workers(self) -> list[dict[str, Any]]:
        main = self._conns.main
        with self._errors("list workers"):
            ids = sorted(records.text(w) for w in main.smembers(self.keys.workers))
            values = main.mget([self.keys.worker(w) for w in ids]) if ids else []
            gone = [w for w, value in zip(ids, values, strict=True) if value is None]
        if gone:  # their TTL ran out: forget them (a read-only ACL user may not: fine)
            try:
                main.srem(self.keys.workers, *gone)
            except redis.RedisError as exc:
                log.debug("could not forget expired workers of %r: %s", self.queue, exc)
        return [
            records.worker_record(worker_id, value)
            for worker_id, value in zip(ids, values, strict=True)
            if value is not None
        ]

    def close(self) -> None:
        with self._lock:
            watches, self._watches = self._watches, []
        for watch in watches:
            watch.stop()
        self._conns.close()

    # -- reads for the dashboard (pages.py) ---------------------------------------------------

    @functools.cached_property
    def _pages(self) -> pages.Pages:
        return pages.Pages(self.keys, self._conns.main_lane)

    def job_page(
        self,
        state: JobState,
        cursor: str | None = None,
        limit: int = 50,
        outcome: str | None = None,
    ) -> JobPage:
        with self._errors(f"read a page of {JobState(state).value} jobs"):
            return self._pages.job_page(state, cursor, limit, outcome)

    def job_detail(self, job_id: str) -> JobDetail | None:
        with self._errors(f"read job {job_id!r}"):
            pipe = self._conns.main.pipeline(transaction=False)
            pipe.hgetall(self.keys.job(job_id))
            pipe.lrange(self.keys.history(job_id), 0, -1)
            fields, history = pipe.execute()
        return pages.job_detail(self.queue, job_id, fields, history)

    def oldest_waiting_ms(self) -> int | None:
        with self._errors("read the oldest waiting job"):
            return self._pages.oldest_waiting_ms()

    def queue_names(self, budget_s: float = 2.0) -> list[str]:
        """Every queue on this Redis (not only this one), for the dashboard: see pages.py."""
        with self._errors("list the queues"):
            return pages.queue_names(self._conns, budget_s)
