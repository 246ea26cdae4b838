"""The storm hits the pool's own helpers too: each worker's fork server is SIGKILLed
twice mid-run, beside random child kills. Nothing is lost or run twice at once, the
attempts the fork server took down are ``interrupted`` (requeued, not charged), never an
``exit`` with code 255, and nothing is left running afterwards (``Fleet.close``)."""

from __future__ import annotations

import time

import pytest
from harness import ChildKiller, ForkServerKiller, Scene

pytestmark = pytest.mark.timeout(240)

JOBS = 150


def test_fork_server_kills_lose_nothing_and_blame_no_handler(scene: Scene) -> None:
    fleet = scene.fleet("--concurrency", "2", "--lease-s", "2")
    workers = fleet.start(2, children=2)
    servers = ForkServerKiller(fleet, every_s=1.0, per_worker=2, seed=3)
    children = ChildKiller(fleet, 0.3, 0.6, seed=4)
    started = time.monotonic()
    producer = scene.producer(
        JOBS, batch=25, pause_s=0.05, seconds=lambda rng: rng.uniform(0.05, 0.2)
    )
    servers.start()
    children.start()
    try:
        result = scene.finish(producer, timeout_s=150)
    finally:
        servers.stop()
        children.stop()
    took = time.monotonic() - started
    print(f"\nfork servers killed {servers.killed} in {took:.1f} s; {result.line()}")
    assert len(producer.accepted) == JOBS and not producer.errors
    assert all(w.proc.poll() is None for w in workers), fleet.errors()
    assert sum(servers.killed.values()) >= 2
    assert result.outcomes["interrupted"] >= 1, result.line()
    assert result.outcomes["exit"] == 0, result.line()  # never multiprocess's 255
    assert result.completed >= JOBS - 5, result.line()
    assert not fleet.errors()
