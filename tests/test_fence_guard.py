"""The fence holds without the parent (design invariant 2): the pool's guard process.

A worker stopped on its own (``kill -STOP``), or with its process group (Ctrl-Z), cannot
renew its leases nor kill its children; the children lead sessions of their own and are
not stopped with it. Each test runs the handler inside one long C call that holds the
GIL, so nothing inside the child can act either: only the guard, a process of its own,
can stop the child with its worker and kill it at its fence deadline, before a second
worker recovers the job.

Real `sandboxq worker` processes on a real redis-server; times are the machine's clock,
read by the handler (its start) and by a pidfd on the child (its death).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from sandboxq import Queue
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import CLI, BackgroundWorkers

LEASE_S = 1.5
HOLD = "tests.support.stuck:hold_gil_logged"


def runs(log: Path) -> dict[int, dict[str, float]]:
    """Per child pid, when its last run of the handler started (and ended), from the log."""
    found: dict[int, dict[str, float]] = {}
    if log.exists():
        for kind, pid, at in (line.split() for line in log.read_text().splitlines()):
            if kind == "start":
                found[int(pid)] = {}
            found[int(pid)][kind] = float(at)
    return found


def guard_of(worker: int) -> psutil.Process | None:
    try:
        kids = psutil.Process(worker).children()
    except psutil.Error:
        return None
    for kid in kids:
        try:
            if any("sandboxq.pool.guard_process" in part for part in kid.cmdline()):
                return kid
        except psutil.Error:
            continue
    return None


def pool_children(worker: int) -> list[int]:
    """The pool's children: the processes the worker's fork server started."""
    try:
        below = psutil.Process(worker).children()
    except psutil.Error:
        return []
    found: list[int] = []
    for helper in below:
        try:
            if "forkserver" in " ".join(helper.cmdline()):
                found += [p.pid for p in helper.children()]
        except psutil.Error:
            continue
    return found


def state(pid: int) -> str:
    try:
        return str(psutil.Process(pid).status())
    except psutil.NoSuchProcess:
        return "gone"


class DeathWatch(threading.Thread):
    """Records when ``pid`` (not our child) ends: its pidfd becomes readable."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.fd = os.pidfd_open(pid)
        self.at: float | None = None

    def run(self) -> None:
        select.select([self.fd], [], [])
        self.at = time.time()
        os.close(self.fd)

    def died_at(self, timeout_s: float) -> float:
        self.join(timeout_s)
        assert self.at is not None, "the child did not die"
        return self.at


#: A stand-in for an interactive shell: the session leader, with the worker in a process
#: group of its own in the same session, as job control puts it. A group whose parent is
#: in another session is orphaned, and the kernel discards a SIGTSTP sent to it: Ctrl-Z
#: only stops a worker that has a shell like this one above it.
SHELL = """
import os, sys
pid = os.fork()
if pid == 0:
    os.setpgid(0, 0)
    os.execvp(sys.argv[1], sys.argv[1:])
print(pid, flush=True)
os.waitpid(pid, 0)
"""


@dataclass
class Scene:
    queue: Queue
    url: str
    workers: BackgroundWorkers
    logs: Path
    shells: list[tuple[subprocess.Popen[bytes], int]]  # and the worker each one started

    def spawn(self, name: str, *, terminal: bool = False) -> int:
        """A `sandboxq worker` with one child running ``HOLD``, leading a process group of
        its own (under a shell's session with ``terminal``); returns its pid."""
        args = ("--concurrency", "1", "--lease-s", str(LEASE_S))
        log = self.logs / f"{name}.log"
        if not terminal:
            return self.workers.spawn(
                self.queue.name, HOLD, *args, url=self.url, log=log, new_session=True
            ).pid
        command = [*CLI, "worker", self.queue.name, HOLD, "--url", self.url, *args]
        with log.open("ab") as stderr:
            shell = subprocess.Popen(
                [sys.executable, "-c", SHELL, *command],
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,
            )
        assert shell.stdout is not None
        worker = int(shell.stdout.readline())
        self.shells.append((shell, worker))
        return worker


