"""The worker and its fork server die together (a ``kill -9`` of the worker's process
group): the pool's guard, in a session of its own, kills everything every child started,
daemons included, and in a cgroup mode removes the pool's groups at once rather than
leaving them for the next pool on the machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandboxq.pool import cgroups
from sandboxq.pool.containment import probe
from sandboxq.testing.processes import still_running
from sandboxq.testing.waiting import wait_for
from tests.support.everything_killed import end_worker

MODE, WHY = probe()

WORKER = textwrap.dedent(
    """
    import sys, time
    from sandboxq import Pool
    pool = Pool("sandboxq.testing.handlers:daemonize_grandchild", size=1,
                containment=sys.argv[2])
    pool.submit(sys.argv[1], "hang")
    while not open(sys.argv[1]).read().strip():
        time.sleep(0.01)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def _groups_of(pid: int) -> list[Path]:
    found: list[Path] = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            if c in cgroups.V1_CONTROLLERS:
                here = Path("/sys/fs/cgroup", c, path.lstrip("/"))
                found += here.glob(f"{cgroups.PREFIX}{pid}.*")
    return found


@pytest.mark.timeout(60)
def test_a_killed_worker_group_leaves_no_daemon_and_no_group(
    containment: str, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    pid_file.write_text("")
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(pid_file), containment],
        stdout=subprocess.PIPE,
        start_new_session=True,  # its own process group: the worker and its fork server
    )
    daemon: list[int] = []
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == b"ready"
        daemon = [int(p) for p in pid_file.read_text().split()]
        assert daemon and still_running(daemon)
        if containment == "auto" and MODE != "process_tree":
            assert _groups_of(worker.pid), "expected the pool's groups"
        os.killpg(worker.pid, signal.SIGKILL)  # the worker and its fork server at once
        worker.wait()
        wait_for(lambda: not still_running(daemon), 10, "the daemon to die with the worker")
        wait_for(lambda: not _groups_of(worker.pid), 10, "the dead pool's groups to go")
    finally:
        end_worker(worker, daemon)
