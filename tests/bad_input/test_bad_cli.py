"""``sandboxq worker`` given bad input: exit status 2 and one line that names what was
wrong, never a traceback and never a hang; a usable command line still runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from sandboxq import JobState, Queue, cli
from sandboxq.testing.redis_server import free_port
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from tests.hostile.support import cli as cli_here

from .support import SHARED_ACROSS_EXAMPLES, H

pytestmark = pytest.mark.timeout(60)


def run_cli(
    *argv: str, env: dict[str, str] | None = None, timeout_s: float = 40, verb: str = "worker"
) -> tuple[int, str]:
    """``python -m sandboxq worker ...`` in its own process: (exit status, stderr). Unless
    the test names one, the worker gets a Redis URL nothing listens on: every refusal
    tested here must come before the worker first reaches for Redis."""
    nowhere = {"SANDBOXQ_URL": f"redis://127.0.0.1:{free_port()}/0"}
    done = subprocess.run(
        [sys.executable, "-m", "sandboxq", verb, *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **nowhere, **(env or {})},
        stdin=subprocess.DEVNULL,
    )
    return done.returncode, done.stderr


def refused_here(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    *argv: str,
    verb: str = "worker",
) -> tuple[int, str]:
    """As ``run_cli``, in this process (``cli.main``, a few milliseconds instead of a third
    of a second): for command lines refused before anything starts."""
    monkeypatch.setenv("SANDBOXQ_URL", f"redis://127.0.0.1:{free_port()}/0")
    code, _out, err = cli_here(capsys, verb, *argv)
    return code, err


def assert_one_line_error(status: int, stderr: str, needle: str) -> None:
    assert status == 2, stderr
    assert "Traceback" not in stderr and "usage:" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, stderr
    assert needle in errors[0], stderr


ECHO = H + "echo"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["q"], "the following arguments are required: processor"),
        (["q", ECHO, "--concurrency", "abc"], "argument --concurrency: invalid int value: 'abc'"),
        (["q", ECHO, "--concurrency", "0"], "concurrency: Input should be greater than or equal"),
        (["q", ECHO, "--lease-s", "nan"], "lease_s: Input should be a finite number"),
        (["q", ECHO, "--hard-timeout-s", "inf"], "hard_timeout_s: Input should be a finite"),
        (["q", ECHO, "--stop-timeout-s", "1e10"], "stop_timeout_s: Input should be less than"),
        (["q", ECHO, "--hard-timeout-s", "1e10"], "hard_timeout_s: Input should be less than"),
        (["q", ECHO, "--max-file-size-mb", "1e13"], "max_file_size_mb: Input should be less"),
        (["q", ECHO, "--max-address-space-mb", "1e13"], "max_address_space_mb: Input should"),
        (["q", ECHO, "--pool-memory-mb", "1e30"], "pool_memory_mb: Input should be less than"),
        (["q", ECHO, "--pool-memory-mb", "1.5"], "pool_memory_mb: Input should be greater than"),
        (["q", ECHO, "--group", "1" + "0" * 30], "group: Value error, a number must be at most"),
        (["q", ECHO, "--user", "1" + "0" * 30], "user: Value error, a number must be at most"),
        (["q", ECHO, "--soft-timeout-s", "5", "--hard-timeout-s", "1"], "must be less than"),
        (["q", ECHO, "--exit-code", "x=fail"], "--exit-code 'x=fail' is not N=ACTION"),
        (["q", ECHO, "--exit-code", "3"], "--exit-code '3' is not N=ACTION"),
        (["q", ECHO, "--exit-code", "300=fail"], "exit_codes.300.[key]: Input should be less"),
        (["q", ECHO, "--exit-code", "3=explode"], "exit_codes.3: Input should be 'complete'"),
        (["q", ECHO, "--exit-code", "-1=fail"], "exit_codes.-1.[key]: Input should be greater"),
        (
            ["q", ECHO, "--exit-code", "3=retry", "--exit-code", "3=fail"],
            "--exit-code 3=retry and --exit-code 3=fail: one action a code",
        ),
        (
            ["q", ECHO, "--retries", "-1"],
            "retries: Input should be greater than or equal to 0 (got -1)",
        ),
        (["q", ECHO, "--max-file-size-mb", "1e13"], "to 1073741824 (got 10000000000000.0)"),
        (["bad{q}", ECHO], "queue name 'bad{q}' is invalid"),
        (["q", ECHO, "--url", "http://x"], "unsupported backend URL 'http://x'"),
        (["q", ECHO, "--url", "redis://h:notaport/0"], "invalid Redis URL"),
        (["q", ECHO, "--url", "redis://h:6379/zero"], "the database must be a number"),
        (["q", "nope_not_a_module:fn"], "there is no module of that name"),
        (["q", H + "nope"], "has no attribute 'nope'"),
        (["q", "sandboxq.testing.handlers"], "is not of the form 'package.module:function'"),
        (["q", ":f"], "processor ':f' is not of the form 'package.module:function'"),
        (["q", H + "echo:x"], "is not of the form 'package.module:function'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_naming_the_problem(
    argv: list[str],
    needle: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert_one_line_error(*refused_here(capsys, monkeypatch, *argv), needle)


def test_an_exporter_that_cannot_serve_exits_2_with_one_line() -> None:
    """A port out of range, one in use or a host that is no address of this machine gave
    Python's traceback (OverflowError, OSError, gaierror) and exit 1."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        for argv, needle in [
            (["--port", "70000"], "--port must be 0-65535 (0: a free one), got 70000"),
            (["--port", "-1"], "--port must be 0-65535"),
            (["--port", busy], f"cannot serve on 127.0.0.1:{busy}: Address already in use"),
            (["--port", "0", "--host", "no such host"], "cannot serve on no such host:0: "),
        ]:
            assert_one_line_error(*run_cli(*argv, verb="exporter"), needle)


