"""The public surface: the names users import from ``sandboxq`` are a contract.

Adding a name means adding it here; removing or renaming one breaks users and must be a
decision, not an accident of a refactor.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import sandboxq

PUBLIC = {
    "Action",
    "AttemptFailed",
    "BackendError",
    "BackendUnreachable",
    "CodecRefused",
    "ConfigError",
    "DamagedRecord",
    "Job",
    "JobFailed",
    "JobNotFound",
    "JobState",
    "Outcome",
    "Pool",
    "PoolBroken",
    "ProcessorError",
    "Queue",
    "SandboxWorker",
    "SandboxqError",
    "SerializationError",
    "SoftTimeout",
    "WorkerFailed",
    "current_job",
}


def test_the_public_names_are_exactly_the_contract() -> None:
    assert set(sandboxq.__all__) == PUBLIC
    assert len(sandboxq.__all__) == len(PUBLIC), "a name is listed twice"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_name_resolves_to_its_defining_object(name: str) -> None:
    value = getattr(sandboxq, name)
    assert value is not None
    # classes and functions are the real ones, not stand-ins re-exported under the name
    assert getattr(value, "__name__", name) == name


def test_errors_derive_from_the_one_root() -> None:
    errors = [
        getattr(sandboxq, n)
        for n in PUBLIC
        if isinstance(getattr(sandboxq, n), type) and issubclass(getattr(sandboxq, n), Exception)
    ]
    outside = {e.__name__ for e in errors if not issubclass(e, sandboxq.SandboxqError)}
    assert outside == {"SoftTimeout"}  # raised inside handlers: an ordinary Exception


@pytest.mark.timeout(30)
def test_a_producer_import_loads_no_process_machinery() -> None:
    code = (
        "import sys, sandboxq\n"
        "q = sandboxq.Queue('names', 'memory://')\n"
        "q.enqueue(1)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('multiprocess', 'sandboxq.pool'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.timeout(30)
def test_the_fork_server_preloads_no_pydantic() -> None:
    """Every pool waits for its fork server, which imports the child's module (and
    forkserver_hooks) before the first child: pydantic was two thirds of that import."""
    code = (
        "import sys, sandboxq.pool.child, sandboxq.pool.forkserver_hooks\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'redis')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
