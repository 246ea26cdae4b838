"""Where an attempt was when it failed, hung or crashed, against real children: the
traceback of a raise, the stack of every thread captured (``faulthandler``) at the soft
signal and just before the hard kill, the stack a crashing child died in, and what the
attempt wrote to stdout and stderr."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import psutil
import pytest

from sandboxq import AttemptFailed, Pool
from sandboxq.models import Outcome
from sandboxq.pool import stacks
from sandboxq.pool.attempt import AttemptResult
from sandboxq.pool.child import SIGSOFT
from sandboxq.pool.output import TAIL_BYTES
from sandboxq.testing.waiting import wait_for
from sandboxq.text import MAX_TRACEBACK_BYTES, bounded_traceback
from tests.support import where

pytestmark = pytest.mark.alone  # kills within 0.25 s of their deadline

W = "tests.support.where:"
#: What these tests look at does not depend on containment: the process-tree mode, where
#: no other pool's clean-up of stale control groups can reach them (the hard-kill test
#: runs in both modes).
TREE = "process_tree"


def attempt(pool: Pool, *args: object, **kwargs: object) -> AttemptResult:
    done: Future[AttemptResult] = Future()
    pool.execute(pool.make_task(*args, **kwargs), done.set_result)
    return done.result(timeout=30)


# -- the traceback of a raise --------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_raise_two_frames_deep_keeps_both_frames_and_the_exception() -> None:
    with Pool(W + "outer_frame_raises", size=1, containment=TREE) as pool:
        result = attempt(pool, "it broke here")
        assert result.outcome is Outcome.ERROR
        tb = result.traceback
        assert tb is not None
        assert "in outer_frame_raises" in tb and "in inner_frame_raises" in tb
        assert tb.index("outer_frame_raises") < tb.index("inner_frame_raises")
        assert tb.rstrip().endswith("RuntimeError: it broke here")
        with pytest.raises(AttemptFailed) as info:
            pool.submit("again").result(timeout=10)
        assert info.value.remote_traceback is not None
        assert "in inner_frame_raises" in info.value.remote_traceback


@pytest.mark.timeout(30)
def test_a_huge_traceback_is_bounded_keeping_the_innermost_frames() -> None:
    with Pool(W + "deep_recursion", size=1, containment=TREE) as pool:
        result = attempt(pool)
    tb = result.traceback
    assert result.outcome is Outcome.ERROR and tb is not None
    assert len(tb.encode()) <= MAX_TRACEBACK_BYTES
    assert tb.startswith("Traceback (most recent call last):")
    assert " cut ...\n" in tb
    assert tb.rstrip().endswith("RecursionError: maximum recursion depth exceeded")
    assert "in deep_recursion" in tb.split(" cut ...\n")[1]


@pytest.mark.timeout(60)
def test_a_huge_exception_message_is_bounded_and_keeps_the_type_and_traceback() -> None:
    """50 MB of message in one line, over the pipe's frame limit as raised: the child
    bounds it (and drops the exception's pickle) before it sends it."""
    with Pool(W + "raise_huge_message", size=1, containment=TREE) as pool:
        result = attempt(pool, 50 * 1024 * 1024)
        assert result.outcome is Outcome.ERROR and result.error is not None
        assert result.error.type_name == "builtins.ValueError"
        assert result.error.message.startswith("EEEE") and " cut ...\n" in result.error.message
        assert len(result.error.message.encode()) <= MAX_TRACEBACK_BYTES
        assert result.error.pickled is None
        tb = result.traceback
        assert tb is not None and len(tb.encode()) <= MAX_TRACEBACK_BYTES
        assert "in raise_huge_message" in tb and "ValueError: EEEE" in tb
        with pytest.raises(AttemptFailed, match=r"ValueError: EEEEEEEEEE$"):  # the pool goes on
            pool.submit(10).result(timeout=30)


def test_bounding_says_how_much_was_cut() -> None:
    frames = [f'  File "m.py", line {n}, in f{n}\n    f{n + 1}()\n' for n in range(2000)]
    text = "Traceback (most recent call last):\n" + "".join(frames) + "ValueError: last\n"
    bounded = bounded_traceback(text, 4096)
    assert len(bounded.encode()) <= 4096
    head, note, *_ = bounded.splitlines()
    assert head == "Traceback (most recent call last):"
    kept = bounded.count("\n") - 2
    lines_cut = text.count("\n") - 1 - kept
    chars_cut = len(text) - len(bounded) + len(note) + 1
    assert note == f"... {lines_cut:,} lines ({chars_cut:,} characters) cut ..."
    assert bounded.endswith("in f1999\n    f2000()\nValueError: last\n")
    # A stack dump lists the innermost frame first: its beginning is what is kept.
    dump = "Current thread 0x1 (most recent call first):\n" + "".join(
        f'  File "m.py", line {n} in f{n}\n' for n in range(2000)
    )
    bounded = bounded_traceback(dump, 4096)
    assert bounded.startswith(
        'Current thread 0x1 (most recent call first):\n  File "m.py", line 0 in f0\n'
    )
    assert bounded.endswith(" cut ...\n") and len(bounded.encode()) <= 4096
    assert bounded_traceback("short\n") == "short\n"
    # One line alone (an exception's message) is cut too.
    one = bounded_traceback("E" * 100_000, 4096)
    assert one.startswith("EEEE") and len(one.encode()) <= 4096 and " cut ...\n" in one


# -- the stack of a hung or crashed child ---------------------------------------------------

HARD = 0.6
#: A generous bound for a loaded 2-core machine; bench/ measures the real figures.
KILL_MARGIN_S = 0.25


def _innermost(dump: str, frames: int = 2) -> str:
    """The innermost ``frames`` frames of the first thread of a ``faulthandler`` dump (the
    handler's function is the first, or below a library's, as ``re.match``)."""
    return "\n".join(dump.split("(most recent call first):\n")[1].splitlines()[:frames])


def _killed_on_time(result: AttemptResult) -> None:
    assert result.outcome is Outcome.HARD_TIMEOUT, result.cause
    assert result.runtime_s is not None and HARD <= result.runtime_s < HARD + KILL_MARGIN_S


@pytest.mark.timeout(30)
@pytest.mark.parametrize("handler", ["spin_in_pure_python", "sleep_in_libc", "regex_with_the_gil"])
def test_a_hard_killed_handler_names_the_function_it_was_stuck_in(
    handler: str, containment: str
) -> None:
    with Pool(W + handler, size=1, hard_timeout_s=HARD, containment=containment) as pool:
        result = attempt(pool)
    _killed_on_time(result)
    assert result.signal == signal.SIGKILL
    tb = result.traceback
    assert tb is not None, result
    assert "most recent call first" in tb
    assert f"in {handler}" in _innermost(tb), tb
    assert len(tb.encode()) <= MAX_TRACEBACK_BYTES


@pytest.mark.timeout(30)
def test_a_child_stopped_when_killed_says_why_it_has_no_stack(containment: str) -> None:
    """A handler that SIGSTOPped its own process, killed at its hard deadline: a stopped
    process takes no signal but SIGKILL, so it dumped no stack, and its traceback was
    empty, as if the pool had lost it. It says the child was stopped."""
    with Pool(W + "stop_itself", size=1, hard_timeout_s=HARD, containment=containment) as pool:
        result = attempt(pool)
        _killed_on_time(result)
        assert result.traceback is not None, result
        assert "stopped (SIGSTOP" in result.traceback and "state T" in result.traceback
        assert "no stack" in result.traceback, result.traceback
        # The next attempt, on a fresh child, spins: its own stack, no word of a stop.
        again = attempt(pool, False)
        _killed_on_time(again)
        assert again.pid != result.pid and again.traceback is not None
        assert "in spin_in_pure_python" in again.traceback and "no stack" not in again.traceback


@pytest.mark.timeout(30)
def test_the_libc_call_really_holds_the_gil() -> None:
    """What makes ``sleep_in_libc`` the GIL-holding case: no other thread ran during it."""
    with Pool(W + "gil_is_held_in_libc_sleep", size=1, containment=TREE) as pool:
        assert pool.submit().result(timeout=10) is True


@pytest.mark.timeout(30)
def test_the_stack_at_the_soft_signal_when_the_handler_returns_after_it() -> None:
    with Pool(
        W + "swallow_soft_timeout_then", 1, soft_timeout_s=0.3, hard_timeout_s=5, containment=TREE
    ) as pool:
        result = attempt(pool, "return")
    assert result.outcome is Outcome.SOFT_TIMEOUT
    assert result.traceback is not None
    assert "in spin_in_pure_python" in _innermost(result.traceback, 1)


@pytest.mark.timeout(30)
def test_a_raise_at_the_soft_signal_keeps_every_threads_stack_beside_its_traceback() -> None:
    """The README promises, at the soft signal, the stack of every thread of the child; a
    handler that raised SoftTimeout kept its raise's traceback alone, and a thread that
    did the waiting was nowhere."""
    with Pool(W + "spin_beside_a_waiting_thread", 1, soft_timeout_s=0.3, hard_timeout_s=5,
              containment=TREE) as pool:  # fmt: skip
        result = attempt(pool)
    assert result.outcome is Outcome.SOFT_TIMEOUT, result.cause
    tb = result.traceback or ""
    assert "SoftTimeout" in tb and "in spin_in_pure_python" in tb, tb  # the raise
    assert "in wait_in_a_side_thread" in tb, tb  # and every thread, as it was
    assert len(tb.encode()) <= MAX_TRACEBACK_BYTES


def _swallowed_then_killed(then: str, signum: int) -> AttemptResult:
    """An attempt that caught its SoftTimeout and spun on (``then``, blocking ``signum``)
    until its hard kill, on time."""
    with Pool(
        W + "swallow_soft_timeout_then",
        1,
        soft_timeout_s=0.3,
        hard_timeout_s=HARD,
        containment=TREE,
    ) as pool:
        result = attempt(pool, then, signum)
    _killed_on_time(result)
    return result


@pytest.mark.timeout(30)
def test_a_hard_kill_keeps_the_stack_at_the_soft_signal_too() -> None:
    """The README promises the stacks at the soft signal and again before the hard kill;
    a handler that went on elsewhere after its soft signal kept the second alone, and
    where it was when told to stop was lost."""
    result = _swallowed_then_killed("spin", 0)
    tb = result.traceback or ""
    assert "in spin_after_the_soft_timeout" in _innermost(tb, 1), tb  # at the kill, first
    at_soft = tb.split(stacks.SOFT_STACK_HEADER, 1)
    assert len(at_soft) == 2 and "in spin_in_pure_python" in _innermost(at_soft[1], 1), tb
    assert len(tb.encode()) <= MAX_TRACEBACK_BYTES


@pytest.mark.timeout(30)
def test_the_soft_stack_stays_when_the_hard_dump_is_blocked() -> None:
    result = _swallowed_then_killed("block", stacks.DUMP_SIGNAL)
    assert result.traceback is not None
    assert "in spin_in_pure_python" in result.traceback
    assert "spin_after_the_soft_timeout" not in result.traceback


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("handler", "signum"), [("segfault_here", signal.SIGSEGV), ("abort_here", signal.SIGABRT)]
)
def test_a_crashing_handler_names_the_function_it_crashed_in(handler: str, signum: int) -> None:
    with Pool(W + handler, size=1, containment=TREE) as pool:
        result = attempt(pool)
        assert result.outcome is Outcome.CRASHED and result.signal == signum
        tb = result.traceback
        assert tb is not None and tb.startswith("Fatal Python error")
        assert f"in {handler}" in _innermost(tb), tb
        # The next attempt, on a fresh child, crashes with a stack of its own.
        again = attempt(pool)
        assert again.pid != result.pid and again.traceback is not None


