"""sandboxq on a real Redis Cluster: three masters on loopback (``LocalCluster``).

The backend contract runs unchanged against it, then a worker end to end. A script whose
keys spanned two slots would fail here with CROSSSLOT (the server refuses it, and redis-py
refuses to route a script call whose keys map to different slots); a pipeline carrying a
script or TIME would be refused by the cluster client.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.cluster import key_slot

from sandboxq import ConfigError, JobFailed, Queue
from sandboxq.backends.base import Backend
from sandboxq.backends.redis.backend import RedisBackend
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.errors import BackendError
from sandboxq.models import JobState
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers, child_pid
from tests.support.contract import BackendContract, MakeBackend
from tests.support.redis_cluster import LocalCluster

pytestmark = pytest.mark.timeout(30)

H = "sandboxq.testing.handlers:"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster() as cluster:
        yield cluster


@pytest.fixture
def backend(make_backend: MakeBackend) -> Backend:
    return make_backend()


class TestClusterBackend(BackendContract):
    @pytest.fixture
    def make_backend(self, cluster: LocalCluster, queue_name: str) -> Iterator[MakeBackend]:
        made: list[RedisBackend] = []

        def make(**options: Any) -> Backend:
            made.append(RedisBackend(cluster.url, f"{queue_name}-{len(made)}", **options))
            return made[-1]

        yield make
        for backend in made:
            backend.close()


def node_clients(cluster: LocalCluster) -> list[redis.Redis]:
    return [redis.Redis(port=port) for port in cluster.ports]


def test_each_queue_lives_in_one_slot_and_queues_spread_over_the_nodes(
    cluster: LocalCluster, queue_name: str
) -> None:
    names = [f"{queue_name}-{i}" for i in range(6)]
    for name in names:
        with Queue(name, url=cluster.url) as queue:
            queue.options(delay_s=60).enqueue(1)
            job = queue.enqueue(2)
            (claimed,) = queue.backend.claim("w", 1, 5.0)
            assert claimed.id == job.id
            queue.backend.register_worker("w", {}, 5.0)
            assert queue.counts()[JobState.ACTIVE] == 1
    slots: dict[str, set[int]] = {name: set() for name in names}
    homes: dict[str, set[int]] = {name: set() for name in names}
    clients = node_clients(cluster)
    try:
        for node, client in enumerate(clients):
            for key in client.scan_iter(match=f"sq:{{{queue_name}-*"):
                name = key.decode().split("{", 1)[1].split("}", 1)[0]
                slots[name].add(key_slot(key))
                homes[name].add(node)
    finally:
        for client in clients:
            client.close()
    assert all(len(s) == 1 for s in slots.values()), slots
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len({next(iter(h)) for h in homes.values()}) >= 2, "every queue landed on one node"


def test_a_queue_follows_its_slot_to_another_node(cluster: LocalCluster, queue_name: str) -> None:
    """Resharding moves the queue's slot, with its keys, to another master: the scripts'
    lanes, still connected to the old owner, are answered MOVED (nothing ran) and follow."""
    slot = key_slot(f"sq:{{{queue_name}}}:waiting".encode())
    with Queue(queue_name, url=cluster.url) as queue:
        first = queue.enqueue(1)
        target = next(port for port in cluster.ports if port != cluster.owner(slot))
        cluster.move_slot(slot, target)
        assert cluster.owner(slot) == target
        second = queue.enqueue(2)
        claimed = queue.backend.claim("w", 3, 5.0, wait_s=0.2)
        assert sorted(c.id for c in claimed) == sorted([first.id, second.id])
        assert queue.counts()[JobState.ACTIVE] == 2


@pytest.fixture
def cluster_queue(cluster: LocalCluster, queue_name: str) -> Iterator[Queue]:
    with Queue(queue_name, url=cluster.url) as queue:
        yield queue


def test_a_worker_end_to_end_on_a_cluster(
    cluster: LocalCluster, cluster_queue: Queue, workers: BackgroundWorkers
) -> None:
    """Results, retries, a delayed job, a cancellation (pub/sub across the cluster) and an
    emptied server (FUNCTION FLUSH: the scripts' library is loaded again on every master)."""
    worker = workers.start(cluster_queue, H + "succeed_after", concurrency=2, lease_s=2.0)
    jobs = cluster_queue.enqueue_many([((0.01, i), {}) for i in range(20)])
    delayed = cluster_queue.options(delay_s=0.5).enqueue(0, "late")
    broken = cluster_queue.options(retries=1, backoff_s=0.1).enqueue("not a number")
    assert [job.result(timeout_s=20) for job in jobs] == list(range(20))
    assert delayed.result(timeout_s=20) == "late"
    with pytest.raises(JobFailed) as failed:
        broken.result(timeout_s=20)
    assert failed.value.attempts == 2 and "TypeError" in str(failed.value)

    hung = cluster_queue.enqueue(60, "never")
    wait_for(lambda: child_pid(cluster_queue, hung.id), 10, "the hung job's child")
    cancelled_at = time.monotonic()
    assert hung.cancel()
    wait_for(lambda: worker.stats["cancelled"] == 1, 10, "the cancellation to reach the worker")
    assert time.monotonic() - cancelled_at < 2.0

    clients = node_clients(cluster)
    try:
        for client in clients:
            client.function_flush()
    finally:
        for client in clients:
            client.close()
    assert cluster_queue.enqueue(0, "after flush").result(timeout_s=20) == "after flush"
    workers.stop(worker)
    assert hung.state() is JobState.CANCELLED
    assert worker.stats["lease_lost"] == 0 and worker.stats["rejected_acks"] == 0


def test_cluster_urls_are_checked(queue_name: str) -> None:
    with pytest.raises(ConfigError, match="only database 0"):
        Queue(queue_name, url="redis+cluster://127.0.0.1:7000/3")
    with pytest.raises(ConfigError, match="no query options"):
        Queue(queue_name, url="redis+cluster://127.0.0.1:7000?socket_timeout=1")
    with pytest.raises(ConfigError, match="bad port"):
        Queue(queue_name, url="redis+cluster://127.0.0.1:x")


def test_an_unreachable_cluster_is_a_clear_error(queue_name: str) -> None:
    from sandboxq.testing.redis_server import free_port

    url = f"redis+cluster://:secret@127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(BackendError) as error:
        Queue(queue_name, url=url)
    assert time.monotonic() - started < 10
    assert "127.0.0.1" in str(error.value) and "secret" not in str(error.value)


def test_queues_are_found_on_a_cluster_without_naming_them_or_scanning(
    cluster: LocalCluster, queue_name: str
) -> None:
    """Each queue is registered in its own slot's index by the enqueue script (a shared
    index key would be CROSSSLOT) or by its worker's registration; any backend reads them
    all, on every node."""
    names = [f"{queue_name}-{i}" for i in range(6)]
    for name in names[:4]:
        with Queue(name, url=cluster.url) as queue:
            queue.enqueue(1)
    with Queue(names[4], url=cluster.url) as queue:
        queue.batch([((1,), {}), ((2,), {})])
    worker_only = RedisBackend(cluster.url, names[5])
    try:
        worker_only.register_worker("w", {}, 5.0)
        found = worker_only.queue_index().names
        assert set(names) <= set(found)
        for name in names:
            assert key_slot(QueueKeys(name, cluster=True).index.encode()) == key_slot(name.encode())
    finally:
        worker_only.close()


def test_the_index_and_numbers_are_read_whole_while_a_queue_s_slot_moves(
    cluster: LocalCluster, queue_name: str
) -> None:
    """Each node is asked for the sizes of all its slots' index sets at once (one SCARD per
    slot through the client cost 0.6 s of CPU a read), and for the numbers of all the
    queues its slots hold. A slot that moved after the reader's slot map was read is not
    that node's any more: it is read by key instead, and the queue is still found, its
    numbers whole (not taken for a damaged queue)."""
    from sandboxq.backends.redis.connection import Connections
    from sandboxq.backends.redis.stats import read_index, read_stats

    slot = key_slot(queue_name.encode())  # the index set's slot is the queue's own
    with Queue(queue_name, url=cluster.url) as queue:
        queue.enqueue(1)
    # two readers: the first to meet the move refreshes its slot map
    reader, counter = (Connections(cluster.url, 5.0, f"sq:{{r{i}}}:x") for i in range(2))
    try:
        before = read_index(reader)
        assert queue_name in before.names
        assert read_stats(counter, [queue_name])[0].jobs[JobState.WAITING] == 1
        target = next(port for port in cluster.ports if port != cluster.owner(slot))
        cluster.move_slot(slot, target)
        after = read_index(reader)  # its slot map still names the old owner
        assert queue_name in after.names and after.total == before.total
        (stats,) = read_stats(counter, [queue_name])  # and so does this one's
        assert stats.damaged is None and stats.jobs[JobState.WAITING] == 1
    finally:
        reader.close()
        counter.close()


def scard_calls(cluster: LocalCluster) -> int:
    """SCARDs the cluster's nodes ran (those inside scripts too)."""
    total = 0
    for node in cluster.nodes:
        with redis.Redis.from_url(node.url) as raw:
            total += int(raw.info("commandstats").get("cmdstat_scard", {}).get("calls", 0))
    return total


def test_the_index_read_costs_one_look_a_slot_after_a_move_and_a_forged_set_its_slot_only(
    cluster: LocalCluster, queue_name: str
) -> None:
    """After a slot moved, every read fell back to a SCARD per slot through the client
    (16,384 more; 0.35 s of CPU a read): the grouping was kept by the slot map's
    identity, which redis-py patches in place. And one slot's index set forged into a
    string hid every queue of the Cluster."""
    from sandboxq.backends.redis.connection import Connections
    from sandboxq.backends.redis.keys import cluster_index
    from sandboxq.backends.redis.stats import read_index

    names = [f"{queue_name}-i{i}" for i in range(2)]
    for name in names:
        with Queue(name, url=cluster.url) as queue:
            queue.enqueue(1)
    reader = Connections(cluster.url, 5.0, "sq:{reader}:x")
    forged_slot = (key_slot(names[1].encode()) + 1) % 16384
    forged = cluster_index(forged_slot)
    owner = redis.Redis(port=cluster.owner(forged_slot))
    try:
        assert set(names) <= set(read_index(reader).names)
        slot = key_slot(names[0].encode())
        cluster.move_slot(slot, next(p for p in cluster.ports if p != cluster.owner(slot)))
        assert set(names) <= set(read_index(reader).names)  # the fallback, once
        before = scard_calls(cluster)
        assert set(names) <= set(read_index(reader).names)
        assert scard_calls(cluster) - before < 16384 + 100  # one look a slot, no more
        owner.set(forged, "not a set")
        assert set(names) <= set(read_index(reader).names)
    finally:
        owner.delete(forged)
        owner.close()
        reader.close()


def test_a_flood_of_ghost_names_cannot_hide_a_cluster_s_queues_for_good(
    cluster: LocalCluster, queue_name: str
) -> None:
    """Names added by hand to the slots' index sets, well-formed but with no queue behind
    them, were never pruned on a Cluster: a look reads the slots in order up to its cap,
    so 5,000 of them in the slots before a real queue's filled every look and hid that
    queue for good. A look now removes the entries it read that no queue is behind (from
    their own slot's set), as on one server, so the next looks reach the real queues."""
    from sandboxq.backends.index import QUEUES_READ_CAP
    from sandboxq.backends.redis.connection import Connections
    from sandboxq.backends.redis.keys import cluster_index
    from sandboxq.backends.redis.stats import read_index

    names = (f"{queue_name}-real{i}" for i in range(100_000))
    real = next(n for n in names if key_slot(n.encode()) > 16_000)  # after the ghosts
    ghosts: list[str] = []
    for i in range(100_000):
        ghost = f"{queue_name}-ghost{i}"
        if key_slot(ghost.encode()) < key_slot(real.encode()):
            ghosts.append(ghost)
        if len(ghosts) == 5 * QUEUES_READ_CAP // 2:
            break
    junk = ["bad name!", "x" * 300]  # not queue names at all, in the first slot's set
    with Queue(real, url=cluster.url) as queue:
        queue.enqueue(1)
    reader = Connections(cluster.url, 5.0, "sq:{reader}:x")
    raw: Any = reader.main
    pipe = raw.pipeline()
    for ghost in ghosts:
        pipe.sadd(cluster_index(key_slot(ghost.encode())), ghost)
    pipe.sadd(cluster_index(0), *junk)
    pipe.execute()
    try:
        looks = [read_index(reader) for _ in range(5)]  # 2,000 entries read a look
        found = [real in look.names for look in looks]
        assert found[-2:] == [True, True], (
            f"found {found}, index sizes {[look.total for look in looks]}"
        )
        listed = {name for look in looks for name in look.names}
        assert not listed & set(ghosts)
        assert looks[-1].total <= looks[0].total - len(ghosts) - len(junk)
        pipe = raw.pipeline()
        for ghost in ghosts:
            pipe.sismember(cluster_index(key_slot(ghost.encode())), ghost)
        assert not any(pipe.execute()), "ghosts were left in their slots' sets"
        assert not any(raw.smismember(cluster_index(0), junk))
    finally:
        pipe = raw.pipeline()
        for ghost in ghosts:
            pipe.srem(cluster_index(key_slot(ghost.encode())), ghost)
        pipe.srem(cluster_index(0), *junk)
        pipe.execute()
        reader.close()


def test_a_cluster_reader_that_may_not_write_the_index_still_ignores_ghost_names(
    cluster: LocalCluster, queue_name: str
) -> None:
    """Pruning is best effort: a reader whose ACL refuses SREM (on every node) reads the
    index as any other, the names no queue is behind left in it but not listed."""
    from sandboxq.backends.redis.connection import Connections
    from sandboxq.backends.redis.keys import cluster_index
    from sandboxq.backends.redis.stats import read_index

    real, ghost = f"{queue_name}-real", f"{queue_name}-ghost"
    with Queue(real, url=cluster.url) as queue:
        queue.enqueue(1)
    user = f"ro-{queue_name}"
    clients = node_clients(cluster)
    for client in clients:
        client.acl_setuser(
            user,
            enabled=True,
            passwords=["+pw"],
            keys=["~*"],
            channels=["*"],
            commands=["+@all", "-srem"],
        )
    hosts = ",".join(f"127.0.0.1:{port}" for port in cluster.ports)
    reader = Connections(f"redis+cluster://{user}:pw@{hosts}", 5.0, "sq:{reader}:x")
    index = cluster_index(key_slot(ghost.encode()))
    try:
        reader.main.sadd(index, ghost)  # SADD is allowed: the ghost is this user's own
        for _ in range(2):
            found = read_index(reader)
            assert real in found.names and ghost not in found.names
            assert found.unbacked >= 1
        assert reader.main.sismember(index, ghost)
    finally:
        reader.close()
        with redis.Redis(port=cluster.owner(key_slot(ghost.encode()))) as owner:
            owner.srem(index, ghost)
        for client in clients:
            client.acl_deluser(user)
            client.close()


def test_many_queues_events_are_read_while_a_slot_moves(
    cluster: LocalCluster, queue_name: str
) -> None:
    """The dashboard's reader sends each node its streams' reads in one write; a stream
    whose slot left that node (answered MOVED) is read through the client instead."""
    names = [f"{queue_name}-e{i}" for i in range(4)]
    reader = RedisBackend(cluster.url, names[0])
    try:
        jobs = {}
        for name in names:
            with Queue(name, url=cluster.url) as queue:
                jobs[name] = queue.enqueue(1).id
        slot = key_slot(names[1].encode())
        assert reader.new_events(dict.fromkeys(names), 10)  # the slot map is read now
        cluster.move_slot(slot, next(p for p in cluster.ports if p != cluster.owner(slot)))
        read = reader.new_events(dict.fromkeys(names), 10)
        for name in names:
            got = read[name]
            assert not isinstance(got, BackendError), got
            assert [(e.kind, e.job_id) for e in got] == [("added", jobs[name])]
    finally:
        reader.close()


def test_the_exporter_finds_and_reads_queues_on_a_cluster_unnamed(
    cluster: LocalCluster, queue_name: str
) -> None:
    from sandboxq.observe.exporter import QueueExporter

    names = [f"{queue_name}-x{i}" for i in range(4)]
    for i, name in enumerate(names):
        with Queue(name, url=cluster.url) as queue:
            queue.enqueue_many([((j,), {}) for j in range(i + 1)])
    exporter = QueueExporter(cluster.url)
    try:
        text = exporter.exposition().decode()
    finally:
        exporter.close()
    assert "sandboxq_exporter_redis_up 1.0" in text
    for i, name in enumerate(names):
        assert f'sandboxq_queue_jobs{{queue="{name}",state="waiting"}} {float(i + 1)}' in text


@pytest.mark.timeout(90)
def test_the_dashboard_shows_a_cluster_s_queues_unnamed(
    cluster: LocalCluster, queue_name: str
) -> None:
    import httpx

    from sandboxq.web import create_app
    from tests.web.support import serve

    names = [f"{queue_name}-d{i}" for i in range(25)]
    for name in names:
        with Queue(name, url=cluster.url) as queue:
            queue.enqueue(1)
    # every queue this module made is in the index: up to 200 shown, a few reads each;
    # they share one Cluster client (one made per queue took 8.6 s for 200 queues) and
    # its connections (a lane per queue held one each)
    before, connected = command_table_reads(cluster), connections(cluster)
    with serve(create_app(cluster.url)) as base, httpx.Client(base_url=base, timeout=60) as http:
        for look in ("first", "second"):
            started = time.monotonic()
            page = http.get("/")
            took_s = time.monotonic() - started
            print(f"{look} overview of {page.text.count('<tr><td><a')} queues: {took_s:.2f} s")
        assert page.status_code == 200
        for name in names:
            assert f'<a href="/queue?name={name}">{name}</a>' in page.text
        assert command_table_reads(cluster) - before == 1
        assert connections(cluster) - connected < 15, (connections(cluster), connected)


def connections(cluster: LocalCluster) -> int:
    """Clients connected to the cluster's nodes, these reads' own left out."""
    total = 0
    for node in cluster.nodes:
        with redis.Redis.from_url(node.url) as raw:
            total += len(raw.client_list()) - 1
    return total


def command_table_reads(cluster: LocalCluster) -> int:
    """How many times clients asked the cluster's nodes for their command table (every
    new Cluster client does, once)."""
    total = 0
    for node in cluster.nodes:
        with redis.Redis.from_url(node.url) as raw:
            stats = raw.info("commandstats")
        total += int(stats.get("cmdstat_command", {}).get("calls", 0))
    return total


def test_a_producer_or_a_reader_makes_one_cluster_client(
    cluster: LocalCluster, queue_name: str
) -> None:
    """The dashboard opens a backend per queue, and each Cluster client discovers the nodes
    and reads a command table: with the renewal and the blocking clients made at once,
    opening 20 queues here took 1.9 s instead of 0.8 s. Those are made when first used."""
    before = command_table_reads(cluster)
    with Queue(queue_name, url=cluster.url) as queue:
        job = queue.enqueue(1)
        assert job.state() is JobState.WAITING and queue.counts()[JobState.WAITING] == 1
        assert command_table_reads(cluster) - before == 1
