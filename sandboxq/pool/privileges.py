"""What a child gives up before any of its user's code runs, so that a handler cannot
lift its own limits, even as root.

    pool start (parent): plan(cgroup mode?, Asked: user, group, network, PID namespace)
                         ──► Privileges, protections in words
    spawn (parent):      the child's group created, its files chowned to GROUP_OWNER_UID
                         when the child will run as root (cgroups.Group.create)
    child start:         (pid_namespace=True: into a PID namespace of its own, with
                         ``own_proc``: pid_namespace.py)
                         limits.enter ─► join its group ─► rlimits ─► drop(privileges):
                           1. a mount namespace of its own, in which every cgroup mount is
                              read-only (a write there fails with EROFS)
                           2. the capability bounding set emptied (no exec can get one back)
                           3. supplementary groups, gid, uid set (``user=``/``group=``)
                           4. every remaining capability dropped, PR_SET_NO_NEW_PRIVS set
                         ─► setsid, subreaper, parent-death signal ─► import the processor

Why each part, against a handler that runs as root:

- Its group's files were the child's to write (root owns them): it raised its own
  ``pids.max`` and memory limit, and wrote its pid into another group's ``cgroup.procs``.
  The read-only mounts refuse every such write, and without ``CAP_SYS_ADMIN`` it cannot
  remount them read-write or mount the hierarchy anew.
- A user namespace needs no capability: in one of its own, a root handler is root again
  over the files its uid owns, and can mount the hierarchy afresh (rooted at its own group,
  through a cgroup namespace). So its group's files are owned by another uid
  (``GROUP_OWNER_UID``, unmapped in any namespace it can make) and the handler, with no
  ``CAP_DAC_OVERRIDE``/``CAP_FOWNER``/``CAP_CHOWN``/``CAP_SETUID`` left, can neither
  write nor take them over.
- Without ``CAP_SYS_PTRACE`` it cannot reach the worker's, the fork server's or the
  guard's mount namespace through ``/proc/<pid>/root`` (the kernel refuses a process
  whose capabilities are not a superset of its target's).
- ``PR_SET_NO_NEW_PRIVS``: no set-user-id program or file capability gives any of it back.

The parent's processes keep their capabilities: they create, limit and kill the groups.
"""

from __future__ import annotations

import contextlib
import ctypes
import grp
import os
import pwd
import sys
from collections.abc import Callable
from dataclasses import dataclass

from sandboxq.errors import ConfigError

#: The owner of a child's group files when the child runs as root: a uid no process runs
#: as. It is never mapped into a user namespace the child makes (the child may map only its
#: own uid), so no capability of such a namespace covers them. Not ``nobody`` (65534):
#: daemons run as it, and so may another pool's children (``user="nobody"``), and any of
#: them could write these files. 2147483646 lies in the range systemd's uid layout leaves
#: unassigned (1879048192-2147483647: above the container ranges, below 2^31); ``user=``
#: refuses it.
GROUP_OWNER_UID = 2147483646

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWUSER = 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_SLAVE = 32, 4096, 16384, 1 << 19
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MOUNT_FLAGS = {
    "ro": _MS_RDONLY,
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": _MS_NOATIME,
    "nodiratime": _MS_NODIRATIME,
    "relatime": _MS_RELATIME,
}
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_CAPABILITY_VERSION_3 = 0x20080522


@dataclass(frozen=True, slots=True)
class Privileges:
    """What a child gives up at start (handed over with its ``ChildSetup``)."""

    #: (mount point, its per-mount flags) of each cgroup mount, remounted read-only in a
    #: mount namespace of the child's own; empty: no mount namespace.
    read_only: tuple[tuple[str, int], ...] = ()
    #: Empty the capability sets (the bounding set included) and set no_new_privs.
    drop_capabilities: bool = False
    uid: int | None = None
    gid: int | None = None
    #: A network namespace of its own, with loopback only (``network=False``).
    no_network: bool = False
    #: The child runs in a PID namespace of its own, with its /proc (pid_namespace.py).
    pid_namespace: bool = False


