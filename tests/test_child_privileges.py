"""``user=``, ``group=`` and ``network=False``: the children drop to the user and group
before they import the processor, and run in a network namespace with loopback only;
settings that cannot be had here are refused at start, naming why."""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxq import ConfigError, Pool

E = "sandboxq.testing.escapes:"
S = "sandboxq.testing.siblings:"
IDENTITY = str(importlib.util.find_spec("sandboxq.testing.identity").origin)  # type: ignore[union-attr]
SIBLINGS = str(importlib.util.find_spec("sandboxq.testing.siblings").origin)  # type: ignore[union-attr]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="changing a child's ids needs root")


@needs_root
@pytest.mark.timeout(60)
def test_a_group_is_dropped_to_before_the_processor_is_imported() -> None:
    with Pool("sandboxq.testing.identity:imported_as", 1, group="nogroup") as pool:
        at_import, at_run = pool.submit().result(timeout=30)
        assert "uid 0 gid 65534" in pool.protections
    assert at_import == at_run == [0, 65534, [65534]]


@needs_root
@pytest.mark.timeout(60)
def test_a_user_is_dropped_to_before_the_processor_is_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody on this machine")
    # The checkout (and this Python) may sit below a directory only root may enter, and
    # the child imports its processor once it runs as nobody: a copy any user can read,
    # under a name of its own, so that no other pool has imported it into a fork server.
    where = Path(tempfile.mkdtemp(dir="/tmp"))
    where.chmod(0o755)
    shutil.copy(IDENTITY, where / "identity_as_nobody.py")
    (where / "identity_as_nobody.py").chmod(0o644)
    monkeypatch.syspath_prepend(str(where))
    try:
        with Pool("identity_as_nobody:imported_as", 1, user="nobody") as pool:
            at_import, at_run = pool.submit().result(timeout=30)
    finally:
        shutil.rmtree(where)
    nobody = pwd.getpwnam("nobody")
    assert at_import == at_run == [nobody.pw_uid, nobody.pw_gid, [nobody.pw_gid]]


@needs_root
@pytest.mark.timeout(60)
def test_no_network_leaves_loopback_only() -> None:
    with Pool(E + "call", 1, network=False) as pool:
        assert pool.submit("what_am_i").result(timeout=30)["interfaces"] == ["lo"]
        reach = pool.submit("network_reach").result(timeout=30)
        assert "loopback-only network" in pool.protections
    assert reach["loopback"] == "ok"
    assert reach["outside"] == "Network is unreachable", reach


@pytest.mark.timeout(30)
def test_unknown_users_and_groups_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="user='no-such-user-here': no such user"):
        Pool(E + "what_am_i", 1, user="no-such-user-here")
    with pytest.raises(ConfigError, match="group='no-such-group-here': no such group"):
        Pool(E + "what_am_i", 1, group="no-such-group-here")
    with pytest.raises(ConfigError, match="user"):
        Pool(E + "what_am_i", 1, user="")


@pytest.mark.timeout(60)
def test_no_network_where_the_kernel_refuses_it_is_an_error_naming_why() -> None:
    # Root, but without capabilities (a container's usual root): no namespace is allowed.
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv(1) to start a worker without capabilities")
    script = (
        "from sandboxq import Pool, ConfigError\n"
        "try:\n"
        "    Pool('sandboxq.testing.handlers:echo', 1, network=False, containment='process_tree')\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [setpriv, "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert "network=False needs a network namespace" in done.stdout, done.stderr
    assert "Operation not permitted" in done.stdout


@pytest.fixture
def siblings_any_user_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The siblings module as ``siblings_anyone:``, in a directory any user may read (the
    checkout may sit below one only root may enter), under a name no fork server has
    preloaded."""
    where = Path(tempfile.mkdtemp(dir="/tmp"))
    where.chmod(0o755)
    shutil.copy(SIBLINGS, where / "siblings_anyone.py")
    (where / "siblings_anyone.py").chmod(0o644)
    monkeypatch.syspath_prepend(str(where))
    yield "siblings_anyone:"
    shutil.rmtree(where)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("containment", "user"), [("cgroup", None), ("process_tree", "nobody")], ids=str
)
def test_a_child_cannot_read_another_childs_memory(
    containment: str, user: str | None, siblings_any_user_reads: str
) -> None:
    """Children run as one user (root without capabilities in a cgroup mode, or ``user=``):
    a handler opened a sibling's ``/proc/<pid>/mem`` and read another job's data (it could
    have written it too). Each child is undumpable, which the kernel's ptrace check holds
    against a process without CAP_SYS_PTRACE. (A root child in process-tree mode keeps
    root's capabilities, this one among them: the README says so.)"""
    if os.geteuid() != 0:
        pytest.skip("control groups and user= need root here")
    barriers = Path(tempfile.mkdtemp(dir="/tmp"))  # where any user's children may write
    barriers.chmod(0o777)
    path = str(barriers / "secret")
    try:
        with Pool(siblings_any_user_reads + "call", 2, containment=containment, user=user) as pool:
            holder = pool.submit("hold_secret", path)
            reader = pool.submit("read_secret", path)
            assert holder.result(timeout=30) == "another job's secret"
            assert reader.result(timeout=30) == {"read": "Permission denied"}
    finally:
        shutil.rmtree(barriers)


@pytest.mark.timeout(60)
def test_no_attempt_keeps_the_dumpable_flag_an_earlier_one_set() -> None:
    """Any process may make itself dumpable again: one attempt that did would leave the
    next ones in that child readable by their siblings."""
    with Pool(S + "call", 1) as pool:
        child, flag = pool.submit("dumpable").result(timeout=30)
        assert flag == 0
        assert pool.submit("become_dumpable").result(timeout=30) == [child, 1]
        assert pool.submit("dumpable").result(timeout=30) == [child, 0]  # the same child
    with Pool(S + "call", 1, core_dumps=True) as pool:
        # a core dump needs it: with core_dumps the children stay dumpable
        assert pool.submit("dumpable").result(timeout=30)[1] == 1
