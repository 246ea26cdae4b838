"""Cleanup at pool start touches only the dead: a pool's control groups are stale only
when the lock its owner holds for its whole life is free, never because a pid lookup
failed (an owner in another PID namespace, or hidden by /proc's hidepid, looks dead)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sandboxq import Pool
from sandboxq.pool import cgroups
from sandboxq.pool.containment import probe
from sandboxq.testing.processes import still_running

H = "sandboxq.testing.handlers:"
MODE, WHY = probe()
needs_cgroup_v1 = pytest.mark.skipif(MODE != "cgroup_v1", reason=f"not in cgroup v1 mode: {WHY}")

#: A pool in a PID namespace of its own, with its own /proc: its pid (1) names another
#: process here, with another start time.
OTHER_NAMESPACE_POOL = textwrap.dedent(
    """
    import sys, time
    from sandboxq import Pool
    pool = Pool("sandboxq.testing.handlers:daemonize_grandchild", size=1)
    pool.submit(sys.argv[1], "hang")
    while not open(sys.argv[1]).read().strip():
        time.sleep(0.01)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def _pool_groups() -> set[Path]:
    found = set()
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            if c in cgroups.V1_CONTROLLERS:
                found |= set(Path("/sys/fs/cgroup", c, path.lstrip("/")).glob(cgroups.PREFIX + "*"))
    return found


def _procs(group: Path) -> set[int]:
    """The processes in ``group``'s child groups (none once it is gone)."""
    found: set[int] = set()
    for child in group.glob("child-*"):
        with contextlib.suppress(OSError):
            found |= {int(p) for p in (child / "cgroup.procs").read_text().split()}
    return found


@pytest.fixture
def other_namespace_pool(tmp_path: Path) -> Iterator[tuple[set[Path], list[int]]]:
    """A live pool in another PID namespace, its job running: (its groups, the pids of
    what its job started, as seen from here)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a PID namespace")
    pid_file = tmp_path / "pids"
    pid_file.write_text("")
    before = _pool_groups()
    owner = subprocess.Popen(
        [unshare, "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c",
         OTHER_NAMESPACE_POOL, str(pid_file)],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == b"ready"
        # The daemon's pid as recorded is the namespace's: find it here by its groups.
        # Its pid there is 1, as is that of any pool another test starts in a namespace
        # beside this one: its groups are those whose processes run below ``owner``.
        below = {p.pid for p in psutil.Process(owner.pid).children(recursive=True)}
        groups = {
            g
            for g in _pool_groups() - before
            if g.name.startswith(f"{cgroups.PREFIX}1.") and _procs(g) & below
        }
        assert groups, "the other pool made no groups"
        inside = [p for g in groups if "pids" in g.parts for p in _procs(g)]
        assert len(inside) >= 2, "expected the child and its daemon in the other pool's group"
        yield groups, inside
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
        for pid in still_running(locals().get("inside", [])):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@needs_cgroup_v1
@pytest.mark.timeout(60)
def test_a_live_pool_in_another_pid_namespace_is_left_alone(
    other_namespace_pool: tuple[set[Path], list[int]],
) -> None:
    groups, inside = other_namespace_pool
    with Pool(H + "echo", 1) as pool:
        assert pool.submit(1).result(timeout=10) == 1
    assert still_running(inside) == inside, "a pool start killed another live pool's job"
    assert all(g.exists() for g in groups), "a pool start removed another live pool's groups"


@needs_cgroup_v1
@pytest.mark.timeout(60)
def test_an_unlocked_group_of_an_older_version_is_removed_only_once_empty() -> None:
    # Named as versions without locks named groups, owner "dead" by its pid: its process
    # may still be a live pool's job, so a start kills nothing, and removes it once empty.
    own = dict(
        (c, path)
        for line in Path("/proc/self/cgroup").read_text().splitlines()
        for _, controllers, path in [line.split(":", 2)]
        for c in controllers.split(",")
    )
    group = Path("/sys/fs/cgroup/pids", own["pids"].lstrip("/"), f"{cgroups.PREFIX}999999999.1.1")
    (group / "child-1").mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (group / "child-1" / "cgroup.procs").write_text(str(sleeper.pid))
        with Pool(H + "echo", 1) as pool:
            assert pool.submit(1).result(timeout=10) == 1
        assert sleeper.poll() is None, "a pool start killed a process of an unlocked group"
        assert group.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    with Pool(H + "echo", 1) as pool:
        assert pool.submit(2).result(timeout=10) == 2
    assert not group.exists(), "an empty unlocked group outlived the next pool start"
