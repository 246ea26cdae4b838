-- until_due.lua: how long until the earliest delayed job falls due, by the server's clock.
-- KEYS: the standard list (common.lua); uses delayed.
-- ARGV: 1-4 standard (unused).
-- Returns: milliseconds until the earliest delayed job is due (0: due now), or -1 when no
--          job is delayed.
-- Upholds: invariant 2 (due times are judged by the server's TIME, never a client's
-- clock). One script on the queue's slot also works on Redis Cluster, whose pipelines
-- refuse TIME (a command without a key has no node to go to).

local first = redis.call('ZRANGE', DELAYED, 0, 0, 'WITHSCORES')
if #first == 0 then return -1 end
local left = tonumber(first[2]) - now_ms()
if left < 0 then return 0 end
return math.floor(left)
