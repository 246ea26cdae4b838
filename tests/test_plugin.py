"""The pytest plugin (sandboxq/pytest_plugin.py): its fixtures used directly by this suite
(the plugin is active here, as wherever sandboxq is installed), and pytest runs of small
test files in a subprocess for what only a whole run shows: teardown after a failure, the
orphan check, a missing redis-server, the options and environment variable."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from sandboxq import ConfigError, JobFailed
from sandboxq.client import Job, Queue
from sandboxq.models import JobState, Outcome
from sandboxq.pool.kill import ended
from sandboxq.testing.cases import CASES, HandlerCase
from sandboxq.testing.redis_server import RedisServer, free_port
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import StartWorker

pytest_plugins = ["pytester"]

H = "sandboxq.testing.handlers:"


# -- the fixtures, used directly ------------------------------------------------------------


def run_case(case: HandlerCase, queue: Queue, start_worker: StartWorker) -> Job:
    """Run ``case`` once, on a worker of one child; its job, once it ended as the case says."""
    start_worker(case.processor, concurrency=1, **case.worker_options)
    job = queue.enqueue(*case.args)
    assert queue.backend.wait_for_finish(job.id, 30) is not None, f"{case.id}: never ended"
    case.check(job.info().history[-1])
    return job


@pytest.mark.timeout(60)
def test_every_handler_case_produces_its_outcome(
    sandboxq_misbehaving_handler: HandlerCase, sandboxq_queue: Queue, sandboxq_worker: StartWorker
) -> None:
    job = run_case(sandboxq_misbehaving_handler, sandboxq_queue, sandboxq_worker)
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=1)
    assert failed.value.outcome == sandboxq_misbehaving_handler.outcome


@pytest.mark.timeout(60)
@pytest.mark.sandboxq_no_orphans
def test_every_contained_handler_returns_and_leaves_nothing(
    sandboxq_contained_handler: HandlerCase, sandboxq_queue: Queue, sandboxq_worker: StartWorker
) -> None:
    job = run_case(sandboxq_contained_handler, sandboxq_queue, sandboxq_worker)
    job.result(timeout_s=1)


@pytest.mark.timeout(10)
def test_catalogue_covers_every_way_to_misbehave() -> None:
    hung = [c.id for c in CASES if c.hangs]
    assert len(hung) == 20 and all(c.endswith(("-soft", "-hard")) for c in hung)
    assert {c.outcome for c in CASES if not c.hangs} == {
        Outcome.EXIT,
        Outcome.CRASHED,
        Outcome.MEMORY_LIMIT,
        Outcome.ERROR,
    }


@pytest.mark.timeout(10)
def test_a_case_check_names_what_differs() -> None:
    case = next(c for c in CASES if c.id == "os_exit")
    from sandboxq.models import AttemptRecord

    wrong = AttemptRecord(attempt=1, outcome=Outcome.CRASHED, worker_id="w", signal=11)
    with pytest.raises(AssertionError, match=r"os_exit: outcome crashed, expected exit; exit code"):
        case.check(wrong)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sandboxq_hung_handler", ["hold_gil-soft"], indirect=True)
def test_cases_can_be_chosen_by_id(
    sandboxq_hung_handler: HandlerCase, sandboxq_memory_queue: Queue, sandboxq_worker: StartWorker
) -> None:
    case = sandboxq_hung_handler
    assert (case.id, case.outcome) == ("hold_gil-soft", Outcome.HARD_TIMEOUT)
    worker = sandboxq_worker(case.processor, **case.worker_options)
    assert worker.settings.url == "memory://"  # the test asked for the memory queue only
    job = sandboxq_memory_queue.enqueue()
    with pytest.raises(JobFailed):
        job.result(timeout_s=20)
    case.check(job.info().history[-1])


@pytest.mark.timeout(30)
def test_worker_serves_the_redis_queue_and_an_explicit_one(
    sandboxq_queue: Queue,
    sandboxq_memory_queue: Queue,
    sandboxq_worker: StartWorker,
    sandboxq_redis_url: str,
) -> None:
    on_redis = sandboxq_worker(H + "echo")
    assert on_redis.settings.url == sandboxq_redis_url
    assert sandboxq_queue.enqueue(1, 2).result(timeout_s=20) == [[1, 2], {}]
    on_memory = sandboxq_worker(H + "echo", queue=sandboxq_memory_queue, burst=True)
    assert on_memory.settings.url == "memory://"
    assert sandboxq_memory_queue.enqueue("m").result(timeout_s=20) == "m"


@pytest.mark.timeout(30)
def test_a_worker_that_cannot_start_fails_the_fixture_call_naming_why(
    sandboxq_memory_queue: Queue, sandboxq_worker: StartWorker
) -> None:
    """The fixture returned before the worker had started: a test then waited out its
    own result's timeout ("did not finish within 5 s"), and the cause came at teardown."""
    asked = time.monotonic()
    with pytest.raises(ConfigError, match="no such user on this machine"):
        sandboxq_worker(H + "echo", queue=sandboxq_memory_queue, user="sq-no-such-user")
    assert time.monotonic() - asked < 10
    # the one that starts is running once the call returns: its pool is up
    worker = sandboxq_worker(H + "echo", queue=sandboxq_memory_queue)
    assert worker.started.is_set()


