"""``RedisBackend``: the production backend. Every state change is one Lua script.

    producer ── enqueue.lua ──► waiting / delayed ── wake LIST ──► idle workers' claims
    worker   ── claim.lua, finish.lua (complete-and-claim-next) ──► active: lease = TIME + lease_s
    heartbeat ── renew.lua, on its own connection ──► active
    reaper   ── recover_stalled.lua ──► waiting, or failed after max_stalls
    user     ── cancel.lua ──► cancelled + PUBLISH ──► the owner's watch_cancellations
    every script ── XADD ──► events STREAM ──► events(), wait_for_finish()
    reader   ── read_job.lua, read_result.lua, read_state.lua, read_outcome.lua ──► get(),
                get_result(), wait_for_finish(), outcomes(): bounded, one round trip each
                (reads.py)

The scripts (``lua/*.lua``) hold the rules, with the constants and texts of
``backends.rules``; this class turns arguments into script arguments (enqueue.py frames new
jobs) and replies into sandboxq types (``records.py``), and every Redis failure into
``BackendError`` (``connection.py``). Blocking waits live in ``listen.py``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from sandboxq.backends import rules
from sandboxq.backends.base import Ack, Backend, Claimed, Event, NewJob
from sandboxq.backends.index import DEPTH_MINUTES, QUEUES_READ_CAP, QueueIndex, WorkerRegistry
from sandboxq.backends.redis import finish_listener, listen, records
from sandboxq.backends.redis.batches import Batches
from sandboxq.backends.redis.connection import Connections, RedisOptions
from sandboxq.backends.redis.enqueue import enqueue_calls, enqueued
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.redis.lane import Lane
from sandboxq.backends.redis.pages import recent_durations
from sandboxq.backends.redis.reads import Reads
from sandboxq.backends.redis.registry import read_workers
from sandboxq.backends.redis.scripts import Arg, Script, Scripts, run, script_settings
from sandboxq.backends.redis.stats import read_index
from sandboxq.errors import BackendError
from sandboxq.models import DEFAULT_MAX_INFRA_DEATHS, AttemptRecord, JobState, check_queue_name

log = logging.getLogger(__name__)

#: finish.lua's answer for an ack it accepted whose member made its batch done without
#: the batch's follow-up being sent (the batch's then_error says why).
FOLLOW_UP_NOT_SENT = 3

PURGE_CHUNK = 1000  # jobs deleted per purge script call


def lease_args(head: Sequence[Arg], leases: Sequence[tuple[str, str]]) -> list[Arg]:
    """``head``, then each lease's job id and token (renew, release, confirm_dead)."""
    args = list(head)
    for job_id, token in leases:
        args += (job_id, token)
    return args


