"""``pid_namespace=True``: each child runs in a PID namespace of its own
(pid_namespace.py), so whatever a handler starts dies with its child, even when the
worker, its fork server and its guard all die at once and no process of the pool is left
to kill anything; and a child in one ends its attempts exactly as one without."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest

from sandboxq import Pool
from sandboxq.models import Outcome
from sandboxq.pool import cgroups
from sandboxq.pool.attempt import AttemptResult
from sandboxq.pool.kill import state
from sandboxq.pool.privileges import pid_namespace_refused
from sandboxq.testing.processes import still_running
from sandboxq.testing.waiting import wait_for
from tests.support.everything_killed import everything_killed

H = "sandboxq.testing.handlers:"
NS = "tests.support.pidns:"

REFUSED = pid_namespace_refused()
pytestmark = pytest.mark.skipif(REFUSED is not None, reason=f"no PID namespace here: {REFUSED}")


def _not_root() -> list[str]:
    """A command prefix that runs a process as uid 1000 with no capability (in a user
    namespace of its own, where root's files are its own): a worker that is not root."""
    prefix = ["unshare", "--user", "--map-user=1000", "--map-group=1000"]
    try:
        said = subprocess.run(
            [*prefix, sys.executable, "-c", "import os; print(os.geteuid())"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError as exc:
        pytest.skip(f"cannot run a process as another user here: {exc}")
    if said.stdout.strip() != "1000":
        pytest.skip(f"cannot run a process as another user here: {said.stderr.strip()}")
    return prefix


@pytest.mark.timeout(60)
def test_a_daemon_dies_when_the_worker_its_fork_server_and_its_guard_all_die(
    containment: str, tmp_path: Path
) -> None:
    with everything_killed(containment, tmp_path, "on") as pids:
        wait_for(lambda: not still_running(pids), 10, "the daemon and its child to die")


@pytest.mark.timeout(60)
def test_a_worker_that_is_not_root_gets_the_same_through_a_user_namespace(
    tmp_path: Path,
) -> None:
    prefix = tuple(_not_root())
    with everything_killed("process_tree", tmp_path, "on", prefix) as pids:
        wait_for(lambda: not still_running(pids), 10, "the daemon and its child to die")
    seen = subprocess.run(
        [*prefix, sys.executable, "-c", NOT_ROOT],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert seen[0] == "a PID namespace per child (in a user namespace)", seen
    assert seen[1] == "2 1000 True", seen  # its pid, its uid, a thread of its own ran
    assert seen[2] == "0000000000000000", seen  # no capability, in any namespace


NOT_ROOT = textwrap.dedent(
    """
    from sandboxq import Pool
    with Pool("tests.support.pidns:what_i_see", 1, containment="process_tree",
              pid_namespace=True) as pool:
        print(*pool.protections)
        seen = pool.submit().result(timeout=30)
        child = pool._supervisor._children[0].pid
        with open(f"/proc/{child}/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:")).split()[1]
    print(seen["pid"], seen["uid"], seen["thread_ran"])
    print(caps)
    """
)


@pytest.mark.timeout(60)
def test_without_a_namespace_the_daemon_outlives_them(tmp_path: Path) -> None:
    """The same kill with ``pid_namespace`` off: the child is left stopped and the daemon
    runs on (what the README's containment table says of that mode)."""
    with everything_killed("process_tree", tmp_path, "off") as (daemon, child, _):
        wait_for(lambda: state(child) == b"T", 10, "the child to be stopped")
        assert still_running([daemon])


@pytest.mark.timeout(60)
def test_the_handler_sees_its_namespace_and_only_it(containment: str) -> None:
    with Pool(NS + "what_i_see", 1, containment=containment, pid_namespace=True) as pool:
        assert "a PID namespace per child" in pool.protections
        seen = pool.submit().result(timeout=30)
        child = pool._supervisor._children[0]
        # The handler is pid 2 (its namespace's first process is the reaper); its /proc
        # shows that namespace only, and a process it starts gets the next pid there.
        assert (seen["pid"], seen["ppid"], seen["nspid"]) == (2, 1, [2])
        assert seen["proc"][:2] == [1, 2] and len(seen["proc"]) <= 4, seen["proc"]
        assert seen["started"][1] == 2 and seen["started"][0] > 2
        assert seen["thread_ran"]  # the reason the handler is not the namespace's maker
        # The pool signals and samples that process, under its own pid here.
        assert child.pid != child.process.pid
        with open(f"/proc/{child.pid}/status") as f:
            assert f"\t{child.pid}\t2" in next(line for line in f if line.startswith("NSpid:"))


def _ending(pool: Pool, *args: Any) -> AttemptResult:
    from concurrent.futures import Future

    done: Future[AttemptResult] = Future()
    pool.execute(pool.make_task(*args), done.set_result)
    return done.result(timeout=30)


ENDINGS = [
    ("returns", H + "echo", (7,)),
    ("raises", H + "raise_unpicklable", ()),
    ("os._exit(3)", H + "os_exit", (3,)),
    ("sys.exit(4)", H + "sys_exit", (4,)),
    ("segfault", H + "segfault", ()),
    ("abort", H + "abort", ()),
    ("SIGKILL to itself", NS + "kill_myself", (int(signal.SIGKILL),)),
    ("SIGTERM to itself", NS + "kill_myself", (int(signal.SIGTERM),)),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "handler", "args"), ENDINGS, ids=[e[0] for e in ENDINGS])
def test_a_child_in_a_namespace_ends_its_attempt_as_one_without(
    how: str, handler: str, args: tuple[Any, ...]
) -> None:
    """The outcome, its cause and its exit code are the same with and without: the
    process the pool started ends as the handler's process did."""
    endings = {}
    for namespace in (True, False):
        with Pool(handler, 1, containment="process_tree", pid_namespace=namespace) as pool:
            r = _ending(pool, *args)
            cause = r.cause.replace(str(r.pid), "PID")
            endings[namespace] = (r.outcome, r.exitcode, r.signal, cause)
    assert endings[True] == endings[False], how


@pytest.mark.timeout(60)
def test_soft_and_hard_timeouts_and_stacks_reach_the_handler(containment: str) -> None:
    with Pool(
        H + "ignore_signals",
        1,
        containment=containment,
        pid_namespace=True,
        soft_timeout_s=0.3,
        hard_timeout_s=1.0,
    ) as pool:
        r = _ending(pool)
    assert r.outcome is Outcome.HARD_TIMEOUT, r.cause
    assert r.traceback and "ignore_signals" in r.traceback  # its stack, dumped on request
    with Pool(
        H + "sleep_forever", 1, containment=containment, pid_namespace=True, soft_timeout_s=0.3
    ) as pool:
        r = _ending(pool)
    assert r.outcome is Outcome.SOFT_TIMEOUT, r.cause


@pytest.mark.alone  # a kill's lateness, a fork burst
@pytest.mark.timeout(60)
def test_a_burst_is_killed_on_time_and_leaves_no_zombie(containment: str, tmp_path: Path) -> None:
    with Pool(
        H + "fork_burst", 1, containment=containment, pid_namespace=True, hard_timeout_s=1.0
    ) as pool:
        r = _ending(pool, str(tmp_path / "pids"), 200, "hang")
        assert r.outcome is Outcome.HARD_TIMEOUT, r.cause
        me = psutil.Process()

        def zombies() -> list[int]:
            found = []
            for proc in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        found.append(proc.pid)
            return found

        wait_for(lambda: not zombies() and len(pool._supervisor._children) == 1, 10, "no zombie")
        assert pool.submit(str(tmp_path / "again"), 3, "return").result(timeout=30) == "return"


@pytest.mark.timeout(60)
def test_a_memory_limit_holds_in_a_namespace(containment: str) -> None:
    with Pool(
        H + "grow_memory", 1, containment=containment, pid_namespace=True, max_memory_mb=60
    ) as pool:
        r = _ending(pool)
    assert r.outcome is Outcome.MEMORY_LIMIT, r.cause


@pytest.mark.timeout(60)
def test_what_the_handler_prints_is_captured_and_its_pipes_end_with_it() -> None:
    """Only the handler's process holds the child's stdout and stderr: the outer process
    and the reaper close theirs, or a replaced child's pipes would never end."""
    with Pool(
        "tests.support.where:print_and_return",
        1,
        containment="process_tree",
        pid_namespace=True,
        max_jobs_per_child=1,
    ) as pool:
        for n in range(3):
            r = _ending(pool, f"hello {n}", 1, f"oops {n}")
            assert r.outcome is Outcome.OK, r.cause
            assert r.output is not None and f"hello {n}" in r.output and f"oops {n}" in r.output

        # The child that ran the last job retires (max_jobs_per_child): its replacement's.
        def fresh() -> int | None:
            kids = pool._supervisor._children
            ready = [c for c in kids if c.ready and not c.retiring and not c.recycle]
            return ready[0].process.pid if ready else None

        outer = wait_for(fresh, 10, "the replacement child")

        def held() -> list[str]:
            return [os.readlink(f"/proc/{outer}/fd/{fd}") for fd in os.listdir(f"/proc/{outer}/fd")]

        # It closes them right after its fork: looked for, not assumed done by now.
        wait_for(lambda: len(held()) == 1, 5, f"the outer to hold one pipe only: {held()}")
        assert held()[0].startswith("pipe:")  # the reaper's word of how the child ended


@pytest.mark.timeout(60)
def test_a_handler_cannot_end_its_namespace_early(containment: str) -> None:
    """Its namespace's first process ignores every signal the namespace sends it: the
    handler can neither end the namespace (and what it holds) nor break the next job."""
    with Pool(NS + "kill_the_reaper", 1, containment=containment, pid_namespace=True) as pool:
        assert pool.submit().result(timeout=30) is True
        child = pool._supervisor._children[0]
        assert pool.submit().result(timeout=30) is True
        assert pool._supervisor._children == [child]  # the same child, its reaper alive


REFUSED_HERE = textwrap.dedent(
    """
    import os, sys
    from sandboxq import Pool
    from sandboxq.errors import ConfigError
    try:
        Pool("sandboxq.testing.handlers:echo", 1, containment=sys.argv[1], pid_namespace=True)
    except ConfigError as exc:
        print(os.getpid())
        print(exc)
    """
)


@pytest.mark.timeout(60)
def test_a_worker_refused_a_namespace_says_why_and_leaves_no_group(containment: str) -> None:
    """Root without CAP_SYS_ADMIN (a container that drops it): the pool refuses to start,
    naming what the machine refused and what it needs, and the groups it had made for
    itself before it knew are gone with it."""
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv here to drop CAP_SYS_ADMIN")
    without = ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin"]
    said = subprocess.run(
        [*without, sys.executable, "-c", REFUSED_HERE, containment],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert len(said) == 2, said
    pid, message = int(said[0]), said[1]
    assert "pid_namespace=True needs a PID namespace per child" in message
    assert "Operation not permitted" in message and "CAP_SYS_ADMIN" in message
    # os.walk, not a glob: the pools of other tests come and go beside this one, and a
    # glob raised FileNotFoundError on a group removed while it walked
    mine = f"{cgroups.PREFIX}{pid}."
    left = [
        os.path.join(root, name)
        for root, dirs, _ in os.walk("/sys/fs/cgroup")
        for name in dirs
        if name.startswith(mine)
    ]
    assert left == [], left
