"""What a redis-server says it ran, read from its own counters (INFO commandstats)."""

from __future__ import annotations

from typing import Any

#: The commands the scripts run as: functions (FCALL), or EVALSHA for a user the server's
#: ACL does not let call functions (backends/redis/scripts.py).
SCRIPT_COMMANDS = ("fcall", "evalsha")


def script_calls(raw: Any) -> int:
    """Script calls the server has run since its counters were last reset."""
    stats = raw.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in SCRIPT_COMMANDS)


def libraries(raw: Any) -> dict[str, str]:
    """The server's function libraries: name -> code."""
    out = {}
    for entry in raw.function_list(withcode=True):
        fields = dict(zip(entry[::2], entry[1::2], strict=True))
        out[fields[b"library_name"].decode()] = fields[b"library_code"].decode()
    return out
