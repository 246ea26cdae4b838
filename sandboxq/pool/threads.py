"""The Python threads an attempt left running in its child, seen before the next one.

    child start ── record(): the Python threads it has once its imports are done
    reply ──────── started_left(): a thread counted and still running (``_thread._count``)
    after reply ── left_running(): the same, or one that exists and has not counted itself
                   yet (its thread state is made by ``start_new_thread``, in the thread
                   that starts it; the count grows only once the new thread runs)

A thread cannot be killed from outside it: one left running would print into the next
attempt's output, spend its CPU, count against its ``max_processes``, and read its
arguments from its frames. The child is replaced instead (child.py).

``_thread._count`` counts threads started with ``_thread`` too (threading's own count
missed those). A thread of C code (OpenBLAS's pool, made at first use) is not the
attempt's to keep or lose: it has no thread state unless it calls into Python, and one
that keeps a thread state (``PyGILState_Ensure``) is waited for once, then taken as part
of the child (``_states_seen``).
"""

from __future__ import annotations

import _thread
import ctypes
import time

#: How long an attempt's end waits for a thread it just started to count itself.
THREAD_START_WAIT_S = 0.05

# CPython's list of an interpreter's thread states (the API debuggers walk). Read with
# the GIL held (``pythonapi`` keeps it): 0.7 us, where the kernel's count of the
# process's threads (a stat of /proc/self/task) took 2.5 us and saw C threads too.
_api = ctypes.pythonapi
_api.PyInterpreterState_Get.restype = ctypes.c_void_p
_first_state = _api.PyInterpreterState_ThreadHead
_first_state.argtypes, _first_state.restype = [ctypes.c_void_p], ctypes.c_void_p
_next_state = _api.PyThreadState_Next
_next_state.argtypes, _next_state.restype = [ctypes.c_void_p], ctypes.c_void_p

_idle_threads = 0
_states_seen = 0


def _thread_states() -> int:
    """The interpreter's thread states: one per Python thread, including one started and
    not yet running."""
    count, state = 0, _first_state(_api.PyInterpreterState_Get())
    while state:
        count += 1
        state = _next_state(state)
    return count


def record() -> None:
    """In the child, once set up: the threads every attempt is compared with (its imports
    may have started some)."""
    global _idle_threads, _states_seen
    _idle_threads = _thread._count()
    _states_seen = _thread_states()


def started_left() -> bool:
    """At the reply: a Python thread the attempt started is running (a look of 0.04 us)."""
    return _thread._count() > _idle_threads


def left_running() -> bool:
    """After the reply: the attempt left a Python thread, counted or about to count
    itself (it is given the GIL, ``THREAD_START_WAIT_S`` at most, to do so)."""
    global _states_seen
    if _thread._count() > _idle_threads:
        return True
    deadline = time.monotonic() + THREAD_START_WAIT_S
    while (now := _thread_states()) > _states_seen and time.monotonic() < deadline:
        time.sleep(0.001)
        if _thread._count() > _idle_threads:
            return True
    _states_seen = now  # a thread state that never counted itself: not a thread of ours
    return False