@pytest.fixture
def scene(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path
) -> Iterator[Scene]:
    q = Queue(queue_name, url=redis_url)
    scene = Scene(q, redis_url, workers, tmp_path, [])
    yield scene
    q.close()
    for shell, worker in scene.shells:
        # Two groups: the worker leads its own (job control), which a kill of the shell's
        # group would miss; then, re-parented to init, no leak check would see it.
        for group in (worker, shell.pid):
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shell.wait(10)
        assert shell.stdout is not None
        shell.stdout.close()
        wait_for(lambda w=worker: state(w) == "gone", 10, f"the worker {worker} to be gone")


def hold(signum: int, worker: int, group: bool) -> None:
    if group:
        os.killpg(worker, signum)
    else:
        os.kill(worker, signum)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "signum, group",
    [(signal.SIGSTOP, False), (signal.SIGTSTP, True), (signal.SIGSTOP, True)],
    ids=["kill-STOP-worker", "ctrl-Z", "kill-STOP-group"],
)
def test_a_stopped_worker_stops_its_child_and_the_fence_kills_it_before_another_runs_the_job(
    scene: Scene, tmp_path: Path, signum: int, group: bool
) -> None:
    """The first worker is stopped while its child runs a 6 s job; a second worker is
    serving the queue. The child stops with its worker and dies at its fence; the job's
    result is the second worker's, and the two executions never overlap."""
    q = scene.queue
    log = tmp_path / "runs.log"
    first = scene.spawn("first", terminal=signum == signal.SIGTSTP)
    job = q.enqueue(str(log), 6.0, str(tmp_path / "ran"), 0.2)  # the second run: 0.2 s
    (child,) = wait_for(lambda: list(runs(log)), 30, "the first worker's child to start")
    assert wait_for(lambda: guard_of(first), 10, "the first worker's guard")
    death = DeathWatch(child)
    death.start()
    hold(signum, first, group)
    stopped_at = time.time()
    try:
        wait_for(
            lambda: state(child) in ("stopped", "zombie", "gone"),
            2.0,
            f"child {child} to stop with its worker (it is {state(child)})",
        )
        scene.spawn("second")
        died = death.died_at(3 * LEASE_S)
        result = job.result(timeout_s=60)
    finally:
        hold(signal.SIGCONT, first, group)
    seen = runs(log)

    assert result != child and result in seen, (result, seen)
    assert "end" not in seen[child], "the stopped worker's child ran its job to the end"
    second_start = seen[result]["start"]
    print(
        f"\nchild stopped with its worker, dead {died - stopped_at:.3f} s after the stop, "
        f"{second_start - died:.3f} s before the second execution started"
    )
    assert died <= second_start, f"the executions overlapped by {died - second_start:.3f} s"
    assert died - stopped_at < LEASE_S + 0.5, "the child outlived its lease"
    # The first worker goes back to work with a fresh child.
    wait_for(
        lambda: [p for p in pool_children(first) if p != child],
        20,
        "the first worker to start a fresh child",
    )
    assert state(first) not in ("zombie", "gone")


