"""Kernel containment against real hostile handlers: in the cgroup mode this machine
allows (skipped, saying why, where it allows none) and in the process-tree mode, forced.

Daemonised grandchildren and setsid helpers die with their attempt, a fork bomb meets the
pids limit, the memory limit is the kernel's, rlimits bound CPU time and core files, the
fallback is loud, and no control group outlives its pool."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import psutil
import pytest

from sandboxq import ConfigError, Pool
from sandboxq.models import Outcome
from sandboxq.pool import cgroups
from sandboxq.pool.attempt import AttemptResult
from sandboxq.pool.containment import detect, probe
from sandboxq.pool.limits import ChildSetup
from sandboxq.testing.processes import still_running
from sandboxq.testing.waiting import wait_for

H = "sandboxq.testing.handlers:"
MODE, WHY = probe()
CGROUPS = MODE != "process_tree"
needs_cgroups = pytest.mark.skipif(not CGROUPS, reason=f"no writable control groups: {WHY}")
#: For the tests that look at the v1 hierarchies' directories themselves.
needs_cgroup_v1 = pytest.mark.skipif(MODE != "cgroup_v1", reason=f"not in cgroup v1 mode: {WHY}")


def attempt(pool: Pool, *args: object) -> AttemptResult:
    done: Future[AttemptResult] = Future()
    pool.execute(pool.make_task(*args), done.set_result)
    return done.result(timeout=30)


def alive_after(pids: list[int], grace_s: float) -> list[int]:
    deadline = time.monotonic() + grace_s
    while (left := still_running(pids)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


@pytest.fixture(autouse=True)
def kill_recorded(tmp_path: Path) -> Iterator[None]:
    """Kill what a handler recorded and a failing (or expected-to-fail) test left alive."""
    yield
    pid_file = tmp_path / "pids"
    for pid in still_running(
        [int(p) for p in pid_file.read_text().split()] if pid_file.exists() else []
    ):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def recorded(pid_file: Path) -> list[int]:
    pids = [int(p) for p in pid_file.read_text().split()]
    assert pids, "the handler recorded no process"
    return pids


# -- nothing an attempt starts outlives it ---------------------------------------------------


@pytest.mark.timeout(30)
def test_a_daemonized_grandchild_dies_at_the_hard_kill(containment: str, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    with Pool(H + "daemonize_grandchild", 1, hard_timeout_s=0.5, containment=containment) as pool:
        result = attempt(pool, str(pid_file), "hang")
        assert result.outcome is Outcome.HARD_TIMEOUT, result.cause
        assert not alive_after(recorded(pid_file), 2.0), "the daemon outlived the hard kill"


@pytest.mark.timeout(30)
def test_a_setsid_helper_dies_at_the_hard_kill(containment: str, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    with Pool(H + "setsid_grandchild_hang", 1, hard_timeout_s=0.5, containment=containment) as p:
        assert attempt(p, str(pid_file)).outcome is Outcome.HARD_TIMEOUT
        assert not alive_after(recorded(pid_file), 2.0), "the helper outlived the hard kill"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("handler", "args"),
    [("daemonize_grandchild", ("return",)), ("session_helper", ("return",))],
    ids=["daemon", "setsid_helper"],
)
def test_leftovers_are_dead_when_a_normal_return_is_reported(
    containment: str, handler: str, args: tuple[object, ...], tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    with Pool(H + handler, 1, hard_timeout_s=10, containment=containment) as pool:
        child = pool.pids[0]
        for _ in range(2):
            result = attempt(pool, str(pid_file), *args)
            assert result.outcome is Outcome.OK, result.cause
            # No grace: the child swept its group before it reported the outcome.
            assert not still_running(recorded(pid_file)), "a leftover outlived its attempt"
        assert pool.pids == [child]  # the same child went on serving


# -- limits -----------------------------------------------------------------------------------


@needs_cgroups
@pytest.mark.timeout(30)
def test_a_fork_bomb_meets_the_pids_limit_and_the_pool_lives() -> None:
    with Pool(H + "fork_bomb_until_refused", 1, hard_timeout_s=15, max_processes=40) as pool:
        for _ in range(2):  # the second proves the pool, and the group, are usable again
            result = attempt(pool, 10_000)
            assert result.outcome is Outcome.ERROR, result.cause
            assert result.error is not None and result.error.type_name.endswith("ForkRefused")
            assert "after" in result.error.message  # "... after N processes"


@needs_cgroups
@pytest.mark.timeout(30)
def test_a_job_over_its_memory_limit_is_oom_killed_by_the_kernel() -> None:
    with Pool(H + "grow_memory", 1, hard_timeout_s=20, max_memory_mb=96) as pool:
        result = attempt(pool, 16, 0.001)
        assert result.outcome is Outcome.MEMORY_LIMIT, result.cause
        assert result.signal == signal.SIGKILL
        assert "OOM-killed" in result.cause  # the kernel's counter, not a sampled guess


@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", ["return", "raise"])
def test_a_grandchild_over_the_memory_limit_ends_the_attempt_as_memory_limit(
    containment: str, then: str
) -> None:
    """Whichever mode: the kernel OOM-kills the grandchild in a group (the handler then
    answers), the sampler kills the tree in the process-tree mode."""
    grows = "tests.support.grandchild_memory:grandchild_grows"
    with Pool(grows, 1, hard_timeout_s=20, max_memory_mb=64, containment=containment) as pool:
        result = attempt(pool, 256, then)
        assert result.outcome is Outcome.MEMORY_LIMIT, result.cause
        assert pool.submit(1, "return", 0).result(timeout=30) == 0  # the pool goes on


@needs_cgroups
@pytest.mark.timeout(60)
def test_threads_an_attempt_left_do_not_use_up_the_next_attempts_processes() -> None:
    """The pids limit counts threads: a child still holding an attempt's threads would
    refuse every later attempt's fork. It is replaced instead (test_boundary.py)."""
    with Pool("tests.support.leftover_threads:call", 1, max_processes=32) as pool:
        started = pool.submit("leave_threads_to_the_limit").result(timeout=30)
        assert 0 < started < 32
        assert pool.submit("fork_and_wait").result(timeout=30) == 0


