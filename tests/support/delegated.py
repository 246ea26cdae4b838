"""Run a command as a worker that is not root, in control groups delegated to its user:
``unshare -m --propagation private python tests/support/delegated.py UID DIRS_JSON -- CMD...``

As root, in the mount namespace ``unshare`` made for it (so nothing here is seen outside):

1. every directory on the way to this Python, the checkout and the test's files that
   others may not enter (``/root`` here, mode 700) is covered by a tmpfs they may enter,
   with only the entries needed bound back in: the Python, the checkout, stay the files
   they are;
2. this process joins the delegated groups (``DIRS_JSON``: one directory per hierarchy,
   owned by ``UID`` already, as ``chown`` or systemd's ``Delegate=`` hands them over);
3. it becomes ``UID`` (its group too, no supplementary groups: every capability goes
   with the uid) and execs ``CMD``, keeping its pid: the caller's process is the worker.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile


def _closed_to_others(path: str) -> str | None:
    """The first directory above ``path`` (itself excluded) that others may not enter."""
    parts = os.path.realpath(path).split(os.sep)[1:-1]
    current = ""
    for part in parts:
        current = f"{current}/{part}"
        if not os.stat(current).st_mode & stat.S_IXOTH:
            return current
    return None


def open_the_way(paths: list[str]) -> None:
    """Make each of ``paths`` reachable by any user, in this mount namespace only (what is
    set aside goes in a tmpfs over /mnt, seen here only: nothing is left behind)."""
    scratch = "/mnt" if os.path.isdir("/mnt") else tempfile.mkdtemp(prefix=".delegated-")
    _mount(["-t", "tmpfs", "tmpfs", scratch])
    while True:
        needed: dict[str, set[str]] = {}  # closed directory -> its entries on the way
        for path in paths:
            if (closed := _closed_to_others(path)) is not None:
                rest = os.path.realpath(path)[len(closed) + 1 :]
                needed.setdefault(closed, set()).add(rest.split(os.sep)[0])
        if not needed:
            return
        for closed, entries in needed.items():
            aside = os.path.join(scratch, str(len(os.listdir(scratch))))
            os.mkdir(aside)
            _mount(["--bind", closed, aside])  # the directory as it is, for its entries
            _mount(["-t", "tmpfs", "-o", "mode=755", "tmpfs", closed])
            for entry in entries:
                target = os.path.join(closed, entry)
                if os.path.isdir(os.path.join(aside, entry)):
                    os.mkdir(target)
                else:
                    open(target, "w").close()
                _mount(["--bind", os.path.join(aside, entry), target])


def _mount(args: list[str]) -> None:
    subprocess.run(["mount", *args], check=True)


def main(argv: list[str]) -> None:
    uid, dirs = int(argv[0]), json.loads(argv[1])
    command = argv[argv.index("--") + 1 :]
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    open_the_way([sys.executable, os.path.realpath(sys.executable), here, command[0]])
    for directory in dirs:
        with open(os.path.join(directory, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
