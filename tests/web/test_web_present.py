"""The dashboard against what an operator meets on day one (uvicorn on loopback, a real
redis-server): a forged Host header, a queue that was just created, a Redis that is down,
and hostile query parameters on every route."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator

import httpx
import pytest
import redis

from sandboxq import Queue
from sandboxq.backends import open_backend
from sandboxq.backends.index import QUEUES_READ_CAP, WORKERS_READ_CAP
from sandboxq.backends.memory import MemoryBackend
from sandboxq.backends.redis.backend import RedisBackend
from sandboxq.backends.redis.keys import INDEX, QueueKeys
from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.waiting import wait_for
from sandboxq.web import create_app
from sandboxq.web.state import DASHBOARD_QUEUES, INDEX_FRESH_S, MAX_BACKENDS

from .support import TOKEN, serve

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def q(redis_url: str, queue_name: str) -> Queue:
    queue = Queue(queue_name, url=redis_url)
    yield queue  # type: ignore[misc]
    queue.close()


def free_port() -> int:
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- problem 1: DNS rebinding ---------------------------------------------------------------


def test_a_forged_host_header_gets_400_before_any_job_is_read(redis_url: str, q: Queue) -> None:
    job = q.options(job_id="secret-job").enqueue({"password": "hunter2"})
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    with serve(app) as base, httpx.Client(base_url=base) as http:
        # what a rebinding page's fetch sends: the attacker's name, resolved to 127.0.0.1
        evil = {"host": "rebind.attacker.example"}
        for path in ["/", f"/job?queue={q.name}&id={job.id}", f"/events?queue={q.name}"]:
            page = http.get(path, headers=evil)
            assert page.status_code == 400, path
            assert "hunter2" not in page.text
            assert "rebind.attacker.example" in page.text and "--allowed-host" in page.text
        assert http.post("/login", data={"token": TOKEN}, headers=evil).status_code == 400
        # the names it serves still work, with or without a port
        for host in ["127.0.0.1", "localhost:1234", "LOCALHOST", "[::1]:80"]:
            assert http.get("/", headers={"host": host}).status_code == 200, host
        page = http.get(f"/job?queue={q.name}&id={job.id}")
        assert page.status_code == 200 and "hunter2" in page.text


def test_a_dashboard_given_its_queues_serves_no_other(redis_url: str, q: Queue) -> None:
    """--queue named the queues a dashboard shows, but any other typed into a URL was
    served: its jobs, their arguments and results, its batches and its live events."""
    with Queue(q.name + "-other", url=redis_url) as other:
        job = other.options(job_id="other-job").enqueue({"password": "hunter2"})
        app = create_app(redis_url, queues=[q.name])
        with serve(app) as base, httpx.Client(base_url=base) as http:
            for path in [
                f"/queue?name={other.name}",
                f"/job?queue={other.name}&id={job.id}",
                f"/batches?queue={other.name}",
                f"/events?queue={other.name}",
            ]:
                page = http.get(path)
                assert page.status_code == 400, (path, page.status_code)
                assert "hunter2" not in page.text
                assert "is not one of the queues this dashboard shows" in page.text, page.text
            assert http.get(f"/queue?name={q.name}").status_code == 200  # its own: served


def test_allowed_hosts_add_names_and_star_turns_the_check_off(redis_url: str, q: Queue) -> None:
    app = create_app(redis_url, queues=[q.name], allowed_hosts=["queues.internal"])
    with serve(app) as base, httpx.Client(base_url=base) as http:
        assert http.get("/", headers={"host": "queues.internal:8686"}).status_code == 200
        assert http.get("/", headers={"host": "other.internal"}).status_code == 400
    app = create_app(redis_url, queues=[q.name], allowed_hosts=["*"])
    with serve(app) as base, httpx.Client(base_url=base) as http:
        assert http.get("/", headers={"host": "other.internal"}).status_code == 200


# -- problem 2: a new queue and its worker show at the next refresh ----------------------------


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A server of the test's own: the queue index it reads holds only this test's queues."""
    with RedisServer() as server:
        yield server