@pytest.mark.timeout(30)
def test_cpu_time_s_ends_a_spinning_attempt_as_cpu_limit(containment: str) -> None:
    with Pool(H + "cpu_spin", 1, hard_timeout_s=20, cpu_time_s=1, containment=containment) as p:
        result = attempt(p)
        assert result.outcome is Outcome.CPU_LIMIT, result.cause
        assert result.signal == signal.SIGXCPU
        assert result.runtime_s is not None and result.runtime_s < 15


@pytest.mark.timeout(40)
def test_the_cpu_budget_is_per_attempt_in_a_reused_child() -> None:
    # Three attempts of 0.6 s of CPU each under a 1 s budget: over 1 s in all, but each
    # attempt starts with a fresh budget.
    with Pool(H + "spin_gil_for", 1, hard_timeout_s=20, cpu_time_s=1) as pool:
        child = pool.pids[0]
        for _ in range(3):
            result = attempt(pool, 0.6)
            assert result.outcome is Outcome.OK, result.cause
        assert pool.pids == [child]


@pytest.mark.timeout(30)
def test_a_crash_leaves_no_core_file(
    containment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The core would land in the child's working directory (core_pattern "core" here);
    # spawn starts the child from this process, so it inherits the raised soft limit.
    monkeypatch.chdir(tmp_path)
    old = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (old[1], old[1]))
    try:
        with Pool(H + "abort", 1, start_method="spawn", containment=containment) as pool:
            result = attempt(pool)
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, old)
    assert result.outcome is Outcome.CRASHED and result.signal == signal.SIGABRT
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("core")]


# -- choosing the mode, and leaving nothing behind ------------------------------------------


@pytest.mark.timeout(30)
def test_forcing_the_process_tree_mode_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sandboxq.pool"):
        with Pool(H + "echo", 1, containment="process_tree") as pool:
            assert pool.containment == "process_tree"
            assert pool.submit(3).result(timeout=10) == 3
    assert "containment: process_tree (forced by the containment setting)" in caplog.text