@pytest.mark.timeout(30)
def test_a_forked_grandchilds_crash_is_not_taken_for_the_childs_stack() -> None:
    with Pool(
        W + "grandchild_crashes_then_spin", size=1, hard_timeout_s=HARD, containment=TREE
    ) as pool:
        result = attempt(pool)
    _killed_on_time(result)
    assert result.traceback is not None
    assert "Fatal Python error" not in result.traceback
    assert "in spin_in_pure_python" in _innermost(result.traceback, 1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_stacks_and_output_with_either_start_method(start_method: str) -> None:
    with Pool(
        W + "print_then_spin", 1, hard_timeout_s=HARD, start_method=start_method, containment=TREE
    ) as pool:
        result = attempt(pool, "spinning now")
    _killed_on_time(result)
    assert result.output == "spinning now\n"
    assert result.traceback is not None and "in spin_in_pure_python" in result.traceback


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "handler",
    ["block_the_dump_signal", "own_handler_for_the_dump_signal"],
)
def test_a_handler_that_keeps_the_dump_from_coming_is_still_killed_on_time(handler: str) -> None:
    with Pool(W + handler, size=1, hard_timeout_s=HARD, containment=TREE) as pool:
        result = attempt(pool, stacks.DUMP_SIGNAL)
        _killed_on_time(result)
        assert result.traceback is None
        # The replacement child dumps again.
        again = attempt(pool, 0)  # signal 0: the handler changes nothing
        _killed_on_time(again)
        assert again.traceback is not None and "in spin_in_pure_python" in again.traceback


