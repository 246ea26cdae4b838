"""Where a hung or crashed child was: its Python stack, every thread, dumped by
``faulthandler`` into a file the parent reads after the fact.

    parent: StackFile() ── a memfd per child, kept by the parent for the child's life
              │ for_child(): crosses with the launch (multiprocess's DupFd)
              ▼
    child:  arm(fd) ── faulthandler.register(DUMP_SIGNAL) and faulthandler.enable(): both
                       write to fd, O_APPEND
            clear() as each attempt starts: the file holds that attempt's dumps alone
    parent: ask(pid) at the soft signal, and DUMP_EARLY_S before the hard kill
              └► the child's C signal handler writes the stack of every thread (no GIL
                 needed: it works while the handler sits in a C call that holds it)
            a crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) writes the same, then dies
    parent: take() once the attempt ended (or the child died): read, then empty the file

Why a file and not the channel: the child may be dead (killed, crashed) by the time the
parent wants it, and a hung child cannot send anything. Why the parent holds it: it
survives the child, and a handler that closes every descriptor cannot take the parent's.

The hard kill is never late for a dump: the parent asks ``DUMP_EARLY_S`` before the hard
deadline and kills at the deadline, whatever the dump did (a handler that blocks the
signal, replaced its handler, or closed the file gets no stack, and is killed on time).
A requested dump that came back empty means the child's dumping was broken by its
handler: the parent replaces that child once its attempt ends. A handler that reset the
signal to its default action dies of it: the parent reads that death as the kill it was
about to make. A child that was stopped (SIGSTOP, or by a tracer) when it was killed
could not dump at all: a stopped process runs no signal handler, and SIGKILL is the one
signal that reaches it. Its traceback says so (``stopped_note``) instead of being empty,
as if the stack were lost.

Why a real-time signal: nothing the system or common libraries send, and it is queued,
never merged with the soft-timeout signal.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import os
import signal

from sandboxq.pool import descriptors
from sandboxq.text import MAX_TRACEBACK_BYTES, bounded_traceback

#: The signal that makes a child dump its stack.
DUMP_SIGNAL: int = signal.SIGRTMAX - 2
#: Its name, as the kernel's documentation writes it (no ``signal.Signals`` member has it).
DUMP_SIGNAL_NAME = "SIGRTMAX-2"
#: How long before the hard deadline the child is asked for its stack. The dump itself
#: takes well under a millisecond, but a child that is runnable and not running (a loaded
#: machine) takes the signal only once it is scheduled again: 5 ms (the guard's early
#: kill) missed the stack under the test suite's load, 20 ms under a load of 12 on two
#: cores. The kill stays at the deadline; a stack from 50 ms before it is the same stack.
DUMP_EARLY_S = 0.05
#: The most of a dump the parent reads (faulthandler writes at most 100 frames for each
#: of at most 100 threads); what is kept is bounded again, to a traceback's size.
MAX_DUMP_BYTES = 1024 * 1024


#: How each of faulthandler's dumps begins: a fatal signal's, the signalled thread's, and
#: another thread's (a dump of only one thread says "Stack").
_DUMP_STARTS = ("Fatal Python error: ", "Current thread 0x", "Thread 0x", "Stack (most recent")


#: In the child: its dump file (``arm``), or None when it has none.
_armed_fd: int | None = None


class StackFile:
    """One child's dump file, as its parent holds it (supervisor thread only)."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = os.memfd_create("sandboxq-stack", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        # A mark no file of a handler's bears: ``clear`` checks it before it empties one.
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)

    def for_child(self) -> descriptors.ToChild:
        """A picklable handle for the child's launch arguments."""
        return descriptors.ToChild(self.fd)

    def take(self) -> str | None:
        """What was dumped since the last ``take``, bounded (None: nothing), and empty
        the file for the next dump."""
        if self.fd < 0:
            return None
        data = os.pread(self.fd, MAX_DUMP_BYTES, 0)
        if not data:
            return None
        os.ftruncate(self.fd, 0)
        text = data.decode("utf-8", "replace")
        # From where faulthandler's own words start: a handler may have written into its
        # file (a scribbler writes to every descriptor it holds) and that is no stack.
        found = [i for i in map(text.find, _DUMP_STARTS) if i >= 0]
        if not found:
            return None
        return bounded_traceback(text[min(found) :].strip("\n") + "\n")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


