-- read_result.lua: a completed job's encoded result for a reader, bounded in size.
-- KEYS: the standard list (common.lua); uses the job prefix.
-- ARGV: 1-4 standard; 5 job id; 6 the most bytes of a result a reader takes in.
-- Returns: {state (false if none), size of the result, the result (false if the job is
--           not completed, has none, or it is over the cap), its codec (false if absent:
--           json; its size when over CODEC_CAP)}; {false, 0, false, false} when the job key
--           is not a hash.
-- Upholds: design invariant 13 (readers trust nothing in Redis): a result made huge by hand is
-- never sent to a reader, which reports its size and the cap instead.

local CODEC_CAP = 64 -- a codec's name is a few bytes

local key = PREFIX .. ARGV[5]
if redis.call('TYPE', key)['ok'] ~= 'hash' then
  return {false, 0, false, false}
end
local state = redis.call('HGET', key, 'state')
local size = redis.call('HSTRLEN', key, 'result')
local codec = redis.call('HSTRLEN', key, 'codec')
if codec <= CODEC_CAP then codec = redis.call('HGET', key, 'codec') end
if state ~= 'completed' or size == 0 or size > tonumber(ARGV[6]) then
  return {state, size, false, codec}
end
return {state, size, redis.call('HGET', key, 'result'), codec}
