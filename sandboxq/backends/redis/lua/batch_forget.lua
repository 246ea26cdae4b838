-- batch_forget.lua: delete a batch and its members, a chunk of members per call.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 batch id, 6 members deleted per call (rules.BATCH_CHUNK).
-- Returns: 1 the batch is gone, 0 more to delete (call again), -1 no such batch, -2
--          refused: a member is still waiting, delayed or active (cancel it first).
-- Upholds: design invariant 14: a batch's members go only with their batch, and only once
-- none of them can still run.

local bid = ARGV[5]
local f = redis.call('HMGET', BATCH .. bid, 'waiting', 'delayed', 'active', 'total')
if not f[4] then return -1 end
if count_or(f[1], 0) + count_or(f[2], 0) + count_or(f[3], 0) > 0 then return -2 end
return sweep_batch(bid, tonumber(ARGV[6]))
