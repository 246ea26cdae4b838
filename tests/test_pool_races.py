"""Races between a child's messages and the supervisor's decisions (issue 10, item 8, the
pool's side), forced with barriers: a FIFO the handler waits on, an outcome callback that
holds the supervisor thread, a hook that ends the child at an exact point of its loop.

- a soft, fence or memory deadline that passes while a finished attempt's result waits
  unread is not applied to it: the attempt is reported with its true outcome;
- an attempt cancelled while queued behind a busy child never starts;
- a child that dies between tasks does not charge the next task for its death;
- memory is charged to the job that used it;
- a lease renewal that reaches the supervisor after the guard fenced its child does not
  make the fence's kill read as a crash;
- a task queued behind a running attempt is taken back when another child goes idle, and
  never starts under its predecessor's memory limit;
- an attempt's memory limit is in force before its child can start it;
- a kill that reads a child's channel before that channel's own readiness is served
  never leaves the supervisor waiting on it.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import psutil
import pytest

from sandboxq import Pool
from sandboxq.models import Outcome
from sandboxq.pool.attempt import AttemptResult, Task
from sandboxq.pool.channel import Channel
from sandboxq.pool.containment import probe
from sandboxq.pool.handles import Child
from sandboxq.pool.messages import Run
from sandboxq.pool.running import Attempt
from sandboxq.pool.waits import readable
from sandboxq.testing.waiting import wait_for

CALL = "sandboxq.testing.handlers:call"
MODE, WHY = probe()


def open_barrier(fifo: Path) -> None:
    """Let the handler waiting on ``fifo`` go on (fails at once, not hangs, if none waits)."""
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def open_or_not(fifo: Path) -> bool:
    try:
        open_barrier(fifo)
    except OSError:
        return False
    return True


def run(pool: Pool, *args: Any, **limits: Any) -> Future[AttemptResult]:
    done: Future[AttemptResult] = Future()
    task = pool.make_task(*args)
    for name, value in limits.items():
        setattr(task, name, value)
    pool.execute(task, done.set_result)
    return done


def execute(pool: Pool, *args: Any, **limits: Any) -> tuple[int, Future[AttemptResult]]:
    done: Future[AttemptResult] = Future()
    task = pool.make_task(*args)
    for name, value in limits.items():
        setattr(task, name, value)
    return pool.execute(task, done.set_result), done


@pytest.mark.timeout(30)
@pytest.mark.parametrize("deadline", ["soft", "fence", "memory"])
def test_a_deadline_never_overrides_a_result_already_sent(tmp_path: Path, deadline: str) -> None:
    fifo, marker = tmp_path / "fifo", tmp_path / "returned"
    os.mkfifo(fifo)
    limits: dict[str, Any] = {"hard_timeout_s": 20.0}
    mb = 0
    if deadline == "soft":
        limits["soft_timeout_s"] = 1.0
    elif deadline == "fence":
        limits["fence_deadline"] = time.monotonic() + 1.0
    else:
        limits["max_memory_mb"] = 60
        mb = 120
    # The race is with the parent's memory sampling, which only the process-tree mode has
    # (in a control group the kernel enforces the limit: test_containment.py).
    with Pool(CALL, size=2, memory_check_interval_s=0.05, containment="process_tree") as pool:
        begun = time.monotonic()
        late = run(pool, "wait_then_return", str(fifo), str(marker), mb, **limits)
        holding, release = threading.Event(), threading.Event()

        def hold_the_supervisor(_: AttemptResult) -> None:
            holding.set()
            release.wait(20)

        pool.execute(pool.make_task("echo", 1), hold_the_supervisor)
        assert holding.wait(10)  # the supervisor thread is now inside this callback
        # the handler returns once it waits on the fifo (its child may still be starting:
        # a loaded machine); its result then waits unread in the pipe
        wait_for(lambda: open_or_not(fifo), 10, "the handler to wait on the fifo")
        wait_for(marker.exists, 10, "the handler to return")
        wait_for(lambda: time.monotonic() > begun + 1.2, 5, "the deadline to pass")
        release.set()
        result = late.result(timeout=10)
        assert result.outcome is Outcome.OK, result.cause


@pytest.mark.timeout(30)
def test_a_task_cancelled_while_queued_behind_a_busy_child_never_starts(tmp_path: Path) -> None:
    fifo, marker = tmp_path / "fifo", tmp_path / "started"
    os.mkfifo(fifo)
    with Pool(CALL, size=1) as pool:
        for i in range(150):  # short jobs: the pool starts queueing tasks in busy children
            run(pool, "echo", i).result(timeout=10)
        child = pool.pids[0]
        blocker = run(pool, "wait_on_fifo", str(fifo))
        task_id, queued = execute(pool, "mark_started", str(marker))
        children = pool._supervisor._children
        wait_for(lambda: any(c.queued for c in children), 10, "the task to be queued")
        pool.kill(task_id, Outcome.CANCELLED, "cancelled while queued")
        # Withdrawn, it ends at once, while the task ahead of it still runs (the kill is
        # asynchronous: the barrier opens only once it has been applied).
        assert queued.result(timeout=10).outcome is Outcome.CANCELLED
        wait_for(lambda: open_or_not(fifo), 10, "the blocker to wait on its barrier")
        assert blocker.result(timeout=10).outcome is Outcome.OK
        assert run(pool, "echo", 1).result(timeout=10).outcome is Outcome.OK
        assert not marker.exists(), "the cancelled task ran"
        assert pool.pids == [child], "the child was killed for a task it never started"


@pytest.mark.timeout(30)
def test_a_child_dying_between_tasks_does_not_charge_the_next_one() -> None:
    with Pool(CALL, size=1) as pool:
        first = run(pool, "exit_at_next_start").result(timeout=10)
        assert first.outcome is Outcome.OK
        second = run(pool, "echo", 5).result(timeout=10)
        assert second.outcome is Outcome.OK, second.cause


@pytest.mark.timeout(30)
def test_memory_leaked_by_one_job_is_not_charged_to_the_next() -> None:
    with Pool(CALL, size=1, memory_check_interval_s=0.02) as pool:
        assert run(pool, "leak_then_hold", 150).result(timeout=10).outcome is Outcome.OK
        small = run(pool, "leak_then_hold", 1, 0.3, max_memory_mb=100).result(timeout=10)
        assert small.outcome is Outcome.OK, small.cause
        # A job over its own limit is still stopped.
        big = run(pool, "leak_then_hold", 150, 2.0, max_memory_mb=100).result(timeout=10)
        assert big.outcome is Outcome.MEMORY_LIMIT, big.cause


@pytest.mark.timeout(30)
def test_a_child_over_the_limit_after_its_attempt_is_replaced() -> None:
    with Pool(CALL, size=1, max_child_growth_mb=100) as pool:
        before = pool.pids
        assert run(pool, "leak_then_hold", 20).result(timeout=10).outcome is Outcome.OK
        assert pool.pids == before  # small growth: kept
        assert run(pool, "leak_then_hold", 150).result(timeout=10).outcome is Outcome.OK
        wait_for(lambda: pool.pids and pool.pids != before, 10, "the child to be replaced")
    with Pool(CALL, size=1) as pool:
        before = pool.pids
        done = run(pool, "leak_then_hold", 150, 0, max_memory_mb=100).result(timeout=10)
        assert done.outcome in (Outcome.OK, Outcome.MEMORY_LIMIT)
        wait_for(lambda: pool.pids and pool.pids != before, 10, "the child to be replaced")


@pytest.mark.timeout(30)
def test_a_renewal_landing_after_the_guard_fenced_does_not_make_the_kill_a_crash() -> None:
    """A worker stopped with a renewal on its way: the guard kills the child at its fence
    deadline, and the renewal's later deadline reaches the supervisor before the child's
    death does. The death is still the fence's (``lease_lost``: the job is recovered), not
    a crash (a failed job). Forced: a cancel's callback holds the supervisor thread while
    the renewal is queued behind it and the guard kills."""
    with Pool(CALL, size=1, containment="process_tree") as pool:
        fence_s = 1.5
        fenced_id, fenced = execute(
            pool, "sleep_forever", fence_deadline=time.monotonic() + fence_s, hard_timeout_s=20.0
        )
        child = wait_for(lambda: pool.running_pids().get(fenced_id), 10, "the child to start")
        holding, release = threading.Event(), threading.Event()

        def hold_the_supervisor(_: AttemptResult) -> None:
            holding.set()
            release.wait(20)

        waiting = pool.make_task("echo", 1)
        waiting_id = pool.execute(waiting, hold_the_supervisor)  # pending: the child is busy
        pool.kill(waiting_id, Outcome.CANCELLED, "cancelled while pending")
        assert holding.wait(10)  # the supervisor thread is in the cancel's callback
        pool.extend_fence(fenced_id, time.monotonic() + 60.0)  # queued behind the cancel
        psutil.Process(child).wait(fence_s + 5)  # the guard's fence kill
        release.set()
        result = fenced.result(timeout=10)
        assert result.outcome is Outcome.LEASE_LOST, result.cause


@pytest.mark.timeout(60)
@pytest.mark.parametrize("trained", [True, False])
def test_no_task_waits_behind_a_hung_attempt_while_a_child_is_idle(
    tmp_path: Path, trained: bool
) -> None:
    """While jobs are short, busy children hold tasks queued ahead; once the other child
    has nothing left to do, it takes those tasks back, so they all end while the attempt
    ahead of them still hangs. (Untrained, the pool learns it from the echoes.)"""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with Pool(CALL, size=2) as pool:
        if trained:  # the pool learns: jobs are short, queue several ahead
            for i in range(150):
                run(pool, "echo", i).result(timeout=10)
        hung = run(pool, "wait_on_fifo", str(fifo))
        rest = [run(pool, "echo", i) for i in range(40)]
        children = pool._supervisor._children
        assert all(f.result(timeout=10).outcome is Outcome.OK for f in rest)
        assert not hung.done()
        assert not any(c.queued for c in children)
        wait_for(lambda: open_or_not(fifo), 10, "the hung attempt to wait on its barrier")
        assert hung.result(timeout=10).outcome is Outcome.OK


@pytest.mark.timeout(60)
@pytest.mark.skipif(MODE == "process_tree", reason=f"no writable control groups: {WHY}")
def test_a_take_back_from_a_child_slow_to_stop_is_tried_again(tmp_path: Path) -> None:
    """Taking a task back stops its child for a moment; on a loaded machine a child may not
    stop within TAKE_BACK_STOP_S. That task was then kept behind the hung attempt for good,
    and the tasks queued before it too, while the other child sat idle (the test above
    failed so under load). Here the hung child is frozen (its group's freezer: SIGSTOP
    cannot stop it) while the other one runs out of work, then thawed."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with Pool(CALL, size=2, containment="cgroup") as pool:
        for i in range(150):  # jobs are short: tasks are queued in busy children
            run(pool, "echo", i).result(timeout=10)
        children = pool._supervisor._children
        hung = run(pool, "wait_on_fifo", str(fifo))
        busy = wait_for(
            lambda: next((c for c in list(children) if c.running is not None), None),
            10,
            "the hung attempt to start",
        )
        assert busy.group is not None
        busy.group._freeze(True)
        try:
            rest = [run(pool, "echo", i) for i in range(40)]
            [other] = [c for c in children if c is not busy]
            wait_for(
                lambda: other.running is None and not other.queued and bool(busy.queued),
                10,
                "the other child to run out of work while the frozen one holds tasks",
            )
            # It tried at once to take a task back, and could not stop the frozen child; a
            # margin for that try on a loaded machine (nothing shows it from outside).
            time.sleep(0.3)
        finally:
            busy.group.thaw()
        assert all(f.result(timeout=10).outcome is Outcome.OK for f in rest)
        assert not hung.done()
        wait_for(lambda: open_or_not(fifo), 10, "the hung attempt to wait on its barrier")
        assert hung.result(timeout=10).outcome is Outcome.OK


