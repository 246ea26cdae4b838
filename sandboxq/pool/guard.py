"""The pool's guard: a process of its own that enforces each attempt's fence deadline when
the worker cannot, and ends every child when the worker is gone.

Why a process: the parent's fence is a thread of the worker, and it stops with the
worker (Ctrl-Z stops the worker's process group, ``kill -STOP``, a debugger), while each
child leads a session of its own and would go on running, with nobody renewing its lease:
a second worker recovers the job after its lease and runs it too. The guard leads its
own session, so nothing that stops the worker stops it.

    supervisor (worker) ── writes ──► table (a memfd, mapped by both): per child slot,
         │                            its pid, start time and the running attempt's fence
         │                            deadline (time.monotonic(), the same clock in both)
         │ pidfd in its select:       ▲ reads
         │ the guard died → restart   │
         └──────── liveness pipe ───► guard process (guard_process.py, own session):
                                        · a fence deadline passed → kill that child's tree
                                        · the worker died → also remove the pool's control
                                          groups (what is in them killed) at once
                                        · the worker is stopped → stop the children's
                                          trees; it runs again → continue them
                                        · the worker died (pidfd) or the pool closed (EOF
                                          on the pipe) → kill every tree in the table, exit

The supervisor keeps its own fence (deadlines.py): while a guard is being restarted it
still applies, and when both race for one kill the outcome is the same (``lease_lost``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import signal
import subprocess
from collections.abc import Mapping

import psutil

from sandboxq.pool.kill import state
from sandboxq.pool.waits import readable
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.pool")

#: The guard kills this much before a fence deadline, so that its wake-up jitter never
#: makes it late; the fence deadline itself already keeps a margin from the lease's end.
GUARD_EARLY_S = 0.005


def fence_came(fence: float | None, now: float) -> bool:
    """Whether the guard may have killed on ``fence`` by ``now`` (both ``time.monotonic()``):
    it strikes GUARD_EARLY_S early. The one test of it, wherever a fence is read."""
    return fence is not None and now + GUARD_EARLY_S >= fence


#: The guard's program, started with the directory that holds this package first on its
#: path: the worker may have found sandboxq through a path of its own (a test, a script).
_GUARD_MAIN = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from sandboxq.pool.guard_process import main; sys.exit(main(sys.argv[2:]))"
)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Slot(ctypes.Structure):
    """One child's entry in the table. ``pid`` 0 is a free slot; ``created`` (psutil's
    create time) tells the child from a process that reused its pid."""

    _fields_ = (
        ("pid", ctypes.c_int64),
        ("created", ctypes.c_double),
        ("deadline", ctypes.c_double),
    )


#: The table starts with a header (``Header``), then the slots.
HEADER = 3 * ctypes.sizeof(ctypes.c_int64)
#: What the pool writes on the liveness pipe before it closes it: EOF without it means the
#: worker died.
CLOSING = b"c"
#: The guard's beat is when it last looked at the table (it looks every
#: ``guard_process.WATCH_S``, or after a sweep, which waits up to a second for what it
#: killed). A beat older than LATE_S is looked into: a stopped guard is continued at once
#: (stopped while the pool was idle and the worker stopped after its next claim, it left
#: that job unfenced, and another worker ran it at the same time). One older than STALL_S
#: that is not stopped hangs, and is replaced.
LATE_S = 0.25
STALL_S = 5.0


#: A slot as the guard reads it in bulk (``struct``): the same bytes as ``Slot``.
SLOT_FORMAT = "=qdd"


def table_size(capacity: int) -> int:
    return HEADER + capacity * ctypes.sizeof(Slot)


class Header(ctypes.Structure):
    _fields_ = (("ready_pid", ctypes.c_int64), ("used", ctypes.c_int64), ("beat", ctypes.c_int64))


def header_of(buffer: mmap.mmap) -> Header:
    """``ready_pid``: the guard that is reading the table (0: none yet); ``used``: slots
    below this index may be in use (the lowest free slot is always taken first); ``beat``:
    when the guard last looked at the table (``time.monotonic_ns()``, one clock for every
    process of the machine)."""
    return Header.from_buffer(buffer)


def slots_in(buffer: mmap.mmap) -> ctypes.Array[Slot]:
    """The table's slots, over the mapped memfd (the parent's and the guard's view)."""
    count = (len(buffer) - HEADER) // ctypes.sizeof(Slot)
    return (Slot * count).from_buffer(buffer, HEADER)


def created(pid: int) -> float | None:
    """The process's start time, as the guard compares it (None: it is gone)."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


class Fence:
    """A child's slot in the table, as the supervisor writes it (no slot: not guarded)."""

    __slots__ = ("_slot", "index")

    def __init__(self, index: int | None, slot: Slot | None = None) -> None:
        self.index = index
        self._slot = slot

    @property
    def deadline(self) -> float | None:
        return (self._slot.deadline or None) if self._slot is not None else None

    @deadline.setter
    def deadline(self, deadline: float | None) -> None:
        """The fence deadline of what the child runs now (None: nothing)."""
        if self._slot is not None:
            self._slot.deadline = deadline or 0.0


