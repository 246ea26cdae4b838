"""A worker and a producer as Redis ACL users with exactly ``acl.rules(queue, role)``
(the rules the README documents): both do their whole job; the producer cannot start a
worker (a clear NOPERM naming what is missing), and neither reaches another queue."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from sandboxq import Queue
from sandboxq.backends.redis import acl
from sandboxq.backends.redis.keys import INDEX
from sandboxq.backends.redis.scripts import function_name, library
from sandboxq.errors import BackendError
from sandboxq.models import JobState
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from sandboxq.worker import SandboxWorker
from tests.support.server_stats import libraries

from .support import H, cli

pytestmark = pytest.mark.timeout(60)

README = Path(__file__).resolve().parents[2] / "README.md"
MakeUser = Callable[[str, acl.Role], str]


@pytest.fixture
def acl_user(raw: redis.Redis, redis_server: object) -> Iterator[MakeUser]:
    """``make(queue, role)``: a new ACL user with the role's rules; returns its URL."""
    made: list[str] = []
    port = raw.connection_pool.connection_kwargs["port"]

    def make(queue: str, role: acl.Role) -> str:
        name, password = f"{role}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
        raw.execute_command("ACL", "SETUSER", name, "on", f">{password}", *acl.rules(queue, role))
        made.append(name)
        return f"redis://{name}:{password}@127.0.0.1:{port}/0"

    yield make
    if made:
        raw.execute_command("ACL", "DELUSER", *made)


