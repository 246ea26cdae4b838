"""Processor paths: a path that does not lead to a callable fails ``Pool(...)`` and
``SandboxWorker(...)`` at once with a ``ProcessorError`` that names the path and why
(missing module or attribute, not callable, syntax error, an exception at import); a
module that hangs at import fails them after ``import_timeout_s``, and never reaches the
fork server, so the next pool of the process still starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxq import ConfigError, Pool, ProcessorError
from sandboxq.processor import IMPORT_TIMEOUT_ENV
from sandboxq.testing.waiting import wait_for
from sandboxq.worker import SandboxWorker

from .support import H

pytestmark = pytest.mark.timeout(60)

MakeModule = Callable[[str], str]


@pytest.fixture
def make_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MakeModule:
    """Write a module with ``source`` in a directory on sys.path; returns its (fresh) name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(source: str) -> str:
        name = f"sq_test_processor_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return make


Build = Callable[[str], object]


def build_pool(path: str) -> object:
    with Pool(path, 1, import_timeout_s=2) as pool:  # only reached if the path resolves
        return pool


def build_worker(path: str) -> object:
    return SandboxWorker("bad-processors", path, url="memory://", import_timeout_s=2)


BUILDERS = pytest.mark.parametrize("build", [build_pool, build_worker], ids=["pool", "worker"])


@BUILDERS
@pytest.mark.parametrize(
    ("source", "attr", "needle"),
    [
        (None, "fn", "cannot import its module: ModuleNotFoundError: there is no module of"),
        ("def fn(): pass\n", "nope", "has no attribute 'nope'"),
        ("def fn(): pass\n", "fn.inner", "'fn' has no attribute 'inner'"),
        ("fn = 42\n", "fn", "is an int, not a callable"),
        ("import os\n", "os", "is a module, not a callable"),
        ("def fn(:\n", "fn", "SyntaxError"),
        ("raise RuntimeError('boom at import')\n", "fn", "RuntimeError: boom at import"),
        ("import sys\nsys.exit(3)\n", "fn", "cannot import its module"),
        ("raise KeyboardInterrupt\n", "fn", "KeyboardInterrupt"),
        ("import no_such_dependency_xyz\n", "fn", "No module named 'no_such_dependency_xyz'"),
    ],
)
def test_a_processor_that_cannot_be_used_fails_at_start_naming_why(
    make_module: MakeModule, build: Build, source: str | None, attr: str, needle: str
) -> None:
    module = "sq_no_such_module" if source is None else make_module(source)
    path = f"{module}:{attr}"
    with pytest.raises(ProcessorError) as refused:
        build(path)
    assert f"processor {path!r}" in str(refused.value)
    assert needle in str(refused.value)
    assert refused.value.processor == path


@BUILDERS
@pytest.mark.parametrize(
    "path",
    [
        "a" * 100_000 + ":f",  # no such module
        "a" * 100_000 + "/x.py:f",  # not a path, with a hint how to write it
        H + "b" * 100_000,  # no such attribute
    ],
    ids=["module", "file", "attribute"],
)
def test_a_100_kb_processor_path_is_named_once_clipped(build: Build, path: str) -> None:
    with pytest.raises(ProcessorError) as refused:
        build(path)
    message = str(refused.value)
    assert message.startswith(f"processor {path[:40]!r}"[:-1]), message[:200]
    assert len(message) < 600 and message.count("a" * 40 + "…") <= 1, message
    assert refused.value.processor == path


@pytest.mark.parametrize(
    ("path", "hint"),
    [
        ("jobs/thumbs.py:make", "with dots: 'jobs.thumbs:make'"),
        ("./jobs/thumbs.py:make", "with dots: 'jobs.thumbs:make'"),
        ("thumbs.py:make", "with dots: 'thumbs:make'"),
        ("/srv/app/thumbs.py:make", "with dots: 'package.module'"),  # its root is unknown
    ],
)
def test_a_module_named_as_a_file_is_refused_saying_how_to_name_it(path: str, hint: str) -> None:
    with pytest.raises(ProcessorError) as refused:
        build_worker(path)
    assert f"processor {path!r}" in str(refused.value) and hint in str(refused.value)


