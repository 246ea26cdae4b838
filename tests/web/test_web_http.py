"""The dashboard over HTTP (uvicorn on loopback, a real redis-server): who may act, what
is rendered as text, links under a mount point, paging, and the one events reader."""

from __future__ import annotations

import asyncio
import html
import json
import logging
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from sandboxq import Queue
from sandboxq.backends.base import Event, NewJob
from sandboxq.backends.memory import MemoryBackend
from sandboxq.cli import main
from sandboxq.models import JobState, Outcome
from sandboxq.testing.waiting import wait_for
from sandboxq.web import create_app
from sandboxq.web.app import CSP
from sandboxq.web.hub import CLIENT_BUFFER, Hub, Throughput, event_ms, outcome_of
from tests.support.contract import add, claim_one, record

from .support import TOKEN, serve

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def q(redis_url: str, queue_name: str) -> Queue:
    queue = Queue(queue_name, url=redis_url)
    yield queue  # type: ignore[misc]
    queue.close()


def failed_job(q: Queue, job_id: str | None = None, error: str = "boom") -> str:
    """A job that failed, made through the backend (no worker needed)."""
    job = q.options(job_id=job_id).enqueue("x") if job_id else q.enqueue("x")
    claimed = claim_one(q.backend)
    attempt = record(claimed, Outcome.ERROR, error=error)
    q.backend.finish("w1", claimed.id, claimed.token, "fail", attempt, error=error)
    return job.id


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]*)"', page)
    assert found is not None, "no CSRF field in the page"
    return html.unescape(found.group(1))


def test_read_only_dashboard_shows_and_refuses_every_action(redis_url: str, q: Queue) -> None:
    job_id = failed_job(q)
    app = create_app(redis_url, queues=[q.name])
    with serve(app) as base, httpx.Client(base_url=base) as http:
        page = http.get("/job", params={"queue": q.name, "id": job_id})
        assert page.status_code == 200 and "read-only" in page.text
        assert '<form method="post"' not in page.text  # no action buttons at all
        form = {"action": "retry", "queue": q.name, "id": job_id}
        refused = http.post("/action", data=form, headers={"Authorization": f"Bearer {TOKEN}"})
        assert refused.status_code == 403 and "read-only" in refused.text
        assert http.post("/login", data={"token": TOKEN}).status_code == 403
    assert q.job(job_id).state() == JobState.FAILED


