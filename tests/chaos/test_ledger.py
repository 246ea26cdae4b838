"""The ledger the chaos tests judge by must itself be able to fail: real children running
one job at once are caught, one after the other are not."""

from __future__ import annotations

import os
import signal
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from sandboxq import Pool
from sandboxq.testing.waiting import wait_for
from tests.support.ledger import overlaps, read_ledger

pytestmark = pytest.mark.timeout(60)

LEDGER_JOB = "tests.support.ledger:ledger_job"


def test_two_children_running_one_job_at_once_are_caught(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    with Pool(LEDGER_JOB, 2) as pool:
        both = [pool.submit(str(ledger), "same", 0.5) for _ in range(2)]
        assert [f.result(timeout=20) for f in both] == ["same", "same"]
        pool.submit(str(ledger), "other", 0.1).result(timeout=20)
        pool.submit(str(ledger), "other", 0.1).result(timeout=20)
    runs = read_ledger(ledger)
    assert len(runs["same"]) == 2 and all(e.finished for e in runs["same"])
    ((first, second),) = overlaps(runs)  # "other" ran twice, one after the other: fine
    assert first.key == second.key == "same" and first.pid != second.pid


def started(pool: Pool, ledger: Path, key: str, seconds: float) -> tuple[Future[Any], int]:
    """Submit ledger job ``key``; once it runs: its future and the pid of its child."""
    future = pool.submit(str(ledger), key, seconds)
    # The supervisor marks an attempt running just after the child may have started it:
    # wait for both before asking which pid runs it.
    wait_for(
        lambda: key in read_ledger(ledger) and pool.running_pids(), 10, f"the {key} run to start"
    )
    (pid,) = pool.running_pids().values()
    return future, pid


def test_a_frozen_execution_that_resumes_is_caught_a_killed_one_is_not(tmp_path: Path) -> None:
    """A frozen child that carries on after another took over its job overlaps it; a child
    killed before the other started does not."""
    ledger = tmp_path / "ledger"
    with Pool(LEDGER_JOB, 2) as pool:
        frozen, pid = started(pool, ledger, "thawed", 1.0)
        os.kill(pid, signal.SIGSTOP)
        pool.submit(str(ledger), "thawed", 0.2).result(timeout=20)
        os.kill(pid, signal.SIGCONT)
        frozen.result(timeout=20)

        killed, pid = started(pool, ledger, "killed", 5.0)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(Exception, match="SIGKILL"):
            killed.result(timeout=20)
        # The killed child is dead by now: whatever it logged comes before the next run.
        pool.submit(str(ledger), "killed", 0.1).result(timeout=20)
    runs = read_ledger(ledger)
    assert [(a.key, b.key) for a, b in overlaps(runs)] == [("thawed", "thawed")]
    assert [e.finished for e in runs["killed"]] == [False, True]
