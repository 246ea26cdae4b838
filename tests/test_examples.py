"""Every example runs as a newcomer would run it, prints what it promises, and leaves no
process behind, so none of them can rot.

Each runs in a subprocess whose environment carries a marker; processes inherit it
wherever they are re-parented, so a scan for the marker finds anything the example left.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from sandboxq.client import Queue
from sandboxq.models import JobState
from sandboxq.testing.workers import BackgroundWorkers

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MARKER = "SANDBOXQ_EXAMPLE_RUN"


def marked_env(**extra: str) -> tuple[dict[str, str], str]:
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "SANDBOXQ_URL"}
    return {**env, MARKER: mark, **extra}, mark


def left_behind(mark: str, grace_s: float = 5.0) -> list[str]:
    """Processes still alive that carry ``mark`` in their environment."""
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.status() != "zombie" and proc.environ().get(MARKER) == mark:
                    found.append(f"{proc.pid}: {' '.join(proc.cmdline())}")
            except psutil.Error:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def run_example(*args: str, timeout_s: float = 120, **env: str) -> str:
    environ, mark = marked_env(**env)
    done = subprocess.run(
        [sys.executable, *args],
        env=environ,
        cwd=EXAMPLES.parent,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert not left_behind(mark), f"{args} left processes behind: {left_behind(mark)}"
    return done.stdout


@pytest.mark.timeout(120)
def test_quickstart() -> None:
    out = run_example(str(EXAMPLES / "quickstart.py"))
    assert "primes below 10,000,000: 664,579" in out
    assert "worker stopped: 4 jobs completed" in out


@pytest.mark.timeout(120)
def test_thumbnails(tmp_path: Path) -> None:
    out = run_example(str(EXAMPLES / "thumbnails.py"), str(tmp_path))
    assert "generated 13 images" in out
    assert "12 thumbnails, 1 failed" in out and "half-written files left: none" in out
    assert "stuck.png        !! hard_timeout: killed at the hard deadline of 3 s" in out
    thumbs = sorted(p.name for p in (tmp_path / "thumbs").iterdir())
    assert thumbs == [f"fractal-{i:02}.jpg" for i in range(12)]


@pytest.mark.timeout(120)
def test_ml_batch() -> None:
    out = run_example(str(EXAMPLES / "ml_batch.py"))
    assert out.count(": 10,000 rows, mean confidence") == 16
    assert "160,000 rows in" in out
    assert "batch 0 scored again in this process: same result" in out


@pytest.mark.timeout(120)
def test_demo_still_runs() -> None:
    out = run_example(str(EXAMPLES / "demo.py"))
    assert "the worker and every child stopped" in out
    # what a newcomer reads first: each failure named, in words that read right
    assert "exit   failed after 1 attempt (exit): exit: the handler exited with code 10" in out
    assert "hang   failed after 2 attempts (hard_timeout, hard_timeout)" in out


@pytest.mark.timeout(180)
def test_my_processor_example_passes_with_the_plugin(redis_url: str) -> None:
    out = run_example(
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:hypothesispytest",
        str(EXAMPLES / "test_my_processor.py"),
        f"--sandboxq-redis-url={redis_url}",
        timeout_s=170,
    )
    assert "5 passed" in out


def _lines(stream: object) -> queue.SimpleQueue[str]:
    """Lines of ``stream``, read on a thread so a silent service cannot block the test."""
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()

    def pump() -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for(lines: queue.SimpleQueue[str], text: str, log: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in log):
        log.append(lines.get(timeout=max(0.01, deadline - time.monotonic())))


def _wait_for_progress(reports: Queue, job_id: str, timeout_s: float = 30) -> None:
    """Until the job has reported progress, so it is surely running in a child."""
    deadline, since = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        for event in reports.events(since, block_s=0.5):
            since = event.id
            if event.kind == "progress" and event.job_id == job_id:
                return
    raise AssertionError(f"job {job_id} reported no progress within {timeout_s} s")


@pytest.mark.timeout(120)
def test_service_drains_on_sigterm(redis_url: str, queue_name: str) -> None:
    environ, mark = marked_env(SANDBOXQ_URL=redis_url)
    service = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "service.py"), queue_name],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    try:
        lines = _lines(service.stdout)
        _wait_for(lines, "ready: worker", log, 60)
        with Queue(queue_name, redis_url) as reports:
            quick = [reports.enqueue(f"customer-{i}", pages=2) for i in range(4)]
            assert [job.result(timeout_s=30)["pages"] for job in quick] == [2] * 4
            long = reports.enqueue("big-customer", pages=60)
            _wait_for_progress(reports, long.id)
            sigterm_ms = int(time.time() * 1000)
            service.send_signal(signal.SIGTERM)
            assert service.wait(60) == 0
            _wait_for(lines, "stopped cleanly", log, 10)
            # It was running when SIGTERM came and was allowed to finish: one attempt.
            info = long.info()
            assert info.state is JobState.COMPLETED and long.result(timeout_s=1)["pages"] == 60
            (attempt,) = info.history
            assert attempt.ended_ms is not None and attempt.ended_ms > sigterm_ms
    finally:
        if service.poll() is None:
            service.kill()
            service.wait(10)
        if service.stdout is not None:
            service.stdout.close()
    output = "".join(log)
    assert "received SIGTERM: draining" in output, output
    assert not left_behind(mark), f"the service left processes behind: {left_behind(mark)}"


def _stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM; a second one (stop now) if it is still draining after 10 s; then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            continue
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.mark.timeout(120)
def test_fastapi_app_enqueues_and_awaits_results(
    redis_url: str, queue_name: str, workers: BackgroundWorkers
) -> None:
    import httpx

    from sandboxq.testing.redis_server import free_port

    environ, mark = marked_env(SANDBOXQ_URL=redis_url, REPORTS_QUEUE=queue_name)
    port = free_port()
    app = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "fastapi_app.py"), "--port", str(port)],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # no --url: SANDBOXQ_URL in its environment names the Redis, as for the app
    worker = workers.spawn(
        queue_name, "jobs_service:render_report", "--concurrency", "1", "--stop-timeout-s", "1",
        env=environ, cwd=EXAMPLES,
    )  # fmt: skip
    log: list[str] = []
    try:
        _wait_for(_lines(app.stdout), "Uvicorn running on", log, 60)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            created = http.post("/reports", json={"customer": "acme", "pages": 2})
            assert created.status_code == 202, created.text
            job_id = created.json()["job_id"]
            done = http.get(f"/reports/{job_id}", params={"wait_s": 30})
            assert done.status_code == 200, done.text
            assert done.json()["state"] == "completed"
            assert done.json()["result"]["customer"] == "acme"
            assert done.json()["result"]["pages"] == 2
            # a long report: waiting for it times out with 504 while it runs...
            long = http.post("/reports", json={"customer": "big", "pages": 400}).json()["job_id"]
            assert http.get(f"/reports/{long}", params={"wait_s": 0.2}).status_code == 504
            # ...and the app keeps answering other requests while one waits
            waiting = threading.Thread(
                target=lambda: http.get(f"/reports/{long}", params={"wait_s": 3}), daemon=True
            )
            waiting.start()
            started = time.monotonic()
            assert http.post("/reports", json={"customer": "x", "pages": 1}).status_code == 202
            assert time.monotonic() - started < 2.0
            waiting.join(10)
            assert http.post("/reports", json={"customer": "x", "pages": 0}).status_code == 422
            assert http.get("/reports/no-such-job").status_code == 404
    finally:
        _stop(worker)
        _stop(app)
    assert not left_behind(mark), f"left processes behind: {left_behind(mark)}"