def test_a_syntax_error_names_the_file_and_line(make_module: MakeModule) -> None:
    module = make_module("x = 1\ndef fn(:\n    pass\n")
    with pytest.raises(ProcessorError, match=rf"{module}\.py.*line 2") as refused:
        build_worker(f"{module}:fn")
    assert "SyntaxError" in str(refused.value)


# -- random paths: a callable or a ProcessorError, never anything else ---------------------

_garbage = st.text(alphabet=":. ab_-/\\{}\u00e9\x00", max_size=12)
_missing = st.text(alphabet="abcxyz_", min_size=1, max_size=8).map(lambda s: f"sq_no_such_{s}")
_attrs = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.", min_size=0, max_size=12)
paths = (
    _garbage
    | st.builds(lambda m, a: f"{m}:{a}", _missing | _garbage, _attrs | _garbage)
    | _attrs.map(lambda a: f"sandboxq.testing.handlers:{a}")
)


@settings(deadline=None, max_examples=150)
@given(path=paths)
def test_any_processor_path_resolves_or_is_refused_by_name(path: str) -> None:
    try:
        worker = SandboxWorker("bad-processors", path, url="memory://", import_timeout_s=5)
    except ProcessorError as exc:  # ":f" and "" too: by its form, not its length
        assert f"processor {path!r}" in str(exc)
        return
    assert worker.settings.processor == path  # it resolved to a callable


# -- a module that hangs at import -----------------------------------------------------------

HANGS = """
    import os, time
    # stands for a module that waits at import for a lock, the network or input()
    while not os.path.exists({flag!r}):
        time.sleep(0.05)

    def fn():
        return "imported at last"
"""


def _import_threads(module: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"sandboxq-import-{module}"]


def test_a_module_that_hangs_at_import_fails_after_the_import_timeout(
    make_module: MakeModule, tmp_path: Path
) -> None:
    flag = tmp_path / "release"
    module = make_module(HANGS.format(flag=str(flag)))
    path = f"{module}:fn"
    try:
        for build in (
            lambda: Pool(path, 1, import_timeout_s=1),
            lambda: SandboxWorker("q", path, url="memory://", import_timeout_s=1),
        ):
            started = time.monotonic()
            with pytest.raises(ProcessorError) as refused:
                build()
            took = time.monotonic() - started
            assert 1 <= took < 10, took
            assert "importing its module did not finish within 1 s" in str(refused.value)
        # the second attempt waited on the first import; it did not start another
        assert len(_import_threads(module)) == 1
    finally:
        flag.touch()  # let the import finish, so no thread outlives the test
    wait_for(lambda: not _import_threads(module), 10, "the import thread to finish")
    # once the module imports, the same path works
    worker = SandboxWorker("q", path, url="memory://", import_timeout_s=1)
    assert worker.settings.processor == path