@pytest.mark.timeout(30)
def test_a_handler_that_resets_the_dump_signal_ends_as_the_hard_timeout_it_was_due() -> None:
    with Pool(
        W + "default_action_for_the_dump_signal", size=1, hard_timeout_s=HARD, containment=TREE
    ) as pool:
        result = attempt(pool, stacks.DUMP_SIGNAL)
    # It dies of the dump signal, a few ms before the deadline: not a crash of its own
    # (or, when its death is seen only at the deadline, killed there as due).
    assert result.outcome is Outcome.HARD_TIMEOUT, result.cause
    assert result.runtime_s is not None and result.runtime_s < HARD + KILL_MARGIN_S
    if result.runtime_s < HARD:
        assert "reset that signal to its default action" in result.cause


# -- a stop's kill: the stack first ---------------------------------------------------------


def _signal_mask(pid: int, field: str) -> int:
    """The ``field`` signal mask (``SigBlk``, ``SigCgt``) of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _dump_bit(pid: int, field: str) -> bool:
    return bool(_signal_mask(pid, field) >> (stacks.DUMP_SIGNAL - 1) & 1)


def _stop_with_stack_first(
    handler: str, ready: Callable[[int], bool], *args: object
) -> tuple[AttemptResult, float]:
    """Run ``handler`` (spinning) until ``ready(pid)``, then kill it as a worker's stop
    does. Returns its result and how long the kill took from being asked."""
    with Pool(W + handler, size=1, containment=TREE) as pool:
        done: Future[AttemptResult] = Future()
        task_id = pool.new_task_id()
        pool.execute(pool.make_task(*args), done.set_result, task_id=task_id)
        pid = wait_for(lambda: pool.running_pids().get(task_id), 10, "the attempt to start")
        wait_for(lambda: ready(pid), 10, "the handler to be where the test needs it")
        asked = time.monotonic()
        pool.kill(task_id, Outcome.INTERRUPTED, "the worker stopped", stack_first=True)
        result = done.result(timeout=30)
        return result, time.monotonic() - asked


@pytest.mark.timeout(30)
def test_a_stops_kill_asks_for_the_stack_first() -> None:
    """A second Ctrl-C (``stop(now=True)``) killed a hung line at once: its line said it
    was interrupted, not where. The kill asks for the stack first, as a hard timeout's."""
    result, took_s = _stop_with_stack_first("spin_in_pure_python", lambda pid: True)
    assert result.outcome is Outcome.INTERRUPTED, result.cause
    assert result.traceback is not None and "in spin_in_pure_python" in result.traceback
    assert took_s < stacks.DUMP_EARLY_S + KILL_MARGIN_S, took_s


