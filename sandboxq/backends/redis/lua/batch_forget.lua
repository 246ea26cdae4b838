-- batch_forget.lua: delete a batch and its members, a chunk of members per call.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 batch id, 6 members deleted per call (rules.BATCH_CHUNK).
-- Returns: {code, ms, now}: code 1 the batch is gone, 0 more to delete (call again), -1 no
--          such batch, -2 refused: a member is still waiting, delayed or active (cancel it
--          first), -3 a member cancelled while running is still fenced until ms (server
--          clock, as now): its child may live; call again (what came before it is gone).
-- Upholds: design invariant 14: a batch's members go only with their batch, and only once
-- none of them can still run; design invariant 12: a fenced member's id stays taken.

local bid = ARGV[5]
local f = redis.call('HMGET', BATCH .. bid, 'waiting', 'delayed', 'active', 'total')
if not f[4] then return {-1, 0, 0} end
if count_or(f[1], 0) + count_or(f[2], 0) + count_or(f[3], 0) > 0 then return {-2, 0, 0} end
local now = now_ms()
local code, until_ms = sweep_batch(bid, tonumber(ARGV[6]), now)
return {code, int(until_ms or 0), int(now)}
