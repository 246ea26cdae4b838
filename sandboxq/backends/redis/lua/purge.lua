-- purge.lua: delete up to `limit` jobs of one (non-active) state, with their history.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 state (waiting, delayed, completed, failed, cancelled), 6 limit,
--       7 offset: how many jobs earlier calls of this purge kept (they stay first in line).
-- Returns: {deleted, kept}: jobs this call deleted, and fenced jobs it left in place (the
--          caller repeats, past the kept ones, while a call looks at `limit` jobs).
-- Upholds: active jobs are never purged (their owner still holds a lease on them); and
-- design invariant 12 across a hand-over: a job cancelled while running keeps its fence
-- (cancel.lua) until its old owner confirms the child dead or the old lease runs out, so
-- its id cannot be enqueued afresh and run beside a child that may still live.

local sets = {waiting = WAITING, delayed = DELAYED, completed = COMPLETED, failed = FAILED,
  cancelled = CANCELLED}
local zset = sets[ARGV[5]]
if not zset then return redis.error_reply('cannot purge state ' .. ARGV[5]) end
local offset, limit = tonumber(ARGV[7]), tonumber(ARGV[6])
local ids = redis.call('ZRANGE', zset, offset, offset + limit - 1)
if #ids == 0 then return {0, 0} end
local now = now_ms()
local dropped = {}
for _, id in ipairs(ids) do
  local f = hmget(PREFIX .. id, 'fence_token', 'fenced_until_ms', 'batch')
  local until_ms = f and tonumber(f[2])
  -- fenced up to and including fenced_until_ms (rules.fence_lifted: strictly after);
  -- a member of a batch stays while its batch is kept (design invariant 14)
  if not (f and f[1] and until_ms and not (until_ms < now)) and not (f and f[3]) then
    drop_job(id)
    emit('purged', id) -- its waiters wake and find it gone (JobNotFound), not at their timeout
    dropped[#dropped + 1] = id
  end
end
if #dropped > 0 then
  redis.call('ZREM', zset, unpack(dropped))
  redis.call('ZREM', EXPIRY, unpack(dropped)) -- retention's entries (common.lua)
end
return {#dropped, #ids - #dropped}
