"""The dashboard and the command line on records forged or damaged in Redis (a real
redis-server, the dashboard over HTTP): a damaged record costs the page that shows it
a one-line reason, never an outage banner, a 500 or a read without a bound."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from sandboxq import Queue
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.backends.redis.stats import INDEX
from sandboxq.cli import main
from sandboxq.models import Outcome, now_ms
from sandboxq.testing.waiting import wait_for
from sandboxq.web import create_app
from tests.support.contract import claim_one, record

from .support import TOKEN, serve

pytestmark = pytest.mark.timeout(60)

HUGE = "-" + "9" * 4000  # an integer Python parses, but no float or date can hold


@pytest.fixture
def q(redis_url: str, queue_name: str) -> Iterator[Queue]:
    with Queue(queue_name, url=redis_url) as queue:
        yield queue


@pytest.fixture
def http(redis_url: str) -> Iterator[httpx.Client]:
    """The dashboard discovering its queues (no --queue), as most operators run it."""
    with serve(create_app(redis_url, token=TOKEN)) as base, httpx.Client(base_url=base) as c:
        yield c


def failed(q: Queue) -> str:
    job = q.enqueue("x")
    claimed = claim_one(q.backend)
    attempt = record(claimed, Outcome.ERROR, error="boom")
    q.backend.finish("w1", claimed.id, claimed.token, "fail", attempt, error="boom")
    return job.id


def one_line_page(page: httpx.Response, status: int) -> str:
    assert page.status_code == status, page.text[:2000]
    assert "Traceback" not in page.text and 'id="outage"' not in page.text
    return page.text


def test_a_job_page_reads_the_newest_attempt_records_only(
    q: Queue, raw: redis.Redis, http: httpx.Client
) -> None:
    job_id = failed(q)
    entry = json.dumps({"attempt": 1, "outcome": "error", "error": "forged"})
    key = QueueKeys(q.name).history(job_id)
    for _ in range(10):
        raw.rpush(key, *[entry] * 5000)  # 50,001 records: the page used to show them all
    page = one_line_page(http.get("/job", params={"queue": q.name, "id": job_id}), 200)
    assert "only the newest 1000 of 50001 attempt records are read" in page
    assert page.count("forged") <= 1000
    assert len(page) < 2_000_000, len(page)


@pytest.mark.parametrize(
    "damage",
    ["history-a-string", "state-markup", "finished-huge", "lease-infinite", "job-a-list"],
)
def test_a_damaged_job_is_its_own_page_s_one_line_and_the_cli_s(
    q: Queue,
    raw: redis.Redis,
    http: httpx.Client,
    redis_url: str,
    capsys: pytest.CaptureFixture[str],
    damage: str,
) -> None:
    keys = QueueKeys(q.name)
    job_id = failed(q)
    if damage == "history-a-string":
        raw.delete(keys.history(job_id))
        raw.set(keys.history(job_id), "not a list")
    elif damage == "state-markup":
        raw.hset(keys.job(job_id), "state", "<b>zombie</b>")
    elif damage == "finished-huge":
        raw.hset(keys.job(job_id), "finished_ms", HUGE)
    elif damage == "lease-infinite":  # an active job whose lease never runs out
        raw.hset(keys.job(job_id), "state", "active")
        raw.zadd(keys.active, {job_id: float("inf")})
    else:
        raw.delete(keys.job(job_id))
        raw.rpush(keys.job(job_id), "not a hash")
    damaged_record = damage in ("state-markup", "job-a-list")
    page = http.get("/job", params={"queue": q.name, "id": job_id})
    text = one_line_page(page, 502 if damaged_record else 200)
    if damaged_record:
        assert "Damaged record" in text
    listed = http.get("/queue", params={"name": q.name, "state": "failed"})
    one_line_page(listed, 200)
    code = main(["job", q.name, job_id, "--url", redis_url])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    said = [line for line in err.splitlines() if "sandboxq.web" not in line]  # the page's log
    if damaged_record:
        assert code == 2 and len(said) == 1 and said[0].startswith("sandboxq: "), err
    else:
        assert code in (0, 1), err  # 1: the job shows as failed


def test_a_forged_depth_sample_costs_the_overview_nothing(
    q: Queue, raw: redis.Redis, redis_url: str
) -> None:
    q.enqueue("x")
    minute = int(time.time() // 60)
    raw.hset(QueueKeys(q.name).depth, str(minute), HUGE.lstrip("-"))
    raw.hset(QueueKeys(q.name).depth, HUGE, "3")
    # named: the session's server holds more queues than an overview shows
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    with serve(app) as base, httpx.Client(base_url=base) as http:
        page = one_line_page(http.get("/"), 200)
    assert f"/queue?name={q.name}" in page


def test_a_depth_history_padded_by_hand_costs_its_chart_only(
    q: Queue, raw: redis.Redis, redis_url: str
) -> None:
    """The overview's line read the whole depth hash in its script: a million fields held
    the server 1.8 s a page. One past what depth.lua keeps is not read."""
    q.enqueue("x")
    raw.hset(QueueKeys(q.name).depth, mapping={str(i): "1" for i in range(1000)})
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    with serve(app) as base, httpx.Client(base_url=base) as http:
        page = one_line_page(http.get("/"), 200)
    assert f"/queue?name={q.name}" in page and "waiting depth unavailable" in page


def test_a_damaged_queue_index_costs_discovery_only(
    q: Queue, raw: redis.Redis, http: httpx.Client
) -> None:
    job_id = q.enqueue("x").id
    saved = raw.smembers(INDEX)
    raw.delete(INDEX)
    raw.rpush(INDEX, "not a set")
    try:
        overview = one_line_page(http.get("/"), 200)
        assert "no queue can be listed" in overview and INDEX in overview
        one_line_page(http.get("/job", params={"queue": q.name, "id": job_id}), 200)
        one_line_page(http.get("/queue", params={"name": q.name}), 200)
    finally:
        raw.delete(INDEX)
        if saved:
            raw.sadd(INDEX, *saved)


def ended(app: object, queue: str) -> tuple[int, int, int]:
    """What the overview counts for ``queue``: attempts ended in the last 5 and 15 minutes,
    and in the chart's last two minutes (two: a test may cross a minute's end)."""
    throughput = app.state.dashboard.hub.throughput  # type: ignore[attr-defined]
    now = now_ms()
    chart = throughput.per_minute(queue, now, 2)
    return (
        sum(throughput.recent(queue, now, 5).values()),
        sum(throughput.recent(queue, now, 15).values()),
        sum(sum(minute.values()) for minute in chart),
    )


def test_an_event_dated_in_the_future_costs_the_throughput_nothing(
    q: Queue, raw: redis.Redis, redis_url: str
) -> None:
    """Stream ids only increase: after one entry added by hand at 99999999999999-0, every
    XADD of the scripts is dated then too. Those were counted in a minute 3,000 years
    ahead, which no chart shows, which never ages out, and whose arrival dropped every
    real minute (the window was kept from the newest minute back)."""
    before = [failed(q) for _ in range(2)]
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    with serve(app) as base, httpx.Client(base_url=base) as http:
        one_line_page(http.get("/"), 200)  # starts the reader
        wait_for(lambda: ended(app, q.name) == (2, 2, 2), 10, "the two read back")
        raw.xadd(QueueKeys(q.name).events, {"kind": "progress", "job": "x"}, id="99999999999999-0")
        after = [failed(q) for _ in range(3)]
        wait_for(lambda: ended(app, q.name) == (5, 5, 5), 10, "five counted as they came")
        page = one_line_page(http.get("/"), 200)
        assert f"sq:{{{q.name}}}:events" in page and "in the future" in page
    # a dashboard started now reads the stream back: the three after the forged entry
    # cannot be dated, and are not counted in any minute
    app = create_app(redis_url, queues=[q.name], token=TOKEN)
    with serve(app) as base, httpx.Client(base_url=base) as http:
        one_line_page(http.get("/"), 200)
        wait_for(lambda: ended(app, q.name) == (2, 2, 2), 10, "the two dated ones read back")
        # the note comes once the read-back has reached the stream's end, after the counts
        # it makes on the way: a page read between the two had none
        note = "3 ended attempts after it could not be dated"
        wait_for(lambda: note in http.get("/").text, 10, "the damage noted")
        page = one_line_page(http.get("/"), 200)
        assert note in page, page
    assert len(set(before + after)) == 5
