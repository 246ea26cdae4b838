"""``sandboxq run ... --url URL --queue NAME``: the JSONL run as a batch over a fleet, driven
as a real process against a real redis-server: the same lines as the local mode, Ctrl-C
(SIGINT) cancelling what has not run, and --resume after the first run was SIGKILLed.

Workers serving the queue run on threads of this process (BackgroundWorkers) or as the
run's own children (--concurrency N); handlers wait on files (tests/support/gates.py)."""

from __future__ import annotations

import base64
import json
import os
import re
import resource
import signal
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis

from sandboxq import JobState, Queue
from sandboxq.backends.redis import RedisBackend
from sandboxq.models import AttemptRecord, Outcome, member_id
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers, child_pid
from sandboxq.text import number_ranges

H = "sandboxq.testing.handlers:"
GATES = "tests.support.gates:"
CLI = [sys.executable, "-m", "sandboxq", "run"]
ROOT = Path(__file__).resolve().parents[1]


def sandboxq_run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def start(*argv: str, stderr: Path) -> subprocess.Popen[bytes]:
    with open(stderr, "wb") as err:
        return subprocess.Popen([*CLI, *argv], stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(row) for row in path.read_text().splitlines()]


def sent_then_killed(source: Path, at: list[str], out: Path, err: Path) -> str:
    """Run ``source`` with no worker serving the queue, and SIGKILL the run once its batch
    is sent: the batch's id; its lines wait, none written."""
    first = start(H + "echo", str(source), *at, "--output", str(out), stderr=err)
    try:
        wait_for(lambda: "re-attach with" in err.read_text(), 30, "the batch to be sent")
    finally:
        first.kill()
        first.wait()
    return batch_id_in(err)


def batch_id_in(stderr: Path) -> str:
    return batch_id_in_text(stderr.read_text())


def batch_id_in_text(said: str) -> str:
    for row in said.splitlines():
        if row.startswith("sandboxq: batch "):
            return row.split()[2].rstrip(":")
    raise AssertionError(f"no batch id in: {said}")


@pytest.mark.timeout(120)
def test_the_fleet_writes_what_the_local_mode_writes(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(
        '{"args": [0, 1]}\n\n{"args": ["x"]}\nnot json\n{"args": [0, "five"]}\n'
        + "".join(f'{{"args": [0, {i}]}}\n' for i in range(6, 30))
    )
    local, fleet, here = (tmp_path / name for name in ("local", "fleet", "here"))
    run_local = sandboxq_run(H + "succeed_after", str(source), "--output", str(local))
    workers.start(queue_name, H + "succeed_after", url=redis_url, concurrency=1)
    workers.start(queue_name, H + "succeed_after", url=redis_url, concurrency=1)
    at = ["--url", redis_url, "--queue", queue_name]
    run_fleet = sandboxq_run(
        H + "succeed_after", str(source), *at, "--concurrency", "0", "--output", str(fleet)
    )
    assert (run_local.returncode, run_fleet.returncode) == (1, 1), run_fleet.stderr
    by_line = sorted(lines_of(local), key=lambda r: r["line"])
    bid = next(w for w in run_fleet.stderr.split() if len(w) == 17 and w.endswith(":"))[:-1]
    fleet_rows = sorted(lines_of(fleet), key=lambda r: r["line"])
    assert {r.pop("batch") for r in fleet_rows} == {bid}  # each row names its batch
    assert fleet_rows == by_line
    assert [r["line"] for r in by_line] == [1, 3, 4, 5, *range(6, 30)]
    assert {r["outcome"] for r in by_line} == {"ok", "error", "malformed"}
    for proc in (run_local, run_fleet):  # the same summary
        assert "28 line(s) of" in proc.stderr and "malformed" in proc.stderr
    # the workers took part: every member ran on one of them
    with Queue(queue_name, redis_url) as q:
        ran_on = {job.info().history[0].worker_id for job in q.get_batch(bid).jobs()}
    assert len(ran_on) == 2
    # --concurrency 2 alone, no worker serving the queue: the run's own children
    workers.stop_all()
    alone = sandboxq_run(
        H + "succeed_after", str(source), *at[:2], "--queue", queue_name + "-b",
        "--concurrency", "2", "--output", str(here),
    )  # fmt: skip
    assert alone.returncode == 1, alone.stderr
    assert [{k: v for k, v in r.items() if k != "batch"} for r in
            sorted(lines_of(here), key=lambda r: r["line"])] == by_line  # fmt: skip


@pytest.mark.timeout(120)
def test_ctrl_c_cancels_what_has_not_run_and_exits_130(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """As the local mode: the first Ctrl-C cancels the lines not started and lets the
    running one finish (written as it ended), a second would stop it too; exit 130."""
    log, gate = tmp_path / "log", tmp_path / "gate"  # opened once the others are cancelled
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"args": [str(log), str(gate)]}) + "\n" for _ in range(3)))
    out, err = tmp_path / "out", tmp_path / "err"
    proc = start(
        GATES + "run_then_wait", str(source), "--url", redis_url, "--queue", queue_name,
        "--concurrency", "1", "--output", str(out), stderr=err,
    )  # fmt: skip
    try:
        wait_for(lambda: log.exists() and "start" in log.read_text(), 60, "a line to start")
        proc.send_signal(signal.SIGINT)
        with Queue(queue_name, redis_url) as q:
            batch = wait_for(lambda: batch_id_in(err), 30, "the batch id on stderr")
            progress = wait_for(
                lambda: (p := q.get_batch(batch).progress()).cancelled == 2 and p,
                30,
                "the two lines not started to be cancelled",
            )
            assert progress.active == 1 and not progress.done  # the running one goes on
        gate.touch()
        assert proc.wait(60) == 130, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = sorted(lines_of(out), key=lambda r: r["line"])
    assert [r["line"] for r in rows] == [1, 2, 3]
    assert sorted(r["outcome"] for r in rows) == ["not_run", "not_run", "ok"], rows
    said, bid = err.read_text(), batch_id_in(err)
    assert "did not run:" in said
    # what runs them, the processor and the children here included: no worker serves
    # the queue, and a resume without them would wait on lines no one runs
    reattach = f"sandboxq run {GATES}run_then_wait --concurrency 1 --resume {bid} "
    assert f"re-attach with: {reattach}" in said
    assert (
        f"to run them: sandboxq batch {queue_name} {bid} --retry-failed, then {reattach}" in said
    ) and said.rstrip().endswith("--output NEW.jsonl"), said
    with Queue(queue_name, redis_url) as q:
        progress = q.get_batch(bid).progress()
        assert (progress.cancelled, progress.completed, progress.done) == (2, 1, True)
        assert q.counts()[JobState.ACTIVE] == 0
    assert log.read_text().count("start") == 1  # the other two never started


