"""The machinery the chaos tests and the soak share: a fleet of worker processes, fault
makers, producers, and the Scene that holds one test's world.

    Producer ── enqueue (explicit ids: a retry after an error is idempotent) ──► Redis
    Fleet: `sandboxq worker` processes ── ledger_job ──► ledger file (tests.support.ledger)
    ChildKiller ── SIGKILL a random ready child every lo..hi s ──► Fleet
    ForkServerKiller ── SIGKILL a worker's fork server now and then ──► Fleet
    Scene.finish() ── every accepted job ended ──► audit.audit() (the verdict)
    Fleet.close(): every process any worker ever started is dead

Nothing here is a stand-in: real `sandboxq worker` processes, real signals, real Redis.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import redis
from audit import Audit, Tally, audit

from sandboxq import Queue, codec
from sandboxq.backends.base import NewJob
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.errors import BackendError
from sandboxq.models import JobOptions, Outcome
from sandboxq.testing.processes import frozen_order
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from tests.support.ledger import Execution, read_ledger

PROCESSOR = "tests.support.ledger:ledger_job"


def alive(pid: int) -> bool:
    """Running or stopped; a zombie has finished dying and only waits to be reaped."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# -- workers ----------------------------------------------------------------------------------


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []

    def children(self, min_age_s: float = 0.0) -> list[psutil.Process]:
        """The pool's children (the fork server's children), started at least ``min_age_s`` ago."""
        found = []
        now = time.time()
        for proc in self.descendants():
            try:
                if proc.ppid() == self.pid:
                    continue  # the fork server or the resource tracker
                if now - proc.create_time() >= min_age_s:
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    def fork_server(self) -> psutil.Process | None:
        """The worker's fork server (its direct child that runs multiprocess's main)."""
        for proc in self.descendants():
            try:
                if proc.ppid() == self.pid and "forkserver" in " ".join(proc.cmdline()):
                    return proc
            except psutil.Error:
                continue
        return None

    def zombies(self) -> list[int]:
        """Zombies below the worker: a dead process nobody reaped (each kill must leave
        none once its processes are reaped)."""
        found = []
        for proc in self.descendants():
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    found.append(proc.pid)
            except psutil.Error:
                continue
        return found

    def family(self) -> list[int]:
        return [self.pid, *(p.pid for p in self.descendants())]

    def signal_family(self, signum: int) -> list[int]:
        """Send ``signum`` to the parent first, then to every descendant (to freeze, with
        SIGSTOP: the pool's guards first, ``frozen_order``)."""
        pids = frozen_order(self.pid) if signum == signal.SIGSTOP else self.family()
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        return pids


class Fleet:
    """`sandboxq worker` processes on one queue, and every pid they ever started."""

    def __init__(self, queue: str, url: str, logs: Path, args: Sequence[str]) -> None:
        self.queue = queue
        self.url = url
        self.logs = logs
        self.args = list(args)
        self.workers: list[Worker] = []
        self.seen: set[int] = set()
        self._lock = threading.Lock()
        self._processes = BackgroundWorkers()

    def spawn(self, url: str | None = None, *extra: str) -> Worker:
        name = f"w{len(self.workers) + 1}"
        log = self.logs / f"{name}.log"
        proc = self._processes.spawn(
            self.queue,
            PROCESSOR,
            *self.args,
            *extra,
            url=url or self.url,
            log=log,
            # Its own process group, as a worker started from a shell has: a test can
            # stop the group the way a terminal's Ctrl-Z would, and only that worker.
            new_session=True,
        )
        worker = Worker(name, proc, log)
        with self._lock:
            self.workers.append(worker)
            self.seen.add(proc.pid)
        return worker

    def start(self, count: int, children: int) -> list[Worker]:
        """Spawn ``count`` workers on the fleet's URL; returns once each has ``children``."""
        workers = [self.spawn() for _ in range(count)]
        for worker in workers:
            self.wait_ready(worker, children)
        return workers

    def wait_ready(self, worker: Worker, children: int, timeout_s: float = 30) -> None:
        wait_for(
            lambda: len(worker.children()) >= children or worker.proc.poll() is not None,
            timeout_s,
            f"{worker.name} to start {children} children",
        )
        assert worker.proc.poll() is None, f"{worker.name} exited: {self.tail(worker)}"
        self.watch()

    def watch(self) -> None:
        """Note every process the workers have now (call it often: pids are checked at close)."""
        for worker in list(self.workers):
            pids = [p.pid for p in worker.descendants()]
            with self._lock:
                self.seen.update(pids)

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() is None]

    def tail(self, worker: Worker, lines: int = 30) -> str:
        text = worker.log.read_text(errors="replace") if worker.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def errors(self) -> str:
        """Tracebacks in any worker's log (a worker must never crash on a fault)."""
        found = []
        for worker in self.workers:
            text = worker.log.read_text(errors="replace") if worker.log.exists() else ""
            if "Traceback" in text:
                found.append(f"--- {worker.name} ---\n{self.tail(worker, 60)}")
        return "\n".join(found)

    def close(self) -> None:
        """SIGKILL every worker; assert everything they ever started dies with them."""
        self.watch()
        self._processes.stop_all()
        deadline = time.monotonic() + 5.0
        while (left := sorted(p for p in self.seen if alive(p))) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"processes outlived their worker: {left}"