@pytest.mark.alone  # a restart within 0.5 s
@pytest.mark.timeout(60)
def test_a_killed_guard_is_restarted_at_once_and_fences_as_before(
    scene: Scene, tmp_path: Path
) -> None:
    """The guard is SIGKILLed mid-job: the worker starts another within 100 ms (generous
    here: 0.5 s under a loaded test run), the running job is not disturbed, and the new
    guard fences the child when its worker stops."""
    q = scene.queue
    log = tmp_path / "runs.log"
    first = scene.spawn("first")
    done = q.enqueue(str(log), 1.0)
    old = wait_for(lambda: guard_of(first), 10, "the guard")
    wait_for(lambda: list(runs(log)), 30, "the child to start")
    old.kill()
    killed_at = time.monotonic()
    while (new := guard_of(first)) is None or new.pid == old.pid:
        assert time.monotonic() - killed_at < 5, "no new guard"
    restarted_s = time.monotonic() - killed_at
    print(f"\na new guard was running {restarted_s:.3f} s after the kill")
    assert restarted_s < 0.5
    assert done.result(timeout_s=30) in runs(log)  # the attempt went on, untouched

    job = q.enqueue(str(log), 6.0, str(tmp_path / "ran"), 0.2)  # the second run: 0.2 s
    child = wait_for(
        lambda: [p for p, r in runs(log).items() if "end" not in r], 30, "the next job to start"
    )[0]
    death = DeathWatch(child)
    death.start()
    os.kill(first, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        died = death.died_at(3 * LEASE_S)
    finally:
        os.kill(first, signal.SIGCONT)
    assert died - stopped_at < LEASE_S + 0.5
    scene.spawn("second")
    assert job.result(timeout_s=60) != child


def daemon_pid(path: Path) -> int | None:
    return int(path.read_text()) if path.exists() else None


@pytest.mark.alone  # gone within 1 s
@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_guard", [False, True], ids=["fork-server-too", "guard-too"])
def test_a_killed_worker_leaves_nothing_of_its_pool(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path, with_guard: bool
) -> None:
    """The worker is SIGKILLed together with its fork server (``kill -9`` of its process
    group), or together with its guard: a child inside a GIL-holding call and the daemon
    its handler double-forked into a session of its own are gone within a second."""
    pid_file = tmp_path / "daemon.pid"
    proc = workers.spawn(
        queue_name,
        "tests.support.stuck:daemon_then_hold",
        "--concurrency",
        "1",
        url=redis_url,
        log=tmp_path / "worker.log",
        new_session=True,
    )
    with Queue(queue_name, url=redis_url) as q:
        q.enqueue(str(pid_file))
    daemon = wait_for(lambda: daemon_pid(pid_file), 30, "the handler's daemon")
    guard = wait_for(lambda: guard_of(proc.pid), 10, "the guard")
    children = pool_children(proc.pid)
    assert daemon not in children and children
    if with_guard:
        guard.kill()
        proc.kill()
    else:
        os.killpg(proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    survivors = [daemon, *children]
    try:
        wait_for(
            lambda: not any(state(p) not in ("zombie", "gone") for p in survivors),
            5,
            "the pool's processes to die",
        )
        took = time.monotonic() - killed_at
    finally:
        for pid in survivors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not with_guard:
            guard.wait(5)
    print(f"\nthe pool's processes were gone {took:.3f} s after the kill")
    assert took < 1.0


@pytest.mark.timeout(10)
def test_the_guard_reads_the_table_the_supervisor_writes() -> None:
    """The supervisor writes slots field by field (ctypes), the guard reads them in bulk
    (struct): both must see the same child, start time and deadline, and a freed slot."""
    import mmap

    from sandboxq.pool import guard_process
    from sandboxq.pool.guard import Guard, created

    table = Guard(capacity=4)
    fence = table.add(os.getpid())
    fence.deadline = 1234.5
    view = mmap.mmap(table._fd, os.fstat(table._fd).st_size)
    reader = guard_process.Guard(os.getpid(), view)
    assert reader.entries() == [(0, os.getpid(), created(os.getpid()), 1234.5)]
    table.remove(fence)
    assert reader.entries() == []
    table.close()


PAST_BOTH_DEADLINES = """
import sys, time
from sandboxq import Pool
from sandboxq.pool.attempt import Task
from sandboxq.testing.waiting import wait_for
ended = []
with Pool("sandboxq.testing.handlers:sleep_forever", size=1) as pool:
    wait_for(pool._supervisor._guard.ready, 10, "the guard to read its table")
    fence = time.monotonic() + 0.5  # the lease, not renewed: then the hard deadline, 1 s
    task = Task(b"[[], {}]", "json", hard_timeout_s=1.0, fence_deadline=fence)
    pool.execute(task, ended.append)
    wait_for(lambda: pool.child_states()["busy"], 10, "the attempt to start")
    print(pool.pids[0], time.monotonic() + 1.0, flush=True)  # stopped by the test now
    sys.stdin.readline()  # continued: past both deadlines
    wait_for(lambda: ended, 10, "the attempt to end")
    print(ended[0].outcome.value, ended[0].detail, flush=True)
"""


@pytest.mark.timeout(40)
def test_a_pool_stopped_past_its_fence_and_hard_deadline_reports_the_lease_lost() -> None:
    """The guard killed the child at its fence while the worker was stopped; continued
    past the hard deadline too, the pool reported ``hard_timeout`` (charged, acked on a
    lease that had run out) instead of the fence's ``lease_lost``, acked by nobody."""
    with subprocess.Popen(
        [sys.executable, "-c", PAST_BOTH_DEADLINES],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            child, hard_at = proc.stdout.readline().split()
            os.kill(proc.pid, signal.SIGSTOP)
            fenced = lambda: state(int(child)) in ("zombie", "gone")  # noqa: E731
            wait_for(fenced, 10, "the guard's fence kill")
            wait_for(lambda: time.monotonic() > float(hard_at), 5, "the hard deadline to pass")
            os.kill(proc.pid, signal.SIGCONT)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            outcome = proc.stdout.readline()
            assert outcome.startswith("lease_lost "), outcome
            assert proc.wait(20) == 0
        finally:
            proc.kill()  # also when stopped


@pytest.mark.timeout(40)
def test_a_guard_stopped_while_the_pool_was_idle_is_continued_by_its_next_task() -> None:
    """With no attempt running no renewal came to look at its beat, so a guard stopped
    then stayed stopped: a worker stopped right after its next claim left that job
    unfenced, and another worker ran it at the same time. The next task continues it."""
    from sandboxq import Pool
    from sandboxq.models import Outcome
    from sandboxq.pool.attempt import Task
    from sandboxq.pool.guard import LATE_S

    with Pool("sandboxq.testing.handlers:sleep_forever", size=1) as pool:
        guard = pool._supervisor._guard
        wait_for(guard.ready, 10, "the guard to read its table")
        pid = guard.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: state(pid) == "stopped", 5, "the guard to stop")
        header = guard._header
        wait_for(lambda: time.monotonic() - header.beat / 1e9 > LATE_S, 5, "its beat to age")
        task = pool.execute(Task(b"[[], {}]", "json"), lambda _: None)
        wait_for(lambda: state(pid) != "stopped", 2, "the guard to be continued")
        assert guard.pid == pid, "it was continued, not replaced"
        pool.kill(task, Outcome.CANCELLED, "the test is over")


@pytest.mark.timeout(40)
def test_a_stopped_guard_is_continued_by_its_pool() -> None:
    """A guard that is SIGSTOPped is alive: its pidfd never fires. Its beat stops moving,
    and the supervisor, woken by the lease renewals of a running attempt, continues it."""
    from sandboxq import Pool
    from sandboxq.models import Outcome
    from sandboxq.pool.attempt import Task
    from sandboxq.pool.guard import STALL_S

    with Pool("sandboxq.testing.handlers:sleep_forever", size=1) as pool:
        guard = pool._supervisor._guard
        wait_for(guard.ready, 10, "the guard to read its table")
        task = pool.execute(Task(b"[[], {}]", "json"), lambda _: None)
        pid = guard.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while state(pid) == "stopped":
            assert time.monotonic() - stopped_at < STALL_S + 10, "the guard stayed stopped"
            pool.extend_fence(task, time.monotonic() + 60)  # a heartbeat's renewal
            time.sleep(0.1)
        print(f"\nthe stopped guard ran again {time.monotonic() - stopped_at:.2f} s later")
        assert guard.pid == pid, "it was continued, not replaced"
        pool.kill(task, Outcome.CANCELLED, "the test is over")