@pytest.mark.timeout(120)
def test_the_bar_counts_only_the_lines_that_ran_not_those_ctrl_c_wrote_not_run(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """Two Ctrl-C on a run of lines of 0.2 s each: the bar read "299/300 19 ok ... 85.7
    jobs/s" while the summary said 5.4 jobs/s, the lines cancelled before they ran counted
    as done. It counts the lines that ran, as the summary does."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"args": [0.2]}\n' * 200)
    out, err = tmp_path / "out.jsonl", tmp_path / "err"
    proc = start(
        H + "succeed_after", str(source), "--url", redis_url, "--queue", queue_name,
        "--concurrency", "1", "--output", str(out), stderr=err,
    )  # fmt: skip

    def outcomes() -> list[str]:
        return [row["outcome"] for row in lines_of(out)] if out.exists() else []

    try:
        wait_for(lambda: len(outcomes()) >= 3, 60, "three lines to end")
        proc.send_signal(signal.SIGINT)
        # The batch's stream brings the cancelled lines, written not_run as they come.
        wait_for(lambda: outcomes().count("not_run") >= 100, 30, "the cancelled lines")
        proc.send_signal(signal.SIGINT)  # a no-op if the run has ended meanwhile
        assert proc.wait(60) == 130, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended = outcomes()
    ran = len(ended) - ended.count("not_run")
    assert len(ended) == 200 and 3 <= ran < 100, ended
    text = err.read_text()
    # Not on a terminal, rich draws the bar once, as it was at the end.
    assert re.findall(r" (\d+)/200 (\d+) ok ", text) == [(str(ran), str(ended.count("ok")))]
    rates = [float(rate) for rate in re.findall(r"([\d.]+) jobs/s", text)]
    assert len(rates) == 2, text  # the bar's and the summary's, over about the same time
    assert rates[0] <= rates[1] * 1.5 + 0.1, text


def started_keys(log: Path) -> list[str]:
    """The key of every ``recorded_sleep`` that started (its log: "start pid key time")."""
    rows = log.read_text().splitlines() if log.exists() else []
    return [row.split()[2] for row in rows if row.startswith("start ")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", ["batch --cancel", "two Ctrl-C"])
def test_lines_cancelled_while_they_ran_are_written_cancelled_not_as_never_run(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path, stop: str
) -> None:
    """Two lines running on a worker (a real process) for as long as it took to cancel
    them, by ``sandboxq batch QUEUE ID --cancel`` or by two Ctrl-C: they were written
    ``not_run`` and the summary listed them among the lines that "did not run"."""
    log, out, err = tmp_path / "log", tmp_path / "out", tmp_path / "err"
    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join(json.dumps({"args": [str(log), f"k{i}", 3600]}) + "\n" for i in range(1, 5))
    )
    at = ["--url", redis_url, "--queue", queue_name]
    # --prefetch 0: the two it holds are the two running, the others wait in the queue;
    # --lease-s 3: its registry, which tells Redis their children's pids, every second
    workers.spawn(
        queue_name,
        H + "recorded_sleep",
        "--concurrency",
        "2",
        "--prefetch",
        "0",
        "--lease-s",
        "3",
        url=redis_url,
    )
    proc = start(H + "recorded_sleep", str(source), *at, "--output", str(out), stderr=err)
    try:
        wait_for(lambda: len(started_keys(log)) == 2, 60, "two lines to start")
        # Redis learns that a claimed member started from its worker's registry (every
        # lease_s / 3): until then a cancel cannot tell it from one claimed ahead
        bid = batch_id_in(err)
        running = [member_id(bid, int(key[1:]) - 1) for key in started_keys(log)]
        with Queue(queue_name, redis_url) as q:
            wait_for(lambda: all(child_pid(q, job) for job in running), 30, "their pids noted")
        if stop == "batch --cancel":
            cancel = subprocess.run(
                [sys.executable, "-m", "sandboxq", "batch", queue_name, bid,
                 "--cancel", "--url", redis_url],
                capture_output=True, text=True, timeout=30, cwd=ROOT,
            )  # fmt: skip
            assert cancel.returncode == 0, cancel.stderr
            expected = 1  # a line did not end ok
        else:
            proc.send_signal(signal.SIGINT)
            wait_for(lambda: "stopping:" in err.read_text(), 30, "the first Ctrl-C shown")
            proc.send_signal(signal.SIGINT)
            expected = 130
        assert proc.wait(60) == expected, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ran = sorted(int(key[1:]) for key in started_keys(log))
    waited = sorted({1, 2, 3, 4} - set(ran))
    rows = {r["line"]: r for r in lines_of(out)}
    assert sorted(rows) == [1, 2, 3, 4]
    for line in ran:
        row = rows[line]
        assert (row["outcome"], row["attempts"]) == ("cancelled", 1), row
        assert row["error"].startswith("the batch was stopped while this line ran"), row
        assert row["ran_s"] > 0, row
    for line in waited:
        assert rows[line] == {
            "line": line,
            "outcome": "not_run",
            "attempts": 0,
            "error": "the batch stopped before this line ran (cancelled while waiting)",
            "batch": batch_id_in(err),
        }
    text = err.read_text()
    assert f"2 line(s) did not run: {number_ranges(waited)}" in text, text
    assert f"2 line(s) were stopped while they ran: {number_ranges(ran)}" in text, text


@pytest.mark.timeout(120)
def test_a_line_claimed_ahead_and_cancelled_by_a_second_ctrl_c_is_written_as_never_run(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path
) -> None:
    """A worker claimed a line ahead (``--prefetch``); a second Ctrl-C cancelled it before
    a child took it. It was written ``not_run`` with ``attempts: 1`` and "the batch stopped
    before this line finished (last attempt: cancelled while active)": not run, yet an
    attempt counted and "finished" half-way."""
    log, out, err = tmp_path / "log", tmp_path / "out", tmp_path / "err"
    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join(json.dumps({"args": [str(log), f"k{i}", 3600]}) + "\n" for i in range(1, 4))
    )
    at = ["--url", redis_url, "--queue", queue_name]
    workers.spawn(
        queue_name,
        H + "recorded_sleep",
        *("--concurrency", "1", "--prefetch", "1", "--lease-s", "3"),
        url=redis_url,
    )
    proc = start(H + "recorded_sleep", str(source), *at, "--output", str(out), stderr=err)
    try:
        wait_for(lambda: len(started_keys(log)) == 1, 60, "a line to start")
        bid = batch_id_in(err)
        [running] = [member_id(bid, int(key[1:]) - 1) for key in started_keys(log)]
        with Queue(queue_name, redis_url) as q:
            wait_for(lambda: child_pid(q, running), 30, "its pid noted")
            wait_for(
                lambda: (
                    sum(j.info().state is JobState.ACTIVE for j in q.get_batch(bid).jobs()) == 2
                ),
                30,
                "a second line claimed ahead",
            )
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: "stopping:" in err.read_text(), 30, "the first Ctrl-C shown")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = {r["line"]: r for r in lines_of(out)}
    [ran] = [int(key[1:]) for key in started_keys(log)]
    assert (rows[ran]["outcome"], rows[ran]["attempts"]) == ("cancelled", 1), rows[ran]
    never = {
        line: row["error"] for line, row in rows.items() if line != ran and row["attempts"] == 0
    }
    assert sorted(never.values()) == [
        "the batch stopped before this line ran (cancelled while waiting)",
        "the batch stopped before this line ran (claimed ahead by a worker, never started)",
    ], rows
    assert all(row["outcome"] == "not_run" for line, row in rows.items() if line != ran), rows


@pytest.mark.timeout(120)
def test_resume_after_the_first_run_was_killed_writes_each_line_once(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path
) -> None:
    open_gate, later = tmp_path / "open", tmp_path / "later"
    open_gate.touch()
    gates = [open_gate, open_gate, later, later]
    source = tmp_path / "in.jsonl"
    source.write_text(
        "\n".join(json.dumps({"args": [str(g), i]}) for i, g in enumerate(gates)) + "\nbad\n"
    )
    workers.start(queue_name, GATES + "report_then_wait", url=redis_url, concurrency=2)
    out, err = tmp_path / "out", tmp_path / "err"
    at = ["--url", redis_url, "--queue", queue_name]
    first = start(GATES + "report_then_wait", str(source), *at, "--output", str(out), stderr=err)
    try:
        wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= 3, 60, "3 lines")
        # a resume while the first still writes: refused, the file left as it was
        written = out.read_text()
        early = sandboxq_run("--resume", batch_id_in(err), *at, "--output", str(out))
        assert early.returncode == 2 and "is being written by another sandboxq run" in early.stderr
        assert out.read_text() == written
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    before = lines_of(out)
    assert sorted(r["line"] for r in before) == [1, 2, 5]  # the malformed one, two that ran
    with open(out, "a") as f:
        f.write('{"line": 3, "outc')  # a write the kill cut short
    bid = batch_id_in(err)
    later.touch()
    resumed = sandboxq_run("--resume", bid, *at, "--output", str(out))
    assert resumed.returncode == 1, resumed.stderr  # line 5 is malformed: as in one run
    rows = lines_of(out)
    assert sorted(r["line"] for r in rows) == [1, 2, 3, 4, 5]
    assert rows[:3] == before
    assert [r["result"] for r in sorted(rows, key=lambda r: r["line"]) if "result" in r] == [
        0, 1, 2, 3,
    ]  # fmt: skip
    # the two lines of the first run count, not in this run's rate
    assert "5 line(s) of batch" in resumed.stderr and ": 2 written before, 2 in " in resumed.stderr
    again = sandboxq_run("--resume", bid, *at, "--output", str(out))  # nothing left to write
    assert again.returncode == 1 and lines_of(out) == rows


@pytest.mark.timeout(120)
def test_a_resume_writes_lines_cancelled_by_anyone_or_lost_as_not_run_saying_which(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """Cancelled with ``sandboxq batch --cancel`` (not this run's Ctrl-C), the lines were
    written with an outcome ``cancelled`` the README does not list, and counted failed;
    a member whose record was deleted was ``not_run`` "the batch stopped before this
    line ran", though whether it ran is not known."""
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"args": [{i}]}}\n' for i in range(3)))
    at = ["--url", redis_url, "--queue", queue_name]
    out, err = tmp_path / "out.jsonl", tmp_path / "err"
    bid = sent_then_killed(source, at, out, err)
    # the command it prints names the file it writes, not a placeholder
    assert f"--queue {queue_name} --output {out}\n" in err.read_text()
    with Queue(queue_name, url=redis_url) as queue:
        assert queue.get_batch(bid).cancel() == 3
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.delete(f"sq:{{{queue_name}}}:job:{bid}.2")
    finally:
        raw.close()
    resumed = sandboxq_run("--resume", bid, *at, "--output", str(out), timeout=30)
    rows = sorted(lines_of(out), key=lambda r: r["line"])
    assert [r["outcome"] for r in rows] == ["not_run"] * 3, rows
    assert rows[0]["error"] == "the batch stopped before this line ran (cancelled while waiting)"
    assert "whether it ran is not known" in rows[2]["error"], rows[2]
    assert resumed.returncode == 1 and "3 line(s) did not run: 1-3" in resumed.stderr


