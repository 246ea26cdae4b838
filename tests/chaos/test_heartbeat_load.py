"""The heartbeat under load: twice as many children as cores, each holding its GIL in one
long C call for five leases. The parent's renewals must not notice."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import PROCESSOR, Scene

from sandboxq.testing.workers import BackgroundWorkers
from sandboxq.worker.heartbeat import fence_margin_s
from tests.support.ledger import read_ledger

pytestmark = [pytest.mark.timeout(120), pytest.mark.alone]  # holds every core

LEASE_S = 1.5


def most_at_once(ledger: Path) -> int:
    """The largest number of executions that were running at one instant."""
    edges = sorted(
        (t, step)
        for runs in read_ledger(ledger).values()
        for e in runs
        for t, step in ((e.started, 1), (e.last, -1))
    )
    running = peak = 0
    for _t, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def test_leases_hold_while_every_core_is_held_by_gil_holding_children(
    scene: Scene, workers: BackgroundWorkers, record_property: Callable[[str, object], None]
) -> None:
    """2 x cores children, each in one ``sum(range(n))`` call (GIL held, signal handlers
    blocked) for 5 leases: every job runs once and completes once, no lease lapses, no job
    is recovered as stalled, and the longest gap between two renewals stays well inside
    the lease. The gap is recorded (``max_renewal_gap_s``) and printed."""
    children = 2 * (os.cpu_count() or 2)
    worker = workers.start(
        scene.queue, PROCESSOR, concurrency=children, lease_s=LEASE_S, prefetch=0
    )
    seconds = 5 * LEASE_S
    producer = scene.producer(
        children,
        batch=children,
        seconds=lambda rng: seconds,
        step_s=seconds,  # one C call for the whole job
        busy=True,
    )
    result = scene.finish(producer)
    workers.stop(worker)
    gap = worker.heartbeat.max_gap_s
    record_property("max_renewal_gap_s", round(gap, 3))
    print(f"\nlongest gap between renewals: {gap:.3f} s (lease {LEASE_S} s); {result.line()}")
    assert most_at_once(scene.ledger) == children, "the children did not all hold a core at once"
    assert result.completed == children and result.executions == children
    assert result.stalls == 0 and scene.tally.total("stalled") == 0
    assert worker.stats["lease_lost"] == 0 and worker.stats["rejected_acks"] == 0, worker.stats
    assert gap < LEASE_S - fence_margin_s(LEASE_S), gap
