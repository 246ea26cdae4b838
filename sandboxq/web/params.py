"""The dashboard's query parameters, checked where they enter: each bad one is a
``ConfigError`` naming the parameter and what was wrong, which the app answers with 400
and that one line (app.py), never a 500.

    request.query_params ──► queue_param / job_param / since_param / flag_param /
                             cursor_param ──► typed values the endpoints trust

Why each check: ``str.isdigit()`` is true for ``²`` (which ``int`` refuses), a
5,000-digit number is over Python's int-parsing limit, and any name typed into a URL
opens a backend (state.py), so names are checked before anything is opened or read.
"""

from __future__ import annotations

from starlette.datastructures import QueryParams

from sandboxq.errors import ConfigError
from sandboxq.models import check_batch_id, check_job_id, check_queue_name

#: A stream position is a count of messages: 20 digits is more than any hub reaches.
MAX_SINCE_DIGITS = 20
#: A page cursor is ``<score>:<ties>`` (Redis) or a short JSON pair (memory://).
MAX_CURSOR_CHARS = 200


def _shown(value: str) -> str:
    """``value`` as an error shows it: clipped, non-ASCII escaped."""
    clipped = value if len(value) <= 40 else value[:40] + f"... ({len(value)} characters)"
    return repr(clipped.encode("ascii", "backslashreplace").decode())


def queue_param(params: QueryParams, key: str, *, required: bool = True) -> str | None:
    """The queue named by ``key`` (None when absent and not ``required``)."""
    value = params.get(key)
    if not value:
        if required:
            raise ConfigError(f"parameter {key!r} (a queue name) is missing")
        return None
    try:
        return check_queue_name(value)
    except ConfigError:
        raise ConfigError(
            f"parameter {key!r}: {_shown(value)} is not a queue name (1-200 letters, digits, "
            "'_', '-', '.' or ':')"
        ) from None


def job_param(params: QueryParams, key: str, *, required: bool = True) -> str | None:
    value = params.get(key)
    if not value:
        if required:
            raise ConfigError(f"parameter {key!r} (a job id) is missing")
        return None
    try:
        return check_job_id(value)
    except ConfigError as exc:
        raise ConfigError(f"parameter {key!r}: {_shown(value)} is not a job id ({exc})") from None


def batch_param(params: QueryParams, key: str) -> str:
    value = params.get(key, "")
    try:
        return check_batch_id(value)
    except ConfigError:
        raise ConfigError(f"parameter {key!r}: {_shown(value)} is not a batch id") from None


def since_param(value: str | None, what: str) -> int | None:
    """A stream position (``since`` or ``Last-Event-ID``): ASCII digits only."""
    if not value:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= MAX_SINCE_DIGITS):
        raise ConfigError(
            f"{what}: {_shown(value)} is not a stream position (up to {MAX_SINCE_DIGITS} "
            "digits 0-9)"
        )
    return int(value)


def flag_param(params: QueryParams, key: str) -> bool:
    value = params.get(key, "")
    if value not in ("", "0", "1"):
        raise ConfigError(f"parameter {key!r}: {_shown(value)} is not 0 or 1")
    return value == "1"


def cursor_param(params: QueryParams, key: str) -> str | None:
    value = params.get(key) or None
    if value is not None and (
        len(value) > MAX_CURSOR_CHARS or not value.isascii() or not value.isprintable()
    ):
        raise ConfigError(f"parameter {key!r}: {_shown(value)} is not a page cursor")
    return value
