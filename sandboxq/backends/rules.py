"""The numbers and words both backends must agree on, defined once.

    rules.py ──► memory.py        imports them
             └─► redis/scripts.py  generates ``lua_constants()`` in front of every script

The model-based test (tests/test_backend_model.py) drives both backends with the same
calls and compares every answer: any rule that lived in two places drifted (the stall
failure text, ``<=`` against ``<`` at lease expiry, rounding seconds to milliseconds), so
each lives here and nowhere else.
"""

from __future__ import annotations

import json
import math

from sandboxq.models import MAX_PRIORITY

#: Attempt records kept per job.
HISTORY_CAP = 1000
#: A job's ``max_stalls`` when its record has none.
DEFAULT_MAX_STALLS = 1

#: The error of an attempt whose lease expired, when the job goes back to waiting
#: (``%d`` stalls so far, ``%d`` allowed) and when it fails for stalling too often.
STALL_RETRY_TEXT = (
    "lease expired (stall %d of at most %d): the worker holding it stopped renewing it"
)
STALL_FAIL_TEXT = "stalled %d times: the worker holding its lease stopped renewing it"
#: The error of a job cancelled while in state ``%s``.
CANCELLED_TEXT = "cancelled while %s"


def ms(seconds: float) -> int:
    """Seconds to whole milliseconds, rounded up (a delay never ends early)."""
    return max(0, math.ceil(seconds * 1000))


def lease_ms(seconds: float) -> int:
    """A lease's length in milliseconds: at least one."""
    return max(1, ms(seconds))


def lease_expired(expiry_ms: int, now_ms: int) -> bool:
    """A lease that expires at ``expiry_ms`` has run out at ``now_ms``: strictly after it
    (recover_stalled.lua's ``ZRANGEBYSCORE -inf (now``)."""
    return expiry_ms < now_ms


def fence_lifted(fenced_until_ms: int, now_ms: int) -> bool:
    """A fence lasts up to and including ``fenced_until_ms`` (the old lease's expiry), and
    lifts when the lease would have been recovered: the same boundary as ``lease_expired``."""
    return lease_expired(fenced_until_ms, now_ms)


def _lua(value: object) -> str:
    # JSON string escapes are valid Lua string escapes for the texts used here
    return json.dumps(value) if isinstance(value, str) else str(value)


def lua_constants() -> str:
    """The rules above as Lua locals, put in front of common.lua by scripts.py."""
    values = {
        "HISTORY_CAP": HISTORY_CAP,
        "MAX_PRIORITY": MAX_PRIORITY,
        "DEFAULT_MAX_STALLS": DEFAULT_MAX_STALLS,
        "STALL_RETRY_TEXT": STALL_RETRY_TEXT,
        "STALL_FAIL_TEXT": STALL_FAIL_TEXT,
        "CANCELLED_TEXT": CANCELLED_TEXT,
    }
    lines = ["-- generated from sandboxq/backends/rules.py: do not edit here"]
    lines += [f"local {name} = {_lua(value)}" for name, value in values.items()]
    return "\n".join(lines) + "\n"