def test_actions_need_the_token_and_a_same_origin_form_with_its_csrf_token(
    redis_url: str, q: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = failed_job(q)
    form = {"action": "retry", "queue": q.name, "id": job_id}
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    caplog.set_level(logging.INFO, logger="sandboxq.web")
    with serve(app) as base, httpx.Client(base_url=base) as http:
        assert http.post("/action", data=form).status_code == 401
        wrong = {"Authorization": "Bearer not-the-token-at-all-123"}
        assert http.post("/action", data=form, headers=wrong).status_code == 401
        assert http.post("/login", data={"token": "not-the-token-at-all-123"}).status_code == 403
        assert "sandboxq_session" not in http.cookies
        assert q.job(job_id).state() == JobState.FAILED

        login = http.post("/login", data={"token": TOKEN})
        assert login.status_code == 303
        cookie = login.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
        assert TOKEN.lower() not in cookie  # the cookie is a session, not the token
        # logged in, but a form without the session's CSRF token is refused
        assert http.post("/action", data=form).status_code == 403
        page = http.get("/job", params={"queue": q.name, "id": job_id})
        csrf = csrf_of(page.text)
        evil = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
        assert http.post("/action", data={**form, "csrf": csrf}, headers=evil).status_code == 403
        assert q.job(job_id).state() == JobState.FAILED

        done = http.post("/action", data={**form, "csrf": csrf}, headers={"Origin": base})
        assert done.status_code == 303
        assert q.job(job_id).state() == JobState.WAITING
        # a script's bearer header needs no cookie and no form token
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        cancel = {"action": "cancel", "queue": q.name, "id": job_id}
        assert httpx.post(f"{base}/action", data=cancel, headers=bearer).status_code == 303
        assert q.job(job_id).state() == JobState.CANCELLED
        purge = {"action": "purge", "queue": q.name, "state": "active"}
        assert httpx.post(f"{base}/action", data=purge, headers=bearer).status_code == 400
        purge["state"] = "cancelled"
        assert httpx.post(f"{base}/action", data=purge, headers=bearer).status_code == 303
        assert q.backend.get(job_id) is None
    logged = [r.getMessage() for r in caplog.records if r.name == "sandboxq.web"]
    assert any("retry" in m and "refused" in m for m in logged), logged
    assert any("retry" in m and "retried" in m for m in logged), logged
    assert any("cancel" in m and "cancelled" in m for m in logged), logged
    assert any("purge" in m and "purged 1" in m for m in logged), logged


def test_what_a_job_carries_is_rendered_as_text(redis_url: str, q: Queue, tmp_path: Path) -> None:
    job_id = failed_job(
        q, '<script>alert("id")</script>', error="<img src=x onerror=alert(1)> \u202eevil"
    )
    planted = tmp_path / "unpickled"

    class Plant:  # unpickling it would create a directory: the dashboard must not
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.mkdir, (str(planted),))

    payload = pickle.dumps([[Plant()], {}])
    ((pickled_id, _),) = q.backend.enqueue([NewJob(payload, "pickle", "{}", "pickled")])
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    with serve(app) as base, httpx.Client(base_url=base) as http:
        pages = [
            http.get("/job", params={"queue": q.name, "id": job_id}),
            http.get("/queue", params={"name": q.name, "state": "failed"}),
            http.get("/job", params={"queue": q.name, "id": pickled_id}),
        ]
        for page in pages:
            assert page.status_code == 200
            assert page.headers["content-security-policy"] == CSP
            assert "<script>alert" not in page.text and "<img src=x" not in page.text
            scripts = re.findall(r"<script[^>]*>", page.text)
            assert scripts == ['<script src="/static/app.js" defer>'], scripts
        assert "&lt;script&gt;alert(&quot;id&quot;)&lt;/script&gt;" in pages[0].text
        assert "&lt;img src=x onerror=alert(1)&gt;" in pages[0].text
        # a bidi override shown as its escape: it would reverse what follows it
        assert "\u202e" not in pages[0].text and "alert(1)&gt; \\u202eevil" in pages[0].text
        assert "pickle payload, not decoded" in pages[2].text
    assert not planted.exists()


def test_the_job_page_shows_the_new_options_and_an_attempts_memory(
    redis_url: str, q: Queue
) -> None:
    q.options(deadline_s=90, max_queue_s=30, progress_timeout_s=5).enqueue("x")
    claimed = claim_one(q.backend)
    attempt = record(claimed, Outcome.ERROR, error="over").model_copy(
        update={"outcome": Outcome.MEMORY_LIMIT, "memory_limit_mb": 60.0, "peak_memory_mb": 61.5}
    )
    q.backend.finish("w1", claimed.id, claimed.token, "fail", attempt, error="over")
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    with serve(app) as base, httpx.Client(base_url=base) as http:
        page = http.get("/job", params={"queue": q.name, "id": claimed.id}).text
    for shown in ("deadline_s", "max_queue_s", "progress_timeout_s", "61.5 / 60 MB"):
        assert shown in page, shown


def test_mounted_under_a_prefix_every_link_stays_under_it(redis_url: str, q: Queue) -> None:
    from fastapi import FastAPI

    job_id = failed_job(q)
    service = FastAPI()
    dashboard = create_app(redis_url, queues=[q.name], token=TOKEN)
    service.mount("/admin/queues", dashboard)
    try:
        with serve(service) as base, httpx.Client(base_url=base) as http:
            urls = ["/admin/queues/", f"/admin/queues/queue?name={q.name}&state=failed"]
            urls.append(f"/admin/queues/job?queue={q.name}&id={job_id}")
            urls.append("/admin/queues/workers")
            for url in urls:
                page = http.get(url)
                assert page.status_code == 200, url
                links = re.findall(r'(?:href|src|action|data-events)="([^"]*)"', page.text)
                outside = [u for u in links if u and not u.startswith("/admin/queues/")]
                assert links and not outside, (url, outside)
            assert http.get("/admin/queues/static/app.js").status_code == 200
            assert (
                http.post("/admin/queues/login", data={"token": TOKEN})
                .headers["set-cookie"]
                .lower()
                .count("path=/admin/queues/")
                == 1
            )
    finally:
        dashboard.state.dashboard.close()


