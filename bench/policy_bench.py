"""Failure policies: how late the progress watchdog and a job's deadline_s act.

    python bench/policy_bench.py [watchdog|deadline|budget|all] [--json OUT] [--quick]

- watchdog: a pool runs ``progress_then_hang`` (two reports, then silence) under
  ``progress_timeout_s``; the parent's clock reads each report as it arrives and the
  outcome as it is settled. Lateness: from the last report + ``progress_timeout_s``
  (the moment the silence is over the limit) to the outcome ``progress_timeout``.
  Two handlers: one the soft signal ends (``sleep_forever``: SoftTimeout), and one deaf
  to it (``ignore_signals``-like), killed a grace later; for that one the figure is the
  kill's lateness past silence + grace.
- deadline: a worker (embedded backend) runs a job whose every attempt hangs until its
  hard timeout, with retries left and a short backoff, under ``deadline_s``. Lateness:
  from enqueue + ``deadline_s`` to the job's end as the producer sees it (target
  <= 100 ms past the deadline, plus the grace for a handler deaf to the soft signal).
- budget: a pool of 4 children under ``pool_memory_mb=400`` (in a control group where
  the machine allows: the mode is in the JSON) runs 4 attempts that grow together to
  150 MB each. Figures: processes the kernel's OOM killer ended (target 0: the pool ends
  the newest attempts first, outcome ``memory_pressure``), how many the pool ended, and
  from the last outcome to a new attempt's result (the pool serves again); then the same
  at four times the growth rate, which may outrun the checks (context, no target).

The JSON goes to bench/results/policy.json.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402

H = "sandboxq.testing.handlers:"
WATCHDOG_S = 0.3


def _watchdog_round(pool: Any, handler_args: str, grace_s: float) -> float:
    """One attempt's lateness (ms): its ``progress_timeout`` outcome past its last report
    + ``WATCHDOG_S`` + ``grace_s``, both read on the parent's monotonic clock."""
    from sandboxq.models import Outcome
    from sandboxq.pool.attempt import Task

    last_report = [0.0]
    ended: list[tuple[float, Outcome]] = []
    done = threading.Event()

    def report(_fraction: float, _message: str | None) -> None:
        last_report[0] = time.monotonic()  # on the supervisor's thread, as it reads it

    def settled(result: Any) -> None:
        ended.append((time.monotonic(), result.outcome))
        done.set()

    task = Task(
        handler_args.encode(),
        "json",
        progress_timeout_s=WATCHDOG_S,
        end_grace_s=grace_s,
        on_progress=report,
    )
    pool.execute(task, settled)
    done.wait(30)
    [(at, outcome)] = ended
    assert outcome is Outcome.PROGRESS_TIMEOUT, outcome
    return (at - (last_report[0] + WATCHDOG_S + grace_s)) * 1000


def _watchdog_runs(handler_args: str, rounds: int, grace_s: float) -> list[float]:
    from sandboxq import Pool

    # process_tree: the watchdog does not depend on the containment, and a pool without
    # control groups is measured apart from whatever else the machine's groups do
    with Pool(H + "call", size=1, containment="process_tree") as pool:
        return [_watchdog_round(pool, handler_args, grace_s) for _ in range(rounds)]