@pytest.mark.parametrize(
    "argv",
    [
        ["job", "q", "\udcff\udcfe"],  # the bytes ff fe: not UTF-8
        ["cancel", "q", "\udcff\udcfe"],
        ["retry", "q", "\udcff\udcfe"],
        ["retry", "q", "--json", "\udcff\udcfe"],  # taken after an option
        ["job", "q", "x" * 600],
    ],
)
def test_a_job_id_no_job_can_have_is_refused_before_redis_is_asked(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    verb, *rest = argv
    refusal = refused_here(capsys, monkeypatch, *rest, verb=verb)
    assert_one_line_error(*refusal, "is invalid: use 1-512 characters")


def test_an_unreachable_redis_exits_2_promptly() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    status, stderr = run_cli("q", ECHO, "--url", url, "--concurrency", "1")
    assert_one_line_error(status, stderr, f"Redis at {url} is unreachable")
    assert time.monotonic() - started < 30


def test_a_processor_that_hangs_at_import_exits_2_after_the_import_timeout(tmp_path: Path) -> None:
    module = f"sq_cli_hang_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("import time\nwhile True:\n    time.sleep(0.05)\n")
    env = {"PYTHONPATH": str(tmp_path), "SANDBOXQ_IMPORT_TIMEOUT_S": "1"}
    started = time.monotonic()
    status, stderr = run_cli("q", f"{module}:fn", env=env)
    assert_one_line_error(status, stderr, "importing its module did not finish within 1 s")
    assert time.monotonic() - started < 30  # the hung import thread does not hold up the exit
    status, stderr = run_cli("q", ECHO, env={"SANDBOXQ_IMPORT_TIMEOUT_S": "soon"})
    assert_one_line_error(status, stderr, "SANDBOXQ_IMPORT_TIMEOUT_S='soon'")
    # empty, as any other SANDBOXQ_ variable: not set (the worker goes on, to no Redis)
    status, stderr = run_cli("q", ECHO, env={"SANDBOXQ_IMPORT_TIMEOUT_S": ""})
    assert_one_line_error(status, stderr, "is unreachable")


@pytest.mark.timeout(60)
def test_a_duration_beyond_the_bound_is_refused_from_a_variable_and_by_run(
    tmp_path: Path,
) -> None:
    """Regression: a stop timeout of 1e10 s was accepted, the jobs ran, and the stop
    crashed with a traceback (a thread's wait overflowed: timestamp out of range for
    platform time_t), exit status 1."""
    status, stderr = run_cli("q", ECHO, env={"SANDBOXQ_STOP_TIMEOUT_S": "1e10"})
    assert_one_line_error(status, stderr, "SANDBOXQ_STOP_TIMEOUT_S='1e10': Input should be less")
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"args": [1]}\n')
    status, stderr = run_cli(
        ECHO, str(lines), "--concurrency", "1", "--stop-timeout-s", "1e23", verb="run"
    )
    assert_one_line_error(status, stderr, "stop_timeout_s: Input should be less than or equal")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout_s", ["nan", "-1", "inf", "soon"])