def test_pages_walk_every_job_once_and_search_needs_the_exact_id(redis_url: str, q: Queue) -> None:
    jobs = q.enqueue_many([((i,), {}) for i in range(120)])
    app = create_app(redis_url, queues=[q.name])
    seen: list[str] = []
    with serve(app) as base, httpx.Client(base_url=base) as http:
        url: str | None = f"/queue?name={q.name}&state=waiting"
        while url is not None:
            page = http.get(url)
            assert page.status_code == 200
            for link in re.findall(r'<a href="([^"]*)" class="job-id">', page.text):
                seen += parse_qs(urlsplit(html.unescape(link)).query)["id"]
            more = re.search(r'<a href="([^"]*)" class="next">', page.text)
            url = html.unescape(more.group(1)) if more else None
        assert seen == [job.id for job in jobs]
        found = http.get("/queue", params={"name": q.name, "id": jobs[7].id}, follow_redirects=True)
        assert found.url.path == "/job" and jobs[7].id in found.text
        partial = http.get("/queue", params={"name": q.name, "id": jobs[7].id[:-1]})
        assert "No job" in partial.text and partial.url.path == "/queue"


def test_one_events_reader_fans_out_to_every_stream(redis_url: str, q: Queue) -> None:
    app = create_app(redis_url, queues=[q.name])
    got: dict[int, list[dict[str, object]]] = {0: [], 1: []}

    def listen(n: int, base: str) -> None:
        with httpx.stream("GET", f"{base}/events", params={"queue": q.name}, timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got[n].append(json.loads(line[6:]))
                    return

    with serve(app) as base:
        hub = app.state.dashboard.hub
        threads = [threading.Thread(target=listen, args=(n, base)) for n in got]
        for thread in threads:
            thread.start()
        wait_for(lambda: hub.clients == 2, 10, "two event streams")
        job = q.enqueue("hello")
        for thread in threads:
            thread.join(10)
        readers = [t for t in threading.enumerate() if t.name == "sandboxq-dashboard-events"]
        assert len(readers) == 1
    for messages in got.values():
        assert messages == [{"queue": q.name, "kind": "added", "job": job.id, "data": {}}]


def test_a_stream_that_falls_behind_is_dropped_not_buffered(queue_name: str) -> None:
    backend = MemoryBackend(queue_name)
    hub = Hub(lambda: [queue_name], lambda name: backend)
    job_id = add(backend)
    claimed = claim_one(backend)

    async def never_read() -> None:
        watcher = hub.subscribe(queue_name, None)  # the queue's page: coalesced
        client = hub.subscribe(queue_name, job_id)  # the job's page: every event
        await asyncio.to_thread(wait_for, lambda: queue_name in hub._after, 5, "the reader")
        for n in range(CLIENT_BUFFER + 50):
            assert backend.record_progress("w1", job_id, claimed.token, n / 1000, None)
        while not client.dropped:
            await asyncio.sleep(0.01)
        assert client.inbox.qsize() == 1 and client.inbox.get_nowait() is None
        assert hub.dropped == 1 and hub.clients == 1
        # the queue-wide stream held one message, the first, and was never dropped
        assert not watcher.dropped and watcher.inbox.qsize() == 1

    try:
        asyncio.run(asyncio.wait_for(never_read(), 10))
    finally:
        hub.close()


def test_dashboard_verb_refuses_a_short_token_and_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    short = tmp_path / "token"
    short.write_text("hunter2\n")
    assert main(["dashboard", "--url", redis_url, "--token-file", str(short)]) == 2
    assert "at least 16" in capsys.readouterr().err
    assert main(["dashboard", "--url", "memory://"]) == 2
    assert "memory://" in capsys.readouterr().err
    assert main(["dashboard", "--url", redis_url, "--token-file", str(tmp_path / "no")]) == 2
    assert "cannot read the dashboard token file" in capsys.readouterr().err


def test_queues_are_found_without_being_named(redis_url: str) -> None:
    # The session's server holds hundreds of queues by now and the overview shows the
    # first 200 by name (saying so): this one's name sorts first.
    q = Queue(f"0-{uuid.uuid4().hex[:12]}", url=redis_url)
    try:
        q.enqueue("x")
        app = create_app(redis_url)
        with serve(app) as base, httpx.Client(base_url=base) as http:
            overview = http.get("/")
            assert f'<a href="/queue?name={q.name}">{q.name}</a>' in overview.text
            assert http.get("/queue", params={"name": "not a queue!"}).status_code == 400
    finally:
        q.close()


def test_a_stream_started_late_gets_what_it_missed(queue_name: str) -> None:
    backend = MemoryBackend(queue_name)
    hub = Hub(lambda: [queue_name], lambda name: backend)

    async def late() -> None:
        first = hub.subscribe(queue_name, None)  # starts the reader
        await asyncio.to_thread(wait_for, lambda: queue_name in hub._after, 5, "the reader")
        page_read_at = hub.position()  # a page notes this, then reads the backend
        ((job_id, _),) = backend.enqueue([NewJob(b"[[],{}]")])
        await asyncio.wait_for(first.inbox.get(), 5)
        # ... and its stream starts only now: the event is replayed to it
        stream = hub.subscribe(queue_name, job_id, since=page_read_at)
        replayed = stream.inbox.get_nowait()
        assert replayed is not None and (replayed["kind"], replayed["job"]) == ("added", job_id)
        assert stream.inbox.empty()
        # a position from before the replay buffer (or another process) asks for a reload
        stale = hub.subscribe(queue_name, None, since=hub.position() + 10)
        reload = stale.inbox.get_nowait()
        assert reload is not None and reload["kind"] == "reload"

    try:
        asyncio.run(asyncio.wait_for(late(), 10))
    finally:
        hub.close()


def test_producers_and_other_verbs_never_load_the_web_stack() -> None:
    code = (
        "import sys, sandboxq, sandboxq.cli; from sandboxq import Queue; "
        "Queue('q').enqueue(1); sandboxq.cli.build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('starlette', 'uvicorn', 'sandboxq') and (m.startswith('sandboxq.web') or "
        "not m.startswith('sandboxq'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_throughput_counts_each_ended_attempt_once_by_outcome() -> None:
    now = 1_700_000_000_000
    events = [
        Event(f"{now - 1000}-0", "completed", "a", {"outcome": "ok"}),
        Event(f"{now - 2000}-0", "retried", "b", {"outcome": "hard_timeout"}),
        Event(f"{now - 3000}-0", "retried", "b", {"manual": "1"}),  # a user's retry
        Event(f"{now - 4000}-0", "stalled", "c", {"state": "failed"}),
        Event(f"{now - 4000}-1", "failed", "c", {"outcome": "lease_lost"}),
        Event(f"{now - 5000}-0", "stalled", "d", {"state": "waiting"}),
        Event(f"{now - 9 * 60_000}-0", "failed", "e", {"outcome": "crashed"}),
        Event(f"{now - 30 * 60_000}-0", "failed", "f", {"outcome": "crashed"}),  # too old
        Event(f"{now - 1000}-1", "progress", "a", {"fraction": "0.5"}),
        # forged: an outcome no attempt can have (a megabyte each bloated every overview)
        *(Event(f"{now - 1000}-{9 + i}", "failed", "z", {"outcome": "x" * i}) for i in (5, 6)),
    ]
    throughput = Throughput()
    for event in events:
        if (outcome := outcome_of(event)) is not None:
            throughput.add("q", outcome, event_ms(event) or 0)
    assert throughput.recent("q", now, 1) == {
        "ok": 1,
        "hard_timeout": 1,
        "lease_lost": 2,
        "other": 2,
    }
    assert throughput.recent("q", now, 15)["crashed"] == 1
    assert throughput.recent("other", now, 15) == {}


def test_an_unreachable_redis_is_a_page_that_says_so() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = create_app(f"redis://127.0.0.1:{port}/0", queues=["jobs"])
    with serve(app) as base, httpx.Client(base_url=base) as http:
        for path in ["/", "/queue?name=jobs", "/job?queue=jobs&id=a", "/workers"]:
            page = http.get(path)
            assert page.status_code == 503, path
            assert f"127.0.0.1:{port}" in page.text and "Traceback" not in page.text


def test_memory_queues_of_this_process_are_shown(queue_name: str) -> None:
    q = Queue(queue_name, url="memory://")
    job = q.options(job_id="in-process").enqueue({"size": 256})
    app = create_app("memory://")
    with serve(app) as base, httpx.Client(base_url=base) as http:
        assert f'<a href="/queue?name={queue_name}">' in http.get("/").text
        page = http.get("/job", params={"queue": queue_name, "id": job.id})
        assert page.status_code == 200 and "{&quot;size&quot;: 256}" in page.text


def test_a_live_memory_queue_shows_past_hundreds_emptied_ones(queue_name: str) -> None:
    """A long-lived process (a test run, a notebook) makes hundreds of memory queues; those
    emptied since are no queues any more, and must not push a live one past the cap."""
    for n in range(250):
        old = Queue(f"{queue_name}-old-{n:03d}", url="memory://")
        old.enqueue(n)
        old.backend.purge(JobState.WAITING)
    live = Queue(f"{queue_name}-zz-live", url="memory://")
    live.enqueue(1)
    app = create_app("memory://")
    with serve(app) as base, httpx.Client(base_url=base) as http:
        assert f'<a href="/queue?name={live.name}">' in http.get("/").text


@pytest.mark.alone  # a page within 0.4 s
@pytest.mark.timeout(30)
def test_every_wrong_token_is_answered_after_half_a_second_without_stalling_others(
    redis_url: str, q: Queue
) -> None:
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    form = {"action": "purge", "queue": q.name, "state": "cancelled"}
    wrong = {"Authorization": "Bearer not-the-token-at-all-123"}

    def timed(do: Callable[[], object]) -> tuple[object, float]:
        started = time.monotonic()
        status = do()
        return status, time.monotonic() - started

    with serve(app) as base, httpx.Client(base_url=base) as http:
        http.get("/")  # the first page's reads are not what is timed
        for name, do in [
            ("bearer", lambda: http.post("/action", data=form, headers=wrong).status_code),
            (
                "form",
                lambda: http.post("/login", data={"token": "wrong-wrong-wrong-1"}).status_code,
            ),
        ]:
            status, took = timed(do)
            assert status in (401, 403) and took >= 0.5, (name, status, took)
        # the pause is awaited: while ten wrong tokens wait, another request is answered
        with ThreadPoolExecutor(11) as pool:
            refused = [
                pool.submit(timed, lambda: httpx.post(f"{base}/action", data=form, headers=wrong))
                for _ in range(10)
            ]
            time.sleep(0.1)
            _, page_s = timed(lambda: http.get("/login").status_code)
            results = [f.result(10) for f in refused]
        assert page_s < 0.4, page_s
        assert all(took < 1.5 for _, took in results), results


@pytest.mark.timeout(90)
def test_dashboard_verb_that_cannot_serve_says_why_in_one_line_with_exit_2(
    tmp_path: Path, redis_url: str
) -> None:
    """Bad settings are one line on stderr and exit 2, before any line claims it serves."""
    binary = tmp_path / "token"
    binary.write_bytes(b"\xff\xfe0123456789abcdefgh")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        with socket.socket() as probe:  # a port nothing listens on once closed
            probe.bind(("127.0.0.1", 0))
            free = str(probe.getsockname()[1])
        cases = {
            "port in use": ["--port", busy],
            "port too high": ["--port", "70000"],
            "negative port": ["--port", "-1"],
            "unknown host": ["--host", "no-such-host.invalid", "--port", free],
            "non-UTF-8 token file": ["--port", free, "--token-file", str(binary)],
        }
        for case, words in cases.items():
            done = subprocess.run(
                [sys.executable, "-m", "sandboxq", "dashboard", "--url", redis_url, *words],
                capture_output=True,
                text=True,
                timeout=20,
                env=os.environ,  # PYTHONPATH included: the code under test
            )
            lines = done.stderr.splitlines()
            assert done.returncode == 2, (case, done.returncode, done.stderr)
            assert len(lines) == 1 and "error: " in lines[0], (case, done.stderr)
            assert "Traceback" not in done.stderr and "dashboard on http" not in done.stderr


@pytest.mark.timeout(60)
def test_sigterm_stops_the_dashboard_while_pages_hold_their_event_streams(
    redis_url: str, q: Queue
) -> None:
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "sandboxq", "dashboard", "--url", redis_url]
    dashboard = subprocess.Popen(
        [*command, "--port", str(port), "--queue", q.name],
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ,  # PYTHONPATH included: the code under test
    )
    streams: list[tuple[httpx.Client, httpx.Response, Iterator[str]]] = []
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(base), 20, "the dashboard to serve")
        for path in ("/events", f"/events?queue={q.name}"):  # two open pages
            http = httpx.Client(timeout=30)
            response = http.send(http.build_request("GET", base + path), stream=True)
            lines = response.iter_lines()  # kept: a dropped iterator closes the stream
            assert next(lines) == "retry: 2000"
            streams.append((http, response, lines))
        started = time.monotonic()
        dashboard.terminate()
        rc = dashboard.wait(15)
        took = time.monotonic() - started
    finally:
        if dashboard.poll() is None:
            dashboard.kill()
            dashboard.wait()
        for http, response, _ in streams:
            response.close()
            http.close()
        stderr = dashboard.communicate()[1]
    # uvicorn ends by raising the signal it stopped for again, once it has shut down
    assert rc in (0, -signal.SIGTERM) and took < 3.0, (rc, took, stderr)
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr


