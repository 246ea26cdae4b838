"""What a child writes to stdout and stderr: shown live as before, and the end of each
attempt's kept with its outcome (``capture_output``, on by default).

    child: fd 1 ─► a pipe ──┐   fd 2 ─► a pipe ──┐        (attach(), at the child's start)
                            ▼                    ▼
    Relay thread (one per pool): select over every child's pipes ─► read ─► that child's
        tail (the last TAIL_BYTES of its running attempt) ─► written on to the worker's own
        stdout / stderr
    supervisor: an idle child is sent a task ─► ChildOutput.clear(), before the send
                an attempt ends ─► ChildOutput.take(task): the pipes drained into the
                tails (the child flushed before replying, so all it wrote is in them),
                that attempt's tail taken as ``AttemptResult.output``

Who may block: only the relay, on a write to the worker's stdout or stderr that nobody
reads fast enough. Then it stops reading the pipes, and a child that writes more than a
pipe holds waits, as it did when it wrote to that stdout itself. The supervisor never
writes there: what it drains at an attempt's end goes to the relay's outbox, bounded
(``OUTBOX_BYTES``; past it, output is dropped from the live view and a line says how
much), so no reader of the worker's stdout can stall an outcome, a kill or a deadline.

Every read of a pipe and every change of a tail happens under the relay's one lock, so
the live view and the tails see the bytes in the order they were read. The read ends are
closed on the relay thread only (``remove``), so a number it still selects on is never
reused under it.

Which attempt wrote what: while short jobs are queued in a child's channel, the next
attempt starts before the parent has read the reply of the one before, so the tail cannot
switch when the reply is read. Instead each read of a pipe is tagged with the attempt the
child had started when the read began (its shared ``STARTED`` mark, read just before),
and the child, before it marks the next attempt started, waits until its pipes are empty
(``wait_drained``): a read that began before the mark can only return the earlier
attempt's bytes, one that began after it only the next one's. (Past ``DRAIN_WAIT_S``, a
parent that does not read, it goes on: its output may then be counted with the next.)
Output of a process an attempt started and that outlives it (``keep_strays``) lands in
whichever attempt runs when it writes, or none; every other process an attempt started is
dead before its reply.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import select
import selectors
import sys
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sandboxq.pool import descriptors
from sandboxq.pool.waits import writable
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.pool")

#: How much of an attempt's output is kept: its last 8 KiB.
TAIL_BYTES = 8 * 1024
#: The most the relay holds back for the worker's stdout and stderr when they are not read
#: fast enough; past it, children's output is dropped from the live view (not from tails).
OUTBOX_BYTES = 1024 * 1024
_READ = 64 * 1024
#: The longest a child waits, before marking its next attempt started, for its parent to
#: read what the one before wrote (the relay reads within microseconds; it waits longer
#: only while it is stuck writing to a worker's stdout that nobody reads).
DRAIN_WAIT_S = 0.05


class _Tail:
    """The last ``TAIL_BYTES`` one attempt wrote, and how much it wrote in all."""

    __slots__ = ("data", "total")

    def __init__(self) -> None:
        self.data = bytearray()
        self.total = 0


class ChildOutput:
    """One child's stdout and stderr pipes, as its parent holds them."""

    __slots__ = ("_relay", "attempt", "dests", "fds", "readable", "tails", "writers")

    def __init__(self, relay: Relay) -> None:
        self._relay = relay
        out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        err_r, err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        for fd in (out_w, err_w):  # the child's ends block, as a terminal's would
            os.set_blocking(fd, True)
        self.fds = (out_r, err_r)
        # One poll(2) of both pipes tells an attempt that wrote nothing (most) at once.
        self.readable = select.poll()
        for fd in self.fds:
            self.readable.register(fd, select.POLLIN)
        self.dests = {out_r: relay.stdout_fd, err_r: relay.stderr_fd}
        self.writers: tuple[int, ...] = (out_w, err_w)
        self.tails: dict[int, _Tail] = {}  # task id → what that attempt wrote
        #: The task the child has started last (its shared ``STARTED`` mark: spawn.py
        #: sets this), read before each read of its pipes (the module docstring).
        self.attempt: Callable[[], int] = lambda: 0

    def for_child(self) -> tuple[Any, Any]:
        """Picklable handles of the write ends, for the child's launch arguments."""
        return descriptors.ToChild(self.writers[0]), descriptors.ToChild(self.writers[1])

    def launched(self) -> None:
        """The child has its ends (or never will): close the parent's copies."""
        for fd in self.writers:
            os.close(fd)
        self.writers = ()

    def clear(self) -> None:
        """An idle child is about to be given an attempt: its output starts here (what
        the pipes hold is passed on, and kept for nobody)."""
        relay = self._relay
        with relay.lock:
            drained = relay.drain(self)
            self.tails.clear()
        if drained:
            relay.wake()

    def take(self, task_id: int) -> str | None:
        """Attempt ``task_id`` ended: the last ``TAIL_BYTES`` it wrote (None: nothing),
        from the pipes drained now. What earlier attempts left untaken goes."""
        relay = self._relay
        with relay.lock:
            drained = relay.drain(self)
            tail = self.tails.pop(task_id, None)
            for older in [t for t in self.tails if t < task_id]:
                del self.tails[older]
        if drained:
            relay.wake()
        if tail is None or not tail.total:
            return None
        text = tail.data.decode("utf-8", "replace")
        if tail.total > len(tail.data):
            text = f"... {tail.total - len(tail.data):,} bytes before these cut ...\n" + text
        return text

    def close(self) -> None:
        """The child is gone and its last output taken: the relay closes the pipes."""
        self._relay.remove(self)

    def discard(self) -> None:
        """The child never started: close every end here (the relay never had them)."""
        for fd in (*self.fds, *self.writers):
            os.close(fd)
        self.writers = ()

    def append(self, data: bytes, task_id: int) -> None:
        """Under the relay's lock: ``data`` was read from one of the pipes by a read that
        began while attempt ``task_id`` was the child's."""
        tail = self.tails.get(task_id)
        if tail is None:
            tail = self.tails[task_id] = _Tail()
        tail.total += len(data)
        kept = tail.data
        kept += data
        if len(kept) > TAIL_BYTES:
            del kept[: len(kept) - TAIL_BYTES]