@pytest.mark.timeout(30)
def test_a_stops_kill_comes_on_time_when_the_handler_blocks_the_dump() -> None:
    result, took_s = _stop_with_stack_first(
        "block_the_dump_signal", lambda pid: _dump_bit(pid, "SigBlk"), stacks.DUMP_SIGNAL
    )
    assert result.outcome is Outcome.INTERRUPTED, result.cause
    assert result.traceback is None
    assert stacks.DUMP_EARLY_S <= took_s < stacks.DUMP_EARLY_S + KILL_MARGIN_S, took_s


@pytest.mark.timeout(30)
def test_a_handler_that_resets_the_dump_signal_ends_as_the_stop_it_was_due() -> None:
    """Asked for its stack, it dies of the dump signal: the stop's kill, not a hard
    timeout (the only other kill that asks first)."""
    result, _took_s = _stop_with_stack_first(
        "default_action_for_the_dump_signal",
        lambda pid: not _dump_bit(pid, "SigCgt"),
        stacks.DUMP_SIGNAL,
    )
    assert result.outcome is Outcome.INTERRUPTED, result.cause
    assert "reset that signal to its default action" in result.cause, result.cause


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("then", "outcome"), [("spin", Outcome.HARD_TIMEOUT), ("segfault", Outcome.CRASHED)]
)
def test_a_handler_that_closes_every_descriptor(then: str, outcome: Outcome) -> None:
    """Its dump file is gone with them: no stack, and still killed on time."""
    with Pool(
        W + "close_every_descriptor_then", size=1, hard_timeout_s=HARD, containment=TREE
    ) as pool:
        result = attempt(pool, then)
        assert result.outcome is outcome, result.cause
        if outcome is Outcome.HARD_TIMEOUT:
            _killed_on_time(result)
        assert result.traceback is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("then", "outcome"), [("spin", Outcome.HARD_TIMEOUT), ("segfault", Outcome.CRASHED)]
)
def test_a_stack_one_attempt_wrote_into_the_dump_file_is_not_the_next_ones(
    then: str, outcome: Outcome
) -> None:
    """A handler holds its child's dump file: what it wrote there (a stack of its own
    making) showed as the traceback of the next job on that child, killed or crashed."""
    with Pool(W + "forge_a_stack_or", size=1, hard_timeout_s=HARD, containment=TREE) as pool:
        forger = attempt(pool, "forge")
        assert forger.outcome is Outcome.OK and pickle.loads(forger.result or b"") == "forged"
        result = attempt(pool, then)
    assert result.pid == forger.pid  # the same child
    assert result.outcome is outcome, result.cause
    tb = result.traceback
    assert tb is not None and where.FORGED_FRAME not in tb, tb
    assert "in spin_in_pure_python" in tb or "in segfault_here" in tb, tb