def bench_watchdog(quick: bool = False) -> dict[str, Any]:
    rounds = 5 if quick else 30
    # two reports 20 ms apart, then silence that the soft signal ends
    soft = _watchdog_runs('[["progress_then_hang", 2, 0.02], {}]', rounds, grace_s=0.5)
    # two reports, then a handler that ignores the soft signal: killed a grace later
    deaf = _watchdog_runs('[["progress_then_deaf", 2, 0.02], {}]', max(3, rounds // 3), 0.2)
    soft_ends = [v + 500 for v in soft]  # it ended at the soft signal, not at the grace
    print(f"  soft-signal end, ms late: {', '.join(f'{v:.1f}' for v in soft_ends)}")
    print(f"  kill after the grace, ms late: {', '.join(f'{v:.1f}' for v in deaf)}")
    target = figures.Target("<=", 50, "ms")
    return {
        "figures": [
            figures.figure("watchdog: silence over the limit → outcome", soft_ends, "ms",
                           target, digits=1),
            figures.figure("watchdog: silence over the limit → outcome, max",
                           [max(soft_ends)], "ms", digits=1),
            figures.figure("watchdog, deaf handler: silence + grace → outcome", deaf, "ms",
                           target, digits=1),
            figures.figure("watchdog, deaf handler: silence + grace → outcome, max",
                           [max(deaf)], "ms", digits=1),
        ]
    }  # fmt: skip


def _deadline_runs(handler: str, rounds: int, deadline_s: float, **worker: Any) -> list[float]:
    """Lateness (ms) of each job's end past enqueue + ``deadline_s``."""
    from sandboxq import JobFailed, Queue, SandboxWorker

    late_ms: list[float] = []
    name = f"policy-bench-{time.monotonic_ns()}"
    with Queue(name, "memory://") as q:
        w = SandboxWorker(
            name, H + "call", "memory://", concurrency=1, containment="process_tree", **worker
        )
        thread = threading.Thread(target=w.run, daemon=True)
        thread.start()
        try:
            assert q.enqueue("succeed_after", 0, 1).result(timeout_s=60) == 1  # serving
            for _ in range(rounds):
                t0 = time.monotonic()
                # a backoff short enough that an attempt is running when the budget ends
                job = q.options(deadline_s=deadline_s, retries=100, backoff_s=0.001).enqueue(
                    handler
                )
                try:
                    job.result(timeout_s=deadline_s + 30)
                except JobFailed:
                    pass
                late_ms.append((time.monotonic() - (t0 + deadline_s)) * 1000)
        finally:
            w.stop()
            thread.join(30)
    return late_ms


def bench_deadline(quick: bool = False) -> dict[str, Any]:
    rounds = 3 if quick else 12
    # attempts of 0.3 s each, killed at their hard timeout and retried until the budget
    soft = _deadline_runs("sleep_forever", rounds, 1.5, hard_timeout_s=0.3)
    # deaf to the soft signal: the attempt running at the deadline is killed a grace
    # (its hard - soft timeout, 0.2 s) after it
    deaf = _deadline_runs(
        "swallow_soft_timeout", rounds, 1.5, soft_timeout_s=0.4, hard_timeout_s=0.6
    )
    deaf_past_grace = [v - 200 for v in deaf]
    print(f"  job end past deadline_s, ms: {', '.join(f'{v:.1f}' for v in soft)}")
    print(f"  deaf: past deadline_s + grace, ms: {', '.join(f'{v:.1f}' for v in deaf_past_grace)}")
    target = figures.Target("<=", 100, "ms")
    return {
        "figures": [
            figures.figure("deadline_s across retries: deadline → job failed", soft, "ms",
                           target, digits=1),
            figures.figure("deadline_s across retries: deadline → job failed, max",
                           [max(soft)], "ms", target, digits=1),
            figures.figure("deadline_s, deaf handler: deadline + grace → job failed",
                           deaf_past_grace, "ms", target, digits=1),
            figures.figure("deadline_s, deaf handler: deadline + grace → job failed, max",
                           [max(deaf_past_grace)], "ms", target, digits=1),
        ]
    }  # fmt: skip


def _budget_round(pool: Any, size: int, step_mb: int = 5) -> tuple[int, int, float]:
    """``size`` attempts growing together past the budget: (ended by the pool, killed by
    the kernel's OOM killer, ms from the last of them settled to a new attempt's result)."""
    from sandboxq.models import Outcome
    from sandboxq.pool.attempt import Task

    settled: list[Any] = []
    done = threading.Event()

    def on_done(result: Any) -> None:
        settled.append(result)
        if len(settled) == size:
            done.set()

    oom_before = pool._containment.pool_oom_kills()
    for _ in range(size):
        payload = f'[["grow_to", 150, {step_mb}, 0.02, 0.5], {{}}]'.encode()
        pool.execute(Task(payload, "json"), on_done)
    done.wait(60)
    assert len(settled) == size, settled
    pressed = sum(r.outcome is Outcome.MEMORY_PRESSURE for r in settled)
    oom = pool._containment.pool_oom_kills() - oom_before
    t0 = time.monotonic()
    again = threading.Event()
    pool.execute(Task(b'[["succeed_after", 0, 1], {}]', "json"), lambda _: again.set())
    again.wait(30)
    return pressed, oom, (time.monotonic() - t0) * 1000


def bench_budget(quick: bool = False) -> dict[str, Any]:
    """4 children growing 250 MB/s each to 150 MB, under pool_memory_mb=400."""
    from sandboxq import Pool

    rounds = 2 if quick else 8
    runs = []
    with Pool(H + "call", size=4, pool_memory_mb=400, containment="auto") as pool:
        mode = pool.containment
        _budget_round(pool, 1)  # warm: every child started
        runs = [_budget_round(pool, 4) for _ in range(rounds)]
        # 4x faster (1 GB/s per child: 40 MB between two 10 ms checks for 4, the whole
        # margin): where the checks are outrun, the kernel's limit on the pool group decides
        fast = [_budget_round(pool, 4, step_mb=20) for _ in range(rounds)]
    fast_oom = [float(r[1]) for r in fast]
    print(f"  at 1 GB/s per child: ended by the pool {[r[0] for r in fast]}; OOM {fast_oom}")
    pressed = [float(r[0]) for r in runs]
    oom = [float(r[1]) for r in runs]
    serve = [r[2] for r in runs]
    print(f"  ({mode}) ended by the pool: {pressed}; OOM-killed: {oom}")
    print(f"  serving again, ms: {', '.join(f'{v:.1f}' for v in serve)}")
    return {
        "containment": mode,
        "figures": [
            figures.figure(f"pool_memory_mb ({mode}): processes the OOM killer ended",
                           [max(oom)], "processes", figures.Target("==", 0), digits=0),
            figures.figure(f"pool_memory_mb ({mode}): attempts the pool ended per round",
                           pressed, "attempts", digits=0),
            figures.figure(f"pool_memory_mb ({mode}): last outcome → the pool serves again",
                           serve, "ms", digits=1),
            figures.figure(f"pool_memory_mb ({mode}), 1 GB/s per child: OOM-killed, max",
                           [max(fast_oom)], "processes", digits=0,
                           note="growth that outruns the checks: the kernel's limit decides"),
        ],
    }  # fmt: skip


if __name__ == "__main__":
    figures.run_sections(
        __file__,
        figures.quick_only(
            {"watchdog": bench_watchdog, "deadline": bench_deadline, "budget": bench_budget}
        ),
        HERE / "results" / "policy.json",
    )
