-- read_result.lua: a completed job's encoded result for a reader, bounded in size.
-- KEYS: the standard list (common.lua); uses the job prefix.
-- ARGV: 1-4 standard; 5 job id; 6 the most bytes of a result a reader takes in.
-- Returns: {state (false if none), size of the result, the result (false if the job is
--           not completed, has none, or it is over the cap)}; {false, 0, false} when the
--           job key is not a hash.
-- Upholds: design invariant 13 (readers trust nothing in Redis): a result made huge by hand is
-- never sent to a reader, which reports its size and the cap instead.

local key = PREFIX .. ARGV[5]
if redis.call('TYPE', key)['ok'] ~= 'hash' then
  return {false, 0, false}
end
local state = redis.call('HGET', key, 'state')
local size = redis.call('HSTRLEN', key, 'result')
if state ~= 'completed' or size == 0 or size > tonumber(ARGV[6]) then
  return {state, size, false}
end
return {state, size, redis.call('HGET', key, 'result')}