class Guard:
    """The parent's side: the table, and the guard process (started, watched, restarted).

    Runs on the supervisor thread only. ``capacity`` bounds how many children can be
    guarded at once: the pool's size, plus the retiring ones still exiting.
    """

    def __init__(self, capacity: int, pool_dirs: Mapping[str, str] | None = None) -> None:
        #: The pool's control groups: the guard removes them when the worker dies.
        self._pool_dirs = json.dumps(dict(pool_dirs or {}))
        self._fd = os.memfd_create("sandboxq-guard")  # close-on-exec: no child inherits it
        os.ftruncate(self._fd, table_size(capacity))
        self._map = mmap.mmap(self._fd, table_size(capacity))
        self._slots = slots_in(self._map)
        self._header = header_of(self._map)
        self._free = list(range(capacity - 1, -1, -1))  # popped lowest first: slots pack low
        self._process: subprocess.Popen[bytes] | None = None
        self._pidfd: int | None = None
        self._alive_w: int | None = None
        #: Guards started after the first (the worker's metrics and logs).
        self.restarts = 0
        self._acted = -STALL_S  # when check last continued or replaced the guard

    # -- the table -------------------------------------------------------------------------

    def add(self, pid: int) -> Fence:
        """Guard child ``pid`` from now on (no slot when the table is full: then only the
        supervisor's fence applies to it)."""
        when = created(pid)
        if not self._free or when is None:
            if not self._free:
                log.warning("the fence guard's table is full: child %d is not guarded", pid)
            return Fence(None)
        index = self._free.pop()
        self._header.used = max(self._header.used, index + 1)
        slot = self._slots[index]
        # A slot is trusted by the guard only while its created time matches the pid's.
        slot.deadline = 0.0
        slot.created = when
        slot.pid = pid
        return Fence(index, slot)

    def remove(self, fence: Fence) -> None:
        """The child is gone: free its slot."""
        if fence.index is not None:
            slot = self._slots[fence.index]
            slot.pid = 0
            slot.deadline = 0.0
            self._free.append(fence.index)
            fence.index = fence._slot = None

    # -- the process -----------------------------------------------------------------------

    @property
    def pidfd(self) -> int | None:
        """Readable once the guard process has exited (for the supervisor's select)."""
        return self._pidfd

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def ready(self) -> bool:
        """Whether the guard process is up and reading the table."""
        return self._process is not None and self._header.ready_pid == self._process.pid

    def check(self, now: float) -> None:
        """A guard that is alive but no longer looks at the table (someone stopped it, or
        it hangs) is not noticed by its pidfd: its beat says so. Continue it; kill it if
        it is not stopped and stalls (its death then restarts it). Called with every
        command (each submit, each lease renewal): a fresh beat costs a read of shared
        memory, an old one a read of the guard's state."""
        if not self.ready() or self._process is None:
            return
        late_s = now - self._header.beat / 1e9
        if late_s < LATE_S:
            return
        if state(self._process.pid) in (b"T", b"t"):
            log.warning("the pool's fence guard (pid %d) was stopped; continuing it", self.pid)
            os.kill(self._process.pid, signal.SIGCONT)
        elif late_s >= STALL_S and now - self._acted >= STALL_S:  # one kill per stall
            self._acted = now
            log.error("the pool's fence guard (pid %d) hangs; replacing it", self.pid)
            self._process.kill()

    def start(self) -> int | None:
        """Start the guard process; returns its pidfd (None: it could not be started, and
        the supervisor's fence is all there is until the next try)."""
        from multiprocess import spawn  # the worker's own copy; the guard never loads it

        alive_r, alive_w = os.pipe()
        try:
            self._process = subprocess.Popen(
                [
                    spawn.get_executable(),
                    "-c",
                    _GUARD_MAIN,
                    _PACKAGE_ROOT,
                    str(os.getpid()),
                    str(self._fd),
                    str(alive_r),
                    self._pool_dirs,
                ],
                pass_fds=(self._fd, alive_r),
                start_new_session=True,  # Ctrl-Z and kill -STOP of the worker's group miss it
                stdin=subprocess.DEVNULL,
            )
            self._pidfd = os.pidfd_open(self._process.pid)
        except OSError as exc:
            log.error("the fence guard could not be started: %s", exc)
            os.close(alive_w)
            self._process = self._pidfd = None
            return None
        finally:
            os.close(alive_r)
        self._alive_w = alive_w
        return self._pidfd

    def lost(self) -> str:
        """The guard process died: reap it and say how (call before ``start`` again)."""
        process = self._process
        self._close_process()
        if process is None:
            return "is gone"
        code = process.wait()
        self.restarts += 1
        return f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"

    def _close_process(self) -> None:
        for fd in (self._pidfd, self._alive_w):
            if fd is not None:
                os.close(fd)
        self._pidfd = self._alive_w = None

    def close(self, wait_s: float = 2.0) -> None:
        """Stop the guard (it sees EOF on its pipe and ends what is still in the table:
        nothing, after a clean shutdown) and release the table."""
        process, pidfd = self._process, self._pidfd
        if process is not None and not self.ready():
            # Still starting (its imports take ~100 ms): it has ended nothing and read no
            # table, so it is killed rather than waited for. A pool that lived a moment
            # (most of a test suite's) waited that long at every shutdown.
            with contextlib.suppress(OSError):
                process.kill()
        elif self._alive_w is not None:
            with contextlib.suppress(OSError):  # a guard that died reads nothing
                os.write(self._alive_w, CLOSING)  # not the worker's death: keep the groups
            if process is not None and state(process.pid) in (b"T", b"t"):  # or never read
                os.kill(process.pid, signal.SIGCONT)
        if pidfd is not None:
            # Woken the moment it exits: Popen.wait(timeout) polls, its naps doubling up to
            # 50 ms, which cost a pool's shutdown 50-100 ms for a guard gone in a few.
            readable(pidfd, wait_s)
        self._close_process()
        if process is not None:
            try:
                process.wait(0 if pidfd is not None else wait_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._process = None
        # The mapping itself goes with the last ``Fence`` that still points into it.
        os.close(self._fd)