#: A child that keeps what the worker has.
NO_CHANGE = Privileges()


@dataclass(frozen=True, slots=True)
class Asked:
    """What the pool's settings ask of its children (``plan`` says what they get)."""

    uid: int | None = None  # None: the worker's own
    gid: int | None = None
    network: bool = True  # False: loopback only
    pid_namespace: bool = False  # True: a PID namespace per child, or an error


#: The settings' defaults: the worker's user, a network, the worker's PID namespace.
DEFAULT_ASK = Asked()


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int, what: str) -> None:
    """unshare(2); raises ``OSError`` naming ``what`` when the kernel refuses."""
    assert _libc is not None
    _check(_libc.unshare(flags), what)


def _prctl(option: int, value: int, arg3: int = 0) -> None:
    assert _libc is not None
    _check(_libc.prctl(option, value, arg3, 0, 0), f"prctl({option})")


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def undumpable() -> None:
    """This process's memory out of reach of its siblings: the kernel gives
    ``/proc/<pid>/mem`` and ptrace of a process of the same user to one without
    CAP_SYS_PTRACE (a child: it has none) only while the target is dumpable. Any process
    may set the flag back on itself, and an opened ``mem`` stays usable: so the child
    clears it at start and after each attempt (limits.py). The parent keeps its access
    (CAP_SYS_PTRACE as root; the world-readable files of ``/proc/<pid>`` otherwise), and so
    does the child to its own ``/proc/self``."""
    _prctl(_PR_SET_DUMPABLE, 0)


def drop(privileges: Privileges) -> None:
    """Give up what ``privileges`` names; in the child, before its processor is imported.
    Raises ``OSError`` naming the step that failed (the child then exits: a child that
    could not be confined must not run anything)."""
    if _libc is None:
        return
    if privileges.no_network:
        unshare(_CLONE_NEWNET, "unshare(CLONE_NEWNET)")
        _loopback_up()
    if privileges.read_only:
        _read_only_groups(privileges.read_only)
    if privileges.drop_capabilities:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
        for cap in range(last + 1):
            _prctl(_PR_CAPBSET_DROP, cap)
        with contextlib.suppress(OSError):  # no ambient capabilities before Linux 4.3
            _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    if privileges.gid is not None:
        os.setgroups([privileges.gid])
        os.setresgid(privileges.gid, privileges.gid, privileges.gid)
    if privileges.uid is not None:
        os.setresuid(privileges.uid, privileges.uid, privileges.uid)
        # A change of uid makes the process undumpable: its /proc files would turn root's,
        # out of its own reach (its descriptors, its status).
        _prctl(_PR_SET_DUMPABLE, 1)
    if privileges.drop_capabilities:
        data = (_CapData * 2)()
        _check(_libc.capset(ctypes.byref(_CapHeader(_CAPABILITY_VERSION_3, 0)), data), "capset")
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)


