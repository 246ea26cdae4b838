"""sandboxq behind Redis Sentinel: a worker and a producer follow a failover (the master is
SIGKILLed, the sentinels promote the replica) and every job completes. The new master
holds the scripts' function library already: Redis replicates functions with the data
(reloading a library a server lacks is test_cluster's, after a FUNCTION FLUSH)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from sandboxq import ConfigError, Queue
from sandboxq.backends.redis.scripts import library
from sandboxq.errors import BackendError
from sandboxq.models import JobState
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from tests.support.redis_sentinel import LocalSentinel
from tests.support.server_stats import libraries

pytestmark = pytest.mark.timeout(60)

H = "sandboxq.testing.handlers:"


@pytest.fixture
def sentinel() -> Iterator[LocalSentinel]:
    with LocalSentinel() as sentinel:
        yield sentinel


def enqueue_until_accepted(queue: Queue, job_id: str, timeout_s: float = 20) -> str:
    """Enqueue with an explicit id, again after each error: the same job, never twice."""

    def enqueue() -> str | None:
        try:
            return queue.options(job_id=job_id).enqueue(0.05, job_id).id
        except BackendError:
            return None

    return wait_for(enqueue, timeout_s, "the producer to reach the new master")


def test_worker_and_producer_follow_a_failover(
    sentinel: LocalSentinel, queue_name: str, workers: BackgroundWorkers
) -> None:
    worker = workers.start(
        queue_name, H + "succeed_after", url=sentinel.url, concurrency=2, lease_s=2.0
    )
    with Queue(queue_name, url=sentinel.url) as queue:
        before = [enqueue_until_accepted(queue, f"before-{i}") for i in range(10)]
        for job_id in before:
            assert queue.job(job_id).result(timeout_s=20) == job_id
        master = redis.Redis(port=sentinel.master.port)
        replica = redis.Redis(port=sentinel.replica.port)
        try:
            # Everything so far is on the replica, the scripts' library included.
            assert master.execute_command("WAIT", 1, 5000) == 1
            digest, text = library()
            assert libraries(replica) == {f"sandboxq_{digest}": text}
        finally:
            master.close()
            replica.close()
        sentinel.kill_master()
        after = [enqueue_until_accepted(queue, f"after-{i}") for i in range(10)]
        for job_id in after:
            assert queue.job(job_id).result(timeout_s=30) == job_id
        assert all(queue.job(j).state() is JobState.COMPLETED for j in before)
    workers.stop(worker)  # raises unless it stops in time


def test_sentinel_urls_are_checked(queue_name: str) -> None:
    with pytest.raises(ConfigError, match="names the master"):
        Queue(queue_name, url="redis+sentinel://127.0.0.1:26379")
    with pytest.raises(ConfigError, match=r"the database must be a number, e\.g\. /0, got .zero."):
        Queue(queue_name, url="redis+sentinel://127.0.0.1:26379/mymaster/zero")
    with pytest.raises(ConfigError, match="no query options"):
        Queue(queue_name, url="redis+sentinel://127.0.0.1:26379/mymaster?db=1")


def test_no_reachable_sentinel_is_a_clear_error(queue_name: str) -> None:
    from sandboxq.testing.redis_server import free_port

    with Queue(queue_name, url=f"redis+sentinel://127.0.0.1:{free_port()}/nowhere") as queue:
        with pytest.raises(BackendError, match="unreachable"):
            queue.enqueue(1)


def test_urls_with_many_hosts_hide_their_password() -> None:
    from sandboxq.backends.redis.connection import redact

    assert redact("redis+sentinel://:pw@h1:1,h2:2/m/0") == "redis+sentinel://:***@h1:1,h2:2/m/0"
    assert redact("redis+cluster://u:p%40ss@h1:1") == "redis+cluster://u:***@h1:1"
    assert redact("redis://h:1/0") == "redis://h:1/0"