def test_the_import_timeout_comes_from_the_environment(
    make_module: MakeModule, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = tmp_path / "release"
    module = make_module(HANGS.format(flag=str(flag)))
    monkeypatch.setenv(IMPORT_TIMEOUT_ENV, "0.5")
    try:
        with pytest.raises(ProcessorError, match=r"did not finish within 0\.5 s"):
            SandboxWorker("q", f"{module}:fn", url="memory://")
    finally:
        flag.touch()
    wait_for(lambda: not _import_threads(module), 10, "the import thread to finish")
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv(IMPORT_TIMEOUT_ENV, bad)
        with pytest.raises(ConfigError, match=f"{IMPORT_TIMEOUT_ENV}={bad!r} is not a positive"):
            SandboxWorker("q", H + "no_such_handler", url="memory://")


#: A module that imports at once in the process named by $SQ_TEST_IMPORTER, and hangs in any
#: other (the pool's fork server, which preloads it) until ``flag`` exists: a module that
#: reads sys.argv, a lock file or the network at import can do so.
HANGS_ELSEWHERE = """
    import os, time
    while os.environ.get("SQ_TEST_IMPORTER") != str(os.getpid()):
        if os.path.exists({flag!r}):
            break
        time.sleep(0.05)

    def fn():
        return os.getpid()
"""

#: Run in a process of its own, so that its fork server is fresh and preloads the module.
FORK_SERVER_HANGS = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
os.environ["SQ_TEST_IMPORTER"] = str(os.getpid())
from sandboxq import Pool, ProcessorError
from sandboxq.worker import SandboxWorker

path = sys.argv[2] + ":fn"
for build in (
    lambda: Pool(path, 1, import_timeout_s=1),
    lambda: SandboxWorker("q", path, url="memory://", import_timeout_s=1).run(),
):
    started = time.monotonic()
    try:
        build()
    except ProcessorError as exc:
        print(f"refused after {time.monotonic() - started:.1f} s: {exc}", flush=True)
open(sys.argv[3], "w").close()
with Pool(path, 1, import_timeout_s=5) as pool:
    print("then ran in", "another process" if pool.submit().result(30) != os.getpid() else "?")
"""


@pytest.mark.timeout(60)
def test_a_fork_server_that_hangs_importing_the_processor_fails_the_start_after_the_timeout(
    make_module: MakeModule, tmp_path: Path
) -> None:
    """The worker's own import of the module finished; the fork server's preload of it
    hung. import_timeout_s did not apply there: the pool (and the worker) waited for the
    fork server for ever, and a worker ignored SIGTERM and SIGINT until the import ended."""
    flag = tmp_path / "release"
    module = make_module(HANGS_ELSEWHERE.format(flag=str(flag)))
    try:
        out = subprocess.run(
            [sys.executable, "-c", FORK_SERVER_HANGS, str(tmp_path), module, str(flag)],
            capture_output=True,
            text=True,
            timeout=50,
            check=False,
        )
    finally:
        flag.touch()
    assert out.returncode == 0, out.stderr[-3000:]
    refusals = [line for line in out.stdout.splitlines() if line.startswith("refused")]
    assert len(refusals) == 2, out.stdout + out.stderr[-3000:]
    for line in refusals:
        took = float(line.split()[2])
        assert 1 <= took < 10, line
        assert "fork server" in line and "within 1 s (import_timeout_s)" in line, line
    assert out.stdout.splitlines()[-1] == "then ran in another process", out.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_worker_signalled_while_its_fork_server_hangs_importing_stops(
    make_module: MakeModule, tmp_path: Path, redis_url: str, signum: int
) -> None:
    flag = tmp_path / "release"
    module = make_module(HANGS_ELSEWHERE.format(flag=str(flag)))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    worker = f"exec {sys.executable} -m sandboxq worker {module} {module}:fn --url {redis_url}"
    proc = subprocess.Popen(
        ["sh", "-c", f"SQ_TEST_IMPORTER=$$ {worker}"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: any(
                "forkserver" in " ".join(c.cmdline()) and module in " ".join(c.cmdline())
                for c in psutil.Process(proc.pid).children()
            ),
            20,
            "the worker's fork server to preload the module",
        )
        asked = time.monotonic()
        os.kill(proc.pid, signum)
        proc.wait(10)
        assert time.monotonic() - asked < 3
    finally:
        flag.touch()
        if proc.poll() is None:
            proc.kill()
        stderr = proc.communicate(timeout=30)[1]
    assert "Traceback" not in stderr, stderr


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "5", 10**6])
def test_a_bad_import_timeout_is_refused_by_name(value: object) -> None:
    with pytest.raises(ConfigError, match="import_timeout_s"):
        SandboxWorker("q", H + "echo", url="memory://", import_timeout_s=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="import_timeout_s"):
        Pool(H + "echo", 1, import_timeout_s=value)  # type: ignore[arg-type]


def test_a_hung_import_never_reaches_the_fork_server(
    make_module: MakeModule, tmp_path: Path
) -> None:
    """In a fresh process (so the fork server is not started yet): the hanging module is
    refused, and the next pool starts and runs. Had the module been put on the fork
    server's preload list, the fork server would hang importing it, and with it every
    child any later pool asks for. The process then exits although the import thread
    still hangs."""
    flag = tmp_path / "never"
    module = make_module(HANGS.format(flag=str(flag)))
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from sandboxq import Pool, ProcessorError
        try:
            Pool("{module}:fn", 1, import_timeout_s=1)
        except ProcessorError as exc:
            print("refused:", exc, flush=True)
        with Pool("{H}echo", 1) as pool:
            print("ran:", pool.submit(7).result(timeout=30), flush=True)
        """
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused:") and "did not finish within 1 s" in lines[0]
    assert lines[1] == "ran: 7"
    assert time.monotonic() - started < 45
