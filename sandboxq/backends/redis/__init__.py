"""The Redis backend: one Lua script per state change, server time for every lease.

See ``keys.py`` for the key layout and ``lua/common.lua`` for what the scripts share.
"""

from sandboxq.backends.redis.backend import RedisBackend

__all__ = ["RedisBackend"]