def _loopback_up() -> None:
    """A new network namespace has ``lo``, down: bring it up (SIOCSIFFLAGS)."""
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s.fileno(), siocgifflags, request))[1]
        fcntl.ioctl(s.fileno(), siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


def _own_mounts() -> None:
    """A mount namespace of the caller's own."""
    assert _libc is not None
    unshare(_CLONE_NEWNS, "unshare(CLONE_NEWNS)")
    # Slave: mounts made on the machine still reach us; nothing we change goes back.
    _check(_libc.mount(None, b"/", None, ctypes.c_ulong(_MS_REC | _MS_SLAVE), None), "mount /")


def _read_only_groups(mounts: tuple[tuple[str, int], ...]) -> None:
    assert _libc is not None
    _own_mounts()
    for point, flags in mounts:
        flags |= _MS_BIND | _MS_REMOUNT | _MS_RDONLY
        _check(
            _libc.mount(None, point.encode(), None, ctypes.c_ulong(flags), None),
            f"remount {point} read-only",
        )


# -- the parent's side --------------------------------------------------------------------------


def cgroup_mounts(mountinfo: str = "/proc/self/mountinfo") -> tuple[tuple[str, int], ...]:
    """(mount point, per-mount flags) of every cgroup mount, and of the directories they
    are mounted in (``/sys/fs/cgroup``'s tmpfs: no new mount point can be made there)."""
    found: dict[str, int] = {}
    points: dict[str, tuple[str, int]] = {}  # mount id -> (point, flags)
    parents: dict[str, str] = {}
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) < 6 or not rest:
                continue
            flags = 0
            for option in fields[5].split(","):
                flags |= _MOUNT_FLAGS.get(option, 0)
            points[fields[0]] = (_unescape(fields[4]), flags)
            if rest[0] in ("cgroup", "cgroup2"):
                found[_unescape(fields[4])] = flags
                parents[fields[0]] = fields[1]
    for parent in set(parents.values()):
        if parent in points and points[parent][0] != "/":
            found.setdefault(*points[parent])
    # Parents first: a remount of the tmpfs must not hide the cgroup mounts below it.
    return tuple(sorted(found.items()))


def _unescape(path: str) -> str:
    return path.encode().decode("unicode_escape") if "\\" in path else path


def resolve_user(user: str | int | None, group: str | int | None) -> tuple[int | None, int | None]:
    """(uid, gid) for the ``user`` and ``group`` settings, looked up once at start. A user
    given alone runs with its own primary group. Raises ``ConfigError`` naming the one
    that does not exist here, or when the worker cannot change to them (not root)."""
    uid = gid = None
    user = int(user) if isinstance(user, str) and user.isdecimal() else user
    group = int(group) if isinstance(group, str) and group.isdecimal() else group
    if user is not None:
        try:
            entry = pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(user)
        except KeyError:
            raise ConfigError(f"user={user!r}: no such user on this machine") from None
        uid, gid = entry.pw_uid, entry.pw_gid
        if uid == GROUP_OWNER_UID:
            raise ConfigError(
                f"user={user!r}: uid {uid} owns the control group files of children that "
                "run as root, out of their reach; run the children as another user"
            )
    if group is not None:
        try:
            gid = (grp.getgrgid(group) if isinstance(group, int) else grp.getgrnam(group)).gr_gid
        except KeyError:
            raise ConfigError(f"group={group!r}: no such group on this machine") from None
    other = uid not in (None, os.geteuid()) or gid not in (None, os.getegid())
    if other and os.geteuid() != 0:
        raise ConfigError(
            f"user={user!r} group={group!r}: only a worker running as root can run its "
            f"children as another user (this one runs as uid {os.geteuid()})"
        )
    return uid, gid


