"""A batch's waits (``as_completed``, ``wait``, ``results``; sync and asyncio) while Redis
is unreachable: they go on as ``Job.result`` does (``finished.Outage``), from where the
stream was read, and raise ``BackendUnreachable`` if it still is at their timeout.

Each test has a redis-server of its own, stopped (SIGSTOP) and continued (SIGCONT) by the
test: the unreachable server of a Sentinel failover or a restart, without either. The
members are finished by the test through the backend (no worker), so which of them end
before and after the outage is decided here; the steps are ordered with events, the
outage's start by the one line ``Outage`` logs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sandboxq import Queue, aio
from sandboxq.errors import BackendUnreachable
from sandboxq.testing.redis_server import RedisServer
from tests.support.contract.support import claim_one, finish

pytestmark = pytest.mark.timeout(60)

#: Short, so each try against the stopped server ends soon.
SOCKET_TIMEOUT_S = 0.5


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A server of this test's own: it is stopped, and a shared one must not be."""
    with RedisServer() as started:
        assert started.process is not None
        try:
            yield started
        finally:
            os.kill(started.process.pid, signal.SIGCONT)  # however the test ended


class OutageMet(threading.Event):
    """Set when a wait logs that the backend is unreachable (``Outage``'s one line);
    ``lines``: those lines."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []


@pytest.fixture
def outage_met() -> Iterator[OutageMet]:
    """An ``OutageMet`` for the test's waits."""
    met = OutageMet()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "unreachable" in record.getMessage():
                met.lines.append(record.getMessage())
                met.set()

    logger = logging.getLogger("sandboxq.finished")
    handler, level = Seen(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield met
    logger.removeHandler(handler)
    logger.setLevel(level)


def stop(server: RedisServer) -> None:
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)


def cont(server: RedisServer) -> None:
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGCONT)


def finish_next(q: Queue, value: Any) -> str:
    """Claim the next member (they are claimed in input order) and complete it."""
    claimed = claim_one(q.backend)
    finish(q.backend, claimed, result=json.dumps(value).encode())
    return claimed.id


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``target()`` run in a thread; its answer, or what it raised, in the list."""
    got: list[Any] = []

    def run() -> None:
        try:
            got.append(target())
        except Exception as exc:  # the failure the old code had, for the assert
            got.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("side", ["threads", "asyncio"])
def test_as_completed_goes_on_from_its_cursor_while_redis_is_unreachable(
    side: str, server: RedisServer, queue_name: str, outage_met: OutageMet
) -> None:
    """Two members are yielded, the server stops, the iteration meets it, the server goes
    on and the last two end: each member is yielded once, none is skipped (the stream's
    cursor outlives the outage). The old code raised BackendUnreachable at its first
    failed read."""
    two, stopped = threading.Event(), threading.Event()
    with Queue(queue_name, url=server.url, socket_timeout_s=SOCKET_TIMEOUT_S) as q:
        batch = q.batch([([i], {}) for i in range(4)])
        ended = [finish_next(q, i) for i in range(2)]

        def took(seen: list[str], job_id: str) -> None:
            seen.append(job_id)
            if len(seen) == 2:  # the server is stopped before the next read
                two.set()
                assert stopped.wait(20)

        def iterate() -> list[str]:
            seen: list[str] = []
            if side == "threads":
                for job in q.get_batch(batch.id).as_completed(timeout_s=30):
                    took(seen, job.id)
                return seen

            async def main() -> list[str]:
                async with aio.Queue(
                    queue_name, server.url, socket_timeout_s=SOCKET_TIMEOUT_S
                ) as aq:
                    handle = await aq.get_batch(batch.id)
                    async for job in handle.as_completed(timeout_s=30):
                        took(seen, job.id)
                return seen

            return asyncio.run(main())

        thread, got = in_thread(iterate)
        try:
            assert two.wait(20), got
            stop(server)
            stopped.set()
            assert outage_met.wait(20), got
        finally:
            cont(server)
        ended += [finish_next(q, i) for i in range(2, 4)]
        thread.join(30)
        assert got == [ended], got
        # one line for the one outage, naming the batch waited for
        assert len(outage_met.lines) == 1, outage_met.lines
        assert outage_met.lines[0].startswith(f"waiting for batch {batch.id!r}: ")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["wait", "results"])
@pytest.mark.parametrize("side", ["threads", "asyncio"])
def test_a_batch_wait_goes_on_while_redis_is_unreachable(
    side: str, call: str, server: RedisServer, queue_name: str, outage_met: OutageMet
) -> None:
    """The server is stopped before the wait begins and continued once the wait has met
    it; then the members end, and the wait returns as if nothing had happened."""
    ready, stopped = threading.Event(), threading.Event()
    with Queue(queue_name, url=server.url, socket_timeout_s=SOCKET_TIMEOUT_S) as q:
        batch = q.batch([([i], {}) for i in range(3)])

        def answer(got: Any) -> Any:
            return got.total if call == "wait" else got

        def waits() -> Any:
            if side == "threads":
                handle = q.get_batch(batch.id)
                ready.set()
                assert stopped.wait(20)
                return answer(getattr(handle, call)(timeout_s=30))

            async def main() -> Any:
                async with aio.Queue(
                    queue_name, server.url, socket_timeout_s=SOCKET_TIMEOUT_S
                ) as aq:
                    handle = await aq.get_batch(batch.id)
                    ready.set()
                    assert stopped.wait(20)
                    return answer(await getattr(handle, call)(timeout_s=30))

            return asyncio.run(main())

        thread, got = in_thread(waits)
        try:
            assert ready.wait(20), got
            stop(server)
            stopped.set()
            assert outage_met.wait(20), got
        finally:
            cont(server)
        for i in range(3):
            finish_next(q, i * 10)
        thread.join(30)
        assert got == [3 if call == "wait" else [0, 10, 20]], got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["as_completed", "results"])
@pytest.mark.parametrize("side", ["threads", "asyncio"])
def test_a_batch_wait_past_its_timeout_while_redis_is_unreachable_raises_unreachable(
    side: str, call: str, server: RedisServer, queue_name: str
) -> None:
    """Redis stopped throughout: the wait tries until its timeout, then raises
    ``BackendUnreachable`` (not TimeoutError: the members' fate is unknown). The old code
    raised it at once."""
    timeout_s = 2.0
    with Queue(queue_name, url=server.url, socket_timeout_s=SOCKET_TIMEOUT_S) as q:
        batch = q.batch([([i], {}) for i in range(2)])

        def sync_wait() -> None:
            handle = q.get_batch(batch.id)
            stop(server)
            if call == "as_completed":
                list(handle.as_completed(timeout_s=timeout_s))
            else:
                handle.results(timeout_s=timeout_s)

        async def async_wait() -> None:
            async with aio.Queue(queue_name, server.url, socket_timeout_s=SOCKET_TIMEOUT_S) as aq:
                handle = await aq.get_batch(batch.id)
                stop(server)
                if call == "as_completed":
                    async for _job in handle.as_completed(timeout_s=timeout_s):
                        pass
                else:
                    await handle.results(timeout_s=timeout_s)

        started = time.monotonic()
        with pytest.raises(BackendUnreachable):
            if side == "threads":
                sync_wait()
            else:
                asyncio.run(async_wait())
        took_s = time.monotonic() - started
        cont(server)
        # each try waits out the socket timeout; the last may end up to one past it
        assert timeout_s - 0.5 <= took_s <= timeout_s + 2 * SOCKET_TIMEOUT_S + 1.0, took_s
