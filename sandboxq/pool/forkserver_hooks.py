"""Imported by the fork server (as a preload module) to make it die with the worker.

Why: multiprocess's fork server hands the write end of its "alive" pipe to every child,
so it only exits once the worker *and* all children are gone. After a SIGKILL of the
worker a hung child keeps the fork server alive, and the child itself never notices:
its own ``PR_SET_PDEATHSIG`` watches the fork server, not the worker. Both would run
forever. (Our children point their copy at /dev/null, descriptors.py, so today the fork
server may instead exit first, on its own: the same sweep then runs at its exit.)

So, inside the fork server:

    worker ──(parent death: SIGTERM)──► fork server: kill every descendant, exit
                                              │ PR_SET_CHILD_SUBREAPER: orphaned
                                              │ grandchildren are re-parented here,
                                              ▼ so "every descendant" is all of them
                                        children (PR_SET_PDEATHSIG=SIGSTOP on the
                                        fork server: a child frozen with its tree,
                                        for the pool's guard to kill, guard.py)

``PR_SET_PDEATHSIG`` fires when the *thread* that started us exits, not only the process;
the handler therefore checks that the worker process is really gone (our parent pid
changed) and ignores the signal otherwise. The kernel re-arms it for the new parent thread.

Second job: on Python 3.11 the fork server ignores the ``sys_path`` it is given, so the
processor module, preloaded right after this one, would only be found if it happened to
sit in the current directory, and every replacement child would import it afresh (numpy:
~80 ms). This module is imported from inside ``main(..., sys_path=...)``, so it applies
that ``sys_path`` itself.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import warnings
from types import FrameType

from sandboxq.pool import linux
from sandboxq.pool.kill import sweep


def _kill_everything_and_exit() -> None:
    # One sweep stops the whole tree before it kills any of it, so a fork bomb below a
    # child cannot outrun it; the second covers a kernel without per-thread children lists.
    for _ in range(2):
        sweep(os.getpid(), include_root=False)
    os._exit(0)


def _on_parent_death(signum: int, frame: FrameType | None) -> None:
    if os.getppid() != _worker_pid:
        _kill_everything_and_exit()


def _adopt_parent_sys_path() -> None:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == (
            "multiprocess.forkserver"
        ):
            sys_path = frame.f_locals.get("sys_path")
            if sys_path is not None:
                sys.path[:] = sys_path
            return
        frame = frame.f_back  # type: ignore[assignment]


def _sweep_at_exit() -> None:
    # multiprocess's fork server also exits on its own once every holder of its "alive"
    # pipe is gone. Children no longer hold it (descriptors.py), so after a SIGKILL of the
    # worker that exit can come first, before the parent-death signal is handled, and
    # grandchildren re-parented here would outlive us: take them all on the way out.
    for _ in range(2):
        sweep(os.getpid(), include_root=False)


def _install() -> None:
    global _worker_pid
    _worker_pid = os.getppid()
    linux.become_subreaper()
    atexit.register(_sweep_at_exit)
    signal.signal(signal.SIGTERM, _on_parent_death)
    # Re-parented orphans are reaped by the fork server's SIGCHLD loop, which warns
    # about pids it did not fork; for a subreaper that is expected.
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
    if not linux.die_with_parent(signal.SIGTERM):
        _kill_everything_and_exit()


_worker_pid = -1
# Only the fork server runs `python -c "from multiprocess.forkserver import main; ..."`.
if sys.argv[:1] == ["-c"] and "multiprocess.forkserver" in sys.modules:
    _adopt_parent_sys_path()
    _install()
