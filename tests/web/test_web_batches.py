"""The dashboard's batch pages over HTTP (uvicorn on loopback, a real redis-server): the
list and the page with counts and failures grouped by outcome, their actions behind the
token, CSRF and Origin checks, and a hostile batch id and label shown as text."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import httpx
import pytest
import redis

from sandboxq import Queue
from sandboxq.backends.base import Backend
from sandboxq.models import JobState, Outcome
from sandboxq.web import create_app
from tests.support.contract import claim_one, record

from .support import TOKEN, serve
from .test_web_http import csrf_of

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def q(redis_url: str, queue_name: str) -> Iterator[Queue]:
    with Queue(queue_name, url=redis_url) as queue:
        yield queue


def end_one(backend: Backend, action: str, outcome: Outcome, error: str | None = None) -> str:
    claimed = claim_one(backend)
    attempt = record(claimed, outcome, error=error)
    backend.finish("w1", claimed.id, claimed.token, action, attempt, error=error)
    return claimed.id


def test_a_batch_page_shows_progress_and_failures_and_acts_behind_the_checks(
    redis_url: str, q: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    batch = q.batch([([i], {}) for i in range(5)], label="nightly <b>run</b>")
    end_one(q.backend, "complete", Outcome.OK)
    failed = [end_one(q.backend, "fail", Outcome.ERROR, "boom") for _ in range(2)]
    timed_out = end_one(q.backend, "fail", Outcome.HARD_TIMEOUT, "killed")
    caplog.set_level(logging.INFO, logger="sandboxq.web")
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    with serve(app) as base, httpx.Client(base_url=base) as http:
        listed = http.get("/batches", params={"queue": q.name})
        assert listed.status_code == 200 and f'href="/batch?queue={q.name}&amp;id={batch.id}"' in (
            listed.text
        )
        assert "nightly &lt;b&gt;run&lt;/b&gt;" in listed.text and "<b>run" not in listed.text
        assert '<progress class="batch" max="5" value="4">' in listed.text
        queue_page = http.get("/queue", params={"name": q.name})
        assert f'href="/batches?queue={q.name}"' in queue_page.text
        page = http.get("/batch", params={"queue": q.name, "id": batch.id})
        assert page.status_code == 200
        assert "4 of 5 finished" in page.text and ">error</td><td>other</td><td>2</td>" in page.text
        for job_id in (*failed, timed_out):
            assert f'href="/job?queue={q.name}&amp;id={job_id}"' in page.text
        assert "hard_timeout" in page.text
        assert 'value="batch_retry"' in page.text and 'value="batch_cancel"' in page.text
        assert f'data-events="/events?queue={q.name}' in page.text  # live, as the queue page

        form = {"action": "batch_retry", "queue": q.name, "id": batch.id}
        assert http.post("/action", data=form).status_code == 401  # no session
        assert http.post("/login", data={"token": TOKEN}).status_code == 303
        assert http.post("/action", data=form).status_code == 403  # no CSRF token
        csrf = csrf_of(http.get("/batch", params={"queue": q.name, "id": batch.id}).text)
        evil = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
        assert http.post("/action", data={**form, "csrf": csrf}, headers=evil).status_code == 403
        assert batch.progress().failed == 3
        done = http.post("/action", data={**form, "csrf": csrf}, headers={"Origin": base})
        assert done.status_code == 303 and done.headers["location"].startswith("/batch?")
        progress = batch.progress()
        assert (progress.failed, progress.waiting) == (0, 4)
        cancel = {"action": "batch_cancel", "queue": q.name, "id": batch.id, "csrf": csrf}
        assert http.post("/action", data=cancel, headers={"Origin": base}).status_code == 303
        assert batch.progress().cancelled == 4
        missing = {**cancel, "id": "0123456789abcdef"}
        assert http.post("/action", data=missing, headers={"Origin": base}).status_code == 400
        assert (
            http.get("/batch", params={"queue": q.name, "id": "0123456789abcdef"}).status_code
            == 404
        )
    logged = [r.getMessage() for r in caplog.records if r.name == "sandboxq.web"]
    assert any("batch_retry" in m and "refused" in m for m in logged), logged
    assert any("batch_retry" in m and "retried 3 member(s)" in m for m in logged), logged
    assert any("batch_cancel" in m and "cancelled 4 member(s)" in m for m in logged), logged


def test_a_hostile_batch_id_written_to_redis_is_shown_as_text(
    redis_url: str, q: Queue, raw: redis.Redis
) -> None:
    evil = '"><script>alert(1)</script>'
    raw.zadd(f"sq:{{{q.name}}}:batch_index", {evil: 1})
    raw.hset(f"sq:{{{q.name}}}:batch:{evil}", mapping={"total": 1, "label": "<img src=x>"})
    app = create_app(redis_url, queues=[q.name])
    with serve(app) as base, httpx.Client(base_url=base) as http:
        listed = http.get("/batches", params={"queue": q.name})
        assert listed.status_code == 200
        assert "<script>alert" not in listed.text and "<img src=x>" not in listed.text
        assert "&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in listed.text
        assert re.findall(r"<script[^>]*>", listed.text) == ['<script src="/static/app.js" defer>']
        # a page for that id is refused by the id check, and says so as text
        page = http.get("/batch", params={"queue": q.name, "id": evil})
        assert page.status_code == 400 and "<script>alert" not in page.text
    assert q.counts()[JobState.WAITING] == 0


def test_a_batch_whose_stream_is_damaged_still_shows_its_page(
    redis_url: str, q: Queue, raw: redis.Redis
) -> None:
    """The page groups failures from the batch's stream of finished members: a stream key
    of another type (written by hand) answered 503, "Unavailable", as an outage does. The
    counts and record show, and the page says what it could not read."""
    batch = q.batch([([1], {}), ([2], {})], label="damaged stream")
    done_key = f"sq:{{{q.name}}}:bdone:{batch.id}"
    raw.set(done_key, "not a stream")
    app = create_app(redis_url, queues=[q.name])
    with serve(app) as base, httpx.Client(base_url=base) as http:
        page = http.get("/batch", params={"queue": q.name, "id": batch.id})
    assert page.status_code == 200, page.text[:500]
    assert "damaged stream" in page.text and "Its finished members cannot be read" in page.text


def test_a_batch_page_shows_each_outcome_by_the_kind_of_error(redis_url: str, q: Queue) -> None:
    """The page said "error 3" for a ValueError, a KeyError and another ValueError."""
    q.batch([([i], {}) for i in range(4)])
    values = [end_one(q.backend, "fail", Outcome.ERROR, "builtins.ValueError: bad") for _ in "ab"]
    keyed = end_one(q.backend, "fail", Outcome.ERROR, "builtins.KeyError: 'k'")
    crashed = end_one(q.backend, "fail", Outcome.CRASHED, "crashed: SIGSEGV")
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    batch_id = values[0].rpartition(".")[0]
    with serve(app) as base, httpx.Client(base_url=base) as http:
        page = http.get("/batch", params={"queue": q.name, "id": batch_id}).text
    assert "<h2>failures by outcome and kind</h2>" in page
    assert "<td>error</td><td>ValueError</td><td>2</td>" in page
    assert "<td>error</td><td>KeyError</td><td>1</td>" in page
    assert "<td>crashed</td><td>crashed</td><td>1</td>" in page
    for job_id in (*values, keyed, crashed):
        assert f'href="/job?queue={q.name}&amp;id={job_id}"' in page
