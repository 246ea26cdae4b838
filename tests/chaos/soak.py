"""The soak: the chaos suite's faults, mixed, for minutes, with thousands of jobs.

    python tests/chaos/soak.py [--minutes 10] [--workers 3] [--concurrency 2] [--lease-s 2]
    (or `make soak SOAK_MINUTES=10`)

    Producer ── jobs (mostly short, some longer than a lease) ──► Redis (AOF, appendfsync always)
    ChildKiller ── a random child SIGKILLed every 0.1-0.3 s, all along
    every --fault-every-s, the next of: SIGKILL of a worker's fork server, SIGKILL of a
        worker parent (replaced 2 s later),
        SIGSTOP of a worker past its lease, Redis SIGKILLed and restarted, the proxied
        worker's network stalled past its lease, a worker's process group stopped past its
        lease (Ctrl-Z: its children run on), the proxied network 100 ms slow for 5 s
    then: stop producing, let every job end, audit (chaos/audit.py), print the counts

Exit status 0 when every invariant held, 1 otherwise. Worker logs, the ledger and Redis's
AOF stay in --workdir (default: a fresh temporary directory) for a look afterwards.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from audit import audit
from harness import ChildKiller, Fleet, Scene, alive

from sandboxq.errors import BackendError
from sandboxq.models import JobOptions, JobState
from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.waiting import wait_for
from tests.support.proxy import TcpProxy

#: Over minutes, a child is killed every 0.2 s: a job may be hit many times, so it gets
#: many retries, at once (the chaos tests' exponential backoff would grow to minutes).
SOAK_OPTIONS = JobOptions(retries=50, backoff_s=0, max_stalls=50)


def job_seconds(rng: random.Random) -> float:
    """Mostly short jobs; one in twenty outlives a lease renewal or two. (A child lives
    about 1.2 s between the kills, so much longer jobs would rarely get to finish.)"""
    return rng.uniform(1.0, 2.0) if rng.random() < 0.05 else rng.uniform(0.02, 0.3)


class Faults:
    """The rotating faults; each returns a line saying what it did."""

    def __init__(
        self, fleet: Fleet, server: RedisServer, proxy: TcpProxy, lease_s: float, seed: int
    ) -> None:
        self.fleet, self.server, self.proxy, self.lease_s = fleet, server, proxy, lease_s
        self.rng = random.Random(seed)
        self.done: Counter[str] = Counter()

    def cycle(self) -> Callable[[], str]:
        order = [
            self.kill_fork_server,
            self.kill_parent,
            self.freeze,
            self.restart_redis,
            self.stall,
            self.ctrl_z,
            self.slow,
        ]
        step = itertools.cycle(order)
        return lambda: next(step)()

    def _victim(self) -> tuple[int, str]:
        running = [(i, w) for i, w in enumerate(self.fleet.workers) if w.proc.poll() is None]
        i, worker = self.rng.choice(running[1:] or running)  # the proxied one is spared
        return i, worker.name

    def kill_fork_server(self) -> str:
        """A worker's fork server SIGKILLed mid-run (the OOM killer's favourite): its pool
        starts a fresh one, the attempts it took down are requeued uncharged."""
        i, name = self._victim()
        server = self.fleet.workers[i].fork_server()
        if server is None:
            return f"{name} had no fork server to kill"
        server.kill()
        self.done["fork server killed"] += 1
        return f"SIGKILLed {name}'s fork server (pid {server.pid})"

    def kill_parent(self) -> str:
        i, name = self._victim()
        victim = self.fleet.workers[i]
        family = victim.family()
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        wait_for(lambda: not any(alive(p) for p in family), 10, f"{name}'s family to die")
        time.sleep(2.0)
        replacement = self.fleet.spawn()
        self.fleet.wait_ready(replacement, 1)
        self.done["parent killed"] += 1
        return f"SIGKILLed {name} ({len(family)} processes), replaced by {replacement.name}"

    def freeze(self) -> str:
        i, name = self._victim()
        worker = self.fleet.workers[i]
        family = worker.signal_family(signal.SIGSTOP)
        time.sleep(2 * self.lease_s)
        worker.proc.send_signal(signal.SIGCONT)
        time.sleep(0.5)  # the parent fences its children first
        for pid in family[1:]:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.done["worker frozen"] += 1
        return f"froze {name} for {2 * self.lease_s:g} s"

    def restart_redis(self) -> str:
        assert self.server.process is not None
        self.server.process.send_signal(signal.SIGKILL)
        self.server.stop()
        time.sleep(2.5 * self.lease_s)
        self.server.start()
        self.done["redis restarted"] += 1
        return f"Redis SIGKILLed, back after {2.5 * self.lease_s:g} s"

    def stall(self) -> str:
        self.proxy.stall()
        time.sleep(2 * self.lease_s)
        self.proxy.resume()
        self.done["network stalled"] += 1
        return f"{self.fleet.workers[0].name}'s network stalled for {2 * self.lease_s:g} s"

    def ctrl_z(self) -> str:
        i, name = self._victim()
        pgid = self.fleet.workers[i].pid  # each worker leads its own process group
        os.killpg(pgid, signal.SIGSTOP)
        time.sleep(2 * self.lease_s)
        os.killpg(pgid, signal.SIGCONT)
        self.done["group stopped"] += 1
        return f"stopped {name}'s process group (not its children) for {2 * self.lease_s:g} s"

    def slow(self) -> str:
        self.proxy.delay_s = 0.1
        time.sleep(5.0)
        self.proxy.delay_s = 0.0
        self.done["network slow"] += 1
        return f"{self.fleet.workers[0].name}'s network 100 ms slow for 5 s"


def waiting(scene: Scene) -> int:
    try:
        return scene.queue.counts()[JobState.WAITING]
    except BackendError:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--lease-s", type=float, default=2.0)
    parser.add_argument("--fault-every-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sandboxq-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"soak: {args.minutes:g} min, {args.workers} workers x {args.concurrency} children, "
        f"lease {args.lease_s:g} s; logs and ledger in {workdir}",
        flush=True,
    )
    with RedisServer(appendonly=True) as server, TcpProxy("127.0.0.1", server.port) as proxy:
        scene = Scene("soak", server.url, workdir)
        status = 1
        try:
            status = run(scene, server, proxy, args)
        except AssertionError as exc:  # e.g. jobs that never ended: a failure, said plainly
            print(f"FAILED: {exc}", flush=True)
        finally:
            try:
                scene.close()  # also checks that no worker left a process behind
            except AssertionError as exc:
                print(f"FAILED: {exc}", flush=True)
                status = 1
        return status


def run(scene: Scene, server: RedisServer, proxy: TcpProxy, args: argparse.Namespace) -> int:
    worker_args = ["--concurrency", str(args.concurrency), "--lease-s", str(args.lease_s)]
    fleet = scene.fleet(*worker_args)
    fleet.wait_ready(fleet.spawn(proxy.url), args.concurrency)  # w1 talks through the proxy
    for _ in range(args.workers - 1):
        fleet.wait_ready(fleet.spawn(), args.concurrency)
    capacity = args.workers * args.concurrency
    producer = scene.producer(
        10**9,
        SOAK_OPTIONS,
        batch=10,
        pause_s=0.05,
        seconds=job_seconds,
        seed=args.seed,
        backlog=lambda: waiting(scene) > 20 * capacity,
    )
    killer = ChildKiller(fleet, 0.1, 0.3, seed=args.seed)
    killer.start()
    faults = Faults(fleet, server, proxy, args.lease_s, args.seed)
    next_fault = faults.cycle()
    started = time.monotonic()
    end = started + args.minutes * 60
    fault_at = started + args.fault_every_s
    status_at = started + 10
    try:
        while time.monotonic() < end:
            time.sleep(0.2)
            if time.monotonic() >= fault_at:
                print(f"  {time.monotonic() - started:6.0f} s  {next_fault()}", flush=True)
                fault_at = time.monotonic() + args.fault_every_s
            if time.monotonic() >= status_at:
                status_at += 10
                print(
                    f"  {time.monotonic() - started:6.0f} s  {len(producer.accepted)} accepted, "
                    f"{scene.tally.total('completed')} completed, {len(killer.killed)} children "
                    f"killed",
                    flush=True,
                )
    finally:
        producer.stop()
        killer.stop()
    print("  draining...", flush=True)
    ids = producer.accepted
    wait_for(lambda: scene.tally.all_finished(ids), 600, "every accepted job to end")
    took = time.monotonic() - started
    try:
        result = audit(scene.queue, ids, scene.tally, scene.ledger, trimmed=True)
    except AssertionError as exc:
        print(f"FAILED after {took:.0f} s with {len(ids)} jobs:\n{exc}", flush=True)
        return 1
    failed_by_cause = Counter(cause.split(":")[0] for cause in result.failed.values())
    print(
        f"soak passed in {took:.0f} s: {len(ids)} jobs accepted, {result.completed} completed "
        f"exactly once, {len(result.failed)} failed with a cause {dict(failed_by_cause)}\n"
        f"  {result.executions} executions, 0 overlapping; {result.stalls} stalled "
        f"recoveries; {len(killer.killed)} children SIGKILLed; faults {dict(faults.done)}\n"
        f"  {len(producer.errors)} enqueue errors retried; attempt outcomes "
        f"{dict(result.outcomes)} (over the {len(ids) - result.trimmed} jobs still retained)",
        flush=True,
    )
    if fleet.errors():
        print(f"worker tracebacks:\n{fleet.errors()}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
