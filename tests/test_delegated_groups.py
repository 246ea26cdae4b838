"""A worker that is not root, in control groups delegated to its user (an administrator's
``chown``, systemd's ``Delegate=``): its pool makes the children's groups there, and with
``pid_namespace=True`` each child, though it runs in a user namespace of its own, still
joins its group, so its limits (processes, memory) hold, and what it starts dies with it
when the worker, its fork server and its guard all die.

The worker runs as uid 1000 (``tests/support/delegated.py``) in groups this test makes
under the test's own, in each cgroup v1 hierarchy the pool uses; where there are none (a
machine with cgroup v2 only, or not root) the tests skip and say why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxq.pool import cgroups, containment
from sandboxq.pool.privileges import pid_namespace_refused
from sandboxq.testing.processes import still_running
from sandboxq.testing.waiting import wait_for
from tests.support.everything_killed import everything_killed

UID = 1000
DELEGATED = str(Path(__file__).parent / "support" / "delegated.py")


@pytest.fixture
def delegated() -> Iterator[dict[str, str]]:
    """Groups owned by UID, one per hierarchy (controller -> directory); afterwards,
    everything in them killed and every group below them removed."""
    if os.geteuid() != 0:
        pytest.skip("making groups for another user needs root")
    try:
        pool_dirs = containment._pool_dirs(1, "/proc/self/mountinfo", "/proc/self/cgroup")
    except (OSError, containment._Unusable) as exc:
        pytest.skip(f"no cgroup v1 hierarchies to delegate here: {exc}")
    name = f"delegated-{uuid.uuid4().hex[:8]}"
    dirs = {c: os.path.join(os.path.dirname(d), name) for c, d in pool_dirs.items()}
    try:
        for directory in dirs.values():
            os.mkdir(directory)
            for entry in [directory, *(os.path.join(directory, f) for f in os.listdir(directory))]:
                os.chown(entry, UID, UID)
    except OSError as exc:
        _remove(dirs)
        pytest.skip(f"cannot make groups for uid {UID} here: {exc}")
    try:
        yield dirs
    finally:
        _remove(dirs)


def _remove(dirs: dict[str, str]) -> None:
    """Kill and remove the pools' groups left below ``dirs``, then ``dirs`` (a pool that
    is still ending may be removing its own meanwhile, hierarchy by hierarchy)."""
    deadline = time.monotonic() + 10.0
    while True:
        pools = {
            name
            for directory in dirs.values()
            if os.path.isdir(directory)
            for name in os.listdir(directory)
            if name.startswith(cgroups.PREFIX)
        }
        for pool in pools:
            cgroups.remove_tree({c: os.path.join(d, pool) for c, d in dirs.items()}, 1.0)
        if cgroups.remove_tree(dirs, 1.0):
            return
        if time.monotonic() >= deadline:
            left = {d: cgroups.read_pids(os.path.join(d, "cgroup.procs")) for d in dirs.values()}
            raise AssertionError(f"groups left, with these processes in them: {left}")


def as_delegated_user(dirs: dict[str, str]) -> tuple[str, ...]:
    """The command prefix that runs what follows as UID, in the groups ``dirs``."""
    return (
        "unshare", "--mount", "--propagation", "private",
        sys.executable, DELEGATED, str(UID), json.dumps(list(dirs.values())), "--",
    )  # fmt: skip


@pytest.fixture
def shared_directory() -> Iterator[Path]:
    """A directory UID can write in: the pid file of the handler's daemon goes there."""
    directory = Path(tempfile.mkdtemp(prefix="sandboxq-delegated-", dir="/tmp"))
    directory.chmod(0o777)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


SEEN = textwrap.dedent(
    """
    import os
    from concurrent.futures import Future
    from sandboxq import Pool
    with Pool("sandboxq.testing.handlers:fork_bomb_until_refused", 1, containment="cgroup",
              pid_namespace=True, max_processes=20, hard_timeout_s=30) as pool:
        print(pool.containment, *pool.protections, sep="|")
        done = Future()
        pool.execute(pool.make_task(10_000), done.set_result)
        result = done.result(timeout=60)
        with open(f"/proc/{result.pid}/cgroup") as f:  # the handler's process, seen from here
            print(*sorted(line.strip() for line in f), sep="|")
        error = result.error
        said = error.message.splitlines()[0] if error else ""  # more than one may be refused
        print(os.getuid(), result.outcome, error and error.type_name, said, sep="|")
    with Pool("sandboxq.testing.handlers:grow_memory", 1, containment="cgroup",
              pid_namespace=True, max_memory_mb=96, hard_timeout_s=30) as pool:
        done = Future()
        pool.execute(pool.make_task(16, 0.001), done.set_result)
        result = done.result(timeout=60)
        print(result.outcome, result.cause, sep="|")
    """
)


@pytest.mark.timeout(90)
def test_a_child_in_a_user_and_pid_namespace_joins_its_delegated_group_and_its_limits_hold(
    delegated: dict[str, str],
) -> None:
    if (why := pid_namespace_refused()) is not None:
        pytest.skip(f"no PID namespace here: {why}")
    done = subprocess.run(
        [*as_delegated_user(delegated), sys.executable, "-c", SEEN],
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    mode, groups, ran, memory = done.stdout.splitlines()
    assert mode.split("|")[0] == "cgroup_v1", mode
    assert "a PID namespace per child (in a user namespace)" in mode.split("|"), mode
    # The child's group in each hierarchy: its own, below its pool's, below the delegated.
    name = os.path.basename(next(iter(delegated.values())))
    for line in groups.split("|"):
        path = line.split(":", 2)[2]
        if line.split(":")[1] in delegated:
            assert f"/{name}/{cgroups.PREFIX}" in path and "/child-" in path, groups
    uid, outcome, kind, message = ran.split("|", 3)
    assert (uid, outcome) == (str(UID), "error"), ran
    # Its pids limit held from inside the namespaces: the bomb was refused at about 20
    # processes ("fork refused: Resource temporarily unavailable after N processes").
    assert kind.endswith("ForkRefused"), ran
    assert int(message.rsplit("after ", 1)[1].split()[0]) <= 40, ran
    # And its memory limit: the kernel OOM-killed it in its group.
    outcome, cause = memory.split("|", 1)
    assert outcome == "memory_limit" and "OOM-killed" in cause, memory


@pytest.mark.timeout(90)
def test_a_daemon_dies_with_the_worker_its_fork_server_and_its_guard(
    delegated: dict[str, str], shared_directory: Path
) -> None:
    if (why := pid_namespace_refused()) is not None:
        pytest.skip(f"no PID namespace here: {why}")
    with everything_killed("cgroup", shared_directory, "on", as_delegated_user(delegated)) as pids:
        wait_for(lambda: not still_running(pids), 10, "the daemon and its child to die")
