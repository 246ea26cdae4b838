"""Resolve a processor path ("pkg.mod:fn" or "pkg.mod:Class.method") to a callable."""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from functools import cache
from typing import Any

from sandboxq.errors import ProcessorError


def split_path(path: str) -> tuple[str, str]:
    """Split "pkg.mod:fn" into module and attribute, or raise a ProcessorError saying why."""
    module, sep, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not sep or not module or not attr:
        raise ProcessorError(
            f"processor {path!r} is not of the form 'package.module:function'", processor=path
        )
    return module, attr


@cache
def resolve(path: str) -> Callable[..., Any]:
    """Import the processor named by ``path`` (cached per process)."""
    module_name, attr = split_path(path)
    try:
        obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # SyntaxError, an error raised at import...
        detail = "".join(traceback.format_exception_only(exc)).strip()
        raise ProcessorError(
            f"processor {path!r}: cannot import module {module_name!r}: {detail}", processor=path
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ProcessorError(
                f"processor {path!r}: {module_name!r} has no attribute {attr!r}", processor=path
            ) from None
    if not callable(obj):
        raise ProcessorError(
            f"processor {path!r} is a {type(obj).__name__}, not a callable", processor=path
        )
    return obj  # type: ignore[no-any-return]