#: Between the stack dumped last (before the hard kill, or at a crash) and the one at the
#: soft signal before it, when an attempt has both.
SOFT_STACK_HEADER = "\nEarlier, at the soft signal:\n"
_HALF_BYTES = (MAX_TRACEBACK_BYTES - len(SOFT_STACK_HEADER)) // 2


def with_soft_stack(last: str | None, at_soft: str | None) -> str | None:
    """The stack dumped last, then the one at the soft signal: where the attempt was when
    told to stop is kept beside where it was when it ended (a handler that caught its
    ``SoftTimeout`` and went on elsewhere lost the first). Each bounded to half the room
    when both are there."""
    if last is None or at_soft is None:
        return last if last is not None else at_soft
    return (
        bounded_traceback(last, _HALF_BYTES)
        + SOFT_STACK_HEADER
        + bounded_traceback(at_soft, _HALF_BYTES)
    )


def stopped_note(state: str) -> str:
    """The traceback of an attempt whose child was in ``state`` (``T``, ``t``: stopped)
    when it was killed, and dumped no stack: where it was cannot be known, and why not."""
    how = "by a tracer: state t" if state == "t" else "SIGSTOP or another stop signal: state T"
    return (
        f"no stack: the child was stopped ({how}) when it was killed; a stopped process "
        "runs no signal handler, so it could not dump its stack\n"
    )


def clear() -> None:
    """In the child, as each attempt starts (before it is marked started, so before the
    parent may ask for its stack): empty the dump file. The handler holds it, as every
    descriptor of its process: a stack of its own making written there was read as the
    next job's, killed or crashed on the same child. A descriptor of that number that is
    not the file (closed, then reused by the handler) is left alone."""
    if _armed_fd is None:
        return
    try:
        if fcntl.fcntl(_armed_fd, fcntl.F_GET_SEALS) == fcntl.F_SEAL_SEAL:
            os.ftruncate(_armed_fd, 0)
    except OSError:
        pass  # closed, or not a sealable file: not the dump file


def ask(pid: int) -> None:
    """Ask child ``pid`` for its stack (it may have died meanwhile)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, DUMP_SIGNAL)


def arm(fd: int) -> None:
    """In the child, before any of the handler's code: dump every thread's stack to ``fd``
    on ``DUMP_SIGNAL`` and on a fatal signal. Appending: the parent empties the file
    between dumps, and the next one starts at its beginning."""
    global _armed_fd
    _armed_fd = fd
    os.set_inheritable(fd, False)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    faulthandler.enable(file=fd, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=fd, all_threads=True)
    # faulthandler asks the kernel to restart a call its dump interrupts (SA_RESTART). The
    # soft signal comes right after the dump signal (``handles.signal_soft``); when it
    # lands while the dump runs, its Python handler only runs once the interrupted call
    # returns, and a restarted read() on a silent pipe never does: the soft timeout would
    # become a hard one. Without SA_RESTART the call fails with EINTR, Python runs the
    # pending handler and, if none raised, retries the call (PEP 475): nothing else
    # changes for the handler's Python code.
    signal.siginterrupt(DUMP_SIGNAL, True)
    # A process the handler forks (os.fork, multiprocessing) would inherit both and write
    # its own crash into this child's file: it is not the child, and its stack is not
    # what the parent reads there. (A program it executes gets neither: exec resets
    # handlers, and the file is close-on-exec.)
    os.register_at_fork(after_in_child=_disarm)


def rearm(fd: int) -> None:
    """In the child, after an attempt: the dump signal's and the fatal signals' handlers
    as ``arm`` set them, whatever the attempt did to them below Python's view
    (``faulthandler.unregister``: the next job died of the dump signal at its soft
    timeout; ``signal.siginterrupt``)."""
    faulthandler.enable(file=fd, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=fd, all_threads=True)
    signal.siginterrupt(DUMP_SIGNAL, True)


def _disarm() -> None:
    faulthandler.unregister(DUMP_SIGNAL)
    faulthandler.disable()