def test_a_wait_that_cannot_be_is_refused_before_the_job_is_enqueued(
    redis_url: str, queue_name: str, timeout_s: str
) -> None:
    """Regression: ``--timeout-s nan`` enqueued the job, printed its id, and only then
    failed, so a user who tried again made a second job; ``-1`` was taken."""
    status, stderr = run_cli(
        queue_name, "--args", "[1]", "--wait", "--timeout-s", timeout_s,
        env={"SANDBOXQ_URL": redis_url}, verb="enqueue",
    )  # fmt: skip
    needle = f"argument --timeout-s: expected a number from 0 to 315360000, got {timeout_s!r}"
    assert_one_line_error(status, stderr, needle)
    with Queue(queue_name, url=redis_url) as queue:
        assert sum(queue.counts().values()) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("limit", ["-1", "0", "99999999999999999999", "2.5"])
def test_a_jobs_limit_that_lists_nothing_or_overflows_is_refused(
    redis_url: str, queue_name: str, limit: str
) -> None:
    """Regression: ``jobs --limit -1`` and ``--limit 0`` said there were no jobs while
    there were; a limit past 64 bits was blamed on Redis ("failed to list waiting jobs:
    value is not an integer or out of range")."""
    with Queue(queue_name, url=redis_url) as queue:
        queue.enqueue()
    status, stderr = run_cli(
        queue_name, "--limit", limit, env={"SANDBOXQ_URL": redis_url}, verb="jobs"
    )
    needle = f"argument --limit: expected a whole number from 1 to 1000000, got {limit!r}"
    assert_one_line_error(status, stderr, needle)


#: JSON nested deeper than Python's JSON reader can recurse.
DEEP_ARRAY = "[" * 1000 + "]" * 1000
DEEP_OBJECT = '{"a": ' * 1000 + "1" + "}" * 1000


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flag", "deep"), [("--args", DEEP_ARRAY), ("--kwargs", DEEP_OBJECT)])
def test_json_nested_too_deeply_to_read_is_refused_in_one_line(
    redis_url: str, queue_name: str, flag: str, deep: str, tmp_path: Path
) -> None:
    """Regression: a JSON flag, variable or input line nested 1000 deep ended in a
    RecursionError traceback."""
    env = {"SANDBOXQ_URL": redis_url}
    status, stderr = run_cli(queue_name, flag, deep, env=env, verb="enqueue")
    assert_one_line_error(status, stderr, f"{flag} is nested too deeply to be read as JSON")
    with Queue(queue_name, url=redis_url) as queue:
        assert sum(queue.counts().values()) == 0
    status, stderr = run_cli("q", ECHO, env={"SANDBOXQ_EXIT_CODES": DEEP_ARRAY})
    assert_one_line_error(status, stderr, "SANDBOXQ_EXIT_CODES='[[[[")
    lines = tmp_path / "in.jsonl"
    lines.write_text(f'{{"args": [1]}}\n{{"args": {deep}}}\n')
    status, stderr = run_cli(ECHO, str(lines), "--strict", verb="run")
    assert status == 2 and "Traceback" not in stderr, stderr
    assert f"{lines} line 2: nested too deeply to be read as JSON\n" in stderr, stderr


