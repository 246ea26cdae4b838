"""``sandboxq run``: a JSONL batch through the real sandboxed pool on the in-memory backend.

Real children that really hang and are really killed; Ctrl-C is a real SIGINT sent to
the whole process group, as a terminal sends it."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from sandboxq.backends.base import NewJob
from sandboxq.backends.memory import MemoryBackend
from sandboxq.cli import batch, main, run_files
from sandboxq.cli.batch_view import BatchView, Tally
from sandboxq.cli.run_files import parse_line
from sandboxq.pool.kill import ended
from sandboxq.testing.waiting import wait_for
from sandboxq.text import number_ranges

H = "sandboxq.testing.handlers:"
GATES = "tests.support.gates:"
CLI = [sys.executable, "-m", "sandboxq"]
#: ``tests.support.gates`` importable from a run in another directory
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def results(path: Path) -> dict[int, dict[str, Any]]:
    """The output file by input line number (each line must appear once)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by_line = {row["line"]: row for row in rows}
    assert len(by_line) == len(rows), "an input line was written twice"
    return by_line


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def started(log: Path) -> list[tuple[int, str]]:
    """(pid, key) of every recorded_sleep that started."""
    if not log.exists():
        return []
    return [
        (int(pid), key)
        for kind, pid, key, _ in (line.split() for line in log.read_text().splitlines())
        if kind == "start"
    ]


# -- the batch ----------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_mixed_file_gives_each_line_its_outcome(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_lines(
        tmp_path / "in.jsonl",
        '{"args": [0, "a"]}',  # 1 ok
        '{"kwargs": {"seconds": 0, "value": [1, 2]}}',  # 2 ok
        "",  # 3 blank: skipped, not an error
        '{"args": [3600]}',  # 4 hangs: killed at the hard timeout
        '{"args": ["soon"]}',  # 5 raises TypeError
        "not json",  # 6 malformed
        '{"args": 1}',  # 7 malformed
        '{"args": [0], "options": {}}',  # 8 malformed: unknown key
        "{}",  # 9 raises: a required argument is missing
    )
    out = tmp_path / "out.jsonl"
    code = main(
        [
            "run",
            H + "succeed_after",
            str(source),
            "--output",
            str(out),
            "--hard-timeout-s",
            "1",
            "--concurrency",
            "2",
        ]
    )
    _, err = capsys.readouterr()
    assert code == 1
    rows = results(out)
    assert sorted(rows) == [1, 2, 4, 5, 6, 7, 8, 9]
    assert {n: rows[n]["outcome"] for n in rows} == {
        1: "ok",
        2: "ok",
        4: "hard_timeout",
        5: "error",
        6: "malformed",
        7: "malformed",
        8: "malformed",
        9: "error",
    }
    assert rows[1]["result"] == "a" and rows[2]["result"] == [1, 2]
    assert rows[1]["attempts"] == 1 and rows[6]["attempts"] == 0
    assert "killed at the hard deadline of 1 s" in rows[4]["error"]
    assert "TypeError" in rows[5]["error"]
    assert "missing 1 required positional argument" in rows[9]["error"]
    assert rows[6]["error"].startswith("not JSON")
    assert rows[7]["error"] == "'args' must be a JSON array, got a JSON number"
    assert "unknown key(s) ['options']" in rows[8]["error"]
    # Malformed lines are reported, by number, before anything runs...
    assert err.index(f"{source} line 6: not JSON") < err.index("5/5")
    # ...the bar ends complete, and the summary counts each outcome with its lines.
    assert "2 ok" in err and "2 failed" in err and "1 timed out" in err
    assert "8 line(s) of" in err
    summary = {line.split()[0]: line.split()[1:] for line in err.splitlines() if line.strip()}
    assert summary["ok"] == ["2", "1-2"] and summary["malformed"] == ["3", "6-8"]
    assert summary["error"] == ["TypeError", "2", "5,", "9"]  # by the kind of error raised
    assert summary["hard_timeout"] == ["1", "4"]


@pytest.mark.timeout(60)
def test_results_go_to_stdout_and_retries_apply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_lines(tmp_path / "in.jsonl", '{"args": [3]}', '{"args": [[1, 2]]}', "[5]")
    code = main(["run", H + "echo", str(source), "--concurrency", "1"])
    out, _ = capsys.readouterr()
    rows = {row["line"]: row for row in map(json.loads, out.splitlines())}
    assert code == 1  # line 3 is malformed (a bare array is not a line object)
    assert (rows[1]["result"], rows[2]["result"]) == (3, [1, 2])
    assert rows[3]["outcome"] == "malformed" and "got a JSON array" in rows[3]["error"]
    source = write_lines(tmp_path / "fails.jsonl", '{"args": ["x"]}', '{"args": [0, 1]}')
    code = main(["run", H + "succeed_after", str(source), "--retries", "1", "--concurrency", "1"])
    out, _ = capsys.readouterr()
    rows = {row["line"]: row for row in map(json.loads, out.splitlines())}
    assert (rows[1]["outcome"], rows[1]["attempts"]) == ("error", 2)
    assert (rows[2]["outcome"], rows[2]["result"]) == ("ok", 1)
    assert code == 1
    source = write_lines(tmp_path / "fine.jsonl", '{"args": [0, 1]}')
    assert main(["run", H + "succeed_after", str(source)]) == 0


