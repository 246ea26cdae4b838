"""The Lua scripts, loaded from ``lua/*.lua`` as one Redis function library, and called
with their keys bound once.

Each state change is one script (one atomic call, one round trip). The library holds the
constants and texts of ``backends.rules`` (as Lua locals, so the memory backend and the
scripts read one definition), then ``lua/common.lua``, the helpers they share (key layout,
server time, events, claim, retention), then each script as one registered function, so
the scripts stay short and agree on one layout. The library's top level runs once per
server, when it is loaded, so the helpers are not defined anew on every call, as they are
when each script carries them (EVALSHA: 12 us more server CPU per call, a tenth of a job's
whole life; redis_cost_bench).

    lua/*.lua ── library() ──► "#!lua name=sandboxq_<digest>"      FUNCTION LOAD, once
    Script("finish", keys, settings).pack(args)
        functions:  FCALL   sq_<digest>_finish 11 <keys> <index, retention> <args...>
        fallback:   EVALSHA <sha of the script alone> 11 <the same>     (SCRIPT LOAD, once)

The library's name and its functions' names carry a digest of its text, so workers of two
versions on one server each call their own. Everything before ``<args...>`` is the same on
every call of one backend, so it is packed into RESP bytes once (a head per way of
calling); a call packs only its own arguments.

Refused calls ran nothing, so they are sent again once their cause is settled (``settle``):
``Function not found`` (a restarted Redis without persistence, a flushed one) loads the
library; ``NOSCRIPT`` loads the script. A user whom the server's ACL does not let load the
library (``function|load``) or call it (``fcall``), and a server without functions, run
the scripts with EVALSHA from then on. A function runs with its caller's rights, so
whoever may load one may replace ours and act as every queue's worker: the README's
per-queue users are not given that right. EVALSHA names a script by the digest of its
text, which no one can replace.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Generator, Sequence
from importlib import resources
from typing import Any

from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from sandboxq.backends import rules
from sandboxq.backends.redis.lane import Lane

_LUA = resources.files("sandboxq.backends.redis") / "lua"

#: Every lua/<name>.lua but these is a script of the library: common.lua is what they
#: share; stats.lua and index_sizes.lua read many queues' keys at once (a library's
#: functions may not read across slots), sent with EVAL by stats.py.
NOT_SCRIPTS = ("common", "index_sizes", "stats")
NAMES = tuple(
    sorted(
        entry.name.removesuffix(".lua")
        for entry in _LUA.iterdir()
        if entry.name.endswith(".lua") and entry.name.removesuffix(".lua") not in NOT_SCRIPTS
    )
)

#: The reply of a call to a function the server does not hold (redis-py drops the "ERR ").
NOT_LOADED = "Function not found"

Arg = bytes | str | int | float  # one script argument
Calls = Sequence[tuple["Script | None", bytes]]  # packed commands; None: not a script's


def _read(name: str) -> str:
    return (_LUA / f"{name}.lua").read_text(encoding="utf-8")


#: Scripts that change none of the queue's keys: they read, or write only their own
#: record (a job's child pids, the depth history). Every other script first checks the
#: queue's keys (common.lua's guard_queue_keys), so a damaged one stops it before it
#: writes anything.
UNGUARDED = (
    "batch_read",
    "child_pids",
    "depth",
    "page",
    "read_job",
    "read_outcome",
    "read_result",
    "read_state",
    "summary",
)


def _entry(name: str) -> str:
    """Script ``name`` as a function of the call's keys and arguments (the same text in the
    library and in the EVALSHA fallback)."""
    guard = "" if name in UNGUARDED else "guard_queue_keys()\n"
    body = f"-- ---- {name}.lua ----\n{_read(name)}"
    return f"function(keys, argv)\nbind(keys, argv)\n{guard}{body}\nend"


@functools.cache
def _prelude() -> str:
    return f"{rules.lua_constants()}{_read('common')}\n"


@functools.cache
def library() -> tuple[str, str]:
    """The library's digest (in its name and every function's) and its full text."""
    entries = {name: _entry(name) for name in NAMES}
    digest = hashlib.sha1("\n".join([_prelude(), *entries.values()]).encode()).hexdigest()
    digest = digest[:16]
    functions = [
        f"redis.register_function('{function_name(digest, name)}', {entry})\n"
        for name, entry in entries.items()
    ]
    return digest, "".join([f"#!lua name=sandboxq_{digest}\n", _prelude(), *functions])


def function_name(digest: str, name: str) -> str:
    return f"sq_{digest}_{name}"


@functools.cache
def eval_source(name: str) -> str:
    """Script ``name`` as EVALSHA runs it: the prelude, then its entry called at once. KEYS
    and ARGV are kept first: common.lua's locals of those names hide them."""
    return (
        "local CALL_KEYS, CALL_ARGV = KEYS, ARGV\n"
        f"{_prelude()}return ({_entry(name)})(CALL_KEYS, CALL_ARGV)\n"
    )


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


class Library:
    """How one backend's scripts reach its server: as the library's functions until the
    server refuses them for good (its ACL denies this user loading or calling them, or it
    has no functions), then with EVALSHA."""

    def __init__(self) -> None:
        self.functions = True


