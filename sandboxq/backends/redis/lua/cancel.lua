-- cancel.lua: cancel a job that has not finished, and tell its owner at once.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 job id, 6 cancel channel (PUBLISH target).
-- Returns: 1 cancelled, 0 unknown or already finished.
-- Upholds: design invariant 1 (the lease is revoked: owner and token cleared, so the owner's
-- renewals and acks are rejected and it fences itself); the PUBLISH ("<token> <id>", the
-- token empty when no lease was held) lets the owner kill that attempt's child within
-- milliseconds, and never a later attempt of the same job. A cancelled active job keeps
-- a fence (fence_owner, fence_token, fenced_until_ms = the old lease's expiry): a retry
-- cannot make it claimable until the owner confirms the child dead (confirm_dead.lua) or
-- that expiry passes. The cancelled attempt is recorded in the history.
-- Cancelled jobs are trimmed like failed ones.

local id = ARGV[5]
local key = PREFIX .. id
local f = hmget(key, 'state', 'owner', 'token', 'attempts')
if not f then return 0 end
local state = f[1]
if state ~= 'waiting' and state ~= 'delayed' and state ~= 'active' then return 0 end
local now = now_ms()
local err = string.format(CANCELLED_TEXT, state)
local token = ''
if state == 'active' then
  local expiry = redis.call('ZSCORE', ACTIVE, id)
  if f[3] then
    token = f[3]
    redis.call('HSET', key, 'fence_owner', f[2] or '', 'fence_token', token,
      'fenced_until_ms', int(tonumber(expiry) or now))
  end
  local record = {attempt = count_or(f[4], 0), outcome = 'cancelled', ended_ms = now,
    error = err}
  if f[2] then record.worker_id = f[2] end
  append_history(id, cjson.encode(record))
end
redis.call('ZREM', WAITING, id)
redis.call('ZREM', DELAYED, id)
redis.call('ZREM', ACTIVE, id)
redis.call('HDEL', key, 'owner', 'token')
redis.call('HSET', key, 'state', 'cancelled', 'finished_ms', int(now), 'outcome', 'cancelled',
  'error', err)
redis.call('ZADD', CANCELLED, int(now), id)
emit('cancelled', id, 'from', state)
trim_finished(CANCELLED, RETAIN_FAILED, now)
redis.call('PUBLISH', ARGV[6], token .. ' ' .. id)
return 1
