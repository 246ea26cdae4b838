"""Which containment a pool runs under, chosen once at start, and its groups' lifetimes.

    Pool start ──► detect(setting) ──► Containment(mode)
                     auto:   cgroup v2 (a writable subtree with memory + pids)
                             else cgroup v1 (memory, pids, freezer hierarchies)
                             else the process-tree mode, with a warning naming why
                     cgroup: the same, but no fallback: an error instead
                     process_tree: no groups at all
    supervisor: spawn ──► new_child() ──► (Group | None, ChildSetup for the child)
                child replaced ──► remove(group)    (now, or once its processes exited)
                close ──► close()                   (every group of this pool removed)

Modes, and what each defends:

- ``cgroup_v2`` / ``cgroup_v1``: one control group per child. A kill takes every process
  in it (daemons that double-forked, setsid helpers), a ``pids`` limit stops fork bombs,
  and a memory limit is enforced by the kernel, whose OOM-kill counter names the outcome.
- ``process_tree``: the child's process tree is walked and killed (``kill.py``); a process
  that left the tree can escape, fork bombs are not bounded, and memory is sampled.

In a cgroup mode, a worker running as root hands its children's groups to another uid and
its children give up the means to write them (read-only cgroup mounts, no capabilities,
no_new_privs: privileges.py); ``protections`` says which are in force.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Literal

from sandboxq.errors import ConfigError
from sandboxq.pool import cgroups, pool_lock, privileges
from sandboxq.pool.cgroups import Group
from sandboxq.pool.limits import ChildSetup
from sandboxq.pool.pool_lock import PoolLock
from sandboxq.settings import ContainmentSetting
from sandboxq.text import guarded_logger

log = guarded_logger("sandboxq.pool")

Mode = Literal["cgroup_v2", "cgroup_v1", "process_tree"]

#: How long close() waits for the processes of its groups to exit before giving up.
CLOSE_WAIT_S = 5.0


class Containment:
    """The mode in force and, in a cgroup mode, the pool group its children's groups sit in."""

    def __init__(
        self,
        mode: Mode,
        why: str,
        setup: ChildSetup,
        pool_dirs: Mapping[str, str] | None = None,
        max_processes: int | None = None,
        *,
        asked: privileges.Asked = privileges.DEFAULT_ASK,
        lock: PoolLock | None = None,
    ) -> None:
        self.mode: Mode = mode
        self._lock = lock  # held while the pool lives: its groups are not stale
        self.why = why  # how the mode was chosen, in words (logged once)
        given_up, self._owner, protections = privileges.plan(bool(pool_dirs), asked)
        #: What keeps a handler from lifting its limits, in words (privileges.py).
        self.protections: tuple[str, ...] = protections
        self._setup = replace(setup, privileges=given_up)  # the same for every child
        self._pool_dirs = dict(pool_dirs or {})
        self._max_processes = max_processes
        self._numbers = itertools.count(1)
        self._lingering: list[Group] = []

    @property
    def pid_namespace(self) -> bool:
        """Whether each child runs in a PID namespace of its own (pid_namespace.py)."""
        return self._setup.privileges.pid_namespace

    @property
    def pool_dirs(self) -> dict[str, str]:
        """controller (v2: "unified") -> this pool's group directory; empty without groups."""
        return dict(self._pool_dirs)

    @property
    def cgroups(self) -> bool:
        return self.mode != "process_tree"

    def new_child(self) -> tuple[Group | None, ChildSetup]:
        """A fresh group for the next child (None without cgroups), and what the child
        applies to itself at start."""
        self.tidy()
        if not self.cgroups:
            return None, self._setup
        name = f"child-{next(self._numbers)}"
        dirs = {c: os.path.join(d, name) for c, d in self._pool_dirs.items()}
        version = 2 if self.mode == "cgroup_v2" else 1
        group = Group.create(version, dirs, self._max_processes, self._owner)
        pids_current = os.path.join(group.pids_dir, "pids.current")
        setup = replace(self._setup, procs_files=group.procs_files, pids_current=pids_current)
        return group, setup

    def remove(self, group: Group | None, wait: bool = True) -> None:
        """The group's child is gone: kill what is left, remove it now or once it empties
        (``wait=False``: without waiting for what it killed to exit)."""
        if group is not None and not group.remove(wait):
            self._lingering.append(group)

    def tidy(self) -> None:
        """Remove the groups ``remove`` left behind whose processes have exited since."""
        self._lingering = [g for g in self._lingering if not g.remove(wait=False)]

    def limit_pool_memory(self, max_bytes: int) -> None:
        """Limit the pool's group, every child's group within it, to ``max_bytes``
        (pool_memory_mb: budget.py); nothing to do without groups. A limit the kernel
        refuses is a ``ConfigError`` naming the setting."""
        memory = self._pool_dirs.get("memory", self._pool_dirs.get("unified"))
        if memory is not None:
            name = "memory.max" if self.mode == "cgroup_v2" else "memory.limit_in_bytes"
            try:
                with open(os.path.join(memory, name), "w") as f:
                    f.write(str(max_bytes))
            except OSError as exc:
                raise ConfigError(
                    f"pool_memory_mb: the kernel refused {max_bytes} bytes as the limit "
                    f"of {memory}: {exc.strerror or exc}"
                ) from None

    def pool_usage(self) -> int | None:
        """What the pool's group is charged now, in bytes (None: no groups)."""
        memory = self._pool_dirs.get("memory", self._pool_dirs.get("unified"))
        if memory is None:
            return None
        name = "memory.current" if self.mode == "cgroup_v2" else "memory.usage_in_bytes"
        try:
            with open(os.path.join(memory, name)) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def pool_oom_kills(self) -> int:
        """The kernel's count of OOM kills in the pool's group (0 without groups)."""
        memory = self._pool_dirs.get("memory", self._pool_dirs.get("unified"))
        if memory is None:
            return 0
        return Group(2 if self.mode == "cgroup_v2" else 1, {"memory": memory}).oom_kills()

    def close(self) -> None:
        """Remove every group of this pool (killing what is still inside)."""
        if self.cgroups and not cgroups.remove_tree(self._pool_dirs, CLOSE_WAIT_S):
            log.warning("control groups of this pool could not all be removed: %s", self._pool_dirs)
        self._lingering.clear()
        if self._lock is not None:
            self._lock.release()  # what is left is for the next pool to remove
            self._lock = None


