"""A child's bad message is that child's fault: whatever the parent cannot decode from a
child's channel ends that attempt as ``error`` with the cause stated and replaces that
child; the supervisor, and every other attempt, carry on. ``progress()`` checks its
arguments in the child."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest

from sandboxq import Pool
from sandboxq.models import Outcome
from sandboxq.pool.attempt import AttemptResult
from sandboxq.pool.child import MAX_PROGRESS_MESSAGE

H = "sandboxq.testing.handlers:"


def attempt(pool: Pool, *args: object, hard_timeout_s: float = 10.0) -> AttemptResult:
    done: Future[AttemptResult] = Future()
    task = pool.make_task(*args)
    task.hard_timeout_s = hard_timeout_s
    pool.execute(task, done.set_result)
    return done.result(timeout=30)


def check_replaced_and_alive(pool: Pool, before: list[int]) -> None:
    """The child that misbehaved is gone, the pool still runs attempts."""
    assert pool._supervisor.broken is None
    assert pool.pids != before
    assert not set(before) & set(pool.pids)


@pytest.mark.timeout(30)
def test_undecodable_progress_message_fails_that_attempt_only() -> None:
    with Pool(H + "progress_undecodable", size=1) as pool:
        before = pool.pids
        result = attempt(pool)
        assert result.outcome is Outcome.ERROR
        assert "could not be decoded" in result.cause, result.cause
        check_replaced_and_alive(pool, before)
        assert attempt(pool).outcome is Outcome.ERROR  # and again: the pool lives on


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "kind", ["bytes", "huge", "crafted", "peak", "error-surrogate", "progress-surrogate"]
)
def test_garbage_on_the_channel_fails_that_attempt_only(kind: str, tmp_path: Path) -> None:
    marker = tmp_path / "crafted"
    with Pool(H + "channel_garbage", size=1) as pool:
        before = pool.pids
        result = attempt(pool, kind, str(marker))
        assert result.outcome is Outcome.ERROR, result.cause
        assert "could not be decoded" in result.cause, result.cause
        check_replaced_and_alive(pool, before)
    assert not marker.exists(), "the parent ran code a child's pickle named"


@pytest.mark.timeout(30)
def test_progress_checks_its_arguments_in_the_child() -> None:
    seen: list[tuple[float, str | None]] = []
    with Pool(H + "progress_bad_arguments", size=1) as pool:
        done: Future[AttemptResult] = Future()
        task = pool.make_task()
        task.on_progress = lambda f, m: seen.append((f, m))
        pool.execute(task, done.set_result)
        result = done.result(timeout=30)
    assert result.outcome is Outcome.OK, result.cause
    import pickle

    assert pickle.loads(result.result or b"") == [
        "ValueError",
        "TypeError",
        "ValueError",
        "TypeError",
        "TypeError",
    ]
    assert [(f, len(m or "")) for f, m in seen] == [(0.5, MAX_PROGRESS_MESSAGE)]