def _unwritable_hierarchies(tmp_path: Path) -> tuple[str, str]:
    """A mountinfo whose cgroup hierarchies are plain directories, as a container without
    delegated groups shows them: mkdir works there, but makes no group."""
    lines, own = [], ["0::/"]
    for n, controller in enumerate(cgroups.V1_CONTROLLERS, 1):
        mount = tmp_path / "fs" / controller
        mount.mkdir(parents=True)
        lines.append(f"{30 + n} 1 0:{n} / {mount} rw - cgroup cgroup rw,{controller}")
        own.append(f"{n}:{controller}:/")
    (tmp_path / "mountinfo").write_text("\n".join(lines) + "\n")
    (tmp_path / "cgroup").write_text("\n".join(own) + "\n")
    return str(tmp_path / "mountinfo"), str(tmp_path / "cgroup")


def test_the_fallback_is_loud_where_groups_are_not_writable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mountinfo, own = _unwritable_hierarchies(tmp_path)
    with caplog.at_level(logging.WARNING, logger="sandboxq.pool"):
        chosen = detect("auto", ChildSetup(), 64, mountinfo=mountinfo, own_cgroups=own)
    assert chosen.mode == "process_tree"
    assert "control groups are not writable here" in caplog.text
    assert "is not a control group hierarchy" in caplog.text  # says why
    assert not [p for p in tmp_path.rglob("sandboxq.*")]  # its probe left nothing
    with pytest.raises(ConfigError, match="containment='cgroup' but no control groups"):
        detect("cgroup", ChildSetup(), 64, mountinfo=mountinfo, own_cgroups=own)


def _pool_group_dirs() -> list[Path]:
    """This process's pool groups, in every v1 hierarchy."""
    return _owned_by(os.getpid())


@needs_cgroup_v1
@pytest.mark.timeout(30)
def test_groups_are_gone_after_close_and_stale_ones_are_removed_at_start(tmp_path: Path) -> None:
    # A dead pool's groups: our pid, but a start time that is not ours (a reused pid).
    stale = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            if c in cgroups.V1_CONTROLLERS:
                d = Path(
                    "/sys/fs/cgroup", c, path.lstrip("/"), f"{cgroups.PREFIX}{os.getpid()}.1.1"
                )
                (d / "child-7").mkdir(parents=True)
                stale.append(d)
    pid_file = tmp_path / "pids"
    with Pool(H + "setsid_grandchild_hang", 2, soft_timeout_s=0.2, hard_timeout_s=5) as pool:
        assert pool.containment == MODE
        assert not [d for d in stale if d.exists()], "stale groups survived the start"
        live = [d for d in _pool_group_dirs() if d not in stale]
        assert live and all(any(d.glob("child-*")) for d in live)
        assert attempt(pool, str(pid_file)).outcome is Outcome.SOFT_TIMEOUT
        assert not still_running(recorded(pid_file)), "a helper outlived its soft-timed-out attempt"
    assert not _pool_group_dirs(), "control groups outlived the pool"
    assert not alive_after(recorded(pid_file), 2.0)


@needs_cgroup_v1
@pytest.mark.timeout(30)
def test_two_pools_of_one_process_have_groups_of_their_own() -> None:
    with Pool(H + "echo", 1) as first:
        with Pool(H + "echo", 1) as second:
            assert second.submit(2).result(timeout=10) == 2
        assert first.submit(1).result(timeout=10) == 1  # closing the other took nothing of it
        assert len(_pool_group_dirs()) == 3  # one pool group per v1 hierarchy


def _v2_dir() -> Path | None:
    """This process's cgroup2 directory, if there is one we can create groups in."""
    from sandboxq.pool.containment import _below, _mounts, _own_paths

    v2 = [
        (root, point) for root, point, fs, _ in _mounts("/proc/self/mountinfo") if fs == "cgroup2"
    ]
    own = _own_paths("/proc/self/cgroup")
    if not v2 or "" not in own:
        return None
    here = Path(_below(*v2[0], own[""]))
    return here if os.access(here, os.W_OK) and (here / "cgroup.procs").exists() else None


