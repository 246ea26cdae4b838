"""The exporter against what breaks it in the field (real redis-servers): Redis going away
and coming back, keys shaped like queues that are not, a padded worker registry, clients
that connect and send nothing."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
import redis

from sandboxq import Queue
from sandboxq.backends.index import WORKERS_READ_CAP
from sandboxq.backends.redis.keys import INDEX, QueueKeys
from sandboxq.observe.exporter import QueueExporter
from sandboxq.observe.exposition import MAX_HANDLERS, MAX_WAITING, READ_S
from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.waiting import wait_for

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(address: tuple[str, int]) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=10) as r:
        return r.status, r.read().decode()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def test_an_unreachable_redis_is_up_0_and_one_log_line_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    exporter = QueueExporter(f"redis://:pw-hidden@127.0.0.1:{port}/0")
    address = exporter.serve(0)
    caplog.set_level(logging.INFO, logger="sandboxq.exporter")
    try:
        for _ in range(3):
            status, text = scrape(address)
            assert status == 200
            assert "sandboxq_exporter_redis_up 0.0" in text
            assert "sandboxq_queue_jobs{" not in text
        with RedisServer(port=port, extra_args=["--requirepass", "pw-hidden"]) as server:
            with Queue("seen", url=server.url.replace("//", "//:pw-hidden@")) as q:
                q.enqueue(1)
            for _ in range(2):
                status, text = scrape(address)
                assert "sandboxq_exporter_redis_up 1.0" in text
                assert 'sandboxq_queue_jobs{queue="seen",state="waiting"} 1.0' in text
        status, text = scrape(address)
        assert status == 200 and "sandboxq_exporter_redis_up 0.0" in text
    finally:
        exporter.close()
    # the state changes; the INFO line of serve() is captured only when an earlier test
    # left this logger at INFO, so it is not counted
    lines = [
        r for r in caplog.records if r.name == "sandboxq.exporter" and r.levelno >= logging.WARNING
    ]
    assert [r.getMessage().split(",")[0].split(" at ")[0] for r in lines] == [
        "Redis unreachable",
        "Redis reachable again",
        "Redis unreachable",
    ]
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in lines)
    assert not any("pw-hidden" in r.getMessage() for r in lines)


def test_a_hung_redis_is_up_0_within_prometheus_scrape_timeout(own_redis: RedisServer) -> None:
    """A Redis that accepts connections and never answers (stopped, a stalled network):
    each call waited its timeout twice (one retry), and the scrape answered after 10 s,
    Prometheus' default scrape_timeout, so the target read as down, not as redis_up 0."""
    import os
    import signal
    import time

    with Queue("seen", url=own_redis.url) as q:
        q.enqueue(1)
    exporter = QueueExporter(own_redis.url)
    address = exporter.serve(0)
    assert own_redis.process is not None
    try:
        assert "sandboxq_exporter_redis_up 1.0" in scrape(address)[1]
        os.kill(own_redis.process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            status, text = scrape(address)
            took = time.monotonic() - started
        finally:
            os.kill(own_redis.process.pid, signal.SIGCONT)
        assert status == 200 and "sandboxq_exporter_redis_up 0.0" in text
        assert took < 8.0, f"the scrape took {took:.1f} s"
    finally:
        exporter.close()


def test_a_flood_of_names_in_the_index_cannot_hide_the_real_queues(
    own_redis: RedisServer,
) -> None:
    """The exporter never pruned the index: 5,000 names with no queue behind them filled
    its cap of 2,000 entries on every scrape, and a real queue was never exported. A
    scrape that finds the index over its cap prunes what it reads."""
    with Queue("real", url=own_redis.url) as q:
        q.enqueue(1)
    raw = redis.Redis.from_url(own_redis.url)
    exporter = QueueExporter(own_redis.url)
    address = exporter.serve(0)
    try:
        raw.sadd(INDEX, *(f"ghost-{i}" for i in range(5000)))
        shown = []
        for _ in range(5):  # 5,000 ghosts, 2,000 read a scrape
            shown.append(
                'sandboxq_queue_jobs{queue="real",state="waiting"} 1.0' in scrape(address)[1]
            )
        assert shown[-1], shown
        assert raw.scard(INDEX) < 2000
    finally:
        exporter.close()
        raw.close()


def test_junk_keys_and_junk_index_entries_add_no_series(own_redis: RedisServer) -> None:
    raw = redis.Redis.from_url(own_redis.url)
    exporter = QueueExporter(own_redis.url)
    try:
        with Queue("real", url=own_redis.url) as q:
            q.enqueue(1)
        # what a SCAN for sq:{*}:seq took for 10,000 queues; and names added to the index
        # by hand: malformed ones, and well-formed ones no queue stands behind
        pipe = raw.pipeline(transaction=False)
        for i in range(10_000):
            pipe.set(f"sq:{{junk-{i}}}:seq", 1)
        pipe.sadd(INDEX, "bad name!", "x" * 500, b"\xff", *[f"ghost-{i}" for i in range(100)])
        pipe.execute()
        # a worker registry padded with 200,000 names (one scrape took 3.7 s)
        keys = QueueKeys("real")
        for start in range(0, 200_000, 10_000):
            raw.sadd(keys.workers, *[f"fake-{i}" for i in range(start, start + 10_000)])
        text = _generate(exporter)
        queues = set(re.findall(r'sandboxq_queue_jobs\{queue="([^"]+)"', text))
        assert queues == {"real"}
        assert 'sandboxq_exporter_capped{what="workers"} 1.0' in text
        assert 'sandboxq_exporter_capped{what="queues"} 0.0' in text
        assert 'sandboxq_workers{queue="real"} 0.0' in text
        assert WORKERS_READ_CAP < 200_000
    finally:
        exporter.close()
        raw.close()


def test_requests_sent_a_byte_at_a_time_cannot_hold_every_slot(own_redis: RedisServer) -> None:
    """MAX_HANDLERS clients that send their request a byte at a time, each byte within
    the read timeout, held every answering slot for as long as they kept sending: every
    scrape was closed unanswered. A request now has READ_S in all to arrive."""
    exporter = QueueExporter(own_redis.url)
    stop = threading.Event()
    trickles: list[threading.Thread] = []
    try:
        address = exporter.serve(0)

        held = threading.Event()  # every slot is theirs: a scrape was refused

        def trickle() -> None:
            while not stop.is_set():
                with socket.create_connection(address, timeout=5) as sock:
                    for byte in b"GET /metrics HTTP/1.0\r\n" + b"X" * 10_000:
                        try:
                            sock.send(bytes([byte]))
                        except OSError:
                            break  # closed by the server
                        if stop.wait(0.2):
                            return
                if held.is_set():
                    return  # closed after READ_S, as it should be: no second try
                # refused while a scrape held a slot: until all hold one, try again

        trickles = [threading.Thread(target=trickle) for _ in range(MAX_HANDLERS)]
        for thread in trickles:
            thread.start()

        def answered() -> bool:
            try:
                return scrape(address)[0] == 200
            except OSError:
                return False

        wait_for(lambda: not answered(), 10, "the trickling clients to hold every slot")
        held.set()
        started = time.monotonic()
        wait_for(answered, READ_S + 5, "a scrape answered beside the trickling clients")
        assert time.monotonic() - started < READ_S + 5
    finally:
        stop.set()
        for thread in trickles:
            thread.join(10)
        exporter.close()


def test_idle_connections_cost_no_thread_and_never_stall_a_scrape(own_redis: RedisServer) -> None:
    """A client that opens connections and sends nothing (slowloris) had a thread of the
    exporter's each, for as long as it kept them open: 200 made 200 threads, without
    bound. Now a connection waits for its request without a thread, for at most READ_S."""
    exporter = QueueExporter(own_redis.url)
    idle: list[socket.socket] = []
    try:
        address = exporter.serve(0)
        before = threading.active_count()
        idle = [socket.create_connection(address, timeout=5) for _ in range(200)]
        started = time.monotonic()
        status, text = scrape(address)  # accepted after all 200: they are the server's now
        assert status == 200 and "sandboxq_exporter_redis_up 1.0" in text
        assert time.monotonic() - started < 2.0
        threads = threading.active_count() - before
        assert threads <= 2, f"{threads} threads for 200 idle connections"
        # an idle connection is closed by the server, not held until the client goes
        idle[0].settimeout(READ_S + 5)
        assert idle[0].recv(1) == b""
        # past MAX_WAITING silent ones, the one waiting longest is closed at once
        idle += [socket.create_connection(address, timeout=5) for _ in range(MAX_WAITING + 10)]
        assert scrape(address)[0] == 200
        idle[200].settimeout(1.0)  # well before its READ_S
        assert idle[200].recv(1) == b""
        assert threading.active_count() - before <= 2
    finally:
        for sock in idle:
            sock.close()
        exporter.close()


def _generate(exporter: QueueExporter) -> str:
    from prometheus_client import generate_latest

    return generate_latest(exporter.registry).decode()


# -- sandboxq queues: the same index, for a person or a script ----------------------------------


def test_queues_verb_lists_every_queue_from_the_index(
    own_redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    from sandboxq.backends import open_backend
    from sandboxq.cli import main

    with Queue("thumbs", url=own_redis.url) as q:
        q.enqueue_many([((i,), {}) for i in range(3)])
    worker_only = open_backend(own_redis.url, "idle-fleet")
    raw = redis.Redis.from_url(own_redis.url)
    try:
        worker_only.register_worker("w1", {"host": "h"}, 30.0)
        raw.set("sq:{junk}:seq", 1)  # shaped like a queue, never registered
        raw.sadd(INDEX, "bad name!")
        assert main(["queues", "--url", own_redis.url, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        by_name = {row["queue"]: row for row in data["queues"]}
        assert set(by_name) == {"thumbs", "idle-fleet"}
        assert by_name["thumbs"]["waiting"] == 3 and by_name["thumbs"]["workers"] == 0
        assert by_name["idle-fleet"]["workers"] == 1
        assert data["index"] == {"total": 3, "ignored": 1, "capped": False}
        # the junk entry was removed by that read: the index holds the two queues now
        assert raw.smembers(INDEX) == {b"thumbs", b"idle-fleet"}
        raw.sadd(INDEX, "ghost")  # well-formed, no queue behind it
        assert main(["queues", "--url", own_redis.url]) == 0
        out = capsys.readouterr()
        assert "thumbs" in out.out and "idle-fleet" in out.out and "junk" not in out.out
        assert "ghost" not in out.out
        assert "1 names with no queue behind them were removed from the index" in out.err
        # a damaged queue: its counts unread, shown as such (they read as all zeros)
        raw.sadd(INDEX, "damaged1")
        raw.set("sq:{damaged1}:workers", "x")
        raw.hset("sq:{damaged1}:waiting", "a", "b")
        assert main(["queues", "--url", own_redis.url]) == 0
        out = capsys.readouterr()
        [row] = [line for line in out.out.splitlines() if "damaged1" in line]
        assert row.split()[1:] == ["?"] * (len(row.split()) - 1), row
        assert "sandboxq queues: queue damaged1: damaged, its counts unread (" in out.err
    finally:
        worker_only.close()
        raw.close()


def test_queues_says_once_it_removed_a_name_no_queue_is_behind_or_what_would(
    own_redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name added to the index by hand was said to be ignored at every look: said once,
    by the look that removes it; a user who may not remove it is told what would."""
    from sandboxq.cli import main

    raw = redis.Redis.from_url(own_redis.url)
    try:
        with Queue("thumbs", url=own_redis.url) as q:
            q.enqueue()
        raw.sadd(INDEX, "ghost")  # well-formed, no queue behind it
        # a reader that may not write (stats.lua runs, as the exporter's user does)
        rights = ["~*", "+@read", "+@connection", "+evalsha", "+eval", "+script", "+time"]
        raw.execute_command("ACL", "SETUSER", "reader", "on", ">pw", *rights)
        reader = own_redis.url.replace("redis://", "redis://reader:pw@")
        for _ in range(2):
            assert main(["queues", "--url", reader]) == 0
            out = capsys.readouterr()
            assert "thumbs" in out.out and "ghost" not in out.out
            said = "1 names with no queue behind them were ignored; they stay in the index, as"
            assert f"{said} this user may not remove them (" in out.err, out.err
            assert "'srem'" in out.err, out.err
            assert "a look by a user who may (sandboxq queues, the dashboard)" in out.err
        assert raw.sismember(INDEX, "ghost")
        looks = []
        for _ in range(2):
            assert main(["queues", "--url", own_redis.url]) == 0
            looks.append(capsys.readouterr().err)
        assert looks == [
            "sandboxq queues: 1 names with no queue behind them were removed from the index\n",
            "",
        ]
        assert raw.smembers(INDEX) == {b"thumbs"}
    finally:
        raw.close()


def test_a_damaged_key_or_index_is_one_line_when_found_and_one_when_repaired(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis answers: a damaged queue key costs that queue its series, a damaged index
    the exporter its discovery, and neither is 'Redis unreachable' nor a line a scrape."""
    raw = redis.Redis.from_url(own_redis.url)
    with Queue("fine", url=own_redis.url) as fine, Queue("broken", url=own_redis.url) as broken:
        fine.enqueue(1)
        broken.enqueue(1)
    waiting = QueueKeys("broken").waiting
    exporter = QueueExporter(own_redis.url)
    address = exporter.serve(0)
    caplog.set_level(logging.INFO, logger="sandboxq.exporter")
    try:
        saved = raw.dump(waiting)
        raw.delete(waiting)
        raw.set(waiting, "not a sorted set")
        for _ in range(3):
            text = scrape(address)[1]
            assert "sandboxq_exporter_redis_up 1.0" in text
            assert 'queue="fine"' in text and 'queue="broken"' not in text
        raw.delete(waiting)
        raw.restore(waiting, 0, saved)
        assert 'queue="broken"' in scrape(address)[1]
        members = raw.smembers(INDEX)
        raw.delete(INDEX)
        raw.set(INDEX, "not a set")
        for _ in range(3):
            text = scrape(address)[1]
            assert "sandboxq_exporter_redis_up 1.0" in text and "queue=" not in text
        raw.delete(INDEX)
        raw.sadd(INDEX, *members)
        assert 'queue="fine"' in scrape(address)[1]
    finally:
        exporter.close()
        raw.close()
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "sandboxq.exporter" and r.levelno >= logging.WARNING
    ]
    expected = [
        "queue 'broken' is damaged, left out of the scrape: WRONGTYPE",
        "queue 'broken' is readable again",
        "the queue index is damaged, the queue index sq:queues holds a string, not a set",
        "the queue index is readable again",
    ]
    assert len(lines) == len(expected), lines
    assert all(line.startswith(start) for line, start in zip(lines, expected, strict=True)), lines
