"""No secret in any output: a worker, a producer and every CLI verb run with a URL that
holds a password (and a secret query option), every failure path is provoked, and
everything captured is searched for the secret: log records, stdout and stderr, the
worker registry in Redis, exception texts and reprs."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import quote

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxq import Queue
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.cli import main
from sandboxq.errors import SandboxqError
from sandboxq.redaction import redact_url
from sandboxq.testing.redis_server import free_port
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from sandboxq.worker import SandboxWorker

from .support import H

pytestmark = pytest.mark.timeout(90)

SECRET = "Pw-" + uuid.uuid4().hex  # unique: a hit can only be a leak


@pytest.fixture
def secret_url(raw: redis.Redis) -> Iterator[str]:
    """A URL of the session's server for a user whose password is ``SECRET``."""
    name = f"user-{uuid.uuid4().hex[:8]}"
    raw.execute_command("ACL", "SETUSER", name, "on", f">{SECRET}", "~*", "&*", "+@all")
    port = raw.connection_pool.connection_kwargs["port"]
    yield f"redis://{name}:{SECRET}@127.0.0.1:{port}/0"
    raw.execute_command("ACL", "DELUSER", name)


def _failures(url: str, queue: str) -> Iterator[Callable[[], object]]:
    """Calls that fail, each with the secret somewhere in what it was given."""
    user = url.split("//")[1].split(":")[0]
    dead = f"redis://{user}:{SECRET}@127.0.0.1:{free_port()}/0"
    wrong = url.replace(SECRET, SECRET + "-wrong")
    yield lambda: Queue(queue, url=dead).enqueue(1)  # unreachable
    yield lambda: Queue(queue, url=wrong).counts()  # wrong password: the secret is a prefix
    yield lambda: Queue(queue, url=f"redis://{user}:{SECRET}@127.0.0.1:x/0").counts()
    yield lambda: Queue(queue, url=f"http://{user}:{SECRET}@127.0.0.1/0")
    yield lambda: Queue(queue, url=f"rediss+sentinel://h:1/m?ssl_password={SECRET}&x=1")
    yield lambda: Queue(
        queue, url=f"rediss://127.0.0.1:{free_port()}/0?ssl_password={SECRET}"
    ).counts()
    yield lambda: Queue(queue, url=f"redis+sentinel://:{SECRET}@127.0.0.1:{free_port()}/m").counts()
    yield lambda: SandboxWorker(queue, H + "echo", url=dead, concurrency=1).run(burst=True)
    yield lambda: SandboxWorker(queue, H + "echo", url=url, concurrency=-1)


def test_no_output_anywhere_holds_the_password(
    secret_url: str,
    raw: redis.Redis,
    queue_name: str,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    workers = BackgroundWorkers(join_timeout_s=20)
    try:
        worker = workers.start(queue_name, H + "echo", url=secret_url, concurrency=1, lease_s=2.0)
        seen += [repr(worker.backend), str(worker.stats)]
        with Queue(queue_name, url=secret_url) as q:
            seen += [repr(q.backend)]
            done = q.enqueue("x")
            assert done.result(timeout_s=30) == "x"
            wait_for(lambda: q.backend.workers(), 10, "the worker's registry entry")
            seen += [repr(q.backend.workers())]
        keys = QueueKeys(queue_name)
        for key in raw.scan_iter(match=f"sq:{{{queue_name}}}:*"):
            if raw.type(key) == b"string":
                seen.append(repr(raw.get(key)))
        job_id = done.id
        for verb in (["info", queue_name], ["jobs", queue_name], ["job", queue_name, job_id]):
            for flags in ([], ["--json"]):
                main([*verb, "--url", secret_url, *flags])
        main(["enqueue", queue_name, "--args", '["y"]', "--wait", "--url", secret_url])
        assert keys.workers  # the registry was read above
    finally:
        workers.stop_all()
    for fail in _failures(secret_url, queue_name):
        with pytest.raises((SandboxqError, ValueError)) as caught:
            fail()
        seen += [str(caught.value), repr(caught.value), str(caught.value.__cause__ or "")]
    port = free_port()
    for verb in (["info", queue_name], ["worker", queue_name, H + "echo", "--burst"]):
        assert main([*verb, "--url", f"redis://u:{SECRET}@127.0.0.1:{port}/0"]) == 2
    out, err = capsys.readouterr()
    seen += [out, err, caplog.text, *(r.getMessage() for r in caplog.records)]
    leaks = [text for text in seen if SECRET in text]
    assert not leaks, f"the password appeared in {len(leaks)} output(s), e.g. {leaks[0][:500]!r}"
    assert "***" in err  # the URLs were named, redacted


@settings(deadline=None, max_examples=200)
@given(
    password=st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=20),
    shape=st.sampled_from(
        [
            "redis://user:{pw}@h:1/0",
            "rediss://:{pw}@h:1/0?ssl_ca_certs=/ca.pem",
            "redis+sentinel://:{pw}@h1:1,h2:2/main/0",
            "rediss+cluster://u:{pw}@[::1]:7000,h:7001",
            "rediss://h:1/0?ssl_certfile=/c&ssl_password={pw}",
            "unix://:{pw}@/tmp/redis.sock?db=0",
            "redis://user:{pw}@[::1/0",  # malformed
        ]
    ),
)
def test_redact_url_hides_any_password(password: str, shape: str) -> None:
    secret = "Pw-" + password
    for written in {quote(secret, safe=""), secret.replace("@", "%40").replace("/", "%2F")}:
        url = shape.format(pw=written)
        shown = redact_url(url)
        assert written not in shown and secret not in shown, (url, shown)
        assert "***" in shown