@pytest.mark.timeout(60)
@pytest.mark.skipif(MODE == "process_tree", reason=f"no writable control groups: {WHY}")
def test_a_task_with_a_higher_memory_limit_never_starts_under_the_one_before(
    tmp_path: Path,
) -> None:
    """In a control group the kernel enforces the running attempt's limit, set when the
    supervisor starts it. A task queued behind another would start before the supervisor
    read the first one's end, under the first one's limit: held in the first one's outcome
    callback here, the supervisor could not catch up before the second one grew past it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with Pool(CALL, size=1, containment="cgroup") as pool:
        for i in range(150):  # short jobs: the pool queues tasks in its busy child
            run(pool, "echo", i).result(timeout=10)
        holding, release = threading.Event(), threading.Event()

        def hold_the_supervisor(_: AttemptResult) -> None:
            holding.set()
            release.wait(20)

        first = pool.make_task("wait_on_fifo", str(fifo))
        first.max_memory_mb = 40
        pool.execute(first, hold_the_supervisor)
        second = run(pool, "use_memory", 120, 0.3, max_memory_mb=400)
        supervisor = pool._supervisor
        children = supervisor._children
        wait_for(
            lambda: supervisor._pending or any(c.queued for c in children),
            10,
            "the supervisor to take the second task",
        )
        wait_for(lambda: open_or_not(fifo), 10, "the first task to wait on its barrier")
        assert holding.wait(10)  # the first one ended; the supervisor is held
        assert not any(c.queued for c in children), "queued behind a lower limit"
        release.set()
        result = second.result(timeout=20)
        assert result.outcome is Outcome.OK, result.cause


@pytest.mark.timeout(60)
@pytest.mark.parametrize("containment", ["process_tree", "cgroup"])
def test_an_attempts_memory_limit_is_in_force_before_its_child_can_start_it(
    tmp_path: Path, containment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's limit (a cgroup mode), or the memory the samples count from (the
    process-tree mode), is set before the task goes to its child. Set after the send, a
    supervisor held there let a handler take 300 MB first: they became its starting
    point, and it returned ok under a limit of 100 MB."""
    if containment == "cgroup" and MODE == "process_tree":
        pytest.skip(f"no writable control groups: {WHY}")
    holding = tmp_path / "holding"
    sent: set[int] = set()
    send, begin = Channel.send, Child.begin

    def send_and_note(self: Channel, *messages: Any) -> None:
        send(self, *messages)
        sent.update(m.task_id for m in messages if isinstance(m, Run))

    def begin_once_it_holds(self: Child, run: Attempt, *args: Any, **kwargs: Any) -> None:
        if run.task_id in sent:  # the child may have started it: hold until it did
            wait_for(holding.exists, 10, "the handler to take its memory")
        begin(self, run, *args, **kwargs)

    monkeypatch.setattr(Channel, "send", send_and_note)
    monkeypatch.setattr(Child, "begin", begin_once_it_holds)
    with Pool(CALL, size=1, containment=containment) as pool:  # type: ignore[arg-type]
        hog = run(pool, "use_memory_and_mark", 300, str(holding), 0.5, max_memory_mb=100)
        result = hog.result(timeout=30)
    assert result.outcome is Outcome.MEMORY_LIMIT, result.cause


