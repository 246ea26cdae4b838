"""A worker whose handler started a daemon, killed with everything of its pool: the
worker's process group (the worker, its fork server) and its guard, at once, so that no
process of the pool is left to kill anything (``tests/test_pid_namespace.py``,
``tests/test_delegated_groups.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

from sandboxq.testing.processes import still_running

WORKER = textwrap.dedent(
    """
    import sys, time
    from sandboxq import Pool
    from sandboxq.testing.processes import in_namespace_of
    pool = Pool("sandboxq.testing.handlers:daemonize_grandchild", size=1,
                containment=sys.argv[2], pid_namespace=sys.argv[3] == "on")
    attempt = pool.submit(sys.argv[1], "hang")
    while not open(sys.argv[1]).read().strip():
        if attempt.done():  # it never hangs: say why rather than wait
            sys.exit(f"the handler ended: {attempt.exception()!r}")
        time.sleep(0.01)
    child = pool._supervisor._children[0]
    daemon = [int(p) for p in open(sys.argv[1]).read().split()]
    if sys.argv[3] == "on":  # the handler wrote its namespace's pid
        daemon = in_namespace_of(child.pid, daemon)
    print(pool._supervisor._guard.pid, child.process.pid, child.pid, *daemon, flush=True)
    time.sleep(600)
    """
)


@contextlib.contextmanager
def everything_killed(
    containment: str, directory: Path, namespace: str, prefix: tuple[str, ...] = ()
) -> Iterator[list[int]]:
    """A worker whose handler started a daemon, then the worker's process group (the
    worker, its fork server) and its guard killed at once. Yields [daemon, child, the
    process the pool started]; kills whatever of them is left at the end. ``directory``
    holds the file the handler writes its daemon's pid in; ``prefix`` goes before the
    worker's command (another user, another place)."""
    pid_file = directory / "pids"
    pid_file.write_text("")
    pid_file.chmod(0o666)  # the handler may run as another user
    worker = subprocess.Popen(
        [*prefix, sys.executable, "-c", WORKER, str(pid_file), containment, namespace],
        stdout=subprocess.PIPE,
        start_new_session=True,  # its own process group: the worker and its fork server
    )
    pids: list[int] = []
    try:
        assert worker.stdout is not None
        said = worker.stdout.readline().split()
        assert said, "the worker did not start (its error is above)"
        guard, outer, child, *daemon = (int(p) for p in said)
        pids = [*daemon, child, outer, guard]
        assert len(daemon) == 1 and still_running(daemon)
        os.kill(guard, signal.SIGKILL)
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        yield [*daemon, child, outer]
    finally:
        end_worker(worker, pids)


def end_worker(worker: subprocess.Popen[bytes], strays: list[int]) -> None:
    """A test's cleanup: the worker's process group killed and reaped, its pipe closed,
    and whichever of ``strays`` still runs killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    if worker.stdout is not None:
        worker.stdout.close()
    for pid in still_running(strays):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
