"""Where an attempt was when it failed, hung or crashed, against real children: the
traceback of a raise, the stack of every thread captured (``faulthandler``) at the soft
signal and just before the hard kill, the stack a crashing child died in, and what the
attempt wrote to stdout and stderr."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from sandboxq import AttemptFailed, Pool
from sandboxq.models import Outcome
from sandboxq.pool.attempt import AttemptResult
from sandboxq.text import MAX_TRACEBACK_BYTES, bounded_traceback

W = "tests.support.where:"


def attempt(pool: Pool, *args: object, **kwargs: object) -> AttemptResult:
    done: Future[AttemptResult] = Future()
    pool.execute(pool.make_task(*args, **kwargs), done.set_result)
    return done.result(timeout=30)


# -- the traceback of a raise --------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_raise_two_frames_deep_keeps_both_frames_and_the_exception() -> None:
    with Pool(W + "outer_frame_raises", size=1) as pool:
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
    with Pool(W + "deep_recursion", size=1) as pool:
        result = attempt(pool)
    tb = result.traceback
    assert result.outcome is Outcome.ERROR and tb is not None
    assert len(tb.encode()) <= MAX_TRACEBACK_BYTES
    assert tb.startswith("Traceback (most recent call last):")
    assert " cut ...\n" in tb
    assert tb.rstrip().endswith("RecursionError: maximum recursion depth exceeded")
    assert "in deep_recursion" in tb.split(" cut ...\n")[1]


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
