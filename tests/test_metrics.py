"""Worker metrics and the queue exporter, checked by the real thing: a Prometheus server
scrapes a worker and the exporter on loopback, and its query API must show the counts
this test caused. promtool lints both outputs.

One Prometheus for the module (it takes a couple of seconds to start); every test uses
its own queue names, so series of one test never satisfy another's query.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import generate_latest

from sandboxq import Queue
from sandboxq.backends.redis.keys import QueueKeys
from sandboxq.observe.exporter import EXPORTER_SERIES, QueueExporter
from sandboxq.observe.metrics import WORKER_SERIES, WorkerMetrics
from sandboxq.testing.waiting import wait_for
from sandboxq.testing.workers import BackgroundWorkers
from sandboxq.worker import SandboxWorker
from tests.support.prometheus_server import PrometheusServer

ECHO = "sandboxq.testing.handlers:echo"


@pytest.fixture(scope="module")
def prometheus() -> Iterator[PrometheusServer]:
    with PrometheusServer(scrape_interval_s=0.5) as server:
        yield server


def scrape(address: tuple[str, int]) -> str:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


def promtool_check_metrics(text: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (apt-get install prometheus)"
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, f"promtool check metrics:\n{done.stdout}\n{done.stderr}"


def value(prom: PrometheusServer, expr: str) -> float | None:
    found = prom.query(expr)
    return found[0][1] if len(found) == 1 else None


def wait_value(prom: PrometheusServer, expr: str, expected: float, timeout_s: float = 15) -> None:
    wait_for(lambda: value(prom, expr) == expected, timeout_s, f"{expr} == {expected}")


@pytest.mark.timeout(60)
def test_prometheus_scrapes_what_a_worker_and_the_exporter_saw(
    prometheus: PrometheusServer, workers: BackgroundWorkers, redis_url: str, queue_name: str
) -> None:
    idle_queue = queue_name + "-idle"
    with Queue(queue_name, redis_url) as q, Queue(idle_queue, redis_url) as idle:
        worker = workers.start(q, ECHO, concurrency=2, metrics_port=0)
        ok = [q.enqueue(i) for i in range(3)]
        failing = workers.start(
            queue_name + "-fail", "sandboxq.testing.handlers:sys_exit", url=redis_url,
            concurrency=1, metrics_port=0,
        )  # fmt: skip
        killed_q = Queue(queue_name + "-fail", redis_url)
        failed = killed_q.enqueue(3)
        assert [job.result(timeout_s=30) for job in ok] == [0, 1, 2]
        with pytest.raises(Exception, match="exit"):
            failed.result(timeout_s=30)
        q.options(delay_s=3600).enqueue("later")
        idle.enqueue("nobody runs me")
        killed_q.close()

        exporter = QueueExporter(redis_url)
        try:
            exporter.serve(0)
            assert worker.metrics_address is not None and failing.metrics_address is not None
            assert worker.metrics_address[0] == "127.0.0.1"  # loopback unless asked
            assert exporter.address is not None
            targets = [worker.metrics_address, failing.metrics_address, exporter.address]
            prometheus.set_targets([f"{h}:{p}" for h, p in targets])

            # promtool lints the exact texts Prometheus scrapes
            for address in targets:
                promtool_check_metrics(scrape(address))

            qf = queue_name + "-fail"
            assert worker._pool is not None
            mode = worker._pool.containment
            wait_value(
                prometheus, f'sandboxq_attempts_total{{queue="{queue_name}",outcome="ok"}}', 3
            )
            wait_value(prometheus, f'sandboxq_attempts_total{{queue="{qf}",outcome="exit"}}', 1)
            series = {
                f'sandboxq_jobs_finished_total{{queue="{queue_name}",state="completed"}}': 3,
                f'sandboxq_jobs_finished_total{{queue="{qf}",state="failed"}}': 1,
                f'sandboxq_attempt_duration_seconds_count{{queue="{queue_name}",outcome="ok"}}': 3,
                f'sandboxq_wait_seconds_count{{queue="{queue_name}"}}': 3,
                f'sum(sandboxq_children{{queue="{queue_name}"}})': 2,
                f'sandboxq_held_jobs{{queue="{queue_name}"}}': 0,
                f'sandboxq_rejected_acks_total{{queue="{queue_name}"}}': 0,
                f'sandboxq_stale_events_dropped_total{{queue="{queue_name}"}}': 0,
                f'sandboxq_stalled_recoveries_total{{queue="{queue_name}"}}': 0,
                # the child that exited was replaced
                f'sandboxq_pool_restarts_total{{queue="{qf}"}}': 1,
                # the mode the pool found on this machine (a control group where writable)
                f'sandboxq_containment_info{{queue="{queue_name}",mode="{mode}"}}': 1,
                # the exporter, from Redis
                f'sandboxq_queue_jobs{{queue="{queue_name}",state="completed"}}': 3,
                f'sandboxq_queue_jobs{{queue="{queue_name}",state="delayed"}}': 1,
                f'sandboxq_queue_jobs{{queue="{qf}",state="failed"}}': 1,
                f'sandboxq_queue_jobs{{queue="{idle_queue}",state="waiting"}}': 1,
                f'sandboxq_workers{{queue="{queue_name}"}}': 1,
                f'sandboxq_workers{{queue="{idle_queue}"}}': 0,
            }
            for expr, expected in series.items():
                wait_value(prometheus, expr, expected)
            positive = [
                f'sandboxq_children_rss_bytes{{queue="{queue_name}"}} > 1e6',
                f'sandboxq_lease_renewal_age_seconds{{queue="{queue_name}"}} < 10',
                f'sandboxq_queue_oldest_waiting_age_seconds{{queue="{idle_queue}"}} > 0',
                f'sandboxq_attempt_duration_seconds_sum{{queue="{queue_name}",outcome="ok"}} > 0',
            ]
            for expr in positive:
                wait_for(lambda e=expr: value(prometheus, e) is not None, 15, expr)  # type: ignore[misc]
        finally:
            prometheus.set_targets([])
            exporter.close()


@pytest.mark.timeout(60)
def test_a_hard_timeout_kill_reports_how_late_it_landed(
    prometheus: PrometheusServer, workers: BackgroundWorkers, redis_url: str, queue_name: str
) -> None:
    with Queue(queue_name, redis_url) as q:
        worker = workers.start(q, "sandboxq.testing.handlers:sleep_forever", metrics_port=0)
        job = q.options(hard_timeout_s=0.5).enqueue()
        with pytest.raises(Exception, match="hard_timeout"):
            job.result(timeout_s=30)
        assert worker.metrics_address is not None
        prometheus.set_targets(["{}:{}".format(*worker.metrics_address)])
        try:
            base = f'queue="{queue_name}",reason="hard_timeout"'
            wait_value(prometheus, f"sandboxq_kill_overshoot_seconds_count{{{base}}}", 1)
            # it landed, and within the largest bucket (the supervisor kills within ms)
            wait_value(prometheus, f'sandboxq_kill_overshoot_seconds_bucket{{{base},le="10.0"}}', 1)
            wait_value(
                prometheus,
                f'sandboxq_attempts_total{{queue="{queue_name}",outcome="hard_timeout"}}',
                1,
            )
        finally:
            prometheus.set_targets([])


def test_no_metrics_unless_asked(redis_url: str, queue_name: str) -> None:
    worker = SandboxWorker(queue_name, ECHO, url=redis_url, concurrency=1)
    try:
        assert worker._metrics is None and worker.metrics_address is None
    finally:
        worker.backend.close()


def test_two_workers_in_one_process_do_not_collide() -> None:
    first, second = WorkerMetrics("a"), WorkerMetrics("b")
    assert first.registry is not second.registry
    a1, a2 = first.serve(0), second.serve(0)
    try:
        assert a1 != a2
        assert 'queue="a"' in scrape(a1) and 'queue="b"' not in scrape(a1)
        assert 'queue="b"' in scrape(a2)
    finally:
        first.close()
        second.close()


@pytest.mark.timeout(30)
def test_idle_connections_to_a_workers_metrics_port_cost_the_worker_no_thread() -> None:
    """A client that opens connections to a worker's metrics port and sends nothing had
    a thread of the worker's process each, without bound (prometheus_client's server):
    threads that count against the worker's own process limit, where its children are
    started. The worker's port is served as the exporter's is (observe/exposition.py)."""
    metrics = WorkerMetrics("q")
    idle: list[socket.socket] = []
    try:
        address = metrics.serve(0)
        before = threading.active_count()
        idle = [socket.create_connection(address, timeout=5) for _ in range(200)]
        assert "sandboxq_attempts_total" in scrape(address)  # after all 200: they are accepted
        threads = threading.active_count() - before
        assert threads <= 2, f"{threads} threads for 200 idle connections"
    finally:
        for sock in idle:
            sock.close()
        metrics.close()


def test_every_declared_worker_series_is_served() -> None:
    metrics = WorkerMetrics("q")
    metrics.bind(
        child_states=lambda: {"busy": [], "idle": [], "starting": []},
        held=lambda: 0,
        renewed_at=lambda: 0.0,
        rejected_acks=lambda: 0,
        recovered=lambda: 0,
        trimmed=lambda: {"cap": 0, "age": 0},
        restarts=lambda: 0,
        rss=lambda pids: 0,
    )
    text = generate_latest(metrics.registry).decode()
    for name, kind, _, _ in WORKER_SERIES:
        assert f"# TYPE {name} {'gauge' if kind == 'info' else kind}" in text, name


def test_a_busy_metrics_port_is_a_clear_error(
    workers: BackgroundWorkers, redis_url: str, queue_name: str
) -> None:
    taken = WorkerMetrics("other")
    _, port = taken.serve(0)
    try:
        worker = SandboxWorker(queue_name, ECHO, url=redis_url, concurrency=1, metrics_port=port)
        with pytest.raises(Exception, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            worker.run()
    finally:
        taken.close()


# -- the command line ------------------------------------------------------------------------

CLI = [sys.executable, "-m", "sandboxq"]


def read_line(stream: Any, pattern: str, timeout_s: float = 20) -> re.Match[str]:
    """The first line of ``stream`` (a pipe) that matches ``pattern``."""
    found: list[re.Match[str]] = []

    def reader() -> None:
        for line in stream:
            if match := re.search(pattern, line):
                found.append(match)
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert found, f"no line matching {pattern!r} within {timeout_s} s"
    return found[0]


def stop(proc: subprocess.Popen[str]) -> int:
    """SIGTERM, and the exit status (SIGKILL after 20 s); its pipes closed."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.timeout(60)