def test_a_worker_and_a_producer_work_with_exactly_the_documented_rules(
    acl_user: MakeUser, queue_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    producer_url = acl_user(queue_name, "producer")
    worker_url = acl_user(queue_name, "worker")
    workers = BackgroundWorkers(join_timeout_s=20)
    try:
        workers.start(queue_name, H + "echo", url=worker_url, concurrency=1, lease_s=3.0)
        with Queue(queue_name, url=producer_url) as q:
            job = q.enqueue("as a producer")
            assert job.result(timeout_s=30) == "as a producer"
            assert job.info().history[0].outcome.value == "ok"
            assert q.counts()[JobState.COMPLETED] == 1
            assert {e.kind for e in q.events()} >= {"added", "active", "completed"}
            assert q.backend.workers()  # the registry is readable
            later = q.options(delay_s=3600).enqueue("never runs")
            assert later.cancel() and later.state() is JobState.CANCELLED
            assert q.backend.retry_failed(later.id)
        for verb in (["info", queue_name], ["jobs", queue_name], ["job", queue_name, job.id]):
            code, _, err = cli(capsys, *verb, "--url", producer_url, "--json")
            assert code == 0, err
    finally:
        workers.stop_all()


def test_a_producer_user_cannot_act_as_a_worker(acl_user: MakeUser, queue_name: str) -> None:
    producer_url = acl_user(queue_name, "producer")
    worker = SandboxWorker(queue_name, H + "echo", url=producer_url, concurrency=1)
    with pytest.raises(BackendError) as caught:
        worker.run(burst=True)
    message = str(caught.value)
    assert "permission denied" in message and "register worker" in message, message
    assert re.search(r"permissions to (run the '(set|sadd)' command|access)", message), message
    assert producer_url.split(":")[2].split("@")[0] not in message  # the password


def test_a_user_of_one_queue_cannot_touch_another(acl_user: MakeUser, queue_name: str) -> None:
    producer_url = acl_user(queue_name, "producer")
    with Queue(queue_name + "-other", url=producer_url) as other:
        with pytest.raises(BackendError, match=r"permission denied.*keys"):
            other.enqueue("x")


@pytest.mark.parametrize("role", acl.ROLES)
def test_a_user_of_one_queue_can_only_add_to_the_shared_queue_index(
    acl_user: MakeUser, raw: redis.Redis, queue_name: str, role: acl.Role
) -> None:
    """The index is shared by every queue on the server: a queue's user who could delete
    it and put a list in its place stopped every other queue's enqueues and workers."""
    url = acl_user(queue_name, role)
    with redis.Redis.from_url(url) as as_user:
        for command in (["DEL", INDEX], ["LPUSH", INDEX, "x"], ["SREM", INDEX, "other"]):
            with pytest.raises(redis.exceptions.NoPermissionError):
                as_user.execute_command(*command)
    assert raw.type(INDEX) in (b"set", b"none")


def test_a_damaged_queue_index_costs_discovery_never_an_enqueue_or_a_worker(
    raw: redis.Redis, redis_url: str, queue_name: str
) -> None:
    kept = raw.dump(INDEX)
    raw.delete(INDEX)
    raw.rpush(INDEX, "changed by hand")
    workers = BackgroundWorkers(join_timeout_s=20)
    try:
        with Queue(queue_name, url=redis_url) as q:
            job = q.enqueue("still")
            workers.start(queue_name, H + "echo", url=redis_url, concurrency=1)
            assert job.result(timeout_s=30) == "still"
            with pytest.raises(BackendError, match=f"the queue index {INDEX} holds a list"):
                q.backend.queue_index()
    finally:
        workers.stop_all()
        raw.delete(INDEX)
        if kept is not None:
            raw.restore(INDEX, 0, kept)


@pytest.mark.parametrize("role", acl.ROLES)
def test_a_queue_user_cannot_replace_the_scripts_library(
    acl_user: MakeUser, queue_name: str, raw: redis.Redis, role: acl.Role
) -> None:
    """A function runs with its caller's rights: a user who could load a library named as
    ours would run its code as every queue's worker. The documented users cannot load,
    delete or flush functions; they run the scripts with EVALSHA (content-addressed)."""
    digest, text = library()
    raw.execute_command("FUNCTION", "LOAD", "REPLACE", text)
    forged = (
        f"#!lua name=sandboxq_{digest}\n"
        f"redis.register_function('{function_name(digest, 'finish')}', function() return 1 end)"
    )
    hostile = redis.Redis.from_url(acl_user(queue_name, role))
    try:
        for command in (
            ["FUNCTION", "LOAD", "REPLACE", forged],
            ["FUNCTION", "DELETE", f"sandboxq_{digest}"],
            ["FUNCTION", "FLUSH"],
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                hostile.execute_command(*command)
    finally:
        hostile.close()
    assert libraries(raw)[f"sandboxq_{digest}"] == text


def test_a_user_who_may_call_but_not_load_functions_runs_an_emptied_server(
    acl_user: MakeUser, queue_name: str, raw: redis.Redis
) -> None:
    """``+fcall`` without ``function|load``: the library an administrator loaded is used;
    once the server has lost it (FUNCTION FLUSH) the load is refused and the scripts go on
    with EVALSHA, reloaded in turn when the script cache is emptied."""
    raw.execute_command("FUNCTION", "LOAD", "REPLACE", library()[1])
    url = acl_user(queue_name, "producer")
    name = url.split("//")[1].split(":")[0]
    raw.execute_command("ACL", "SETUSER", name, "+fcall")
    with Queue(queue_name, url=url) as q:
        before = raw.info("commandstats").get("cmdstat_fcall", {}).get("calls", 0)
        q.enqueue("with the library")
        assert raw.info("commandstats")["cmdstat_fcall"]["calls"] > before
        raw.execute_command("FUNCTION", "FLUSH")
        q.enqueue("after its loss")
        raw.script_flush()
        q.enqueue("after the script cache's loss too")
        assert q.counts()[JobState.WAITING] == 3
    assert libraries(raw) == {}


@pytest.mark.parametrize("role", acl.ROLES)
def test_the_readme_documents_exactly_these_rules(role: acl.Role) -> None:
    documented = " ".join(acl.rules("QUEUE", role))
    assert documented in README.read_text(encoding="utf-8"), (
        f"the README's ACL rules for a {role} differ from acl.rules('QUEUE', {role!r}):\n"
        f"{documented}"
    )


def test_a_batch_with_exactly_the_documented_rules_and_a_then_queue_out_of_reach(
    acl_user: MakeUser, queue_name: str, raw: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A producer user makes batches and reads their progress; a worker user runs them
    (every member's move keeps the batch's counters, with HINCRBY). The follow-up of the
    batch whose ``then`` queue the worker's user cannot reach is not sent: the member still
    finishes, the batch says why, and the worker logs it."""
    producer_url = acl_user(queue_name, "producer")
    worker_url = acl_user(queue_name, "worker")
    workers = BackgroundWorkers(join_timeout_s=20)
    try:
        workers.start(queue_name, H + "echo", url=worker_url, concurrency=1, lease_s=3.0)
        with Queue(queue_name, url=producer_url) as q, caplog.at_level("WARNING"):
            own = q.batch([([i], {}) for i in range(3)], then=queue_name)
            assert own.results(timeout_s=30) == [0, 1, 2]
            assert own.progress().then_sent and own.progress().then_error is None
            assert q.job(own.id + ".then").result(timeout_s=30)["completed"] == 3
            away = q.batch([([1], {})], then=queue_name + "-elsewhere")
            assert away.results(timeout_s=30) == [1]
            progress = away.progress()
            assert progress.done and progress.completed == 1 and progress.then_sent is False
            assert progress.then_error is not None and "can't access" in progress.then_error
            logged = f"batch {away.id!r} of queue {queue_name!r} is done: the follow-up to queue"
            # the worker logs once the finish's reply is back: after results() may return
            wait_for(lambda: logged in caplog.text, 10, "the worker to log the then_error")
        assert raw.exists(f"sq:{{{queue_name}-elsewhere}}:job:{away.id}.then") == 0
    finally:
        workers.stop_all()


def test_a_then_queue_key_of_the_wrong_type_does_not_abort_the_finish(
    redis_url: str, queue_name: str, raw: redis.Redis
) -> None:
    """A hostile (or broken) ``then`` queue: its waiting set is a string. The last member's
    finish still applies whole; the batch says why no follow-up was sent."""
    then = queue_name + "-then"
    raw.set(f"sq:{{{then}}}:waiting", "not a sorted set")
    workers = BackgroundWorkers(join_timeout_s=20)
    try:
        with Queue(queue_name, url=redis_url) as q:
            batch = q.batch([([1], {}), ([2], {})], then=then)
            workers.start(queue_name, H + "echo", url=redis_url, concurrency=1)
            assert batch.results(timeout_s=30) == [1, 2]
            progress = batch.progress()
            assert (progress.completed, progress.active, progress.done) == (2, 0, True)
            assert progress.then_error is not None and "is a string, not a zset" in (
                progress.then_error
            )
            assert q.counts()[JobState.ACTIVE] == 0
        assert raw.exists(f"sq:{{{then}}}:job:{batch.id}.then") == 0
    finally:
        workers.stop_all()


def test_every_command_the_scripts_call_is_in_the_rules() -> None:
    """A command a script calls that the rules leave out fails only on the path that
    calls it, for a user with exactly these rules: a rare path (a retention switch, a
    damaged record) would meet NOPERM in production first. So every call in lua/ is
    checked against the list, whichever path it is on, but for the scripts of readers of
    every queue (the exporter, the dashboard, ``sandboxq queues``), which no worker or
    producer runs."""
    lua = Path(acl.__file__).resolve().parent / "lua"
    every_queue = {"stats.lua", "index_sizes.lua"}
    called = {
        name.lower()
        for path in lua.glob("*.lua")
        if path.name not in every_queue
        for name in re.findall(
            r"redis\.p?call\(\s*'([A-Za-z|]+)'", path.read_text(encoding="utf-8")
        )
    }
    assert len(called) > 20, called  # the pattern still finds the calls
    for role in acl.ROLES:
        allowed = set(acl.commands(role))
        assert called <= allowed, (role, sorted(called - allowed))
