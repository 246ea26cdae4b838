"""`make demo`: a queue on the embedded in-memory backend (no Redis), a sandboxed worker, and
jobs that hang in C code, crash, exit and raise while the good ones complete.

The dashboard watches the same in-process queue on 127.0.0.1 while it runs; with
``--serve`` it stays open after the jobs are done, until Ctrl-C."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(__file__))

from sandboxq import JobFailed, Queue, SandboxWorker


def start_dashboard() -> tuple[str, Callable[[], None]] | None:
    """The dashboard for this process's memory:// queues on a free loopback port, on a
    thread; its address and how to stop it (None without the web extra)."""
    try:
        import uvicorn

        from sandboxq.web import create_app
    except ImportError:
        return None
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app("memory://", queues=["demo"])
    app.state.dashboard.hub.start()  # count the attempts that end from now on
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def stop() -> None:
        server.should_exit = True
        thread.join(5)
        sock.close()

    return f"http://127.0.0.1:{sock.getsockname()[1]}/", stop


def main() -> None:
    queue = Queue("demo", url="memory://")
    dashboard = start_dashboard()
    if dashboard is not None:
        print(f"dashboard of this queue (memory://, this process only): {dashboard[0]}")
    print("against Redis: sandboxq dashboard --url redis://localhost:6379/0\n")
    good = [queue.enqueue(f"photo-{i}.png", size=256) for i in range(6)]
    bad = {
        kind: queue.options(retries=1, backoff_s=0.1).enqueue(kind)
        for kind in ("hang", "crash", "exit", "raise")
    }
    worker = SandboxWorker(
        "demo",
        "demo_jobs:route",
        url="memory://",
        concurrency=2,
        soft_timeout_s=0.5,
        hard_timeout_s=1.0,
        lease_s=5,
    )
    print("worker running 2 sandboxed children; hard timeout 1 s, one retry for failures\n")
    started = time.monotonic()
    thread = threading.Thread(target=worker.run, kwargs={"burst": True})
    thread.start()
    for job in good:
        print(f"  completed  {job.result(timeout_s=60)}")
    print()
    for kind, job in bad.items():
        try:
            job.result(timeout_s=60)
        except JobFailed as err:
            attempts = ", ".join(f"{a.outcome}" for a in job.info().history)
            tries = f"{err.attempts} attempt" + ("s" if err.attempts != 1 else "")
            print(f"  {kind:6} failed after {tries} ({attempts}): {err.error}")
    thread.join()
    print(f"\n{worker.stats}")
    print(f"all done in {time.monotonic() - started:.1f} s; the worker and every child stopped")
    if dashboard is not None:
        if "--serve" in sys.argv:
            print(f"dashboard still at {dashboard[0]}: Ctrl-C to stop")
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                pass
        dashboard[1]()


if __name__ == "__main__":
    main()
