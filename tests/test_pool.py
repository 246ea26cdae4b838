"""The sandboxed pool against real misbehaving children: every catalogue handler ends with
its stated outcome, the kill lands close to its deadline, the pool serves the next job,
and nothing is left running."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import psutil
import pytest

from sandboxq import AttemptFailed, ConfigError, Pool, ProcessorError, SerializationError
from sandboxq.models import Outcome
from sandboxq.pool.assign import PIPELINE_DEPTH
from sandboxq.pool.attempt import AttemptResult
from sandboxq.testing.waiting import wait_for

H = "sandboxq.testing.handlers:"
SOFT, HARD = 0.3, 0.6
#: A generous bound for a loaded 2-core CI machine; bench/ measures the real figures.
KILL_MARGIN_S = 0.25


def attempt(pool: Pool, *args: object, **kwargs: object) -> AttemptResult:
    done: Future[AttemptResult] = Future()
    pool.execute(pool.make_task(*args, **kwargs), done.set_result)
    return done.result(timeout=30)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # gone, even between looking it up and asking its status
        return False


def wait_dead(pids: list[int], timeout_s: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.02)
    return alive


CATALOGUE = [
    # handler, soft timeout set?, expected outcome
    ("sleep_forever", True, Outcome.SOFT_TIMEOUT),
    ("sleep_forever", False, Outcome.HARD_TIMEOUT),
    ("cpu_spin", True, Outcome.SOFT_TIMEOUT),
    ("cpu_spin", False, Outcome.HARD_TIMEOUT),
    ("hold_gil", True, Outcome.HARD_TIMEOUT),
    ("catastrophic_regex", True, Outcome.SOFT_TIMEOUT),
    ("swallow_soft_timeout", True, Outcome.HARD_TIMEOUT),
    ("ignore_signals", True, Outcome.HARD_TIMEOUT),
    ("block_in_syscall", False, Outcome.HARD_TIMEOUT),
]


@pytest.mark.alone  # a kill within 0.25 s
@pytest.mark.timeout(30)
@pytest.mark.parametrize(("handler", "soft", "expected"), CATALOGUE)
def test_hung_handlers_end_with_their_outcome(handler: str, soft: bool, expected: Outcome) -> None:
    with Pool(
        H + handler, size=1, soft_timeout_s=SOFT if soft else None, hard_timeout_s=HARD
    ) as pool:
        first_pid = pool.pids[0] if pool.pids else None
        result = attempt(pool)
        assert result.outcome is expected, result.cause
        assert result.runtime_s is not None
        if expected is Outcome.HARD_TIMEOUT:
            assert HARD <= result.runtime_s < HARD + KILL_MARGIN_S
            assert result.signal == signal.SIGKILL
            assert not wait_dead([result.pid or 0])
        else:
            assert SOFT <= result.runtime_s < SOFT + KILL_MARGIN_S
            assert result.error is not None and result.error.type_name.endswith("SoftTimeout")
            # what ended it, with its value, before what it raised
            assert result.cause.startswith(f"soft_timeout: past its soft timeout of {SOFT:g} s (")
        # The pool goes on: the next attempt runs (and ends the same way) in a live child.
        again = attempt(pool)
        assert again.outcome is expected
        if expected is Outcome.HARD_TIMEOUT:
            assert again.pid != first_pid


@pytest.mark.timeout(30)
@pytest.mark.parametrize("handler", ["grandchild_hang", "setsid_grandchild_hang"])
def test_hard_kill_takes_grandchildren(handler: str, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    with Pool(H + handler, size=1, hard_timeout_s=HARD) as pool:
        result = attempt(pool, str(pid_file))
        assert result.outcome is Outcome.HARD_TIMEOUT
        grandchildren = [int(x) for x in pid_file.read_text().split()]
        assert grandchildren
        assert not wait_dead(grandchildren), "a grandchild outlived the hard kill"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("handler", ["grandchild_hang", "setsid_grandchild_hang"])
def test_soft_timeout_takes_the_grandchildren_it_left_behind(handler: str, tmp_path: Path) -> None:
    # The child survives its soft timeout; the attempt boundary still ends what it started
    # (another session included) before the outcome is reported.
    pid_file = tmp_path / "pids"
    with Pool(
        H + handler, 1, soft_timeout_s=SOFT, hard_timeout_s=5, containment="process_tree"
    ) as pool:
        assert attempt(pool, str(pid_file)).outcome is Outcome.SOFT_TIMEOUT
        grandchildren = [int(x) for x in pid_file.read_text().split()]
        assert grandchildren
        left = [
            p
            for p in grandchildren
            if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
        ]
        assert not left, "a grandchild outlived its attempt"


@pytest.mark.timeout(30)
def test_soft_timeout_lets_cleanup_run(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    with Pool(H + "cleanup_on_soft_timeout", size=1, soft_timeout_s=SOFT, hard_timeout_s=5) as pool:
        with pytest.raises(AttemptFailed) as info:
            pool.submit(str(marker)).result(timeout=10)
    assert info.value.outcome == "soft_timeout"
    assert marker.read_text() == "cleaned up"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("handler", ["os_exit", "sys_exit"])
def test_exit_codes_are_reported(handler: str) -> None:
    with Pool(H + handler, size=1) as pool:
        with pytest.raises(AttemptFailed) as info:
            pool.submit(10).result(timeout=10)
        assert info.value.outcome == "exit"
        assert info.value.exitcode == 10
        assert "code 10" in str(info.value)
        with pytest.raises(AttemptFailed):  # a replacement child is serving
            pool.submit(11).result(timeout=10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("code", [256, -1, 10**30])
def test_a_sys_exit_code_outside_0_255_fails_the_attempt_naming_it(code: int) -> None:
    # The system would report 256 as 0 (a completed job) and -1 as 255: the handler's
    # code is not an exit status, so the attempt is an error that says so.
    with Pool(H + "sys_exit", size=1) as pool:
        with pytest.raises(AttemptFailed) as info:
            pool.submit(code).result(timeout=10)
        assert info.value.outcome == "error"
        assert f"sys.exit({code})" in str(info.value)
        assert "0-255" in str(info.value)
        again = pool.submit(code).exception(timeout=10)
        assert isinstance(again, AttemptFailed)
        assert again.pid == info.value.pid  # the child lived on: an error, not an exit


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("handler", "signum"), [("segfault", signal.SIGSEGV), ("abort", signal.SIGABRT)]
)
def test_crashes_name_the_signal(handler: str, signum: int) -> None:
    with Pool(H + handler, size=1) as pool, pytest.raises(AttemptFailed) as info:
        pool.submit().result(timeout=10)
    assert info.value.outcome == "crashed"
    assert info.value.signal == signum
    assert signal.Signals(signum).name in str(info.value)


@pytest.mark.timeout(30)
def test_memory_limit_kills_the_tree() -> None:
    # The sampled limit; a control group's (the kernel's) is tested in test_containment.py.
    with Pool(
        H + "grow_memory", 1, max_memory_mb=200, hard_timeout_s=20, containment="process_tree"
    ) as pool:
        result = attempt(pool)
    assert result.outcome is Outcome.MEMORY_LIMIT, result.cause
    assert "over the limit of 200 MB" in result.cause


@pytest.mark.timeout(30)
def test_exception_that_cannot_be_pickled_still_arrives() -> None:
    with Pool(H + "raise_unpicklable", size=1) as pool, pytest.raises(AttemptFailed) as info:
        pool.submit().result(timeout=10)
    err = info.value
    assert err.outcome == "error"
    assert err.error_type == "sandboxq.testing.handlers._Unpicklable"
    assert "holds a lock" in str(err)
    assert err.remote_traceback and "raise_unpicklable" in err.remote_traceback


@pytest.mark.timeout(30)
def test_handler_exception_is_chained_with_remote_traceback() -> None:
    with Pool(H + "segfault", size=1) as pool:  # any processor; we call with bad arity
        with pytest.raises(AttemptFailed) as info:
            pool.submit("unexpected").result(timeout=10)
    assert isinstance(info.value.__cause__, TypeError)
    assert info.value.remote_traceback and "TypeError" in info.value.remote_traceback


@pytest.mark.timeout(30)
def test_a_kill_for_a_task_id_given_out_but_not_submitted_ends_it_when_it_comes(
    tmp_path: Path,
) -> None:
    """A caller records the id first (``new_task_id``), then submits: a kill sent in
    between is kept and done when the attempt comes, which then never starts. An id the
    pool never gave out, or whose attempt ended, is still nothing to it."""
    marker = tmp_path / "ran"
    with Pool(H + "touch_and_return", size=1) as pool:
        pool.kill(12345, Outcome.CANCELLED, "no such attempt")  # never given out: ignored
        task_id = pool.new_task_id()
        pool.kill(task_id, Outcome.CANCELLED, "cancelled before it was submitted")
        done: Future[AttemptResult] = Future()
        pool.execute(pool.make_task(str(marker)), done.set_result, task_id=task_id)
        result = done.result(timeout=10)
        assert result.outcome is Outcome.CANCELLED and result.pid is None  # never started
        assert "cancelled before it was submitted" in result.cause
        assert not marker.exists()
        assert attempt(pool, str(marker)).outcome is Outcome.OK  # the next one runs
        assert marker.exists()


@pytest.mark.timeout(30)
def test_a_handlers_traceback_starts_at_the_handler() -> None:
    """The child's own frames that call the handler (its loop, the limits' wrapper) are
    left out; an error the call itself raised, before any frame of the handler, keeps
    them, or nothing would say where it came from."""
    with Pool(H + "succeed_after", size=1, cpu_time_s=30) as pool:  # wrapped: limits.py
        with pytest.raises(AttemptFailed) as info:
            pool.submit("not seconds").result(timeout=10)
        frames = [ln for ln in info.value.remote_traceback.splitlines() if "File " in ln]
        assert frames and "handlers.py" in frames[0] and "succeed_after" in frames[0]
        assert not [f for f in frames if "child.py" in f or "limits.py" in f]
        with pytest.raises(AttemptFailed) as info:
            pool.submit(1, 2, 3, 4).result(timeout=10)  # the call is refused: no handler frame
        assert "child.py" in info.value.remote_traceback
        assert "takes from 1 to 2 positional arguments" in info.value.remote_traceback


@pytest.mark.timeout(30)
def test_unserializable_and_huge_results_fail_one_job() -> None:
    with Pool(H + "return_unserializable", size=1) as pool:
        with pytest.raises(AttemptFailed, match="cannot be encoded"):
            pool.submit().result(timeout=10)
    with Pool(H + "return_huge", size=1, max_result_bytes=1024 * 1024) as pool:
        with pytest.raises(AttemptFailed, match="over the limit"):
            pool.submit(2).result(timeout=10)
        assert len(pool.submit(0).result(timeout=10)) == 0  # the same child serves on


@pytest.mark.timeout(30)
def test_results_and_progress() -> None:
    seen: list[tuple[float, str | None]] = []
    with Pool(H + "progress_steps", size=2) as pool:
        task = pool.make_task(4)
        task = type(task)(
            **{
                **{f: getattr(task, f) for f in task.__slots__},
                "on_progress": lambda f, m: seen.append((f, m)),
            }
        )
        done: Future[AttemptResult] = Future()
        pool.execute(task, done.set_result)
        result = done.result(timeout=10)
        assert result.outcome is Outcome.OK and pickle.loads(result.result or b"") == 4
        assert [f for f, _ in seen] == [0.25, 0.5, 0.75, 1.0]
        assert [pool.submit(i).result(timeout=10) for i in range(1, 4)] == [1, 2, 3]


@pytest.mark.timeout(30)
def test_many_short_jobs_all_complete_in_order() -> None:
    with Pool(H + "echo", size=2) as pool:
        futures = [pool.submit(i) for i in range(3000)]
        assert [f.result(timeout=30) for f in futures] == list(range(3000))


@pytest.mark.timeout(30)
def test_max_jobs_per_child_recycles_children() -> None:
    with Pool(H + "echo", size=1, max_jobs_per_child=3) as pool:
        pids = set()
        for i in range(7):
            assert pool.submit(i).result(timeout=10) == i
            pids.update(pool.pids)
        # 7 jobs at 3 per child: at least 3 different children served them.
        assert len(pids) >= 3


@pytest.mark.timeout(30)
def test_kill_by_task_id_ends_that_attempt_only() -> None:
    with Pool(H + "succeed_after", size=1) as pool:
        done: Future[AttemptResult] = Future()
        task_id = pool.execute(pool.make_task(30), done.set_result)
        wait_for(pool.running_pids, 10, "the attempt to run in a child")
        pool.kill(task_id, Outcome.CANCELLED, "cancelled by a test")
        result = done.result(timeout=5)
        assert result.outcome is Outcome.CANCELLED and result.pid is not None
        # A kill for an attempt that already ended must not touch the next one.
        first: Future[AttemptResult] = Future()
        task_id = pool.execute(pool.make_task(0, "first"), first.set_result)
        assert first.result(timeout=10).outcome is Outcome.OK
        later = pool.submit(0.3, "second")
        pool.kill(task_id, Outcome.CANCELLED, "stale kill")
        assert later.result(timeout=10) == "second"


@pytest.mark.timeout(30)
def test_kill_of_a_queued_attempt_never_runs_it() -> None:
    with Pool(H + "succeed_after", size=1) as pool:
        busy = pool.submit(0.5, "busy")
        queued: Future[AttemptResult] = Future()
        task_id = pool.execute(pool.make_task(0, "queued"), queued.set_result)
        pool.kill(task_id, Outcome.CANCELLED, "cancelled while queued")
        result = queued.result(timeout=5)
        assert result.outcome is Outcome.CANCELLED and result.pid is None
        assert busy.result(timeout=5) == "busy"


@pytest.mark.timeout(30)
def test_cancelling_a_submitted_future_ends_its_attempt_running_or_queued(tmp_path: Path) -> None:
    running_marker, queued_marker = tmp_path / "running", tmp_path / "queued"
    with Pool(H + "call", size=1) as pool:
        running = pool.submit("mark_then_hang", str(running_marker))
        queued = pool.submit("mark_started", str(queued_marker))
        wait_for(lambda: running_marker.exists() and running_marker.read_text(), 10, "a start")
        pid = int(running_marker.read_text())
        assert running.cancel() and queued.cancel()
        assert running.cancelled() and queued.cancelled()
        # the one child is free again: the hung attempt was killed, the queued one skipped
        assert pool.submit("echo", "next").result(timeout=10) == "next"
        wait_for(lambda: not psutil.pid_exists(pid), 10, "the killed child to be reaped")
    assert not queued_marker.exists()


@pytest.mark.timeout(30)
def test_short_tasks_wait_behind_an_unexpectedly_long_one_only_up_to_the_pipeline_depth() -> None:
    """While jobs are short, busy children get tasks queued in their channels; one job that
    turns out long holds back only the few queued behind it, never the whole backlog."""
    with Pool(H + "succeed_after", size=2) as pool:
        for f in [pool.submit(0) for _ in range(300)]:  # the pool learns: jobs are short
            f.result(timeout=10)
        long = pool.submit(0.5, "long")
        shorts = [pool.submit(0) for _ in range(200)]
        ended: list[float] = []
        for f in shorts:
            f.add_done_callback(lambda _: ended.append(time.monotonic()))
        assert long.result(timeout=10) == "long"
        long_ended = time.monotonic()
        for f in shorts:
            f.result(timeout=10)
        behind = sum(1 for t in ended if t >= long_ended - 0.05)
        assert behind <= PIPELINE_DEPTH, f"{behind} short tasks waited for the long one"


@pytest.mark.timeout(30)
def test_shutdown_cancel_interrupts_and_leaves_nothing() -> None:
    pool = Pool(H + "sleep_forever", size=2)
    futures = [pool.submit() for _ in range(4)]
    wait_for(lambda: len(pool.running_pids()) == 2, 10, "both children to run a task")
    pids = pool.pids
    pool.shutdown(cancel=True)
    for f in futures:
        with pytest.raises(AttemptFailed) as info:
            f.result(timeout=5)
        assert info.value.outcome == "interrupted"
    assert not wait_dead(pids)
    with pytest.raises(RuntimeError):
        pool.submit()


def test_bad_processor_fails_at_start_with_the_import_error() -> None:
    with pytest.raises(ProcessorError, match="cannot import its module: ModuleNotFoundError"):
        Pool("no_such_module:fn", size=1)
    with pytest.raises(ProcessorError, match="has no attribute"):
        Pool(H + "no_such_handler", size=1)
    with pytest.raises(ProcessorError, match="not of the form"):
        Pool("sandboxq.testing.handlers", size=1)
    with pytest.raises(ProcessorError, match="not a callable"):
        Pool("sandboxq.testing.handlers:_SLEEPER", size=1)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"soft_timeout_s": 2, "hard_timeout_s": 1}, "must be less than"),
        ({"hard_timeout_s": -1}, "hard_timeout_s"),
        ({"hard_timeout_s": float("nan")}, "hard_timeout_s"),
        ({"size": 0}, "size"),
        ({"max_jobs_per_child": 0}, "max_jobs_per_child"),
    ],
)
def test_bad_settings_name_the_setting(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Pool(H + "echo", **kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_unpicklable_arguments_fail_at_submit() -> None:
    with Pool(H + "echo", size=1) as pool, pytest.raises(SerializationError):
        pool.submit(threading.Lock())


@contextlib.contextmanager
def script_tree(script: str) -> Iterator[subprocess.Popen[bytes]]:
    """``python -c script`` in a session of its own; its whole tree killed at the end."""
    from sandboxq.pool import kill

    child = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        yield child
    finally:
        kill.kill_tree(child.pid)
        child.wait(10)


_THREAD_FORKS = (
    "import ctypes, platform, subprocess, sys, threading, time\n"
    "def start():\n"
    "    time.sleep(0.2)  # the first thread has exited by now, if it was to\n"
    "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
    "    time.sleep(30)\n"
    "threading.Thread(target=start).start()\n"
)
_FIRST_THREAD_EXITS = (
    "SYS_EXIT = {'x86_64': 60, 'aarch64': 93}[platform.machine()]\n"
    "ctypes.CDLL(None).syscall(SYS_EXIT, 0)  # exit(2): this thread only\n"
)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "first_thread", [_THREAD_FORKS + "time.sleep(30)\n", _THREAD_FORKS + _FIRST_THREAD_EXITS],
    ids=["lives", "exited"],
)  # fmt: skip
def test_tree_walk_finds_a_child_forked_by_a_thread_other_than_the_first(
    first_thread: str,
) -> None:
    """A process with one thread has one children list, read alone; one with more has a
    list per thread, and a child forked by a second thread is only in that thread's. A
    first thread that exited while the second lives on still counts (the kernel keeps
    it till the process ends), so the second's list is read then too."""
    from sandboxq.pool import kill

    with script_tree(first_thread) as child:
        wait_for(lambda: kill.descendants(child.pid), 10, "the child the thread started")
        [grandchild] = [p.pid for p in kill.descendants(child.pid)]
        assert len(os.listdir(f"/proc/{child.pid}/task")) == 2  # an exited first one stays
        assert kill.stop_tree(child.pid, include_root=True) == {child.pid, grandchild}
        kill.kill_tree(child.pid)
        assert child.wait(5) == -signal.SIGKILL
        wait_for(lambda: kill.ended(grandchild), 5, "the grandchild killed")