# -- what the attempt wrote ------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_the_output_of_an_attempt_is_kept_from_both_streams() -> None:
    with Pool(W + "print_and_return", size=1, containment=TREE) as pool:
        result = attempt(pool, "to stdout", 1, "to stderr")
    assert result.outcome is Outcome.OK
    assert result.output is not None
    assert "to stdout\n" in result.output and "to stderr\n" in result.output


@pytest.mark.timeout(30)
def test_output_is_bounded_to_the_last_8_kib_and_says_what_was_cut() -> None:
    with Pool(W + "print_numbered", size=1, containment=TREE) as pool:
        result = attempt(pool, 20_000)
    out = result.output
    assert out is not None
    note, _, kept = out.partition("\n")
    assert len(kept.encode()) == TAIL_BYTES
    assert kept.endswith("line 19999\n")
    written = sum(len(f"line {n}\n") for n in range(20_000))
    assert note == f"... {written - TAIL_BYTES:,} bytes before these cut ..."


@pytest.mark.timeout(30)
def test_output_is_per_attempt_on_a_reused_child() -> None:
    with Pool(W + "print_and_return", size=1, containment=TREE) as pool:
        first = attempt(pool, "from the first attempt")
        second = attempt(pool, "from the second attempt")
        silent = attempt(pool, "", 0)
    assert first.pid == second.pid == silent.pid  # one child, reused
    assert first.output == "from the first attempt\n"
    assert second.output == "from the second attempt\n"
    assert silent.output is None