# -- whole pytest runs in a subprocess ----------------------------------------------------


# hypothesis's plugin imports all of hypothesis (1-2 s) at the end of every run.
_ARGS = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--timeout=60")


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(*_ARGS, *args)


def run_inline(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """In this process: quicker, for runs that start no process."""
    return pytester.runpytest_inprocess(*_ARGS, *args)


@pytest.fixture
def no_env_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SANDBOXQ_TEST_REDIS_URL", raising=False)


@pytest.mark.timeout(60)
def test_plugin_is_inert_for_tests_that_do_not_use_it(
    pytester: pytest.Pytester, no_env_url: None
) -> None:
    pytester.makepyfile(
        """
        import sys, psutil

        def test_plain(request):
            assert request.config.pluginmanager.has_plugin("sandboxq")
            # The plugin loads neither process machinery nor a Redis client up front.
            assert not {"sandboxq.worker", "multiprocess", "redis"} & set(sys.modules)
            assert not psutil.Process().children(recursive=True)
        """
    )
    run(pytester).assert_outcomes(passed=1)


@pytest.mark.timeout(90)
def test_worker_is_stopped_at_teardown_even_when_the_test_fails(
    pytester: pytest.Pytester, redis_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "log"
    pytester.makepyfile(
        f"""
        import os, time
        import pytest
        from sandboxq.client import Queue

        seen = {{}}

        def test_fails_while_a_job_runs(sandboxq_queue, sandboxq_worker, sandboxq_no_orphans):
            seen["queue"] = sandboxq_queue.name
            sandboxq_worker("sandboxq.testing.handlers:recorded_sleep")
            seen["job"] = sandboxq_queue.enqueue({str(log)!r}, "k", 60).id
            while not os.path.exists({str(log)!r}):
                time.sleep(0.02)
            assert False, "the test fails with its job running"

        def test_then_the_job_is_back_in_the_queue_and_its_child_gone(sandboxq_redis_url):
            ((start, pid, *_),) = [line.split() for line in open({str(log)!r})]
            assert start == "start"
            with pytest.raises(ProcessLookupError):
                os.kill(int(pid), 0)
            with Queue(seen["queue"], sandboxq_redis_url) as queue:
                info = queue.job(seen["job"]).info()
            assert (info.state, info.attempts) == ("waiting", 0)
            assert [(a.outcome, a.action) for a in info.history] == [
                ("interrupted", "retry_uncharged")
            ]
        """
    )
    result = run(pytester, f"--sandboxq-redis-url={redis_url}")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*the test fails with its job running*"])
    assert "process(es) started by the test were still alive" not in result.stdout.str()


CTRL_C = """
import os, time

def test_waits_for_a_ctrl_c(sandboxq_queue, sandboxq_worker):
    sandboxq_worker("sandboxq.testing.handlers:echo")
    assert sandboxq_queue.enqueue(1).result(timeout_s=20) == 1
    open(os.environ["SQ_TEST_READY"], "w").close()
    time.sleep(60)
"""


@pytest.mark.timeout(90)
def test_a_ctrl_c_at_the_terminal_leaves_the_throwaway_redis_to_the_teardown(
    tmp_path: Path, no_env_url: None
) -> None:
    """The throwaway redis-server was in the terminal's process group: a Ctrl-C meant for
    pytest killed it first, and the workers' teardown then logged "claim failed (Redis
    ... is unreachable" and the like."""
    (tmp_path / "test_ctrl_c.py").write_text(CTRL_C)
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", *_ARGS, "test_ctrl_c.py"],
        cwd=tmp_path,
        env={**os.environ, "SQ_TEST_READY": str(ready)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a process group of its own, as a terminal gives
    )
    try:
        wait_for(ready.exists, 60, "the test to run")
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "KeyboardInterrupt" in out, out
    assert "unreachable" not in out and "Connection refused" not in out, out


LEAKY = """
import os, subprocess, sys, time

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]

def start_daemon(pid_file):
    # Double fork: the daemon is re-parented away from the child, which returns normally.
    if os.fork() == 0:
        proc = subprocess.Popen(SLEEPER, start_new_session=True)
        with open(pid_file, "w") as f:
            f.write(str(proc.pid))
        os._exit(0)
    os.wait()
    return "started"
"""


@pytest.mark.timeout(90)
def test_orphan_check_catches_leaked_processes(
    pytester: pytest.Pytester, redis_url: str, tmp_path: Path
) -> None:
    pytester.makepyfile(leaky=LEAKY)
    pytester.makepyfile(
        test_leaks=f"""
        import os, subprocess, sys
        import pytest
        from leaky import SLEEPER
        from sandboxq.testing.waiting import wait_for

        @pytest.mark.sandboxq_no_orphans
        def test_leaks_a_subprocess():
            subprocess.Popen(SLEEPER + ["marker-popen"])

        def test_fixture_form_a_daemon_started_by_a_job_dies_with_its_attempt(
            sandboxq_worker, sandboxq_no_orphans, sandboxq_queue
        ):
            # A control group would take the daemon down with its job: nothing to catch.
            sandboxq_worker("leaky:start_daemon", containment="process_tree")
            pid_file = {str(tmp_path / "daemon")!r}
            assert sandboxq_queue.enqueue(pid_file).result(timeout_s=20) == "started"

        @pytest.mark.sandboxq_no_orphans
        def test_leaks_a_daemon_of_its_own():
            # setsid, then its parent exits: re-parented away from the test's process
            subprocess.run(["setsid", "sh", "-c", " ".join(SLEEPER[:2]) + " 'import time; "
                            "time.sleep(60)' marker-daemon & exit 0"], check=True)

        @pytest.mark.sandboxq_no_orphans
        def test_leaks_a_process_named_like_redis():
            subprocess.Popen(SLEEPER + ["marker-redis-server-lookalike"])

        @pytest.mark.sandboxq_no_orphans
        def test_clean_with_a_hung_job(sandboxq_worker, sandboxq_queue):
            sandboxq_worker("sandboxq.testing.handlers:setsid_grandchild_hang")
            pid_file = {str(tmp_path / "grandchild")!r}
            sandboxq_queue.enqueue(pid_file)
            # Teardown comes with the job hung mid-run, its setsid grandchild started.
            wait_for(lambda: os.path.exists(pid_file), 20, "the grandchild to start")
        """
    )
    result = run(pytester, f"--sandboxq-redis-url={redis_url}", "-o", "sandboxq_orphan_grace_s=1")
    result.assert_outcomes(passed=5, errors=3)
    out = result.stdout.str()
    for test, marker in [
        ("test_leaks_a_subprocess", "marker-popen"),
        # a daemon double-forked by the test itself, and a process whose command line
        # names redis-server, got past the check: the first was re-parented to init, and
        # anything named so was taken for the suite's own server
        ("test_leaks_a_daemon_of_its_own", "marker-daemon"),
        ("test_leaks_a_process_named_like_redis", "marker-redis-server-lookalike"),
    ]:
        section = out.split(f"ERROR at teardown of {test}")[1].split(" ERROR at ")[0]
        assert "1 process(es) started by the test were still alive 1 s after" in section, out
        assert marker in section, section
    summary = out.split("short test summary")[1]
    assert "test_clean_with_a_hung_job" not in summary
    # The attempt boundary killed the daemon when its job returned: no orphan to report.
    assert "a_daemon_started_by_a_job" not in summary
    for pid_file in ("daemon", "grandchild"):
        pid = int((tmp_path / pid_file).read_text())
        assert ended(pid)


def printed(result: pytest.RunResult) -> tuple[str, str]:
    """The URL and queue name REDIS_USER printed."""
    (found,) = re.findall(r"URL (\S+) QUEUE (\S+)", result.stdout.str())
    return found[0], found[1]


REDIS_USER = """
import sys
import psutil

def test_redis(sandboxq_redis_url, sandboxq_queue, sandboxq_worker):
    print("URL", sandboxq_redis_url, "QUEUE", sandboxq_queue.name)
    sandboxq_worker("sandboxq.testing.handlers:echo")
    assert sandboxq_queue.enqueue(7).result(timeout_s=20) == 7
"""


@pytest.mark.timeout(60)
def test_missing_binary_skips_with_a_clear_message(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, no_env_url: None
) -> None:
    pytester.makepyfile(REDIS_USER)
    empty = pytester.mkdir("empty-bin")
    monkeypatch.setenv("PATH", str(empty))
    result = run_inline(pytester, "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*sandboxq: no Redis for this test: redis-server is not on PATH*"])

    result = run_inline(pytester, "--sandboxq-require-redis")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*redis-server is not on PATH: install it*"])

    result = run_inline(pytester, "-rs", "--sandboxq-redis-server=/nowhere/redis-server")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*'/nowhere/redis-server' was not found*"])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["option", "env"])
def test_an_existing_redis_is_used_and_nothing_is_started(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
    how: str,
) -> None:
    pytester.makepyfile(
        REDIS_USER
        + """
def test_no_server_of_our_own(sandboxq_redis_url):
    assert not [p for p in psutil.Process().children() if "redis-server" in p.name()]
"""
    )
    if how == "env":
        monkeypatch.setenv("SANDBOXQ_TEST_REDIS_URL", redis_url)
        result = run(pytester, "-s")
    else:
        monkeypatch.delenv("SANDBOXQ_TEST_REDIS_URL", raising=False)
        result = run(pytester, "-s", f"--sandboxq-redis-url={redis_url}")
    result.assert_outcomes(passed=2)
    url, queue_name = printed(result)
    assert url == redis_url
    with Queue(queue_name, redis_url) as queue:  # the job really went to our server
        assert queue.counts()[JobState.COMPLETED] == 1


@pytest.mark.timeout(60)
def test_an_unreachable_redis_url_is_a_clear_error(
    pytester: pytest.Pytester, no_env_url: None
) -> None:
    pytester.makepyfile(REDIS_USER)
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = run_inline(pytester, f"--sandboxq-redis-url={url}")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [f"*the Redis named by --sandboxq-redis-url is not usable: Redis at {url} is unreach*"]
    )


