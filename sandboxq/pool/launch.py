"""Starting a child process through multiprocess, without re-running the parent's ``__main__``
(and, ``start_retrying``, through a fork server that is being replaced).

multiprocess sends each new process "preparation data" that makes it re-import the
parent's main script as ``__mp_main__``. Our children only run a processor named by import
path, so that import is pure cost (and fails outright when ``__main__`` is stdin or a
REPL). ``start`` marks the current thread while it launches; the wrapper below drops the
main-module keys for launches so marked and leaves every other multiprocess user alone.
"""

from __future__ import annotations

import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from multiprocess import resource_tracker, spawn

from sandboxq.text import guarded_logger

_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")
_marked = threading.local()
_original_preparation_data = spawn.get_preparation_data


def _preparation_data(name: str) -> dict[str, Any]:
    data: dict[str, Any] = _original_preparation_data(name)
    if getattr(_marked, "active", False):
        for key in _MAIN_KEYS:
            data.pop(key, None)
    return data


spawn.get_preparation_data = _preparation_data


def start(process: Any) -> None:
    """``process.start()``, with the child skipping the parent's ``__main__``."""
    _marked.active = True
    try:
        process.start()
    finally:
        _marked.active = False


def start_retrying(
    process: Any, tries: int, given_up: Callable[[], str | None] = lambda: None
) -> None:
    """``start``, tried ``tries`` times: a fork server that just died refuses the first
    connections until multiprocess sees it gone and starts a fresh one. Raises
    ``OSError`` when every try failed, or at once when ``given_up()`` says why not."""
    for attempt in range(tries):
        try:
            # multiprocess *warns* when it relaunches a dead resource tracker; that is the
            # recovery working, logged here, never an error of the calling thread.
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                # The supervisor thread keeps SIGINT and SIGHUP blocked (supervisor.py),
                # so that a fork server this start makes inherits them: a Ctrl-C meant
                # for the run broke its import of the processor with a traceback, a
                # hangup killed it. multiprocess unblocks SIGINT in this thread when it
                # starts a resource tracker: the tracker first, then the block again.
                resource_tracker.ensure_running()
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGHUP})
                start(process)
            for warning in said:
                guarded_logger("sandboxq.pool").warning("starting a child: %s", warning.message)
            return
        except (OSError, EOFError) as exc:
            if (why := given_up()) is not None:  # the fork server was killed for it
                raise OSError(why) from exc
            # A fork server that dies while it forks this child closes the connection
            # before it sends the new pid: multiprocess raises EOFError, not OSError.
            if attempt == tries - 1:
                if isinstance(exc, EOFError):
                    raise OSError(f"the fork server closed the connection: {exc}") from exc
                raise
            time.sleep(0.02 * (attempt + 1))