@pytest.mark.timeout(60)
def test_memory_a_queued_task_takes_at_its_start_is_not_the_child_growth_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``max_child_growth_mb`` the supervisor reads a child's memory after each
    attempt. Had a task been queued behind a short one, the child would be in it by then:
    held there, the 100 MB the next task took at its start read as the child's growth, and
    the child was replaced for memory no attempt had left behind."""
    holding = tmp_path / "holding"
    check_after = Child.check_after
    hog_task: list[Task] = []

    def check_once_the_next_holds(self: Child, run: Attempt, *args: Any) -> None:
        if any(q.task in hog_task for q in self.queued):
            wait_for(holding.exists, 10, "the queued task to take its memory")
        check_after(self, run, *args)

    monkeypatch.setattr(Child, "check_after", check_once_the_next_holds)
    with Pool(CALL, size=1, max_child_growth_mb=50) as pool:
        for i in range(150):  # short jobs: a pool that queues tasks ahead would now
            run(pool, "echo", i).result(timeout=10)
        pids = pool.pids
        hog_task.append(pool.make_task("use_memory_and_mark", 100, str(holding), 0.3))
        short = run(pool, "echo", "short")
        hog: Future[AttemptResult] = Future()
        pool.execute(hog_task[0], hog.set_result)
        assert short.result(timeout=10).outcome is Outcome.OK
        assert hog.result(timeout=10).outcome is Outcome.OK
        assert run(pool, "echo", "after").result(timeout=10).outcome is Outcome.OK
        assert pool.pids == pids, "a child was replaced for memory it did not keep"


@pytest.mark.timeout(60)
def test_a_kill_that_reads_a_channel_first_leaves_its_readiness_harmless(tmp_path: Path) -> None:
    """A kill reads what its child already sent before it acts (a finished attempt is
    never taken for a hung one). When the kill and the child's answer are in the same
    select batch, the kill comes first and reads the channel to its end; the channel's
    own readiness then found nothing, and the supervisor waited in a blocking read of a
    child with nothing more to say: the whole pool hung (a batch cancelled under a worker
    busy with short jobs hung its stop, 2 runs in 4)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with Pool(CALL, size=2) as pool:
        holding, release = threading.Event(), threading.Event()

        def hold_the_supervisor(_: AttemptResult) -> None:
            holding.set()
            release.wait(20)

        waiting_id, waiting = execute(pool, "wait_on_fifo", str(fifo))
        (child,) = wait_for(
            lambda: [c for c in pool._supervisor._children if c.running is not None],
            10,
            "the first attempt to start",
        )
        pool.execute(pool.make_task("echo", "held"), hold_the_supervisor)  # the other child
        assert holding.wait(10)
        pool.kill(waiting_id, Outcome.CANCELLED, "cancelled")  # first in the next batch
        wait_for(lambda: open_or_not(fifo), 10, "the first attempt to wait on its barrier")
        wait_for(lambda: readable(child.conn), 10, "its answer")  # second in that batch
        release.set()
        assert waiting.result(timeout=10).outcome is Outcome.OK  # it had answered
        assert run(pool, "echo", "after").result(timeout=10).outcome is Outcome.OK