def test_a_new_queue_and_a_new_worker_show_within_two_seconds(own_redis: RedisServer) -> None:
    url = own_redis.url
    app = create_app(url)  # no queue named: every queue is found in the index
    raw = redis.Redis.from_url(url)
    try:
        # junk shaped like queues (what a SCAN for sq:{*}:seq found) and junk in the index
        raw.mset({f"sq:{{junk-{i}}}:seq": 1 for i in range(2000)})
        raw.sadd(INDEX, "not a queue!", "x" * 300, b"\xff\xfe", "a{b}", "ghost-queue")
        with serve(app) as base, httpx.Client(base_url=base) as http:
            first = http.get("/")
            assert first.status_code == 200 and "No queues found yet" in first.text
            assert "junk-" not in first.text
            assert "4 entries that are not queue names were removed from the index" in first.text
            assert "1 names with no queue behind them were removed from the index" in first.text
            assert "ghost-queue" not in first.text
            assert raw.scard(INDEX) == 0  # the dashboard removed what no queue stands behind
            with Queue("arrived-later", url=url) as q:
                q.enqueue("x")
                started = time.monotonic()
                wait_for(lambda: "arrived-later" in http.get("/").text, 2.0, "the new queue")
                shown_after_s = time.monotonic() - started
            backend = open_backend(url, "worker-first")
            try:
                backend.register_worker("w-new", {"host": "h", "pid": 1}, 30.0)
                wait_for(lambda: "worker-first" in http.get("/").text, 2.0, "the new worker")
                assert "w-new" in http.get("/workers").text
            finally:
                backend.close()
        assert shown_after_s <= 2.0
    finally:
        raw.close()


def test_the_number_of_queues_read_is_capped_and_the_cap_is_said(own_redis: RedisServer) -> None:
    raw = redis.Redis.from_url(own_redis.url)
    try:
        names = [f"q{i}" for i in range(QUEUES_READ_CAP + 500)]
        raw.sadd(INDEX, *names)
        raw.mset({QueueKeys(name).seq: 1 for name in names})  # each a queue that was used
        backend = RedisBackend(own_redis.url, "probe")
        try:
            index = backend.queue_index()
        finally:
            backend.close()
        assert index.total == QUEUES_READ_CAP + 500 and index.capped
        assert len(index.names) == QUEUES_READ_CAP
        assert f"holds {QUEUES_READ_CAP + 500} entries" in index.note()
        app = create_app(own_redis.url)  # a dashboard shows fewer, and says so
        with serve(app) as base, httpx.Client(base_url=base, timeout=30) as http:
            page = http.get("/").text
        assert f"holds {QUEUES_READ_CAP + 500} entries; only {QUEUES_READ_CAP} were read" in page
        assert f"{DASHBOARD_QUEUES} of the {QUEUES_READ_CAP} queues read are shown" in page
        assert page.count('<tr><td><a href="/queue?name=q') == DASHBOARD_QUEUES
        shown = re.findall(r'<tr><td><a href="/queue\?name=(q\d+)">', page)
        assert shown == sorted(index.names)[:DASHBOARD_QUEUES]  # the first by name
    finally:
        raw.close()


def test_a_dashboard_of_many_queues_holds_a_few_connections(own_redis: RedisServer) -> None:
    """Every queue shown has a backend, and each once had connections of its own: 407 for
    200 queues, and 8.6 s of Cluster clients made before a first overview. They share the
    first one's now. The backends of queues gone are still closed (on a Cluster each
    keeps a connection to its slot's node)."""
    raw = redis.Redis.from_url(own_redis.url)
    names = [f"gone{i}" for i in range(150)]
    try:
        raw.sadd(INDEX, *names)
        raw.mset({QueueKeys(name).seq: 1 for name in names})
        app = create_app(own_redis.url)
        dashboard = app.state.dashboard
        with serve(app) as base, httpx.Client(base_url=base, timeout=30) as http:
            assert http.get("/").status_code == 200  # each queue's row read: 150 backends
            shown, opened = len(raw.client_list()), len(dashboard._backends)
            raw.delete(*(QueueKeys(name).seq for name in names))
            raw.srem(INDEX, *names)
            time.sleep(INDEX_FRESH_S + 0.1)  # the next page then reads the index again
            assert http.get("/").status_code == 200
            left = len(dashboard._backends)
        assert shown < 10, shown  # this client, the dashboard's few, the server's own
        assert opened > 150 and left <= MAX_BACKENDS + 1, (opened, left)
    finally:
        raw.close()


def test_the_memory_backend_keeps_an_index_too(queue_name: str) -> None:
    MemoryBackend.shared("sandboxq-dashboard")  # opened, never used: not a queue
    assert queue_name not in MemoryBackend.shared(queue_name).queue_index().names
    with Queue(queue_name, url="memory://") as q:
        q.enqueue("x")
    index = MemoryBackend.shared("other").queue_index()
    assert queue_name in index.names and "sandboxq-dashboard" not in index.names


