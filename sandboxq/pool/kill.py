"""Process-tree kill and memory sampling: the pool's only use of psutil.

A child leads its own process group (it calls ``setsid`` at start), so one ``killpg``
takes the child and every grandchild that stayed in the group. Grandchildren that left
the group (``setsid``) are found by walking the process tree, which must happen *before*
the child dies: after that they are re-parented and no longer descend from it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable

import psutil


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


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
        tree = root.children(recursive=True)
    except psutil.Error:
        return 0, []
    total = 0
    for proc in (root, *tree):
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total, tree
