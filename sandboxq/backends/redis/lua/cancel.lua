-- cancel.lua: cancel a job that has not finished, and tell its owner at once.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 job id, 6 cancel channel (PUBLISH target).
-- Returns: 1 cancelled, 0 unknown or already finished.
-- Upholds: invariant 1 (the lease is revoked: owner and token cleared, so the owner's
-- renewals and acks are rejected and it fences itself); the PUBLISH lets the owner kill
-- the child within milliseconds. Cancelled jobs are trimmed like failed ones.

local id = ARGV[5]
local key = PREFIX .. id
local f = hmget(key, 'state')
if not f then return 0 end
local state = f[1]
if state ~= 'waiting' and state ~= 'delayed' and state ~= 'active' then return 0 end
local now = now_ms()
redis.call('ZREM', WAITING, id)
redis.call('ZREM', DELAYED, id)
redis.call('ZREM', ACTIVE, id)
redis.call('HDEL', key, 'owner', 'token')
redis.call('HSET', key, 'state', 'cancelled', 'finished_ms', int(now), 'outcome', 'cancelled',
  'error', 'cancelled while ' .. state)
redis.call('ZADD', CANCELLED, int(now), id)
emit('cancelled', id, 'from', state)
trim_finished(CANCELLED, RETAIN_FAILED, now)
redis.call('PUBLISH', ARGV[6], id)
return 1