def unfinished(ledger: Path, pids: set[int], since: float = 0.0) -> dict[str, int]:
    """Job key -> pid, for the executions by ``pids`` that have not (yet) finished (and
    started after ``since``, a ``time.time()``)."""
    return {
        e.key: e.pid
        for runs in read_ledger(ledger).values()
        for e in runs
        if e.pid in pids and not e.finished and e.started > since
    }


def lease_ends(scene: Scene, keys: Iterable[str]) -> dict[str, float]:
    """Where the lease of each running job of ``keys`` ends on the server (its score in the
    active set), as a ``time.time()``; 0 for one not running."""
    active = QueueKeys(scene.queue.name).active
    with redis.Redis.from_url(scene.url) as raw:
        return {key: (raw.zscore(active, key) or 0) / 1000 for key in keys}


def assert_within_leases(
    runs: dict[str, list[Execution]], held: dict[str, int], ends: dict[str, float]
) -> None:
    """No execution of ``held`` (key -> pid) made progress after its lease ended on the
    server (``ends``, read once no renewal could reach it), whether it ran to its end
    meanwhile or was killed: the promise the fence keeps."""
    for key, pid in held.items():
        (run,) = [e for e in runs[key] if e.pid == pid]
        assert run.last < ends[key], (run, ends[key])


def assert_cut_off(
    scene: Scene, runs: dict[str, list[Execution]], held: dict[str, int], at: float, lease_s: float
) -> None:
    """Each job of ``held`` (key -> pid) ran in that pid until less than a lease after ``at``
    (the wall-clock time of the fault), never to its end, and that first attempt was
    recorded as a lost lease."""
    for key, pid in held.items():
        (cut_off,) = [e for e in runs[key] if e.pid == pid]
        assert not cut_off.finished and cut_off.last < at + lease_s, cut_off
        info = scene.queue.backend.get(key)
        assert info is not None and info.history[0].outcome is Outcome.LEASE_LOST, info


# -- fault makers -----------------------------------------------------------------------------


class ChildKiller(threading.Thread):
    """SIGKILLs a random child of a random running worker every ``lo_s``..``hi_s`` seconds.

    Only children that have been up for a while: a pool that sees its children die before
    they are ready (an import crash loop) gives up by design, and that is not this test.
    """

    def __init__(self, fleet: Fleet, lo_s: float = 0.1, hi_s: float = 0.3, seed: int = 0) -> None:
        super().__init__(name="chaos-child-killer", daemon=True)
        self.fleet = fleet
        self.lo_s, self.hi_s = lo_s, hi_s
        self.rng = random.Random(seed)
        self.killed: list[int] = []
        self._halt = threading.Event()
        self.paused = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.rng.uniform(self.lo_s, self.hi_s)):
            self.fleet.watch()
            if self.paused.is_set():
                continue
            workers = self.fleet.running()
            self.rng.shuffle(workers)
            for worker in workers:
                children = worker.children(min_age_s=0.5)
                if not children:
                    continue
                victim = self.rng.choice(children)
                try:
                    victim.kill()
                except psutil.Error:
                    continue
                self.killed.append(victim.pid)
                break

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


class ForkServerKiller(threading.Thread):
    """SIGKILLs a random running worker's fork server every ``every_s`` seconds, at most
    ``per_worker`` times each (a pool gives up, by design, on its third death a minute)."""

    def __init__(self, fleet: Fleet, every_s: float = 1.0, per_worker: int = 2, seed: int = 0):
        super().__init__(name="chaos-fork-server-killer", daemon=True)
        self.fleet = fleet
        self.every_s, self.per_worker = every_s, per_worker
        self.rng = random.Random(seed)
        self.killed: dict[str, int] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            self.fleet.watch()
            workers = [
                w for w in self.fleet.running() if self.killed.get(w.name, 0) < self.per_worker
            ]
            self.rng.shuffle(workers)
            for worker in workers:
                server = worker.fork_server()
                if server is None or not worker.children(min_age_s=0.3):
                    continue
                try:
                    server.kill()
                except psutil.Error:
                    continue
                self.killed[worker.name] = self.killed.get(worker.name, 0) + 1
                break

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