@pytest.mark.timeout(60)
def test_the_audit_line_names_the_peer_not_a_forwarded_for_header(
    redis_url: str, q: Queue, tmp_path: Path
) -> None:
    """uvicorn took the client's address from X-Forwarded-For when the peer was local: a
    refused action was logged as coming from whatever address the request named."""
    token = tmp_path / "token"
    token.write_text("a-token-of-more-than-sixteen-characters")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "sandboxq", "dashboard", "--url", redis_url]
    dashboard = subprocess.Popen(
        [*command, "--port", str(port), "--token-file", str(token), "--queue", q.name],
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(base), 20, "the dashboard to serve")
        forged = {"X-Forwarded-For": "203.0.113.66", "Authorization": "Bearer wrong-token"}
        data = {"action": "purge", "queue": q.name, "state": "failed"}
        assert httpx.post(base + "/action", headers=forged, data=data).status_code == 401
    finally:
        dashboard.terminate()
        stderr = dashboard.communicate(timeout=15)[1]
    refused = [line for line in stderr.splitlines() if "refused from" in line]
    assert refused and all("refused from 127.0.0.1" in line for line in refused), stderr
    assert "203.0.113.66" not in stderr, stderr


def _answers(base: str) -> bool:
    try:
        return httpx.get(base + "/", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_a_session_ends_at_logout_and_only_a_same_origin_page_may_log_out(
    redis_url: str, q: Queue
) -> None:
    """A cookie copied before the logout (a proxy's log, a shared machine) is refused
    after it, and another site's page cannot log the operator out."""
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    with serve(app) as base, httpx.Client(base_url=base) as http:
        assert http.post("/login", data={"token": TOKEN}).status_code == 303
        copied = http.cookies["sandboxq_session"]
        page = http.get("/workers")
        assert 'action="/logout"' in page.text  # logged in: the page offers to log out
        other_port = {"Origin": "http://127.0.0.1:1", "Sec-Fetch-Site": "same-site"}
        refused = http.post("/logout", headers=other_port)
        assert refused.status_code == 403
        assert "sandboxq_session" in http.cookies
        assert http.post("/logout", headers={"Origin": base}).status_code == 303
        with httpx.Client(base_url=base, cookies={"sandboxq_session": copied}) as thief:
            after = thief.get("/workers")
            assert 'action="/logout"' not in after.text, "the session outlived its logout"


def test_a_session_cookie_past_its_life_is_refused() -> None:
    """The browser is told to drop the cookie after SESSION_S; the server does not rely
    on it: a cookie issued longer ago than that is refused however it was kept."""
    from starlette.requests import Request

    from sandboxq.web.auth import SESSION_S, Auth

    auth = Auth(TOKEN)

    def request_with(cookie: str) -> Request:
        header = f"sandboxq_session={cookie}".encode()
        return Request({"type": "http", "headers": [(b"cookie", header)]})

    assert auth.session(request_with(auth.new_cookie())) is not None
    sid, issued = "s" * 24, str(int(time.time() - SESSION_S - 60))
    stale = f"{sid}.{issued}.{auth._mac('session', f'{sid}.{issued}')}"
    assert auth.session(request_with(stale)) is None
    unsigned = f"{sid}.{int(time.time())}.{auth._mac('session', sid)}"  # the old form
    assert auth.session(request_with(unsigned)) is None


def test_a_refused_action_s_fields_cannot_forge_a_log_line(
    redis_url: str, q: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    caplog.set_level(logging.INFO, logger="sandboxq.web")
    forged = "cancel\n2026-01-01 00:00:00,000 WARNING sandboxq.web: dashboard login from 10.6.6.6"
    with serve(app) as base, httpx.Client(base_url=base) as http:
        form = {"action": forged, "queue": q.name + "\nx", "id": "j\r\ny"}
        assert http.post("/action", data=form).status_code == 401
    logged = [r.getMessage() for r in caplog.records if r.name == "sandboxq.web"]
    assert logged and not any("\n" in m or "\r" in m for m in logged), logged
