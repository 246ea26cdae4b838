"""The Lua scripts, loaded from ``lua/*.lua`` and registered with redis-py in one place.

Each state change is one script (one atomic call, one round trip). ``lua/common.lua``
holds the helpers they share (key layout, server time, events, claim, retention) and is
put in front of every script here, so the scripts stay short and agree on one layout.
redis-py sends a script by its SHA1 and loads it on the first ``NOSCRIPT`` answer, so a
restarted Redis (empty script cache) is handled without any step of ours.
"""

from __future__ import annotations

from importlib import resources

from redis.commands.core import Script

from sandboxq.backends.redis.connection import Client

_LUA = resources.files("sandboxq.backends.redis") / "lua"


def source(name: str) -> str:
    """The full text sent to Redis for script ``name``: common helpers + the script."""
    common = (_LUA / "common.lua").read_text(encoding="utf-8")
    own = (_LUA / f"{name}.lua").read_text(encoding="utf-8")
    return f"{common}\n-- ---- {name}.lua ----\n{own}"


class Scripts:
    """One registered ``Script`` per state change. A script can run on any client of the
    same server (``script(keys, args, client=...)``), e.g. renew on its own connection."""

    def __init__(self, client: Client) -> None:
        def load(name: str) -> Script:
            return client.register_script(source(name))

        self.enqueue = load("enqueue")
        self.claim = load("claim")
        self.renew = load("renew")
        self.finish = load("finish")
        self.fail_malformed = load("fail_malformed")
        self.progress = load("progress")
        self.recover_stalled = load("recover_stalled")
        self.cancel = load("cancel")
        self.retry_failed = load("retry_failed")
        self.purge = load("purge")
        self.until_due = load("until_due")