# -- detection -------------------------------------------------------------------------------


def detect(
    setting: ContainmentSetting,
    setup: ChildSetup,
    max_processes: int | None,
    *,
    mountinfo: str = "/proc/self/mountinfo",
    own_cgroups: str = "/proc/self/cgroup",
    asked: privileges.Asked = privileges.DEFAULT_ASK,
) -> Containment:
    """Choose the mode, create this pool's group, and log once which mode is in force and
    which protections (what the settings ``asked`` of the children: privileges.py).

    ``mountinfo`` and ``own_cgroups`` are the kernel's files; tests hand others.
    """
    chosen = _choose(setting, setup, max_processes, mountinfo, own_cgroups, asked)
    log.info("containment protections: %s", ", ".join(chosen.protections) or "none")
    return chosen


def _choose(
    setting: ContainmentSetting,
    setup: ChildSetup,
    max_processes: int | None,
    mountinfo: str,
    own_cgroups: str,
    asked: privileges.Asked,
) -> Containment:
    if setting == "process_tree":
        chosen = Containment(
            "process_tree",
            "forced by the containment setting",
            setup,
            asked=asked,
        )
        log.info("containment: process_tree (%s)", chosen.why)
        return chosen
    problems = []
    for version in (2, 1):
        try:
            dirs = _pool_dirs(version, mountinfo, own_cgroups)
            lock = _make_pool_group(version, dirs)
        except OSError as exc:
            problems.append(f"cgroup v{version}: {exc.strerror or exc}")
            continue
        except _Unusable as exc:
            problems.append(f"cgroup v{version}: {exc}")
            continue
        mode: Mode = "cgroup_v2" if version == 2 else "cgroup_v1"
        where = ", ".join(sorted(set(dirs.values())))
        try:
            chosen = Containment(
                mode,
                f"groups under {where}",
                setup,
                dirs,
                max_processes,
                asked=asked,
                lock=lock,
            )
        except BaseException:  # a setting the machine refuses: the pool never starts
            cgroups.remove_tree(dirs, CLOSE_WAIT_S)
            lock.release()
            raise
        log.info("containment: %s (%s; max_processes=%s)", mode, chosen.why, max_processes)
        return chosen
    why = "; ".join(problems)
    if setting == "cgroup":
        raise ConfigError(f"containment='cgroup' but no control groups are writable here: {why}")
    log.warning(
        "containment: process_tree, because control groups are not writable here (%s); "
        "a process that leaves its child's tree can escape a kill, fork bombs are not "
        "bounded, and memory is sampled",
        why,
    )
    return Containment(
        "process_tree",
        f"control groups not writable: {why}",
        setup,
        asked=asked,
    )


