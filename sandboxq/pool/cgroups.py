"""Control groups, one per pool child: create, join, limit, kill, read OOM kills, remove.

    pool group   <root>/sandboxq.<owner pid>.<owner start time>.<n>/ (one per pool)
    child group  <pool group>/child-<n>/                              (one per child)

cgroup v2 has one directory per group; v1 has one per controller (``memory``, ``pids``,
``freezer``), so every operation below is done in each of them. The parent creates a
child's group before starting the child, and the child writes its own pid into it first
thing (``join``), before it imports the processor: everything it ever starts is inside.

A kill cannot miss a process, however it detached itself (setsid, double fork), since
nothing leaves a group on its own. The group is frozen first so a fork bomb cannot add
processes while they are being listed (v2 with ``cgroup.kill`` does all this in one write).

Groups are named after the pool's owner (pid and start time, unique on the machine), and
each pool holds a lock on its group for its life: a later pool removes the groups whose
lock is free (``pool_lock.py``, then ``remove_tree``; see ``containment.py``).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import signal
import time

from sandboxq.pool.kill import ended
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.pool")

#: The v1 controllers cgroup mode needs; v2 needs the first two (freezing is built in).
V1_CONTROLLERS = ("memory", "pids", "freezer")
V2_CONTROLLERS = ("memory", "pids")
PREFIX = "sandboxq."
#: Ends the name of a pool group whose pool holds its lock (pool_lock.py); groups named
#: without it were made by versions that held none.
LOCKED_SUFFIX = ".locked"
#: How long a kill waits for the processes it killed to be dead (a task in an
#: uninterruptible wait dies only when that wait returns), as ``kill.SWEEP_WAIT_S``.
KILL_WAIT_S = 1.0


_pools = itertools.count(1)


def pool_group_name() -> str:
    """``sandboxq.<pid>.<start time in clock ticks since boot>.<n>.locked``: the owner is
    unique within its PID namespace, and ``n`` tells apart the pools of one process."""
    pid = os.getpid()
    return f"{PREFIX}{pid}.{_start_ticks(pid)}.{next(_pools)}{LOCKED_SUFFIX}"


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22, starttime


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def read_pids(procs_file: str) -> list[int]:
    try:
        return [int(p) for p in _read(procs_file).split()]
    except OSError:
        return []


class Group:
    """One child's control group (``dirs``: one per v1 controller, or the one v2 dir)."""

    __slots__ = (
        "_limited",
        "_oom_at_start",
        "_usage_at_start",
        "_version",
        "dirs",
        "memory_dir",
        "pids_dir",
        "procs_files",
    )

    def __init__(self, version: int, dirs: dict[str, str]) -> None:
        self._version = version
        self.dirs = dirs  # controller (v2: "unified") -> directory
        self.memory_dir = dirs.get("memory", dirs.get("unified", ""))
        self.pids_dir = dirs.get("pids", dirs.get("unified", ""))
        self.procs_files = tuple(os.path.join(d, "cgroup.procs") for d in dirs.values())
        self._oom_at_start = 0
        self._limited = False
        self._usage_at_start = 0  # the group's charge when the attempt began (peak_growth)

    @classmethod
    def create(
        cls,
        version: int,
        dirs: dict[str, str],
        max_processes: int | None,
        owner_uid: int | None = None,
    ) -> Group:
        """Make the group and set its pids limit; ``owner_uid``: hand its directories and
        files to that uid, out of a root child's reach (privileges.py says why)."""
        for path in dirs.values():
            os.mkdir(path)
        group = cls(version, dirs)
        if version == 2:
            with contextlib.suppress(OSError):  # older kernels: OOM kills one process
                _write(os.path.join(group.memory_dir, "memory.oom.group"), "1")
        if max_processes is not None:
            _write(os.path.join(group.pids_dir, "pids.max"), str(max_processes))
        if owner_uid is not None:
            for path in dirs.values():
                os.chown(path, owner_uid, -1)
                for name in os.listdir(path):
                    os.chown(os.path.join(path, name), owner_uid, -1)
        return group

    def pids(self) -> list[int]:
        return read_pids(self.procs_files[0])

    # -- kill -----------------------------------------------------------------------------

    def kill(self, *, thaw: bool = True, wait: bool = True) -> None:
        """SIGKILL every process in the group and wait (up to ``KILL_WAIT_S``) until each
        one is dead: none can run another instruction after.

        ``thaw=False`` leaves the group frozen, SIGKILLs pending, and does not wait (a
        frozen task cannot die): the caller reports the kill first, then calls ``thaw``
        (waking hundreds of tasks takes milliseconds).
        """
        if self._version == 2:
            kill_file = os.path.join(self.dirs["unified"], "cgroup.kill")
            listed = set(self.pids())  # to wait for: an exiting task leaves the list
            try:
                _write(kill_file, "1")
            except OSError as exc:
                if exc.errno != errno.ENOENT:  # no cgroup.kill before Linux 5.14
                    raise
            else:
                if wait:
                    self._wait_dead(listed)
                return
        killed: set[int] = set()
        self._freeze(True)
        try:
            # A task the freezer has not reached yet can fork once more before it stops:
            # list again until a pass finds nobody new.
            while fresh := [pid for pid in self.pids() if pid not in killed]:
                for pid in fresh:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                killed.update(fresh)
        except BaseException:
            self.thaw()
            raise
        if thaw:
            self.thaw()
            if wait:
                self._wait_dead(killed)

    def kill_pending(self, freeze_wait_s: float) -> bool:
        """SIGKILL every process in the group so that none can run again, without waiting
        for any to exit: True once that holds (v2: ``cgroup.kill``; v1: the group reads
        FROZEN, every task in it has SIGKILL pending: call ``thaw`` next). False when it
        could not be made sure of within ``freeze_wait_s`` (then the group is thawed)."""
        if self._version == 2:
            try:
                _write(os.path.join(self.dirs["unified"], "cgroup.kill"), "1")
                return True
            except FileNotFoundError:
                return False  # no cgroup.kill before Linux 5.14
        if "freezer" not in self.dirs:
            return False
        self.kill(thaw=False)
        state = os.path.join(self.dirs["freezer"], "freezer.state")
        deadline = time.monotonic() + freeze_wait_s
        while _read(state).strip() != "FROZEN":
            if time.monotonic() >= deadline:
                self.thaw()
                return False
            time.sleep(0.0002)
        # Frozen: nothing forks any more, but a fork that was past its parent's signal
        # check when the parent was killed may have joined after the last listing.
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return True

    def _wait_dead(self, killed: set[int]) -> None:
        """Wait until every process in ``killed`` has ended and the group lists nobody
        else, SIGKILLing whoever shows up meanwhile (added to ``killed``).

        Why: the outcome is reported right after the kill, and a SIGKILL is only pending
        until its task runs again: on a loaded machine the processes of a fork bomb were
        still running when the outcome of an attempt whose child had exited was reported
        (design invariant 10). And a fork already past the kernel's signal check when
        its parent was killed can join the group after the last listing above, with no
        SIGKILL of its own (the v1 freeze is not waited for either). Its parent ends only
        once that fork is done, so the group is listed after the check that every killed
        process ended, and whoever it shows is killed and waited for too.
        """
        deadline = time.monotonic() + KILL_WAIT_S
        waiting = set(killed)
        while True:
            waiting = {pid for pid in waiting if not ended(pid)}
            fresh = [pid for pid in self.pids() if pid not in killed]
            for pid in fresh:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(fresh)
            waiting.update(fresh)
            if not waiting:
                return
            if time.monotonic() >= deadline:
                # Said, not silent: the outcome that follows is reported with these alive.
                log.warning(
                    "%d killed processes of %s still alive after %g s (uninterruptible?)",
                    len(waiting),
                    self.procs_files[0],
                    KILL_WAIT_S,
                )
                return
            time.sleep(0.0005)

    def thaw(self) -> None:
        """Frozen tasks only act on their pending SIGKILL once thawed."""
        self._freeze(False)

    def _freeze(self, frozen: bool) -> None:
        if self._version == 2:
            path = os.path.join(self.dirs["unified"], "cgroup.freeze")
            value = "1" if frozen else "0"
        elif "freezer" in self.dirs:
            path = os.path.join(self.dirs["freezer"], "freezer.state")
            value = "FROZEN" if frozen else "THAWED"
        else:
            return  # what is left of a dead pool's group, gone from the freezer hierarchy
        try:
            _write(path, value)
        except FileNotFoundError:
            # Already removed (its child died and the group was removed first, as when the
            # fork server dies under it): an empty group has nothing to freeze or thaw.
            pass

    def empty(self) -> bool:
        return not self.pids()

    def remove(self, wait: bool = True) -> bool:
        """Kill what is left and remove the directories; False while some are still
        exiting (the caller tries again later; ``wait=False``: without waiting for what
        it killed to exit)."""
        if not self.empty():
            self.kill(wait=wait)
            return False
        gone = True
        for path in self.dirs.values():
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                gone = False
        return gone

    # -- memory ---------------------------------------------------------------------------

    def limit_memory(self, max_bytes: int | None) -> None:
        """Limit the job now starting to ``max_bytes`` of growth over the group's current
        charge, and remember the OOM-kill count the job starts from."""
        name = "memory.max" if self._version == 2 else "memory.limit_in_bytes"
        current = "memory.current" if self._version == 2 else "memory.usage_in_bytes"
        if max_bytes is None and not self._limited:
            return  # nothing to undo: no file touched on the no-limit path
        self._oom_at_start = self.oom_kills()
        self._limited = max_bytes is not None
        if max_bytes is None:
            limit = "max" if self._version == 2 else "-1"
        else:
            used = int(_read(os.path.join(self.memory_dir, current)))
            limit = str(used + max_bytes)
        try:
            _write(os.path.join(self.memory_dir, name), limit)
        except OSError as exc:
            if exc.errno != errno.EBUSY:  # v1: over the new limit already; keep the old one
                raise

    def start_peak(self) -> None:
        """The attempt now starting is measured from here: v1 resets the group's high-water
        mark to its present charge (writing 0 to ``memory.max_usage_in_bytes``)."""
        current = "memory.current" if self._version == 2 else "memory.usage_in_bytes"
        try:
            self._usage_at_start = int(_read(os.path.join(self.memory_dir, current)))
            if self._version == 1:
                _write(os.path.join(self.memory_dir, "memory.max_usage_in_bytes"), "0")
        except (OSError, ValueError):
            self._usage_at_start = 0

    def peak_growth(self) -> int | None:
        """The most the group's charge grew over its start (``start_peak``), in bytes: the
        kernel's own high-water mark (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``,
        which older kernels lack and cannot be reset: None then)."""
        name = "memory.peak" if self._version == 2 else "memory.max_usage_in_bytes"
        if self._version == 2:
            return None  # memory.peak counts since the group was made, not this attempt
        try:
            peak = int(_read(os.path.join(self.memory_dir, name)))
        except (OSError, ValueError):
            return None
        return max(0, peak - self._usage_at_start)

    def oom_kills(self) -> int:
        """The kernel's count of OOM kills in this group (v1 ``memory.oom_control``, v2
        ``memory.events``)."""
        name = "memory.events" if self._version == 2 else "memory.oom_control"
        try:
            text = _read(os.path.join(self.memory_dir, name))
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def oom_killed_since_start(self) -> bool:
        return self.oom_kills() > self._oom_at_start


def remove_tree(pool_dirs: dict[str, str], wait_s: float) -> bool:
    """Kill and remove every child group below ``pool_dirs``, then the pool group itself;
    waits up to ``wait_s`` for killed processes to exit. True when all is gone."""
    version = 2 if "unified" in pool_dirs else 1
    names: set[str] = set()
    for path in pool_dirs.values():  # a group may be gone from some hierarchies already
        with contextlib.suppress(FileNotFoundError):
            names.update(n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n)))
    groups = [Group(version, {c: os.path.join(d, n) for c, d in pool_dirs.items()}) for n in names]
    deadline = time.monotonic() + wait_s
    while True:
        groups = [g for g in groups if not g.remove()]
        if not groups or time.monotonic() >= deadline:
            break
        time.sleep(0.002)
    if groups:
        return False
    gone = True
    for path in pool_dirs.values():
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:
            gone = False  # EBUSY: a process or group appeared in it meanwhile
    return gone