@pytest.mark.timeout(120)
def test_a_resume_after_retry_failed_writes_the_retried_lines_as_they_end_again(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """The README's way to finish a stopped run: ``--retry-failed``, then ``--resume`` into
    a new file. The batch's stream holds every member's end, then every retried member's
    reopening; a batch of 1,000 is one read's worth, and the resume took the batch as done
    after that read: it wrote the lines still waiting to run again as not_run."""
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"args": [{i}]}}\n' for i in range(1000)))
    at = ["--url", redis_url, "--queue", queue_name]
    bid = sent_then_killed(source, at, tmp_path / "first.jsonl", tmp_path / "err")
    with Queue(queue_name, url=redis_url) as queue:
        batch = queue.get_batch(bid)
        assert batch.cancel() == 1000 and batch.wait(timeout_s=10).done
        assert batch.retry_failed() == 1000
    out = tmp_path / "out.jsonl"
    resumed = sandboxq_run(
        H + "echo",
        "--resume",
        batch.id,
        *at,
        "--concurrency",
        "1",
        "--output",
        str(out),
        timeout=90,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = lines_of(out)
    assert sorted(r["line"] for r in rows) == list(range(1, 1001))
    assert {r["outcome"] for r in rows} == {"ok"}, [r for r in rows if r["outcome"] != "ok"][:3]


@pytest.mark.timeout(120)
def test_a_resume_counts_the_lines_written_before_by_the_kind_they_raised(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """The summary splits error lines by the type raised; the lines an earlier run wrote
    into OUT were read back without their error, and a resume's summary listed them all
    as ``other``."""
    source = tmp_path / "in.jsonl"
    source.write_text("{}\n{}\n")
    at = ["--url", redis_url, "--queue", queue_name]
    out, err = tmp_path / "out.jsonl", tmp_path / "err"
    ran = sandboxq_run(
        H + "raise_unpicklable", str(source), *at, "--concurrency", "1", "--output", str(out)
    )
    assert ran.returncode == 1, ran.stderr
    err.write_text(ran.stderr)
    kinds = [["error", "sandboxq.testing.handlers._Unpicklable", "2", "1-2"]]
    assert error_rows(ran.stderr) == kinds, ran.stderr
    again = sandboxq_run("--resume", batch_id_in(err), *at, "--output", str(out), timeout=30)
    assert again.returncode == 1, again.stderr
    assert error_rows(again.stderr) == kinds, again.stderr


def error_rows(stderr: str) -> list[list[str]]:
    """The summary's rows of error lines, by kind."""
    return [row.split() for row in stderr.splitlines() if row.split()[:1] == ["error"]]


@pytest.mark.timeout(120)
def test_a_resume_of_a_finished_batch_waits_for_no_worker_and_counts_only_its_own_rate(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """Every member final, its rows missing from OUT (another file, a crash before the
    writes): a resume reads them from the batch's stream, and said no worker served the
    queue, as if the lines waited for one."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"args": [1]}\n{"args": [2]}\n')
    at = ["--url", redis_url, "--queue", queue_name]
    first, err = tmp_path / "first.jsonl", tmp_path / "err"
    ran = sandboxq_run(H + "echo", str(source), *at, "--concurrency", "1", "--output", str(first))
    assert ran.returncode == 0, ran.stderr
    err.write_text(ran.stderr)
    out = tmp_path / "out.jsonl"
    resumed = sandboxq_run("--resume", batch_id_in(err), *at, "--output", str(out), timeout=30)
    assert resumed.returncode == 0, resumed.stderr
    assert "no worker serves" not in resumed.stderr, resumed.stderr
    assert sorted(lines_of(out), key=lambda r: r["line"]) == sorted(
        lines_of(first), key=lambda r: r["line"]
    )
    assert "2 line(s) of batch" in resumed.stderr and "written before" not in resumed.stderr


def test_clear_errors(redis_url: str, queue_name: str, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"args": [1]}\n')
    at = ["--url", redis_url, "--queue", queue_name]
    cases = [
        (["--resume", "0123456789abcdef", *at, "--output", str(tmp_path / "o")], 1,
         "batch '0123456789abcdef' of queue"),
        (["--resume", "0123456789abcdef", *at], 2, "needs --output"),
        ([H + "echo", str(source), "--url", redis_url], 2, "needs --queue NAME"),
        (["--resume", "x", *at, "--output", "o", "--concurrency", "1"], 2, "needs PROCESSOR"),
    ]  # fmt: skip
    for argv, code, needle in cases:
        proc = sandboxq_run(*argv)
        assert proc.returncode == code, (argv, proc.stderr)
        assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    with Queue(queue_name, redis_url) as q:
        plain = q.batch([([1], {})])
    proc = sandboxq_run("--resume", plain.id, *at, "--output", str(tmp_path / "o"))
    assert proc.returncode == 2 and "was not sent by sandboxq run" in proc.stderr


@pytest.mark.timeout(30)
def test_the_label_keeps_every_line_number_within_its_limit_however_lines_alternate() -> None:
    """A file whose good and malformed lines alternate makes ranges of single numbers: as
    text, 60,000 lines were a 400 KB label, over what a label may be. Its map instead,
    read back to the same numbers on --resume."""
    from sandboxq.backends.rules import MAX_LABEL_BYTES
    from sandboxq.cli.run_label import LABEL_KEY, LINE_MAP, _read_line_map, make_label, parse_ranges

    lines = list(range(1, 60_001, 2))
    bad = {n: "not JSON" for n in range(2, 60_001, 2)}
    label = make_label("in.jsonl", lines, bad)
    assert len(label.encode()) <= MAX_LABEL_BYTES
    data = json.loads(label)
    assert data[LABEL_KEY] == "in.jsonl" and _read_line_map(data[LINE_MAP], len(lines)) == (
        lines,
        list(bad),
    )
    plain = json.loads(make_label("in.jsonl", [1, 2, 3, 5], {4: "x"}))  # the readable form
    assert parse_ranges(plain["lines"], 4) == [1, 2, 3, 5] and plain["malformed"] == "4"


def _deflated_dashes(lines: int) -> str:
    """A line map of ``lines`` blank lines, as ``make_label`` packs one (built a chunk at a
    time: the map inflates a thousandfold)."""
    deflate, chunk, parts = zlib.compressobj(9), b"-" * 1_000_000, []
    for _ in range(lines // len(chunk)):
        parts.append(deflate.compress(chunk))
    return base64.b64encode(b"".join([*parts, deflate.flush()])).decode()


@pytest.mark.timeout(120)
def test_a_forged_label_is_refused_on_resume_without_reading_it_whole(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """Any user may label a batch, and anyone who can write to Redis may rewrite a label.
    Line numbers it names in ranges were made into a list of billions, and its map was
    inflated and walked in full (200 million lines: a minute): each is refused at once,
    naming the batch, under a memory limit that the old reads ran into."""
    from sandboxq.cli.run_label import LABEL_KEY, LINE_MAP, MAX_MAPPED_LINES

    labels = {
        "lines": {LABEL_KEY: "in.jsonl", "lines": "1-3000000000"},
        "past an index": {LABEL_KEY: "in.jsonl", "lines": "1-99999999999999999999999"},
        "malformed": {LABEL_KEY: "in.jsonl", "lines": "1", "malformed": "2-3000000000"},
        "map": {LABEL_KEY: "in.jsonl", LINE_MAP: _deflated_dashes(2 * MAX_MAPPED_LINES)},
    }
    at = ["--url", redis_url, "--queue", queue_name]
    with Queue(queue_name, redis_url) as q:
        ids = {what: q.batch([([1], {})]).id for what in labels}
        backend = q.backend
        assert isinstance(backend, RedisBackend)
        with redis.Redis.from_url(redis_url) as raw:  # a label past what enqueue takes
            for what, label in labels.items():
                raw.hset(backend.keys.batch(ids[what]), "label", json.dumps(label))

    def two_gib() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    for what, batch_id in ids.items():
        proc = subprocess.run(
            [*CLI, "--resume", batch_id, *at, "--output", str(tmp_path / what)],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
            preexec_fn=two_gib,
        )
        assert proc.returncode == 2, (what, proc.stderr[-2000:])
        assert f"batch {batch_id!r}: its label's line numbers cannot be read" in proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
def test_a_resume_into_another_inputs_output_is_refused(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """The output's rows name input lines, not batches: a resume into the file another
    run wrote took its lines as this batch's, and skipped them. A row naming a line this
    batch never had is refused, and the file is left as it was."""
    from sandboxq.cli.run_label import make_label

    with Queue(queue_name, redis_url) as q:
        batch = q.batch([([1], {})], label=make_label("in.jsonl", [1], {}))
    out = tmp_path / "out.jsonl"
    out.write_text(
        '{"line": 1, "outcome": "ok", "attempts": 1, "result": 7}\n'
        '{"line": 2, "outcome": "ok", "attempts": 1, "result": 8}\n'
    )
    written = out.read_text()
    proc = sandboxq_run(
        "--resume", batch.id, "--url", redis_url, "--queue", queue_name, "--output", str(out)
    )
    assert proc.returncode == 2, proc.stderr
    assert "holds line 2, which batch" in proc.stderr and "Traceback" not in proc.stderr
    assert out.read_text() == written


@pytest.mark.timeout(90)
def test_a_resume_into_another_batchs_output_is_refused(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """A resume into the output of another batch of a shorter input (or of the same
    input, sent again) took its rows as its own: the file mixed two batches, and the lines
    the other had left not run were never written. Each row names its batch."""
    from sandboxq.cli.run_label import make_label

    source = tmp_path / "in.jsonl"
    source.write_text('{"args": [1]}\n{"args": [2]}\n')
    out = tmp_path / "out.jsonl"
    at = ["--url", redis_url, "--queue", queue_name, "--output", str(out)]
    first = sandboxq_run(H + "echo", str(source), *at, "--concurrency", "1")
    assert first.returncode == 0, first.stderr
    written = out.read_text()
    with Queue(queue_name, redis_url) as q:
        other = q.batch([([n], {}) for n in (1, 2, 3)], label=make_label("in.jsonl", [1, 2, 3], {}))
    proc = sandboxq_run("--resume", other.id, *at)
    assert proc.returncode == 2, proc.stderr
    assert f"holds line 1 of batch {batch_id_in_text(first.stderr)}" in proc.stderr
    assert out.read_text() == written


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "held", [b'{"api_key": "k", "version": 3}', b"\xff\xfe\x00garbage"], ids=["json", "binary"]
)
def test_a_resume_into_a_file_of_one_line_without_a_newline_leaves_it_as_it_was(
    redis_url: str, queue_name: str, tmp_path: Path, held: bytes
) -> None:
    """A last line without a newline is taken for a row a crash cut short, and cut off:
    a settings file json.dump wrote (one line, no newline) passed for one, and was
    emptied. Only what can be the start of a row is cut."""
    from sandboxq.cli.run_label import make_label

    with Queue(queue_name, redis_url) as q:
        batch = q.batch([([1], {})], label=make_label("in.jsonl", [1], {}))
    out = tmp_path / "settings.json"
    out.write_bytes(held)
    proc = sandboxq_run(
        "--resume", batch.id, "--url", redis_url, "--queue", queue_name, "--output", str(out)
    )
    assert proc.returncode == 2, proc.stderr
    assert "line 1 is not a line sandboxq run wrote" in proc.stderr, proc.stderr
    assert out.read_bytes() == held


@pytest.mark.timeout(60)
def test_a_batch_only_partly_sent_is_not_resumed_and_says_how_to_clear_it(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """A run killed while it sends leaves part of a batch (the members of the round trips
    that went): resuming it would wait for members that will never exist."""
    from sandboxq.backends.base import NewJob
    from sandboxq.cli.run_label import make_label
    from sandboxq.errors import BatchIncomplete
    from sandboxq.models import member_id

    with Queue(queue_name, redis_url) as q:
        q.options(job_id=member_id("bx", 600)).enqueue(1)  # stops the send at its 2nd chunk
        jobs = [NewJob(b"[[1],{}]", job_id=member_id("bx", i)) for i in range(1000)]
        label = make_label("in.jsonl", list(range(1, 1001)), {})
        with pytest.raises(BatchIncomplete):
            q.backend.enqueue_batch("bx", jobs, label=label)
    at = ["--url", redis_url, "--queue", queue_name, "--output", str(tmp_path / "out")]
    proc = sandboxq_run("--resume", "bx", *at, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "was only partly sent (500 of 1000 lines" in proc.stderr
    assert f"sandboxq batch {queue_name} bx --cancel" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_a_refused_setting_or_processor_sends_nothing_and_writes_nothing(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """The settings of the worker run here (--concurrency N), its processor and its user
    were checked only once the batch was sent: the run exited 2 and left the lines waiting
    in the queue (with a nosuchuser, written as not_run, though they would run later).
    Each is refused before anything is sent, and the output is left as it was."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"args": [1]}\n')
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n")
    at = ["--url", redis_url, "--queue", queue_name, "--output", str(out)]
    cases = [
        ([H + "echo", "--concurrency", "-2"], "concurrency"),
        ([H + "echo", "--concurrency", "1", "--max-processes", "0"], "max_processes"),
        ([H + "echo", "--concurrency", "1", "--user", "nosuchuser"], "no such user"),
        (["nosuchmod:h", "--concurrency", "1"], "nosuchmod"),
    ]
    for (processor, *flags), needle in cases:
        proc = sandboxq_run(processor, str(source), *at, *flags, "--overwrite")
        assert proc.returncode == 2, (flags, proc.stderr)
        assert "sandboxq: error:" in proc.stderr and needle in proc.stderr, proc.stderr
        assert "sending" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert out.read_text() == "kept\n", flags
    with Queue(queue_name, redis_url) as q:
        assert sum(q.counts().values()) == 0


@pytest.mark.timeout(60)
def test_a_pool_flag_with_no_children_here_is_refused_and_the_processor_is_said_unused(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """Without --concurrency no child runs here: a pool's flag (--max-processes, a memory
    retry factor...) went unused without a word, and so did PROCESSOR, each line running
    with whatever processor the worker that took it serves."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"args": [1]}\n')
    at = ["--url", redis_url, "--queue", queue_name]
    for flags, said in [
        (["--max-processes", "5"], "--max-processes applies to the children --concurrency N"),
        (["--memory-retry-factor", "0.5"], "--memory-retry-factor applies"),
        (["--no-capture-output"], "--no-capture-output applies"),
    ]:
        proc = sandboxq_run(H + "echo", str(source), *at, *flags, timeout=20)  # no worker
        assert proc.returncode == 2, (flags, proc.stderr)
        assert f"sandboxq: error: {said}" in proc.stderr, proc.stderr
        assert "sending" not in proc.stderr, proc.stderr
    with Queue(queue_name, redis_url) as q:
        assert sum(q.counts().values()) == 0
    err = tmp_path / "err"
    waiting = start(H + "echo", str(source), *at, "--hard-timeout-s", "5", stderr=err)
    try:  # a job's flag is the job's own: sent with it
        wait_for(lambda: "sent to queue" in err.read_text(), 60, "the batch sent")
        assert f"{H}echo is not run here (no --concurrency)" in err.read_text()
    finally:
        waiting.send_signal(signal.SIGINT)
        waiting.wait(30)


@pytest.mark.timeout(120)
def test_an_output_another_run_writes_is_refused_before_anything_is_sent(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """A second run on an --output the first one holds was refused only once it had sent
    its batch, whose lines then waited in the queue with no one to write them."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"args": [1]}\n')
    out, err = tmp_path / "out.jsonl", tmp_path / "err"
    at = ["--url", redis_url, "--queue", queue_name, "--output", str(out)]
    first = start(H + "echo", str(source), *at, stderr=err)  # no worker: it waits, holding out
    try:
        wait_for(lambda: "sent to queue" in err.read_text(), 60, "the first run's batch sent")
        second = sandboxq_run(H + "echo", str(source), *at)
        assert second.returncode == 2, second.stderr
        assert "is being written by another sandboxq run" in second.stderr, second.stderr
        assert "sending" not in second.stderr
        with Queue(queue_name, redis_url) as q:
            assert q.counts()[JobState.WAITING] == 1  # the first run's line alone
        first.send_signal(signal.SIGTERM)  # as a service manager stops it: 128 + 15
        assert first.wait(60) == 143, err.read_text()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


@pytest.mark.timeout(60)
def test_an_unreachable_redis_leaves_the_output_as_it_was(tmp_path: Path) -> None:
    """The output is ours before anything is sent, but emptied only once the batch went:
    a run refused because Redis cannot be reached leaves it as it was."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"args": [1]}\n')
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n")
    at = ["--url", "redis://127.0.0.1:1/0", "--queue", "q", "--output", str(out)]
    proc = sandboxq_run(H + "echo", str(source), *at, "--overwrite", timeout=30)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "127.0.0.1:1" in proc.stderr, proc.stderr
    assert out.read_text() == "kept\n"


@pytest.mark.timeout(60)
def test_an_output_that_holds_lines_is_refused_before_anything_is_sent(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """A new fleet run emptied an output that held an earlier run's lines without a word.
    It is refused before its batch is sent, and the file is left as it was."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"args": [1]}\n')
    out = tmp_path / "out.jsonl"
    out.write_text('{"line": 1, "outcome": "ok", "attempts": 1, "result": 1}\n')
    at = ["--url", redis_url, "--queue", queue_name, "--output", str(out)]
    proc = sandboxq_run(H + "echo", str(source), *at, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert f"{out} already holds 1 line(s)" in proc.stderr
    assert "--overwrite replaces them" in proc.stderr and "--skip-done" not in proc.stderr
    assert "sending" not in proc.stderr
    assert out.read_text().count("\n") == 1
    with Queue(queue_name, redis_url) as q:
        assert sum(q.counts().values()) == 0


@pytest.mark.timeout(60)
def test_a_resume_into_an_output_that_disagrees_with_the_label_is_refused(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """Only the line numbers of OUT's rows were compared with the batch's: an output
    written for another input with as many lines was appended to, its rows counted, a
    line the batch sent kept as malformed. A malformed row for a line the label records
    as sent, or a row that ran for one it records as malformed, is refused too, and the
    file (even its last line cut short) is left as it was."""
    from sandboxq.cli.run_label import make_label

    with Queue(queue_name, redis_url) as q:
        batch = q.batch(
            [([1], {}), ([2], {})], label=make_label("in.jsonl", [1, 2], {3: "not JSON"})
        )
    at = ["--url", redis_url, "--queue", queue_name]
    cases = {
        '{"line": 1, "outcome": "malformed", "attempts": 0, "error": "not JSON"}\n'
        '{"line": 2, "outc': "holds line 1 as malformed, which batch",
        '{"line": 1, "outcome": "ok", "attempts": 1, "result": 1}\n'
        '{"line": 3, "outcome": "ok", "attempts": 1, "result": 3}\n': "holds line 3 as ok, "
        "which batch",
    }
    for n, (written, needle) in enumerate(cases.items()):
        out = tmp_path / f"out{n}.jsonl"
        out.write_text(written)
        # no worker serves the queue: a resume not refused waits, till the timeout
        proc = sandboxq_run("--resume", batch.id, *at, "--output", str(out), timeout=20)
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert out.read_text() == written


@pytest.mark.timeout(60)
def test_a_member_that_finished_before_a_second_ctrl_c_is_written_as_it_ended(
    redis_url: str, queue_name: str
) -> None:
    """A second Ctrl-C stops reading the batch's stream: what it had not delivered was all
    written as not_run, a member that had completed too (run again by whoever reruns the
    not_run lines)."""
    from sandboxq.cli.batch_view import Tally
    from sandboxq.cli.run_files import Output
    from sandboxq.cli.run_fleet import _not_run

    with Queue(queue_name, redis_url) as q:
        batch = q.batch([([1], {}), ([2], {})])
        [claimed] = q.backend.claim("w", 1, lease_s=30)
        attempt = AttemptRecord(attempt=1, outcome=Outcome.OK, worker_id="w")
        q.backend.finish("w", claimed.id, claimed.token, "complete", attempt, result=b"7")
        batch.cancel()  # the second Ctrl-C's: the other member never runs
        rows: list[tuple[int, str, dict[str, Any]]] = []
        output = Output(None, Tally())
        output.write = lambda line, outcome, **fields: rows.append((line, outcome, fields))  # type: ignore[method-assign]
        _not_run(q, batch, [10, 20], output)
    assert sorted((line, outcome) for line, outcome, _ in rows) == [(10, "ok"), (20, "not_run")]
    assert [fields["result"] for line, _, fields in rows if line == 10] == [7]


@pytest.mark.timeout(120)
def test_a_ctrl_c_while_the_lines_are_sent_leaves_none_of_them_to_run(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    """A Ctrl-C that landed while the batch was being sent ended the run at once
    ("interrupted"), with the lines sent so far waiting in the queue for any worker."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"args": [1]}\n' * 20_000)
    out, err = tmp_path / "out.jsonl", tmp_path / "err"
    proc = start(H + "echo", str(source), "--url", redis_url, "--queue", queue_name,
                 "--output", str(out), stderr=err)  # fmt: skip
    try:
        wait_for(lambda: "line(s) to queue" in err.read_text(), 60, "the send to begin")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 130, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "line(s) sent to queue" in err.read_text(), "the Ctrl-C came after the send"
    with Queue(queue_name, redis_url) as q:
        progress = q.get_batch(batch_id_in(err)).progress()
        assert progress.cancelled == progress.enqueued == 20_000, progress
    assert {row["outcome"] for row in lines_of(out)} == {"not_run"}