class _Unusable(Exception):
    """A hierarchy is there but cannot hold our groups (say why)."""


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fs type, super options) of each cgroup mount."""
    found = []
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
                found.append((fields[3], fields[4], rest[0], set(rest[2].split(","))))
    return found


def _own_paths(own_cgroups: str) -> dict[str, str]:
    """controller (v2: "") -> this process's group path."""
    paths = {}
    with open(own_cgroups) as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(","):
                paths[name] = path
    return paths


def _below(root: str, mount_point: str, path: str) -> str:
    if root != "/" and path.startswith(root):
        path = path[len(root) :]
    return os.path.join(mount_point, path.lstrip("/"))


def _pool_dirs(version: int, mountinfo: str, own_cgroups: str) -> dict[str, str]:
    mounts, own = _mounts(mountinfo), _own_paths(own_cgroups)
    name = cgroups.pool_group_name()
    if version == 2:
        v2 = [(r, p) for r, p, fs, _ in mounts if fs == "cgroup2"]
        if not v2 or "" not in own:
            raise _Unusable("no cgroup2 hierarchy")
        here = _below(*v2[0], own[""])
        with open(os.path.join(here, "cgroup.subtree_control")) as f:
            enabled = set(f.read().split())
        missing = [c for c in cgroups.V2_CONTROLLERS if c not in enabled]
        if missing:
            raise _Unusable(f"controllers {', '.join(missing)} not enabled for {here}")
        return {"unified": os.path.join(here, name)}
    dirs = {}
    for controller in cgroups.V1_CONTROLLERS:
        match = [(r, p) for r, p, fs, opts in mounts if fs == "cgroup" and controller in opts]
        if not match or controller not in own:
            raise _Unusable(f"no {controller} hierarchy")
        dirs[controller] = os.path.join(_below(*match[0], own[controller]), name)
    return dirs


def _make_pool_group(version: int, dirs: Mapping[str, str]) -> PoolLock:
    """Remove the groups of pools that are gone, then create ours, locked for the pool's
    life (pool_lock.py), and check the kernel made it a group (a plain directory has no
    ``cgroup.procs``)."""
    _remove_stale({c: os.path.dirname(d) for c, d in dirs.items()})
    made = []
    lock = PoolLock()
    try:
        for path in dirs.values():
            lock.make(path)
            made.append(path)
            if not os.path.exists(os.path.join(path, "cgroup.procs")):
                raise _Unusable(f"{os.path.dirname(path)} is not a control group hierarchy")
        if version == 2:
            with open(os.path.join(dirs["unified"], "cgroup.subtree_control"), "w") as f:
                f.write(" ".join(f"+{c}" for c in cgroups.V2_CONTROLLERS))
        probe = Group.create(version, {c: os.path.join(d, "probe") for c, d in dirs.items()}, 1)
        probe.remove()
    except BaseException:
        for path in made:
            with contextlib.suppress(OSError):
                os.rmdir(path)
        lock.release()
        raise
    return lock


def _remove_stale(parents: Mapping[str, str]) -> None:
    """Remove the pool groups below ``parents`` (controller -> directory) whose lock is
    free in every hierarchy they are in: their pool is gone, whatever its pid looks like
    from here. One locked anywhere belongs to a live pool (or one being made)."""
    found: dict[str, dict[str, pool_lock.Stale]] = {}
    for controller, parent in parents.items():
        for stale in pool_lock.stale(parent):
            found.setdefault(stale.name, {})[controller] = stale
    for name, held in found.items():
        try:
            elsewhere = [
                c
                for c, p in parents.items()
                if c not in held and os.path.exists(os.path.join(p, name))
            ]
            if elsewhere:
                continue
            stale_dirs = {c: os.path.join(parents[c], name) for c in held}
            if cgroups.remove_tree(stale_dirs, 1.0):
                log.info("removed the control groups of a pool that is gone: %s", name)
        finally:
            for stale in held.values():
                stale.release()


def probe() -> tuple[Mode, str]:
    """The mode ``auto`` would choose here, and why, leaving nothing behind."""
    chosen = detect("auto", ChildSetup(), None)
    chosen.close()
    return chosen.mode, chosen.why