@pytest.mark.timeout(90)
def test_a_run_ended_by_pytest_timeout_leaves_no_redis_server_behind(
    pytester: pytest.Pytester, no_env_url: None, tmp_path: Path
) -> None:
    """pytest-timeout's thread method ends a hung run with os._exit: no fixture teardown
    runs, so the session's redis-server must end with the process that started it."""
    pid_file = tmp_path / "server.pid"
    pytester.makepyfile(
        f"""
import time
import redis

def test_hangs(sandboxq_redis_url):
    with redis.Redis.from_url(sandboxq_redis_url) as r:
        open({str(pid_file)!r}, "w").write(str(r.info("server")["process_id"]))
    time.sleep(600)
"""
    )
    result = run(pytester, "-p", "timeout", "--timeout=1", "--timeout-method=thread")
    assert "Timeout" in result.stdout.str() + result.stderr.str()
    server = int(pid_file.read_text())
    wait_for(lambda: ended(server), 10, "the session's redis-server to end with its run")


@pytest.mark.timeout(90)
def test_the_directory_a_killed_run_left_is_removed_by_the_next_start_and_no_live_one(
    pytester: pytest.Pytester, no_env_url: None, tmp_path: Path
) -> None:
    """A run that ends with os._exit (pytest-timeout, CI's kill -9) removes nothing: each
    left its server's directory in the temp directory for good. The next server started
    anywhere removes it, and leaves the directory of every server still running."""
    dir_file = tmp_path / "server.dir"
    pytester.makepyfile(
        f"""
import time
import redis

def test_hangs(sandboxq_redis_url):
    with redis.Redis.from_url(sandboxq_redis_url) as r:
        open({str(dir_file)!r}, "w").write(r.config_get("dir")["dir"])
    time.sleep(600)
"""
    )
    run(pytester, "-p", "timeout", "--timeout=1", "--timeout-method=thread")
    left = Path(dir_file.read_text())
    assert left.is_dir()  # nothing cleaned it up
    start_one = "from sandboxq.testing.redis_server import RedisServer; RedisServer().close()"
    with RedisServer() as live:
        subprocess.run([sys.executable, "-c", start_one], check=True, timeout=30)
        assert not left.exists()
        assert live.data_dir.is_dir()