def test_worker_command_serves_metrics_from_the_environment_on_a_logged_port(
    redis_url: str, queue_name: str, workers: BackgroundWorkers, tmp_path: Path
) -> None:
    env = {**os.environ, "SANDBOXQ_METRICS_PORT": "0", "SANDBOXQ_CONCURRENCY": "1"}
    log = tmp_path / "worker.log"
    proc = workers.spawn(queue_name, ECHO, url=redis_url, log=log, env=env)
    match = wait_for(
        lambda: re.search(r"metrics on http://(127\.0\.0\.1):(\d+)/metrics", log.read_text()),
        20,
        "the metrics address in the worker's log",
    )
    address = (match[1], int(match[2]))
    # the gauges that read the pool appear once it has started
    held = f'sandboxq_held_jobs{{queue="{queue_name}"}} 0.0'
    wait_for(lambda: held in scrape(address), 20, "the held-jobs gauge")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0


@pytest.mark.timeout(60)
def test_exporter_command_serves_the_named_queue(redis_url: str, queue_name: str) -> None:
    with Queue(queue_name, redis_url) as q:
        q.enqueue(1)
    proc = subprocess.Popen(
        [*CLI, "exporter", "--url", redis_url, "--port", "0", "--queue", queue_name],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        match = read_line(proc.stdout, r"http://(127\.0\.0\.1):(\d+)/metrics")
        text = scrape((match[1], int(match[2])))
        assert f'sandboxq_queue_jobs{{queue="{queue_name}",state="waiting"}} 1.0' in text
        assert 'queue="t-' not in text.replace(f'queue="{queue_name}"', "")  # only that one
    finally:
        assert stop(proc) == 0


def test_a_worker_without_metrics_never_loads_prometheus_client() -> None:
    code = (
        "import sys, sandboxq.worker, sandboxq.client, sandboxq.aio\n"
        "assert 'prometheus_client' not in sys.modules, 'prometheus_client was loaded'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr


# -- the dashboard, the alert rules and the README table ------------------------------------

ROOT = Path(__file__).resolve().parent.parent
SERIES_NAME = re.compile(r"\bsandboxq_[a-z_]+")


def exported_names() -> set[str]:
    """Every series name a worker or the exporter serves, as PromQL sees them."""
    names: set[str] = set()
    for name, kind, _, _ in (*WORKER_SERIES, *EXPORTER_SERIES):
        suffixes = ("_bucket", "_count", "_sum") if kind == "histogram" else ("",)
        names |= {name + suffix for suffix in suffixes}
    return names


def dashboard_exprs() -> list[str]:
    board = json.loads((ROOT / "examples/grafana/sandboxq.json").read_text())
    return [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]


def test_the_dashboard_names_only_series_that_are_exported() -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    used = {name for expr in exprs for name in SERIES_NAME.findall(expr)}
    assert used <= exported_names(), f"not exported: {used - exported_names()}"
    # and every series that matters to an operator is on it
    for wanted in ("sandboxq_attempts_total", "sandboxq_wait_seconds_bucket",
                   "sandboxq_queue_oldest_waiting_age_seconds",
                   "sandboxq_kill_overshoot_seconds_bucket",
                   "sandboxq_lease_renewal_age_seconds"):  # fmt: skip
        assert wanted in used, wanted


def test_every_dashboard_query_runs_on_prometheus(prometheus: PrometheusServer) -> None:
    for expr in dashboard_exprs():
        concrete = expr.replace("$__rate_interval", "1m").replace("$queue", ".*")
        prometheus.query(concrete)  # raises if Prometheus refuses it


def test_the_alert_rules_load_and_fire_as_their_unit_tests_say() -> None:
    promtool = shutil.which("promtool")
    assert promtool
    rules = ROOT / "examples/prometheus"
    for command in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run(
            [promtool, *command], cwd=rules, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"promtool {command}:\n{done.stdout}\n{done.stderr}"
    text = (rules / "alerts.yml").read_text()
    used = set(SERIES_NAME.findall(text))
    assert used <= exported_names(), f"not exported: {used - exported_names()}"


def test_the_readme_metric_table_is_the_code_s() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Monitoring", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(
        r"^\| `(sandboxq_\w+)` \| (\w+) \| ([\w, ]*) \| .+ \| (\w+) \|$", section, re.M
    )
    declared = [(n, k, labels, "worker") for n, k, labels, _ in WORKER_SERIES]
    declared += [(n, k, labels, "exporter") for n, k, labels, _ in EXPORTER_SERIES]
    assert sorted(rows) == sorted(declared)


# -- what the numbers rest on -----------------------------------------------------------------


def test_a_claim_says_how_long_the_job_waited_since_it_was_ready(url: str, queue_name: str) -> None:
    from sandboxq.backends import open_backend

    with Queue(queue_name, url) as q:
        backend = open_backend(url, queue_name)
        try:
            started = time.monotonic()
            q.enqueue("now")
            q.options(delay_s=0.3).enqueue("later")
            time.sleep(0.15)  # time for the first job to wait: the clock cannot be faked
            (first,) = backend.claim("w", 1, 10)
            waited = time.monotonic() - started
            assert first.wait_s is not None and 0.14 <= first.wait_s <= waited + 0.01
            due = wait_for(lambda: backend.claim("w", 1, 10), 10, "the delayed job")
            # counted from its due time, not from its enqueue
            elapsed = time.monotonic() - started
            assert due[0].wait_s is not None and 0 <= due[0].wait_s <= elapsed - 0.3 + 0.01
        finally:
            backend.close()


def test_a_scrape_costs_the_same_few_commands_however_many_jobs_wait(
    redis_url: str, raw: Any, queue_name: str
) -> None:
    exporter = QueueExporter(redis_url, [queue_name])
    try:

        def commands_per_scrape() -> int:
            before = int(raw.info("stats")["total_commands_processed"])
            generate_latest(exporter.registry)
            # the INFO that reads the second figure counts too
            return int(raw.info("stats")["total_commands_processed"]) - before - 1

        with Queue(queue_name, redis_url) as q:
            q.enqueue_many([((i,), {}) for i in range(10)])
            commands_per_scrape()  # the first one also opens the connection
            few = commands_per_scrape()
            q.enqueue_many([((i,), {}) for i in range(2000)])
            many = commands_per_scrape()
        # the commands stats.lua runs inside its one call count too (13 for one queue)
        assert few == many <= 14
    finally:
        exporter.close()


def test_discovery_finds_queues_and_is_not_fooled_by_job_ids(
    redis_url: str, queue_name: str
) -> None:
    from sandboxq.backends.redis.connection import Connections
    from sandboxq.backends.redis.stats import read_index

    with Queue(queue_name, redis_url) as q:
        # a job id that ends the way a queue's sequence key does
        q.options(job_id="evil}:seq").enqueue()
        q.options(job_id="x}:workers").enqueue()
    conns = Connections(redis_url, 5.0, "sq:{probe}:x")
    try:
        found = read_index(conns).names
    finally:
        conns.close()
    assert queue_name in found
    assert not [name for name in found if "}" in name or ":job:" in name]


@pytest.mark.timeout(60)
def test_the_pool_reports_how_late_each_deadline_kill_landed() -> None:
    """Hard timeout and lease fence: the two kills that have a deadline. A kill without
    one (a cancellation) and an attempt that ended by itself report no lateness."""
    import queue as queues

    from sandboxq.models import Outcome
    from sandboxq.pool.attempt import AttemptResult
    from sandboxq.pool.pool import Pool

    ended: queues.SimpleQueue[AttemptResult] = queues.SimpleQueue()
    with Pool("sandboxq.testing.handlers:sleep_forever", 2) as pool:
        # both children ready: a fence that passed before its task started is no kill
        wait_for(lambda: len(pool.child_states()["idle"]) == 2, 30, "two ready children")
        hard = pool.make_task()
        hard.hard_timeout_s = 0.3
        fenced = pool.make_task()
        fenced.fence_deadline = time.monotonic() + 0.5
        pool.execute(hard, ended.put)
        pool.execute(fenced, ended.put)
        results = {r.outcome: r for r in (ended.get(timeout=30), ended.get(timeout=30))}
        cancelled = pool.execute(pool.make_task(), ended.put)
        pool.kill(cancelled, Outcome.CANCELLED, "cancelled by a test")
        results[Outcome.CANCELLED] = ended.get(timeout=30)
    for outcome in (Outcome.HARD_TIMEOUT, Outcome.LEASE_LOST):
        late = results[outcome].kill_overshoot_s
        # the supervisor kills within milliseconds; seconds would mean a missed deadline
        assert late is not None and 0 <= late < 2.0, (outcome, late)
    assert results[Outcome.CANCELLED].kill_overshoot_s is None


@pytest.mark.timeout(30)
def test_a_queue_whose_keys_were_damaged_by_hand_costs_only_its_own_gauges(
    redis_url: str, queue_name: str
) -> None:
    # A shared Redis is hostile input: one queue's waiting set turned into a string must
    # not turn every scrape into an HTTP 500 for the queues that are fine.
    broken = queue_name + "-broken"
    with Queue(queue_name, redis_url) as good, Queue(broken, redis_url) as bad:
        good.enqueue(1)
        bad.enqueue(1)
        waiting = QueueKeys(broken).waiting
        raw = redis.Redis.from_url(redis_url)
        try:
            raw.delete(waiting)
            raw.set(waiting, "not a sorted set")
            exporter = QueueExporter(redis_url, [queue_name, broken])
            try:
                exporter.serve(0)
                assert exporter.address is not None
                text = scrape(exporter.address)
            finally:
                exporter.close()
        finally:
            raw.delete(waiting)
            raw.close()
    assert f'sandboxq_queue_jobs{{queue="{queue_name}",state="waiting"}} 1.0' in text
    assert f'queue="{broken}"' not in text
