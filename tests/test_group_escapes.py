"""A handler running as root tries to lift the limits of its own control group: raise its
``pids.max``, lift its memory limit, move itself out of its group, remount the hierarchy
read-write, or mount it afresh in namespaces of its own. In a cgroup mode every one of
these is refused by the kernel (skipped, saying why, where the machine has no writable
groups or the test does not run as root)."""

from __future__ import annotations

import logging
import os
import pwd
from concurrent.futures import Future
from typing import Any

import pytest

from sandboxq import Pool
from sandboxq.models import Outcome
from sandboxq.pool.attempt import AttemptResult
from sandboxq.pool.containment import probe
from sandboxq.pool.privileges import GROUP_OWNER_UID

E = "sandboxq.testing.escapes:"
MODE, WHY = probe()
pytestmark = [
    pytest.mark.skipif(MODE == "process_tree", reason=f"no writable control groups: {WHY}"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the escapes need root"),
]


def attempt(pool: Pool, *args: object) -> AttemptResult:
    done: Future[AttemptResult] = Future()
    pool.execute(pool.make_task(*args), done.set_result)
    return done.result(timeout=60)


def value(pool: Pool, *args: object) -> Any:
    return pool.submit(*args).result(timeout=60)


@pytest.mark.timeout(60)
def test_a_root_handler_cannot_raise_its_own_pids_max(pid_namespace: bool) -> None:
    with Pool(
        E + "raise_pids_max", 1, hard_timeout_s=30, pid_namespace=pid_namespace, max_processes=20
    ) as pool:
        got = value(pool, 100)
    assert got["wrote"] != "ok", "the handler raised its own pids.max"
    assert got["forked"] < 20, f"{got['forked']} forks under max_processes=20"


@pytest.mark.timeout(60)
def test_a_root_handler_cannot_lift_its_own_memory_limit(pid_namespace: bool) -> None:
    with Pool(
        E + "raise_memory_limit",
        1,
        hard_timeout_s=30,
        pid_namespace=pid_namespace,
        max_memory_mb=100,
    ) as pool:
        result = attempt(pool, 300)
    assert result.outcome is Outcome.MEMORY_LIMIT, (result.outcome, result.cause)


@pytest.mark.timeout(60)
def test_a_root_handler_cannot_move_itself_out_of_its_group(pid_namespace: bool) -> None:
    with Pool(E + "leave_group", 1, hard_timeout_s=30, pid_namespace=pid_namespace) as pool:
        got = value(pool)
    assert got["moved"] != "ok" and got["still_in"], got


@pytest.mark.timeout(60)
def test_a_root_handler_cannot_remount_the_groups_read_write(pid_namespace: bool) -> None:
    with Pool(
        E + "remount_groups_rw", 1, hard_timeout_s=30, pid_namespace=pid_namespace, max_processes=20
    ) as pool:
        got = value(pool)
    assert got["remount"] != "ok" and got["wrote"] != "ok", got


@pytest.mark.timeout(60)
def test_a_root_handler_cannot_write_its_group_through_a_mount_of_its_own(
    pid_namespace: bool,
) -> None:
    with Pool(
        E + "userns_cgroup_mount",
        1,
        hard_timeout_s=30,
        pid_namespace=pid_namespace,
        max_processes=20,
    ) as pool:
        got = value(pool)
    assert got["wrote"] != "ok", got


def _write_as(uid: int, path: str, value: str) -> str:
    """Write ``value`` to ``path`` from a process of ``uid`` (no capabilities): "ok", or
    the error's strerror."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            with open(path, "w") as f:
                f.write(value)
            said = "ok"
        except OSError as exc:
            said = exc.strerror or str(exc)
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    os.waitpid(pid, 0)
    return said


@pytest.mark.timeout(60)
def test_no_other_process_on_the_machine_can_write_a_root_childs_group() -> None:
    """The group files of a child that runs as root belong to a uid nobody runs as: they
    belonged to ``nobody`` (65534), and any process of that user on the machine (a daemon,
    another pool's children run with ``user="nobody"``) lifted the child's limits."""
    with Pool(E + "call", 1, hard_timeout_s=30, max_processes=10) as pool:
        dirs = value(pool, "group_dirs")
        pids_dir = dirs.get("pids", dirs.get("unified", ""))
        assert os.stat(os.path.join(pids_dir, "pids.max")).st_uid == GROUP_OWNER_UID
        for uid in (65534, 1000):
            said = _write_as(uid, os.path.join(pids_dir, "pids.max"), "max")
            assert said == "Permission denied", (uid, said)
        assert value(pool, "raise_pids_max", 40)["forked"] < 10  # the limit is still there
    with pytest.raises(KeyError):
        pwd.getpwuid(GROUP_OWNER_UID)  # no account has it


@pytest.mark.timeout(60)
def test_the_child_runs_with_no_capabilities_and_no_new_privileges(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="sandboxq.pool"), Pool(E + "what_am_i", 1) as pool:
        got = value(pool)
        shown = pool.protections
    assert int(got["cap_eff"], 16) == 0 and int(got["cap_bnd"], 16) == 0, got
    assert got["no_new_privs"] == "1", got
    assert got["uid"] == 0  # still root: no user= given
    assert "read-only cgroup mounts" in shown and "no capabilities" in shown
    assert f"group files owned by uid {GROUP_OWNER_UID}" in shown
    said = [r.getMessage() for r in caplog.records if "protections" in r.getMessage()]
    assert said == [f"containment protections: {', '.join(shown)}"]  # once, at start


@pytest.mark.timeout(60)
def test_the_worker_parts_keep_their_capabilities() -> None:
    # The supervisor goes on limiting and killing the groups: it still can after a child
    # dropped everything (a memory limit set per attempt, a kill at the hard timeout).
    with Pool(E + "call", 1, hard_timeout_s=1, max_memory_mb=64) as pool:
        result = attempt(pool, "raise_memory_limit", 200)
        assert result.outcome is Outcome.MEMORY_LIMIT, result.cause
        assert value(pool, "raise_pids_max", 3)["forked"] == 3  # the replacement works
