"""Starting pool children, and following the fork server they are forked from.

    spawn() ──► a channel pair, the child's own page of shared values (memory.py:
                soft-signal target, started/withdrawn tasks), its stack-dump file
                (stacks.py), its stdout and stderr pipes (output.py, with
                capture_output), a control group in a cgroup mode
            ──► Process(child_main) started (launch.py; through the fork server with the
                forkserver start method) and registered (server.py) before an orphan
                sweep can see it
    follow_server() ──► after each start: the fork server's pidfd joins the select; one
                that was replaced before its death was seen has died
    follow_tracker() ──► after each start and each wake: the resource tracker's pidfd
                joins the select, reaped when it dies (tracker.py)

What a fork server's death does to the children is the supervisor's (its
``on_server_death``, then deaths.py): this module only notices the death.
"""

from __future__ import annotations

import contextlib
import functools
import os
import selectors
import signal
import time
from collections.abc import Callable
from typing import Any

from sandboxq.pool import launch, server
from sandboxq.pool.channel import Channel
from sandboxq.pool.child import STARTED, child_main
from sandboxq.pool.containment import Containment
from sandboxq.pool.handles import Child
from sandboxq.pool.kill import resume, state
from sandboxq.pool.memory import ChildMemory
from sandboxq.pool.output import ChildOutput, Relay
from sandboxq.pool.stacks import StackFile
from sandboxq.pool.tracker import TrackerWatch
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.pool")

#: Tries to start one child before the pool is broken.
LAUNCH_TRIES = 4
#: A child's frame may exceed the result cap by this much (the message around the result,
#: an error's traceback); anything larger is a bad message, refused before it is read.
FRAME_SLACK = 4 * 1024 * 1024


class Spawner:
    """Starts the children of one pool and watches their fork server (``forkserver`` start
    method only) from the supervisor's select."""

    def __init__(
        self,
        ctx: Any,
        processor: str,
        *,
        max_result_bytes: int,
        keep_strays: bool,
        containment: Containment,
        relay: Relay | None = None,
        selector: selectors.BaseSelector,
        on_server_death: Callable[[], None],
        wake: Callable[[], None],
    ) -> None:
        self._ctx = ctx
        self._processor = processor
        self._max_frame = max_result_bytes + FRAME_SLACK
        self._keep_strays = keep_strays
        self._relay = relay  # None: children write to the worker's stdout as it is
        self._contain = containment
        self._selector = selector
        self._on_server_death = on_server_death
        self._watch = server.Watch() if ctx.get_start_method() == "forkserver" else None
        self._tracker = TrackerWatch(wake)
        #: Why the pool's start was given up (``give_up``): no child is started after it.
        self.given_up: str | None = None

    def give_up(self, why: str) -> None:
        """Stop a start that hangs in the fork server (its import of the processor): no
        more tries, and the fork server killed, so that the thread waiting for it goes on
        (and the next pool of this process starts a fresh one)."""
        self.given_up = why
        if (pid := server.pid()) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def spawn(self) -> Child:
        """Start one child (not ready yet: it sends ``Ready`` once its processor is
        imported). Raises ``OSError`` when none could be started."""
        channel, child_end = Channel.pair(max_frame=self._max_frame)
        memory = ChildMemory()
        soft, shared = memory.for_child()
        group, setup = self._contain.new_child()
        dumps = StackFile()
        out = ChildOutput(self._relay) if self._relay is not None else None
        process = self._ctx.Process(
            target=child_main,
            args=(
                child_end,
                self._processor,
                soft,
                self._keep_strays,
                shared,
                setup,
                dumps.for_child(),
                out.for_child() if out is not None else None,
            ),
            name="sandboxq-child",
        )
        try:
            with server.spawning():
                launch.start_retrying(process, LAUNCH_TRIES, lambda: self.given_up)
                server.register(process.pid)
        except OSError:
            channel.close()
            dumps.close()
            if out is not None:
                out.discard()
            raise
        finally:
            child_end.close()
            memory.launched()
            if out is not None and out.writers:
                out.launched()
        child = Child(process, channel, memory.soft, memory.shared)
        child.group = group
        child.stacks = dumps
        if out is not None:
            assert self._relay is not None
            out.attempt = functools.partial(_started, memory.shared)
            child.output = out
            self._relay.add(out)
        return child

    def follow_server(self) -> None:
        """Watch the fork server the last child came from (a new one after a death), and
        the resource tracker."""
        self.follow_tracker()
        watch = self._watch
        if watch is None:
            return
        if watch.fd is not None and server.pid() != watch.pid:
            self._on_server_death()  # replaced before its death was seen: it died
        if (fd := watch.follow()) is not None:
            self._selector.register(fd, selectors.EVENT_READ, self._on_server_event)

    def follow_tracker(self) -> None:
        """Watch the resource tracker: a new one, once it changed (the old one replaced
        before its death was seen: its pidfd leaves the select before it is closed)."""
        tracker = self._tracker
        if (pid := tracker.changed()) is None:
            return
        if tracker.fd is not None:
            self._selector.unregister(tracker.fd)
        if (fd := tracker.follow(pid)) is not None:
            self._selector.register(fd, selectors.EVENT_READ, self._on_tracker_event)

    def _on_tracker_event(self, fd: Any) -> None:
        # As below: an event of a pidfd closed meanwhile, its number reused, is not its.
        if fd == self._tracker.fd and self._tracker.dead():
            self._selector.unregister(fd)
            self._tracker.reap()

    def _on_server_event(self, _fd: Any) -> None:
        # A select batch can still hold the event of a pidfd already handled (through a
        # child's exit) and closed, its number now reused: only a dead server counts.
        if self.server_dead():
            self._on_server_death()

    def continue_stopped_server(self) -> None:
        """Continue the watched fork server if someone stopped it: stopped, it reaps no
        child, so no exit reaches the pool."""
        pid = self._watch.pid if self._watch is not None else None
        if pid is not None and state(pid) in (b"T", b"t"):
            log.warning("the pool's fork server (pid %d) was stopped; continuing it", pid)
            resume(pid)

    def server_dead(self, wait_s: float = 0.0) -> bool:
        """Whether the watched fork server has died (waiting up to ``wait_s`` to see it)."""
        return self._watch is not None and self._watch.is_dead(wait_s)

    def server_lost(self) -> tuple[int | None, str] | None:
        """Stop watching the dead fork server: its pid and how it ended (None: not
        watching one)."""
        watch = self._watch
        if watch is None or watch.fd is None:
            return None
        self._selector.unregister(watch.fd)
        dead, how = watch.pid, watch.how()
        watch.close()
        return dead, how

    def unblamed_death(self) -> int:
        """Count a fork server death no running attempt is to blame for; returns how many
        fell within ``server.DEATH_WINDOW_S``."""
        return self._watch.died(time.monotonic()) if self._watch is not None else 0

    @property
    def server_restarts(self) -> int:
        """Fork servers started to replace dead ones."""
        return self._watch.restarts if self._watch is not None else 0

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        self._tracker.retire()


def _started(shared: Any) -> int:
    """The task a child has started last (its ``STARTED`` mark), for its output's tags."""
    return int(shared[STARTED])