@pytest.mark.timeout(60)
def test_short_attempts_queued_in_one_child_each_keep_only_their_own_output() -> None:
    """Short jobs are queued in a busy child's channel (assign.py): the next one starts
    before the parent has read the reply of the one before. Each still keeps what it
    wrote, all of it, and nothing of its neighbours'."""
    with Pool(W + "print_then_raise_every_tenth", size=1, containment=TREE) as pool:
        done: dict[int, Future[AttemptResult]] = {i: Future() for i in range(400)}
        for i, future in done.items():
            pool.execute(pool.make_task(i), future.set_result)
        results = {i: future.result(timeout=30) for i, future in done.items()}
    wrong = []
    for i, result in results.items():
        expected = {f"stdout of {i}", f"stderr of {i}"} if i % 10 == 5 else set()
        got = set(result.output.splitlines()) if result.output else set()
        if got != expected:
            wrong.append((i, result.output))
    assert not wrong, f"{len(wrong)} of 400 attempts kept the wrong output, e.g. {wrong[:3]}"


@pytest.mark.timeout(30)
def test_a_process_the_attempt_left_printing_does_not_reach_the_next_attempt() -> None:
    with Pool(W + "leave_a_printer_or_say", size=1, containment=TREE) as pool:
        first = attempt(pool, "stray")
        second = attempt(pool, "the second attempt")
    assert first.output is not None and "from the stray" in first.output
    assert second.pid == first.pid
    assert second.output == "the second attempt\n"
    printer = pickle.loads(first.result or b"")
    with contextlib.suppress(psutil.NoSuchProcess):  # swept before the first reply
        assert psutil.Process(printer).status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(30)
def test_what_a_hard_killed_handler_printed_before_it_hung_is_kept() -> None:
    with Pool(W + "print_then_spin", 1, hard_timeout_s=HARD, containment=TREE) as pool:
        result = attempt(pool, "about to spin")
    _killed_on_time(result)
    assert result.output == "about to spin\n"


@pytest.mark.timeout(30)
def test_capture_output_false_leaves_output_none() -> None:
    with Pool(W + "print_and_return", 1, capture_output=False, containment=TREE) as pool:
        result = attempt(pool, "not kept", 1, "nor this")
    assert result.outcome is Outcome.OK and result.output is None


