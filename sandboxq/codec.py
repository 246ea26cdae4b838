"""Payload encoding for job arguments and results.

JSON is the default because job payloads live in a shared Redis: unpickling a payload
someone else wrote is remote code execution. ``pickle`` is an explicit opt-in for
deployments where every writer is trusted (and it is what the standalone ``Pool`` uses,
since its payloads never leave the parent and its children).

A call is encoded as ``[args, kwargs]``. Every encode checks ``max_bytes`` so an
oversized payload fails the one job that produced it.

JSON carries exactly dict (str keys), list, str, int, float (finite), bool and None.
Tuples arrive as lists. Anything else is refused with an error naming where it sits
(``args[1]['size']``): Python's ``json`` would quietly turn a dict key ``1`` into ``"1"``
(and ``{1: a, "1": b}`` into two equal keys, one of them lost), so non-string keys are
refused too, and a value that does arrive is the value that was sent.

Reading what is stored (design invariant 13): a record in a shared Redis says which codec its
payload uses, and anyone who can write to that Redis can say "pickle". So a reader never
takes the record's word for it: ``decode_stored`` is the one path every reader of stored
payloads goes through (``Job.result`` and the asyncio ``AsyncJob.result``, ``sandboxq job``
and ``enqueue --wait`` through ``client.py``; ``sandboxq run``'s results; the dashboard).
It decodes only with a codec the reader opted into (``reader_codecs``), refuses anything
else with ``CodecRefused`` before a byte is decoded, and refuses payloads over the size
cap the same way.
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Collection, Iterator
from typing import Any, Literal

from sandboxq.errors import CodecRefused, SerializationError

CodecName = Literal["json", "pickle"]
CODECS: tuple[CodecName, ...] = ("json", "pickle")

#: Default cap on one encoded payload (arguments or result).
DEFAULT_MAX_BYTES = 16 * 1024 * 1024

_json_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def check_codec(codec: str) -> CodecName:
    if codec not in CODECS:
        raise SerializationError(f"unknown codec {codec!r}; expected one of {CODECS}")
    return codec


def reader_codecs(codec: str = "json", *, allow_pickle: bool = False) -> frozenset[CodecName]:
    """The codecs a reader decodes: always json; pickle only by the reader's own opt-in
    (its queue's ``codec="pickle"``, or ``allow_pickle=True``). What a record claims never
    widens this set."""
    chosen = check_codec(codec)
    if not isinstance(allow_pickle, bool):
        raise SerializationError(f"allow_pickle must be True or False, got {allow_pickle!r}")
    if chosen == "pickle" or allow_pickle:
        return frozenset(("json", "pickle"))
    return frozenset(("json",))


def decode_stored(
    data: bytes,
    claimed: str | bytes | None,
    *,
    allowed: Collection[str],
    job_id: str,
    what: str = "result",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Any:
    """Decode a payload read back from a backend; the one decoding path of every reader.

    ``claimed`` is the codec the stored record names. It must be one of ``allowed`` (the
    reader's own choice, see ``reader_codecs``), else ``CodecRefused`` naming the job and
    the claimed codec, and ``data`` is not touched. ``data`` over ``max_bytes`` is refused
    with the cap in the error. Anything that does not decode is a ``SerializationError``.
    """
    name = claimed.decode("utf-8", errors="replace") if isinstance(claimed, bytes) else claimed
    if name is None or name not in allowed or name not in CODECS:
        shown = "no codec" if name is None else f"codec {_short(name)}"
        hint = (
            "; a reader opts into pickle with Queue(codec='pickle') or allow_pickle=True "
            "(sandboxq --allow-pickle), and only if every writer to this backend is trusted"
            if name == "pickle"
            else ""
        )
        raise CodecRefused(
            f"job {job_id!r}: the {what} claims {shown}, which this reader does not decode "
            f"(it allows {', '.join(sorted(allowed)) or 'nothing'}){hint}; nothing was decoded",
            job_id=job_id,
            codec=None if name is None else name[:60],
        )
    if not isinstance(data, bytes | bytearray | memoryview):
        raise SerializationError(f"job {job_id!r}: the {what} is not bytes ({type(data).__name__})")
    if len(data) > max_bytes:
        raise SerializationError(
            f"job {job_id!r}: the {what} is {len(data)} bytes, over the read limit of "
            f"{max_bytes} bytes; nothing was decoded"
        )
    return decode(name, bytes(data), what=f"the {what} of job {job_id!r}")


def encode(codec: CodecName, value: Any, *, what: str, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Encode ``value``; ``what`` names it in errors ("result")."""
    return _encode(codec, value, what, ((what, value),), max_bytes)


def _encode(
    codec: CodecName,
    value: Any,
    what: str,
    parts: tuple[tuple[str, Any], ...],
    max_bytes: int,
) -> bytes:
    """Encode ``value``, made of the named ``parts`` (named in errors: "args", "kwargs")."""
    try:
        if codec == "json":
            data = _json_encoder.encode(value).encode()
            _check_keys(parts)
        else:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except (TypeError, ValueError, pickle.PicklingError, AttributeError, RecursionError) as exc:
        where = _json_problem(parts) if codec == "json" else None
        raise SerializationError(f"{what} cannot be encoded as {codec}: {where or exc}") from exc
    if len(data) > max_bytes:
        raise SerializationError(
            f"{what} encode to {len(data)} bytes, over the limit of {max_bytes} bytes"
        )
    return data


def decode(codec: CodecName, data: bytes, *, what: str) -> Any:
    """Decode ``data`` with ``codec``, trusted: readers of stored payloads call
    ``decode_stored`` instead, which checks the codec against the reader's choice first."""
    try:
        if codec == "json":
            return json.loads(data)
        return pickle.loads(data)
    except Exception as exc:
        raise SerializationError(f"{what} cannot be decoded as {codec}: {_clip(exc)}") from exc


def _clip(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def encode_call(
    codec: CodecName,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> bytes:
    args_list = list(args)
    parts = (("args", args_list), ("kwargs", kwargs))
    return _encode(codec, [args_list, kwargs], "arguments", parts, max_bytes)


def decode_call(codec: CodecName, data: bytes) -> tuple[list[Any], dict[str, Any]]:
    call = decode(codec, data, what="arguments")
    if (
        not isinstance(call, list | tuple)
        or len(call) != 2
        or not isinstance(call[0], list | tuple)
        or not isinstance(call[1], dict)
    ):
        raise SerializationError("arguments are not an [args, kwargs] pair")
    return list(call[0]), call[1]


# -- what JSON cannot carry, and where ------------------------------------------------------

_SCALARS = frozenset({str, int, float, bool, type(None)})  # exact types: the fast path
_CONTAINERS = (dict, list, tuple)
_JSON_TYPES = "dict, list, str, int, float, bool and None"
#: Deeper than this, the JSON encoder has already failed with a RecursionError.
_MAX_DEPTH = 500


def _check_keys(parts: tuple[tuple[str, Any], ...]) -> None:
    """Raise ``TypeError`` if a dict anywhere in ``parts`` has a key that is not a str.

    Runs after a successful encode (so there is no cycle), on every JSON payload: it is a
    plain walk, cheaper than the encode itself, and only ``_json_problem`` builds paths.
    """
    stack = [value for _, value in parts]
    while stack:
        value = stack.pop()
        if type(value) in _SCALARS:
            continue
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, str):
                    raise TypeError("a dict key is not a string")
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)


def _json_problem(parts: tuple[tuple[str, Any], ...]) -> str | None:
    """Where the first value JSON cannot carry exactly sits, and what it is."""
    for name, value in parts:
        for path, problem in _problems(value, name, set(), 0):
            return f"{path} {problem}"
    return None


def _problems(value: Any, path: str, seen: set[int], depth: int) -> Iterator[tuple[str, str]]:
    if not isinstance(value, _CONTAINERS):
        if (problem := _scalar_problem(value)) is not None:
            yield path, problem
        return
    if id(value) in seen:
        yield path, "contains itself (a circular reference)"
        return
    if depth >= _MAX_DEPTH:
        yield path, f"is nested more than {_MAX_DEPTH} levels deep"
        return
    seen.add(id(value))
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                yield (
                    path,
                    f"has the key {_short(key)} ({type(key).__qualname__}): JSON object keys "
                    "must be strings",
                )
                return
            yield from _problems(item, f"{path}[{key!r}]", seen, depth + 1)
    else:
        for i, item in enumerate(value):
            yield from _problems(item, f"{path}[{i}]", seen, depth + 1)
    seen.discard(id(value))


def _scalar_problem(value: Any) -> str | None:
    """Why JSON cannot carry ``value`` (not a container) exactly, or None."""
    if value is None:
        return None
    if isinstance(value, int):  # bool and IntEnum are ints too
        try:
            str(value)
        except ValueError:  # over sys.get_int_max_str_digits()
            return f"is an integer of {value.bit_length()} bits, too long to write as text"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"is {value!r}: JSON has no NaN or infinity"
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            bad = value[exc.start : exc.end]
            return f"is a string holding {bad!r}, which UTF-8 cannot carry (a lone surrogate)"
        return None
    kind = type(value)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    return f"is {with_article(name)} ({_short(value)}): JSON carries only {_JSON_TYPES}"


def with_article(name: str) -> str:
    """A type's name with its article: "an object", "a set", "an int"."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:
        text = object.__repr__(value)
    return text if len(text) <= 60 else text[:57] + "..."
