"""Process-tree kill and memory sampling: the pool's only use of psutil.

A child leads its own process group (it calls ``setsid`` at start), so one ``killpg``
takes the child and every grandchild that stayed in the group. Grandchildren that left
the group (``setsid``) are found by walking the process tree, which must happen *before*
the child dies: after that they are re-parented and no longer descend from it.

The walk reads ``/proc/<pid>/task/<tid>/children`` for the tree's own members where the
kernel has it: psutil's ``children()`` reads every process on the machine to find a
parent's, which took 2 to 3 ms here, most of a hard kill's delay and of a memory sample.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable

import psutil

#: Whether this kernel keeps per-thread children lists (CONFIG_PROC_CHILDREN).
_CHILDREN_LISTS = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _descendant_pids(pid: int) -> list[int]:
    """Pids below ``pid``, read from the kernel's per-thread children lists."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue  # gone: its children, if any, were re-parented
        for tid in threads:
            try:
                with open(f"/proc/{parent}/task/{tid}/children", "rb") as f:
                    kids = [int(p) for p in f.read().split()]
            except OSError:
                continue  # the thread or the process ended while we looked
            found += kids
            todo += kids
    return found


def descendants(pid: int) -> list[psutil.Process]:
    """The processes below ``pid`` (children, grandchildren...), alive when looked at."""
    if not _CHILDREN_LISTS:
        try:
            return psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            return []
    procs = []
    for child in _descendant_pids(pid):
        try:
            procs.append(psutil.Process(child))
        except psutil.Error:
            pass  # ended while we looked
    return procs


def kill_tree(pid: int, known: Iterable[psutil.Process] = ()) -> None:
    """SIGKILL ``pid``'s process group, every descendant, and ``known`` processes.

    ``known`` are descendants seen earlier (by memory sampling) that may have been
    re-parented since. psutil refuses to signal a process whose pid was reused, so a
    stale entry can never hit an unrelated process.
    """
    tree = descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for proc in (*tree, *known):
        try:
            proc.kill()
        except psutil.Error:
            pass


def tree_rss(pid: int) -> tuple[int, list[psutil.Process]]:
    """Resident memory of ``pid`` and its descendants in bytes, and the descendants seen."""
    try:
        root = psutil.Process(pid)
        tree = descendants(pid)
    except psutil.Error:
        return 0, []
    total = 0
    for proc in (root, *tree):
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total, tree
