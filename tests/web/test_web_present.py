"""The dashboard against what an operator meets on day one (uvicorn on loopback, a real
redis-server): a forged Host header, a queue that was just created, a Redis that is down,
and hostile query parameters on every route."""

from __future__ import annotations

import socket

import httpx
import pytest

from sandboxq import Queue
from sandboxq.web import create_app

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


def test_allowed_hosts_add_names_and_star_turns_the_check_off(redis_url: str, q: Queue) -> None:
    app = create_app(redis_url, queues=[q.name], allowed_hosts=["queues.internal"])
    with serve(app) as base, httpx.Client(base_url=base) as http:
        assert http.get("/", headers={"host": "queues.internal:8686"}).status_code == 200
        assert http.get("/", headers={"host": "other.internal"}).status_code == 400
    app = create_app(redis_url, queues=[q.name], allowed_hosts=["*"])
    with serve(app) as base, httpx.Client(base_url=base) as http:
        assert http.get("/", headers={"host": "other.internal"}).status_code == 200