class RedisBackend(Reads, Batches, Backend):
    """One queue on one Redis server (or Cluster slot: every key shares the ``{queue}`` tag).
    Options: those of ``connection.RedisOptions``."""

    def __init__(
        self, url: str, queue: str, *, share: Connections | None = None, **options: Any
    ) -> None:
        """``share``: another queue's connections to use (``sibling``)."""
        self.queue = check_queue_name(queue)
        settings = RedisOptions(**options)
        self.url = url
        self.keys = QueueKeys(queue)
        self._options = options
        timeout_s, key_types = float(settings.socket_timeout_s), records.queue_key_types(self.keys)
        self._conns = Connections(url, timeout_s, self.keys.waiting, key_types, share=share)
        if self._conns.cluster:  # the queue index is the slot's own (keys.py)
            self.keys = QueueKeys(queue, cluster=True)
        self.socket_timeout_s = timeout_s
        lane = self._conns.main_lane
        self._scripts = Scripts(
            self.keys.script_keys, script_settings(settings, self.keys.index), lane
        )
        self._batch_ttl_ms = rules.ms(settings.batch_ttl_s)
        self._watches: list[listen.CancellationWatch] = []
        self._lock = threading.Lock()
        self._waiting: set[str] = set()  # workers whose claim is in (or about to send) BLPOP
        self._not_waiting: set[str] = set()  # workers whose next claim waits not

    def __repr__(self) -> str:
        return f"RedisBackend({self._conns.where!r}, {self.queue!r})"

    def sibling(self, queue: str) -> RedisBackend:
        return RedisBackend(self.url, queue, share=self._conns, **self._options)

    # -- producing ------------------------------------------------------------------------

    def enqueue(self, jobs: Sequence[NewJob]) -> list[tuple[str, bool]]:
        ids, calls = enqueue_calls(self._scripts.enqueue, jobs)
        if not calls:
            return []
        with self._conns.errors("enqueue"):
            replies = run(self._conns.main_lane, calls)
        return enqueued(ids, replies)

    # -- leases ---------------------------------------------------------------------------

    def claim(
        self, worker_id: str, count: int, lease_s: float, wait_s: float = 0.0
    ) -> list[Claimed]:
        if count <= 0:
            return []
        args: list[Arg] = [worker_id, count, rules.lease_ms(lease_s), rules.token_base()]
        lane = self._conns.main_lane
        with self._conns.errors("claim jobs"):
            wait_ms, *flat = self._scripts.claim(args)
            sent = lane.sent_at()  # the lease counts from the write, the connection made
            if not flat and wait_s > 0 and wait_ms != 0 and self._may_wait(worker_id):
                if wait_ms > 0:  # a delayed job falls due before wait_s: claim it then
                    wait_s = min(wait_s, wait_ms / 1000)
                unblock = self.keys.unblock_prefix + worker_id
                try:
                    if listen.wait_for_wake(self._conns, self.keys, wait_s, unblock):
                        return []  # stop_waiting
                finally:
                    with self._lock:
                        self._waiting.discard(worker_id)
                wait_ms, *flat = self._scripts.claim(args)
                sent = lane.sent_at()
        return self._usable(worker_id, flat, sent)

    def _may_wait(self, worker_id: str) -> bool:
        """False once, after ``stop_waiting`` (its claim returns without waiting); else
        the claim is marked as waiting, so ``stop_waiting`` knows to unblock it."""
        with self._lock:
            if worker_id in self._not_waiting:
                self._not_waiting.discard(worker_id)
                return False
            self._waiting.add(worker_id)
            return True

    def stop_waiting(self, worker_id: str) -> None:
        with self._lock:
            waiting = worker_id in self._waiting
            if not waiting:
                self._not_waiting.add(worker_id)
        if waiting:  # in its BLPOP, or about to send it: the entry ends it either way
            with self._conns.errors("unblock a waiting claim"):
                listen.unblock(self._conns, self.keys.unblock_prefix + worker_id)

    def _usable(self, worker_id: str, flat: Sequence[Any], sent: float) -> list[Claimed]:
        """The claimed jobs whose options validate; each other one is failed with the cause
        (design invariant 7: one bad record fails one job, never the claim)."""
        usable: list[Claimed] = []
        for job, problem in records.claimed_rows(flat, sent):
            if problem is None:
                usable.append(job)
                continue
            cause = rules.MALFORMED_TEXT % problem
            record = AttemptRecord.refused(job.attempt, worker_id, cause)
            args: list[Arg] = [
                worker_id,
                job.id,
                job.token,
                problem,
                record.model_dump_json(exclude_none=True),
            ]
            with self._conns.errors(f"fail malformed job {job.id!r}"):
                self._scripts.fail_malformed(args)
            log.warning("job %r of queue %r failed: %s", job.id, self.queue, cause)
        return usable

    def renew(self, worker_id: str, leases: Sequence[tuple[str, str]], lease_s: float) -> list[str]:
        # on a connection of its own: a busy claim loop cannot delay it (design invariant 5)
        head: list[Arg] = [worker_id, rules.lease_ms(lease_s)]
        lane = self._conns.renew_lane
        return self._per_lease(self._scripts.renew, head, leases, "renew leases", lane)

    def confirm_dead(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        return self._per_lease(self._scripts.confirm_dead, [worker_id], leases, "confirm ends")

    def release(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        return self._per_lease(self._scripts.release, [worker_id], leases, "release jobs")

    def _per_lease(
        self,
        script: Script,
        head: Sequence[Arg],
        leases: Sequence[tuple[str, str]],
        doing: str,
        lane: Lane | None = None,
    ) -> list[str]:
        """A script over (job id, token) pairs that answers with job ids."""
        if not leases:
            return []
        with self._conns.errors(doing):
            ids = script(lease_args(head, leases), lane)
        return [records.text(job_id) for job_id in ids]

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
        rules.check_actions(ack.action for ack in acks)
        args: list[Arg] = [
            worker_id,
            max(0, claim),
            rules.lease_ms(lease_s),
            token_base or rules.token_base(),
            len(acks),
        ]
        for ack in acks:
            args += (
                ack.job_id,
                ack.token,
                ack.action,
                ack.attempt.model_dump_json(exclude_none=True),
                ack.attempt.outcome.value,
                ack.error or "",
                "0" if ack.result is None else "1",
                ack.result or b"",
                rules.ms(ack.retry_delay_s),
                ack.infra_death or "",
            )
        args.append(replay_of or "")
        what = f"finish job {acks[0].job_id!r}" if len(acks) == 1 else f"finish {len(acks)} jobs"
        with self._conns.errors(what):
            reply = self._scripts.finish(args)
            sent = self._conns.main_lane.sent_at()  # the claimed jobs' lease: as in claim
        n = int(reply[0])
        flags = [int(x) for x in reply[1 : n + 1]]
        for ack, flag in zip(acks, flags, strict=True):
            if flag == FOLLOW_UP_NOT_SENT:
                self._log_then_error(ack.job_id)
        accepted = [flag in (1, FOLLOW_UP_NOT_SENT) for flag in flags]
        return accepted, self._usable(worker_id, reply[n + 1 :], sent)

    def _log_then_error(self, member_id: str) -> None:
        """A finish made a batch done whose follow-up could not be sent (the ``then`` queue
        is out of this user's ACL, or a key of it has the wrong type): say so where the
        worker's operator looks, once per batch (it is done once)."""
        batch_id = member_id.rpartition(".")[0]
        progress = self.batch_progress(batch_id)
        log.warning(
            "batch %r of queue %r is done: %s",
            batch_id,
            self.queue,
            progress.then_error
            if progress is not None
            else "its follow-up was not sent (the batch is gone now)",
        )

    def record_progress(
        self, worker_id: str, job_id: str, token: str, fraction: float, message: str | None
    ) -> bool:
        args: list[Arg] = [worker_id, job_id, token, repr(float(fraction)), message or ""]
        with self._conns.errors(f"record progress of job {job_id!r}"):
            return bool(self._scripts.progress(args) == 1)

    def recover_stalled(
        self, max_infra_deaths: int = DEFAULT_MAX_INFRA_DEATHS
    ) -> list[tuple[str, str]]:
        with self._conns.errors("recover stalled jobs"):
            flat = self._scripts.recover_stalled([rules.RECOVER_LIMIT, max_infra_deaths])
        return [(records.text(flat[i]), records.text(flat[i + 1])) for i in range(0, len(flat), 2)]

    # -- managing -------------------------------------------------------------------------

    def cancel(self, job_id: str) -> bool:
        with self._conns.errors(f"cancel job {job_id!r}"):
            return bool(self._scripts.cancel([job_id, self.keys.cancel_channel]) == 1)

    def retry_failed(self, job_id: str) -> bool:
        with self._conns.errors(f"retry job {job_id!r}"):
            return bool(self._scripts.retry_failed([job_id]) == 1)

    def purge(self, state: JobState) -> int:
        state = rules.purgeable(state)
        total = kept = 0
        with self._conns.errors(f"purge {state.value} jobs"):
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

    # -- waiting (listen.py) ----------------------------------------------------------------

    def wait_for_finish(self, job_id: str, timeout_s: float) -> JobState | None:
        """On the process's finish listener of this queue (finish_listener.py): one
        connection however many threads wait."""

        def read_state() -> Any:
            return self._scripts.read_state([job_id, records.MAX_STATE_BYTES])

        with self._conns.errors(f"wait for job {job_id!r}"):
            return finish_listener.wait_for_finish(
                self.url, self.keys, self.socket_timeout_s, job_id, timeout_s, read_state
            )

    def events(self, since: str | None = None, block_s: float | None = None) -> Iterator[Event]:
        return listen.events(self._conns, self.keys, since, block_s)

    def new_events(
        self, after: Mapping[str, str | None], count: int
    ) -> dict[str, list[Event] | BackendError]:
        return listen.new_events(self._conns, after, count)

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
        ttl_ms = rules.lease_ms(ttl_s)
        data = json.dumps({**info, "worker_id": worker_id, "ttl_ms": ttl_ms}, default=str)
        with self._conns.errors(f"register worker {worker_id!r}"):
            # The pids on the jobs first: whoever reads one in the record finds it there too.
            if held := rules.child_pids(info):
                args: list[Arg] = [worker_id]
                for job_id, number, pid, started_ms in held:
                    args += (job_id, number, pid, "" if started_ms is None else started_ms)
                self._scripts.child_pids(args)
            pipe = self._conns.main.pipeline(transaction=False)
            pipe.set(self.keys.worker(worker_id), data, px=ttl_ms)
            pipe.sadd(self.keys.workers, worker_id)
            pipe.sadd(self.keys.index, self.queue)  # a queue with a worker is a queue
            *own, _ = pipe.execute(raise_on_error=False)
            # The index is shared by every queue on the server, so any queue's user may
            # damage it: that costs the dashboard its discovery of this queue, never the
            # registration (its readers say the index is damaged).
            for reply in own:
                if isinstance(reply, Exception):
                    raise reply
        # The depth chart's sample for this minute: a nicety, which must not make the
        # registration fail (a damaged queue key is reported by the claims, by name).
        try:
            with self._conns.errors("sample the waiting depth"):
                self._scripts.depth([DEPTH_MINUTES])
        except BackendError as exc:
            log.debug("no depth sample for queue %r: %s", self.queue, exc)

    def unregister_worker(self, worker_id: str) -> None:
        with self._conns.errors(f"unregister worker {worker_id!r}"):
            pipe = self._conns.main.pipeline(transaction=False)
            pipe.delete(self.keys.worker(worker_id))
            pipe.srem(self.keys.workers, worker_id)
            pipe.execute()

    def workers(self) -> list[dict[str, Any]]:
        return self.worker_registry().live

    def worker_registry(self) -> WorkerRegistry:
        return read_workers(self._conns, self.keys)

    def queue_index(self, limit: int = QUEUES_READ_CAP) -> QueueIndex:
        return read_index(self._conns, limit)

    def recent_durations(self, limit: int) -> list[tuple[str, float]]:
        return recent_durations(self._conns, self.keys, limit)

    def close(self) -> None:
        with self._lock:
            watches, self._watches = self._watches, []
        for watch in watches:
            watch.stop()
        self._conns.close()
