"""A deadline kill reports its outcome once nothing of the attempt can run again, without
waiting for the kernel to tear its processes down, and never holds up another child's
deadline; the processes are reaped later, and no zombie is left under the worker."""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path

import psutil
import pytest

from sandboxq import Pool
from sandboxq.models import Outcome
from sandboxq.pool.attempt import AttemptResult
from sandboxq.testing.processes import still_running
from sandboxq.testing.waiting import wait_for

pytestmark = pytest.mark.alone  # a kill's lateness in milliseconds, beside a fork burst

H = "sandboxq.testing.handlers:"
BURST = 200
#: The burst's hard timeout: long enough for all of it to be forked first.
BURST_HARD_S = 1.5
#: The other child's deadline comes this long after the burst's: the burst's teardown
#: took the kernel 140 to 160 ms here (quiet), and the supervisor used to wait inside it;
#: the kill itself (freezing 200 tasks, or stopping them) still takes up to tens of ms
#: of the supervisor's time on a loaded machine, before this gap runs out.
GAP_S = 0.05
#: How late the other child's kill may land (a loaded, shared machine: generous, but far
#: below a teardown the supervisor would wait for).
LATE_S = 0.08


def _recorded(pid_file: Path) -> list[int]:
    return [int(p) for p in pid_file.read_text().split()] if pid_file.exists() else []


def _zombies_below(pid: int) -> list[int]:
    found = []
    for proc in psutil.Process(pid).children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            pass
    return found


@pytest.mark.timeout(60)
def test_a_burst_teardown_delays_no_other_deadline(containment: str, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    with Pool(H + "call", 2, containment=containment) as pool:
        burst: Future[tuple[AttemptResult, list[int]]] = Future()
        other: Future[AttemptResult] = Future()
        bursting = pool.make_task("fork_burst", str(pid_file), BURST, "hang")
        bursting.hard_timeout_s = BURST_HARD_S
        sleeping = pool.make_task("sleep_forever")
        sleeping.hard_timeout_s = BURST_HARD_S + GAP_S
        pool.execute(bursting, lambda r: burst.set_result((r, still_running(_recorded(pid_file)))))
        pool.execute(sleeping, other.set_result)
        result, left = burst.result(timeout=30)
        assert result.outcome is Outcome.HARD_TIMEOUT, result.cause
        assert len(_recorded(pid_file)) == BURST, "the burst was not all forked in time"
        assert not left, f"{len(left)} of the burst could still run when the outcome came"
        late = other.result(timeout=30)
        assert late.outcome is Outcome.HARD_TIMEOUT, late.cause
        assert late.kill_overshoot_s is not None and late.kill_overshoot_s < LATE_S, (
            f"the other child's kill landed {late.kill_overshoot_s:.3f} s late"
        )
        # Reaped later, off the supervisor's path: nothing of the burst stays a zombie.
        wait_for(lambda: not _zombies_below(os.getpid()), 10, "the burst to be reaped")
        assert pool.submit("echo", 1).result(timeout=30) == 1  # the pool serves on
