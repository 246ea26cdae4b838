"""The overview's and the queue page's charts, drawn from what workers write, on both
backends (uvicorn on loopback; the real browser's view is in test_browser.py)."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from sandboxq import Queue
from sandboxq.backends.base import Claimed
from sandboxq.models import AttemptRecord, Outcome
from sandboxq.testing.waiting import wait_for
from sandboxq.web import create_app

from .support import serve

pytestmark = pytest.mark.timeout(30)


def attempt(claimed: Claimed, outcome: Outcome, took_ms: int) -> AttemptRecord:
    now_ms = time.time_ns() // 1_000_000
    return AttemptRecord(
        attempt=claimed.attempt,
        outcome=outcome,
        worker_id="w1",
        started_ms=now_ms - took_ms,
        ended_ms=now_ms,
        error=None if outcome is Outcome.OK else "boom",
    )


def finish(q: Queue, outcome: Outcome, took_ms: int) -> None:
    q.enqueue("x")
    (claimed,) = q.backend.claim("w1", 1, 30.0)
    action = "complete" if outcome is Outcome.OK else "fail"
    result = b"1" if outcome is Outcome.OK else None
    error = None if outcome is Outcome.OK else "boom"
    q.backend.finish(
        "w1", claimed.id, claimed.token, action, attempt(claimed, outcome, took_ms),
        result=result, error=error,
    )  # fmt: skip


def title(svg_class: str, page: str) -> str:
    found = re.search(rf'<svg class="chart {svg_class}"[^>]*><title>([^<]*)</title>', page)
    assert found is not None, f"no {svg_class} chart"
    return found.group(1)


def test_charts_show_finished_per_minute_depth_and_durations(url: str, queue_name: str) -> None:
    q = Queue(queue_name, url=url)
    try:
        app = create_app(url, queues=[queue_name])
        with serve(app) as base, httpx.Client(base_url=base) as http:
            assert "0 attempts ended" in title("finished", http.get("/").text)  # hub started
            for took_ms in (3, 4, 50, 2000):
                finish(q, Outcome.OK, took_ms)
            finish(q, Outcome.ERROR, 20)
            q.enqueue_many([((i,), {}) for i in range(7)])  # waiting
            q.backend.register_worker("w1", {"host": "h"}, 30.0)  # this minute's sample
            # the hub counts attempts ended from the events stream, as they come
            wait_for(
                lambda: (
                    "5 attempts ended in the last 60 minutes"
                    in title("finished", http.get("/").text)
                ),
                10,
                "the chart to count five attempts",
            )
            overview = http.get("/").text
            assert title("depth", overview) == (
                "jobs waiting: now 7 waiting, at most 7 in the last 60 minutes"
            )
            assert "this minute: ok 4, error 1" in overview
            page = http.get("/queue", params={"name": queue_name}).text
            assert "of 5 recently finished jobs" in title("durations", page)
            for bucket, said in (("&lt;10ms", "ok 2"), ("&lt;100ms", "ok 1, error 1"),
                                 ("&lt;10s", "ok 1")):  # fmt: skip
                assert f"<title>{bucket}: {said}</title>" in page, bucket
            assert "style=" not in overview + page  # the CSP refuses inline styles
    finally:
        q.close()
