"""Payload encoding for job arguments and results.

JSON is the default because job payloads live in a shared Redis: unpickling a payload
someone else wrote is remote code execution. ``pickle`` is an explicit opt-in for
deployments where every writer is trusted (and it is what the standalone ``Pool`` uses,
since its payloads never leave the parent and its children).

A call is encoded as ``[args, kwargs]``. Every encode checks ``max_bytes`` so an
oversized payload fails the one job that produced it.
"""

from __future__ import annotations

import json
import pickle
from typing import Any, Literal

from sandboxq.errors import SerializationError

CodecName = Literal["json", "pickle"]
CODECS: tuple[CodecName, ...] = ("json", "pickle")

#: Default cap on one encoded payload (arguments or result).
DEFAULT_MAX_BYTES = 16 * 1024 * 1024

_json_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def check_codec(codec: str) -> CodecName:
    if codec not in CODECS:
        raise SerializationError(f"unknown codec {codec!r}; expected one of {CODECS}")
    return codec


def encode(codec: CodecName, value: Any, *, what: str, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Encode ``value``; ``what`` names it in errors ("arguments", "result")."""
    try:
        if codec == "json":
            data = _json_encoder.encode(value).encode()
        else:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except (TypeError, ValueError, pickle.PicklingError, AttributeError, RecursionError) as exc:
        raise SerializationError(f"{what} cannot be encoded as {codec}: {exc}") from exc
    if len(data) > max_bytes:
        raise SerializationError(
            f"{what} encode to {len(data)} bytes, over the limit of {max_bytes} bytes"
        )
    return data


def decode(codec: CodecName, data: bytes, *, what: str) -> Any:
    try:
        if codec == "json":
            return json.loads(data)
        return pickle.loads(data)
    except Exception as exc:
        raise SerializationError(f"{what} cannot be decoded as {codec}: {exc}") from exc


def encode_call(
    codec: CodecName,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> bytes:
    return encode(codec, [list(args), kwargs], what="arguments", max_bytes=max_bytes)


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
