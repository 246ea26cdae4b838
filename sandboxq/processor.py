"""Resolve a processor path ("pkg.mod:fn" or "pkg.mod:Class.method") to a callable.

Two callers, two ways:

    parent (Pool, SandboxWorker) ── resolve_within(path, timeout_s)
        the import runs on a daemon thread; the caller waits at most timeout_s
        (import_timeout_s, else $SANDBOXQ_IMPORT_TIMEOUT_S, else 60 s), then gets a
        ProcessorError. A module that hangs at import (a network call, a lock,
        input()) can neither hang the worker's start nor the CLI: the thread is left
        behind, blocked, and a later call waits on that same import instead of
        starting another. The module is only added to the fork server's preload list
        after it imported here, so a hanging module never reaches the fork server
        (which would then hang every child it is asked to start).
    child ── resolve(path)
        imports on its own main thread, as any program would.

Caveat of the parent's thread: module-level code that only works on the main thread
(``signal.signal``) fails there with its own error; do such set-up inside the function.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import threading
import traceback
from collections.abc import Callable
from functools import cache
from pathlib import PurePosixPath
from types import ModuleType
from typing import Any

from sandboxq.codec import with_article
from sandboxq.errors import ConfigError, ProcessorError
from sandboxq.text import clip

#: How long the parent lets a processor module import before giving up on it.
DEFAULT_IMPORT_TIMEOUT_S = 60.0
#: Overrides DEFAULT_IMPORT_TIMEOUT_S wherever no ``import_timeout_s`` is given.
IMPORT_TIMEOUT_ENV = "SANDBOXQ_IMPORT_TIMEOUT_S"


def shown(path: str) -> str:
    """``path`` as an error names it, once: quoted, on one line, clipped (a caller may
    pass anything: a 100 KB path was echoed whole, three times in one error). Whole when
    it fits: ``clip`` would also fold the runs of spaces a bad path may be made of."""
    quoted = repr(path)
    return quoted if len(quoted) <= 80 else clip(quoted, 80)


def split_path(path: str) -> tuple[str, str]:
    """Split "pkg.mod:fn" into module and attribute, or raise a ProcessorError saying why."""
    module, sep, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    names = [*module.split("."), *attr.split(".")]  # "pkg.mod:Class.method" is a path too
    if not sep or not all(name.isidentifier() for name in names):
        raise ProcessorError(
            f"processor {shown(path)} is not of the form 'package.module:function'"
            f"{_file_path_hint(module, path)}",
            processor=path,
        )
    return module, attr


def default_import_timeout_s() -> float:
    """``$SANDBOXQ_IMPORT_TIMEOUT_S`` if set (and a positive number), else 60 s."""
    raw = os.environ.get(IMPORT_TIMEOUT_ENV, "").strip()
    if not raw:  # unset or empty: as every other SANDBOXQ_ variable (settings.from_env)
        return DEFAULT_IMPORT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{IMPORT_TIMEOUT_ENV}={raw!r} is not a positive number of seconds")
    return value


@cache
def resolve(path: str) -> Callable[..., Any]:
    """Import the processor named by ``path`` on this thread (cached per process)."""
    module_name, attr = split_path(path)
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # SyntaxError, an error raised at import...
        raise _import_error(path, module_name, exc) from exc
    return _lookup(path, module, module_name, attr)


_resolved: dict[str, Callable[..., Any]] = {}
_imports: dict[str, _Import] = {}  # module name -> its import, while it may still run
_imports_lock = threading.Lock()


def resolve_within(path: str, timeout_s: float | None = None) -> Callable[..., Any]:
    """Import the processor named by ``path``, giving up after ``timeout_s`` seconds
    (``None``: ``default_import_timeout_s()``) with a ProcessorError that says so."""
    if path in _resolved:
        return _resolved[path]
    module_name, attr = split_path(path)
    limit = default_import_timeout_s() if timeout_s is None else timeout_s
    module = sys.modules.get(module_name)
    if module is None or getattr(module.__spec__, "_initializing", False):
        module = _import_on_thread(path, module_name, limit)
    found = _resolved[path] = _lookup(path, module, module_name, attr)
    return found


class _Import:
    """One import of a module, on its own daemon thread."""

    def __init__(self, module_name: str) -> None:
        self.module_name = module_name
        self.done = threading.Event()
        self.module: ModuleType | None = None
        self.error: BaseException | None = None
        thread = threading.Thread(
            target=self._run, name=f"sandboxq-import-{module_name}", daemon=True
        )
        thread.start()

    def _run(self) -> None:
        try:
            self.module = importlib.import_module(self.module_name)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt at import too
            self.error = exc
        finally:
            self.done.set()


def _import_on_thread(path: str, module_name: str, timeout_s: float) -> ModuleType:
    with _imports_lock:
        running = _imports.get(module_name)
        if running is None or running.done.is_set():  # a failed import is tried afresh
            running = _imports[module_name] = _Import(module_name)
    if not running.done.wait(timeout_s):
        raise ProcessorError(
            f"processor {shown(path)}: importing its module did not finish within "
            f"{timeout_s:g} s: does its top level wait for something (a lock, the network, "
            f"input())? A slow import can be given longer with import_timeout_s or "
            f"${IMPORT_TIMEOUT_ENV}",
            processor=path,
        )
    if running.error is not None:
        raise _import_error(path, module_name, running.error) from running.error
    assert running.module is not None
    return running.module


def _import_error(path: str, module_name: str, exc: BaseException) -> ProcessorError:
    if isinstance(exc, ModuleNotFoundError) and exc.name == module_name:
        # its message would name the module, which the path named already
        detail = "ModuleNotFoundError: there is no module of that name"
    else:  # what the module's own import raised: a SyntaxError, a missing dependency
        detail = clip("".join(traceback.format_exception_only(exc)), 300)
    return ProcessorError(
        f"processor {shown(path)}: cannot import its module: {detail}"
        f"{_file_path_hint(module_name, path)}",
        processor=path,
    )


def _file_path_hint(module_name: str, path: str) -> str:
    """What to write instead when the module was named as a file ("jobs/thumbs.py")."""
    if "/" not in module_name and not module_name.endswith(".py"):
        return ""
    parts = PurePosixPath(module_name.removesuffix(".py")).parts
    dotted = ".".join(part for part in parts if part != ".")
    suggested = f"{dotted}:{path.partition(':')[2]}"
    # Where it imports from is unknown; or the suggestion is too long to show whole (a
    # clipped one would be the value the error named already, a second time).
    if module_name.startswith("/") or ".." in parts or shown(suggested) != repr(suggested):
        suggested = "package.module"
    return f" (a module is named as Python imports it, with dots: {suggested!r})"


def _lookup(path: str, module: ModuleType, module_name: str, attr: str) -> Callable[..., Any]:
    obj: Any = module
    walked: list[str] = []  # what the next part is looked up on: the module, 'Cls', ...
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            # named within the path the error names already, not as a second copy of it
            on = shown(".".join(walked)) if walked else "its module"
            raise ProcessorError(
                f"processor {shown(path)}: {on} has no attribute {shown(part)}",
                processor=path,
            ) from None
        walked.append(part)
    if not callable(obj):
        raise ProcessorError(
            f"processor {shown(path)} is {with_article(type(obj).__name__)}, not a callable",
            processor=path,
        )
    return obj  # type: ignore[no-any-return]
