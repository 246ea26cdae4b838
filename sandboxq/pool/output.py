"""What a child writes to stdout and stderr: shown live as before, and the end of each
attempt's kept with its outcome (``capture_output``, on by default).

    child: fd 1 ─► a pipe ──┐   fd 2 ─► a pipe ──┐        (attach(), at the child's start)
                            ▼                    ▼
    Relay thread (one per pool): select over every child's pipes ─► read ─► that child's
        tail (the last TAIL_BYTES of its running attempt) ─► written on to the worker's own
        stdout / stderr
    supervisor: an idle child is sent a task ─► ChildOutput.clear(), before the send
                an attempt ends ─► ChildOutput.take(): the pipes drained into the tail (the
                child flushed before replying, so all it wrote is in them), the tail
                taken as ``AttemptResult.output``, and the tail empty for the next one

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

The attempt boundary is where the parent sees it: while short jobs are queued in a
child's channel, the next attempt may start before the parent has read the reply of the
one before, and what it writes first can be counted with that one. Output of a process
an attempt started and that outlives it (``keep_strays``) lands in whichever attempt runs
when it writes; every other process an attempt started is dead before its reply.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import selectors
import sys
import threading
from collections import deque
from typing import Any

from sandboxq.pool import descriptors

log = logging.getLogger("sandboxq.pool")

#: How much of an attempt's output is kept: its last 8 KiB.
TAIL_BYTES = 8 * 1024
#: The most the relay holds back for the worker's stdout and stderr when they are not read
#: fast enough; past it, children's output is dropped from the live view (not from tails).
OUTBOX_BYTES = 1024 * 1024
_READ = 64 * 1024


class ChildOutput:
    """One child's stdout and stderr pipes, as its parent holds them."""

    __slots__ = ("_relay", "dests", "fds", "readable", "tail", "total", "writers")

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
        self.tail = bytearray()
        self.total = 0  # bytes of the running attempt, kept or not

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
            self.tail.clear()
            self.total = 0
        if drained:
            relay.wake()

    def take(self) -> str | None:
        """The attempt ended: the last ``TAIL_BYTES`` it wrote (None: nothing), from the
        pipes drained now."""
        relay = self._relay
        with relay.lock:
            drained = relay.drain(self)
            if not self.total:
                return None
            data, total = bytes(self.tail), self.total
            self.tail.clear()
            self.total = 0
        if drained:
            relay.wake()
        text = data.decode("utf-8", "replace")
        if total > len(data):
            text = f"... {total - len(data):,} bytes before these cut ...\n" + text
        return text

    def close(self) -> None:
        """The child is gone and its last output taken: the relay closes the pipes."""
        self._relay.remove(self)

    def discard(self) -> None:
        """The child never started: close every end here (the relay never had them)."""
        for fd in (*self.fds, *self.writers):
            os.close(fd)
        self.writers = ()

    def append(self, data: bytes) -> None:
        """Under the relay's lock: ``data`` was read from one of the pipes."""
        self.total += len(data)
        tail = self.tail
        tail += data
        if len(tail) > TAIL_BYTES:
            del tail[: len(tail) - TAIL_BYTES]


def attach(stdout_fd: int, stderr_fd: int) -> None:
    """In the child, first thing: its stdout and stderr become the pipes to its parent.
    Line-buffered, as on a terminal: what a handler printed before it hung is in the pipe
    when it is killed, not lost in a buffer."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    os.close(stdout_fd)
    os.close(stderr_fd)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # replaced by something that cannot be
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def flush_stdio() -> None:
    """In the child, at an attempt's end: what the handler printed leaves its buffers now
    (the attempt's output is what is in the pipes when the parent reads its reply)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # the handler may have closed or replaced it
            stream.flush()


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
                try:
                    data = os.read(fd, _READ)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    break
                got += len(data)
                out.append(data)
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
            try:
                data = os.read(fd, _READ)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if data:
                out.append(data)
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
            select.select([], [fd], [], 1.0)
        except OSError:  # closed (EPIPE), a full disk...: the live view gives up on it
            return