# -- problem 3: an unreachable Redis ----------------------------------------------------------


def test_an_outage_is_a_503_banner_on_every_page_and_recovery_shows_the_queues(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    url = f"redis://:s3cret-pass@127.0.0.1:{port}/0"
    app = create_app(url, token=TOKEN)  # no queue named: on today's code, "No queues found"
    with serve(app) as base, httpx.Client(base_url=base) as http:
        for path in PAGES:
            page = http.get(path)
            assert page.status_code == 503, path
            banner = re.search(
                r'<div class="banner outage" id="outage"[^>]*>([^<]*)</div>', page.text
            )
            assert banner is not None, path
            assert f"127.0.0.1:{port}" in banner.group(1), path
            assert "s3cret-pass" not in page.text and "Traceback" not in page.text
            assert "No queues found yet" not in page.text
        for _ in range(5):  # what an open page polling every 2 s does
            assert http.get("/").status_code == 503
        logged = [r for r in caplog.records if r.getMessage().startswith("dashboard page /:")]
        assert len(logged) == 1, [r.getMessage() for r in logged]  # one per cause per 10 s
        with RedisServer(port=port, extra_args=["--requirepass", "s3cret-pass"]) as server:
            with Queue("back-again", url=server.url.replace("//", "//:s3cret-pass@")) as q:
                q.enqueue("x")
            wait_for(lambda: http.get("/").status_code == 200, 5.0, "the dashboard to recover")
            assert "back-again" in http.get("/").text


# -- problem 4: bad input on every endpoint ----------------------------------------------------

PAGES = [
    "/",
    "/queue?name=jobs",
    "/job?queue=jobs&id=a",
    "/workers",
    "/batches?queue=jobs",
    "/batch?queue=jobs&id=b",
    "/login",
]

HOSTILE = {
    "oversized": "9" * 5000,
    "non-numeric": "abc",
    "non-ASCII": "²",
    "non-ASCII word": "файл\u202e",
    "surrogate": "%ED%A0%80",
    "NUL": "%00",
}

#: Every route and the parameters it reads.
ROUTES: dict[str, list[str]] = {
    "/queue": ["name", "state", "outcome", "cursor", "id"],
    "/job": ["queue", "id", "full"],
    "/workers": ["queue"],
    "/batches": ["queue"],
    "/batch": ["queue", "id"],
    "/events": ["queue", "job", "since"],
}
GOOD = {"name": "jobs", "queue": "jobs", "id": "a", "state": "waiting"}


def test_every_route_answers_hostile_parameters_with_a_one_line_4xx(
    redis_url: str, q: Queue
) -> None:
    q.options(job_id="a").enqueue("x")
    good = {**GOOD, "name": q.name, "queue": q.name}
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    answers: dict[str, int] = {}
    with serve(app) as base, httpx.Client(base_url=base, timeout=10) as http:
        for route, keys in ROUTES.items():
            for key in keys:
                for kind, value in HOSTILE.items():
                    others = "&".join(f"{k}={v}" for k, v in good.items() if k in keys and k != key)
                    path = f"{route}?{others}&{key}={value}"
                    if route == "/events":  # a stream: read its status line only
                        with http.stream("GET", path) as r:
                            status, text = (
                                r.status_code,
                                r.read().decode() if r.status_code >= 400 else "",
                            )
                    else:
                        r = http.get(path)
                        status, text = r.status_code, r.text
                    answers[f"{route} {key} {kind}"] = status
                    if status >= 400:
                        assert 400 <= status < 500, (path, status)
                        reason = re.search(r'<p class="notice" id="message">([^<]*)</p>', text)
                        assert reason is not None and "\n" not in reason.group(1), path
                        assert "Traceback" not in text
        # page cursors page.lua cannot take: they said Redis was down (503)
        for cursor in ("0:9223372036854775808", "nan:0", "0:-1"):
            page = http.get(f"/queue?name={q.name}&cursor={cursor}")
            assert page.status_code == 400 and "invalid page cursor" in page.text, cursor
        # the cases the operator hit: /events?since=² and a 5,000-digit id
        for bad in ("%C2%B2", "9" * 5000):
            assert http.get(f"/events?since={bad}").status_code == 400
        with http.stream("GET", "/events", headers={"last-event-id": "9" * 5000}) as r:
            assert r.status_code == 400
        assert http.get("/job", params={"queue": q.name, "id": "9" * 5000}).status_code == 400
        # a body over the limit is refused as such, not as an outage
        assert http.post("/login", data={"token": "x" * 20_000}).status_code == 400
        # the one POST that acts: every field hostile in turn, with the right token
        bearer = {"authorization": f"Bearer {TOKEN}"}
        form = {"action": "cancel", "queue": q.name, "id": "a", "state": "waiting"}
        for key in form:
            for kind, value in HOSTILE.items():
                data = {**form, key: urllib.parse.unquote(value)}
                status = http.post("/action", data=data, headers=bearer).status_code
                answers[f"/action {key} {kind}"] = status
    errors = {case: status for case, status in answers.items() if status >= 500}
    assert not errors, errors


def test_a_padded_worker_registry_is_read_up_to_the_cap_and_says_so(
    own_redis: RedisServer,
) -> None:
    raw = redis.Redis.from_url(own_redis.url)
    keys = QueueKeys("padded")
    try:
        with Queue("padded", url=own_redis.url) as q:
            q.enqueue("x")
        pipe = raw.pipeline(transaction=False)
        for i in range(WORKERS_READ_CAP + 200):
            pipe.set(keys.worker(f"w{i}"), json.dumps({"worker_id": f"w{i}", "host": "h"}))
            pipe.sadd(keys.workers, f"w{i}")
        pipe.execute()
        app = create_app(own_redis.url, queues=["padded"])
        with serve(app) as base, httpx.Client(base_url=base, timeout=20) as http:
            assert f">{WORKERS_READ_CAP}+</a>" in http.get("/").text
            page = http.get("/workers", params={"queue": "padded"}).text
            assert f"the first {WORKERS_READ_CAP} registered workers were read" in page
            assert page.count('<section class="worker">') == WORKERS_READ_CAP
    finally:
        raw.close()


@pytest.mark.timeout(60)
def test_the_overview_counts_the_live_worker_of_a_registry_padded_by_hand(
    own_redis: RedisServer,
) -> None:
    """100,000 names with no worker behind them, and one live worker: the overview read
    one capped batch of the registry and showed "0+" until the workers page (or
    ``sandboxq info``) had forgotten the junk."""
    raw = redis.Redis.from_url(own_redis.url)
    keys = QueueKeys("padded2")
    try:
        with Queue("padded2", url=own_redis.url) as q:
            q.enqueue("x")
        pipe = raw.pipeline(transaction=False)
        for start in range(0, 100_000, 10_000):
            pipe.sadd(keys.workers, *(f"gone{i}" for i in range(start, start + 10_000)))
        pipe.set(keys.worker("live"), json.dumps({"worker_id": "live", "host": "h"}), ex=600)
        pipe.sadd(keys.workers, "live")
        pipe.execute()
        app = create_app(own_redis.url, queues=["padded2"])
        with serve(app) as base, httpx.Client(base_url=base, timeout=30) as http:
            page = http.get("/").text
            link = 'href="/workers?queue=padded2">'
            assert f"{link}1</a>" in page, page[page.find(link) - 20 : page.find(link) + 60]
            assert raw.scard(keys.workers) == 1  # the walk forgot the dead names it read
    finally:
        raw.close()


@pytest.mark.timeout(60)
def test_a_damaged_queue_costs_only_its_own_numbers_on_workers_and_events(
    own_redis: RedisServer,
) -> None:
    """A queue in the index whose events key is a string and whose workers key a hash (keys
    changed by hand): every other queue's workers and live events are still served."""
    raw = redis.Redis.from_url(own_redis.url)
    damaged = QueueKeys("damaged1")
    try:
        with Queue("healthy", url=own_redis.url) as q:
            q.enqueue("x")
            raw.sadd(INDEX, "damaged1")
            raw.set(damaged.seq, 1)
            raw.set(damaged.events, "notastream")
            raw.hset(damaged.workers, "a", "b")
            app = create_app(own_redis.url)
            with serve(app) as base, httpx.Client(base_url=base, timeout=20) as http:
                page = http.get("/workers")
                assert page.status_code == 200, page.text
                assert "damaged1" in page.text and "unavailable" in page.text
                got: list[dict[str, object]] = []

                def listen() -> None:
                    params = {"queue": "healthy"}
                    with httpx.stream("GET", f"{base}/events", params=params, timeout=20) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                got.append(json.loads(line[6:]))
                                return

                hub = app.state.dashboard.hub
                reader = threading.Thread(target=listen)
                reader.start()
                wait_for(lambda: hub.clients == 1, 10, "the event stream")
                job = q.enqueue("y")
                reader.join(15)
                assert got and got[0]["job"] == job.id, got
    finally:
        raw.close()
