"""The pool's fence guard: how fast it kills with the parent stopped, and what it costs.

    python bench/guard_bench.py [fence|cost|all] [--json OUT] [--quick]

- fence: a host process runs a pool whose child holds the GIL in one C call; the host
  says when the attempt's fence deadline is (about 0.3 s ahead), and is SIGSTOPped by
  this script, which reads the child's death on a pidfd. Figures: from the
  fence deadline to the child's death, median and max (target <= 50 ms; negative: the
  guard strikes a few ms early on purpose), and the time from the host's stop to the child
  being stopped with it.
- cost: the guard's CPU time per second of wall time while 64 attempts run (sleeping
  handlers, fence deadlines renewed every 0.5 s as a worker's heartbeat would), and how
  long after a SIGKILL of the guard a new one is started (target <= 100 ms) and reading
  the table.

No-op throughput with the guard and without it is an A/B of two source trees (this one
and the commit before the guard), run alternately; see the closing figures of the change.
The JSON goes to bench/results/guard.json.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402

from sandboxq.pool.kill import state  # noqa: E402

HOST = textwrap.dedent(
    """
    import sys, time
    from sandboxq import Pool
    from sandboxq.pool.attempt import Task
    rounds = int(sys.argv[1])
    with Pool("sandboxq.testing.handlers:hold_gil", size=1) as pool:
        for _ in range(rounds):
            done = []
            # The deadline goes with the task: the supervisor hands it to the guard before
            # the child starts (a later extend_fence could still be in its mailbox when
            # the bench stops this process).
            deadline = time.monotonic() + 0.5
            task = pool.execute(Task(b"[[], {}]", "json", fence_deadline=deadline), done.append)
            while not pool.running_pids().get(task):
                time.sleep(0.001)
            pid = pool.running_pids()[task]
            time.sleep(max(0.0, deadline - 0.3 - time.monotonic()))
            print(pid, deadline, flush=True)
            sys.stdin.readline()  # stopped and continued by the bench meanwhile
            while not done:
                time.sleep(0.001)
    """
)


def bench_fence(quick: bool = False) -> dict[str, Any]:
    rounds = 5 if quick else 20
    host = subprocess.Popen(
        [sys.executable, "-c", HOST, str(rounds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert host.stdin is not None and host.stdout is not None
    late_ms: list[float] = []
    paused_ms: list[float] = []
    try:
        for _ in range(rounds):
            pid_text, deadline_text = host.stdout.readline().split()
            child, deadline = int(pid_text), float(deadline_text)
            pidfd = os.pidfd_open(child)
            host.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            while state(child) not in (b"T", b"t", b"Z", b""):
                time.sleep(0.0005)
            paused_ms.append((time.monotonic() - stopped) * 1000)
            select.select([pidfd], [], [], 10)
            late_ms.append((time.monotonic() - deadline) * 1000)
            os.close(pidfd)
            host.send_signal(signal.SIGCONT)
            host.stdin.write("\n")
            host.stdin.flush()
        host.stdin.close()
        host.wait(30)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    print(f"  deadline → death, ms: {', '.join(f'{v:.1f}' for v in late_ms)}")
    return {
        "figures": [
            figures.figure(
                "parent stopped: fence deadline → child dead",
                late_ms,
                "ms",
                figures.Target("<=", 50),
                digits=1,
            ),
            figures.figure(
                "parent stopped: fence deadline → child dead, max",
                [max(late_ms)],
                "ms",
                figures.Target("<=", 50),
                digits=1,
            ),
            figures.figure("parent stopped → child stopped", paused_ms, "ms", digits=1),
        ]
    }


def bench_cost(quick: bool = False) -> dict[str, Any]:
    from sandboxq import Pool
    from sandboxq.models import Outcome
    from sandboxq.pool.attempt import Task

    size, seconds = 64, (3.0 if quick else 10.0)
    cpu_per_s: list[float] = []
    noticed_ms: list[float] = []
    restart_ms: list[float] = []
    with Pool("sandboxq.testing.handlers:sleep_forever", size=size) as pool:
        tasks = [
            pool.execute(Task(payload=b"[[], {}]", codec="json"), lambda _: None)
            for _ in range(size)
        ]
        while len(pool.running_pids()) < size:
            time.sleep(0.01)
        guard = pool._supervisor._guard
        for _ in range(1 if quick else 3):
            pid = guard.pid
            assert pid is not None
            t0, cpu0 = time.monotonic(), _cpu_s(pid)
            while (now := time.monotonic()) - t0 < seconds:
                for task in tasks:
                    pool.extend_fence(task, now + 60.0)  # the heartbeat's renewals
                time.sleep(0.5)
            cpu_per_s.append((_cpu_s(pid) - cpu0) / (time.monotonic() - t0) * 1000)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            while guard.pid == pid:
                time.sleep(0.0002)
            noticed_ms.append((time.monotonic() - killed) * 1000)
            while not guard.ready():
                time.sleep(0.0005)
            restart_ms.append((time.monotonic() - killed) * 1000)
        for task in tasks:
            pool.kill(task, Outcome.CANCELLED, "the bench is over")
    return {
        "figures": [
            figures.figure(f"guard CPU with {size} running attempts", cpu_per_s, "ms/s", digits=2),
            figures.figure(
                "guard killed → a new one started", noticed_ms, "ms", figures.Target("<=", 100)
            ),
            figures.figure("guard killed → a new guard reading the table", restart_ms, "ms"),
        ]
    }


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    figures.run_sections(
        __file__,
        figures.quick_only({"fence": bench_fence, "cost": bench_cost}),
        HERE / "results" / "guard.json",
    )