@pytest.mark.timeout(30)
def test_tree_walk_finds_every_child_of_a_process_with_a_thousand() -> None:
    """A children list gives at most a page a read (some 800 pids): a sweep that read it
    once would leave the rest of a wide fork burst running."""
    from sandboxq.pool import kill

    script = (
        "import os, signal\n"
        "for _ in range(1000):\n"
        "    if os.fork() == 0:\n"
        "        signal.pause()\n"
        "        os._exit(0)\n"
        "signal.pause()\n"
    )
    with script_tree(script) as child:
        wait_for(lambda: len(kill.children_of(child.pid)) >= 1000, 20, "a thousand children")
        stopped = kill.stop_tree(child.pid, include_root=True)
        assert len(stopped) == 1001
        kill.kill_tree(child.pid)
        assert child.wait(10) == -signal.SIGKILL
        wait_for(lambda: all(kill.ended(pid) for pid in stopped), 10, "every child killed")


@pytest.mark.timeout(20)
def test_tree_walk_finds_grandchildren_that_left_the_group_either_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel's per-thread children lists and psutil's full scan find the same tree
    (a child, its grandchild in the group and one that called setsid)."""
    from sandboxq.pool import kill

    script = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'],"
        " start_new_session=True)\n"
        "time.sleep(30)\n"
    )
    with script_tree(script) as child:
        wait_for(lambda: len(kill.descendants(child.pid)) >= 2, 10, "the child and grandchild")
        fast = sorted(p.pid for p in kill.descendants(child.pid))
        monkeypatch.setattr(kill, "_CHILDREN_LISTS", False)
        scanned = sorted(p.pid for p in kill.descendants(child.pid))
        assert len(fast) == 2 and fast == scanned
        kill.kill_tree(child.pid, kill.descendants(child.pid))
        assert child.wait(5) == -signal.SIGKILL
