"""The pool outlives its own helpers (design invariant 11): the fork server and the resource
tracker may be SIGKILLed at any moment. The pool notices at once, starts a fresh fork
server and fresh children, and charges no handler: the attempts that were running end
as ``interrupted`` with a cause that names what died, never as an exit code the handler
did not give."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import multiprocess
import pytest

from sandboxq import Pool
from sandboxq.errors import PoolBroken
from sandboxq.models import Outcome
from sandboxq.pool import launch, server
from sandboxq.pool.attempt import AttemptResult
from sandboxq.pool.server import MAX_DEATHS
from sandboxq.testing.waiting import wait_for

H = "sandboxq.testing.handlers:"


def start_running(pool: Pool, marker: Path) -> Future[AttemptResult]:
    done: Future[AttemptResult] = Future()
    task = pool.make_task(str(marker))
    pool.execute(task, done.set_result)
    wait_for(marker.exists, 10, "the attempt to start")
    return done


def kill_fork_server() -> int:
    pid = server.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.timeout(30)
def test_fork_server_death_interrupts_without_blame_and_the_pool_recovers(
    tmp_path: Path, pid_namespace: bool
) -> None:
    with Pool(H + "mark_then_hang", size=2, pid_namespace=pid_namespace) as pool:
        first = start_running(pool, tmp_path / "a")
        second = start_running(pool, tmp_path / "b")
        old = pool.pids
        dead = kill_fork_server()
        for done in (first, second):
            result = done.result(timeout=10)
            assert result.outcome is Outcome.INTERRUPTED, result.cause
            assert result.exitcode is None
            assert "fork server" in result.cause and str(dead) in result.cause
        third = start_running(pool, tmp_path / "c")  # runs: a fresh server, fresh children
        assert server.pid() not in (None, dead)
        assert not set(old) & set(pool.pids)
        assert pool._supervisor.broken is None
        pool.kill(running_task_id(pool), Outcome.CANCELLED, "done")
        assert third.result(timeout=10).outcome is Outcome.CANCELLED


def running_task_id(pool: Pool) -> int:
    return next(iter(pool.running_pids()))


@pytest.mark.timeout(30)
def test_a_fork_server_that_keeps_dying_breaks_the_pool_with_the_cause() -> None:
    with Pool(H + "mark_then_hang", size=1) as pool:
        killed: set[int] = set()

        def fresh_server_or_broken() -> int | str | None:
            if pool._supervisor.broken is not None:
                return "broken"
            pid = server.pid()
            return pid if pid is not None and pid not in killed and pool.pids else None

        while (got := wait_for(fresh_server_or_broken, 10, "a fresh fork server")) != "broken":
            assert isinstance(got, int)
            killed.add(got)
            os.kill(got, signal.SIGKILL)
        assert len(killed) == MAX_DEATHS
        assert "fork server" in str(pool.broken)
        with pytest.raises(PoolBroken):
            pool.submit("x")


@pytest.mark.timeout(30)
def test_resource_tracker_death_does_not_disturb_the_pool(tmp_path: Path) -> None:
    from multiprocess import resource_tracker

    with Pool(H + "echo", size=1, max_jobs_per_child=1) as pool:
        assert pool.submit(1).result(timeout=10) == 1
        tracker = resource_tracker._resource_tracker._pid
        if tracker is not None:
            os.kill(tracker, signal.SIGKILL)
        for i in range(3):  # each job needs a fresh child: spawning still works
            assert pool.submit(i).result(timeout=10) == i


HELPER_MODULE = """
import os, subprocess, sys
_helper = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(120)"],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)
with open(os.environ["HELPER_PIDS"], "a") as f:
    f.write(f"{os.getpid()} {_helper.pid}\\n")

def run(how):
    if how == "exit":
        os._exit(3)
    return how
"""

HELPER_PARENT = """
import os, sys, time
import psutil
sys.path.insert(0, sys.argv[1])
from sandboxq import Pool
from sandboxq.pool import server
with Pool("helper_module:run", size=1) as pool:
    rows = [line.split() for line in open(os.environ["HELPER_PIDS"]).read().splitlines()]
    in_server = [int(h) for importer, h in rows if int(importer) == server.pid()]
    assert in_server, rows
    assert pool.submit("exit").exception(timeout=10) is not None  # a child dies on its own
    assert pool.submit("ok").result(timeout=10) == "ok"
    assert all(psutil.pid_exists(h) for h in in_server), "the helper was swept"
print("ok", flush=True)
"""


@pytest.mark.timeout(30)
def test_a_helper_the_processor_module_starts_at_import_is_not_an_orphan(
    tmp_path: Path,
) -> None:
    """The orphan sweep below the fork server spares what the fork server started itself
    (a module preloaded there that starts a helper at import). In a process of its own,
    so that the fork server is fresh and preloads the module."""
    import subprocess
    import sys

    pid_file = tmp_path / "helpers"
    (tmp_path / "helper_module.py").write_text(HELPER_MODULE)
    env = {**os.environ, "HELPER_PIDS": str(pid_file)}
    try:
        out = subprocess.run(
            [sys.executable, "-c", HELPER_PARENT, str(tmp_path)],
            capture_output=True,
            timeout=25,
            env=env,
            check=False,
        )
        assert out.returncode == 0, out.stderr.decode()[-2000:]
        assert out.stdout.strip() == b"ok"
    finally:
        for line in pid_file.read_text().splitlines() if pid_file.exists() else []:
            try:
                os.kill(int(line.split()[1]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def blocked_in(thread: threading.Thread, function: str) -> bool:
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


@pytest.mark.timeout(30)
def test_a_fork_server_dying_mid_launch_is_retried() -> None:
    """The fork server dies after it took a launch request and before it sent the new pid
    back (multiprocess raises EOFError there, not OSError): the launch is tried again
    through a fresh fork server instead of crashing the thread that starts children."""
    ctx = multiprocess.get_context("forkserver")
    warm = ctx.Process(target=time.sleep, args=(0,))
    launch.start(warm)  # a fork server is running
    warm.join()
    dead = server.pid()
    assert dead is not None
    os.kill(dead, signal.SIGSTOP)  # it accepts nothing more until it is killed
    process = ctx.Process(target=time.sleep, args=(0,))
    failed: list[BaseException] = []

    def start() -> None:
        try:
            launch.start_retrying(process, 4)
        except BaseException as exc:
            failed.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    wait_for(lambda: blocked_in(starter, "read_signed"), 10, "the launch to wait for a pid")
    os.kill(dead, signal.SIGKILL)
    starter.join(10)
    assert not starter.is_alive()
    assert failed == []
    process.join(10)
    assert process.exitcode == 0
    assert server.pid() not in (None, dead)
