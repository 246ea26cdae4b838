"""The misbehaving handlers of ``sandboxq.testing.handlers`` as test cases: each names the
handler, the worker settings that provoke it, and the outcome its attempt must end with.
``CONTAINED`` lists the handlers that return normally but leave processes (or memory)
behind; the plugin turns it into ``sandboxq_contained_handler``.

    case = CASES_BY_ID["hold_gil-soft"]
    worker = SandboxWorker(queue, case.processor, url=url, **case.worker_options)
    job = Queue(queue, url).enqueue(*case.args)
    ... job.result() raises JobFailed ...
    case.check(job.info().history[-1])     # AssertionError naming what differed

Ids ending in ``-soft`` run with a soft and a hard timeout, ``-hard`` with a hard timeout
only. The pytest plugin turns ``CASES`` into the ``sandboxq_misbehaving_handler`` fixture
and ``HUNG`` into ``sandboxq_hung_handler``.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from sandboxq.models import AttemptRecord, Outcome

HANDLERS = "sandboxq.testing.handlers"
#: Handlers that attack the pool itself (``HOSTILE``).
HOSTILE_HANDLERS = "sandboxq.testing.hostile"

#: Short enough that a whole catalogue runs in seconds, long enough for a loaded machine
#: to start the handler before the soft signal.
SOFT_S = 0.4
HARD_S = 2.0
HARD_ONLY_S = 0.8


@dataclass(frozen=True)
class HandlerCase:
    """One way a handler misbehaves, and what sandboxq must make of it."""

    id: str
    handler: str  # a function of sandboxq.testing.handlers
    outcome: Outcome
    args: tuple[Any, ...] = ()
    soft_timeout_s: float | None = None
    hard_timeout_s: float | None = None
    max_memory_mb: float | None = None
    exitcode: int | None = None
    signal: int | None = None
    error_contains: str | None = None
    module: str = HANDLERS

    @property
    def processor(self) -> str:
        return f"{self.module}:{self.handler}"

    @property
    def worker_options(self) -> dict[str, Any]:
        """The ``SandboxWorker`` (or ``Pool``) keywords this case needs."""
        options = {
            "soft_timeout_s": self.soft_timeout_s,
            "hard_timeout_s": self.hard_timeout_s,
            "max_memory_mb": self.max_memory_mb,
        }
        return {name: value for name, value in options.items() if value is not None}

    @property
    def hangs(self) -> bool:
        """Only a timeout ends it."""
        return self.outcome in (Outcome.SOFT_TIMEOUT, Outcome.HARD_TIMEOUT)

    def check(self, attempt: AttemptRecord) -> None:
        """Raise ``AssertionError`` naming every way ``attempt`` differs from this case."""
        wrong = []
        if attempt.outcome != self.outcome:
            wrong.append(f"outcome {attempt.outcome!s}, expected {self.outcome!s}")
        if self.exitcode is not None and attempt.exitcode != self.exitcode:
            wrong.append(f"exit code {attempt.exitcode}, expected {self.exitcode}")
        if self.signal is not None and attempt.signal != self.signal:
            wrong.append(f"signal {attempt.signal}, expected {self.signal}")
        if self.error_contains is not None and self.error_contains not in (attempt.error or ""):
            wrong.append(f"error {attempt.error!r} does not mention {self.error_contains!r}")
        if wrong:
            raise AssertionError(f"{self.id}: " + "; ".join(wrong))


_SIGKILL = int(signal.SIGKILL)


def _limits(case: HandlerCase) -> tuple[float | None, float | None]:
    return case.soft_timeout_s, case.hard_timeout_s


def _timeouts(handler: str, with_soft: Outcome) -> list[HandlerCase]:
    """The two cases of a hanging handler: with a soft timeout, and with a hard one only
    (the hard kill is always SIGKILL)."""

    def case(suffix: str, outcome: Outcome, soft_s: float | None, hard_s: float) -> HandlerCase:
        killed = _SIGKILL if outcome is Outcome.HARD_TIMEOUT else None
        return HandlerCase(
            f"{handler}-{suffix}", handler, outcome, (), soft_s, hard_s, signal=killed
        )

    return [
        case("soft", with_soft, SOFT_S, HARD_S),
        case("hard", Outcome.HARD_TIMEOUT, None, HARD_ONLY_S),
    ]


HUNG: list[HandlerCase] = [
    *_timeouts("sleep_forever", Outcome.SOFT_TIMEOUT),
    *_timeouts("cpu_spin", Outcome.SOFT_TIMEOUT),
    # One C call holds the GIL: the soft signal's handler never runs.
    *_timeouts("hold_gil", Outcome.HARD_TIMEOUT),
    *_timeouts("catastrophic_regex", Outcome.SOFT_TIMEOUT),
    *_timeouts("swallow_soft_timeout", Outcome.HARD_TIMEOUT),
    *_timeouts("ignore_signals", Outcome.HARD_TIMEOUT),
    *_timeouts("grandchild_hang", Outcome.SOFT_TIMEOUT),
    *_timeouts("setsid_grandchild_hang", Outcome.SOFT_TIMEOUT),
    *_timeouts("block_in_syscall", Outcome.SOFT_TIMEOUT),
    # The attempt boundary: what they started dies with the attempt (args: no pid file,
    # then "hang").
    *(
        HandlerCase(c.id, c.handler, c.outcome, (None, "hang"), *_limits(c), signal=c.signal)
        for c in _timeouts("daemonize_grandchild", Outcome.SOFT_TIMEOUT)
    ),
]

CRASHING: list[HandlerCase] = [
    HandlerCase("os_exit", "os_exit", Outcome.EXIT, (3,), exitcode=3),
    HandlerCase("sys_exit", "sys_exit", Outcome.EXIT, (4,), exitcode=4),
    HandlerCase("segfault", "segfault", Outcome.CRASHED, signal=int(signal.SIGSEGV)),
    HandlerCase("abort", "abort", Outcome.CRASHED, signal=int(signal.SIGABRT)),
    # Small steps, so the 50 ms memory sampling sees it well before the machine suffers.
    HandlerCase(
        "grow_memory",
        "grow_memory",
        Outcome.MEMORY_LIMIT,
        (8, 0.02),
        hard_timeout_s=20.0,
        max_memory_mb=150,
        signal=_SIGKILL,
    ),
    HandlerCase(
        "raise_unpicklable",
        "raise_unpicklable",
        Outcome.ERROR,
        error_contains="this exception holds a lock",
    ),
    HandlerCase("return_unserializable", "return_unserializable", Outcome.ERROR),
    # 20 MB is over the default 16 MiB cap on results.
    HandlerCase("return_huge", "return_huge", Outcome.ERROR, (20,)),
    # What a child writes to its channel that the parent cannot decode: that attempt's
    # error, and the child is replaced.
    HandlerCase(
        "progress_undecodable",
        "progress_undecodable",
        Outcome.ERROR,
        hard_timeout_s=20.0,
        error_contains="could not be decoded",
    ),
    *(
        HandlerCase(
            f"channel_garbage-{kind}",
            "channel_garbage",
            Outcome.ERROR,
            (kind,),
            hard_timeout_s=20.0,
            error_contains="could not be decoded",
        )
        for kind in ("bytes", "huge", "crafted")
    ),
]

#: Handlers that return normally (ok) but leave processes or memory behind: nothing they
#: started may outlive their attempt (check with the ``sandboxq_no_orphans`` fixture), and
#: a leak is not charged to the next job.
CONTAINED: list[HandlerCase] = [
    HandlerCase("daemonize_grandchild-return", "daemonize_grandchild", Outcome.OK),
    HandlerCase("session_helper", "session_helper", Outcome.OK),
    HandlerCase("fork_burst", "fork_burst", Outcome.OK, (None, 200)),
    HandlerCase("fork_bomb", "fork_bomb", Outcome.OK, (None, 6)),
    HandlerCase("leak_memory", "leak_memory", Outcome.OK, (150,)),
]

#: Handlers that attack the pool itself, with the outcome their job ends with *through a
#: worker* (default ``max_infra_deaths``): each reaches only its own attempt, and the
#: worker goes on serving. The plugin turns it into ``sandboxq_hostile_handler``.
HOSTILE: list[HandlerCase] = [
    HandlerCase(
        "kill_parent",
        "kill_parent",
        Outcome.POISON,
        hard_timeout_s=20.0,
        error_contains="fork server",
        module=HOSTILE_HANDLERS,
    ),
    HandlerCase(
        "scribble_descriptors",
        "scribble_descriptors",
        Outcome.ERROR,
        hard_timeout_s=20.0,
        error_contains="could not be decoded",
        module=HOSTILE_HANDLERS,
    ),
    HandlerCase(
        "close_descriptors",
        "close_descriptors",
        Outcome.ERROR,
        hard_timeout_s=20.0,
        error_contains="closed or broke the child's channel",
        module=HOSTILE_HANDLERS,
    ),
]

#: Every case that fails its attempt: the hung ones first.
CASES: list[HandlerCase] = HUNG + CRASHING
CASES_BY_ID: dict[str, HandlerCase] = {case.id: case for case in CASES + CONTAINED + HOSTILE}