class Producer(threading.Thread):
    """Enqueues ``count`` ledger jobs (``seconds``, ``step_s`` and ``busy`` are passed to
    ``ledger_job``) in batches (one script call each); on a backend error
    it keeps the error and enqueues the same batch again: the jobs carry explicit ids, so
    a batch the server applied before the error is not added twice."""

    def __init__(
        self,
        queue: Queue,
        ledger: Path,
        count: int,
        options: JobOptions,
        *,
        prefix: str = "j",
        batch: int = 10,
        pause_s: float = 0.02,
        seconds: Callable[[random.Random], float] = lambda rng: rng.uniform(0.02, 0.1),
        step_s: float = 0.02,
        busy: bool = False,
        backlog: Callable[[], bool] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(name=f"chaos-producer-{prefix}", daemon=True)
        self.step_s = step_s
        self.busy = busy
        self.backlog = backlog  # while it says True, hold the next batch back
        self.backend = queue.backend
        self.ledger = str(ledger)
        self.count = count
        self.options_json = options.model_dump_json(exclude_defaults=True)
        self.prefix = prefix
        self.batch = batch
        self.pause_s = pause_s
        self.seconds = seconds
        self.rng = random.Random(seed)
        self.accepted: list[str] = []
        self.errors: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        n = 0
        while n < self.count and not self._halt.is_set():
            if self.backlog is not None and self.backlog():
                self._halt.wait(0.2)
                continue
            keys = [f"{self.prefix}{i}" for i in range(n, min(n + self.batch, self.count))]
            jobs = [
                NewJob(
                    codec.encode_call(
                        "json",
                        (self.ledger, key, self.seconds(self.rng), self.step_s, self.busy),
                        {},
                    ),
                    "json",
                    self.options_json,
                    key,
                )
                for key in keys
            ]
            while True:
                try:
                    added = self.backend.enqueue(jobs)
                    break
                except BackendError as exc:
                    self.errors.append(str(exc))
                    if self._halt.wait(0.2):
                        return
            self.accepted.extend(job_id for job_id, _created in added)
            n += len(keys)
            self._halt.wait(self.pause_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


# -- one test's world -------------------------------------------------------------------------

#: Job options for every chaos job: enough retries and stalls that the faults these tests
#: inflict do not exhaust them (a job that still fails must state its cause), and short
#: backoff so retried jobs come back within the test.
CHAOS_OPTIONS = JobOptions(retries=20, backoff_s=0.1, max_stalls=20)


class Scene:
    """One chaos test's world on one Redis: its queue, ledger, event tally and worker
    fleets. ``close()`` stops everything and checks that no worker left a process behind."""

    def __init__(self, queue_name: str, url: str, workdir: Path) -> None:
        self.url = url
        self.workdir = workdir
        self.ledger = workdir / "ledger"
        self.queue = Queue(queue_name, url=url)
        self.tally = Tally(queue_name, url)
        self.tally.start()
        self.fleets: list[Fleet] = []
        self.producers: list[Producer] = []

    def fleet(self, *worker_args: str) -> Fleet:
        self.fleets.append(Fleet(self.queue.name, self.url, self.workdir, worker_args))
        return self.fleets[-1]

    def producer(
        self, count: int, job_options: JobOptions = CHAOS_OPTIONS, **options: Any
    ) -> Producer:
        """A started producer of ``count`` ledger jobs (``options``: see ``Producer``)."""
        producer = Producer(self.queue, self.ledger, count, job_options, **options)
        self.producers.append(producer)
        producer.start()
        return producer

    def finish(self, producer: Producer, timeout_s: float = 90) -> Audit:
        """Wait for the producer and for every job it got accepted to end; then audit."""
        producer.join(timeout_s)
        assert not producer.is_alive(), "the producer is still enqueuing"
        wait_for(lambda: self.tally.all_finished(producer.accepted), timeout_s, "every job to end")
        return audit(self.queue, producer.accepted, self.tally, self.ledger)

    def close(self) -> None:
        for producer in self.producers:
            producer.stop()
        try:
            for fleet in self.fleets:
                fleet.close()
        finally:
            self.tally.stop()
            self.queue.close()