def plan(
    cgroups: bool, asked: Asked = DEFAULT_ASK
) -> tuple[Privileges, int | None, tuple[str, ...]]:
    """What children give up, the uid their group files must be owned by (None: leave
    them as created), and the protections in force, in words (logged once, shown in the
    worker record). Raises ``ConfigError`` when ``network=False`` or ``pid_namespace``
    cannot be had here."""
    uid, gid, network = asked.uid, asked.gid, asked.network
    root = os.geteuid() == 0
    not_root = f"the worker runs as uid {os.geteuid()}"
    protections: list[str] = []
    if asked.pid_namespace:
        if refused := pid_namespace_refused():
            how = "root with CAP_SYS_ADMIN" if root else "user namespaces open to users"
            raise ConfigError(
                f"pid_namespace=True needs a PID namespace per child with a /proc of its "
                f"own, which this machine refuses: {refused} (it needs {how})"
            )
        protections.append("a PID namespace per child" + ("" if root else " (in a user namespace)"))
    if not network:
        if refused := _refused(_unshare_probe(_CLONE_NEWNET)) if root else not_root:
            raise ConfigError(
                f"network=False needs a network namespace per child, which this machine "
                f"refuses: {refused} (it needs root with CAP_SYS_ADMIN)"
            )
        protections.append("loopback-only network")
    changes_user = uid is not None or gid is not None
    if changes_user:
        shown_uid = uid if uid is not None else os.geteuid()
        shown_gid = gid if gid is not None else os.getegid()
        protections.append(f"uid {shown_uid} gid {shown_gid}")
    if not root or not (cgroups or changes_user or not network):
        if cgroups:
            # The groups were delegated to the worker's uid, which the child shares: its
            # own files stay writable to it.
            protections.append("group files writable by the child (not run as root)")
        return Privileges(pid_namespace=asked.pid_namespace), None, tuple(protections)
    read_only = cgroup_mounts() if cgroups else ()
    owner = GROUP_OWNER_UID if cgroups and uid in (None, 0) else None
    if read_only and (refused := _refused(_unshare_probe(_CLONE_NEWNS))):
        read_only = ()
        protections.append(f"cgroup mounts writable (no mount namespace: {refused})")
    elif read_only:
        protections.append("read-only cgroup mounts")
    if owner is not None:
        protections.append(f"group files owned by uid {owner}")
    protections += ["no capabilities", "no_new_privs"]
    given_up = Privileges(read_only, True, uid, gid, not network, asked.pid_namespace)
    return given_up, owner, tuple(protections)


def _refused(attempt: Callable[[], None]) -> str | None:
    """Why the kernel refuses ``attempt`` (None: it allows it), tried in a forked process
    that does nothing else; ``attempt`` raises ``OSError`` when refused."""
    if _libc is None:
        return "not Linux"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the forked probe
        try:
            attempt()
            code = 0
        except OSError as exc:
            code = exc.errno or 1
        os.write(w, bytes([min(code, 255)]))
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        answer = f.read(1)
    os.waitpid(pid, 0)
    code = answer[0] if answer else 255
    return None if code == 0 else os.strerror(code)


def pid_namespace_refused() -> str | None:
    """Why this machine refuses children PID namespaces of their own (None: it allows
    them): tried as a child does it, in a forked process."""
    return _refused(_pid_namespace_probe)


def _unshare_probe(flags: int) -> Callable[[], None]:
    return lambda: unshare(flags, f"unshare({flags:#x})")


def _pid_namespace_probe() -> None:
    """What a child does to enter its PID namespace (pid_namespace.py), up to the fork of
    the handler's process: a new namespace, its first process, its /proc."""
    new_pid_namespace()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the namespace's first process
        try:
            own_proc()
            code = 0
        except OSError as exc:
            code = exc.errno or 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if code := os.waitstatus_to_exitcode(status):
        raise OSError(code if code > 0 else 1, "in a new PID namespace")


def new_pid_namespace() -> None:
    """A PID namespace for the caller's children (the caller stays where it is): with
    root's ``CAP_SYS_ADMIN``, else inside a user namespace of the caller's own, in which
    its uid and gid stay what they are and stand for themselves alone (the kernel lets any
    user make one, where it is not restricted). Needs a single-threaded caller."""
    if os.geteuid() == 0:
        unshare(_CLONE_NEWPID, "unshare(CLONE_NEWPID)")
        return
    uid, gid = os.geteuid(), os.getegid()
    unshare(_CLONE_NEWUSER | _CLONE_NEWPID, "unshare(CLONE_NEWUSER | CLONE_NEWPID)")
    for name, line in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def own_proc() -> None:
    """In the first process of a new PID namespace: a mount namespace of its own, whose
    ``/proc`` shows that PID namespace (its pids, its processes only)."""
    assert _libc is not None
    _own_mounts()
    flags = ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    _check(_libc.mount(b"proc", b"/proc", b"proc", flags, None), "mount /proc")
