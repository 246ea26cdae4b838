"""Handlers that try to lift the limits of their own control group (they run as whatever
user the child runs as: root, on most containers). Each returns what it managed, so a
test sees both that the attempt was refused and that the refusal is the kernel's.

Use them as processors by path, e.g. ``"sandboxq.testing.escapes:raise_pids_max"``.

| handler                 | protected child (cgroup mode)            | unprotected child (root) |
|-------------------------|------------------------------------------|--------------------------|
| raise_pids_max(n)       | ``{"wrote": <error>, "forked": < limit}``| ``wrote: "ok"``, n forks  |
| raise_memory_limit(mb)  | ``memory_limit`` (the write was refused) | ok: ``mb`` MB held       |
| leave_group()           | ``{"moved": <error>, "still_in": True}`` | moved out of its group   |
| remount_groups_rw()     | ``{"remount": <error>}``                 | ``"ok"``                 |
| userns_cgroup_mount()   | ``{"wrote": <error>}`` (files not ours)  | ``"ok"`` (userns allowed) |
| group_dirs()            | its group's directories, by controller                          |
| what_am_i()             | uid, gid, capabilities, no_new_privs, netns interfaces            |
| network_reach()         | loopback ``ok``; outside: the error a connection meets            |

An error is reported as its ``strerror`` (``"Read-only file system"``,
``"Permission denied"``, ...).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from typing import Any

from sandboxq.pool.containment import _below, _mounts, _own_paths

_libc = ctypes.CDLL(None, use_errno=True)


def _group_dirs() -> dict[str, str]:
    """controller -> this process's group directory, for each v1 controller mounted (v2:
    "unified")."""
    own = _own_paths("/proc/self/cgroup")
    found: dict[str, str] = {}
    for root, point, fs, options in _mounts("/proc/self/mountinfo"):
        if fs == "cgroup2" and "" in own:
            found.setdefault("unified", _below(root, point, own[""]))
        for name in ("memory", "pids", "freezer"):
            if fs == "cgroup" and name in options and name in own:
                found.setdefault(name, _below(root, point, own[name]))
    return found


def _try(action: Any) -> str:
    try:
        action()
    except OSError as exc:
        return exc.strerror or str(exc)
    return "ok"


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _pids_file() -> tuple[str, str]:
    dirs = _group_dirs()
    pids_dir = dirs.get("pids", dirs.get("unified", ""))
    return pids_dir, os.path.join(pids_dir, "pids.max")


def group_dirs() -> dict[str, str]:
    """Its own group's directories, by controller ("pids", "memory", "freezer"; "unified"
    on cgroup v2), as paths on the machine."""
    return _group_dirs()


def raise_pids_max(count: int = 100) -> dict[str, Any]:
    """Writes ``max`` into its own group's ``pids.max``, then forks ``count`` sleepers
    (killed and reaped before it returns); returns how many forks succeeded."""
    _, pids_max = _pids_file()
    wrote = _try(lambda: _write(pids_max, "max"))
    forked = []
    try:
        for _ in range(count):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            forked.append(pid)
    finally:
        for pid in forked:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in forked:
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)
    return {"wrote": wrote, "forked": len(forked)}


def raise_memory_limit(mb: int = 300) -> dict[str, Any]:
    """Lifts its own group's memory limit, then holds ``mb`` MB (touched page by page)."""
    dirs = _group_dirs()
    if "memory" in dirs:
        path, unlimited = os.path.join(dirs["memory"], "memory.limit_in_bytes"), "-1"
    else:
        path, unlimited = os.path.join(dirs.get("unified", ""), "memory.max"), "max"
    wrote = _try(lambda: _write(path, unlimited))
    held = bytearray(mb * 2**20)
    for i in range(0, len(held), 4096):
        held[i] = 1
    return {"wrote": wrote, "held_mb": len(held) // 2**20}


def leave_group() -> dict[str, Any]:
    """Writes its pid into the root group of each hierarchy (out of its own group)."""
    before = _read("/proc/self/cgroup")
    moved = {}
    for _, point, fs, _ in _mounts("/proc/self/mountinfo"):
        if fs in ("cgroup", "cgroup2"):
            moved[point] = _try(lambda p=point: _write(os.path.join(p, "cgroup.procs"), "0"))
    after = _read("/proc/self/cgroup")
    refused = [why for why in moved.values() if why != "ok"]
    return {"moved": refused[0] if refused else "ok", "still_in": before == after}


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str) -> None:
    if (
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        )
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


_MS_REMOUNT, _MS_BIND = 32, 4096


def remount_groups_rw() -> dict[str, Any]:
    """Remounts its pids hierarchy read-write, then writes its own ``pids.max``."""
    point = next(
        p for _, p, fs, o in _mounts("/proc/self/mountinfo") if "pids" in o or fs == "cgroup2"
    )
    remount = _try(lambda: _mount(None, point, None, _MS_REMOUNT | _MS_BIND, ""))
    _, pids_max = _pids_file()
    return {"remount": remount, "wrote": _try(lambda: _write(pids_max, "max"))}


_CLONE_NEWNS, _CLONE_NEWCGROUP, _CLONE_NEWUSER = 0x20000, 0x02000000, 0x10000000


def _unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def userns_cgroup_mount() -> dict[str, Any]:
    """In a user namespace of its own (mapping its uid to root there) and a cgroup
    namespace rooted at its group, mounts the pids hierarchy afresh and writes
    ``pids.max`` through it. Forks first, so its own namespaces stay as they were."""
    uid, gid = os.getuid(), os.getgid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        outcome = "ok"
        try:
            _unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWCGROUP)
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
            target = "/tmp" if os.path.isdir("/tmp") else "/"
            _mount("none", target, "tmpfs", 0, "")
            point = os.path.join(target, "pids")
            os.mkdir(point)
            _mount("cgroup", point, "cgroup", 0, "pids")
            _write(os.path.join(point, "pids.max"), "max")
        except OSError as exc:
            outcome = exc.strerror or str(exc)
        os.write(w, outcome.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        outcome = f.read().decode()
    os.waitpid(pid, 0)
    return {"wrote": outcome}


def what_am_i() -> dict[str, Any]:
    """The credentials and namespaces this handler runs with."""
    status = dict(
        line.split(":", 1) for line in _read("/proc/self/status").splitlines() if ":" in line
    )
    return {
        "uid": os.getuid(),
        "gid": os.getgid(),
        "groups": os.getgroups(),
        "cap_eff": status["CapEff"].strip(),
        "cap_bnd": status["CapBnd"].strip(),
        "no_new_privs": status.get("NoNewPrivs", "").strip(),
        "interfaces": sorted(name for _, name in socket_if_names()),
    }


def network_reach(port: int = 9) -> dict[str, Any]:
    """Whether a TCP connection over loopback works (to a listener of its own), and what a
    connection to an outside address (192.0.2.1, TEST-NET-1) meets at once."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname(), timeout=5):
            loopback = "ok"
    try:
        with socket.create_connection(("192.0.2.1", port), timeout=0.5):
            outside = "ok"
    except OSError as exc:
        outside = exc.strerror or type(exc).__name__
    return {"loopback": loopback, "outside": outside}


def socket_if_names() -> list[tuple[int, str]]:
    import socket

    return list(socket.if_nameindex())


def call(name: str, *args: Any) -> Any:
    """Run the handler ``name`` of this module (one pool, several escapes)."""
    return globals()[name](*args)
