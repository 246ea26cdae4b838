-- read_state.lua: a job's state for a waiter (result(), wait_for_finish), bounded.
-- KEYS: the standard list (common.lua); uses the job prefix.
-- ARGV: 1-4 standard; 5 job id; 6 the longest state a reader takes in.
-- Returns: the state, or false when the job does not exist; an error naming the problem
--          when its key is not a hash, it has no state, or its state is over the cap.
-- Upholds: design invariant 13 (readers trust nothing in Redis): a waiter re-reads the state on
-- every event, so a state made huge by hand must cost it nothing but this error.

local key = PREFIX .. ARGV[5]
local kind = redis.call('TYPE', key)['ok']
if kind == 'none' then
  return false
end
if kind ~= 'hash' then
  return redis.error_reply('the job record ' .. key .. ' holds a ' .. kind .. ', not a hash')
end
local size = redis.call('HSTRLEN', key, 'state')
if size > tonumber(ARGV[6]) then
  return redis.error_reply('the state field of ' .. key .. ' is ' .. size ..
    ' bytes, over the read limit of ' .. ARGV[6] .. ' bytes')
end
local state = redis.call('HGET', key, 'state')
if not state then
  return redis.error_reply('the job record ' .. key .. ' has no state field')
end
return state