SHOWS_LIVE = """
import sys
from concurrent.futures import Future
from pathlib import Path
from sandboxq import Pool
with Pool("tests.support.where:print_and_return", size=1, capture_output=sys.argv[1] == "on",
          containment="process_tree") as pool:
    done = Future()
    pool.execute(pool.make_task("OUT-LINE", 1, "ERR-LINE"), done.set_result)
    kept = done.result(timeout=20).output
# Written once the pool is closed: the live view is the relay thread's, which may still be
# writing when the outcome is known (a print writes its parts one by one to the child's
# write-through stderr, so a line written then could land between them).
sys.stderr.write(f"kept: {kept!r}\\n")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("capture", ["on", "off"])
def test_output_is_still_shown_on_the_workers_own_stdout_and_stderr(capture: str) -> None:
    shown = subprocess.run(
        [sys.executable, "-c", SHOWS_LIVE, capture], capture_output=True, text=True, timeout=50
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == "OUT-LINE\n"
    shown_live = [line for line in shown.stderr.splitlines() if not line.startswith("kept:")]
    assert shown_live == ["ERR-LINE"]
    kept = "'OUT-LINE\\nERR-LINE\\n'" if capture == "on" else "None"
    assert f"kept: {kept}" in shown.stderr


# -- `sandboxq run` keeps stdout for its results ------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["local", "fleet"])
@pytest.mark.parametrize("capture", ["on", "off"])
def test_sandboxq_run_stdout_is_json_lines_when_handlers_print(
    mode: str, capture: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"args": ["printed {n}", 2, "said {n}"]}}\n' for n in range(4)))
    argv = [sys.executable, "-m", "sandboxq", "run", W + "print_and_return", str(source)]
    argv += ["--containment", TREE]
    if mode == "fleet":
        url = request.getfixturevalue("redis_url")
        argv += ["--url", url, "--queue", f"prints-{capture}", "--concurrency", "1"]
    if capture == "off":
        argv.append("--no-capture-output")
    ran = subprocess.run(argv, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr
    rows = [json.loads(line) for line in ran.stdout.splitlines()]
    assert sorted(r["line"] for r in rows) == [1, 2, 3, 4]
    assert {r["outcome"] for r in rows} == {"ok"}
    # What the handlers printed is not lost: on stderr. Without capture two children
    # write to it at once, so their lines may interleave mid-line.
    for n in range(4):
        assert ran.stderr.count(f"printed {n}") == 2 and f"said {n}" in ran.stderr


# -- the soft signal and the dump ------------------------------------------------------------


def _waits_in(pid: int, kernel_function: str) -> None:
    """Until ``pid`` sleeps in ``kernel_function`` (its /proc wchan: the kernel names
    it ``pipe_read`` or ``anon_pipe_read``, by version). A kernel that shows no wchan
    (built without symbols: always "0") cannot tell: the test is skipped, saying so."""
    deadline = time.monotonic() + 10
    shown = False
    while kernel_function not in (wchan := Path(f"/proc/{pid}/wchan").read_text()):
        shown = shown or wchan not in ("", "0")
        if time.monotonic() >= deadline:
            if not shown:
                pytest.skip("this kernel shows no /proc/<pid>/wchan: no way to see the dump")
            raise AssertionError(f"{pid} never waited in {kernel_function} (wchan {wchan!r})")
        time.sleep(0.001)


def _drain(fd: int) -> None:
    while os.read(fd, 65536):
        pass


@pytest.mark.timeout(30)
def test_a_soft_signal_landing_during_the_stack_dump_still_ends_a_blocked_call() -> None:
    """``signal_soft`` sends the dump signal, then the soft signal at once. When the soft
    one lands while faulthandler still dumps, the call the dump interrupted (a ``read()``
    here) must end with EINTR, not be restarted by the kernel once the dump returns: else
    the soft signal's Python handler never runs, and a soft timeout becomes a hard one.
    A full pipe as the dump's file holds the dump in its first write, so the soft signal
    lands inside it every time."""
    dump_r, dump_w = os.pipe()
    fcntl.fcntl(dump_w, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(dump_w, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(dump_w, b"x" * 4096)
    os.set_blocking(dump_w, True)
    drain = threading.Thread(target=_drain, args=(dump_r,), daemon=True)
    with subprocess.Popen(
        [sys.executable, "-m", "tests.support.soft_during_dump", str(dump_w)],
        pass_fds=(dump_w,),
        stdout=subprocess.PIPE,
    ) as child:
        os.close(dump_w)
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == b"armed\n"
            _waits_in(child.pid, "pipe_read")
            os.kill(child.pid, stacks.DUMP_SIGNAL)
            _waits_in(child.pid, "pipe_write")  # the dump, held by the full pipe
            os.kill(child.pid, SIGSOFT)
            # then let the dump finish (the reader ends when the child closes its end)
            drain.start()
            try:
                out, _ = child.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                pytest.fail("the soft signal never ended the read: the kernel restarted it")
            assert out == b"soft\n"
        finally:
            child.kill()
    if drain.ident is not None:  # started
        drain.join(timeout=10)
    os.close(dump_r)
