"""What several verbs share: common flags, flags made from settings, the URL check, the
working directory on the import path, and ``Exit`` (a failure the user caused or asked
about, not a bug).

A setting's flag is made from its field in settings.py, so nothing here restates one:

    field name  lease_s           ─► --lease-s (dest lease_s)
    annotation  float | None      ─► type=float; a Literal gives choices; bool store_true
    description, default, "none"  ─► help "… (default: 30 s)"

Every such flag defaults to None ("not given"), so ``settings.from_env`` can let it win
over its ``SANDBOXQ_*`` variable, and the variable over the model's default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import NoneType, UnionType
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from sandboxq.backends import URL_ENV, resolve_url
from sandboxq.errors import ConfigError

if TYPE_CHECKING:
    from sandboxq.client import Queue

#: Exit statuses, shared by every verb (documented in ``sandboxq --help``).
EXIT_OK = 0
EXIT_FAILED = 1  # the job(s) failed, or there was nothing to retry / cancel
EXIT_ERROR = 2  # bad input or settings, unreachable backend, unimportable processor
EXIT_TIMEOUT = 3  # ``enqueue --wait --timeout-s`` ran out before the job finished
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (128 + SIGINT, as shells report it)
EXIT_RESULTS_UNREAD = 141  # ``sandboxq run``'s stdout closed by its reader (128 + SIGPIPE)


class Exit(Exception):
    """End the command with ``code`` after printing ``message`` (one line) on stderr."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def add_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", help=f"Redis URL, e.g. redis://localhost:6379/0 (default: ${URL_ENV})"
    )


def add_allow_pickle(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="decode pickled results (only if every writer to this Redis is trusted: "
        "unpickling runs code)",
    )


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON, for scripts")


def shared_url(url: str | None) -> str:
    """The URL of a backend other processes can reach: every verb but ``run`` needs one.

    ``memory://`` lives inside one process, so a worker or a second command on it would
    see an empty queue forever; that is refused here rather than left to puzzle a user.
    """
    url = resolve_url(url)
    if url.startswith("memory://"):
        raise ConfigError(
            f"no Redis URL: pass --url redis://host:port/db or set ${URL_ENV} "
            "(memory:// lives inside one process; `sandboxq run` is the local batch mode)"
        )
    return url


@contextmanager
def open_queue(args: argparse.Namespace) -> Iterator[Queue]:
    from sandboxq.client import Queue

    allow_pickle = bool(getattr(args, "allow_pickle", False))
    queue = Queue(args.queue, url=shared_url(args.url), allow_pickle=allow_pickle)
    try:
        yield queue
    finally:
        queue.close()