@pytest.mark.timeout(30)
@pytest.mark.skipif(_v2_dir() is None, reason="no writable cgroup2 hierarchy")
def test_a_v2_group_kill_takes_a_daemon_that_left_the_tree(tmp_path: Path) -> None:
    # The cgroup v2 kill (cgroup.kill), joined as a child joins (limits.enter); even where
    # v2 lacks the memory and pids controllers cgroup mode needs, the kill can be checked.
    here = _v2_dir()
    assert here is not None
    group = cgroups.Group.create(2, {"unified": str(here / f"sandboxq-test-{os.getpid()}")}, None)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the "child": never returns into pytest
        try:
            from sandboxq.pool.limits import enter

            enter(ChildSetup(procs_files=group.procs_files))
            daemon = subprocess.Popen(["sleep", "60"], start_new_session=True)
            os.write(w, f"{daemon.pid}".encode())
            os.close(w)
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        daemon_pid = int(f.read())
    try:
        assert sorted(group.pids()) == sorted([pid, daemon_pid])
        group.kill()
        os.waitpid(pid, 0)
        assert not alive_after([daemon_pid], 2.0)
    finally:
        deadline = time.monotonic() + 5
        while not group.remove() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not Path(group.dirs["unified"]).exists()


def _owned_by(pid: int) -> list[Path]:
    return [d for d in _all_pool_group_dirs() if d.name.startswith(f"{cgroups.PREFIX}{pid}.")]


def _all_pool_group_dirs() -> list[Path]:
    found = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            if c in cgroups.V1_CONTROLLERS:
                found += Path("/sys/fs/cgroup", c, path.lstrip("/")).glob(cgroups.PREFIX + "*")
    return found


@needs_cgroup_v1
@pytest.mark.timeout(60)
def test_a_sigkilled_owners_groups_are_removed_by_the_next_pool(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    script = (
        "import time\n"
        "from sandboxq import Pool\n"
        f"pool = Pool({H + 'daemonize_grandchild'!r}, 1)\n"
        f"pool.submit({str(pid_file)!r}, 'hang')\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 30, "the daemon")
        assert _owned_by(owner.pid)
        # The owner's fence guard removes its groups when the owner dies: here the guard
        # dies first (the worker and all its helpers killed), the owner stopped meanwhile
        # so that it cannot start another guard.
        owner.send_signal(signal.SIGSTOP)
        wait_for(lambda: psutil.Process(owner.pid).status() == psutil.STATUS_STOPPED, 10, "stop")
        guards = [
            p
            for p in psutil.Process(owner.pid).children()
            if "sandboxq.pool.guard_process" in " ".join(p.cmdline())
        ]
        assert guards, "the owner's fence guard was not found"
        for guard in guards:
            guard.kill()
        # Dead, but a zombie until its stopped owner reaps it: waiting for it to be gone
        # would wait the whole timeout.
        wait_for(lambda: not still_running(g.pid for g in guards), 10, "the guard to die")
    finally:
        owner.kill()
        owner.wait()
    assert _owned_by(owner.pid), "expected the SIGKILLed owner's groups to be left behind"
    with Pool(H + "echo", 1) as pool:
        assert pool.submit(1).result(timeout=10) == 1
        assert not _owned_by(owner.pid), "a dead owner's groups survived the next start"
    assert not alive_after(recorded(pid_file), 2.0)


def test_bad_containment_settings_are_refused_with_the_setting_named() -> None:
    with pytest.raises(ConfigError, match="containment: Input should be 'auto'"):
        Pool(H + "echo", 1, containment="jail")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cpu_time_s: Value error, must be a positive"):
        Pool(H + "echo", 1, cpu_time_s=-1)
    with pytest.raises(ConfigError, match=r"max_address_space_mb \(64\) is below max_memory_mb"):
        Pool(H + "echo", 1, max_memory_mb=128, max_address_space_mb=64)


@needs_cgroups
@pytest.mark.timeout(30)
def test_the_mode_in_force_is_logged_once_at_start(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sandboxq.pool"):
        with Pool(H + "echo", 2) as pool:
            assert pool.submit(1).result(timeout=10) == 1
    lines = [r.getMessage() for r in caplog.records if "containment:" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"containment: {MODE} (groups under ")
