"""A worker's log while Redis is down: one line per cause per 10 s, with a count (a real
worker process, a real redis-server stopped and started again)."""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from sandboxq import Queue
from sandboxq.errors import BackendError
from sandboxq.observe.quiet import WINDOW_S, OutageFilter
from sandboxq.testing.redis_server import RedisServer
from sandboxq.testing.workers import BackgroundWorkers

H = "sandboxq.testing.handlers:"


@pytest.mark.timeout(60)
def test_a_worker_logs_one_line_per_cause_while_redis_is_down(
    queue_name: str, tmp_path: Path
) -> None:
    """The filter is on a real worker's loggers: over an outage of a few seconds, in which
    the fetcher alone, unlimited, logged a line every 0.1-2 s, each cause is one line.
    (Crossing the 10 s window is the filter's own test below, on a shorter window.)"""
    log = tmp_path / "worker.log"
    with (
        RedisServer() as server,
        Queue(queue_name, url=server.url) as q,
        BackgroundWorkers() as workers,
    ):
        worker = workers.spawn(queue_name, H + "echo", "--lease-s", "2", url=server.url, log=log)
        assert q.enqueue(1).result(timeout_s=30) == 1
        server.stop()
        time.sleep(3.0)  # the subject: Redis stays down for well over the fetcher's backoff
        assert worker.poll() is None, "the worker died while Redis was down"
        server.start()
        assert q.enqueue(2).result(timeout_s=30) == 2
    text = log.read_text()
    assert WINDOW_S == 10.0  # what the README promises
    # the first failed claim may see the server close the connection (a cause of its own);
    # every one after sees it refused
    claims = [line for line in text.splitlines() if "claim failed" in line]
    refused = [line for line in claims if "Connection refused" in line]
    assert len(refused) == 1, "\n".join(claims)
    causes = Counter(line.split(" ", 3)[-1] for line in text.splitlines() if "WARNING" in line)
    assert all(n == 1 for n in causes.values()), causes
    # and the end of the outage is a line of its own: the operator sees when it ended
    assert re.search(r"claims go through again, after \d+ failed", text), text


def test_the_first_line_after_the_window_counts_what_it_held_back() -> None:
    """Records offered for longer than a window, on the real clock: the first passes, the
    rest of that window are held, the first after it passes carrying their number."""
    window_s = 0.3
    quiet = OutageFilter(window_s=window_s)
    logger = logging.getLogger("sandboxq.test-quiet")
    down = BackendError("Redis at redis://h:1/0 is unreachable (claim): refused")
    passed: list[str] = []
    started = time.monotonic()
    while time.monotonic() - started < 1.5 * window_s:
        record = logger.makeRecord(
            logger.name, logging.WARNING, __file__, 1, "claim failed (%s)", (down,), None
        )
        if quiet.filter(record):
            passed.append(record.getMessage())
        time.sleep(0.01)
    assert len(passed) == 2, passed
    held = re.search(r"\((\d+) more like this in the last 0.3 s\)$", passed[1])
    assert held is not None and int(held.group(1)) >= 10, passed[1]


def test_distinct_causes_and_lines_without_an_error_are_never_held_back() -> None:
    quiet = OutageFilter(window_s=60.0)
    logger = logging.getLogger("sandboxq.test-quiet")
    records: list[logging.LogRecord] = []

    def emit(msg: str, *args: object) -> bool:
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, msg, args, None)
        passed = quiet.filter(record)
        if passed:
            records.append(record)
        return passed

    down = BackendError("Redis at redis://h:1/0 is unreachable (claim): refused")
    assert emit("claim failed (%s); retrying", down)
    assert not emit("claim failed (%s); retrying", down)
    assert emit("could not renew %d lease(s): %s", 2, down)  # another cause
    other = BackendError("Redis at redis://h:1/0 is unreachable (claim): timed out")
    assert emit("claim failed (%s); retrying", other)  # another error
    for job in ("a", "b", "a"):
        assert emit("job %s stalled (its lease expired): now %s", job, "waiting")
    assert len(records) == 6