def import_from_cwd() -> None:
    """Let ``myapp.jobs:fn`` name a module of the current directory, as ``python -m``
    would. The installed ``sandboxq`` script starts with its own directory on the path
    instead; the pool's fork server adopts this path, so the children find it too."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def parse_json(flag: str, text: str | None, expected: type, example: str) -> Any:
    """The value of a JSON flag (``--args``, ``--kwargs``), checked for its type."""
    if text is None:
        return expected()
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} is not valid JSON ({exc}); e.g. {flag} '{example}'") from None
    except RecursionError:
        raise ConfigError(
            f"{flag} is nested too deeply to be read as JSON; e.g. {flag} '{example}'"
        ) from None
    if not isinstance(value, expected):
        raise ConfigError(
            f"{flag} must be a JSON {json_type(expected)}, got {json_type(type(value))}; "
            f"e.g. {flag} '{example}'"
        )
    return value


def bounded(kind: type[int] | type[float], low: float, high: float) -> Callable[[str], Any]:
    """The argparse ``type`` of a number flag that is no setting (``enqueue --timeout-s``,
    ``jobs --limit``): a ``kind`` from ``low`` to ``high``. Anything else (NaN included)
    is argparse's usage error, naming the flag and the value given, before the command
    does anything."""
    what = "a whole number" if kind is int else "a number"
    span = " to ".join(str(int(b)) if float(b).is_integer() else str(b) for b in (low, high))

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {what} from {span}, got {text!r:.40}")
        return value

    return parse


def checked(check: Callable[[str], str]) -> Callable[[str], str]:
    """The argparse ``type`` of a word one of the models' checks takes (``check_job_id``):
    what it refuses is argparse's usage error, one line naming the argument."""

    def parse(text: str) -> str:
        try:
            return check(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def json_type(python_type: type) -> str:
    """What JSON calls a Python type, for error messages."""
    names = {list: "array", dict: "object", str: "string", bool: "boolean", type(None): "null"}
    return names.get(python_type, "number")


# -- flags made from settings ---------------------------------------------------------------

#: A setting's unit, by the suffix of its name (style: durations ``*_s``, sizes ``*_mb``).
UNITS = {"_s": "seconds", "_mb": "MB", "_bytes": "bytes"}


def unit(name: str) -> str:
    return next((u for suffix, u in UNITS.items() if name.endswith(suffix)), "")


def default_text(name: str, field: FieldInfo) -> str:
    """A setting's default as a person reads it: ``30 seconds``, ``off``, ``one per CPU``."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    extra = field.json_schema_extra
    if value is None and isinstance(extra, dict) and isinstance(extra.get("none"), str):
        return str(extra["none"])  # what the default None stands for
    if isinstance(value, bool):
        return "on" if value else "off"
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{text} {unit(name)}".strip()


def value_type(field: FieldInfo) -> Any:
    """The type a value of the setting has, without None: ``float | None`` -> float."""
    annotation = field.annotation
    if get_origin(annotation) in (Union, UnionType):
        annotation = next(a for a in get_args(annotation) if a is not NoneType)
    return annotation


def flag_help(name: str, field: FieldInfo, repeatable: bool = False) -> str:
    more = " (repeatable)" if repeatable else ""
    return f"{field.description}{more} (default: {default_text(name, field)})".replace("%", "%%")


def own_first(model: type[BaseModel]) -> tuple[str, ...]:
    """``model``'s settings, those it declares first, then each base's, nearest first: the
    settings particular to a worker lead its ``--help`` (the README's table is ordered
    by settings_table.py's own ``LAYERS``)."""
    declared = (vars(cls).get("__annotations__", {}) for cls in model.__mro__)
    return tuple(dict.fromkeys(n for names in declared for n in names if n in model.model_fields))


def add_setting_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    names: Iterable[str],
    forms: Mapping[str, tuple[str, dict[str, Any]]] | None = None,
) -> None:
    """A flag for each setting in ``names``; ``forms`` spells one otherwise: its option
    string and argparse keywords (``--exit-code N=ACTION``, repeatable)."""
    for name in names:
        field = model.model_fields[name]
        kind = value_type(field)
        option, keywords = (forms or {}).get(name, ("--" + name.replace("_", "-"), {}))
        if kind is bool and field.get_default() is True:  # on by default: a flag turns it off
            option = "--no-" + name.replace("_", "-")
            keywords = {"action": "store_false", **keywords}
        elif kind is bool:
            keywords = {"action": "store_true", **keywords}
        elif get_origin(kind) is Literal:
            keywords = {"choices": get_args(kind), **keywords}
        elif kind in (int, float):
            keywords = {"type": kind, **keywords}
        repeatable = keywords.get("action") == "append"
        # a --no- flag says what it turns off, not what it does (it read backwards)
        off = "turn off: " if keywords.get("action") == "store_false" else ""
        parser.add_argument(
            option,
            dest=name,
            default=None,
            help=off + flag_help(name, field, repeatable),
            **keywords,
        )


def setting_flags(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The values of the flags ``add_setting_flags`` made (None where left out)."""
    return {name: getattr(args, name) for name in names}