@pytest.mark.timeout(90)
def test_own_server_on_a_unix_socket_is_stopped_after_the_session(
    pytester: pytest.Pytester, no_env_url: None
) -> None:
    pytester.makepyfile(REDIS_USER)
    result = run(pytester, "-s", "--sandboxq-redis-socket")
    result.assert_outcomes(passed=1)
    url, _ = printed(result)
    assert url.startswith("unix://") and url.endswith("/redis.sock?db=0")
    socket_dir = Path(url.removeprefix("unix://").split("?")[0]).parent
    assert not socket_dir.exists()  # the server stopped and its directory was removed


@pytest.mark.timeout(60)
def test_a_server_whose_free_port_was_taken_starts_on_another() -> None:
    """Between ``free_port()`` and the server's bind another process (a test suite
    running beside this one) can take the port. The server that then fails to bind must
    not take the other's answer for its own: it starts again on another port."""
    with RedisServer() as theirs:
        ours = RedisServer()
        ours.port = theirs.port  # the race, as it falls: ours chose it, theirs bound it
        with ours:
            assert ours.port != theirs.port and ours.process is not None
            with redis.Redis.from_url(ours.url) as raw:
                assert raw.info("server")["process_id"] == ours.process.pid


@pytest.mark.timeout(60)
def test_a_server_given_a_taken_port_fails_saying_why() -> None:
    with RedisServer() as theirs, pytest.raises(RuntimeError) as failed:
        with RedisServer(port=theirs.port):
            pass
    assert "exited with code 1" in str(failed.value), failed.value
    assert "Address already in use" in str(failed.value), failed.value