@pytest.mark.timeout(60)
def test_a_resumed_run_refuses_what_is_nested_too_deeply_in_its_label_or_output(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """Regression: ``run --resume`` read the batch's label (from a Redis others may write)
    and the output file's lines as JSON, and one nested 1000 deep was a traceback."""
    at = ["--url", redis_url, "--queue", queue_name]
    out = tmp_path / "out.jsonl"
    with Queue(queue_name, url=redis_url) as queue:
        forged = queue.batch([([1], {})], label=DEEP_ARRAY)
    status, stderr = run_cli("--resume", forged.id, *at, "--output", str(out), verb="run")
    assert_one_line_error(status, stderr, "was not sent by sandboxq run")
    source = tmp_path / "in.jsonl"
    source.write_text('{"args": [1]}\n')
    status, stderr = run_cli(
        ECHO, str(source), *at, "--concurrency", "1", "--output", str(out), verb="run"
    )
    assert status == 0, stderr
    sent = next(line for line in stderr.splitlines() if line.startswith("sandboxq: batch "))
    batch_id = sent.split()[2].rstrip(":")
    out.write_text(out.read_text() + DEEP_OBJECT + "\n")
    status, stderr = run_cli("--resume", batch_id, *at, "--output", str(out), verb="run")
    assert_one_line_error(status, stderr, f"{out} line 2 is not a line sandboxq run wrote")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("presses", [1, 2])
def test_a_worker_stopped_by_ctrl_c_exits_130(
    workers: BackgroundWorkers, redis_url: str, queue_name: str, tmp_path: Path, presses: int
) -> None:
    """Regression: the README gives 130 for "stopped by Ctrl-C", but a worker that Ctrl-C
    drained (once) or stopped (twice) exited 0. Ctrl-C is SIGINT to the terminal's whole
    process group: the worker is started as a shell would start it, and so signalled."""
    runs, log = tmp_path / "runs", tmp_path / "worker.log"
    proc = workers.spawn(
        queue_name, H + "recorded_sleep", "--concurrency", "1",
        url=redis_url, log=log, new_session=True,
    )  # fmt: skip
    with Queue(queue_name, url=redis_url) as queue:
        job = queue.enqueue(str(runs), "job", 1.5 if presses == 1 else 60)
        wait_for(lambda: runs.exists() and "start" in runs.read_text(), 30, "the job to start")
        os.killpg(proc.pid, signal.SIGINT)
        if presses == 2:
            wait_for(lambda: "received SIGINT: draining" in log.read_text(), 10, "the drain")
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 130, log.read_text()
        # once: the drain let the job finish; twice: it was stopped, and put back
        expected = JobState.COMPLETED if presses == 1 else JobState.WAITING
        assert job.info().state is expected
    assert "Traceback" not in log.read_text()


# -- any option value: a burst run, or exit 2 with one line ----------------------------------

FLAGS = {
    "--concurrency": st.sampled_from(["1", "2", "0", "-1", "1.5", "abc", "", "99999"]),
    "--lease-s": st.sampled_from(["0.3", "5", "0", "-1", "nan", "inf", "1e300", "x"]),
    "--soft-timeout-s": st.sampled_from(["1", "0", "-1", "nan", "inf", "1e300", "1e-300"]),
    "--hard-timeout-s": st.sampled_from(["2", "0", "-1", "nan", "inf", "1e300", "3e6"]),
    "--retries": st.sampled_from(["0", "3", "-1", "1001", "x"]),
    "--max-memory-mb": st.sampled_from(["64", "0", "-5", "nan", "1e300"]),
    "--max-jobs-per-child": st.sampled_from(["1", "0", "-1"]),
    "--prefetch": st.sampled_from(["0", "5", "-1", "1001"]),
    "--stop-timeout-s": st.sampled_from(["0", "1", "-1", "nan", "inf"]),
    "--containment": st.sampled_from(["auto", "process_tree", "cgroup", "jail", ""]),
    "--max-processes": st.sampled_from(["64", "0", "-1", "1.5", "x"]),
    "--cpu-time-s": st.sampled_from(["1", "0", "-1", "nan", "inf"]),
    "--max-open-files": st.sampled_from(["256", "1", "x"]),
    "--max-file-size-mb": st.sampled_from(["10", "0", "-1", "nan"]),
    "--max-address-space-mb": st.sampled_from(["4096", "0", "nan"]),
    "--exit-code": st.sampled_from(
        ["3=retry", "0=complete", "x", "=", "3=", "256=fail", "-1=fail"]
    ),
}


@st.composite
def command_lines(draw: st.DrawFn, url: str) -> list[str]:
    argv = ["bad-cli-queue", ECHO, "--url", url, "--burst"]
    for flag in draw(st.lists(st.sampled_from(sorted(FLAGS)), max_size=3, unique=True)):
        argv += [flag, draw(FLAGS[flag])]
    return argv


@settings(SHARED_ACROSS_EXAMPLES, max_examples=30)  # capsys is read out per example
@given(data=st.data())
def test_any_option_value_runs_or_is_refused_in_one_line(
    data: st.DataObject, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process (``cli.main``) for speed: a usable command line runs a burst worker on an
    empty queue and returns 0; anything else returns or exits 2 with one error line."""
    argv = data.draw(command_lines(redis_url))
    try:
        status = cli.main(["worker", *argv])
    except SystemExit as exc:  # argparse's own errors
        status = int(exc.code or 0)
    stderr = capsys.readouterr().err
    event(f"exit status {status}")
    assert status in (0, 2), (argv, stderr)
    if status == 2:
        errors = [line for line in stderr.splitlines() if "error:" in line]
        assert len(errors) == 1, (argv, stderr)