class Script:
    """One script with this backend's keys and settings bound: ``script.pack(args)`` is a
    ready-to-send command, ``script(args)`` a round trip."""

    def __init__(
        self,
        name: str,
        keys: Sequence[str],
        settings: Sequence[Arg],
        lane: Lane | None,
        library_use: Library,
    ):
        self.name = name
        self.function = function_name(library()[0], name)
        self.sha = hashlib.sha1(eval_source(name).encode()).hexdigest()
        bound: list[Arg] = [len(keys), *keys, *settings]
        self._fixed = 2 + len(bound)
        self._fcall_head = b"".join(_bulk(arg) for arg in ["FCALL", self.function, *bound])
        self._eval_head = b"".join(_bulk(arg) for arg in ["EVALSHA", self.sha, *bound])
        self._library = library_use
        self._lane = lane

    def pack(self, args: Sequence[Arg]) -> bytes:
        head = self._fcall_head if self._library.functions else self._eval_head
        parts = [b"*%d\r\n" % (self._fixed + len(args)), head]
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

    def repack(self, packed: bytes) -> bytes:
        """``packed`` (made by ``pack``) as the library's way of calling now says."""
        if self._library.functions:
            return packed
        return packed.replace(self._fcall_head, self._eval_head, 1)

    def __call__(self, args: Sequence[Arg], lane: Lane | None = None) -> Any:
        lane = lane or self._lane
        assert lane is not None, "scripts bound without a lane are sent by their caller"
        return run(lane, [(self, self.pack(args))])[0]


def pack_command(*args: Arg) -> bytes:
    """A plain command packed for ``run`` (with ``None`` as its script)."""
    return b"*%d\r\n%s" % (len(args), b"".join(_bulk(arg) for arg in args))


#: What ``settle`` sends: each round trip's commands, answered with their replies.
Settling = Generator[list[bytes], list[Any], list[Any]]


def settle(calls: Calls, replies: list[Any]) -> Settling:
    """``replies`` to ``calls`` with every script call the server refused for want of the
    library or the script sent again once that is settled: a generator that yields the
    commands of each further round trip (none if nothing was refused), is sent their
    replies, and returns the replies to ``calls``. Any other error reply is left in place."""
    refused = [i for i, reply in enumerate(replies) if _refused(calls[i][0], reply)]
    if not refused:
        return replies
    scripts = [script for i in refused if (script := calls[i][0]) is not None]
    library_use = scripts[0]._library
    if library_use.functions:
        if any(_no_functions(replies[i]) for i in refused):
            library_use.functions = False  # this user, or this server, cannot call them
        else:
            (loaded,) = yield [pack_command("FUNCTION", "LOAD", "REPLACE", library()[1])]
            if _no_functions(loaded):
                library_use.functions = False  # nor load the library (function|load)
            elif isinstance(loaded, ResponseError):
                raise loaded
    loads = []
    if not library_use.functions:
        names = dict.fromkeys(script.name for script in scripts)
        loads = [pack_command("SCRIPT", "LOAD", eval_source(name)) for name in names]
    again = yield [
        *loads,
        *(script.repack(calls[i][1]) for i, script in zip(refused, scripts, strict=True)),
    ]
    for i, reply in zip(refused, again[len(loads) :], strict=True):
        replies[i] = reply
    return replies


def _refused(script: Script | None, reply: Any) -> bool:
    """Whether ``reply`` says the server did not run ``script``'s call for want of the
    library or the script, or of functions (a call packed before its backend's way of
    calling changed can come back with either)."""
    if script is None or not isinstance(reply, ResponseError):
        return False
    return isinstance(reply, NoScriptError) or str(reply) == NOT_LOADED or _no_functions(reply)


def _no_functions(reply: Any) -> bool:
    """Whether ``reply`` refuses a function command for good: the server's ACL denies this
    user ``fcall`` or ``function|load``, or the server has no such command (one older than
    Redis 7, or one that renamed it away)."""
    if isinstance(reply, NoPermissionError):
        return "'fcall'" in str(reply) or "'function|load'" in str(reply)
    return isinstance(reply, ResponseError) and str(reply).lower().startswith(
        ("unknown command 'fcall'", "unknown command 'function'")
    )


def send(lane: Lane, calls: Calls) -> list[Any]:
    """Send packed commands in one round trip; their replies, in order, error replies in
    place. Calls refused for want of the library or a script are sent again once it is
    loaded (``settle``)."""
    settling = settle(calls, lane.round_trip([packed for _, packed in calls]))
    try:
        trip = next(settling)
        while True:
            trip = settling.send(lane.round_trip(trip))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def run(lane: Lane, calls: Calls) -> list[Any]:
    """``send``, raising the first error reply."""
    return raise_errors(send(lane, calls))


def raise_errors(replies: list[Any]) -> list[Any]:
    """``replies``, unless one is an error reply: then that is raised."""
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    return replies


def script_settings(retention: rules.Retention, index: str) -> list[Arg]:
    """ARGV 0-4 of every script (lua/common.lua): the queue index, which bind takes off
    (not a KEYS entry: see common.lua), then the retention settings."""
    return [
        index,
        int(retention.max_events),
        int(retention.retain_completed),
        int(retention.retain_failed),
        f"{retention.completed_ttl_ms} {retention.failed_ttl_ms}",
    ]


class Scripts:
    """Every script of one queue, bound to its keys and settings."""

    def __init__(self, keys: Sequence[str], settings: Sequence[Arg], lane: Lane | None) -> None:
        self.library = Library()

        def bind(name: str) -> Script:
            return Script(name, keys, settings, lane, self.library)

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
        self.batch_read = bind("batch_read")
        self.depth = bind("depth")
        self.child_pids = bind("child_pids")
        # Readers (read-only): bounded reads of one job for Job.info and Job.result, and
        # where it stands (outcomes).
        self.read_job = bind("read_job")
        self.read_result = bind("read_result")
        self.read_outcome = bind("read_outcome")
        self.read_state = bind("read_state")
