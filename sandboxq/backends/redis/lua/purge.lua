-- purge.lua: delete up to `limit` jobs of one (non-active) state, with their history.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 state (waiting, delayed, completed, failed, cancelled), 6 limit.
-- Returns: how many jobs this call deleted (the caller repeats while it gets `limit`).
-- Upholds: active jobs are never purged (their owner still holds a lease on them).

local sets = {waiting = WAITING, delayed = DELAYED, completed = COMPLETED, failed = FAILED,
  cancelled = CANCELLED}
local zset = sets[ARGV[5]]
if not zset then return redis.error_reply('cannot purge state ' .. ARGV[5]) end
local ids = redis.call('ZRANGE', zset, 0, tonumber(ARGV[6]) - 1)
if #ids == 0 then return 0 end
for _, id in ipairs(ids) do drop_job(id) end
redis.call('ZREM', zset, unpack(ids))
return #ids
