"""What one retained finished job costs in Redis memory (README "Retention").

    python bench/retention_bench.py [--jobs N] [--runs N] [--json OUT] [--url URL]

N jobs (1,000 by default) run through a real ``sandboxq worker`` process on a real
redis-server: no-op jobs that complete; jobs whose handler exits 3 (no exit code mapped:
failed at its first attempt); and jobs that fail with about 4 KiB of traceback after
writing 8 KiB of output (``bench_jobs.loud_failure``). Then ``MEMORY USAGE`` (every
sample) of each job's own keys, its hash (payload, options, state, result or error; a
completed job's sole attempt record too) and its history list (the attempt records kept
apart), and each job's share of the sorted sets that index it: its finished set and
retention's ``expiry`` set (only jobs not kept for the queue's time to live have an entry).
Their sum is what a retained job costs; the count caps (``retain_completed``,
``retain_failed``) times it bound a queue's memory. The events stream is capped on its own
(``max_events``), so it is shown apart, per job, and not added. Without --url it starts
its own redis-server.

The hash holds the worker's id, which starts with the host name (``SandboxWorker.id``):
the name of this machine may be shorter than a real one, so one completed job's hash is
also measured copied with a host name of ``LONG_HOST`` characters (a cloud instance's
DNS name is about 40).

Target: a retained completed no-op job <= 500 bytes (issue: Redis memory per job).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402

from sandboxq import Queue  # noqa: E402
from sandboxq.backends.redis.keys import QueueKeys  # noqa: E402
from sandboxq.models import RETAIN_COMPLETED, RETAIN_FAILED, JobState  # noqa: E402
from sandboxq.testing.redis_server import RedisServer  # noqa: E402

TOTAL = figures.Target("<=", 500, "B")
LONG_HOST = 40

#: kind -> (processor, the state its jobs end in, the worker's further options)
KINDS: dict[str, tuple[str, JobState, tuple[str, ...]]] = {
    "completed": ("bench_jobs:noop", JobState.COMPLETED, ()),
    # its attempt record also carries the limit and the peak
    "completed_under_a_memory_limit": (
        "bench_jobs:noop",
        JobState.COMPLETED,
        ("--max-memory-mb", "256"),
    ),
    "failed": ("sandboxq.testing.handlers:sys_exit", JobState.FAILED, ()),
    # a failed attempt that keeps about 4 KiB of traceback and 8 KiB of output
    "failed_with_traceback": ("bench_jobs:loud_failure", JobState.FAILED, ()),
}


def run_burst(url: str, queue: str, processor: str, options: tuple[str, ...]) -> None:
    """A real worker process that stops once the queue is empty."""
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "sandboxq", "worker", queue, processor, "--url", url]
    done = subprocess.run(
        # memory is what is measured here, not containment: the process tree mode runs
        # on any machine
        [*command, "--concurrency", "2", "--containment", "process_tree", "--burst", *options],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        check=False,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(f"the worker failed ({done.returncode}): {done.stderr.decode()[-2000:]}")


def long_host_hash(r: redis.Redis, keys: QueueKeys, job_id: str) -> int:
    """Bytes of job ``job_id``'s hash copied, under a key name of the same length, with a
    host name of LONG_HOST characters in its worker id."""
    fields = r.hgetall(keys.job_prefix + job_id)
    worker = fields.get(b"worker_id", b"")
    assert worker, "the completed job keeps no sole attempt in its hash"
    copy = keys.job_prefix + "~" + job_id[1:]
    r.hset(
        copy, mapping={**fields, b"worker_id": b"h" * LONG_HOST + b":" + worker.split(b":", 1)[1]}
    )
    try:
        return int(r.memory_usage(copy, samples=0) or 0)
    finally:
        r.delete(copy)


def bytes_per_job(url: str, kind: str, n: int) -> dict[str, float]:
    """Bytes of one retained job of ``kind``, by part (see the module docstring)."""
    processor, state, options = KINDS[kind]
    name = f"r-{uuid.uuid4().hex[:8]}"
    keys = QueueKeys(name)
    r = redis.Redis.from_url(url)
    q = Queue(name, url=url)
    try:
        ids = [job.id for job in q.enqueue_many([((3,), {}) for _ in range(n)])]
        run_burst(url, name, processor, options)
        assert q.counts()[state] == n, q.counts()

        def usage(key: str) -> int:
            return int(r.memory_usage(key, samples=0) or 0)

        finished = keys.completed if state is JobState.COMPLETED else keys.failed
        parts = {
            "hash": sum(usage(keys.job_prefix + i) for i in ids) / n,
            "history": sum(usage(keys.history_prefix + i) for i in ids) / n,
            "finished_set": usage(finished) / n,
            "expiry_set": usage(keys.expiry) / n,
        }
        parts["total"] = sum(parts.values())
        parts["events_stream"] = usage(keys.events) / n
        if state is JobState.COMPLETED:
            parts["total_with_a_long_host_name"] = (
                parts["total"] - usage(keys.job_prefix + ids[0]) + long_host_hash(r, keys, ids[0])
            )
        return parts
    finally:
        q.backend.purge(state)
        q.close()
        r.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--json", default=str(HERE / "results" / "retention.json"))
    parser.add_argument("--url", help="an existing redis-server (default: start one)")
    args = parser.parse_args()
    runs: dict[str, dict[str, list[float]]] = {kind: {} for kind in KINDS}
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(RedisServer()).url
        for _ in range(args.runs):
            for kind in KINDS:
                for part, value in bytes_per_job(url, kind, args.jobs).items():
                    runs[kind].setdefault(part, []).append(value)
    report: dict[str, Any] = {"jobs": args.jobs, "figures": []}
    caps = {
        kind: RETAIN_COMPLETED if state is JobState.COMPLETED else RETAIN_FAILED
        for kind, (_, state, _) in KINDS.items()
    }
    for kind, parts in runs.items():
        report[kind] = {}
        for part, values in parts.items():
            target = TOTAL if kind.startswith("completed") and part.startswith("total") else None
            fig = figures.figure(
                f"Redis bytes per retained {kind} job: {part}", values, "B", target
            )
            report[kind][part] = fig["value"]
            report["figures"].append(fig)
        at_cap = report[kind]["total"] * caps[kind] / 2**20
        fig = figures.figure(f"{kind} jobs at the count cap ({caps[kind]:,})", [at_cap], "MiB")
        report[kind]["at_cap_mib"] = fig["value"]
        report["figures"].append(fig)
    for fig in report["figures"]:
        print(figures.line(fig))
    figures.write_json(args.json, report)


if __name__ == "__main__":
    main()