@pytest.mark.timeout(60)
def test_a_server_that_cannot_start_says_what_it_said_and_what_was_tried(
    tmp_path: Path,
) -> None:
    binary = tmp_path / "redis-server"
    binary.write_text(
        "#!/bin/sh\necho '1:M 27 Nov 2026 10:00:00.000 # Bad directive in config'\nexit 1\n"
    )
    binary.chmod(0o755)
    with pytest.raises(RuntimeError) as failed:
        with RedisServer(binary=str(binary)):
            pass
    said = str(failed.value)
    assert said.startswith("redis-server exited with code 1 (127.0.0.1:"), said
    assert ": Bad directive in config [" in said and str(binary) in said, said
    assert "it tried 3 free ports" in said, said


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fixture", "case"),
    [
        ("sandboxq_misbehaving_handler", "hang_forever"),
        # sandboxq_hung_handler took any case id: "segfault" gave a crash, not a hang,
        # and an unknown id listed every catalogue's 40 ids
        ("sandboxq_hung_handler", "segfault"),
    ],
)
def test_an_unknown_case_id_fails_naming_the_known_ones(
    pytester: pytest.Pytester, no_env_url: None, fixture: str, case: str
) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.parametrize("{fixture}", ["{case}"], indirect=True)
        def test_case({fixture}):
            pass
        """
    )
    result = run_inline(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [f"*{fixture}: unknown handler case '{case}'; known: sleep_forever-soft*"]
    )
    assert f"{case}," not in result.stdout.str()  # only the fixture's own cases are listed


@pytest.mark.timeout(60)
def test_the_catalogue_handlers_leave_no_pid_file_behind(tmp_path: Path) -> None:
    """Handlers given no pid file record their processes' pids in one of their own: each
    run of the catalogue left one in the temporary directory, for good."""
    script = (
        "from sandboxq import Pool\n"
        "H = 'sandboxq.testing.handlers:'\n"
        "for handler, args in [('daemonize_grandchild', (None, 'return')),\n"
        "                      ('fork_burst', (None, 20))]:\n"
        "    with Pool(H + handler, size=1) as pool:\n"
        "        pool.submit(*args).result(timeout=30)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=50)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("sandboxq-pids-")]
