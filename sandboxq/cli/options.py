"""What several verbs share: common flags, the URL check, the working directory on the
import path, and ``Exit`` (a failure the user caused or asked about, not a bug)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

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
    if not isinstance(value, expected):
        raise ConfigError(
            f"{flag} must be a JSON {json_type(expected)}, got {json_type(type(value))}; "
            f"e.g. {flag} '{example}'"
        )
    return value


def json_type(python_type: type) -> str:
    """What JSON calls a Python type, for error messages."""
    names = {list: "array", dict: "object", str: "string", bool: "boolean", type(None): "null"}
    return names.get(python_type, "number")
