"""The Lua scripts, loaded from ``lua/*.lua`` and called with their keys bound once.

Each state change is one script (one atomic call, one round trip). In front of every
script go the constants and texts of ``backends.rules`` (as Lua locals, so the memory
backend and the scripts read one definition), then ``lua/common.lua``, the helpers they
share (key layout, server time, events, claim, retention), so the scripts stay short and
agree on one layout.

A call is ``EVALSHA sha 11 <the queue's keys> <ARGV 1-4: retention settings> <args...>``.
Everything before ``<args...>`` is the same on every call of one backend, so it is packed
into RESP bytes once (``Script.head``); a call packs only its own arguments. A script the
server does not know (a restarted Redis, an empty script cache) is loaded on the
``NOSCRIPT`` answer and the call is sent again: nothing ran the first time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from sandboxq.backends import rules
from sandboxq.backends.redis.lane import Lane

_LUA = resources.files("sandboxq.backends.redis") / "lua"

Arg = bytes | str | int | float  # one script argument


def source(name: str) -> str:
    """The full text sent to Redis for script ``name``: the constants shared with the
    memory backend (rules.py), the common helpers, then the script."""
    common = (_LUA / "common.lua").read_text(encoding="utf-8")
    own = (_LUA / f"{name}.lua").read_text(encoding="utf-8")
    return f"{rules.lua_constants()}{common}\n-- ---- {name}.lua ----\n{own}"


def _bulk(value: Arg) -> bytes:
    """One RESP bulk string (what redis-py's packer makes of the same value)."""
    if type(value) is str:
        data = value.encode()
    elif type(value) is int:
        data = b"%d" % value
    elif isinstance(value, bytes):
        data = value
    else:
        data = repr(value).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


class Script:
    """One script with this backend's keys and settings bound: ``script.pack(args)`` is a
    ready-to-send command, ``script(args)`` a round trip."""

    def __init__(self, name: str, keys: Sequence[str], settings: Sequence[Arg], lane: Lane | None):
        self.name = name
        self.source = source(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()
        fixed: list[Arg] = ["EVALSHA", self.sha, len(keys), *keys, *settings]
        self._fixed = len(fixed)
        self.head = b"".join(_bulk(arg) for arg in fixed)
        self._lane = lane

    def pack(self, args: Sequence[Arg]) -> bytes:
        parts = [b"*%d\r\n" % (self._fixed + len(args)), self.head]
        # _bulk inlined for the common types: this runs for every argument of every call
        for arg in args:
            if isinstance(arg, str):
                data = arg.encode()
            elif isinstance(arg, bytes):
                data = arg
            else:
                parts.append(_bulk(arg))
                continue
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
        return b"".join(parts)

    def __call__(self, args: Sequence[Arg], lane: Lane | None = None) -> Any:
        lane = lane or self._lane
        assert lane is not None, "scripts bound without a lane are sent by their caller"
        return run(lane, [(self, self.pack(args))])[0]


def pack_command(*args: Arg) -> bytes:
    """A plain command packed for ``run`` (with ``None`` as its script)."""
    return b"*%d\r\n%s" % (len(args), b"".join(_bulk(arg) for arg in args))


def run(lane: Lane, calls: Sequence[tuple[Script | None, bytes]]) -> list[Any]:
    """Send packed commands in one round trip; their replies, in order. Script calls
    answered ``NOSCRIPT`` are loaded and sent again; any other error reply is raised."""
    replies = lane.round_trip([packed for _, packed in calls])
    missing, loads = unknown_scripts(calls, replies)
    if missing:
        lane.round_trip(loads)
        again = lane.round_trip([calls[i][1] for i in missing])
        for i, reply in zip(missing, again, strict=True):
            replies[i] = reply
    return raise_errors(replies)


def unknown_scripts(
    calls: Sequence[tuple[Script | None, bytes]], replies: Sequence[Any]
) -> tuple[list[int], list[bytes]]:
    """The calls answered ``NOSCRIPT``, and the ``SCRIPT LOAD`` commands to send first."""
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    load = {s.name: s for i in missing if (s := calls[i][0]) is not None}
    return missing, [pack_command("SCRIPT", "LOAD", script.source) for script in load.values()]


def raise_errors(replies: list[Any]) -> list[Any]:
    """``replies``, unless one is an error reply: then that is raised."""
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    return replies


def script_settings(retention: rules.Retention) -> list[Arg]:
    """ARGV 1-4 of every script (lua/common.lua)."""
    return [
        int(retention.max_events),
        int(retention.retain_completed),
        int(retention.retain_failed),
        f"{retention.completed_ttl_ms} {retention.failed_ttl_ms}",
    ]


class Scripts:
    """Every script of one queue, bound to its keys and settings."""

    def __init__(self, keys: Sequence[str], settings: Sequence[Arg], lane: Lane | None) -> None:
        def bind(name: str) -> Script:
            return Script(name, keys, settings, lane)

        self.enqueue = bind("enqueue")
        self.claim = bind("claim")
        self.renew = bind("renew")
        self.finish = bind("finish")
        self.fail_malformed = bind("fail_malformed")
        self.progress = bind("progress")
        self.recover_stalled = bind("recover_stalled")
        self.cancel = bind("cancel")
        self.retry_failed = bind("retry_failed")
        self.purge = bind("purge")
        self.release = bind("release")
        self.confirm_dead = bind("confirm_dead")
        self.batch_enqueue = bind("batch_enqueue")
        self.batch_each = bind("batch_each")
        self.batch_forget = bind("batch_forget")
        self.depth = bind("depth")
        # Readers (read-only): bounded reads of one job for Job.info and Job.result.
        self.read_job = bind("read_job")
        self.read_result = bind("read_result")
        self.read_state = bind("read_state")
