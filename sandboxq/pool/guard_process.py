"""The fence guard's own program: ``python -m sandboxq.pool.guard_process WORKER TABLE ALIVE
[POOL DIRS as JSON]``.

Runs in a session of its own (guard.py says why), reading the table the supervisor
writes. One loop:

    select(worker's pidfd, the liveness pipe; timeout = the nearest fence deadline, at
           most WATCH_S)
      ├─ readable: the worker died, or its pool closed ──► kill every tree in the table
      │            (the worker died: also kill and remove the pool's groups), exit
      ├─ a slot's fence deadline has come ──────────────► kill that child's tree (once)
      └─ the worker's state (/proc) ── stopped ─────────► stop every child's tree
                                    └─ running again ───► continue them

Why the worker's state is read every WATCH_S rather than waited for: the kernel tells a
parent when its child stops, never a child when its parent does, and the guard is the
worker's child. A read of /proc costs microseconds; at 20 reads a second the guard stays
far below a millisecond of CPU per second (bench/guard_cost.py measures it).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import time
from collections.abc import Iterator

from sandboxq.pool.cgroups import remove_tree
from sandboxq.pool.guard import (
    CLOSING,
    GUARD_EARLY_S,
    HEADER,
    SLOT_FORMAT,
    created,
    fence_came,
    header_of,
)
from sandboxq.pool.kill import parent, resume, state, stop_tree, sweep
from sandboxq.pool.waits import readable_among

#: How often the worker's state is read, and the longest wait between looks at the table
#: (a new attempt's fence deadline is at least a lease away, far longer than this).
WATCH_S = 0.05


class Guard:
    def __init__(self, worker: int, table: mmap.mmap) -> None:
        self.worker = worker
        self.table = table
        self.header = header_of(table)
        self.slot_size = struct.calcsize(SLOT_FORMAT)
        self.fenced: set[tuple[int, float]] = set()  # (pid, created) already killed
        self.paused: dict[tuple[int, float], set[int]] = {}  # child → the pids stopped

    def entries(self) -> list[tuple[int, int, float, float]]:
        """(slot, pid, created, deadline) of each slot in use, read in one pass, up to
        the highest slot ever used."""
        end = HEADER + min(self.header.used * self.slot_size, len(self.table) - HEADER)
        return [
            (index, *entry)
            for index, entry in enumerate(struct.iter_unpack(SLOT_FORMAT, self.table[HEADER:end]))
            if entry[0]
        ]

    def children(self) -> Iterator[tuple[int, float]]:
        """(pid, created) of each slot in use that still holds the child it names."""
        for _, pid, when, _ in self.entries():
            if created(pid) == when:
                yield pid, when

    def next_wait_s(self, entries: list[tuple[int, int, float, float]], now: float) -> float:
        deadlines = [deadline for *_, deadline in entries if deadline > 0.0]
        if not deadlines:
            return WATCH_S
        return max(0.0, min(WATCH_S, min(deadlines) - GUARD_EARLY_S - now))

    def enforce_fences(self, entries: list[tuple[int, int, float, float]], now: float) -> None:
        for index, pid, when, deadline in entries:
            if deadline <= 0.0 or not fence_came(deadline, now) or (pid, when) in self.fenced:
                continue
            # Still the same child and the same deadline: the supervisor may have freed
            # the slot or moved the deadline (a renewal) since the snapshot.
            offset = HEADER + index * self.slot_size
            if struct.unpack_from(SLOT_FORMAT, self.table, offset) != (pid, when, deadline):
                continue
            if created(pid) != when:
                continue
            self.fenced.add((pid, when))
            sweep(pid)
        if len(self.fenced) > 64:  # forget kills long buried
            self.fenced &= {(pid, when) for _, pid, when, _ in entries}

    def follow_worker(self) -> None:
        """Stop the children while the worker is stopped; continue them when it runs."""
        if state(self.worker) in (b"T", b"t"):
            for key in self.children():
                if key not in self.paused and key not in self.fenced:
                    self.paused[key] = stop_tree(key[0], include_root=True)
        elif self.paused:
            for key, pids in self.paused.items():
                if key not in self.fenced:
                    for pid in pids:
                        resume(pid)
            self.paused.clear()

    def end_everything(self, pool_dirs: dict[str, str] | None = None) -> None:
        """The worker is gone (or its pool closed): nothing of the pool may outlive it.
        ``pool_dirs`` (the worker died): its control groups, killed and removed now,
        rather than left for the next pool on the machine (its lock died with it); and
        its children's parent, the fork server, continued if it was stopped: it ends
        itself on its parent's death (forkserver_hooks), but a stopped process runs no
        handler, and it stayed behind, stopped, for good."""
        children = [pid for pid, _ in self.children()]
        servers = {parent(pid) for pid in children} if pool_dirs is not None else set()
        for pid in children:
            sweep(pid)
        for server in servers:
            if server is not None and server != self.worker and state(server) in (b"T", b"t"):
                resume(server)
        if pool_dirs and not remove_tree(pool_dirs, 1.0):
            print(f"sandboxq guard: could not remove {pool_dirs}", file=sys.stderr)


def main(argv: list[str]) -> int:
    worker, table_fd, alive_fd = (int(a) for a in argv[:3])
    pool_dirs: dict[str, str] = json.loads(argv[3]) if len(argv) > 3 else {}
    table = mmap.mmap(table_fd, os.fstat(table_fd).st_size)
    os.close(table_fd)
    guard = Guard(worker, table)
    try:
        worker_fd = os.pidfd_open(worker)
    except OSError:
        worker_fd = None
    if worker_fd is None or os.getppid() != worker:  # the worker died before we looked
        guard.end_everything(pool_dirs)
        return 0
    guard.header.beat = time.monotonic_ns()  # first: a ready guard with no beat looks hung
    guard.header.ready_pid = os.getpid()
    watched = [worker_fd, alive_fd]
    while True:
        guard.header.beat = time.monotonic_ns()  # the supervisor sees a stopped or hung guard by it
        wait_s = guard.next_wait_s(guard.entries(), time.monotonic())
        if ready := readable_among(watched, wait_s):
            # The worker died (its pidfd, or EOF on the pipe without the pool's word: the
            # pipe closes as the worker exits, before its pidfd says so), or only its pool
            # closed (CLOSING first): then the pool removes its groups itself.
            said = os.read(alive_fd, 1) if alive_fd in ready else b""
            died = worker_fd in ready or said != CLOSING
            guard.end_everything(pool_dirs if died else None)  # {}: died, no groups
            return 0
        guard.enforce_fences(guard.entries(), time.monotonic())
        guard.follow_worker()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
