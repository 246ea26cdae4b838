"""A slow or stalled network between one worker and Redis: a TCP proxy on loopback (the
worker connects through it) delays every byte, then holds every byte for longer than a
lease and delivers it all late."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from harness import Scene, alive, assert_cut_off, assert_within_leases, lease_ends, unfinished

from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.waiting import wait_for
from tests.support.ledger import read_ledger
from tests.support.proxy import TcpProxy

pytestmark = pytest.mark.timeout(180)

LEASE_S = 1.5


def wait_for_a_renewal(scene: Scene, job_id: str) -> None:
    """Until the lease of running job ``job_id`` has been renewed once (its expiry moved)."""
    active = QueueKeys(scene.queue.name).active
    with redis.Redis.from_url(scene.url) as raw:
        claimed = raw.zscore(active, job_id)
        assert claimed is not None, f"job {job_id} is not running"
        wait_for(lambda: (raw.zscore(active, job_id) or 0) > claimed, 10, "a lease renewal")


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[TcpProxy]:
    with TcpProxy("127.0.0.1", redis_server.port) as proxy:
        yield proxy


def test_late_renewals_make_the_worker_fence_itself(scene: Scene, proxy: TcpProxy) -> None:
    """Worker A talks to Redis through the proxy, worker B directly. First every byte to and
    from A is 100 ms late, which its leases survive; then A's traffic stalls for twice
    the lease. A's renewals cannot arrive in time, so A kills its children before their
    leases can expire on the server and acks nothing for them; B recovers the jobs and
    completes them; when the stall ends, A's late renewals are rejected and A goes back
    to work. No job ever runs in two
    children at once, and every job completes exactly once.

    A job of A's that ends on its own within its lease, before the fence falls, is not the
    fence's: its child lives on. So the stall comes just after A starts a job (one with
    more time left than a lease, which the fence must cut off), and every job A runs at the
    stall is held to its lease as the server counts it."""
    fleet = scene.fleet("--concurrency", "2", "--lease-s", str(LEASE_S))
    a = fleet.spawn(proxy.url)
    b = fleet.spawn()
    fleet.wait_ready(a, 2)
    fleet.wait_ready(b, 2)
    # Jobs longer than the stall's fence window, so the stall finds A mid-job.
    producer = scene.producer(16, batch=16, seconds=lambda rng: rng.uniform(2.5, 3.5))
    try:
        # Once A's connections are up (and its first leases renewed), its link slows down:
        # its renewals arrive late, but in time. Nothing is fenced, nothing stalls.
        running = wait_for(
            lambda: unfinished(scene.ledger, set(a.family())), 10, "worker A to start a job"
        )
        wait_for_a_renewal(scene, next(iter(running)))
        proxy.delay_s = 0.1
        time.sleep(3.0)  # the subject: two leases' worth of renewals over the slow link
        proxy.delay_s = 0.0
        assert scene.tally.total("stalled") == 0, "100 ms of latency cost a lease"
        a_family = set(a.family())
        wait_for(
            lambda: unfinished(scene.ledger, a_family, time.time() - 0.5), 10, "A to start a job"
        )
        proxy.stall()
        stalled_at = time.time()
        held = unfinished(scene.ledger, a_family)
        # Those with more than a lease left (every job takes 2.5 s at least) are the fence's.
        fenced = unfinished(scene.ledger, a_family, stalled_at - (2.5 - LEASE_S))
        ends = lease_ends(scene, held)  # no renewal of A's gets through from now on
        time.sleep(2 * LEASE_S)  # the subject: the stall outlasts the lease
        # Fenced during the stall, not after it: A's children running its jobs are dead.
        assert not any(alive(pid) for pid in fenced.values()), fenced
        proxy.resume()
        resumed_at = time.time()
    finally:
        proxy.resume()
    result = scene.finish(producer)
    print(f"\n{len(held)} jobs held by A when its network stalled; {result.line()}")
    assert fenced, "worker A had no job the fence must cut off: the test proved nothing"
    runs = read_ledger(scene.ledger)
    assert_within_leases(runs, held, ends)
    # A's child was killed within one lease of the stall (the fence), never ran to the end.
    assert_cut_off(scene, runs, fenced, stalled_at, LEASE_S)
    for key in fenced:
        info = scene.queue.backend.get(key)
        assert info is not None and info.stalls >= 1
    # A is alive and went back to work once its network healed.
    assert a.proc.poll() is None, fleet.tail(a)
    a_now = {p.pid for p in a.children()}
    assert any(e.pid in a_now and e.started > resumed_at for r in runs.values() for e in r)
    assert not result.failed and not fleet.errors()
