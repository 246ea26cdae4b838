"""The attempt boundary (design invariant 10), in process-tree mode: whatever an attempt starts is
dead before its outcome is reported and before its child takes another task, whatever the
outcome. Each test runs a hostile handler of the catalogue through the real Pool and looks
at the processes it recorded *from inside the outcome callback*, so "dead before it is
reported" is what is checked, not "dead a while later"."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from sandboxq import Pool
from sandboxq.errors import AttemptFailed
from sandboxq.models import Outcome
from sandboxq.pool.attempt import AttemptResult
from sandboxq.testing.processes import still_running
from sandboxq.testing.waiting import wait_for

H = "sandboxq.testing.handlers:"


def recorded(pid_file: Path) -> list[int]:
    return [int(p) for p in pid_file.read_text().split()] if pid_file.exists() else []


def run_and_look(
    pool: Pool, pid_file: Path, handler_args: tuple[Any, ...], **limits: Any
) -> tuple[AttemptResult, list[int], list[int]]:
    """Run one attempt; return its result, the pids it recorded, and those of them still
    running at the moment the outcome was reported."""
    done: Future[tuple[AttemptResult, list[int]]] = Future()

    def on_done(result: AttemptResult) -> None:
        done.set_result((result, still_running(recorded(pid_file))))

    task = pool.make_task(*handler_args)
    for name, value in limits.items():
        setattr(task, name, value)
    pool.execute(task, on_done)
    result, left = done.result(timeout=30)
    return result, recorded(pid_file), left


@pytest.fixture
def daemon_pool(containment: str) -> Any:
    with Pool(H + "daemonize_grandchild", size=1, containment=containment) as pool:
        yield pool


ENDINGS = [
    # how the handler ends, the limits of its attempt, the outcome
    ("return", {}, Outcome.OK),
    ("raise", {}, Outcome.ERROR),
    ("hang", {"hard_timeout_s": 0.6}, Outcome.HARD_TIMEOUT),
    ("hang", {"soft_timeout_s": 0.5, "hard_timeout_s": 3.0}, Outcome.SOFT_TIMEOUT),
    ("exit", {}, Outcome.EXIT),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("then", "limits", "outcome"), ENDINGS, ids=[e[2] for e in ENDINGS])
def test_daemonised_grandchild_is_dead_when_the_outcome_is_reported(
    daemon_pool: Pool, tmp_path: Path, then: str, limits: dict[str, float], outcome: Outcome
) -> None:
    pid_file = tmp_path / "pids"
    result, pids, left = run_and_look(daemon_pool, pid_file, (str(pid_file), then), **limits)
    assert result.outcome is outcome, result.cause
    assert len(pids) == 1
    assert not left, f"the daemon outlived its {outcome} attempt: {left}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("outcome", [Outcome.CANCELLED, Outcome.LEASE_LOST, Outcome.INTERRUPTED])
def test_daemonised_grandchild_dies_with_a_parent_side_kill(
    daemon_pool: Pool, tmp_path: Path, outcome: Outcome
) -> None:
    pid_file = tmp_path / "pids"
    done: Future[tuple[AttemptResult, list[int]]] = Future()
    task_id = daemon_pool.execute(
        daemon_pool.make_task(str(pid_file), "hang"),
        lambda r: done.set_result((r, still_running(recorded(pid_file)))),
    )
    wait_for(lambda: recorded(pid_file), 10, "the daemon to start")
    daemon_pool.kill(task_id, outcome, "killed by the test")
    result, left = done.result(timeout=10)
    assert result.outcome is outcome
    assert not left, f"the daemon outlived its killed attempt: {left}"


@pytest.mark.timeout(30)
def test_session_helper_left_by_a_normal_return_is_gone_before_the_next_task(
    tmp_path: Path, containment: str
) -> None:
    with Pool(H + "session_helper", size=1, containment=containment) as pool:
        for i in range(3):
            pid_file = tmp_path / f"pids{i}"
            result, pids, left = run_and_look(pool, pid_file, (str(pid_file),))
            assert result.outcome is Outcome.OK
            assert len(pids) == 1 and not left, f"job {i} leaked its helper {left}"


@pytest.mark.timeout(30)
def test_keep_strays_lets_a_helper_live_across_jobs_but_not_past_close(
    tmp_path: Path, containment: str
) -> None:
    pid_file = tmp_path / "pids"
    with Pool(H + "session_helper", size=1, containment=containment, keep_strays=True) as pool:
        result, pids, left = run_and_look(pool, pid_file, (str(pid_file),))
        assert result.outcome is Outcome.OK
        assert left == pids, "keep_strays=True must leave the helper running"
    assert not still_running(pids), "the pool's close must still take the helper"


@pytest.mark.timeout(40)
@pytest.mark.parametrize("then", ["return", "hang"], ids=["returned", "killed"])
def test_fork_burst_of_200_is_dead_when_the_outcome_is_reported(
    tmp_path: Path, then: str, containment: str
) -> None:
    pid_file = tmp_path / "pids"
    with Pool(H + "fork_burst", size=1, containment=containment) as pool:
        done: Future[tuple[AttemptResult, list[int]]] = Future()
        task_id = pool.execute(
            pool.make_task(str(pid_file), 200, then),
            lambda r: done.set_result((r, still_running(recorded(pid_file)))),
        )
        if then == "hang":  # killed once the whole burst runs (the hard deadline's path)
            wait_for(lambda: len(recorded(pid_file)) >= 200, 30, "the burst")
            pool.kill(task_id, Outcome.CANCELLED, "killed by the test")
        result, left = done.result(timeout=30)
        assert result.outcome is (Outcome.OK if then == "return" else Outcome.CANCELLED)
        assert len(recorded(pid_file)) == 200
        assert not left, f"{len(left)} of the burst outlived the attempt"


@pytest.mark.alone  # a fork bomb
@pytest.mark.timeout(40)
@pytest.mark.parametrize("then", ["return", "exit"])
def test_bounded_fork_bomb_cannot_outrun_the_sweep(
    tmp_path: Path, then: str, containment: str
) -> None:
    """The attempt ends while its tree is still forking; afterwards nothing of it runs, and
    the processes it was about to fork never appear."""
    pid_file = tmp_path / "pids"
    with Pool(H + "fork_bomb", size=1, containment=containment) as pool:
        result, _, left = run_and_look(pool, pid_file, (str(pid_file), 6, then))
        assert result.outcome is (Outcome.OK if then == "return" else Outcome.EXIT)
        assert not left, f"{len(left)} processes of the bomb outlived the attempt"
    # A process forked while the sweep ran would record itself late: none may be running.
    late = still_running(recorded(pid_file))
    assert not late, f"{len(late)} processes of the bomb appeared after the attempt ended"


DAEMON_PARENT = textwrap.dedent(
    """
    import sys
    from sandboxq import Pool
    pool = Pool("sandboxq.testing.handlers:daemonize_grandchild", size=1)
    pool.submit(sys.argv[1], "hang")
    import time
    while not open(sys.argv[1]).read().strip():
        time.sleep(0.01)
    print("ready", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.timeout(30)
def test_worker_sigkill_takes_the_daemonised_grandchild(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    pid_file.write_text("")
    parent = subprocess.Popen(
        [sys.executable, "-c", DAEMON_PARENT, str(pid_file)], stdout=subprocess.PIPE
    )
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == b"ready"
        daemon = recorded(pid_file)
        assert daemon and still_running(daemon)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    wait_for(lambda: not still_running(daemon), 5, "the daemon to die with the worker")


@pytest.mark.timeout(30)
def test_pool_close_takes_the_daemonised_grandchild(tmp_path: Path, containment: str) -> None:
    pid_file = tmp_path / "pids"
    pid_file.write_text("")
    pool = Pool(H + "daemonize_grandchild", size=1, containment=containment)
    pool.submit(str(pid_file), "hang")
    wait_for(lambda: recorded(pid_file), 10, "the daemon to start")
    pool.shutdown(cancel=True)
    assert not still_running(recorded(pid_file)), "the daemon outlived the pool"


# -- out of the tree ---------------------------------------------------------------------------


def sleeping(marker: str) -> list[int]:
    """Live processes (zombies aside) running ``sleep <marker>``, machine-wide."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[:2] == [b"/bin/sleep", marker.encode()] and still_running([int(name)]):
            found.append(int(name))
    return found


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64"), reason="clone's number is not known here"
)
def test_a_process_started_outside_the_childs_tree_does_not_outlive_its_attempt(
    containment: str, pid_namespace: bool
) -> None:
    """``clone(CLONE_PARENT)`` makes the new process the child of the child's parent (the
    fork server, or the PID namespace's reaper): no sweep of the child's own tree finds
    it, and it lived on beside the next jobs until the pool closed (in the process-tree
    mode past the worker's death too). Only the cgroup mode's group sweep killed it."""
    marker = f"61.{os.getpid()}{time.monotonic_ns() % 10**6}"
    with Pool(
        "tests.support.escapees:escape",
        size=1,
        containment=containment,
        pid_namespace=pid_namespace,
        hard_timeout_s=20,
    ) as pool:
        pool.submit(marker).result(timeout=30)
        assert sleeping(marker) == [], "the process outlived its attempt"


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64"), reason="clone's number is not known here"
)
def test_a_process_started_outside_the_childs_tree_dies_with_a_deadline_kill(
    containment: str,
) -> None:
    """The same escapee, then the handler hangs to its hard timeout: the deadline kill
    stopped the child's own tree only, and in the process-tree mode the escapee ran on
    until some later attempt returned normally, or the pool closed."""
    marker = f"62.{os.getpid()}{time.monotonic_ns() % 10**6}"
    done: Future[list[int]] = Future()
    with Pool("tests.support.escapees:escape_then_hang", size=1, containment=containment) as pool:
        task = pool.make_task(marker)
        task.hard_timeout_s = 1.0
        pool.execute(task, lambda result: done.set_result(sleeping(marker)))
        assert done.result(timeout=30) == [], "the escapee outlived its attempt's outcome"


@pytest.mark.timeout(60)
def test_a_forked_copy_that_comes_back_out_of_the_handler_ends_there(containment: str) -> None:
    """A handler forks, and the copy returns out of the handler into the pool's own
    code: it sent its value as the attempt's, then answered the next jobs in the
    child's place (process-tree mode), or its sweep killed the child (control groups:
    reported as a crash). The copy now ends as it comes back; the child answers."""
    with Pool("tests.support.escapees:copy_comes_back", size=1, containment=containment) as pool:
        child = pool.pids[0]
        for _ in range(3):
            assert pool.submit(0.3).result(timeout=30) == f"from the child {child}"
        assert pool.pids == [child]


# -- descriptors -----------------------------------------------------------------------------

D = "tests.support.leftover_descriptors:"


@pytest.mark.timeout(60)
def test_an_attempt_that_used_up_every_descriptor_is_swept_and_its_child_replaced(
    containment: str,
) -> None:
    """A handler started a process, opened files until none was left and returned. The
    sweep after it opens a file per process it looks at: it found no one, and looked
    again until the hard timeout ended a job that had returned. (A process the handler
    moved out of its tree, in a cgroup mode: the group sweep failed after the next job,
    which was charged with its "Too many open files".) Each child then starts with a
    descriptor it can give back for the sweep, and one left with none is replaced."""
    with Pool(
        D + "call", size=1, containment=containment, hard_timeout_s=20, max_open_files=256
    ) as pool:
        left = pool.submit("exhaust").result(timeout=30)
        assert left["opened"] > 200, left
        assert not still_running([left["stray"]]), "the process outlived its attempt"
        second = pool.submit("open_a_file").result(timeout=30)
        assert second != left["pid"], "the child with no descriptor free took another task"
        assert pool.submit("open_a_file").result(timeout=30) == second  # a sound one is kept


# -- the child's process state ---------------------------------------------------------------

S = "tests.support.process_state:call"


#: Each changes its child for the next job: put back, or the child replaced (True).
BREAKERS = {
    "close_stdout": True,
    "close_fd_1": True,
    "reconfigure_stdout": True,
    "ignore_every_signal": True,
    "block_every_signal": True,
    "lower_cpu_limit": True,
    "raw_thread": True,
    "siginterrupt_soft": False,
    "unregister_dump": False,
    "libc_ignores_soft": False,
    "pending_alarm": False,
    "pending_cpu_timer": False,
    "nonblocking_stdout": False,
    "ignore_sigchld": False,
    "chdir_elsewhere": False,
    "umask_everything": False,
    "pin_to_one_cpu": False,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("breaker", BREAKERS)
def test_an_attempt_that_changes_its_child_changes_no_other_job(breaker: str) -> None:
    """A handler closed sys.stdout (or descriptor 1): every later job on that child failed
    printing. One ignored (or blocked, or with ctypes or siginterrupt quietly changed)
    the soft signal: the next job got none and was killed at its hard deadline, its
    cleanup never run. A pending alarm killed the next job (``crashed``); a lowered CPU
    limit failed it (``cpu_limit``); stdout left non-blocking lost its output; SIGCHLD
    ignored made its ``subprocess.run`` return 0; a thread started with ``_thread`` read
    its arguments. A working directory, umask, priority or CPU affinity changed moved the
    next job's relative paths, made its files unreadable, slowed it, or pinned it to one
    core. What can be set back is, else the child is replaced."""

    def told_to_stop(pool: Pool) -> int:
        started = time.monotonic()
        with pytest.raises(AttemptFailed) as failed:
            pool.submit("print_and_wait_for_soft").result(timeout=30)
        assert failed.value.error_type == "sandboxq.errors.SoftTimeout", failed.value
        assert time.monotonic() - started < 5.0
        assert failed.value.pid is not None
        return failed.value.pid

    with Pool(S, size=1, soft_timeout_s=1.0, hard_timeout_s=20.0) as pool:
        clean = pool.submit("probe").result(timeout=10)
        broken = pool.submit(breaker).result(timeout=10)
        assert pool.submit("probe").result(timeout=10) == clean
        child = told_to_stop(pool)
        assert (child != broken) is BREAKERS[breaker], (broken, child)
        assert told_to_stop(pool) == child


@pytest.mark.timeout(60)
def test_a_nice_value_raised_by_an_attempt_does_not_slow_the_next_job() -> None:
    """Set back where the child may lower it (CAP_SYS_NICE), else the child is replaced:
    a new one has the fork server's."""
    with Pool(S, size=1) as pool:
        clean = pool.submit("probe").result(timeout=10)
        broken, may_lower = pool.submit("renice").result(timeout=10)
        assert pool.submit("probe").result(timeout=10) == clean
        replaced = pool.submit("pid").result(timeout=10) != broken
        assert replaced is not may_lower, (broken, may_lower)


# -- threads ---------------------------------------------------------------------------------

T = "tests.support.leftover_threads:"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("daemon", [False, True], ids=["thread", "daemon-thread"])
def test_a_thread_the_attempt_left_running_ends_with_its_child(daemon: bool) -> None:
    """A thread cannot be killed: the child that holds it is replaced before its next task,
    and it exits (its normal end would wait for a non-daemon thread forever)."""
    with Pool(T + "leave_threads", size=1, containment="process_tree") as pool:
        first = pool.submit(3, daemon).result(timeout=10)
        second = pool.submit(0).result(timeout=10)
        assert second != first
        wait_for(lambda: not still_running([first]), 10, "the replaced child to exit")
        assert pool.submit(0).result(timeout=10) == second  # no thread left: kept


@pytest.mark.timeout(30)
def test_keep_strays_keeps_the_threads_but_not_past_close() -> None:
    with Pool(T + "leave_threads", size=1, containment="process_tree", keep_strays=True) as pool:
        first = pool.submit(2).result(timeout=10)
        assert pool.submit(0).result(timeout=10) == first
    wait_for(lambda: not still_running([first]), 10, "the child to exit at close")
