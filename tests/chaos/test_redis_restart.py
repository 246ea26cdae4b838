"""Redis itself dies (SIGKILL, AOF with appendfsync always) for longer than a lease while
jobs run and producers enqueue, then comes back on the same port."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator

import pytest
from harness import Scene

from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

LEASE_S = 1.0
JOBS = 150


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(appendonly=True) as server:
        yield server


def test_redis_killed_and_restarted_loses_no_accepted_job(
    server: RedisServer, make_scene: Callable[[str], Scene]
) -> None:
    """Redis is SIGKILLed mid-run and restarted 2.5 leases later. Producers get a clear
    error while it is down and enqueue the same jobs again (same ids: nothing twice);
    workers fence their running jobs, survive and reconnect; every job whose enqueue was
    acknowledged completes exactly once, and none ran twice at the same time."""
    scene = make_scene(server.url)
    fleet = scene.fleet("--concurrency", "2", "--lease-s", str(LEASE_S))
    workers = fleet.start(2, children=2)
    producer = scene.producer(
        JOBS, batch=10, pause_s=0.1, seconds=lambda rng: rng.uniform(0.05, 0.3)
    )
    wait_for(lambda: len(producer.accepted) >= 40, 30, "the first jobs to be accepted")
    assert server.process is not None
    server.process.send_signal(signal.SIGKILL)
    server.stop()
    down_at = time.monotonic()
    before = len(producer.accepted)
    time.sleep(2.5 * LEASE_S)  # the subject: Redis stays down for longer than the lease
    assert all(w.proc.poll() is None for w in workers), fleet.errors()
    server.start()
    print(f"\nRedis was down {time.monotonic() - down_at:.1f} s")
    result = scene.finish(producer)
    print(f"{len(producer.errors)} enqueue errors while down; {result.line()}")
    assert len(producer.accepted) == JOBS and before < JOBS, "Redis died after the producer"
    # The producer was refused, clearly, while Redis was down...
    assert producer.errors and all("unreachable" in e for e in producer.errors), producer.errors[:3]
    # ...and nothing it was told was accepted got lost, or done twice.
    assert not result.failed, result.failed
    assert all(w.proc.poll() is None for w in workers), fleet.errors()
    assert not fleet.errors()