@pytest.mark.timeout(30)
def test_a_run_returns_once_its_worker_is_done(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The follower stops once the worker is done, not at its next look at the events:
    with looks far apart (past this test's timeout), a run that waited for one more would
    never return."""
    from sandboxq.cli import batch

    monkeypatch.setattr(batch, "FOLLOW_LOOK_S", 3600.0)
    source = write_lines(tmp_path / "in.jsonl", '{"args": [1]}', '{"args": [2]}')
    assert main(["run", H + "echo", str(source), "--concurrency", "1"]) == 0
    out, _ = capsys.readouterr()
    assert sorted(json.loads(row)["result"] for row in out.splitlines()) == [1, 2]


@pytest.mark.timeout(30)
def test_a_file_without_job_lines_starts_no_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_lines(tmp_path / "in.jsonl", "", "  ")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert main(["run", H + "echo", str(source)]) == 0
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    out, err = capsys.readouterr()
    assert out == "" and f"nothing to run: {source} has no job lines" in err


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"args": [NaN]}', "args[0] is nan: JSON has no NaN or infinity"),
        (b'{"args": [1]} trailing', "not JSON: Extra data at column 15"),
        # the line's own end is not where JSON stopped ("line 2 column 1" said it was)
        (b'{"args": [1]\n', "not JSON: Expecting ',' delimiter at column 13"),
        (b'{"kwargs": [1]}', "'kwargs' must be a JSON object, got a JSON array"),
        (b'"just a string"', "expected a JSON object like"),
        (b'{"args": ["\xff"]}', "not UTF-8 text"),
    ],
)
def test_malformed_lines_say_what_is_wrong(raw: bytes, needle: str) -> None:
    item = parse_line(7, raw)
    assert item.payload is None and item.line == 7
    assert item.error is not None and needle in item.error


@pytest.mark.timeout(60)
def test_strict_stops_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    ok = json.dumps({"args": [str(runs), "k", 0]})
    source = write_lines(tmp_path / "in.jsonl", ok, "{oops", ok)
    out = tmp_path / "out.jsonl"
    code = main(["run", H + "recorded_sleep", str(source), "--output", str(out), "--strict"])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.splitlines() == [
        f"sandboxq: {source} line 2: not JSON: Expecting property name enclosed in double "
        "quotes at column 2",
        f"sandboxq: 1 malformed line(s) in {source}; nothing was run",
    ]
    assert not out.exists() and not runs.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["no.such.module:fn", "IN"], {}, "cannot import its module: ModuleNotFoundError"),
        ([H + "echo", "missing.jsonl"], {}, "cannot read missing.jsonl: No such file"),
        ([H + "echo", "IN", "--output", "/no/such/dir/out.jsonl"], {}, "cannot write /no/such"),
        ([H + "echo", "IN", "--concurrency", "0"], {}, "concurrency"),
        ([H + "echo", "IN"], {"SANDBOXQ_CONCURRENCY": "lots"}, "SANDBOXQ_CONCURRENCY='lots'"),
    ],
    ids=["processor", "input", "output", "flag", "variable"],
)
def test_start_errors_are_one_line_and_run_nothing(
    tmp_path: Path, args: list[str], env: dict[str, str], needle: str
) -> None:
    source = write_lines(tmp_path / "in.jsonl", '{"args": [1]}')
    argv = [str(source) if a == "IN" else a for a in args]
    proc = subprocess.run(
        [*CLI, "run", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
        env={**os.environ, **env},
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("sandboxq: error: ")
    assert needle in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
def test_a_user_that_does_not_exist_is_refused_before_the_output_is_touched(
    tmp_path: Path,
) -> None:
    """The user was looked up only when the pool started: by then the output had been
    emptied and the malformed lines written to it, and nothing ran."""
    source = write_lines(tmp_path / "in.jsonl", '{"args": [1]}', "not json")
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n")
    proc = subprocess.run(
        [*CLI, "run", H + "echo", str(source), "--output", str(out), "--user", "nosuchuser"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "sandboxq: error: user='nosuchuser': no such user" in proc.stderr, proc.stderr
    assert out.read_text() == "kept\n"


@pytest.mark.timeout(60)
def test_settings_come_from_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDBOXQ_HARD_TIMEOUT_S", "0.5")
    monkeypatch.setenv("SANDBOXQ_URL", "redis://unused.invalid:1/0")  # run is always local
    source = write_lines(tmp_path / "in.jsonl", "{}")
    assert main(["run", H + "sleep_forever", str(source)]) == 1
    (row,) = map(json.loads, capsys.readouterr()[0].splitlines())
    assert row["outcome"] == "hard_timeout" and "0.5 s" in row["error"]


@pytest.mark.timeout(60)
def test_the_installed_script_imports_a_processor_from_the_current_directory(
    tmp_path: Path,
) -> None:
    """What a newcomer does first: a module of their own, a file, `sandboxq run`."""
    (tmp_path / "myjobs.py").write_text("def double(x):\n    return 2 * x\n")
    write_lines(tmp_path / "in.jsonl", '{"args": [1]}', '{"args": [21]}')
    script = Path(sys.executable).with_name("sandboxq")
    proc = subprocess.run(
        [str(script), "run", "myjobs:double", "in.jsonl", "--output", "out.jsonl"],
        capture_output=True,
        text=True,
        timeout=40,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    rows = results(tmp_path / "out.jsonl")
    assert (rows[1]["result"], rows[2]["result"]) == (2, 42)


@pytest.mark.timeout(30)
def test_an_output_that_is_the_input_is_refused_and_the_input_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--output`` naming the input file (by another path) emptied it once its lines were
    read: the results replaced the input."""
    source = write_lines(tmp_path / "in.jsonl", '{"args": [1]}', '{"args": [2]}')
    before = source.read_text()
    same = str(tmp_path / "." / "in.jsonl")
    assert main(["run", H + "echo", str(source), "--output", same]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert source.read_text() == before


@pytest.mark.timeout(90)
def test_a_second_run_on_the_same_output_is_refused_and_leaves_it_alone(tmp_path: Path) -> None:
    """Two runs writing one file (a command run again in another terminal): the second
    emptied it under the first and both wrote their lines into it. The second is refused
    while the first holds it, naming the file; the first writes every line once."""
    (tmp_path / "open").touch()
    gate = tmp_path / "gate"
    calls = [[str(tmp_path / "open"), 0], *([str(gate), i] for i in range(1, 4))]
    write_lines(tmp_path / "in.jsonl", *(json.dumps({"args": args}) for args in calls))
    out = tmp_path / "out.jsonl"
    run = [*CLI, "run", GATES + "report_then_wait", "in.jsonl", "--output", "out.jsonl"]
    with open(tmp_path / "first.err", "wb") as err:
        first = subprocess.Popen(
            [*run, "--concurrency", "1"],
            cwd=tmp_path,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        # its first line is written, and the next waits at the gate: the run is under way
        wait_for(lambda: out.exists() and out.read_text().count("\n") == 1, 30, "a first line")
        second = subprocess.run(
            run, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 2, second.stderr
        assert "out.jsonl is being written by another sandboxq run" in second.stderr
        assert out.read_text().count("\n") == 1  # left as it was
        gate.touch()
        assert first.wait(timeout=60) == 0, (tmp_path / "first.err").read_text()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert sorted(results(out)) == [1, 2, 3, 4]


@pytest.mark.timeout(90)
def test_running_again_onto_an_output_that_holds_lines_is_refused_unless_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same command run again (a night's batch, rerun by hand the next morning)
    emptied the first run's results without a word. It is refused, naming the file and
    what keeps or replaces them, and the file is left as it was; --overwrite replaces it."""
    source = write_lines(tmp_path / "in.jsonl", '{"args": [1]}', '{"args": [2]}')
    out = tmp_path / "out.jsonl"
    earlier = '{"line": 1, "outcome": "ok", "attempts": 1, "result": "from last night"}\n'
    out.write_text(earlier)
    assert main(["run", H + "echo", str(source), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} already holds 1 line(s)" in err
    assert "--skip-done runs only the lines it does not hold as finished" in err
    assert "--overwrite replaces them" in err
    assert out.read_text() == earlier
    assert main(["run", H + "echo", str(source), "--output", str(out), "--overwrite"]) == 0
    assert {n: row["result"] for n, row in results(out).items()} == {1: 1, 2: 2}


@pytest.mark.timeout(90)
def test_skip_done_runs_only_the_lines_a_stopped_run_did_not_finish(tmp_path: Path) -> None:
    """A local run stopped part-way (Ctrl-C, a reboot) could only be run again whole: a
    night of work lost for the lines it had left. --skip-done keeps the rows of the lines
    that finished, byte for byte, and runs the others: those not run, and a line added
    since. The file ends with one row per line."""
    code, _, _, _ = interrupt_a_batch(tmp_path, 5, 1.5, [signal.SIGINT])
    assert code == 130
    out, log = tmp_path / "out.jsonl", tmp_path / "runs"
    first = results(out)
    finished = {n for n, row in first.items() if row["outcome"] == "ok"}
    assert len(finished) == 2 and len(first) == 5
    kept = [row for row in out.read_text().splitlines() if json.loads(row)["line"] in finished]
    with open(tmp_path / "in.jsonl", "a") as f:  # a line added since
        f.write(json.dumps({"args": [str(log), "k6", 0]}) + "\n")
    log.unlink()
    argv = [H + "recorded_sleep", "in.jsonl", "--output", "out.jsonl", "--skip-done"]
    again = subprocess.run(
        [*CLI, "run", *argv, "--concurrency", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr
    assert {int(key[1:]) for _, key in started(log)} == {1, 2, 3, 4, 5, 6} - finished
    rows = results(out)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert {row["outcome"] for row in rows.values()} == {"ok"}
    assert out.read_text().splitlines()[: len(kept)] == kept
    assert "6 line(s) of in.jsonl: 2 written before, 4 in" in again.stderr


@pytest.mark.timeout(60)
def test_skip_done_runs_again_lines_cut_short_stopped_running_or_malformed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = (json.dumps({"args": [n]}) for n in (1, 2, 3, 4))
    source = write_lines(tmp_path / "in.jsonl", *calls)  # line 4 fixed since
    out = tmp_path / "out.jsonl"
    out.write_text(
        '{"line": 1, "outcome": "ok", "attempts": 1, "result": 1}\n'
        '{"line": 4, "outcome": "malformed", "attempts": 0, "error": "not JSON"}\n'
        '{"line": 2, "outcome": "interrupted", "attempts": 1, "error": "stopped", "ran_s": 9}\n'
        '{"line": 3, "outc'  # the run was killed while it wrote this row
    )
    assert main(["run", H + "echo", str(source), "--output", str(out), "--skip-done"]) == 0
    rows = results(out)
    assert {n: (row["outcome"], row["result"]) for n, row in rows.items()} == {
        n: ("ok", n) for n in (1, 2, 3, 4)
    }
    assert "4 line(s) of" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (
            '{"line": 9, "outcome": "ok", "attempts": 1, "result": 1}\n',
            "holds line 9, which {source} has not (past its end, or blank)",
        ),
        (
            '{"line": 2, "outcome": "ok", "attempts": 1, "result": 1}\n',
            "holds line 2 as ok, which {source} has as malformed",
        ),
        ('{"results": [1, 2]}', "line 1 is not a line sandboxq run wrote"),
        # a line 3.9, "1" or true passed for a line, and kept; Infinity raised
        *(
            (f'{{"line": {line}, "outcome": "ok", "result": 1}}\n', "line 1 is not a line")
            for line in ("1.9", '"1"', "true", "Infinity")
        ),
        ('{"line": 1, "outcome": null, "result": 1}\n', "line 1 is not a line sandboxq"),
    ],
    ids=[
        "a-line-the-input-lacks",
        "a-line-now-malformed",
        "another-programs-file",
        "line-a-float",
        "line-a-string",
        "line-a-bool",
        "line-infinity",
        "outcome-null",
    ],
)
def test_skip_done_refuses_an_output_of_another_input_and_leaves_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, needle: str
) -> None:
    source = write_lines(tmp_path / "in.jsonl", '{"args": [1]}', "not json")
    out = tmp_path / "out.jsonl"
    out.write_text(content)
    assert main(["run", H + "echo", str(source), "--output", str(out), "--skip-done"]) == 2
    assert needle.format(source=source) in capsys.readouterr().err
    assert out.read_text() == content
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.timeout(60)
def test_skip_done_keeps_a_whole_last_row_without_its_newline_and_the_files_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A crash between a row and its newline left a whole row: it was taken for one cut
    short, and its line ran again. The rewrite dropped a setuid bit (chmod, then chown)."""
    source = write_lines(tmp_path / "in.jsonl", '{"args": [1]}', '{"args": [2]}')
    out = tmp_path / "out.jsonl"
    out.write_text('{"line": 1, "outcome": "ok", "attempts": 1, "result": "from before"}')
    out.chmod(0o4755)
    assert main(["run", H + "echo", str(source), "--output", str(out), "--skip-done"]) == 0
    assert {n: row["result"] for n, row in results(out).items()} == {1: "from before", 2: 2}
    assert "2 line(s) of" in capsys.readouterr().err
    assert out.stat().st_mode & 0o7777 == 0o4755


@pytest.mark.timeout(60)
def test_skip_done_on_a_full_disk_refuses_and_leaves_the_output_whole(tmp_path: Path) -> None:
    """The rewrite wrote what one write took and went on: on a full disk the output was
    cut to 171 of its 2,000 rows, and the run said all 2,000 were written before."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode:
        pytest.skip(f"a small tmpfs cannot be mounted here: {mounted.stderr.strip()}")
    try:
        rows = [
            json.dumps({"line": n, "outcome": "ok", "result": "x" * 60}) for n in range(1, 2001)
        ]
        out = write_lines(disk / "out.jsonl", *rows)
        before = out.read_bytes()
        source = write_lines(tmp_path / "in.jsonl", *(['{"args": [1]}'] * 2000))
        argv = ["run", H + "echo", str(source), "--output", str(out), "--skip-done"]
        done = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert f"cannot rewrite {out}: No space left on device" in done.stderr
        assert out.read_bytes() == before
        assert sorted(p.name for p in disk.iterdir()) == ["out.jsonl"]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.timeout(60)
def test_skip_done_replaces_what_a_killed_rewrite_left_and_says_when_it_cannot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rewrite killed part-way (SIGTERM, a hangup, SIGKILL) left its scratch file, up to
    the output's size, under a name no later run knew. It has one name per output, which
    the next run replaces; where it cannot be made, one line says why (a traceback did)."""
    source = write_lines(tmp_path / "in.jsonl", '{"args": [1]}')
    out = tmp_path / "out.jsonl"
    scratch = tmp_path / ".out.jsonl.sandboxq-rewrite"
    scratch.write_text("what a killed rewrite left")
    assert main(["run", H + "echo", str(source), "--output", str(out), "--skip-done"]) == 0
    assert not scratch.exists() and results(out)[1]["result"] == 1
    capsys.readouterr()
    out.write_text('{"line": 1, "outcome": "interrupted", "attempts": 1}\n')
    scratch.mkdir()  # cannot be opened as a file: as a directory that is not writable
    assert main(["run", H + "echo", str(source), "--output", str(out), "--skip-done"]) == 2
    err = capsys.readouterr().err
    assert f"sandboxq: error: cannot rewrite {out}: cannot create {scratch} beside it" in err
    assert "Traceback" not in err
    assert out.read_text() == '{"line": 1, "outcome": "interrupted", "attempts": 1}\n'


@pytest.mark.timeout(60)
def test_a_run_whose_pool_cannot_start_still_writes_every_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's start failed (here: its fork server's import of the processor hangs):
    the output was left with no row for the lines it had, and a --skip-done had already
    dropped the earlier run's rows of the lines it was to run again."""
    (tmp_path / "hangs_elsewhere.py").write_text(
        "import os, time\n"
        "while os.environ.get('SQ_TEST_IMPORTER') != str(os.getpid()):\n"
        "    time.sleep(0.05)\n"
        "def fn(n):\n"
        "    return n\n"
    )
    source = write_lines(tmp_path / "in.jsonl", *(json.dumps({"args": [n]}) for n in (1, 2, 3)))
    out = tmp_path / "out.jsonl"
    out.write_text(
        '{"line": 1, "outcome": "ok", "attempts": 1, "result": 1}\n'
        '{"line": 2, "outcome": "interrupted", "attempts": 1, "error": "stopped"}\n'
    )
    code = (
        "import os, sys; os.environ['SQ_TEST_IMPORTER'] = str(os.getpid()); "
        "from sandboxq.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    env = {**ENV, "SANDBOXQ_IMPORT_TIMEOUT_S": "1"}
    argv = ["run", "hangs_elsewhere:fn", str(source), "--output", str(out), "--skip-done"]
    done = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 2, done.stderr
    assert "fork server" in done.stderr, done.stderr
    rows = results(out)
    assert {n: row["outcome"] for n, row in rows.items()} == {1: "ok", 2: "not_run", 3: "not_run"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--skip-done"], "--skip-done needs --output OUT.jsonl"),
        (["--output", "o.jsonl", "--skip-done", "--overwrite"], "replaces it: give one"),
        (["--output", "o.jsonl", "--skip-done", "--queue", "q"], "--skip-done is for a run here"),
        (["--output", "o.jsonl", "--resume", "b", "--overwrite"], "no --overwrite"),
        (["--output", "/dev/null", "--skip-done"], "/dev/null is not a file"),
    ],
)
def test_the_output_flags_that_cannot_go_together_are_refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    needle: str,
) -> None:
    source = write_lines(tmp_path / "in.jsonl", '{"args": [1]}')
    monkeypatch.chdir(tmp_path)
    assert main(["run", H + "echo", str(source), *flags]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


# -- a terminal: the live bar, and Ctrl-C -------------------------------------------------


def start_in_session(tmp_path: Path, *args: str, stderr: Any = None) -> subprocess.Popen[bytes]:
    """Started as a terminal starts a job: its own process group, which Ctrl-C signals."""
    return subprocess.Popen(
        [*CLI, "run", *args],
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=stderr or subprocess.PIPE,
    )


def interrupt_a_batch(
    tmp_path: Path, lines: int, seconds: float, presses: list[signal.Signals]
) -> tuple[int, str, list[int], float]:
    """Run ``lines`` sleeps of ``seconds`` two at a time; once two run, send the signals
    of ``presses`` (SIGINT: a Ctrl-C) to its group. Returns the exit status, stderr, the
    pids that ran the sleeps, and how long the batch took to end after the last press."""
    log = tmp_path / "runs"
    jobs = [json.dumps({"args": [str(log), f"k{i}", seconds]}) for i in range(1, lines + 1)]
    write_lines(tmp_path / "in.jsonl", *jobs)
    proc = start_in_session(
        tmp_path, H + "recorded_sleep", "in.jsonl", "--output", "out.jsonl", "--concurrency", "2"
    )
    try:
        wait_for(lambda: len(started(log)) == 2, 30, "two lines to start")
        for n, signum in enumerate(presses):
            time.sleep(0.5 if n else 0)  # the subject: presses half a second apart
            os.killpg(proc.pid, signum)
        pressed = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - pressed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ran = started(log)
    assert len(ran) == 2, ran  # nothing new started after Ctrl-C
    return proc.returncode, err.decode(), [pid for pid, _ in ran], took


@pytest.mark.timeout(90)
def test_ctrl_c_lets_running_lines_finish_and_reports_what_did_not_run(tmp_path: Path) -> None:
    code, text, _, _ = interrupt_a_batch(tmp_path, 5, 1.5, [signal.SIGINT])
    assert code == 130, text
    rows = results(tmp_path / "out.jsonl")
    ran = {int(key[1:]) for _, key in started(tmp_path / "runs")}
    assert {n for n, r in rows.items() if r["outcome"] == "ok"} == ran
    not_run = sorted(n for n, r in rows.items() if r["outcome"] == "not_run")
    assert not_run == sorted(set(range(1, 6)) - ran)
    assert "stopping: running jobs may finish; Ctrl-C again to stop now" in text
    assert f"3 line(s) did not run: {number_ranges(not_run)}" in text
    assert "Traceback" not in text


@pytest.mark.timeout(90)
def test_a_second_ctrl_c_kills_running_lines_at_once(tmp_path: Path) -> None:
    # a service manager's SIGTERM first: the status is a shell's for it (128 + 15)
    code, text, children, took = interrupt_a_batch(
        tmp_path, 3, 600, [signal.SIGTERM, signal.SIGINT]
    )
    assert code == 143, text
    assert took < 15  # not the 600 s the jobs wanted, nor the 30 s drain
    assert "stopping now: running jobs are killed" in text
    rows = results(tmp_path / "out.jsonl")
    ran = sorted(int(key[1:]) for _, key in started(tmp_path / "runs"))
    [waited] = sorted({1, 2, 3} - set(ran))
    # the two that ran were killed running: said so, not "never ran"
    assert {n: r["outcome"] for n, r in rows.items()} == {
        **dict.fromkeys(ran, "interrupted"),
        waited: "not_run",
    }
    assert f"1 line(s) did not run: {waited}" in text
    assert f"2 line(s) were stopped while they ran: {number_ranges(ran)}" in text
    for pid in children:
        assert ended(pid)


def stop_a_hung_line(tmp_path: Path, *flags: str, presses: int) -> tuple[int, str, int]:
    """Run two lines that sleep an hour, one at a time; once the first has started, press
    Ctrl-C ``presses`` times, each once the run has shown the one before. Returns the exit
    status, stderr, and the line that ran."""
    log, err = tmp_path / "runs", tmp_path / "err"
    jobs = [json.dumps({"args": [str(log), f"k{i}", 3600]}) for i in (1, 2)]
    write_lines(tmp_path / "in.jsonl", *jobs)
    argv = [H + "recorded_sleep", "in.jsonl", "--output", "out.jsonl", "--concurrency", "1"]
    with open(err, "wb") as stderr:
        proc = start_in_session(tmp_path, *argv, *flags, stderr=stderr)
    try:
        [(_, key)] = wait_for(lambda: started(log), 30, "a line to start")
        for n in range(presses):
            os.killpg(proc.pid, signal.SIGINT)
            shown = "stopping now" if n else "stopping: running jobs may finish"
            wait_for(lambda s=shown: s in err.read_text(), 30, f"the run to show {shown!r}")
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(started(log)) == 1  # the other line never started
    return proc.returncode, err.read_text(), int(key[1:])


@pytest.mark.timeout(120)
def test_a_line_killed_running_by_a_second_ctrl_c_is_written_interrupted_not_as_never_run(
    tmp_path: Path,
) -> None:
    """A line that had run for seconds when a second Ctrl-C killed it was written
    ``not_run``, ``attempts: 0``, "the batch stopped before this line ran", and listed
    among the lines that did not run: the one line that could say where it hung said it
    never started. It has the stack the line was killed in, too: the kill asks for it
    first, as a hard timeout's does ("where was it stuck")."""
    code, text, ran = stop_a_hung_line(tmp_path, presses=2)
    assert code == 130, text
    rows = results(tmp_path / "out.jsonl")
    [other] = {1, 2} - {ran}
    killed, waited = rows[ran], rows[other]
    assert killed["outcome"] == "interrupted" and killed["attempts"] == 1, killed
    assert killed["error"].startswith("the batch was stopped while this line ran"), killed
    assert killed["ran_s"] > 0, killed
    assert "in recorded_sleep" in killed.get("traceback", ""), killed
    assert waited == {
        "line": other,
        "outcome": "not_run",
        "attempts": 0,
        "error": "the batch stopped before this line ran",
    }
    assert f"1 line(s) did not run: {other}" in text
    assert f"1 line(s) were stopped while they ran: {ran}" in text
    assert "Traceback" not in text


@pytest.mark.timeout(120)
def test_a_line_stopped_at_the_end_of_the_drain_keeps_where_it_was(tmp_path: Path) -> None:
    """One Ctrl-C, and a line that does not finish within --stop-timeout-s: the pool sends
    it the soft signal, with a dump of its stack, then kills it. It was written as never
    run, without the stack that says where it was."""
    code, text, ran = stop_a_hung_line(tmp_path, "--stop-timeout-s", "1", presses=1)
    assert code == 130, text
    rows = results(tmp_path / "out.jsonl")
    killed = rows[ran]
    assert (killed["outcome"], killed["attempts"]) == ("interrupted", 1), killed
    assert "in recorded_sleep" in killed["traceback"], killed  # where it slept
    assert f"1 line(s) were stopped while they ran: {ran}" in text


@pytest.mark.timeout(60)
def test_on_a_terminal_the_progress_bar_redraws_live(tmp_path: Path) -> None:
    lines = [json.dumps({"args": [0.3, i]}) for i in range(8)]
    write_lines(tmp_path / "in.jsonl", *lines)
    leader, follower = pty.openpty()
    try:
        proc = start_in_session(
            tmp_path,
            H + "succeed_after",
            "in.jsonl",
            "--output",
            "o.jsonl",
            "--concurrency",
            "2",
            stderr=follower,
        )
        os.close(follower)
        screen = b""
        while True:  # read all the terminal gets, so the writer never blocks
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the process closed the terminal
                    break
                if not chunk:
                    break
                screen += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(30) == 0
    finally:
        os.close(leader)
    text = screen.decode(errors="replace")
    assert text.count("\r") > 2 or text.count("\x1b[") > 10  # redrawn in place, not printed once
    assert "8/8" in text and "8 ok" in text and "jobs/s" in text and "ETA" in text
    assert len(results(tmp_path / "o.jsonl")) == 8


def _own_terminal() -> None:
    """In the child: a session of its own, whose controlling terminal is its stdin."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.mark.timeout(60)
def test_closing_the_terminal_drains_the_run_and_writes_every_line(tmp_path: Path) -> None:
    """Closing the window a run shows its bar in: the hangup killed the run at once, and
    the lines running and waiting were never written. Once the hangup was a stop, the
    next redraw on the closed terminal (EIO) ended it with exit 1 and no line written.
    It drains as the first Ctrl-C does: every line is written, and the status is 129."""
    log = tmp_path / "runs"
    jobs = [json.dumps({"args": [str(log), f"k{i}", 1.0]}) for i in range(1, 6)]
    write_lines(tmp_path / "in.jsonl", *jobs)
    leader, follower = pty.openpty()
    argv = [H + "recorded_sleep", "in.jsonl", "--output", "out.jsonl", "--concurrency", "2"]
    try:
        proc = subprocess.Popen(
            [*CLI, "run", *argv],
            cwd=tmp_path,
            stdin=follower,
            stdout=follower,
            stderr=follower,
            preexec_fn=_own_terminal,
        )
        os.close(follower)
        wait_for(lambda: len(started(log)) == 2, 30, "two lines to start")
    finally:
        os.close(leader)  # the window closes: the terminal hangs up
    try:
        assert proc.wait(30) == 128 + signal.SIGHUP
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = results(tmp_path / "out.jsonl")
    ran = {int(key[1:]) for _, key in started(log)}
    assert {n for n, row in rows.items() if row["outcome"] == "ok"} == ran
    assert {n for n, row in rows.items() if row["outcome"] == "not_run"} == {1, 2, 3, 4, 5} - ran


@pytest.mark.timeout(60)
def test_the_bars_rate_is_the_runs_not_a_burst(tmp_path: Path) -> None:
    """Two lines that finish together: the bar showed rich's speed over its last updates,
    12,532.9 jobs/s beside a summary of 7.8. It shows lines over the run's time, once a
    second has passed, as the summary counts them."""
    source = write_lines(tmp_path / "in.jsonl", '{"args": [1]}', '{"args": [2]}')
    proc = subprocess.run(
        [*CLI, "run", H + "echo", str(source), "--output", str(tmp_path / "o.jsonl")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    summary = next(line for line in proc.stderr.splitlines() if "line(s) of" in line)
    run_rate = float(summary.split(", ")[-1].split()[0])
    for line in proc.stderr.splitlines():
        if line.startswith("running") and "jobs/s" in line:
            shown = float(line.split("jobs/s")[0].split()[-1])
            assert shown <= 2 * run_rate, (line, summary)


@pytest.mark.timeout(60)
def test_a_reader_that_leaves_early_ends_the_batch_quietly(tmp_path: Path) -> None:
    """`sandboxq run ... | head -1`: the pool stops, no traceback, no orphan, one line
    saying why, and 128 + SIGPIPE (it was 1, and now and then 'the pool is broken: no
    child could be started: BrokenPipeError': a child's start flushes stdout)."""
    write_lines(tmp_path / "in.jsonl", *(json.dumps({"args": [0.05, i]}) for i in range(200)))
    proc = subprocess.Popen(
        [*CLI, "run", H + "succeed_after", "in.jsonl", "--concurrency", "2"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    # stderr is read all along: a full pipe would block the run, not the test's subject
    errors: list[bytes] = []
    reader = threading.Thread(target=lambda: errors.append(proc.stderr.read()))  # type: ignore[union-attr]
    reader.start()
    first = json.loads(proc.stdout.readline())
    proc.stdout.close()  # as `head -1` does
    try:
        assert proc.wait(30) == 141
    finally:
        if proc.poll() is None:
            proc.kill()  # never left behind, whatever failed
        reader.join(10)
        proc.stderr.close()
    err = b"".join(errors).decode()
    assert first["outcome"] == "ok" and "Traceback" not in err and "broken" not in err, err
    assert "the results' reader closed stdout: stopped" in err


@pytest.mark.timeout(30)
def test_following_a_finished_worker_reads_what_is_left_without_waiting_a_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A look interval long enough that waiting one cannot pass for not waiting.
    monkeypatch.setattr(batch, "FOLLOW_LOOK_S", 10.0)
    backend = MemoryBackend("follow-done")
    item = run_files.Item(1, b"[[],{}]")
    backend.enqueue([NewJob(b"[[],{}]", job_id=item.job_id)])
    tally = Tally()
    lines: list[str] = []
    output = run_files.Output(None, tally)
    monkeypatch.setattr(output, "write", lambda line, outcome, **_: lines.append(outcome))
    view = BatchView(1, tally, redirect_stdout=False)
    began = time.monotonic()
    batch.follow(backend, [item], output, view, batch.StopRequests(), wait_done=lambda s: True)
    assert time.monotonic() - began < 5.0  # the worker was done: no tick to wait out
    assert lines == []  # its one job never finished: nothing to write
    backend.close()


@pytest.mark.timeout(30)
def test_the_summary_splits_the_errors_by_the_kind_raised(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """ "error 66" said nothing of why: its lines are split by the type each raised, as
    ``sandboxq batch`` splits a batch's failures; an error that names none is ``other``."""
    tally = Tally()
    errors = {1: "builtins.ValueError: x", 2: "builtins.KeyError: 3", 3: "builtins.ValueError: y"}
    for line, error in {**errors, 4: "names no type"}.items():
        tally.add("error", line, error)
    tally.add("ok", 5)
    BatchView(5, tally, redirect_stdout=False).summary("in.jsonl", interrupted=False)
    err = capsys.readouterr().err
    rows = [line.split() for line in err.splitlines() if line.split()[:1] == ["error"]]
    assert rows == [
        ["error", "ValueError", "2", "1,", "3"],
        ["error", "KeyError", "1", "2"],
        ["error", "other", "1", "4"],
    ], err