def attach(stdout_fd: int, stderr_fd: int) -> None:
    """In the child, first thing: its stdout and stderr become the pipes to its parent.
    Line-buffered, as on a terminal: what a handler printed before it hung is in the pipe
    when it is killed, not lost in a buffer."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    global _pipes
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    # Its own ends too, whatever the handler does to 1 and 2: ``wait_drained`` asks them.
    _pipes = (stdout_fd, stderr_fd)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # replaced by something that cannot be
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]


_pipes: tuple[int, ...] = ()  # the child's ends of its output pipes (attach)


def kept_fds() -> tuple[int, ...]:
    """In the child: the descriptors ``attach`` keeps beside 1 and 2."""
    return _pipes


#: FIONREAD's answer, read in place (a new buffer and an unpack: 0.6 us an attempt more).
_unread = array.array("i", [0])


def wait_drained() -> None:
    """In the child, before it marks its next attempt started: until its parent has read
    all it wrote (both pipes empty), ``DRAIN_WAIT_S`` at most (the module docstring)."""
    give_up_at = None
    for fd in _pipes:
        while True:
            try:
                fcntl.ioctl(fd, termios.FIONREAD, _unread, True)
            except OSError:
                return  # the handler closed it: nothing to wait for
            if not _unread[0]:
                break
            now = time.monotonic()
            if give_up_at is None:
                give_up_at = now + DRAIN_WAIT_S
            elif now >= give_up_at:
                return
            time.sleep(0.0001)


def flush_stdio() -> None:
    """In the child, at an attempt's end: what the handler printed leaves its buffers now
    (the attempt's output is what is in the pipes when the parent reads its reply)."""
    for stream in (sys.stdout, sys.stderr):
        try:  # not contextlib.suppress: 1.3 us an attempt, this 0.2
            stream.flush()
        except Exception:  # the handler may have closed or replaced it
            pass


class Relay:
    """One thread that moves every child's output to the worker's own stdout and stderr,
    keeping each attempt's tail on the way (see the module docstring)."""

    def __init__(self, stdout_fd: int = 1, stderr_fd: int = 2) -> None:
        self.stdout_fd, self.stderr_fd = stdout_fd, stderr_fd
        self.lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._changes: deque[tuple[bool, ChildOutput]] = deque()
        self._outs: set[ChildOutput] = set()  # added and not removed (relay thread only)
        self._outbox: deque[tuple[int, bytes]] = deque()
        self._outbox_bytes = 0
        self._dropped = 0
        self._closing = False
        self._thread = threading.Thread(target=self._main, name="sandboxq-output", daemon=True)
        self._thread.start()

    # -- any thread --------------------------------------------------------------------

    def add(self, out: ChildOutput) -> None:
        with self.lock:
            self._changes.append((True, out))
        self.wake()

    def remove(self, out: ChildOutput) -> None:
        """The child is gone (its last output drained by ``take``): the relay stops reading
        its pipes and closes them."""
        with self.lock:
            self._changes.append((False, out))
        self.wake()

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def close(self, wait_s: float = 1.0) -> None:
        """Stop the thread once it has passed on what it holds (it may be stuck writing to
        a stdout nobody reads: then it is left behind, a daemon, after ``wait_s``)."""
        self._closing = True
        self.wake()
        self._thread.join(wait_s)

    def drain(self, out: ChildOutput) -> int:
        """Under ``lock``: read what ``out``'s pipes hold now into its tail, and queue it
        for the live view. Returns how many bytes."""
        got = 0
        for fd, _ in out.readable.poll(0):
            while True:
                task_id = out.attempt()  # before the read: the module docstring says why
                try:
                    data = os.read(fd, _READ)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    break
                got += len(data)
                out.append(data, task_id)
                self._queue(out.dests[fd], data)
                if len(data) < _READ:
                    break
        return got

    def _queue(self, dest: int, data: bytes) -> None:
        if self._outbox_bytes + len(data) > OUTBOX_BYTES:
            self._dropped += len(data)
            return
        self._outbox.append((dest, data))
        self._outbox_bytes += len(data)

    # -- the relay thread ---------------------------------------------------------------

    def _main(self) -> None:
        try:
            while not (self._closing and not self._outbox):
                for key, _ in self._selector.select():
                    if key.fd == self._wake_r:
                        with contextlib.suppress(BlockingIOError, OSError):
                            os.read(self._wake_r, 4096)
                    else:
                        self._read(key.fd, key.data)
                self._apply_changes()
                self._send()
        except Exception:
            log.exception("the pool's output relay failed; children's output is no longer shown")
        finally:
            self._shut()

    def _read(self, fd: int, out: ChildOutput) -> None:
        with self.lock:
            task_id = out.attempt()  # before the read: the module docstring says why
            try:
                data = os.read(fd, _READ)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if data:
                out.append(data, task_id)
                self._queue(out.dests[fd], data)
                return
        # End of file: every writer of that pipe is gone. Stop selecting on it (it would be
        # ready forever); it is closed with the child (``remove``).
        self._selector.unregister(fd)

    def _apply_changes(self) -> None:
        with self.lock:
            changes, self._changes = self._changes, deque()
        for added, out in changes:
            if added:
                self._outs.add(out)
                for fd in out.fds:
                    self._selector.register(fd, selectors.EVENT_READ, out)
            else:
                self._outs.discard(out)
                _close(self._selector, out)

    def _send(self) -> None:
        """Write the outbox to the worker's stdout and stderr (blocking: see the module
        docstring), then say what was dropped, if anything."""
        while True:
            with self.lock:
                if not self._outbox:
                    dropped, self._dropped = self._dropped, 0
                    break
                dest, data = self._outbox.popleft()
                self._outbox_bytes -= len(data)
            _write_all(dest, data)
        if dropped:
            note = (
                f"[sandboxq: {dropped:,} bytes of children's output were not shown: the "
                "worker's stdout or stderr was not read fast enough]\n"
            )
            _write_all(self.stderr_fd, note.encode())

    def _shut(self) -> None:
        self._apply_changes()
        for out in self._outs:
            _close(self._selector, out)
        self._outs.clear()
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _close(selector: selectors.BaseSelector, out: ChildOutput) -> None:
    for fd in out.fds:
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(fd)  # already, at its end of file
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except InterruptedError:
            continue
        except BlockingIOError:  # a stdout someone made non-blocking: wait for room
            writable(fd, 1.0)
        except OSError:  # closed (EPIPE), a full disk...: the live view gives up on it
            return
